// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> for the clang C++-for-OpenCL compiles
// of tools/clcpp (the address-space check, tools/tensor_mix.py's instruction mix): Metal 4's
// tensor ops as the subset the CPU engine emulates (Sources/MSLEngine/msl/msl_tensor_ops.h;
// docs/tensor-ops.md), declared after Apple's documentation and the documented signatures of
// MPPTensorOpsMatMul2d.h in the macOS 26.2 SDK, not its text. Include after <metal_stdlib>.
//
// Declarations only, as in ../metal_stdlib: clang emits calls to matmul2d::run, the
// cooperative tensors' element accesses, load and store, so the instruction mix counts them. What
// is defined is what has to be a constant: the descriptor (C++17 has no class-type template
// parameters, so, as in the engine, a descriptor converts to a 64-bit code that matmul2d takes)
// and get_capacity(), so that loops over a tensor's elements keep a constant trip count.
#ifndef FA_CLCPP_METAL_PERFORMANCE_PRIMITIVES
#define FA_CLCPP_METAL_PERFORMANCE_PRIMITIVES

namespace metal {

// Extents of a rank-2 tensor: extent(0) innermost.
template <typename I, int Rank> struct dextents {
    dextents(I e0, I e1);
    I extent(int d) const;

  private:
    I e_[Rank];
};

struct tensor_inline {};

// A rank-2 view of memory (T carries the address space: tensor<device half, ...>).
template <typename T, typename Extents = dextents<int, 2>, typename Kind = tensor_inline> struct tensor {
    tensor(T *data, Extents e);
    template <typename A> tensor(T *data, Extents e, const A &strides);
    int get_extent(int d) const;
    int get_stride(int d) const;
    tensor slice(int x, int y) const;

  private:
    T *data_;
    Extents extents_;
    int strides_[2];
};

struct execution_simdgroup {};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
    enum class mode { multiply, multiply_accumulate };
    int m, n, k;
    bool transpose_left, transpose_right, relaxed_precision;
    mode matmul_mode;
    constexpr matmul2d_descriptor(int m_, int n_, int k_, bool transpose_left_ = false,
                                  bool transpose_right_ = false, bool relaxed_precision_ = false,
                                  mode mode_ = mode::multiply)
        : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
          relaxed_precision(relaxed_precision_), matmul_mode(mode_) {}
    // The engine's code: m, n, k in bits 0-47, the flags in bits 48-51 (tools/tensor_mix.py
    // reads it back from the instantiation's name).
    constexpr operator unsigned long long() const {
        return (unsigned long long)(m & 0xffff) | (unsigned long long)(n & 0xffff) << 16 |
               (unsigned long long)(k & 0xffff) << 32 | (unsigned long long)transpose_left << 48 |
               (unsigned long long)transpose_right << 49 |
               (unsigned long long)relaxed_precision << 50 |
               (unsigned long long)(matmul_mode == mode::multiply_accumulate) << 51;
    }
};

// One lane's share of a Rows x Cols operand: 16x16 fragments of 8 elements a lane.
template <typename T, uint Rows, uint Cols, bool Transposed> struct cooperative_tensor {
    static constexpr uint capacity = (Rows + 15) / 16 * ((Cols + 15) / 16) * 8;
    using element_type = T;

    static constexpr uint get_capacity() { return capacity; }
    T &operator[](uint i);
    const T &operator[](uint i) const;
    bool is_valid_element(uint i) const;
    metal::vec<int, 2> get_multidimensional_index(uint i) const;
    template <typename U, typename E, typename K> void load(const metal::tensor<U, E, K> &t);
    template <typename U, typename E, typename K> void store(const metal::tensor<U, E, K> &t) const;

  private:
    T elements_[capacity];
};

// destination (m x n) = left (m x k) * right (k x n) [+ destination], by one SIMD-group.
template <unsigned long long Code, typename Scope> struct matmul2d {
    static constexpr uint M = uint(Code & 0xffff), N = uint((Code >> 16) & 0xffff),
                          K = uint((Code >> 32) & 0xffff);

    template <typename L, typename R, typename D>
    cooperative_tensor<L, M, K, ((Code >> 48) & 1) != 0> get_left_input_cooperative_tensor() const;
    template <typename L, typename R, typename D>
    cooperative_tensor<R, K, N, ((Code >> 49) & 1) != 0> get_right_input_cooperative_tensor() const;
    template <typename LT, typename RT, typename D>
    cooperative_tensor<D, M, N, false> get_destination_cooperative_tensor() const;
    template <typename L, typename R, typename D>
    void run(const L &left, const R &right, D &destination) const;
};

}  // namespace tensor_ops
}  // namespace mpp

#endif
