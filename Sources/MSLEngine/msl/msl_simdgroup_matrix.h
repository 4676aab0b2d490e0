// Metal Shading Language SIMD-group matrices for the CPU engine (MSL specification 6.7
// "SIMD-Group Matrix Functions"): simdgroup_matrix<T, 8, 8>, simdgroup_float8x8,
// simdgroup_half8x8, simdgroup_bfloat8x8 (MSL 3.1), make_filled_simdgroup_matrix, simdgroup_load,
// simdgroup_store, simdgroup_multiply, simdgroup_multiply_accumulate and thread_elements().
//
// Model: an 8x8 matrix is distributed over the 32 lanes of a SIMD-group, two elements per lane,
// with the mapping Apple GPUs use (documented by MLX and metal-flash-attention; MSL leaves it
// unspecified): lane l holds row ((l / 4) & 4) + (l / 2) % 4, columns ((l / 4) & 2) * 2 + (l % 2) * 2
// and the one after. In the engine each lane has its own copy of a matrix variable, and that copy
// owns exactly its lane's two elements; thread_elements() is that pair. The collective operations
// are rendezvous of the 32 lanes (all must be active, at the same call site) that assemble the
// whole tile from the owners, so a thread_elements() write is seen exactly as on a GPU.
//
// simdgroup_load/store addressing: matrix_origin is (column, row) of the logical matrix; element
// (r, c) lives at src[(origin.y + r) * elements_per_row + origin.x + c], or with transpose_matrix
// at src[(origin.x + c) * elements_per_row + origin.y + r].
// multiply_accumulate computes d = a * b + c with products accumulated in float (starting from c,
// k = 0..7, fused multiply-add) and rounds once to d's element type.
#ifndef MSL_SIMDGROUP_MATRIX_H
#define MSL_SIMDGROUP_MATRIX_H

#include "msl_simd.h"

namespace metal {

namespace matrix_detail {

/// Row of the first of lane l's two elements (Apple's lane mapping).
constexpr uint32_t row_of_lane(uint32_t l) { return ((l / 4) & 4) + (l / 2) % 4; }
/// Column of the first of lane l's two elements; the second is the next column.
constexpr uint32_t column_of_lane(uint32_t l) { return ((l / 4) & 2) * 2 + (l % 2) * 2; }

/// Memory index of element e (0 or 1) of the calling lane's pair, for simdgroup_load/store.
inline ulong element_index(uint32_t e, ulong elements_per_row, ulong2 origin, bool transpose) {
    const uint32_t l = msl_engine::runtime::simd_lane();
    const ulong r = row_of_lane(l), c = column_of_lane(l) + e;
    return transpose ? (origin.x + c) * elements_per_row + origin.y + r
                     : (origin.y + r) * elements_per_row + origin.x + c;
}

inline bool require_all_lanes(uint32_t mask, msl_engine::simd_fault *fault) {
    if (mask == 0xffffffffu) return true;
    const uint32_t missing = uint32_t(__builtin_ctz(~mask));
    return simd_detail::fail(fault, msl_engine::simd_fault_kind::partial_matrix, missing, missing);
}

inline bool all_lanes(const msl_engine::simd_slot *, uint32_t mask, msl_engine::simd_fault *fault) {
    return require_all_lanes(mask, fault);
}

template <class TA, class TB, class TC> struct mma_operands {
    const vec<TA, 2> *a;
    const vec<TB, 2> *b;
    const vec<TC, 2> *c;
};

// d = a * b + c from the 32 lanes' slots (all must be active). Inlined into each combine below,
// which fixes the instruction set it is compiled for.
template <class TD, class TA, class TB, class TC>
__attribute__((always_inline)) inline bool multiply_accumulate_body(const msl_engine::simd_slot *s,
                                                                    uint32_t mask,
                                                                    msl_engine::simd_fault *fault) {
    if (!require_all_lanes(mask, fault)) return false;
    float a[8][8], b[8][8], c[8][8];
    for (uint32_t l = 0; l < 32; ++l) {
        const auto *ops = static_cast<const mma_operands<TA, TB, TC> *>(s[l].in);
        const uint32_t r = row_of_lane(l), col = column_of_lane(l);
        for (uint32_t e = 0; e < 2; ++e) {
            a[r][col + e] = float((*ops->a)[e]);
            b[r][col + e] = float((*ops->b)[e]);
            c[r][col + e] = float((*ops->c)[e]);
        }
    }
    // Row by row, k outside j: every element still adds its products in k order from c (the
    // same bits), and the j loop is 8 independent multiply-adds, one vector instruction.
    float d[8][8];
    for (int i = 0; i < 8; ++i) {
        float acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = c[i][j];
        for (int k = 0; k < 8; ++k) {
            for (int j = 0; j < 8; ++j) acc[j] = __builtin_fmaf(a[i][k], b[k][j], acc[j]);
        }
        for (int j = 0; j < 8; ++j) d[i][j] = acc[j];
    }
    for (uint32_t l = 0; l < 32; ++l) {
        auto *out = static_cast<vec<TD, 2> *>(s[l].out);
        const uint32_t r = row_of_lane(l), col = column_of_lane(l);
        *out = vec<TD, 2>(TD(d[r][col]), TD(d[r][col + 1]));
    }
    return true;
}

template <class TD, class TA, class TB, class TC>
bool multiply_accumulate(const msl_engine::simd_slot *s, uint32_t mask,
                         msl_engine::simd_fault *fault) {
    return multiply_accumulate_body<TD, TA, TB, TC>(s, mask, fault);
}

#if defined(__x86_64__)
// The same for x86-64 CPUs with AVX2, F16C and FMA (those the attention kernels are built for):
// fused multiply-adds and half conversions are instructions there, library calls in the baseline
// build, which made them most of a matrix product's time. The same operations, the same bits.
template <class TD, class TA, class TB, class TC>
__attribute__((target("avx2,f16c,fma"))) bool
multiply_accumulate_avx2(const msl_engine::simd_slot *s, uint32_t mask, msl_engine::simd_fault *fault) {
    return multiply_accumulate_body<TD, TA, TB, TC>(s, mask, fault);
}

/// Whether this CPU runs multiply_accumulate_avx2.
inline bool has_avx2_f16c_fma() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                            __builtin_cpu_supports("fma");
    return yes;
}
#endif

/// The combine function of a multiply-accumulate: the fastest this CPU runs.
template <class TD, class TA, class TB, class TC>
inline msl_engine::simd_combine_fn multiply_accumulate_combine() {
#if defined(__x86_64__)
    if (has_avx2_f16c_fma()) return multiply_accumulate_avx2<TD, TA, TB, TC>;
#endif
    return multiply_accumulate<TD, TA, TB, TC>;
}

} // namespace matrix_detail

/// An 8x8 matrix shared by the 32 lanes of a SIMD-group; this lane's copy holds its 2 elements.
template <class T, int Cols, int Rows> struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "the CPU engine supports 8x8 simdgroup matrices");
    vec<T, 2> elements;

    simdgroup_matrix() = default;
    /// A diagonal matrix with `diagonal` on the diagonal and zero elsewhere (MSL constructor).
    explicit simdgroup_matrix(T diagonal) {
        const uint32_t l = msl_engine::runtime::simd_lane();
        const uint32_t r = matrix_detail::row_of_lane(l), c = matrix_detail::column_of_lane(l);
        elements = vec<T, 2>(r == c ? diagonal : T(0), r == c + 1 ? diagonal : T(0));
    }
    /// This lane's two elements (row, column) and (row, column + 1), per the mapping above.
    vec<T, 2> &thread_elements() { return elements; }
    const vec<T, 2> &thread_elements() const { return elements; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

/// A matrix with every element equal to `value` (MSL make_filled_simdgroup_matrix).
template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.elements = vec<T, 2>(value);
    return m;
}

/// Loads an 8x8 tile from device or threadgroup memory (addressing in the file comment).
template <class T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows> &d, const T *src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                    MSL_SIMD_SITE) {
    msl_engine::runtime::simd_collective("simdgroup_load", matrix_detail::all_lanes, nullptr,
                                         nullptr, 0, file, line);
    for (uint32_t e = 0; e < 2; ++e) {
        d.elements[e] = src[matrix_detail::element_index(e, elements_per_row, matrix_origin,
                                                          transpose_matrix)];
    }
}

/// Stores an 8x8 tile to device or threadgroup memory (addressing in the file comment).
template <class T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows> &a, T *dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                     bool transpose_matrix = false, MSL_SIMD_SITE) {
    msl_engine::runtime::simd_collective("simdgroup_store", matrix_detail::all_lanes, nullptr,
                                         nullptr, 0, file, line);
    for (uint32_t e = 0; e < 2; ++e) {
        dst[matrix_detail::element_index(e, elements_per_row, matrix_origin, transpose_matrix)] =
            a.elements[e];
    }
}

/// d = a * b + c over the whole SIMD-group (MSL simdgroup_multiply_accumulate).
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8> &d, const simdgroup_matrix<TA, 8, 8> &a,
                                   const simdgroup_matrix<TB, 8, 8> &b,
                                   const simdgroup_matrix<TC, 8, 8> &c, MSL_SIMD_SITE) {
    const matrix_detail::mma_operands<TA, TB, TC> ops{&a.elements, &b.elements, &c.elements};
    vec<TD, 2> result;
    msl_engine::runtime::simd_collective(msl_engine::runtime::matrix_multiply_accumulate_operation,
                                         matrix_detail::multiply_accumulate_combine<TD, TA, TB, TC>(), &ops,
                                         &result, 0, file, line);
    d.elements = result;
}

/// d = a * b over the whole SIMD-group (MSL simdgroup_multiply).
template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8> &d, const simdgroup_matrix<TA, 8, 8> &a,
                        const simdgroup_matrix<TB, 8, 8> &b, MSL_SIMD_SITE) {
    const simdgroup_matrix<TD, 8, 8> zero = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
    simdgroup_multiply_accumulate(d, a, b, zero, line, file);
}

} // namespace metal

#endif
