// Metal 4 MetalPerformancePrimitives `mpp::tensor_ops::matmul2d` with cooperative tensors, for
// the CPU engine. The subset an attention kernel needs, declared after Apple's documentation and
// the documented signatures of MPPTensorOpsMatMul2d.h in the macOS 26.2 SDK (not its text):
//   matmul2d_descriptor(m, n, k, transpose_left, transpose_right, relaxed_precision, mode),
//   mode::multiply / mode::multiply_accumulate; matmul2d<descriptor, execution_simdgroup> with
//   run(left, right, destination) and get_left_input_cooperative_tensor<L, R, D>(),
//   get_right_input_cooperative_tensor<L, R, D>(), get_destination_cooperative_tensor<LT, RT, D>();
//   cooperative tensors with operator[], get_capacity(), is_valid_element(i),
//   get_multidimensional_index(i), load(tensor), store(tensor); a minimal metal::tensor view
//   (pointer, dextents<int, 2>, strides, slice); run() also takes tensors as operands.
//   execution_simdgroups<N>, reductions and iterators are not emulated yet (docs/tensor-ops.md).
//
// Rules the emulation enforces (issue 37; docs/tensor-ops.md):
// - Scope: run() is a rendezvous of all 32 lanes of the SIMD-group at one call site with one
//   descriptor (a different descriptor is another instantiation, so the engine's site/function
//   check reports divergence); a returned lane is a fault, a lane elsewhere a reported stall.
// - Layout (implementation defined on a GPU): a matrix R x C is cut into 16x16 fragments, taken
//   in row-major order; element i of a lane lives in fragment i / 8. Within a fragment, under the
//   M5 map (MLX's, steel/gemm/nax.h BaseNAXFrag) lane l holds rows fm and fm + 8 and columns
//   fn .. fn + 3, fm = (qid & 4) | ((l >> 1) & 3), fn = 4 * ((qid & 2) | (l & 1)), qid = l >> 2,
//   element j = i % 8 at (fm + 8 * (j / 4), fn + j % 4). The permuted map gives lane l the M5
//   position of lane (13 l + 7) mod 32 with element j reversed (7 - j). The environment variable
//   FLASH_ATTENTION_TENSOR_LAYOUT=permuted selects it (read when a cooperative tensor is made);
//   unset or `m5` selects the M5 map. Positions past R x C are invalid elements.
// - Indices: get_multidimensional_index(i) is (column, row) of the logical operand (left M x K,
//   right K x N, destination M x N), the tensor convention (dimension 0 innermost). An index at
//   or past get_capacity() is a reported fault (the threadgroup fails).
// - Bounds: load() reads 0 past the tensor's extents; store() writes only inside them. With
//   transpose_left/right the tensor holds the transposed operand (K x M, N x K).
// - Rounding: each destination element starts from its value (multiply_accumulate) or 0
//   (multiply) and adds a[i][k] * b[k][j] for k = 0, 1, ... in order with one fused
//   multiply-add each (the product is exact for half and bfloat operands), then rounds once to
//   the destination's type. Under relaxed_precision float operands are first truncated toward
//   zero to 10 mantissa bits (M5 measured 2^-10.4 relative, matching truncation).
#ifndef MSL_TENSOR_OPS_H
#define MSL_TENSOR_OPS_H

#include <stdlib.h>
#include <string.h>

#include "msl_simd.h"

namespace metal {

/// Extents of a rank-2 tensor: extent(0) is the innermost dimension (columns of a row-major
/// matrix), extent(1) the outer one (rows).
template <class I, int Rank> struct dextents {
    static_assert(Rank == 2, "the CPU engine's tensor ops support rank-2 tensors");
    I e[2];
    dextents(I e0, I e1) : e{e0, e1} {}
    I extent(int d) const { return e[d]; }
};

/// A fixed-size array (MSL's metal::array), as tensors take their strides.
template <class T, size_t N> struct array {
    T elements[N];
    T &operator[](size_t i) { return elements[i]; }
    const T &operator[](size_t i) const { return elements[i]; }
    static constexpr size_t size() { return N; }
};

/// Marks a tensor whose pointer, extents and strides live in the kernel (Metal's tensor_inline).
struct tensor_inline {};

/// A rank-2 view of memory: element (x, y) at data[x * stride(0) + y * stride(1)]; strides
/// default to (1, extent(0)), a row-major matrix of extent(1) rows.
template <class T, class Extents = dextents<int, 2>, class Kind = tensor_inline> struct tensor {
    T *data;
    Extents extents;
    int strides[2];

    tensor(T *data_, Extents e) : data(data_), extents(e), strides{1, int(e.extent(0))} {}
    template <class A>
    tensor(T *data_, Extents e, const A &s) : data(data_), extents(e), strides{int(s[0]), int(s[1])} {}
    int get_extent(int d) const { return int(extents.extent(d)); }
    int get_stride(int d) const { return strides[d]; }
    /// The sub-view from (x, y) to the end (extents shrink, clamped at 0).
    tensor slice(int x, int y) const {
        const int e0 = get_extent(0) > x ? get_extent(0) - x : 0;
        const int e1 = get_extent(1) > y ? get_extent(1) - y : 0;
        tensor t(data + long(x) * strides[0] + long(y) * strides[1], Extents(e0, e1));
        t.strides[0] = strides[0];
        t.strides[1] = strides[1];
        return t;
    }
};

/// Execution scope of a tensor operation: one SIMD-group (32 lanes).
struct execution_simdgroup {};

} // namespace metal

namespace mpp {
namespace tensor_ops {

/// The shape and options of a matmul2d: destination (m x n) = left (m x k) * right (k x n)
/// [+ destination under multiply_accumulate]. The engine is C++17, which has no class-type
/// template parameters: a descriptor converts to a 64-bit code (extents below 2^16), and
/// matmul2d<descriptor, scope> takes that code, so Metal source spells it unchanged.
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
    constexpr operator unsigned long long() const {
        return (unsigned long long)(m & 0xffff) | (unsigned long long)(n & 0xffff) << 16 |
               (unsigned long long)(k & 0xffff) << 32 | (unsigned long long)transpose_left << 48 |
               (unsigned long long)transpose_right << 49 |
               (unsigned long long)relaxed_precision << 50 |
               (unsigned long long)(matmul_mode == mode::multiply_accumulate) << 51;
    }
    /// The descriptor a code stands for.
    static constexpr matmul2d_descriptor decode(unsigned long long c) {
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

enum class layout : uint8_t { m5, permuted };

/// The layout FLASH_ATTENTION_TENSOR_LAYOUT selects (file comment).
inline layout selected_layout() {
    const char *v = getenv("FLASH_ATTENTION_TENSOR_LAYOUT");
    return v != nullptr && strcmp(v, "permuted") == 0 ? layout::permuted : layout::m5;
}

/// (row, column) of element i of lane l in a tensor of `fragment_columns` fragments per row.
inline void position(layout map, uint32_t l, uint32_t i, uint32_t fragment_columns, uint32_t &row,
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

/// Clears the low 13 of float's 23 mantissa bits: truncation toward zero to 10 bits.
inline float truncate_to_10_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits &= ~uint32_t(0x1fff);
    memcpy(&x, &bits, 4);
    return x;
}

template <class T> inline float operand(T v, bool relaxed) {
    return relaxed && sizeof(T) == 4 ? truncate_to_10_bits(float(v)) : float(v);
}

/// The fault of an element index past get_capacity(): a one-lane-or-more collective whose
/// combine always fails, so the engine fails the threadgroup and names this call.
inline bool past_capacity(const msl_engine::simd_slot *, uint32_t mask, msl_engine::simd_fault *f) {
    f->kind = msl_engine::simd_fault_kind::invalid_lane;
    f->lane = uint32_t(__builtin_ctz(mask));
    f->source = 32;
    return false;
}

} // namespace tensor_ops_detail

/// One lane's share of a Rows x Cols operand of a matmul2d (its elements per the layout in the
/// file comment). Made only by matmul2d's get_*_cooperative_tensor functions.
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

    cooperative_tensor()
        : elements{}, map(tensor_ops_detail::selected_layout()),
          lane(msl_engine::runtime::simd_lane()) {}

    /// Number of element slots this lane has (some may be invalid: is_valid_element).
    static constexpr uint32_t get_capacity() { return capacity; }

    /// Element i of this lane; i at or past get_capacity() fails the threadgroup.
    T &operator[](uint32_t i) {
        if (i >= capacity) return past_capacity(i);
        return elements[i];
    }
    const T &operator[](uint32_t i) const {
        return const_cast<cooperative_tensor &>(*this)[i];
    }

    /// Whether slot i holds an element of the Rows x Cols operand.
    bool is_valid_element(uint32_t i) const {
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        return i < capacity && r < Rows && c < Cols;
    }

    /// (column, row) of slot i in the operand (dimension 0 innermost, as tensors index).
    vec<int, 2> get_multidimensional_index(uint32_t i) const {
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        return vec<int, 2>(int(c), int(r));
    }

    /// Loads this lane's elements from `t` (the operand, or its transpose when the descriptor
    /// transposes it); reads past t's extents give 0.
    template <class U, class E, class K> void load(const metal::tensor<U, E, K> &t) {
        for (uint32_t i = 0; i < capacity; ++i) {
            int x = 0, y = 0;
            if (!address(i, t.get_extent(0), t.get_extent(1), x, y)) {
                elements[i] = T(0);
                continue;
            }
            elements[i] = T(t.data[long(x) * t.strides[0] + long(y) * t.strides[1]]);
        }
    }

    /// Stores this lane's elements into `t`; elements past t's extents are not written.
    template <class U, class E, class K> void store(const metal::tensor<U, E, K> &t) const {
        for (uint32_t i = 0; i < capacity; ++i) {
            int x = 0, y = 0;
            if (address(i, t.get_extent(0), t.get_extent(1), x, y))
                t.data[long(x) * t.strides[0] + long(y) * t.strides[1]] = U(elements[i]);
        }
    }

    void position_of(uint32_t i, uint32_t &r, uint32_t &c) const {
        tensor_ops_detail::position(map, lane, i, fragment_columns, r, c);
    }

  private:
    T &past_capacity(uint32_t i, unsigned line = __builtin_LINE(),
                     const char *file = __builtin_FILE()) {
        msl_engine::runtime::simd_collective(
            "cooperative_tensor element index past get_capacity()",
            tensor_ops_detail::past_capacity, nullptr, nullptr, i, file, line);
        return elements[0];
    }

    // The tensor coordinate (x, y) of valid slot i; false when invalid or outside the extents.
    bool address(uint32_t i, int e0, int e1, int &x, int &y) const {
        if (!is_valid_element(i)) return false;
        uint32_t r = 0, c = 0;
        position_of(i, r, c);
        x = int(Transposed ? r : c);
        y = int(Transposed ? c : r);
        return x < e0 && y < e1;
    }
};

namespace tensor_ops_detail {

template <class L, class R, class D> struct run_operands {
    const L *left;
    const R *right;
    D *destination;
};

/// Gathers each lane's slots of `t` (one per lane in slots) into a dense Rows x Cols matrix.
template <class CT, uint32_t Rows, uint32_t Cols, class Pick>
void gather(const msl_engine::simd_slot *s, Pick pick, float *m, bool relaxed) {
    for (uint32_t l = 0; l < 32; ++l) {
        const CT &t = pick(s[l]);
        for (uint32_t i = 0; i < CT::capacity; ++i) {
            uint32_t r = 0, c = 0;
            t.position_of(i, r, c);
            if (r < Rows && c < Cols) m[r * Cols + c] = operand(t.elements[i], relaxed);
        }
    }
}

template <unsigned long long Code, class L, class R, class D>
bool run(const msl_engine::simd_slot *s, uint32_t mask, msl_engine::simd_fault *fault) {
    using ops = run_operands<L, R, D>;
    constexpr matmul2d_descriptor Desc = matmul2d_descriptor::decode(Code);
    if (mask != 0xffffffffu) {
        fault->kind = msl_engine::simd_fault_kind::partial_matrix;
        fault->lane = fault->source = uint32_t(__builtin_ctz(~mask));
        return false;
    }
    constexpr uint32_t M = uint32_t(Desc.m), N = uint32_t(Desc.n), K = uint32_t(Desc.k);
    constexpr bool relaxed = Desc.relaxed_precision;
    float a[M * K], b[K * N], d[M * N];
    gather<L, M, K>(s, [](const msl_engine::simd_slot &x) -> const L & {
        return *static_cast<const ops *>(x.in)->left; }, a, relaxed);
    gather<R, K, N>(s, [](const msl_engine::simd_slot &x) -> const R & {
        return *static_cast<const ops *>(x.in)->right; }, b, relaxed);
    gather<D, M, N>(s, [](const msl_engine::simd_slot &x) -> const D & {
        return *static_cast<const ops *>(x.in)->destination; }, d, false);
    for (uint32_t i = 0; i < M; ++i) {
        for (uint32_t j = 0; j < N; ++j) {
            float acc = Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate
                            ? d[i * N + j] : 0.0f;
            for (uint32_t k = 0; k < K; ++k) acc = __builtin_fmaf(a[i * K + k], b[k * N + j], acc);
            d[i * N + j] = acc;
        }
    }
    for (uint32_t l = 0; l < 32; ++l) {
        D &t = *static_cast<const ops *>(s[l].in)->destination;
        for (uint32_t i = 0; i < D::capacity; ++i) {
            uint32_t r = 0, c = 0;
            t.position_of(i, r, c);
            if (r < M && c < N) t.elements[i] = typename D::element_type(d[r * N + c]);
        }
    }
    return true;
}

template <class T> struct remove_cvref { using type = T; };
template <class T> struct remove_cvref<const T> { using type = T; };
template <class T> struct remove_cvref<T &> { using type = typename remove_cvref<T>::type; };
template <class T> struct remove_cvref<T &&> { using type = typename remove_cvref<T>::type; };
template <class T> using remove_cvref_t = typename remove_cvref<T>::type;

/// A cooperative-tensor operand as it is; a tensor operand loaded into one of its element type.
template <uint32_t Rows, uint32_t Cols, bool Transposed, class T>
T &as_cooperative(T &t) { return t; }
template <uint32_t Rows, uint32_t Cols, bool Transposed, class U, class E, class K>
cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed>
as_cooperative(const metal::tensor<U, E, K> &t) {
    cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed> c;
    c.load(t);
    return c;
}
template <uint32_t Rows, uint32_t Cols, bool Transposed, class U, class E, class K>
cooperative_tensor<typename remove_cvref<U>::type, Rows, Cols, Transposed>
as_cooperative(metal::tensor<U, E, K> &t) {
    return as_cooperative<Rows, Cols, Transposed>(static_cast<const metal::tensor<U, E, K> &>(t));
}

/// Writes a tensor destination back after run (a cooperative destination is updated in place).
template <class C, class T> void store_back(const C &, T &) {}
template <class C, class U, class E, class K>
void store_back(const C &c, metal::tensor<U, E, K> &t) { c.store(t); }
template <class C, class U, class E, class K>
void store_back(const C &c, const metal::tensor<U, E, K> &t) { c.store(t); }

} // namespace tensor_ops_detail

/// A 2-D matrix multiplication executed cooperatively by `Scope` (execution_simdgroup).
template <unsigned long long Code, class Scope> struct matmul2d {
    static constexpr matmul2d_descriptor Desc = matmul2d_descriptor::decode(Code);
    static_assert(__is_same(Scope, metal::execution_simdgroup),
                  "the CPU engine emulates matmul2d for execution_simdgroup only");
    static_assert(Desc.m > 0 && Desc.n > 0 && Desc.k > 0, "matmul2d extents must be positive");
    // run's combine holds the three operands densely on a lane's fiber stack (256 KiB).
    static_assert(Desc.m * Desc.k + Desc.k * Desc.n + Desc.m * Desc.n <= 16384,
                  "the CPU engine's matmul2d holds at most 64 KiB of operands");

    /// The left operand (m x k) as a cooperative tensor of element type L.
    template <class L, class R, class D> auto get_left_input_cooperative_tensor() const {
        return cooperative_tensor<L, uint32_t(Desc.m), uint32_t(Desc.k), Desc.transpose_left>();
    }
    /// The right operand (k x n) as a cooperative tensor of element type R.
    template <class L, class R, class D> auto get_right_input_cooperative_tensor() const {
        return cooperative_tensor<R, uint32_t(Desc.k), uint32_t(Desc.n), Desc.transpose_right>();
    }
    /// The destination (m x n) as a cooperative tensor of element type D.
    template <class LT, class RT, class D> auto get_destination_cooperative_tensor() const {
        return cooperative_tensor<D, uint32_t(Desc.m), uint32_t(Desc.n), false>();
    }

    /// destination = left * right (+ destination under multiply_accumulate), over all 32 lanes
    /// of the SIMD-group (rules in the file comment). Each operand is a cooperative tensor of
    /// this operation or a tensor (loaded, and for the destination stored back, with the
    /// bounds rules).
    template <class L, class R, class D>
    void run(const L &left, const R &right, D &destination, unsigned line = __builtin_LINE(),
             const char *file = __builtin_FILE()) const {
        using namespace tensor_ops_detail;
        const auto &l = as_cooperative<uint32_t(Desc.m), uint32_t(Desc.k), Desc.transpose_left>(left);
        const auto &r = as_cooperative<uint32_t(Desc.k), uint32_t(Desc.n), Desc.transpose_right>(right);
        auto &&d = as_cooperative<uint32_t(Desc.m), uint32_t(Desc.n), false>(destination);
        using LT = remove_cvref_t<decltype(l)>;
        using RT = remove_cvref_t<decltype(r)>;
        using DT = remove_cvref_t<decltype(d)>;
        run_operands<LT, RT, DT> ops{&l, &r, &d};
        msl_engine::runtime::simd_collective("mpp::tensor_ops::matmul2d::run",
                                             tensor_ops_detail::run<Code, LT, RT, DT>, &ops,
                                             nullptr, 0, file, line);
        store_back(d, destination);
    }
};

} // namespace tensor_ops
} // namespace mpp

#endif
