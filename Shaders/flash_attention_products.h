// The matrix products of the tiled kernels: which rows and head_dim slice a SIMD-group owns, the
// products over that slice, the sums of the slices' partial products and the stores of a row.
#ifndef FLASH_ATTENTION_PRODUCTS_H
#define FLASH_ATTENTION_PRODUCTS_H

#include "flash_attention_fragment.h"
#include "flash_attention_blocks.h"

// Head_dim slices of a kernel that owns ROWS rows per threadgroup (flash_attention_params.h).
#define FA_SLICES(ROWS) (8 * FA_SIMDGROUPS / (ROWS))

// The partial products of the head_dim slices, per SIMD-group an 8 x COLS block (sum_over_slices);
// a single float where there is one slice, which never touches it, so that it costs no
// threadgroup memory (occupancy: flash_attention_params.h).
#define FA_PARTIALS(NAME, SLICES, COLS)                                                            \
    float NAME[(SLICES) > 1 ? FA_SIMDGROUPS : 1][(SLICES) > 1 ? 8 : 1][(SLICES) > 1 ? (COLS) : 1]

// Where one SIMD-group works: rows [row0, row0 + 8) of the threadgroup's block and columns
// [col0, col0 + 8 * fragments) of its head_dim slice, of which `active` fragments lie inside
// head_dim (q, k) and `active_v` inside head_dim_v (v, out). A SIMD-group whose rows all lie past
// the end of the block's rows is not live and has no active fragment: it multiplies nothing (but
// still loads tiles and meets the barriers with the others).
struct SimdgroupSlice {
    uint row0;
    uint col0;
    uint active;
    uint active_v;
    uint first_sgid;  // the SIMD-group holding slice 0 of the same rows
    bool live;
};

template <uint DP, uint SLICES>
inline SimdgroupSlice simdgroup_slice(constant FlashAttentionParams &p, uint sgid, uint rows_left) {
    SimdgroupSlice s;
    s.row0 = (sgid / SLICES) * 8;
    s.col0 = (sgid % SLICES) * (DP / SLICES);
    const bool live = s.row0 < rows_left;
    s.live = live;
    s.active = live ? active_fragments(p.head_dim, s.col0, DP / SLICES / 8) : 0;
    s.active_v = live ? active_fragments(p.head_dim_v, s.col0, DP / SLICES / 8) : 0;
    s.first_sgid = sgid - sgid % SLICES;
    return s;
}

// Products over a head_dim slice. With every column of the bucket inside head_dim and head_dim_v
// (FlashAttentionParams.partial_columns 0, the common case) a live SIMD-group multiplies all ND
// fragments of its slice, fully unrolled, without a test; otherwise (CHECKED) only the first
// `active` ones, the rest being zero padding.

// x = A B^T over the SIMD-group's head_dim slice: A the 8 rows [a_row0, a_row0 + 8) of tile `a`,
// B the rows [8j, 8j + 8) of tile `b` for fragment j of x, summed over the slice's first `active`
// 8-column fragments (of ND), all of them unless CHECKED. B_PAIRED: tile `b` is in the paired
// layout of that width (PairedRows), 0 row-major.
template <typename T, uint ND, bool CHECKED, uint B_PAIRED, uint N, typename TileA, typename TileB>
FA_ALWAYS_INLINE void product_transposed_over(thread Fragments<N> &x, TileA a, uint a_row0,
                                              TileB b, uint col0, uint active, FragmentCoord at) {
    static_assert(B_PAIRED == 0 || B_PAIRED % (ND * 8) == 0, "a paired tile is read in whole slices");
    // Half tiles give half operands (TileFragment, flash_attention_fragment.h).
    typedef simdgroup_matrix<typename TileFragment<T>::type, 8, 8> Operand;
    clear(x);
    FA_UNROLL
    for (uint d = 0; d < ND; ++d) {
        if (!CHECKED || d < active) {
            Operand af;
            load_fragment<T>(af, a, a_row0, col0 / 8 + d, at);
            FA_UNROLL
            for (uint j = 0; j < N; ++j) {
                Operand bt;
                if (B_PAIRED != 0) {
                    // Column fragment col0 / 8 + d of the tile (a constant once unrolled where
                    // the SIMD-group reads all of head_dim: col0 0).
                    load_fragment_paired<T, B_PAIRED>(bt, b, j * 8, col0 / 8 + d, at);
                } else {
                    load_fragment_transposed<T>(bt, b, j * 8, col0 + d * 8, at);
                }
                simdgroup_multiply_accumulate(x.f[j], af, bt, x.f[j]);
            }
        }
    }
}

// S = Q K^T, dP = dO V^T and their transposes (see product_transposed_over); x = 0 for a SIMD-group
// that is not live.
template <typename T, uint ND, uint B_PAIRED = 0, uint N, typename TileA, typename TileB>
FA_ALWAYS_INLINE void product_transposed(thread Fragments<N> &x, TileA a, uint a_row0, TileB b,
                                         SimdgroupSlice s, uint active,
                                         constant FlashAttentionParams &p, FragmentCoord at) {
    if (p.partial_columns != 0) {
        product_transposed_over<T, ND, true, B_PAIRED>(x, a, a_row0, b, s.col0, active, at);
    } else if (s.live) {
        product_transposed_over<T, ND, false, B_PAIRED>(x, a, a_row0, b, s.col0, active, at);
    } else {
        clear(x);
    }
}

// acc += P B over the slice's first `active` fragments (of ND; all of them unless CHECKED): P an
// 8 x 8N block, B the rows [0, 8N) of tile `b`.
template <typename T, bool CHECKED, uint ND, uint N, typename TileB>
FA_ALWAYS_INLINE void accumulate_product_over(thread Fragments<ND> &acc, thread Fragments<N> &p,
                                              TileB b, uint col0, uint active, FragmentCoord at) {
    FA_UNROLL
    for (uint d = 0; d < ND; ++d) {
        if (!CHECKED || d < active) {
            FA_UNROLL
            for (uint j = 0; j < N; ++j) {
                simdgroup_float8x8 bf;
                load_fragment<T>(bf, b, j * 8, col0 / 8 + d, at);
                simdgroup_multiply_accumulate(acc.f[d], p.f[j], bf, acc.f[d]);
            }
        }
    }
}

// O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q (see accumulate_product_over); nothing for a
// SIMD-group that is not live.
template <typename T, uint ND, uint N, typename TileB>
FA_ALWAYS_INLINE void accumulate_product(thread Fragments<ND> &acc, thread Fragments<N> &x,
                                         TileB b, SimdgroupSlice s, uint active,
                                         constant FlashAttentionParams &p, FragmentCoord at) {
    if (p.partial_columns != 0) {
        accumulate_product_over<T, true>(acc, x, b, s.col0, active, at);
    } else if (s.live) {
        accumulate_product_over<T, false>(acc, x, b, s.col0, active, at);
    }
}

// Sums the head_dim slices' partial products (no-op for one slice). All threads call it.
template <uint SLICES, uint N, typename Partials>
inline void sum_over_slices(thread Fragments<N> &x, Partials partials, uint sgid,
                            SimdgroupSlice s, FragmentCoord at) {
    if (SLICES > 1) {
        store_partial(x, partials, sgid, at);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        sum_partials<N, SLICES>(x, partials, s.first_sgid, at);
    }
}

// Stores the lane's row of an 8 x 8N accumulator times `scale`, rounded to T: dst points at the
// row, columns below `cols` only.
template <uint N, typename T>
inline void store_row(device T *dst, thread Fragments<N> &x, float scale, uint cols,
                      SimdgroupSlice s, FragmentCoord at) {
    FA_UNROLL
    for (uint d = 0; d < N; ++d) {
        FA_UNROLL
        for (uint e = 0; e < 2; ++e) {
            const uint col = s.col0 + d * 8 + at.col + e;
            if (col < cols) {
                dst[col] = T(x.f[d].thread_elements()[e] * scale);
            }
        }
    }
}

#endif
