// The forward kernels' bodies: the dense forward (Algorithm 1), the tiled split-KV forward and the
// combine of its chunks (flash_attention_decode.h has the decode forward).
#ifndef FLASH_ATTENTION_FORWARD_H
#define FLASH_ATTENTION_FORWARD_H

#include "flash_attention_products.h"
#include "flash_attention_scores.h"
#include "flash_attention_merge.h"

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

// One K/V tile of the forward pass, keys [kv0, kv0 + BK) (the next tiles of the KV head's K and V
// from kvs, KVTiles or a cache's source): loads the tiles (every thread calls it; V only after S
// where K and V share a buffer), S = Q K^T over the slice and then over all of head_dim, masks (only when
// `masked`; the lane's row is query `row`), online softmax update, O += P V (without WITH_V,
// only m and l: V is neither loaded nor multiplied). DROPOUT: the kernel reads the dropout
// function constant (the dense forward; the split kernels never get a call with dropout) and, when
// it is on, P enters O += P V dropped (its row sum l stays undropped: lse is of the scores), the
// row's mask drawn from Philox stream `stream` (flash_attention_philox.h).
template <uint DP, uint BQ, uint BK, uint ND, bool WITH_V = true, bool DROPOUT = false,
          typename KVS, typename Storage>
FA_ALWAYS_INLINE void forward_tile(thread RowState<ND> &r, Storage tg, thread KVS &kvs,
                                   device const uchar *mask,
                                   constant FlashAttentionParams &p, uint kv0, bool masked,
                                   uint row, RowModifiers mods, SimdgroupSlice s, FragmentCoord at,
                                   uint sgid, uint tid, uint stream = 0) {
    typedef typename KVS::element T;
    constexpr uint NK = BK / 8;  // fragments across a key tile
    constexpr bool SHARED = WITH_V && FA_FORWARD_SHARED(T, DP, BQ, BK);
    auto v_tile = SHARED ? tg->k : tg->v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // K is read only transposed: paired rows where the bucket allows (PairedRows).
    constexpr uint K_PAIRED = PairedRows<T, DP>::WIDTH;
    load_keys<BK, DP, K_PAIRED != 0>(tg->k, kvs, kv0, p, tid);
    if (WITH_V && !SHARED) {
        load_values<BK, DP>(tg->v, kvs, kv0, p, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    Fragments<NK> sc;
    product_transposed<T, ND, K_PAIRED>(sc, tg->q, s.row0, tg->k, s, s.active, p, at);
    sum_over_slices<FA_SLICES(BQ)>(sc, tg->s_partial, sgid, s, at);
    if (SHARED) {
        // V over K once every SIMD-group has read K (the softmax sits between copy and barrier).
        threadgroup_barrier(mem_flags::mem_threadgroup);
        load_values<BK, DP>(v_tile, kvs, kv0, p, tid);
    }
    next_tile(kvs);

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
    const float m_base = softmax_shift(m_next);
    // After a +inf score the shift is 0, not the max, so exp(r.m - 0) could overflow and a lane
    // whose part of l is 0 would turn NaN (0 * inf): a finite past is dropped (weight 0 beside
    // +inf) and a +inf past kept as it is. Finite m_next: exp(r.m - m_next) as before.
    const float correction = m_next == INFINITY ? float(r.m == INFINITY) : exp_of(r.m - m_base);
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
    if (WITH_V && DROPOUT && dropout_on(p)) {
        FA_UNROLL
        for (uint j = 0; j < NK; ++j) {
            const DropoutFactors keep = dropout_factors(p, stream, row, kv0 + j * 8 + at.col);
            sc.f[j].thread_elements()[0] *= keep.first;
            sc.f[j].thread_elements()[1] *= keep.second;
        }
    }

    if (SHARED) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (WITH_V) {
        accumulate_product<T>(r.o, sc, v_tile, s, s.active_v, p, at);
    }
}

// The natural-log lse of a finished row whose row sum is l (-inf for a row that saw no key; NaN
// where l is, from a NaN score, even while m is still -inf; +inf after a +inf score).
inline float row_lse(float m, float l) {
    return l == 0.0f ? -INFINITY : m + precise::log(l);
}

// A split-KV chunk's softmax state at entry `index` of partial_lse: its running max m and log l,
// apart (entries 2 index and 2 index + 1), so that a chunk's share survives where |m| is too large
// for float32 to add log l (rows masked with the float32 minimum); (-inf, 0) for a chunk without
// keys; (NaN, NaN) for a chunk that saw a NaN score (l NaN, m possibly still -inf), so that the
// combine cannot take it for an empty one.
inline void store_partial_lse(device float *partial_lse, ulong index, float m, float l) {
    partial_lse[2 * index] = l == 0.0f ? -INFINITY : (isnan(l) ? l : m);
    partial_lse[2 * index + 1] = l == 0.0f ? 0.0f : precise::log(l);
}

// The K/V source of the forward kernels for plain tensors k and v (flash_attention_kv_cache.h has
// the ones for KV caches): the tiles of batch element b's KV head from key `first`, tile streams
// over K and V. (Member functions say `inline`: the CUDA check build makes every `inline` function
// a __device__ one.)
template <typename T>
struct DeviceKV {
    device const T *k;
    device const T *v;

    template <uint ROWS, uint DP>
    FA_ALWAYS_INLINE KVTiles<TileStream<T, ROWS, DP>, TileStream<T, ROWS, DP>>
    tiles(constant FlashAttentionParams &p, uint b, uint kv_head, uint first, uint tid) const {
        return kv_tiles(tile_stream<T, ROWS, DP>(k + head_offset(p.k, b, kv_head), first, p.seqlen_k, p.k.seq,
                                                 p.head_dim, tid),
                        tile_stream<T, ROWS, DP>(v + head_offset(p.v, b, kv_head), first, p.seqlen_k, p.v.seq,
                                                 p.head_dim_v, tid));
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
    const uint stream = dropout_stream(p, b, h);

    TileStream<T, BQ, DP> qs = tile_stream<T, BQ, DP>(q + head_offset(p.q, b, h), q0, p.seqlen_q,
                                                      p.q.seq, p.head_dim, tid);
    load_tile<BQ, DP>(tg->q, qs, q0, p, tid);
    auto kvs = kv.template tiles<BK, DP>(p, b, kv_head, key_begin, tid);
    RowState<ND> r;
    start_rows(r, sinks_on(p), sinks_on(p) ? sinks[h] : 0.0f, at);
    const KeyRange unmasked = unmasked_keys(p, q0, BQ);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        forward_tile<DP, BQ, BK, ND, true, true>(r, tg, kvs, mask, p, kv0,
                                                 !tile_unmasked(unmasked, kv0, BK), row, mods, s,
                                                 at, sgid, tid, stream);
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
    auto kvs = kv.template tiles<BK, DP>(p, b, kv_head, key_begin, tid);
    // The sink joins once, in the combine.
    RowState<ND> r;
    start_rows(r, false, 0.0f, at);
    const KeyRange unmasked = unmasked_keys(p, rows.i_min, rows.i_max - rows.i_min + 1);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        const bool masked = !rows.full || !tile_unmasked(unmasked, kv0, BK);
        forward_tile<DP, BQ, BK>(r, tg, kvs, mask, p, kv0, masked, row, mods, s, at, sgid, tid);
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


// Combines the chunks of one query row (threadgroup (i, h, b)) with the log-sum-exp merge of
// flash_attention_merge.h: out = sum_c w_c O_c / sum_c w_c with w_c = exp(lse_c - max_c lse_c),
// lse = max + log(sum_c w_c), chunks in order; a sink adds its weight to the denominator only. A
// chunk with lse -inf weighs 0 (its partial output is not used); a row without any key (and no
// sink) gets out 0, lse -inf.
// The weight of the chunk at entry `index` of partial_lse relative to the shift `top`
// (softmax_shift of the largest chunk max): l exp(m - top), exactly 0 for a chunk without keys.
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
    top = softmax_shift(top);
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

#endif
