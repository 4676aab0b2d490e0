// FlashAttention for Apple GPUs: forward (out and the log-sum-exp) and backward (D pre-pass, dQ,
// dK/dV), on simdgroup_matrix tiles.
//
// Math: FlashAttention-2 (Dao, 2023). Operands: Q, K, V, O (out), L (lse), dO (dout), D (delta),
// S = Q K^T, P = softmax(S), dP = dO V^T, dS = P (dP - D). Scores are kept in base 2: S is scaled by
// softmax_scale * log2(e), so exp2 gives the softmax and lse = m ln 2 + log(l).
//
//   forward (Algorithm 1), one threadgroup per BQ query rows:
//     load Q block; m = -inf, l = 0, O = 0
//     for each K/V tile of BK keys that some row of the block sees:
//       load K, V tiles; S = Q K^T (scaled); element masks only on tiles crossing the diagonal or
//       the end; m' = max(m, rowmax S); P = exp2(S - m'); l = l exp2(m - m') + rowsum P;
//       O = O exp2(m - m') + P V; m = m'
//     out = O / l, lse = m ln 2 + log l (a row that sees no key: out 0, lse -inf)
//   backward_delta: D_i = rowsum(dO_i * O_i), once per row, in float32
//   backward_dq (Algorithm 2, the dQ half), one threadgroup per BQ query rows:
//     for each visible K/V tile: S = Q K^T, P = exp2(S - L), dP = dO V^T, dS = P (dP - D),
//     dQ += dS K; dq = softmax_scale dQ
//   backward_dkv (the dK/dV half), one threadgroup per BK keys of one KV head:
//     for each query head of the GQA group, in order, and each Q/dO tile that sees the keys:
//       S^T = K Q^T, P^T = exp2(S^T - L), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D),
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
// FA_HEAD_DIM_BUCKETS_F32 for float), named <kernel>_<dtype>_d<head_dim_max>. Threadgroup storage
// is one struct per kernel, named <kernel>_threadgroup.

#include <metal_stdlib>

using namespace metal;

#include "flash_attention_params.h"
#include "flash_attention_fragment.h"
#include "flash_attention_blocks.h"

// Head_dim slices of a kernel that owns ROWS rows per threadgroup (flash_attention_params.h).
#define FA_SLICES(ROWS) (8 * FA_SIMDGROUPS / (ROWS))

// Where one SIMD-group works: rows [row0, row0 + 8) of the threadgroup's block and columns
// [col0, col0 + 8 * fragments) of its head_dim slice, of which `active` fragments lie inside
// head_dim (q, k) and `active_v` inside head_dim_v (v, out). A SIMD-group whose rows all lie past
// the end of the block's rows has no active fragment: it multiplies nothing (but still loads tiles
// and meets the barriers with the others).
struct SimdgroupSlice {
    uint row0;
    uint col0;
    uint active;
    uint active_v;
    uint first_sgid;  // the SIMD-group holding slice 0 of the same rows
};

template <uint DP, uint SLICES>
inline SimdgroupSlice simdgroup_slice(constant FlashAttentionParams &p, uint sgid, uint rows_left) {
    SimdgroupSlice s;
    s.row0 = (sgid / SLICES) * 8;
    s.col0 = (sgid % SLICES) * (DP / SLICES);
    const bool live = s.row0 < rows_left;
    s.active = live ? active_fragments(p.head_dim, s.col0, DP / SLICES / 8) : 0;
    s.active_v = live ? active_fragments(p.head_dim_v, s.col0, DP / SLICES / 8) : 0;
    s.first_sgid = sgid - sgid % SLICES;
    return s;
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
    for (uint d = 0; d < N; ++d) {
        for (uint e = 0; e < 2; ++e) {
            const uint col = s.col0 + d * 8 + at.col + e;
            if (col < cols) {
                dst[col] = T(x.f[d].thread_elements()[e] * scale);
            }
        }
    }
}

// ---- forward ---------------------------------------------------------------------------------

template <typename T, uint DP, uint BQ, uint BK>
struct ForwardStorage {
    T q[BQ][DP + FA_TILE_PAD];
    T k[BK][DP + FA_TILE_PAD];
    T v[BK][DP + FA_TILE_PAD];
    float s_partial[FA_SLICES(BQ) > 1 ? FA_SIMDGROUPS : 1][8][BK];
};

// The online softmax of one lane's row (Algorithm 1): running max m of the scaled scores (base 2),
// this lane's part of the running sum l of exp2(score - m), and the SIMD-group's 8-row block of the
// unnormalised output over its head_dim slice.
template <uint ND>
struct RowState {
    float m;
    float l;
    Fragments<ND> o;
};

template <uint ND>
inline void start_rows(thread RowState<ND> &r) {
    r.m = -INFINITY;
    r.l = 0.0f;
    clear(r.o);
}

// One K/V tile of the forward pass, keys [kv0, kv0 + BK) of the KV head whose rows start at k_head
// and v_head: loads the tiles (every thread calls it), S = Q K^T over the slice and then over all
// of head_dim, masks (only when `masked`; the lane's row is query `row`), online softmax update,
// O += P V.
template <uint DP, uint BQ, uint BK, uint ND, typename T, typename Storage>
inline void forward_tile(thread RowState<ND> &r, Storage tg, device const T *k_head,
                         device const T *v_head, constant FlashAttentionParams &p, uint kv0,
                         bool masked, uint row, SimdgroupSlice s, FragmentCoord at, uint sgid,
                         uint tid) {
    constexpr uint NK = BK / 8;  // fragments across a key tile
    threadgroup_barrier(mem_flags::mem_threadgroup);
    load_rows<BK, DP>(tg->k, k_head, kv0, p.seqlen_k, p.k.seq, p.head_dim, tid);
    load_rows<BK, DP>(tg->v, v_head, kv0, p.seqlen_k, p.v.seq, p.head_dim_v, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    Fragments<NK> sc;
    clear(sc);
    for (uint d = 0; d < ND; ++d) {
        if (d < s.active) {
            simdgroup_float8x8 qf;
            load_fragment(qf, tg->q, s.row0, s.col0 + d * 8, at);
            for (uint j = 0; j < NK; ++j) {
                simdgroup_float8x8 kt;
                load_fragment_transposed(kt, tg->k, j * 8, s.col0 + d * 8, at);
                simdgroup_multiply_accumulate(sc.f[j], qf, kt, sc.f[j]);
            }
        }
    }
    sum_over_slices<FA_SLICES(BQ)>(sc, tg->s_partial, sgid, s, at);

    // Online softmax; P replaces S in place.
    const float scale2 = p.softmax_scale * M_LOG2E_F;
    float tile_max = -INFINITY;
    for (uint j = 0; j < NK; ++j) {
        for (uint e = 0; e < 2; ++e) {
            float x = sc.f[j].thread_elements()[e] * scale2;
            if (masked && !is_visible(p, row, kv0 + j * 8 + at.col + e)) {
                x = -INFINITY;
            }
            sc.f[j].thread_elements()[e] = x;
            tile_max = max(tile_max, x);
        }
    }
    const float m_next = max(r.m, row_max(tile_max));
    // While a row has seen no key, m_next is -inf: subtracting 0 keeps exp2 at 0, not NaN.
    const float m_base = m_next == -INFINITY ? 0.0f : m_next;
    const float correction = exp2(r.m - m_base);
    r.l *= correction;
    for (uint d = 0; d < ND; ++d) {
        r.o.f[d].thread_elements()[0] *= correction;
        r.o.f[d].thread_elements()[1] *= correction;
    }
    for (uint j = 0; j < NK; ++j) {
        for (uint e = 0; e < 2; ++e) {
            const float pe = exp2(sc.f[j].thread_elements()[e] - m_base);
            sc.f[j].thread_elements()[e] = pe;
            r.l += pe;
        }
    }
    r.m = m_next;

    for (uint d = 0; d < ND; ++d) {
        if (d < s.active_v) {
            for (uint j = 0; j < NK; ++j) {
                simdgroup_float8x8 vf;
                load_fragment(vf, tg->v, j * 8, s.col0 + d * 8, at);
                simdgroup_multiply_accumulate(r.o.f[d], sc.f[j], vf, r.o.f[d]);
            }
        }
    }
}

// The natural-log lse of a finished row whose row sum is l (-inf for a row that saw no key).
inline float row_lse(float m, float l) {
    return l > 0.0f ? m * M_LN2_F + log(l) : -INFINITY;
}

template <uint DP, uint BQ, uint BK, typename T, typename Storage>
inline void attention_forward(device const T *q, device const T *k, device const T *v,
                              device T *out, device float *lse, constant FlashAttentionParams &p,
                              Storage tg, uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;  // fragments across the slice
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint q0 = tgid.x * BQ;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_q - q0);
    const uint row = q0 + s.row0 + at.row;
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    // Keys seen by the block's last row: the tiles the threadgroup visits (none past it).
    const uint block_keys = visible_keys(p, min(q0 + BQ, p.seqlen_q) - 1);

    load_rows<BQ, DP>(tg->q, q + head_offset(p.q, b, h), q0, p.seqlen_q, p.q.seq, p.head_dim, tid);
    RowState<ND> r;
    start_rows(r);
    for (uint kv0 = 0; kv0 < block_keys; kv0 += BK) {
        forward_tile<DP, BQ, BK>(r, tg, k + head_offset(p.k, b, kv_head),
                                 v + head_offset(p.v, b, kv_head), p, kv0,
                                 !tile_unmasked(p, q0, BQ, kv0, BK), row, s, at, sgid, tid);
    }

    const float l = row_sum(r.l);
    if (row < p.seqlen_q) {
        store_row(out + head_offset(p.out, b, h) + ulong(row) * p.out.seq, r.o,
                  l > 0.0f ? 1.0f / l : 0.0f, p.head_dim_v, s, at);
        if (s.col0 == 0 && at.col == 0) {
            lse[row_index(b, p.num_heads, h, p.seqlen_q, row)] = row_lse(r.m, l);
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
template <uint DP, uint BQ, uint BK, typename T, typename Storage>
inline void attention_forward_split(device const T *q, device const T *k, device const T *v,
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
    const uint chunk = tgid.x / row_blocks;
    const PackedRows rows = packed_rows<BQ>(p, tgid.x % row_blocks);
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, rows.count - rows.first);
    const uint packed = rows.first + s.row0 + at.row;
    const bool valid = packed < rows.count;
    const uint row = valid ? packed % p.seqlen_q : p.seqlen_q;  // seqlen_q sees no key
    const uint key_begin = chunk * p.kv_chunk_keys;
    const uint key_end = min(key_begin + p.kv_chunk_keys, visible_keys(p, rows.i_max));

    for (uint e = tid; e < BQ * DP; e += FA_THREADS_PER_THREADGROUP) {
        const uint r = e / DP;
        const uint d = e % DP;
        const uint at_row = rows.first + r;
        tg->q[r][d] = (at_row < rows.count && d < p.head_dim)
                          ? q[head_offset(p.q, b, packed_head(p, rows, kv_head, at_row)) +
                              ulong(at_row % p.seqlen_q) * p.q.seq + d]
                          : T(0.0f);
    }
    RowState<ND> r;
    start_rows(r);
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        const bool masked = !rows.full || !tile_unmasked(p, rows.i_min, rows.i_max - rows.i_min + 1,
                                                         kv0, BK);
        forward_tile<DP, BQ, BK>(r, tg, k + head_offset(p.k, b, kv_head),
                                 v + head_offset(p.v, b, kv_head), p, kv0, masked, row, s, at,
                                 sgid, tid);
    }

    const float l = row_sum(r.l);
    if (valid) {
        const ulong index = partial_index(p, rows, b, kv_head, packed, chunk);
        const float scale = l > 0.0f ? 1.0f / l : 0.0f;
        for (uint d = 0; d < ND; ++d) {
            for (uint e = 0; e < 2; ++e) {
                const uint col = s.col0 + d * 8 + at.col + e;
                if (col < p.head_dim_v) {
                    partial_out[index * p.head_dim_v + col] = r.o.f[d].thread_elements()[e] * scale;
                }
            }
        }
        if (s.col0 == 0 && at.col == 0) {
            partial_lse[index] = row_lse(r.m, l);
        }
    }
}

// Combines the chunks of one query row (threadgroup (i, h, b)): out = sum_c w_c O_c / sum_c w_c
// with w_c = exp(lse_c - max_c lse_c), lse = max + log(sum_c w_c), chunks in order. A chunk with
// lse -inf weighs 0; a row without any key gets out 0, lse -inf.
template <typename T>
inline void attention_forward_combine(device const float *partial_out,
                                      device const float *partial_lse, device T *out,
                                      device float *lse, constant FlashAttentionParams &p,
                                      uint3 tgid, uint tid) {
    const ulong first = (ulong(tgid.z) * p.num_heads + tgid.y) * p.kv_chunks * p.seqlen_q + tgid.x;
    float top = -INFINITY;
    for (uint c = 0; c < p.kv_chunks; ++c) {
        top = max(top, partial_lse[first + ulong(c) * p.seqlen_q]);
    }
    float total = 0.0f;
    for (uint c = 0; c < p.kv_chunks; ++c) {
        const float part = partial_lse[first + ulong(c) * p.seqlen_q];
        total += part == -INFINITY ? 0.0f : exp(part - top);
    }
    device T *out_row = out + head_offset(p.out, tgid.z, tgid.y) + ulong(tgid.x) * p.out.seq;
    for (uint d = tid; d < p.head_dim_v; d += FA_THREADS_PER_THREADGROUP) {
        float acc = 0.0f;
        for (uint c = 0; c < p.kv_chunks; ++c) {
            const ulong part = first + ulong(c) * p.seqlen_q;
            if (partial_lse[part] != -INFINITY) {
                acc = fma(exp(partial_lse[part] - top), partial_out[part * p.head_dim_v + d], acc);
            }
        }
        out_row[d] = T(total > 0.0f ? acc / total : 0.0f);
    }
    if (tid == 0) {
        lse[row_index(tgid.z, p.num_heads, tgid.y, p.seqlen_q, tgid.x)] =
            total > 0.0f ? top + log(total) : -INFINITY;
    }
}

// ---- backward: D = rowsum(dO * O) ------------------------------------------------------------

// One thread per query row; D in float32, read by both gradient kernels.
template <typename T>
inline void attention_backward_delta(device const T *dout, device const T *out,
                                     device float *delta, constant FlashAttentionParams &p,
                                     uint3 tgid, uint tid) {
    const uint row = tgid.x * FA_DELTA_BLOCK_ROWS + tid;
    if (row < p.seqlen_q) {
        device const T *dout_row = dout + head_offset(p.dout, tgid.z, tgid.y) + ulong(row) * p.dout.seq;
        device const T *out_row = out + head_offset(p.out, tgid.z, tgid.y) + ulong(row) * p.out.seq;
        float acc = 0.0f;
        for (uint d = 0; d < p.head_dim_v; ++d) {
            acc = fma(float(dout_row[d]), float(out_row[d]), acc);
        }
        delta[row_index(tgid.z, p.num_heads, tgid.y, p.seqlen_q, row)] = acc;
    }
}

// ---- backward: dQ ----------------------------------------------------------------------------

// SHARED: the K and V tiles share one buffer (when both would not fit in 32 KiB): V is loaded
// first for dP, then K for S and dQ, so each is still read once per tile.
template <typename T, uint DP, uint BQ, uint BK, bool SHARED>
struct BackwardQueryStorage {
    T q[BQ][DP + FA_TILE_PAD];
    T dout[BQ][DP + FA_TILE_PAD];
    T k[BK][DP + FA_TILE_PAD];
    T v[SHARED ? 1 : BK][DP + FA_TILE_PAD];
    float s_partial[FA_SLICES(BQ) > 1 ? FA_SIMDGROUPS : 1][8][BK];
    float dp_partial[FA_SLICES(BQ) > 1 ? FA_SIMDGROUPS : 1][8][BK];
};

template <uint DP, uint BQ, uint BK, bool SHARED, typename T, typename Storage>
inline void attention_backward_dq(device const T *dout, device const T *q, device const T *k,
                                  device const T *v, device const float *lse,
                                  device const float *delta, constant FlashAttentionParams &p,
                                  device T *dq, Storage tg, uint3 tgid, uint sgid, uint lane) {
    constexpr uint SLICES = FA_SLICES(BQ);
    constexpr uint ND = DP / SLICES / 8;
    constexpr uint NK = BK / 8;
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    auto v_tile = SHARED ? tg->k : tg->v;

    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint q0 = tgid.x * BQ;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_q - q0);
    const uint row = q0 + s.row0 + at.row;
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    device const T *k_head = k + head_offset(p.k, b, kv_head);
    device const T *v_head = v + head_offset(p.v, b, kv_head);
    const uint block_keys = visible_keys(p, min(q0 + BQ, p.seqlen_q) - 1);
    const float scale2 = p.softmax_scale * M_LOG2E_F;
    // Rows past the end or without keys have every element masked: their L and D are not read.
    const bool has_keys = row < p.seqlen_q && visible_keys(p, row) > 0;
    const ulong at_row = row_index(b, p.num_heads, h, p.seqlen_q, has_keys ? row : 0);
    const float row_lse2 = has_keys ? lse[at_row] * M_LOG2E_F : 0.0f;
    const float row_delta = has_keys ? delta[at_row] : 0.0f;

    load_rows<BQ, DP>(tg->q, q + head_offset(p.q, b, h), q0, p.seqlen_q, p.q.seq, p.head_dim, tid);
    load_rows<BQ, DP>(tg->dout, dout + head_offset(p.dout, b, h), q0, p.seqlen_q, p.dout.seq,
                      p.head_dim_v, tid);

    Fragments<ND> dq_acc;
    clear(dq_acc);
    for (uint kv0 = 0; kv0 < block_keys; kv0 += BK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        load_rows<BK, DP>(v_tile, v_head, kv0, p.seqlen_k, p.v.seq, p.head_dim_v, tid);
        if (!SHARED) {
            load_rows<BK, DP>(tg->k, k_head, kv0, p.seqlen_k, p.k.seq, p.head_dim, tid);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // dP = dO V^T.
        Fragments<NK> dp;
        clear(dp);
        for (uint d = 0; d < ND; ++d) {
            if (d < s.active_v) {
                simdgroup_float8x8 dof;
                load_fragment(dof, tg->dout, s.row0, s.col0 + d * 8, at);
                for (uint j = 0; j < NK; ++j) {
                    simdgroup_float8x8 vt;
                    load_fragment_transposed(vt, v_tile, j * 8, s.col0 + d * 8, at);
                    simdgroup_multiply_accumulate(dp.f[j], dof, vt, dp.f[j]);
                }
            }
        }
        if (SHARED) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            load_rows<BK, DP>(tg->k, k_head, kv0, p.seqlen_k, p.k.seq, p.head_dim, tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }

        // S = Q K^T.
        Fragments<NK> sc;
        clear(sc);
        for (uint d = 0; d < ND; ++d) {
            if (d < s.active) {
                simdgroup_float8x8 qf;
                load_fragment(qf, tg->q, s.row0, s.col0 + d * 8, at);
                for (uint j = 0; j < NK; ++j) {
                    simdgroup_float8x8 kt;
                    load_fragment_transposed(kt, tg->k, j * 8, s.col0 + d * 8, at);
                    simdgroup_multiply_accumulate(sc.f[j], qf, kt, sc.f[j]);
                }
            }
        }
        sum_over_slices<SLICES>(sc, tg->s_partial, sgid, s, at);
        sum_over_slices<SLICES>(dp, tg->dp_partial, sgid, s, at);

        // dS = P (dP - D), in place of S.
        const bool masked = !tile_unmasked(p, q0, BQ, kv0, BK);
        for (uint j = 0; j < NK; ++j) {
            for (uint e = 0; e < 2; ++e) {
                const bool hidden = masked && !is_visible(p, row, kv0 + j * 8 + at.col + e);
                const float pe =
                    hidden ? 0.0f : exp2(sc.f[j].thread_elements()[e] * scale2 - row_lse2);
                sc.f[j].thread_elements()[e] = pe * (dp.f[j].thread_elements()[e] - row_delta);
            }
        }

        // dQ += dS K.
        for (uint d = 0; d < ND; ++d) {
            if (d < s.active) {
                for (uint j = 0; j < NK; ++j) {
                    simdgroup_float8x8 kf;
                    load_fragment(kf, tg->k, j * 8, s.col0 + d * 8, at);
                    simdgroup_multiply_accumulate(dq_acc.f[d], sc.f[j], kf, dq_acc.f[d]);
                }
            }
        }
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
    T k[BK][DP + FA_TILE_PAD];
    T v[BK][DP + FA_TILE_PAD];
    T q[BQ][DP + FA_TILE_PAD];
    T dout[SHARED ? 1 : BQ][DP + FA_TILE_PAD];
    float lse2[BQ];   // L of the tile's rows in base 2 (0 for rows past the end or without keys)
    float delta[BQ];  // D of the tile's rows (0 likewise)
    float s_partial[FA_SLICES(BK) > 1 ? FA_SIMDGROUPS : 1][8][BQ];
    float dp_partial[FA_SLICES(BK) > 1 ? FA_SIMDGROUPS : 1][8][BQ];
};

template <uint DP, uint BK, uint BQ, bool SHARED, typename T, typename Storage>
inline void attention_backward_dkv(device const T *dout, device const T *q, device const T *k,
                                   device const T *v, device const float *lse,
                                   device const float *delta, constant FlashAttentionParams &p,
                                   device T *dk, device T *dv, Storage tg, uint3 tgid, uint sgid,
                                   uint lane) {
    constexpr uint SLICES = FA_SLICES(BK);
    constexpr uint ND = DP / SLICES / 8;
    constexpr uint NQ = BQ / 8;  // fragments across a query tile
    const uint tid = sgid * 32 + lane;
    const FragmentCoord at = fragment_coord(lane);
    auto dout_tile = SHARED ? tg->q : tg->dout;

    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint k0 = tgid.x * BK;
    const SimdgroupSlice s = simdgroup_slice<DP, SLICES>(p, sgid, p.seqlen_k - k0);
    const uint key = k0 + s.row0 + at.row;
    const uint first_row = first_row_seeing(p, k0);
    const float scale2 = p.softmax_scale * M_LOG2E_F;

    load_rows<BK, DP>(tg->k, k + head_offset(p.k, b, kv_head), k0, p.seqlen_k, p.k.seq, p.head_dim,
                      tid);
    load_rows<BK, DP>(tg->v, v + head_offset(p.v, b, kv_head), k0, p.seqlen_k, p.v.seq,
                      p.head_dim_v, tid);

    Fragments<ND> dk_acc;
    Fragments<ND> dv_acc;
    clear(dk_acc);
    clear(dv_acc);
    for (uint g = 0; g < group; ++g) {
        const uint h = kv_head * group + g;
        device const T *q_head = q + head_offset(p.q, b, h);
        device const T *dout_head = dout + head_offset(p.dout, b, h);
        for (uint q0 = first_row; q0 < p.seqlen_q; q0 += BQ) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            load_rows<BQ, DP>(tg->q, q_head, q0, p.seqlen_q, p.q.seq, p.head_dim, tid);
            if (!SHARED) {
                load_rows<BQ, DP>(tg->dout, dout_head, q0, p.seqlen_q, p.dout.seq, p.head_dim_v, tid);
            }
            if (tid < BQ) {
                const uint r = q0 + tid;
                const bool has_keys = r < p.seqlen_q && visible_keys(p, r) > 0;
                const ulong at_row = row_index(b, p.num_heads, h, p.seqlen_q, has_keys ? r : 0);
                tg->lse2[tid] = has_keys ? lse[at_row] * M_LOG2E_F : 0.0f;
                tg->delta[tid] = has_keys ? delta[at_row] : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            // S^T = K Q^T.
            Fragments<NQ> st;
            clear(st);
            for (uint d = 0; d < ND; ++d) {
                if (d < s.active) {
                    simdgroup_float8x8 kf;
                    load_fragment(kf, tg->k, s.row0, s.col0 + d * 8, at);
                    for (uint j = 0; j < NQ; ++j) {
                        simdgroup_float8x8 qt;
                        load_fragment_transposed(qt, tg->q, j * 8, s.col0 + d * 8, at);
                        simdgroup_multiply_accumulate(st.f[j], kf, qt, st.f[j]);
                    }
                }
            }
            if (SHARED) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
                load_rows<BQ, DP>(dout_tile, dout_head, q0, p.seqlen_q, p.dout.seq, p.head_dim_v, tid);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }

            // dP^T = V dO^T.
            Fragments<NQ> dpt;
            clear(dpt);
            for (uint d = 0; d < ND; ++d) {
                if (d < s.active_v) {
                    simdgroup_float8x8 vf;
                    load_fragment(vf, tg->v, s.row0, s.col0 + d * 8, at);
                    for (uint j = 0; j < NQ; ++j) {
                        simdgroup_float8x8 dot;
                        load_fragment_transposed(dot, dout_tile, j * 8, s.col0 + d * 8, at);
                        simdgroup_multiply_accumulate(dpt.f[j], vf, dot, dpt.f[j]);
                    }
                }
            }
            sum_over_slices<SLICES>(st, tg->s_partial, sgid, s, at);
            sum_over_slices<SLICES>(dpt, tg->dp_partial, sgid, s, at);

            // P^T in place of S^T, dS^T in place of dP^T.
            const bool masked = !tile_unmasked(p, q0, BQ, k0, BK);
            for (uint j = 0; j < NQ; ++j) {
                for (uint e = 0; e < 2; ++e) {
                    const uint i = j * 8 + at.col + e;
                    const bool hidden = masked && !is_visible(p, q0 + i, key);
                    const float pe =
                        hidden ? 0.0f : exp2(st.f[j].thread_elements()[e] * scale2 - tg->lse2[i]);
                    st.f[j].thread_elements()[e] = pe;
                    dpt.f[j].thread_elements()[e] = pe * (dpt.f[j].thread_elements()[e] - tg->delta[i]);
                }
            }

            // dV += P^T dO.
            for (uint d = 0; d < ND; ++d) {
                if (d < s.active_v) {
                    for (uint j = 0; j < NQ; ++j) {
                        simdgroup_float8x8 dof;
                        load_fragment(dof, dout_tile, j * 8, s.col0 + d * 8, at);
                        simdgroup_multiply_accumulate(dv_acc.f[d], st.f[j], dof, dv_acc.f[d]);
                    }
                }
            }
            if (SHARED) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
                load_rows<BQ, DP>(tg->q, q_head, q0, p.seqlen_q, p.q.seq, p.head_dim, tid);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }

            // dK += dS^T Q.
            for (uint d = 0; d < ND; ++d) {
                if (d < s.active) {
                    for (uint j = 0; j < NQ; ++j) {
                        simdgroup_float8x8 qf;
                        load_fragment(qf, tg->q, j * 8, s.col0 + d * 8, at);
                        simdgroup_multiply_accumulate(dk_acc.f[d], dpt.f[j], qf, dk_acc.f[d]);
                    }
                }
            }
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

// The kernels of one dtype (element type T, name suffix SUFFIX) that do not depend on the bucket.
#define FA_DEFINE_DTYPE_KERNELS(T, SUFFIX)                                                         \
    kernel void flash_attention_forward_combine_##SUFFIX(                                          \
        device const T *q [[buffer(FA_FORWARD_BUFFER_Q)]],                                         \
        device const T *k [[buffer(FA_FORWARD_BUFFER_K)]],                                         \
        device const T *v [[buffer(FA_FORWARD_BUFFER_V)]],                                         \
        device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],                                           \
        device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],                                       \
        constant FlashAttentionParams &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],                \
        device const float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                 \
        device const float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                 \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        attention_forward_combine(partial_out, partial_lse, out, lse, params, tgid, tid);          \
    }                                                                                              \
                                                                                                   \
    kernel void flash_attention_backward_delta_##SUFFIX(                                           \
        device const T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                                  \
        device const T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                        \
        device const T *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                        \
        device const T *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                        \
        device const T *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                    \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams &params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],                                  \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        attention_backward_delta(dout, out, delta, params, tgid, tid);                             \
    }

// The kernels of one dtype and head-dim bucket. The threadgroup storage type of kernel K is
// K_threadgroup, so a host (the CPU engine) can size it.
#define FA_DEFINE_KERNELS(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)             \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_##SUFFIX##_d##DP##_threadgroup;                                    \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_split_##SUFFIX##_d##DP##_threadgroup;                              \
    typedef BackwardQueryStorage<T, DP, DQ_BQ, DQ_BK, FA_DQ_SHARED(T, DP, DQ_BQ, DQ_BK)>           \
        flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup;                                \
    typedef BackwardKeyValueStorage<T, DP, DKV_BK, DKV_BQ, FA_DKV_SHARED(T, DP, DKV_BK, DKV_BQ)>   \
        flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup;                               \
    static_assert(sizeof(flash_attention_forward_##SUFFIX##_d##DP##_threadgroup) <= 32768 &&       \
                      sizeof(flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup) <= 32768 && \
                      sizeof(flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup) <= 32768,  \
                  "threadgroup storage above 32 KiB");                                             \
    static_assert(DP % (8 * FA_SLICES(FWD_BQ)) == 0 && DP % (8 * FA_SLICES(DQ_BQ)) == 0 &&         \
                      DP % (8 * FA_SLICES(DKV_BK)) == 0 && FWD_BK % 8 == 0 && DQ_BK % 8 == 0 &&    \
                      DKV_BQ % 8 == 0,                                                             \
                  "blocks must split into 8x8 fragments");                                         \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_##SUFFIX##_d##DP(                                          \
        device const T *q [[buffer(FA_FORWARD_BUFFER_Q)]],                                         \
        device const T *k [[buffer(FA_FORWARD_BUFFER_K)]],                                         \
        device const T *v [[buffer(FA_FORWARD_BUFFER_V)]],                                         \
        device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],                                           \
        device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],                                       \
        constant FlashAttentionParams &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],                \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_##SUFFIX##_d##DP##_threadgroup tg;                     \
        attention_forward<DP, FWD_BQ, FWD_BK>(q, k, v, out, lse, params, &tg, tgid, sgid, lane);   \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_split_##SUFFIX##_d##DP(                                    \
        device const T *q [[buffer(FA_FORWARD_BUFFER_Q)]],                                         \
        device const T *k [[buffer(FA_FORWARD_BUFFER_K)]],                                         \
        device const T *v [[buffer(FA_FORWARD_BUFFER_V)]],                                         \
        device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],                                           \
        device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],                                       \
        constant FlashAttentionParams &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],                \
        device float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                       \
        device float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                       \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_split_##SUFFIX##_d##DP##_threadgroup tg;               \
        attention_forward_split<DP, FWD_BQ, FWD_BK>(q, k, v, partial_out, partial_lse, params,     \
                                                    &tg, tgid, sgid, lane);                        \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_dq_##SUFFIX##_d##DP(                                      \
        device const T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                                  \
        device const T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                        \
        device const T *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                        \
        device const T *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                        \
        device const T *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                    \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams &params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device const float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],                            \
        device T *dq [[buffer(FA_BACKWARD_BUFFER_DQ)]],                                            \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_backward_dq_##SUFFIX##_d##DP##_threadgroup tg;                 \
        attention_backward_dq<DP, DQ_BQ, DQ_BK, FA_DQ_SHARED(T, DP, DQ_BQ, DQ_BK)>(                \
            dout, q, k, v, lse, delta, params, dq, &tg, tgid, sgid, lane);                         \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_backward_dkv_##SUFFIX##_d##DP(                                     \
        device const T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                                  \
        device const T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                        \
        device const T *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                        \
        device const T *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                        \
        device const T *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                    \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams &params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device const float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],                            \
        device T *dk [[buffer(FA_BACKWARD_BUFFER_DK)]],                                            \
        device T *dv [[buffer(FA_BACKWARD_BUFFER_DV)]],                                            \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_backward_dkv_##SUFFIX##_d##DP##_threadgroup tg;                \
        attention_backward_dkv<DP, DKV_BK, DKV_BQ, FA_DKV_SHARED(T, DP, DKV_BK, DKV_BQ)>(          \
            dout, q, k, v, lse, delta, params, dk, dv, &tg, tgid, sgid, lane);                     \
    }

#define FA_DEFINE_F16(...) FA_DEFINE_KERNELS(half, f16, __VA_ARGS__)
#define FA_DEFINE_BF16(...) FA_DEFINE_KERNELS(bfloat, bf16, __VA_ARGS__)
#define FA_DEFINE_F32(...) FA_DEFINE_KERNELS(float, f32, __VA_ARGS__)

FA_DEFINE_DTYPE_KERNELS(half, f16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16)
FA_DEFINE_DTYPE_KERNELS(float, f32)
FA_HEAD_DIM_BUCKETS_F32(FA_DEFINE_F32)
// bfloat needs MSL 3.1 (macOS 14, iOS 17); older compilers get the other dtypes.
#if !defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)
FA_DEFINE_DTYPE_KERNELS(bfloat, bf16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_BF16)
#endif
