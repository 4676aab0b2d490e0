// The backward kernels' bodies: the delta pre-pass, the lse residual, dsinks, dQ and dK/dV.
#ifndef FLASH_ATTENTION_BACKWARD_H
#define FLASH_ATTENTION_BACKWARD_H

#include "flash_attention_forward.h"

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
        // (ks stands in for the V stream, which is not read.)
        KVTiles<TileStream<T, BK, DP>, TileStream<T, BK, DP>> kvs = kv_tiles(ks, ks);
        for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
            forward_tile<DP, BQ, BK, ND, false>(r, tg, kvs, mask, p, kv0,
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
    const uint stream = dropout_stream(p, b, h);

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

        // dS = P (dP - D) (through the softcap), in place of S. With dropout, dP is with respect
        // to the dropped P (dO V^T) times the mask's factor (D = rowsum(dO O) already is the
        // dropped out's).
        const TileWindow window =
            tile_window(mods.keys, kv0 + at.col, !tile_unmasked(unmasked, kv0, BK));
        FA_UNROLL
        for (uint j = 0; j < NK; ++j) {
            const DropoutFactors keep = dropout_on(p) ? dropout_factors(p, stream, row, kv0 + j * 8 + at.col)
                                                      : no_dropout();
            FA_UNROLL
            for (uint e = 0; e < 2; ++e) {
                float t;
                const float x = score<T>(p, mask, sc.f[j].thread_elements()[e], row,
                                          kv0 + j * 8 + at.col + e, mods, window.visible(j * 8 + e), t);
                const float pe = probability(x, row_lse, row_residual);
                const float dpe = dp.f[j].thread_elements()[e] * (e == 0 ? keep.first : keep.second);
                sc.f[j].thread_elements()[e] = through_softcap(p, pe * (dpe - row_delta), t);
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

// The query heads [first, end) of a KV head's GQA group that one dK/dV threadgroup sums over: the
// whole group, or one split of it (backward_dkv_split).
struct GroupHeads {
    uint first;
    uint end;
};

// Split `split` of the group: dkv_splits consecutive ranges of ceil(group / dkv_splits) heads.
inline GroupHeads group_split(constant FlashAttentionParams &p, uint split) {
    const uint group = p.num_heads / p.num_kv_heads;
    const uint per_split = (group + p.dkv_splits - 1) / p.dkv_splits;
    GroupHeads g;
    g.first = min(split * per_split, group);
    g.end = min(g.first + per_split, group);
    return g;
}

// Where dK and dV go: dk and dv themselves (rounded to T, dK scaled by softmax_scale).
template <typename T>
struct KeyValueGradients {
    device T *dk;
    device T *dv;

    template <uint N>
    inline void store(constant FlashAttentionParams &p, uint b, uint kv_head, uint key,
                      thread Fragments<N> &dk_acc, thread Fragments<N> &dv_acc, SimdgroupSlice s,
                      FragmentCoord at) const {
        store_row(dk + head_offset(p.dk, b, kv_head) + ulong(key) * p.dk.seq, dk_acc, p.softmax_scale,
                  p.head_dim, s, at);
        store_row(dv + head_offset(p.dv, b, kv_head) + ulong(key) * p.dv.seq, dv_acc, 1.0f,
                  p.head_dim_v, s, at);
    }
};

// Row `key` of split `split` in partial_dk and partial_dv ([batch][num_kv_heads][dkv_splits][rows]
// rows of head_dim and head_dim_v floats; rows: the keys of the host's struct).
inline ulong partial_key_row(constant FlashAttentionParams &p, uint rows, uint b, uint kv_head, uint split,
                             uint key) {
    return ((ulong(b) * p.num_kv_heads + kv_head) * p.dkv_splits + split) * rows + key;
}

// Where a split's dK and dV go: its float32 partial sums, unscaled (backward_dkv_reduce scales and
// rounds their sum once).
struct PartialKeyValueGradients {
    device float *dk;
    device float *dv;
    uint rows;
    uint split;

    template <uint N>
    inline void store(constant FlashAttentionParams &p, uint b, uint kv_head, uint key,
                      thread Fragments<N> &dk_acc, thread Fragments<N> &dv_acc, SimdgroupSlice s,
                      FragmentCoord at) const {
        const ulong row = partial_key_row(p, rows, b, kv_head, split, key);
        store_row(dk + row * p.head_dim, dk_acc, 1.0f, p.head_dim, s, at);
        store_row(dv + row * p.head_dim_v, dv_acc, 1.0f, p.head_dim_v, s, at);
    }
};

// One threadgroup per BK keys (block `block`) of KV head tgid.y, summing over query `heads` of its
// GQA group in order; `out` stores the sums (KeyValueGradients or PartialKeyValueGradients).
template <uint DP, uint BK, uint BQ, bool SHARED, typename T, typename Out, typename Storage>
inline void attention_backward_dkv(device const T *dout, device const T *q, device const T *k,
                                   device const T *v, device const float *lse,
                                   device const float *delta, device const float *residual,
                                   device const uchar *mask, device const float *alibi,
                                   constant FlashAttentionParams &p, Out out, Storage tg, uint block,
                                   GroupHeads heads, uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BK);
    constexpr uint ND = DP / SLICES / 8;
    constexpr uint NQ = BQ / 8;  // fragments across a query tile
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    auto dout_tile = SHARED ? tg->q : tg->dout;

    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint k0 = block * BK;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_k - k0);
    const uint key = k0 + s.row0 + at.row;
    // The query rows that see some key of the block through the window, and those that see this
    // lane's key (none past the end): a tile's element mask is then one compare per element
    // (TileWindow over query rows), as the forward's and dQ's are over keys.
    const KeyRange rows = row_range(p, k0, BK);
    KeyRange seen = row_range(p, key, 1);
    seen.end = key < p.seqlen_k ? seen.end : seen.first;

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
    for (uint g = heads.first; g < heads.end; ++g) {
        const uint h = kv_head * group + g;
        seek(qs, q + head_offset(p.q, b, h), rows.first);
        seek(ds, dout + head_offset(p.dout, b, h), rows.first);
        // The head's slope and mask start; per element only the mask row moves.
        const RowModifiers head_mods = row_modifiers(p, alibi, b, h, 0);
        const uint stream = dropout_stream(p, b, h);
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

            // P^T in place of S^T, dS^T (through the softcap) in place of dP^T; with dropout the
            // dropped P^T for dV and dP^T times the mask's factor (as in dQ).
            const TileWindow window = tile_window(seen, q0 + at.col, !tile_unmasked(p, q0, BQ, k0, BK));
            FA_UNROLL
            for (uint j = 0; j < NQ; ++j) {
                FA_UNROLL
                for (uint e = 0; e < 2; ++e) {
                    const uint i = j * 8 + at.col + e;
                    RowModifiers mods = head_mods;
                    mods.mask_row += ulong(q0 + i) * p.mask.seq;
                    float t;
                    const float x = score<T>(p, mask, st.f[j].thread_elements()[e], q0 + i, key,
                                              mods, window.visible(j * 8 + e), t);
                    const float pe = probability(x, tg->lse[i], tg->residual[i]);
                    const float kept = dropout_on(p) ? dropout_factor(p, stream, q0 + i, key) : 1.0f;
                    st.f[j].thread_elements()[e] = pe * kept;
                    dpt.f[j].thread_elements()[e] =
                        through_softcap(p, pe * (dpt.f[j].thread_elements()[e] * kept - tg->delta[i]), t);
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
        out.store(p, b, kv_head, key, dk_acc, dv_acc, s, at);
    }
}

// ---- backward: the split dK/dV's reduction ------------------------------------------------------

// One threadgroup per FA_DKV_REDUCE_ROWS keys from `first` of KV head tgid.y: each element of dk
// and dv is the sum of its dkv_splits partial sums, added in split order (so reruns are
// bit-identical), scaled (dK by softmax_scale) and rounded to T once, as the unsplit kernel's.
template <typename T>
inline void attention_backward_dkv_reduce(device const float *partial_dk, device const float *partial_dv,
                                          uint rows, device T *dk, device T *dv,
                                          constant FlashAttentionParams &p, uint first, uint3 tgid,
                                          uint tid) {
    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint last = min(first + FA_DKV_REDUCE_ROWS, p.seqlen_k);
    // A split's rows lie rows x head_dim (head_dim_v) floats after the previous split's.
    const ulong dk_split = ulong(rows) * p.head_dim;
    const ulong dv_split = ulong(rows) * p.head_dim_v;
    for (uint key = first; key < last; ++key) {
        device const float *dk_sums = partial_dk + partial_key_row(p, rows, b, kv_head, 0, key) * p.head_dim;
        device const float *dv_sums = partial_dv + partial_key_row(p, rows, b, kv_head, 0, key) * p.head_dim_v;
        device T *dk_row = dk + head_offset(p.dk, b, kv_head) + ulong(key) * p.dk.seq;
        device T *dv_row = dv + head_offset(p.dv, b, kv_head) + ulong(key) * p.dv.seq;
        for (uint c = tid; c < p.head_dim; c += FA_THREADS_PER_THREADGROUP) {
            float sum = dk_sums[c];
            for (uint split = 1; split < p.dkv_splits; ++split) {
                sum += dk_sums[split * dk_split + c];
            }
            dk_row[c] = T(sum * p.softmax_scale);
        }
        for (uint c = tid; c < p.head_dim_v; c += FA_THREADS_PER_THREADGROUP) {
            float sum = dv_sums[c];
            for (uint split = 1; split < p.dkv_splits; ++split) {
                sum += dv_sums[split * dv_split + c];
            }
            dv_row[c] = T(sum);
        }
    }
}

#endif
