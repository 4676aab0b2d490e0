// Metal 4 MetalPerformancePrimitives tensor ops (`mpp::tensor_ops::matmul2d` with cooperative
// tensors) for the CUDA check build: the CUDA half of the emulation whose CPU-engine half is
// Sources/MSLEngine/msl/msl_tensor_ops.h (issue 37; docs/tensor-ops.md). The same API subset,
// declared after Apple's documentation and the documented signatures of MPPTensorOpsMatMul2d.h in
// the macOS 26.2 SDK (not its text), and the same rules, so that a matmul2d gives bit-identical
// results in both (tests/cuda/tensor_ops_check.cu checks that against the engine's outputs):
// - Scope: run() needs all 32 lanes of the warp at one call site with one descriptor. The lanes
//   that arrived are counted per warp (__activemask(): no lane waits for another, so a missing
//   lane cannot hang the run); fewer than 32, or lanes whose call site or descriptor differ
//   (__match_all_sync), print the sites and trap. Lanes that the compiler left diverged before
//   a correct call would count as missing too: a loud false fault, never a silent one.
// - Layout: the engine's map, M5 (MLX's steel/gemm/nax.h fragment map) or permuted, chosen on
//   the host by fa_cuda::select_tensor_layout (FLASH_ATTENTION_TENSOR_LAYOUT's values) per
//   translation unit, read when a cooperative tensor is made.
// - Bounds: load() reads 0 past a tensor's extents, store() writes only inside them; an element
//   index at or past get_capacity() prints and traps.
// - Rounding: every lane gathers the dense left and right operands by warp shuffles, then each
//   of its destination elements starts from its value (multiply_accumulate) or 0 and adds
//   a[i][k] * b[k][j] for k = 0, 1, ... with one fmaf each, rounding once to the destination's
//   type; under relaxed_precision float operands are first truncated toward zero to 10 mantissa
//   bits. The engine's order exactly.
// execution_simdgroups<N>, reductions and iterators are not emulated (nor in the engine).
//
// metal_cuda.h includes this header before its MSL keyword macros; Metal source reaches it by
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (include/), a no-op by then.
#ifndef FA_METAL_TENSOR_OPS_H
#define FA_METAL_TENSOR_OPS_H

#ifndef FA_METAL_CUDA_H
#error "include metal_cuda.h, which includes metal_tensor_ops.h"
#endif

#include <stdlib.h>
#include <string.h>

namespace metal {

// Extents of a rank-2 tensor: extent(0) is the innermost dimension (columns of a row-major
// matrix), extent(1) the outer one (rows).
template <class I, int Rank> struct dextents {
    static_assert(Rank == 2, "the CUDA check build's tensor ops support rank-2 tensors");
    I e[2];
    __host__ __device__ dextents(I e0, I e1) : e{e0, e1} {}
    __host__ __device__ I extent(int d) const { return e[d]; }
};

// A fixed-size array (MSL's metal::array), as tensors take their strides: array<int32_t, 2>{1, s}.
template <class T, size_t N> struct array {
    T elements[N];
    __host__ __device__ T &operator[](size_t i) { return elements[i]; }
    __host__ __device__ const T &operator[](size_t i) const { return elements[i]; }
    __host__ __device__ static constexpr size_t size() { return N; }
};

// A tensor whose pointer, extents and strides live in the kernel (Metal's tensor_inline).
struct tensor_inline {};

// A rank-2 view of memory: element (x, y) at data[x * stride(0) + y * stride(1)]; strides
// default to (1, extent(0)), a row-major matrix of extent(1) rows.
template <class T, class Extents = dextents<int, 2>, class Kind = tensor_inline> struct tensor {
    T *data;
    Extents extents;
    int strides[2];

    __device__ tensor(T *data_, Extents e)
        : data(data_), extents(e), strides{1, int(e.extent(0))} {}
    template <class A>
    __device__ tensor(T *data_, Extents e, const A &s)
        : data(data_), extents(e), strides{int(s[0]), int(s[1])} {}
    __device__ int get_extent(int d) const { return int(extents.extent(d)); }
    __device__ int get_stride(int d) const { return strides[d]; }
    // The sub-view from (x, y) to the end (extents shrink, clamped at 0).
    __device__ tensor slice(int x, int y) const {
        const int e0 = get_extent(0) > x ? get_extent(0) - x : 0;
        const int e1 = get_extent(1) > y ? get_extent(1) - y : 0;
        tensor t(data + long(x) * strides[0] + long(y) * strides[1], Extents(e0, e1));
        t.strides[0] = strides[0];
        t.strides[1] = strides[1];
        return t;
    }
};

// Execution scope of a tensor operation: one SIMD-group (a 32-lane warp).
struct execution_simdgroup {};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

// The shape and options of a matmul2d: destination (m x n) = left (m x k) * right (k x n)
// [+ destination under multiply_accumulate]. As in the engine (C++17 has no class-type template
// parameters), a descriptor converts to a 64-bit code and matmul2d takes the code, so Metal
// source spells matmul2d<desc, execution_simdgroup> unchanged.
struct matmul2d_descriptor {
    enum class mode { multiply, multiply_accumulate };
    int m, n, k;
    bool transpose_left, transpose_right, relaxed_precision;
    mode matmul_mode;
    __host__ __device__ constexpr matmul2d_descriptor(int m_, int n_, int k_,
                                                      bool transpose_left_ = false,
                                                      bool transpose_right_ = false,
                                                      bool relaxed_precision_ = false,
                                                      mode mode_ = mode::multiply)
        : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
          relaxed_precision(relaxed_precision_), matmul_mode(mode_) {}
    __host__ __device__ constexpr operator unsigned long long() const {
        return (unsigned long long)(m & 0xffff) | (unsigned long long)(n & 0xffff) << 16 |
               (unsigned long long)(k & 0xffff) << 32 | (unsigned long long)transpose_left << 48 |
               (unsigned long long)transpose_right << 49 |
               (unsigned long long)relaxed_precision << 50 |
               (unsigned long long)(matmul_mode == mode::multiply_accumulate) << 51;
    }
    // The descriptor a code stands for.
    __host__ __device__ static constexpr matmul2d_descriptor decode(unsigned long long c) {
        return matmul2d_descriptor(int(c & 0xffff), int((c >> 16) & 0xffff),
                                   int((c >> 32) & 0xffff), ((c >> 48) & 1) != 0,
                                   ((c >> 49) & 1) != 0, ((c >> 50) & 1) != 0,
                                   ((c >> 51) & 1) != 0 ? mode::multiply_accumulate
                                                        : mode::multiply);
    }
};

namespace tensor_ops_detail {

constexpr uint32_t fragment = 16;
constexpr uint32_t per_fragment = fragment * fragment / 32;

enum class layout : unsigned char { m5, permuted };

template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };

// The layout this translation unit's cooperative tensors take (select_tensor_layout).
static __device__ layout selected_layout;

// (row, column) of element i of lane l in a tensor of `fragment_columns` fragments per row: the
// engine's map (msl_tensor_ops.h), M5 or permuted (lane (13 l + 7) mod 32's position, j reversed).
__host__ __device__ __forceinline__ void position(layout map, uint32_t l, uint32_t i,
                                                  uint32_t fragment_columns, uint32_t &row,
                                                  uint32_t &column) {
    uint32_t j = i % per_fragment;
    if (map == layout::permuted) {
        l = (13 * l + 7) & 31;
        j = per_fragment - 1 - j;
    }
    const uint32_t f = i / per_fragment, qid = l >> 2;
    const uint32_t fm = (qid & 4) | ((l >> 1) & 3), fn = 4 * ((qid & 2) | (l & 1));
    row = (f / fragment_columns) * fragment + fm + 8 * (j / 4);
    column = (f % fragment_columns) * fragment + fn + j % 4;
}

// Clears the low 13 of float's 23 mantissa bits: truncation toward zero to 10 bits.
__device__ __forceinline__ float truncate_to_10_bits(float x) {
    return __uint_as_float(__float_as_uint(x) & ~0x1fffu);
}

template <class T> __device__ __forceinline__ float operand(T v, bool relaxed) {
    return relaxed && sizeof(T) == 4 ? truncate_to_10_bits(float(v)) : float(v);
}

// An element index at or past get_capacity(): prints and traps (the launch fails).
static __device__ __noinline__ void past_capacity(uint32_t i, uint32_t capacity) {
    printf("cooperative_tensor element index %u past get_capacity() %u (lane %u)\n", i, capacity,
           metal::simd_detail::lane_id());
    __trap();
}

}  // namespace tensor_ops_detail

// One lane's share of a Rows x Cols operand of a matmul2d (its elements per the layout above).
// Made only by matmul2d's get_*_cooperative_tensor functions.
template <class T, uint32_t Rows, uint32_t Cols, bool Transposed> struct cooperative_tensor {
    static constexpr uint32_t fragment_columns =
        (Cols + tensor_ops_detail::fragment - 1) / tensor_ops_detail::fragment;
    static constexpr uint32_t capacity =
        (Rows + tensor_ops_detail::fragment - 1) / tensor_ops_detail::fragment * fragment_columns *
        tensor_ops_detail::per_fragment;
    using element_type = T;

    T elements[capacity];
    tensor_ops_detail::layout map;
    uint32_t lane;

    __device__ cooperative_tensor()
        : map(tensor_ops_detail::selected_layout), lane(metal::simd_detail::lane_id()) {
        for (uint32_t i = 0; i < capacity; ++i) elements[i] = T(0.0f);
    }

    // Number of element slots this lane has (some may be invalid: is_valid_element).
    __host__ __device__ static constexpr uint32_t get_capacity() { return capacity; }

    // Element i of this lane; i at or past get_capacity() traps.
    __device__ T &operator[](uint32_t i) {
        if (i >= capacity) tensor_ops_detail::past_capacity(i, capacity);
        return elements[i < capacity ? i : 0];
    }
    __device__ const T &operator[](uint32_t i) const {
        return const_cast<cooperative_tensor &>(*this)[i];
    }

    // Whether slot i holds an element of the Rows x Cols operand.
    __device__ bool is_valid_element(uint32_t i) const {
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        return i < capacity && r < Rows && c < Cols;
    }

    // (column, row) of slot i in the operand (dimension 0 innermost, as tensors index).
    __device__ metal::vec<int, 2> get_multidimensional_index(uint32_t i) const {
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        return metal::vec<int, 2>(int(c), int(r));
    }

    // Loads this lane's elements from `t` (the operand, or its transpose when the descriptor
    // transposes it); reads past t's extents give 0.
    template <class U, class E, class K> __device__ void load(const metal::tensor<U, E, K> &t) {
        for (uint32_t i = 0; i < capacity; ++i) {
            int x = 0, y = 0;
            elements[i] = address(i, t.get_extent(0), t.get_extent(1), x, y)
                              ? T(t.data[long(x) * t.strides[0] + long(y) * t.strides[1]])
                              : T(0.0f);
        }
    }

    // Stores this lane's elements into `t`; elements past t's extents are not written.
    template <class U, class E, class K>
    __device__ void store(const metal::tensor<U, E, K> &t) const {
        for (uint32_t i = 0; i < capacity; ++i) {
            int x = 0, y = 0;
            if (address(i, t.get_extent(0), t.get_extent(1), x, y))
                t.data[long(x) * t.strides[0] + long(y) * t.strides[1]] = U(elements[i]);
        }
    }

    __device__ void position_of(uint32_t i, uint32_t &r, uint32_t &c) const {
        tensor_ops_detail::position(map, lane, i, fragment_columns, r, c);
    }

  private:
    // The tensor coordinate (x, y) of valid slot i; false when invalid or outside the extents.
    __device__ bool address(uint32_t i, int e0, int e1, int &x, int &y) const {
        if (!is_valid_element(i)) return false;
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        x = int(Transposed ? r : c);
        y = int(Transposed ? c : r);
        return x < e0 && y < e1;
    }
};

namespace tensor_ops_detail {

// The scope check of run (file comment): traps unless all 32 lanes arrived together at one call
// site with one descriptor code. The lowest lane of each group that arrived prints the report.
static __device__ __noinline__ void check_scope(unsigned long long code, unsigned line,
                                                const char *file) {
    const unsigned arrived = __activemask();
    const unsigned lane = metal::simd_detail::lane_id();
    const bool first = lane == unsigned(__ffs(arrived) - 1);
    if (arrived != metal::simd_detail::kAllLanes) {
        if (first) {
            printf("mpp::tensor_ops::matmul2d::run at %s:%u: %d of the SIMD-group's 32 lanes "
                   "arrived (mask 0x%08x); lane %d did not (it returned, or is at another run call "
                   "or descriptor)\n",
                   file, line, __popc(arrived), arrived, __ffs(~arrived) - 1);
        }
        __trap();
    }
    int same_code = 0, same_line = 0, same_file = 0;
    __match_all_sync(arrived, code, &same_code);
    __match_all_sync(arrived, line, &same_line);
    __match_all_sync(arrived, (unsigned long long)file, &same_file);
    if (same_code && same_line && same_file) return;
    const unsigned with_lane0 = __match_any_sync(arrived, code ^ ((unsigned long long)line << 52) ^
                                                             (unsigned long long)file);
    const int other = __ffs(~with_lane0) - 1;  // a lane unlike lane 0 (lane 0 is in with_lane0)
    const char *other_file = (const char *)__shfl_sync(arrived, (unsigned long long)file, other);
    const unsigned other_line = __shfl_sync(arrived, line, other);
    const unsigned long long other_code = __shfl_sync(arrived, code, other);
    if (first) {
        printf("mpp::tensor_ops::matmul2d::run: the SIMD-group's lanes are at two run calls or "
               "descriptors: lane 0 at %s:%u (descriptor 0x%llx), lane %d at %s:%u (descriptor "
               "0x%llx)\n",
               file, line, code, other, other_file, other_line, other_code);
    }
    __trap();
}

// Every lane's copy of the dense Rows x Cols operand whose lanes hold `t`: lane src's slot i
// comes by one warp shuffle each.
template <uint32_t Rows, uint32_t Cols, class CT>
__device__ __forceinline__ void gather(const CT &t, float *m, bool relaxed) {
    for (uint32_t src = 0; src < 32; ++src) {
        for (uint32_t i = 0; i < CT::capacity; ++i) {
            const float v =
                __shfl_sync(metal::simd_detail::kAllLanes, operand(t.elements[i], relaxed), src);
            uint32_t r = 0, c = 0;
            position(t.map, src, i, CT::fragment_columns, r, c);
            if (r < Rows && c < Cols) m[r * Cols + c] = v;
        }
    }
}

template <class T> struct remove_cvref { using type = T; };
template <class T> struct remove_cvref<const T> { using type = T; };
template <class T> struct remove_cvref<T &> { using type = typename remove_cvref<T>::type; };
template <class T> struct remove_cvref<T &&> { using type = typename remove_cvref<T>::type; };
template <class T> using remove_cvref_t = typename remove_cvref<T>::type;

// A cooperative-tensor operand as it is; a tensor operand loaded into one of its element type.
template <uint32_t Rows, uint32_t Cols, bool Transposed, class T>
__device__ T &as_cooperative(T &t) { return t; }
template <uint32_t Rows, uint32_t Cols, bool Transposed, class U, class E, class K>
__device__ cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed>
as_cooperative(const metal::tensor<U, E, K> &t) {
    cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed> c;
    c.load(t);
    return c;
}
template <uint32_t Rows, uint32_t Cols, bool Transposed, class U, class E, class K>
__device__ cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed>
as_cooperative(metal::tensor<U, E, K> &t) {
    return as_cooperative<Rows, Cols, Transposed>(static_cast<const metal::tensor<U, E, K> &>(t));
}

// Writes a tensor destination back after run (a cooperative destination is updated in place).
template <class C, class T> __device__ void store_back(const C &, T &) {}
template <class C, class U, class E, class K>
__device__ void store_back(const C &c, metal::tensor<U, E, K> &t) { c.store(t); }
template <class C, class U, class E, class K>
__device__ void store_back(const C &c, const metal::tensor<U, E, K> &t) { c.store(t); }

}  // namespace tensor_ops_detail

// A 2-D matrix multiplication executed cooperatively by `Scope` (execution_simdgroup).
template <unsigned long long Code, class Scope> struct matmul2d {
    static constexpr matmul2d_descriptor Desc = matmul2d_descriptor::decode(Code);
    // Scalars, which device code may read (the descriptor itself is host data to nvcc).
    static constexpr uint32_t M = uint32_t(Desc.m), N = uint32_t(Desc.n), K = uint32_t(Desc.k);
    static constexpr bool TransposeLeft = Desc.transpose_left;
    static constexpr bool TransposeRight = Desc.transpose_right;
    static constexpr bool Relaxed = Desc.relaxed_precision;
    static constexpr bool Accumulate =
        Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    static_assert(tensor_ops_detail::is_same<Scope, metal::execution_simdgroup>::value,
                  "the CUDA check build emulates matmul2d for execution_simdgroup only");
    static_assert(Desc.m > 0 && Desc.n > 0 && Desc.k > 0, "matmul2d extents must be positive");
    // The engine's limit (its combine holds the operands on a fiber stack); the same here, so a
    // descriptor valid in one build is valid in the other.
    static_assert(Desc.m * Desc.k + Desc.k * Desc.n + Desc.m * Desc.n <= 16384,
                  "the CPU engine's matmul2d holds at most 64 KiB of operands");

    // The left operand (m x k) as a cooperative tensor of element type L.
    template <class L, class R, class D> __device__ auto get_left_input_cooperative_tensor() const {
        return cooperative_tensor<L, M, K, TransposeLeft>();
    }
    // The right operand (k x n) as a cooperative tensor of element type R.
    template <class L, class R, class D>
    __device__ auto get_right_input_cooperative_tensor() const {
        return cooperative_tensor<R, K, N, TransposeRight>();
    }
    // The destination (m x n) as a cooperative tensor of element type D.
    template <class LT, class RT, class D>
    __device__ auto get_destination_cooperative_tensor() const {
        return cooperative_tensor<D, M, N, false>();
    }

    // destination = left * right (+ destination under multiply_accumulate), over all 32 lanes of
    // the warp (rules in the file comment). Each operand is a cooperative tensor of this
    // operation or a tensor (loaded, and for the destination stored back, with the bounds rules).
    template <class L, class R, class D>
    __device__ void run(const L &left, const R &right, D &destination,
                        unsigned line = __builtin_LINE(),
                        const char *file = __builtin_FILE()) const {
        using namespace tensor_ops_detail;
        check_scope(Code, line, file);
        const auto &l = as_cooperative<M, K, TransposeLeft>(left);
        const auto &r = as_cooperative<K, N, TransposeRight>(right);
        auto &&d = as_cooperative<M, N, false>(destination);
        float a[M * K], b[K * N];
        gather<M, K>(l, a, Relaxed);
        gather<K, N>(r, b, Relaxed);
        using DT = remove_cvref_t<decltype(d)>;
        for (uint32_t i = 0; i < DT::capacity; ++i) {
            uint32_t row = 0, column = 0;
            d.position_of(i, row, column);
            if (row >= M || column >= N) continue;
            float acc = Accumulate ? float(d.elements[i]) : 0.0f;
            for (uint32_t k = 0; k < K; ++k) acc = fmaf(a[row * K + k], b[k * N + column], acc);
            d.elements[i] = typename DT::element_type(acc);
        }
        store_back(d, destination);
    }
};

}  // namespace tensor_ops
}  // namespace mpp

namespace fa_cuda {

// Host: selects the cooperative-tensor layout of the kernels of this translation unit, by
// FLASH_ATTENTION_TENSOR_LAYOUT's values: "permuted", or "m5" / anything else / nullptr for the
// M5 map (as the engine reads the variable). Ordered with launches on the default stream.
static inline cudaError_t select_tensor_layout(const char *name) {
    using mpp::tensor_ops::tensor_ops_detail::layout;
    const layout map = name != nullptr && strcmp(name, "permuted") == 0 ? layout::permuted
                                                                         : layout::m5;
    return cudaMemcpyToSymbol(mpp::tensor_ops::tensor_ops_detail::selected_layout, &map,
                              sizeof map);
}

}  // namespace fa_cuda

#endif
