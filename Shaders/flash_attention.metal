// FlashAttention for Apple GPUs: forward (out and the log-sum-exp) and backward (D pre-pass, lse
// residual, dQ, dK/dV), on simdgroup_matrix tiles.
//
// Math: FlashAttention-2 (Dao, 2023). Operands: Q, K, V, O (out), L (lse), dO (dout), D (delta),
// S = Q K^T, P = softmax(S), dP = dO V^T, dS = P (dP - D). Every exponential of a score is exp2
// of a difference x - m (<= 0) times log2(e) (exp_of): the hardware's exp2, while scores, maxima
// and lse stay in natural units (the merges of lse values and dsinks use exp). Every float math
// function is called as precise:: explicitly: a host's compile options choose fast or precise
// for the unqualified ones (MTLCompileOptions.mathFloatingPointFunctions, fast by default from
// macOS 15; MLX sets only mathMode), and every front end must give the same bits.
//
//   forward (Algorithm 1), one threadgroup per BQ query rows:
//     load Q block; m = -inf, l = 0, O = 0
//     for each K/V tile of BK keys that some row of the block sees:
//       load K, V tiles; S = Q K^T (scaled, softcap, ALiBi, attn_mask); element masks only on
//       tiles that a window, causal edge or the end crosses; m' = max(m, rowmax S); P = exp(S - m'); l = l exp(m - m') + rowsum P;
//       O = O exp(m - m') + P V; m = m'
//     out = O / l, lse = m + log l (a row that sees no key: out 0, lse -inf)
//   backward_delta: D_i = rowsum(dO_i * O_i), once per row, in float32
//   backward_lse_residual: R_i = log sum_j exp(S_ij - L_i) for rows whose |L_i| is too large for
//     float32 to hold log l beside m (0 elsewhere, where nothing is recomputed)
//   backward_dq (Algorithm 2, the dQ half), one threadgroup per BQ query rows:
//     for each visible K/V tile: S = Q K^T, P = exp(S - L - R), dP = dO V^T, dS = P (dP - D),
//     dQ += dS K; dq = softmax_scale dQ
//   backward_dkv (the dK/dV half), one threadgroup per BK keys of one KV head:
//     for each query head of the GQA group, in order, and each Q/dO tile that sees the keys:
//       S^T = K Q^T, P^T = exp(S^T - L - R), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D),
//       dK += dS^T Q; dk = softmax_scale dK
//   No atomics: every output element has one writer, and sums run in a fixed order, so results
//   are bit-identical from run to run.
//
// Structure: 4 SIMD-groups per threadgroup; each owns 8 rows and a head_dim slice (see
// flash_attention_params.h). Tiles are copied from device memory into threadgroup memory once per
// threadgroup and read by all SIMD-groups; the accumulators (O, dQ, dK, dV), the running max and
// sum live in registers. Every barrier is reached by all threads (loop trip counts and branches
// around barriers are the same for the whole threadgroup); every simdgroup_matrix and SIMD
// shuffle call is reached by all 32 lanes (edges are zero-filled tiles and masks, never per-lane
// branches). Minus infinity is used only as the masked score and the initial running max, and
// never enters an inf - inf: fast math must stay off (the host compiles with it off).
//
// Semantics (flash_attention_metal.h): bottom-right causal masks; a row that sees no key gets
// out 0, lse -inf and zero gradients; GQA/MQA query head h reads KV head
// h / (num_heads / num_kv_heads); 64-bit offsets from per-tensor strides (any layout whose last
// axis is contiguous); head_dim (q, k) and head_dim_v (v, out) 1 to FA_MAX_HEAD_DIM, zero-padded
// to the bucket's width inside threadgroup memory, never read past the tensor. Element type T of
// the tensors: half, bfloat or float; every product accumulates in float32 and every output is
// rounded to T once.
//
// One instance per dtype and head-dim bucket (FA_HEAD_DIM_BUCKETS for half and bfloat,
// FA_HEAD_DIM_BUCKETS_F32 for float; the decode kernel up to FA_DECODE_MAX_HEAD_DIM), named
// <kernel>_<dtype>_d<head_dim_max>. Threadgroup storage is one struct per kernel, named
// <kernel>_threadgroup.

#include <metal_stdlib>

using namespace metal;

#include "flash_attention_params.h"
#include "flash_attention_features.h"
#include "flash_attention_loader.h"
#include "flash_attention_fragment.h"
#include "flash_attention_blocks.h"
#include "flash_attention_merge.h"
#include "flash_attention_varlen.h"

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
    static_assert(B_PAIRED == 0 || ND * 8 == B_PAIRED, "a paired tile is read in one slice");
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
                    // One slice (asserted): column fragment d, a constant once unrolled.
                    load_fragment_paired<T, B_PAIRED>(bt, b, j * 8, d, at);
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

// ---- exponentials ----------------------------------------------------------------------------

// log2(e) as a float pair hi + lo (hi the float nearest, lo the rest).
#define FA_LOG2E_HI 1.44269502162933349609375f
#define FA_LOG2E_LO 1.925963033500011079e-8f

// exp(x) as exp2 of x * log2(e), the product in two terms. Scores, running maxima and lse stay in
// natural units and only differences x = score - max (<= 0) go to base 2: a product with a rounded
// log2(e) would put the same relative error on every score of a row (a bias float32 gradients
// see), and a finite score beyond FLT_MAX / log2(e) (Hugging Face's float32-minimum masks) would
// overflow in base 2.
inline float exp_of(float x) {
    return precise::exp2(fma(x, FA_LOG2E_HI, x * FA_LOG2E_LO));
}

// ---- scores ----------------------------------------------------------------------------------

// What shapes one lane's scores besides q . k: softmax_scale (read once, not per score), the ALiBi
// slope of its row's head, where its row of attn_mask starts (flash_attention_params.h: FA_MASK_*)
// and the keys its row sees.
struct RowModifiers {
    float scale;
    float slope;
    ulong mask_row;
    KeyRange keys;  // the keys the row sees through the window (visible_keys)
};

inline RowModifiers row_modifiers(constant FlashAttentionParams &p, device const float *alibi,
                                  uint b, uint h, uint row) {
    RowModifiers m;
    m.scale = p.softmax_scale;
    m.slope = alibi_on(p) ? alibi[ulong(b) * p.alibi_batch_stride + h] : 0.0f;
    m.mask_row = head_offset(p.mask, b, h) + ulong(row) * p.mask.seq;
    m.keys = visible_keys(p, row);
    return m;
}

// Whether `key` is one of `keys` (a row's window, visible_keys).
inline bool in_window(KeyRange keys, uint key) {
    return key >= keys.first && key < keys.end;
}

// The window test of a lane's keys key0 + c of one tile, c = 8j + e (a constant once unrolled): one
// add and one unsigned compare per key, (key0 - first) + c < end - first, the same answer as
// in_window; every key passes in a tile that needs no element mask (`checked` false).
struct TileWindow {
    uint base;
    uint width;

    inline bool visible(uint c) const { return base + c < width; }
};

inline TileWindow tile_window(KeyRange keys, uint key0, bool checked) {
    TileWindow w;
    w.base = checked ? key0 - keys.first : 0u;
    w.width = !checked ? 0xffffffffu : (keys.end > keys.first ? keys.end - keys.first : 0u);
    return w;
}

// The score of (row, key) from its raw product q . k: softcap(softmax_scale * raw),
// minus slope * |row + seqlen_k - seqlen_q - key|, plus the additive mask; -inf where the pair is
// hidden (not `visible` through the window, as the caller tests on every tile that needs element
// masks, or by a boolean mask). *t receives tanh(softmax_scale * raw / softcap) for the softcap
// backward.
template <typename T>
inline float score(constant FlashAttentionParams &p, device const uchar *mask, float raw,
                    uint row, uint key, RowModifiers m, bool visible, thread float &t) {
    t = 0.0f;
    if (!visible) {
        return -INFINITY;
    }
    // (The mask's index is formed inside each mask branch: none of it on the path without a mask.)
    if (mask_type_of(p) == FA_MASK_BOOL && mask[m.mask_row + key] == 0) {
        return -INFINITY;
    }
    float x = raw * m.scale;
    if (softcap_on(p)) {
        t = precise::tanh(x / p.softcap);
        x = p.softcap * t;
    }
    if (alibi_on(p)) {
        x -= m.slope * abs(float(long(row) + long(p.seqlen_k) - long(p.seqlen_q) - long(key)));
    }
    if (mask_type_of(p) == FA_MASK_ADDITIVE) {
        x += float(((device const T *)mask)[m.mask_row + key]);
    } else if (mask_type_of(p) == FA_MASK_ADDITIVE_F32) {
        x += ((device const float *)mask)[m.mask_row + key];
    }
    return x;
}

// dS with respect to softmax_scale * q . k from dS with respect to the final score: the softcap
// multiplies it by d(c tanh(x / c))/dx = 1 - tanh^2.
inline float through_softcap(constant FlashAttentionParams &p, float ds, float t) {
    return softcap_on(p) ? ds * (1.0f - t * t) : ds;
}

// P = exp((score - lse) - residual) (backward_lse_residual); 0 for a hidden pair (whose score is
// -inf, also when the row's lse is -inf).
inline float probability(float score, float lse, float residual) {
    return score == -INFINITY ? 0.0f : exp_of((score - lse) - residual);
}

// The lse a backward row works with: as given where finite; +inf for -inf, +inf and NaN, so that
// every P and the sink's weight of that row are exp(-inf) = 0 and its gradient is zero, never NaN
// or inf. The forward gives -inf only to rows without visible keys (all P 0 already); the host
// rejects the others where it can read lse (LseCheck.swift), this covers lse in GPU memory.
inline float backward_row_lse(float lse) {
    return isfinite(lse) ? lse : INFINITY;
}

// ---- forward ---------------------------------------------------------------------------------

// Without WITH_V (the backward's lse residual pass: scores only) the V tile is a placeholder.
// SHARED: the K and V tiles share one buffer (where Q, K and V would not fit in 32 KiB: float16
// and bfloat16 at head_dim 256, 32 query rows), as in MLX's steel attention (its KV_smem): K for
// S, then V over it for O += P V, two barriers more per tile (forward_tile).
template <typename T, uint DP, uint BQ, uint BK, bool WITH_V, bool SHARED>
struct ForwardTiles {
    uint4 q[BQ][FA_ROW_CHUNKS(T, DP)];
    uint4 k[BK][FA_ROW_CHUNKS(T, DP)];
    uint4 v[WITH_V && !SHARED ? BK : 1][FA_ROW_CHUNKS(T, DP)];
    FA_PARTIALS(s_partial, FA_SLICES(BQ), BK);
};

// Whether the forward kernels of a bucket share the K/V buffer (ForwardTiles).
#define FA_FORWARD_SHARED(T, DP, BQ, BK) (sizeof(ForwardTiles<T, DP, BQ, BK, true, false>) > 32768)

template <typename T, uint DP, uint BQ, uint BK, bool WITH_V = true>
using ForwardStorage = ForwardTiles<T, DP, BQ, BK, WITH_V, FA_FORWARD_SHARED(T, DP, BQ, BK)>;

// The online softmax of one lane's row (Algorithm 1): running max m of the scores, this lane's part
// of the running sum l of exp(score - m), and the SIMD-group's 8-row block of the
// unnormalised output over its head_dim slice.
template <uint ND>
struct RowState {
    float m;
    float l;
    Fragments<ND> o;
};

// Starts a row; with a sink (a virtual key of logit `sink` and no value) the row's softmax begins
// with that key's weight (one lane of the four holding the row counts it).
template <uint ND>
inline void start_rows(thread RowState<ND> &r, bool with_sink, float sink, FragmentCoord at) {
    r.m = with_sink ? sink : -INFINITY;
    r.l = with_sink && at.col == 0 ? 1.0f : 0.0f;
    clear(r.o);
}

// One K/V tile of the forward pass, keys [kv0, kv0 + BK) (the next tiles of the streams ks and vs
// over the KV head's K and V): loads the tiles (every thread calls it; V only after S where K and
// V share a buffer), S = Q K^T over the slice and then over all of head_dim, masks (only when
// `masked`; the lane's row is query `row`), online softmax update, O += P V (without WITH_V,
// only m and l: V is neither loaded nor multiplied).
template <uint DP, uint BQ, uint BK, uint ND, bool WITH_V = true, typename KS, typename VS,
          typename Storage>
FA_ALWAYS_INLINE void forward_tile(thread RowState<ND> &r, Storage tg, thread KS &ks,
                                   thread VS &vs, device const uchar *mask,
                                   constant FlashAttentionParams &p, uint kv0, bool masked,
                                   uint row, RowModifiers mods, SimdgroupSlice s, FragmentCoord at,
                                   uint sgid, uint tid) {
    typedef typename KS::element T;
    constexpr uint NK = BK / 8;  // fragments across a key tile
    constexpr bool SHARED = WITH_V && FA_FORWARD_SHARED(T, DP, BQ, BK);
    auto v_tile = SHARED ? tg->k : tg->v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // K is read only transposed: paired rows where the bucket allows (PairedRows).
    constexpr uint K_PAIRED = PairedRows<T, DP>::WIDTH;
    load_tile<BK, DP, K_PAIRED != 0>(tg->k, ks, kv0, p, tid);
    if (WITH_V && !SHARED) {
        load_tile<BK, DP>(tg->v, vs, kv0, p, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    Fragments<NK> sc;
    product_transposed<T, ND, K_PAIRED>(sc, tg->q, s.row0, tg->k, s, s.active, p, at);
    sum_over_slices<FA_SLICES(BQ)>(sc, tg->s_partial, sgid, s, at);
    if (SHARED) {
        // V over K once every SIMD-group has read K (the softmax sits between copy and barrier).
        threadgroup_barrier(mem_flags::mem_threadgroup);
        load_tile<BK, DP>(v_tile, vs, kv0, p, tid);
    }

    // Online softmax; P replaces S in place.
    const TileWindow window = tile_window(mods.keys, kv0 + at.col, masked);
    float tile_max = -INFINITY;
    FA_UNROLL
    for (uint j = 0; j < NK; ++j) {
        FA_UNROLL
        for (uint e = 0; e < 2; ++e) {
            float t;
            const float x = score<T>(p, mask, sc.f[j].thread_elements()[e], row,
                                      kv0 + j * 8 + at.col + e, mods, window.visible(j * 8 + e), t);
            sc.f[j].thread_elements()[e] = x;
            tile_max = max(tile_max, x);
        }
    }
    const float m_next = max(r.m, row_max(tile_max));
    // While a row has seen no key, m_next is -inf: subtracting 0 keeps exp at 0, not NaN.
    const float m_base = m_next == -INFINITY ? 0.0f : m_next;
    const float correction = exp_of(r.m - m_base);
    r.l *= correction;
    FA_UNROLL
    for (uint d = 0; d < ND; ++d) {
        r.o.f[d].thread_elements()[0] *= correction;
        r.o.f[d].thread_elements()[1] *= correction;
    }
    FA_UNROLL
    for (uint j = 0; j < NK; ++j) {
        FA_UNROLL
        for (uint e = 0; e < 2; ++e) {
            const float pe = exp_of(sc.f[j].thread_elements()[e] - m_base);
            sc.f[j].thread_elements()[e] = pe;
            r.l += pe;
        }
    }
    r.m = m_next;

    if (SHARED) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (WITH_V) {
        accumulate_product<T>(r.o, sc, v_tile, s, s.active_v, p, at);
    }
}

// The natural-log lse of a finished row whose row sum is l (-inf for a row that saw no key).
inline float row_lse(float m, float l) {
    return l > 0.0f ? m + precise::log(l) : -INFINITY;
}

// A split-KV chunk's softmax state at entry `index` of partial_lse: its running max m and log l,
// apart (entries 2 index and 2 index + 1), so that a chunk's share survives where |m| is too large
// for float32 to add log l (rows masked with the float32 minimum); (-inf, 0) for a chunk without
// keys.
inline void store_partial_lse(device float *partial_lse, ulong index, float m, float l) {
    partial_lse[2 * index] = l > 0.0f ? m : -INFINITY;
    partial_lse[2 * index + 1] = l > 0.0f ? precise::log(l) : 0.0f;
}

// The K/V source of the forward kernels for plain tensors k and v (flash_attention_kv_cache.h has
// the one for KV caches): tile streams over batch element b's KV head. (Member functions say
// `inline`: the CUDA check build makes every `inline` function a __device__ one.)
template <typename T>
struct DeviceKV {
    device const T *k;
    device const T *v;

    template <uint ROWS, uint DP>
    inline TileStream<T, ROWS, DP> keys(constant FlashAttentionParams &p, uint b, uint kv_head,
                                        uint first, uint tid) const {
        return tile_stream<T, ROWS, DP>(k + head_offset(p.k, b, kv_head), first, p.seqlen_k, p.k.seq,
                                        p.head_dim, tid);
    }

    template <uint ROWS, uint DP>
    inline TileStream<T, ROWS, DP> values(constant FlashAttentionParams &p, uint b, uint kv_head,
                                          uint first, uint tid) const {
        return tile_stream<T, ROWS, DP>(v + head_offset(p.v, b, kv_head), first, p.seqlen_k, p.v.seq,
                                        p.head_dim_v, tid);
    }
};

template <uint DP, uint BQ, uint BK, typename T, typename KV, typename Storage>
inline void attention_forward(device const T *q, KV kv, device T *out, device float *lse, device const uchar *mask,
                              device const float *alibi, device const float *sinks,
                              constant FlashAttentionParams &p, Storage tg, uint3 tgid, uint sgid,
                              uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;  // fragments across the slice
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint q0 = (tgid.x + p.block_offset) * BQ;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_q - q0);
    const uint row = q0 + s.row0 + at.row;
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    // From the first row's first key to the last row's last: the tiles the threadgroup visits.
    const uint key_begin = key_range(p, q0).first;
    const uint key_end = key_range(p, min(q0 + BQ, p.seqlen_q) - 1).end;
    const RowModifiers mods = row_modifiers(p, alibi, b, h, row);

    TileStream<T, BQ, DP> qs = tile_stream<T, BQ, DP>(q + head_offset(p.q, b, h), q0, p.seqlen_q,
                                                      p.q.seq, p.head_dim, tid);
    load_tile<BQ, DP>(tg->q, qs, q0, p, tid);
    auto ks = kv.template keys<BK, DP>(p, b, kv_head, key_begin, tid);
    auto vs = kv.template values<BK, DP>(p, b, kv_head, key_begin, tid);
    RowState<ND> r;
    start_rows(r, sinks_on(p), sinks_on(p) ? sinks[h] : 0.0f, at);
    const KeyRange unmasked = unmasked_keys(p, q0, BQ);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        forward_tile<DP, BQ, BK>(r, tg, ks, vs, mask, p, kv0, !tile_unmasked(unmasked, kv0, BK),
                                 row, mods, s, at, sgid, tid);
    }

    const float l = row_sum(r.l);
    if (row < p.seqlen_q) {
        store_row(out + head_offset(p.out, b, h) + ulong(row) * p.out.seq, r.o,
                  l > 0.0f ? 1.0f / l : 0.0f, p.head_dim_v, s, at);
        if (s.col0 == 0 && at.col == 0) {
            lse[lse_index(p, b, h, row)] = row_lse(r.m, l);
        }
    }
}

// ---- split-KV forward (decode) ---------------------------------------------------------------

// The rows of a split-KV threadgroup: the query rows of all heads of one GQA group, packed as
// index g * seqlen_q + i (head kv_head * group + g, query row i), BQ of them per block.
struct PackedRows {
    uint group;  // query heads per KV head
    uint count;  // group * seqlen_q
    uint first;  // the block's first packed index
    uint i_min;  // smallest and largest query row i among the block's rows
    uint i_max;
    bool full;   // the block has no padding rows
};

template <uint BQ>
inline PackedRows packed_rows(constant FlashAttentionParams &p, uint block) {
    PackedRows r;
    r.group = p.num_heads / p.num_kv_heads;
    r.count = r.group * p.seqlen_q;
    r.first = block * BQ;
    const uint last = min(r.first + BQ, r.count) - 1;
    const bool one_head = r.first / p.seqlen_q == last / p.seqlen_q;
    r.i_min = one_head ? r.first % p.seqlen_q : 0;
    r.i_max = one_head ? last % p.seqlen_q : p.seqlen_q - 1;
    r.full = r.first + BQ <= r.count;
    return r;
}

// The query head of packed row `packed` of KV head kv_head.
inline uint packed_head(constant FlashAttentionParams &p, PackedRows r, uint kv_head, uint packed) {
    return kv_head * r.group + packed / p.seqlen_q;
}

// Index of (packed row, chunk) in partial_lse; times head_dim_v, in partial_out.
inline ulong partial_index(constant FlashAttentionParams &p, PackedRows r, uint b, uint kv_head,
                           uint packed, uint chunk) {
    const uint h = packed_head(p, r, kv_head, packed);
    return ((ulong(b) * p.num_heads + h) * p.kv_chunks + chunk) * p.seqlen_q + packed % p.seqlen_q;
}

// One chunk of keys for one block of packed rows: threadgroups (row blocks x chunks, KV heads,
// batch), x = chunk * row_blocks + row block. Writes the chunk's normalised output and lse.
template <uint DP, uint BQ, uint BK, typename T, typename KV, typename Storage>
inline void attention_forward_split(device const T *q, KV kv, device const uchar *mask, device const float *alibi,
                                    device float *partial_out, device float *partial_lse,
                                    constant FlashAttentionParams &p, Storage tg, uint3 tgid,
                                    uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint row_blocks = (group * p.seqlen_q + BQ - 1) / BQ;
    const uint x = tgid.x + p.block_offset;
    const uint chunk = x / row_blocks;
    const PackedRows rows = packed_rows<BQ>(p, x % row_blocks);
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, rows.count - rows.first);
    const uint packed = rows.first + s.row0 + at.row;
    const bool valid = packed < rows.count;
    const uint row = valid ? packed % p.seqlen_q : p.seqlen_q;  // seqlen_q sees no key
    // The chunk's keys that some row of the block sees through the window, from a key tile of the
    // chunk: the element mask does not stop at chunk ends, so a tile must not cross into the next.
    const uint chunk_begin = chunk * p.kv_chunk_keys;
    const uint key_begin =
        chunk_begin + (max(chunk_begin, key_range(p, rows.i_min).first) - chunk_begin) / BK * BK;
    const uint key_end = min(chunk_begin + p.kv_chunk_keys, key_range(p, rows.i_max).end);
    const RowModifiers mods = row_modifiers(p, alibi, b, packed_head(p, rows, kv_head, valid ? packed : 0), row);

    // The packed rows come from several heads: copied once per launch, word by word.
    constexpr uint PER_WORD = TileWords<T>::PER_WORD;
    constexpr uint WORDS = DP / PER_WORD;
    for (uint e = tid; e < BQ * WORDS; e += FA_THREADS_PER_THREADGROUP) {
        const uint r = e / WORDS;
        const uint w = e % WORDS;
        const uint at_row = rows.first + r;
        uint bits = 0;
        for (uint i = 0; i < PER_WORD; ++i) {
            const uint d = w * PER_WORD + i;
            if (at_row < rows.count && d < p.head_dim) {
                bits |= TileWords<T>::bits(q[head_offset(p.q, b, packed_head(p, rows, kv_head, at_row)) +
                                    ulong(at_row % p.seqlen_q) * p.q.seq + d])
                        << (16 * i);
            }
        }
        tg->q[r][w / 4][w % 4] = bits;
    }
    auto ks = kv.template keys<BK, DP>(p, b, kv_head, key_begin, tid);
    auto vs = kv.template values<BK, DP>(p, b, kv_head, key_begin, tid);
    // The sink joins once, in the combine.
    RowState<ND> r;
    start_rows(r, false, 0.0f, at);
    const KeyRange unmasked = unmasked_keys(p, rows.i_min, rows.i_max - rows.i_min + 1);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        const bool masked = !rows.full || !tile_unmasked(unmasked, kv0, BK);
        forward_tile<DP, BQ, BK>(r, tg, ks, vs, mask, p, kv0, masked, row, mods, s, at, sgid, tid);
    }

    const float l = row_sum(r.l);
    if (valid) {
        const ulong index = partial_index(p, rows, b, kv_head, packed, chunk);
        store_row(partial_out + index * p.head_dim_v, r.o, l > 0.0f ? 1.0f / l : 0.0f, p.head_dim_v, s,
                  at);
        if (s.col0 == 0 && at.col == 0) {
            store_partial_lse(partial_lse, index, r.m, l);
        }
    }
}

#include "flash_attention_decode.h"

// Combines the chunks of one query row (threadgroup (i, h, b)) with the log-sum-exp merge of
// flash_attention_merge.h: out = sum_c w_c O_c / sum_c w_c with w_c = exp(lse_c - max_c lse_c),
// lse = max + log(sum_c w_c), chunks in order; a sink adds its weight to the denominator only. A
// chunk with lse -inf weighs 0 (its partial output is not used); a row without any key (and no
// sink) gets out 0, lse -inf.
// The weight of the chunk at entry `index` of partial_lse relative to the largest chunk max `top`:
// l exp(m - top), exactly 0 for a chunk without keys.
inline float chunk_weight(device const float *partial_lse, ulong index, float top) {
    const float m = partial_lse[2 * index];
    return m == -INFINITY ? 0.0f : precise::exp((m - top) + partial_lse[2 * index + 1]);
}

template <typename T>
inline void attention_forward_combine(device const float *partial_out,
                                      device const float *partial_lse, device const float *sinks,
                                      device T *out, device float *lse,
                                      constant FlashAttentionParams &p, uint3 tgid, uint tid) {
    const ulong first = (ulong(tgid.z) * p.num_heads + tgid.y) * p.kv_chunks * p.seqlen_q + tgid.x;
    const float sink = sinks_on(p) ? sinks[tgid.y] : -INFINITY;
    float top = sink;
    for (uint c = 0; c < p.kv_chunks; ++c) {
        top = max(top, partial_lse[2 * (first + ulong(c) * p.seqlen_q)]);
    }
    float total = merge_weight(sink, top);
    for (uint c = 0; c < p.kv_chunks; ++c) {
        total += chunk_weight(partial_lse, first + ulong(c) * p.seqlen_q, top);
    }
    const float scale = merge_normalizer(total);
    device T *out_row = out + head_offset(p.out, tgid.z, tgid.y) + ulong(tgid.x) * p.out.seq;
    for (uint d = tid; d < p.head_dim_v; d += FA_THREADS_PER_THREADGROUP) {
        float acc = 0.0f;
        for (uint c = 0; c < p.kv_chunks; ++c) {
            const ulong part = first + ulong(c) * p.seqlen_q;
            acc = merge_accumulate(acc, chunk_weight(partial_lse, part, top),
                                   partial_out[part * p.head_dim_v + d]);
        }
        out_row[d] = T(acc * scale);
    }
    if (tid == 0) {
        lse[row_index(tgid.z, p.num_heads, tgid.y, p.seqlen_q, tgid.x)] = merged_lse(top, total);
    }
}

// ---- backward: D = rowsum(dO * O) ----------------------------------------------------------

// Columns of dO and O per step of the delta pre-pass: 64 bytes of each row.
#define FA_DELTA_STEP_COLUMNS(T) (64 / sizeof(T))

template <typename T>
struct DeltaStorage {
    uint4 dout[FA_DELTA_BLOCK_ROWS][FA_ROW_CHUNKS(T, FA_DELTA_STEP_COLUMNS(T))];
    uint4 out[FA_DELTA_BLOCK_ROWS][FA_ROW_CHUNKS(T, FA_DELTA_STEP_COLUMNS(T))];
};

// One thread per query row; D in float32, read by both gradient kernels. The rows' columns are
// staged through threadgroup memory FA_DELTA_STEP_COLUMNS at a time with the tile copies, whose
// loads are coalesced (neighbouring threads read neighbouring chunks of a row), then each thread
// sums its own row.
template <typename T, typename Storage>
inline void attention_backward_delta(device const T *dout, device const T *out,
                                     device float *delta, constant FlashAttentionParams &p,
                                     Storage tg, uint3 tgid, uint tid) {
    constexpr uint STEP = FA_DELTA_STEP_COLUMNS(T);
    const uint first = (tgid.x + p.block_offset) * FA_DELTA_BLOCK_ROWS;
    const uint row = first + tid;
    device const T *dout_head = dout + head_offset(p.dout, tgid.z, tgid.y);
    device const T *out_head = out + head_offset(p.out, tgid.z, tgid.y);
    // Eight interleaved partial sums added pairwise (NumPy's float32 summation): a single
    // running sum over head_dim loses bits that dP - D, often a near-cancellation, exposes.
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (uint c0 = 0; c0 < p.head_dim_v; c0 += STEP) {
        TileStream<T, FA_DELTA_BLOCK_ROWS, STEP> ds = tile_stream<T, FA_DELTA_BLOCK_ROWS, STEP>(
            dout_head + c0, first, p.seqlen_q, p.dout.seq, p.head_dim_v - c0, tid);
        TileStream<T, FA_DELTA_BLOCK_ROWS, STEP> os = tile_stream<T, FA_DELTA_BLOCK_ROWS, STEP>(
            out_head + c0, first, p.seqlen_q, p.out.seq, p.head_dim_v - c0, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        load_tile<FA_DELTA_BLOCK_ROWS, STEP>(tg->dout, ds, first, p, tid);
        load_tile<FA_DELTA_BLOCK_ROWS, STEP>(tg->out, os, first, p, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // STEP is a multiple of 8, so column c0 + i belongs to partial sum i % 8.
        FA_UNROLL
        for (uint i = 0; i < STEP; ++i) {
            if (c0 + i < p.head_dim_v) {
                acc[i % 8] = fma(tile_element<T>(tg->dout, tid, i), tile_element<T>(tg->out, tid, i),
                                 acc[i % 8]);
            }
        }
    }
    if (row < p.seqlen_q) {
        delta[lse_index(p, tgid.z, tgid.y, row)] =
            ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

// ---- backward: the lse residual --------------------------------------------------------------

// From |lse| = 2^8 on, the float32 lse = m + log l the forward returns may have lost part of log l
// (its last bit is worth 2^-15 there); at Hugging Face's float32-minimum mask over a whole row it
// rounds to m, and exp(score - lse) would weigh every key 1 instead of 1 / l. Below, its rounding
// is no larger than that of the scores themselves.
#define FA_LSE_RESIDUAL_MIN 256.0f
// The residual is taken only where the given lse is the one this forward gives these keys: equal to
// it (the dense forward computes the very same m and l), or, for the split-KV forward's shapes
// (seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS, chunks merged in another order), within this fraction of
// its value (4 to 8 ulp). Any other lse, e.g. ring attention's global lse of a longer row, is used
// as given. Where that one rounds to this very value (a whole row of float32 minima, say), the two
// cannot be told apart and the block's own is used.
#define FA_LSE_RESIDUAL_MATCH 4.76837158203125e-7f  // 2^-21

inline bool needs_residual(float lse) {
    return isfinite(lse) && abs(lse) >= FA_LSE_RESIDUAL_MIN;
}

// R = log sum_j exp(S_j - L) from the row's own max m and sum l (l relative to m), in the order
// that keeps log l: L - m is exact (both huge, within a factor of 2), log l is not absorbed.
inline float residual_of_row(constant FlashAttentionParams &p, float m, float l, float lse) {
    const float slack = p.seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS ? abs(lse) * FA_LSE_RESIDUAL_MATCH : 0.0f;
    if (!needs_residual(lse) || !(l > 0.0f) || !(abs(row_lse(m, l) - lse) <= slack)) {
        return 0.0f;
    }
    return (m - lse) + precise::log(l);
}

// One threadgroup per BQ query rows, as the forward. A block none of whose rows needs a residual
// writes 0 and returns (the common case: one read of the block's lse). Otherwise the forward's
// scores and online softmax again, without V (same tiles, same order: the same m and l).
template <uint DP, uint BQ, uint BK, typename T, typename Storage>
inline void attention_backward_lse_residual(device const T *q, device const T *k,
                                            device const float *lse, device const uchar *mask,
                                            device const float *alibi, device const float *sinks,
                                            device float *residual,
                                            constant FlashAttentionParams &p, Storage tg,
                                            uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint q0 = (tgid.x + p.block_offset) * BQ;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_q - q0);
    const uint row = q0 + s.row0 + at.row;
    const uint last = min(q0 + BQ, p.seqlen_q) - 1;
    // The same answer in every thread, so the branch below is uniform over the threadgroup.
    bool needed = false;
    for (uint i = q0; i <= last; ++i) {
        needed = needed || needs_residual(lse[lse_index(p, b, h, i)]);
    }
    float value = 0.0f;
    if (needed) {
        const uint kv_head = h / (p.num_heads / p.num_kv_heads);
        const uint key_begin = key_range(p, q0).first;
        const uint key_end = key_range(p, last).end;
        const RowModifiers mods = row_modifiers(p, alibi, b, h, row);
        TileStream<T, BQ, DP> qs = tile_stream<T, BQ, DP>(q + head_offset(p.q, b, h), q0,
                                                          p.seqlen_q, p.q.seq, p.head_dim, tid);
        load_tile<BQ, DP>(tg->q, qs, q0, p, tid);
        TileStream<T, BK, DP> ks = tile_stream<T, BK, DP>(k + head_offset(p.k, b, kv_head),
                                                          key_begin, p.seqlen_k, p.k.seq,
                                                          p.head_dim, tid);
        RowState<ND> r;
        start_rows(r, sinks_on(p), sinks_on(p) ? sinks[h] : 0.0f, at);
        const KeyRange unmasked = unmasked_keys(p, q0, BQ);
        for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
            // (ks stands in for the V stream, which is not read.)
            forward_tile<DP, BQ, BK, ND, false>(r, tg, ks, ks, mask, p, kv0,
                                                !tile_unmasked(unmasked, kv0, BK), row, mods, s,
                                                at, sgid, tid);
        }
        const float l = row_sum(r.l);
        if (row < p.seqlen_q) {
            value = residual_of_row(p, r.m, l, lse[lse_index(p, b, h, row)]);
        }
    }
    if (row < p.seqlen_q && s.col0 == 0 && at.col == 0) {
        residual[lse_index(p, b, h, row)] = value;
    }
}

// ---- backward: dsinks -----------------------------------------------------------------------

struct DsinksStorage {
    float partial[FA_THREADS_PER_THREADGROUP];
};

// dsinks[h] = -sum over batch and query rows of exp(sinks[h] - lse - R) * D: a virtual key's
// dS = P (dP - D) with dP = 0 (it has no value). One threadgroup per head; each thread sums rows
// tid, tid + 128, ... in order, then a fixed tree adds the threads, so reruns are bit-identical.
template <typename Storage>
inline void attention_backward_dsinks(device const float *lse, device const float *delta,
                                      device const float *sinks, device const float *residual,
                                      device float *dsinks,
                                      constant FlashAttentionParams &p, Storage tg, uint h,
                                      uint tid) {
    const ulong rows = ulong(p.batch) * p.seqlen_q;
    float acc = 0.0f;
    for (ulong r = tid; r < rows; r += FA_THREADS_PER_THREADGROUP) {
        const ulong at = row_index(uint(r / p.seqlen_q), p.num_heads, h, p.seqlen_q, uint(r % p.seqlen_q));
        acc = fma(precise::exp((sinks[h] - backward_row_lse(lse[at])) - residual[at]), delta[at], acc);
    }
    tg->partial[tid] = acc;
    for (uint width = FA_THREADS_PER_THREADGROUP / 2; width > 0; width /= 2) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < width) {
            tg->partial[tid] += tg->partial[tid + width];
        }
    }
    if (tid == 0) {
        dsinks[h] = -tg->partial[0];
    }
}

// ---- backward: dQ ----------------------------------------------------------------------------

// SHARED: the K and V tiles share one buffer (when both would not fit in 32 KiB): V is loaded
// first for dP, then K for S and dQ, so each is still read once per tile.
template <typename T, uint DP, uint BQ, uint BK, bool SHARED>
struct BackwardQueryStorage {
    uint4 q[BQ][FA_ROW_CHUNKS(T, DP)];
    uint4 dout[BQ][FA_ROW_CHUNKS(T, DP)];
    uint4 k[BK][FA_ROW_CHUNKS(T, DP)];
    uint4 v[SHARED ? 1 : BK][FA_ROW_CHUNKS(T, DP)];
    FA_PARTIALS(s_partial, FA_SLICES(BQ), BK);
    FA_PARTIALS(dp_partial, FA_SLICES(BQ), BK);
};

template <uint DP, uint BQ, uint BK, bool SHARED, typename T, typename Storage>
inline void attention_backward_dq(device const T *dout, device const T *q, device const T *k,
                                  device const T *v, device const float *lse,
                                  device const float *delta, device const float *residual,
                                  device const uchar *mask, device const float *alibi,
                                  constant FlashAttentionParams &p, device T *dq, Storage tg,
                                  uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;
    constexpr uint NK = BK / 8;
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    auto v_tile = SHARED ? tg->k : tg->v;

    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint q0 = (tgid.x + p.block_offset) * BQ;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_q - q0);
    const uint row = q0 + s.row0 + at.row;
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    const uint key_begin = key_range(p, q0).first;
    const uint key_end = key_range(p, min(q0 + BQ, p.seqlen_q) - 1).end;
    const RowModifiers mods = row_modifiers(p, alibi, b, h, row);
    // Rows past the end have every element hidden: their L and D are not read.
    const ulong at_row = lse_index(p, b, h, row < p.seqlen_q ? row : 0);
    const float row_lse = row < p.seqlen_q ? backward_row_lse(lse[at_row]) : 0.0f;
    const float row_residual = row < p.seqlen_q ? residual[at_row] : 0.0f;
    const float row_delta = row < p.seqlen_q ? delta[at_row] : 0.0f;

    TileStream<T, BQ, DP> qs = tile_stream<T, BQ, DP>(q + head_offset(p.q, b, h), q0, p.seqlen_q,
                                                      p.q.seq, p.head_dim, tid);
    load_tile<BQ, DP>(tg->q, qs, q0, p, tid);
    TileStream<T, BQ, DP> ds = tile_stream<T, BQ, DP>(dout + head_offset(p.dout, b, h), q0,
                                                      p.seqlen_q, p.dout.seq, p.head_dim_v, tid);
    load_tile<BQ, DP>(tg->dout, ds, q0, p, tid);
    TileStream<T, BK, DP> ks = tile_stream<T, BK, DP>(k + head_offset(p.k, b, kv_head), key_begin,
                                                      p.seqlen_k, p.k.seq, p.head_dim, tid);
    TileStream<T, BK, DP> vs = tile_stream<T, BK, DP>(v + head_offset(p.v, b, kv_head), key_begin,
                                                      p.seqlen_k, p.v.seq, p.head_dim_v, tid);

    Fragments<ND> dq_acc;
    clear(dq_acc);
    const KeyRange unmasked = unmasked_keys(p, q0, BQ);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // V is read only transposed: paired rows where the bucket allows (PairedRows).
        constexpr uint V_PAIRED = SHARED ? 0 : PairedRows<T, DP>::WIDTH;
        load_tile<BK, DP, V_PAIRED != 0>(v_tile, vs, kv0, p, tid);
        if (!SHARED) {
            load_tile<BK, DP>(tg->k, ks, kv0, p, tid);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // dP = dO V^T.
        Fragments<NK> dp;
        product_transposed<T, ND, V_PAIRED>(dp, tg->dout, s.row0, v_tile, s, s.active_v, p, at);
        if (SHARED) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            load_tile<BK, DP>(tg->k, ks, kv0, p, tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }

        // S = Q K^T.
        Fragments<NK> sc;
        product_transposed<T, ND>(sc, tg->q, s.row0, tg->k, s, s.active, p, at);
        sum_over_slices<SLICES>(sc, tg->s_partial, sgid, s, at);
        sum_over_slices<SLICES>(dp, tg->dp_partial, sgid, s, at);

        // dS = P (dP - D) (through the softcap), in place of S.
        const TileWindow window =
            tile_window(mods.keys, kv0 + at.col, !tile_unmasked(unmasked, kv0, BK));
        FA_UNROLL
        for (uint j = 0; j < NK; ++j) {
            FA_UNROLL
            for (uint e = 0; e < 2; ++e) {
                float t;
                const float x = score<T>(p, mask, sc.f[j].thread_elements()[e], row,
                                          kv0 + j * 8 + at.col + e, mods, window.visible(j * 8 + e), t);
                const float pe = probability(x, row_lse, row_residual);
                sc.f[j].thread_elements()[e] =
                    through_softcap(p, pe * (dp.f[j].thread_elements()[e] - row_delta), t);
            }
        }

        // dQ += dS K.
        accumulate_product<T>(dq_acc, sc, tg->k, s, s.active, p, at);
    }

    if (row < p.seqlen_q) {
        store_row(dq + head_offset(p.dq, b, h) + ulong(row) * p.dq.seq, dq_acc, p.softmax_scale,
                  p.head_dim, s, at);
    }
}

// ---- backward: dK and dV ---------------------------------------------------------------------

// SHARED: the Q and dO tiles share one buffer (when both would not fit in 32 KiB): Q for S, then
// dO for dP and dV, then Q again for dK.
template <typename T, uint DP, uint BK, uint BQ, bool SHARED>
struct BackwardKeyValueStorage {
    uint4 k[BK][FA_ROW_CHUNKS(T, DP)];
    uint4 v[BK][FA_ROW_CHUNKS(T, DP)];
    uint4 q[BQ][FA_ROW_CHUNKS(T, DP)];
    uint4 dout[SHARED ? 1 : BQ][FA_ROW_CHUNKS(T, DP)];
    float lse[BQ];       // lse of the tile's rows (0 for rows past the end)
    float residual[BQ];  // their lse residual R (0 likewise)
    float delta[BQ];     // D of the tile's rows (0 likewise)
    FA_PARTIALS(s_partial, FA_SLICES(BK), BQ);
    FA_PARTIALS(dp_partial, FA_SLICES(BK), BQ);
};

template <uint DP, uint BK, uint BQ, bool SHARED, typename T, typename Storage>
inline void attention_backward_dkv(device const T *dout, device const T *q, device const T *k,
                                   device const T *v, device const float *lse,
                                   device const float *delta, device const float *residual,
                                   device const uchar *mask, device const float *alibi,
                                   constant FlashAttentionParams &p, device T *dk, device T *dv,
                                   Storage tg, uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BK);
    constexpr uint ND = DP / SLICES / 8;
    constexpr uint NQ = BQ / 8;  // fragments across a query tile
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    auto dout_tile = SHARED ? tg->q : tg->dout;

    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint k0 = (tgid.x + p.block_offset) * BK;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_k - k0);
    const uint key = k0 + s.row0 + at.row;
    // The query rows that see some key of the block through the window.
    const KeyRange rows = row_range(p, k0, BK);

    TileStream<T, BK, DP> ks = tile_stream<T, BK, DP>(k + head_offset(p.k, b, kv_head), k0,
                                                      p.seqlen_k, p.k.seq, p.head_dim, tid);
    load_tile<BK, DP>(tg->k, ks, k0, p, tid);
    TileStream<T, BK, DP> vs = tile_stream<T, BK, DP>(v + head_offset(p.v, b, kv_head), k0,
                                                      p.seqlen_k, p.v.seq, p.head_dim_v, tid);
    load_tile<BK, DP>(tg->v, vs, k0, p, tid);
    // Streams over each query head's Q and dO, moved to the head below.
    TileStream<T, BQ, DP> qs = tile_stream<T, BQ, DP>(q, rows.first, p.seqlen_q, p.q.seq,
                                                      p.head_dim, tid);
    TileStream<T, BQ, DP> ds = tile_stream<T, BQ, DP>(dout, rows.first, p.seqlen_q, p.dout.seq,
                                                      p.head_dim_v, tid);

    Fragments<ND> dk_acc;
    Fragments<ND> dv_acc;
    clear(dk_acc);
    clear(dv_acc);
    for (uint g = 0; g < group; ++g) {
        const uint h = kv_head * group + g;
        seek(qs, q + head_offset(p.q, b, h), rows.first);
        seek(ds, dout + head_offset(p.dout, b, h), rows.first);
        // The head's slope and mask start; per element only the mask row moves.
        const RowModifiers head_mods = row_modifiers(p, alibi, b, h, 0);
        // The head's rows of lse, residual and delta (one 64-bit multiply per head, not per tile).
        const ulong head_rows = lse_index(p, b, h, 0);
        for (uint q0 = rows.first; q0 < rows.end; q0 += BQ) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            load_tile<BQ, DP>(tg->q, qs, q0, p, tid);
            if (!SHARED) {
                load_tile<BQ, DP>(tg->dout, ds, q0, p, tid);
            }
            if (tid < BQ) {
                const uint r = q0 + tid;
                const ulong at_row = head_rows + (r < p.seqlen_q ? r : 0);
                tg->lse[tid] = r < p.seqlen_q ? backward_row_lse(lse[at_row]) : 0.0f;
                tg->residual[tid] = r < p.seqlen_q ? residual[at_row] : 0.0f;
                tg->delta[tid] = r < p.seqlen_q ? delta[at_row] : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            // S^T = K Q^T.
            Fragments<NQ> st;
            product_transposed<T, ND>(st, tg->k, s.row0, tg->q, s, s.active, p, at);
            if (SHARED) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
                load_tile<BQ, DP>(dout_tile, ds, q0, p, tid);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }

            // dP^T = V dO^T.
            Fragments<NQ> dpt;
            product_transposed<T, ND>(dpt, tg->v, s.row0, dout_tile, s, s.active_v, p, at);
            sum_over_slices<SLICES>(st, tg->s_partial, sgid, s, at);
            sum_over_slices<SLICES>(dpt, tg->dp_partial, sgid, s, at);

            // P^T in place of S^T, dS^T (through the softcap) in place of dP^T.
            const bool masked = !tile_unmasked(p, q0, BQ, k0, BK);
            FA_UNROLL
            for (uint j = 0; j < NQ; ++j) {
                FA_UNROLL
                for (uint e = 0; e < 2; ++e) {
                    const uint i = j * 8 + at.col + e;
                    RowModifiers mods = head_mods;
                    mods.mask_row += ulong(q0 + i) * p.mask.seq;
                    mods.keys = visible_keys(p, q0 + i);
                    float t;
                    const float x = score<T>(p, mask, st.f[j].thread_elements()[e], q0 + i, key,
                                              mods, !masked || in_window(mods.keys, key), t);
                    const float pe = probability(x, tg->lse[i], tg->residual[i]);
                    st.f[j].thread_elements()[e] = pe;
                    dpt.f[j].thread_elements()[e] =
                        through_softcap(p, pe * (dpt.f[j].thread_elements()[e] - tg->delta[i]), t);
                }
            }

            // dV += P^T dO.
            accumulate_product<T>(dv_acc, st, dout_tile, s, s.active_v, p, at);
            if (SHARED) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
                reload_tile<BQ, DP>(tg->q, qs, q0, p, tid);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }

            // dK += dS^T Q.
            accumulate_product<T>(dk_acc, dpt, tg->q, s, s.active, p, at);
        }
    }

    if (key < p.seqlen_k) {
        store_row(dk + head_offset(p.dk, b, kv_head) + ulong(key) * p.dk.seq, dk_acc,
                  p.softmax_scale, p.head_dim, s, at);
        store_row(dv + head_offset(p.dv, b, kv_head) + ulong(key) * p.dv.seq, dv_acc, 1.0f,
                  p.head_dim_v, s, at);
    }
}

// ---- instances -------------------------------------------------------------------------------

// Whether a backward kernel's two streamed tiles must share one buffer to fit in 32 KiB.
#define FA_DQ_SHARED(T, DP, BQ, BK) (sizeof(BackwardQueryStorage<T, DP, BQ, BK, false>) > 32768)
#define FA_DKV_SHARED(T, DP, BK, BQ) (sizeof(BackwardKeyValueStorage<T, DP, BK, BQ, false>) > 32768)

// The buffers every forward kernel binds, in [[buffer(i)]] order up to sinks. `params` points at
// the host's parameter struct, or in a varlen pass at the sequence table that starts with it
// (sequence_params): a pointer, so that reading past the first struct is indexing an array whose
// length the compiler does not assume.
#define FA_FORWARD_KERNEL_BUFFERS(T)                                                               \
    device const T *q [[buffer(FA_FORWARD_BUFFER_Q)]],                                             \
        device const T *k [[buffer(FA_FORWARD_BUFFER_K)]],                                         \
        device const T *v [[buffer(FA_FORWARD_BUFFER_V)]],                                         \
        device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],                                           \
        device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],                                       \
        constant FlashAttentionParams *params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],                \
        device const uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],                               \
        device const float *alibi [[buffer(FA_FORWARD_BUFFER_ALIBI)]],                             \
        device const float *sinks [[buffer(FA_FORWARD_BUFFER_SINKS)]]

// The buffers every backward kernel binds, in [[buffer(i)]] order up to the lse residual; DELTA
// and RESIDUAL are `const` except in the kernel that writes that workspace.
#define FA_BACKWARD_KERNEL_BUFFERS(T, DELTA, RESIDUAL)                                             \
    device const T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                                      \
        device const T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                        \
        device const T *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                        \
        device const T *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                        \
        device const T *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                    \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams *params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device DELTA float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],                            \
        device const uchar *mask [[buffer(FA_BACKWARD_BUFFER_MASK)]],                              \
        device const float *alibi [[buffer(FA_BACKWARD_BUFFER_ALIBI)]],                            \
        device const float *sinks [[buffer(FA_BACKWARD_BUFFER_SINKS)]],                            \
        device RESIDUAL float *lse_residual [[buffer(FA_BACKWARD_BUFFER_LSE_RESIDUAL)]]

// A tensor's pointer moved to the first query row (key) of the sequence of struct `p`
// (flash_attention_varlen.h); unmoved in a dense problem, whose seq_q0 and seq_k0 are 0.
#define FA_QUERY_ROWS(X) ((X) + ulong(p.seq_q0) * p.X.seq)
#define FA_KEY_ROWS(X) ((X) + ulong(p.seq_k0) * p.X.seq)

// The kernels of one dtype (element type T, name suffix SUFFIX) that do not depend on the bucket.
#define FA_DEFINE_DTYPE_KERNELS(T, SUFFIX)                                                         \
    typedef DeltaStorage<T> flash_attention_backward_delta_##SUFFIX##_threadgroup;                 \
                                                                                                   \
    kernel void flash_attention_forward_combine_##SUFFIX(                                          \
        FA_FORWARD_KERNEL_BUFFERS(T),                                                              \
        device const float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                 \
        device const float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                 \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        attention_forward_combine(partial_out, partial_lse, sinks, out, lse, *params, tgid, tid);  \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_delta_##SUFFIX(                                           \
        FA_BACKWARD_KERNEL_BUFFERS(T, , const),                                                    \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        threadgroup flash_attention_backward_delta_##SUFFIX##_threadgroup tg;                      \
        constant FlashAttentionParams &p = sequence_params(params, tgid.z);                        \
        if (block_past_end((tgid.x + p.block_offset) * FA_DELTA_BLOCK_ROWS, p.seqlen_q)) {          \
            return;                                                                                \
        }                                                                                          \
        attention_backward_delta(FA_QUERY_ROWS(dout), FA_QUERY_ROWS(out), delta + p.seq_q0, p, &tg, \
                                 sequence_tgid(p, tgid), tid);                                     \
    }

// The kernels of one dtype and head-dim bucket. The threadgroup storage type of kernel K is
// K_threadgroup, so a host (the CPU engine) can size it.
#define FA_DEFINE_KERNELS(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)             \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_##SUFFIX##_d##DP##_threadgroup;                                    \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_split_##SUFFIX##_d##DP##_threadgroup;                              \
    FA_IF_DECODE(DP, typedef DecodeStorage<DP>                                                     \
                         flash_attention_forward_decode_##SUFFIX##_d##DP##_threadgroup;)           \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK, false>                                           \
        flash_attention_backward_lse_residual_##SUFFIX##_d##DP##_threadgroup;                      \
    typedef BackwardQueryStorage<T, DP, DQ_BQ, DQ_BK, FA_DQ_SHARED(T, DP, DQ_BQ, DQ_BK)>           \
        flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup;                                \
    typedef BackwardKeyValueStorage<T, DP, DKV_BK, DKV_BQ, FA_DKV_SHARED(T, DP, DKV_BK, DKV_BQ)>   \
        flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup;                               \
    static_assert(sizeof(flash_attention_forward_##SUFFIX##_d##DP##_threadgroup) <= 32768 &&       \
                      sizeof(flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup) <= 32768 && \
                      sizeof(flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup) <= 32768,  \
                  "threadgroup storage above 32 KiB");                                             \
    static_assert(sizeof(T) == 4 || DP > 128 ||                                                    \
                      FA_CORE_THREADGROUP_BYTES /                                                  \
                              sizeof(flash_attention_forward_##SUFFIX##_d##DP##_threadgroup) >=    \
                          FA_FORWARD_MIN_THREADGROUPS_PER_CORE,                                    \
                  "forward threadgroups per core below the target (flash_attention_params.h)");    \
    static_assert(DP % (8 * FA_SLICES(FWD_BQ)) == 0 && DP % (8 * FA_SLICES(DQ_BQ)) == 0 &&         \
                      DP % (8 * FA_SLICES(DKV_BK)) == 0 && FWD_BK % 8 == 0 && DQ_BK % 8 == 0 &&    \
                      DKV_BQ % 8 == 0,                                                             \
                  "blocks must split into 8x8 fragments");                                         \
    static_assert(DP <= (sizeof(T) == 4 ? FA_MAX_HEAD_DIM_F32 : FA_MAX_HEAD_DIM),                  \
                  "a bucket above the dtype's largest head_dim (flash_attention_params.h)");       \
    static_assert(FA_ACCUMULATOR_FLOATS(DP, FWD_BQ) <= FA_MAX_ACCUMULATOR_FLOATS &&                \
                      FA_ACCUMULATOR_FLOATS(DP, DQ_BQ) <= FA_MAX_ACCUMULATOR_FLOATS &&             \
                      2 * FA_ACCUMULATOR_FLOATS(DP, DKV_BK) <= FA_MAX_ACCUMULATOR_FLOATS,          \
                  "accumulators per lane above the budget (flash_attention_params.h)");            \
    static_assert((0 FA_IF_DECODE(DP, +1)) == (DP <= FA_DECODE_MAX_HEAD_DIM),                     \
                  "FA_IF_DECODE_<DP> disagrees with FA_DECODE_MAX_HEAD_DIM");                     \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_##SUFFIX##_d##DP(                                          \
        FA_FORWARD_KERNEL_BUFFERS(T),                                                              \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_##SUFFIX##_d##DP##_threadgroup tg;                     \
        constant FlashAttentionParams &p = sequence_params(params, tgid.z);                        \
        if (block_past_end((tgid.x + p.block_offset) * FWD_BQ, p.seqlen_q)) {                      \
            return;                                                                                \
        }                                                                                          \
        attention_forward<DP, FWD_BQ, FWD_BK>(                                                     \
            FA_QUERY_ROWS(q), DeviceKV<T>{FA_KEY_ROWS(k), FA_KEY_ROWS(v)}, FA_QUERY_ROWS(out),     \
            lse + p.seq_q0,                                                                        \
            mask, sequence_alibi(p, alibi, tgid.z), sinks, p, &tg, sequence_tgid(p, tgid), sgid,   \
            lane);                                                                                 \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_split_##SUFFIX##_d##DP(                                    \
        FA_FORWARD_KERNEL_BUFFERS(T),                                                              \
        device float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                       \
        device float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                       \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_split_##SUFFIX##_d##DP##_threadgroup tg;               \
        attention_forward_split<DP, FWD_BQ, FWD_BK>(q, DeviceKV<T>{k, v}, mask, alibi, partial_out, \
                                                    partial_lse, *params, &tg, tgid, sgid, lane);  \
    }                                                                                              \
                                                                                                   \
    FA_IF_DECODE(DP,                                                                               \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_decode_##SUFFIX##_d##DP(                                   \
        FA_FORWARD_KERNEL_BUFFERS(T),                                                              \
        device float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                       \
        device float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                       \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_decode_##SUFFIX##_d##DP##_threadgroup tg;              \
        attention_forward_decode<DP>(q, DeviceKV<T>{k, v}, mask, alibi, partial_out, partial_lse,  \
                                     *params, &tg, tgid, sgid, lane);                              \
    })                                                                                             \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_lse_residual_##SUFFIX##_d##DP(                            \
        FA_BACKWARD_KERNEL_BUFFERS(T, const, ),                                                    \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_backward_lse_residual_##SUFFIX##_d##DP##_threadgroup tg;       \
        constant FlashAttentionParams &p = sequence_params(params, tgid.z);                        \
        if (block_past_end((tgid.x + p.block_offset) * FWD_BQ, p.seqlen_q)) {                      \
            return;                                                                                \
        }                                                                                          \
        attention_backward_lse_residual<DP, FWD_BQ, FWD_BK>(                                       \
            FA_QUERY_ROWS(q), FA_KEY_ROWS(k), lse + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), \
            sinks, lse_residual + p.seq_q0, p, &tg, sequence_tgid(p, tgid), sgid, lane);           \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_dq_##SUFFIX##_d##DP(                                      \
        FA_BACKWARD_KERNEL_BUFFERS(T, const, const),                                               \
        device T *dq [[buffer(FA_BACKWARD_BUFFER_DQ)]],                                            \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup tg;                 \
        constant FlashAttentionParams &p = sequence_params(params, tgid.z);                        \
        if (block_past_end((tgid.x + p.block_offset) * DQ_BQ, p.seqlen_q)) {                       \
            return;                                                                                \
        }                                                                                          \
        attention_backward_dq<DP, DQ_BQ, DQ_BK, FA_DQ_SHARED(T, DP, DQ_BQ, DQ_BK)>(                \
            FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), lse + p.seq_q0, \
            delta + p.seq_q0, lse_residual + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), p,  \
            FA_QUERY_ROWS(dq), &tg, sequence_tgid(p, tgid), sgid, lane);                           \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_dkv_##SUFFIX##_d##DP(                                     \
        FA_BACKWARD_KERNEL_BUFFERS(T, const, const),                                               \
        device T *dk [[buffer(FA_BACKWARD_BUFFER_DK)]],                                            \
        device T *dv [[buffer(FA_BACKWARD_BUFFER_DV)]],                                            \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup tg;                \
        constant FlashAttentionParams &p = sequence_params(params, tgid.z);                        \
        if (block_past_end((tgid.x + p.block_offset) * DKV_BK, p.seqlen_k)) {                      \
            return;                                                                                \
        }                                                                                          \
        attention_backward_dkv<DP, DKV_BK, DKV_BQ, FA_DKV_SHARED(T, DP, DKV_BK, DKV_BQ)>(          \
            FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), lse + p.seq_q0, \
            delta + p.seq_q0, lse_residual + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), p,  \
            FA_KEY_ROWS(dk), FA_KEY_ROWS(dv), &tg, sequence_tgid(p, tgid), sgid, lane);            \
    }

// Reads only lse, delta and sinks (float), whatever the dtype of the other tensors.
typedef DsinksStorage flash_attention_backward_dsinks_threadgroup;

[[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]
kernel void flash_attention_backward_dsinks(
    FA_BACKWARD_KERNEL_BUFFERS(uchar, const, const),
    device float *dsinks [[buffer(FA_BACKWARD_BUFFER_DSINKS)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
    threadgroup flash_attention_backward_dsinks_threadgroup tg;
    attention_backward_dsinks(lse, delta, sinks, lse_residual, dsinks, *params, &tg, tgid.x, tid);
}

// The first dispatch of a varlen pass (flash_attention_varlen.h): one threadgroup.
typedef VarlenSequencesStorage flash_attention_varlen_sequences_threadgroup;

[[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]
kernel void flash_attention_varlen_sequences(
    device const int *cu_seqlens_q [[buffer(FA_VARLEN_BUFFER_CU_SEQLENS_Q)]],
    device const int *cu_seqlens_k [[buffer(FA_VARLEN_BUFFER_CU_SEQLENS_K)]],
    device FlashAttentionParams *table [[buffer(FA_VARLEN_BUFFER_TABLE)]],
    constant FlashAttentionParams &params [[buffer(FA_VARLEN_BUFFER_PARAMS)]],
    uint tid [[thread_index_in_threadgroup]]) {
    threadgroup flash_attention_varlen_sequences_threadgroup tg;
    varlen_sequences(cu_seqlens_q, cu_seqlens_k, table, params, &tg, tid);
}

#include "flash_attention_kv_cache.h"

#define FA_DEFINE_F16(...) FA_DEFINE_KERNELS(half, f16, __VA_ARGS__) FA_DEFINE_KV_CACHE_KERNELS(half, f16, __VA_ARGS__)
#define FA_DEFINE_BF16(...) FA_DEFINE_KERNELS(bfloat, bf16, __VA_ARGS__) FA_DEFINE_KV_CACHE_KERNELS(bfloat, bf16, __VA_ARGS__)
#define FA_DEFINE_F32(...) FA_DEFINE_KERNELS(float, f32, __VA_ARGS__) FA_DEFINE_KV_CACHE_KERNELS(float, f32, __VA_ARGS__)

// The dtypes this compile instantiates (FA_DTYPE_MASK_* of flash_attention_params.h), every one
// unless a prelude defines FA_DTYPES: a host whose compile of the whole source fails compiles each
// dtype alone, so that a compiler failure loses only that dtype's kernels.
#ifndef FA_DTYPES
#define FA_DTYPES (FA_DTYPE_MASK_F16 | FA_DTYPE_MASK_F32 | FA_DTYPE_MASK_BF16)
#endif

#if FA_DTYPES & FA_DTYPE_MASK_F16
FA_DEFINE_DTYPE_KERNELS(half, f16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16)
#endif
#if FA_DTYPES & FA_DTYPE_MASK_F32
FA_DEFINE_DTYPE_KERNELS(float, f32)
FA_HEAD_DIM_BUCKETS_F32(FA_DEFINE_F32)
#endif
// bfloat needs MSL 3.1 (macOS 14, iOS 17); older compilers get the other dtypes.
#if (!defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)) && (FA_DTYPES & FA_DTYPE_MASK_BF16)
FA_DEFINE_DTYPE_KERNELS(bfloat, bf16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_BF16)
#endif

// fa_merge_attention(_v2): two results over disjoint key sets -> the result over their union
// (flash_attention_merge.h), one kernel per dtype.
#if FA_DTYPES & FA_DTYPE_MASK_F16
FA_DEFINE_MERGE_KERNEL(half, f16)
#endif
#if FA_DTYPES & FA_DTYPE_MASK_F32
FA_DEFINE_MERGE_KERNEL(float, f32)
#endif
#if (!defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)) && (FA_DTYPES & FA_DTYPE_MASK_BF16)
FA_DEFINE_MERGE_KERNEL(bfloat, bf16)
#endif
