// FlashAttention for Apple GPUs: forward (out and the log-sum-exp) and the two backward kernels.
//
// Math: FlashAttention-2 (Dao, 2023). Forward is Algorithm 1: each threadgroup owns a block of query
// rows and streams key/value tiles through threadgroup memory, keeping an online softmax (running
// max m, running sum l, unnormalised output o) per row. Backward is Algorithm 2 split into two
// kernels without atomics: dQ per query block, dK/dV per key block; both recompute
// P = exp(softmax_scale * q . k - lse) and use D_i = rowsum(dout * out) in float32.
//
// Semantics (shared with every layer, see flash_attention_metal.h): causal masks are aligned
// bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q); a row that sees no key gets
// out = 0, lse = -inf and zero gradients; GQA/MQA query head h reads KV head
// h / (num_heads / num_kv_heads); offsets are 64-bit.
//
// Structure rules: every barrier sits in a loop whose trip count is the same for all threads of
// the threadgroup (Metal requires a barrier to be reached by all of them); per-thread work that
// depends on the row is guarded inside the loop body, never around a barrier. Threadgroup storage
// is one struct per kernel, declared in the kernel and named <kernel>_threadgroup. Arithmetic does
// not rely on infinities, so fast-math compilation keeps empty rows exact.
//
// One instance per head-dim bucket of FA_HEAD_DIM_BUCKETS (flash_attention_params.h), named
// <kernel>_d<head_dim_max>; vectors are padded with zeros to head_dim_max.

#include <metal_stdlib>
#include "flash_attention_params.h"

using namespace metal;

#include "flash_attention_merge.h"

// Number of keys query row `row` sees: all of them, or with the causal mask the prefix
// j <= row + seqlen_k - seqlen_q (possibly empty).
inline uint visible_keys(constant FlashAttentionParams &p, uint row) {
    if (p.causal == 0) {
        return p.seqlen_k;
    }
    const long n = long(row) + long(p.seqlen_k) - long(p.seqlen_q) + 1;
    return n <= 0 ? 0u : (n >= long(p.seqlen_k) ? p.seqlen_k : uint(n));
}

// First query row that sees key `key` (seqlen_q when none does). Rows see a prefix of the keys, so
// the rows seeing a key form a suffix.
inline uint first_row_seeing(constant FlashAttentionParams &p, uint key) {
    if (p.causal == 0) {
        return 0;
    }
    const long i = long(key) - long(p.seqlen_k) + long(p.seqlen_q);
    return i <= 0 ? 0u : (i >= long(p.seqlen_q) ? p.seqlen_q : uint(i));
}

// Element offset of the first row of head `head` of batch `b` in a [batch][heads][seqlen][head_dim]
// tensor.
inline ulong head_offset(uint b, uint heads, uint head, uint seqlen, uint head_dim) {
    return (ulong(b) * heads + head) * seqlen * head_dim;
}

// Copies rows [first, first + ROWS) of one head (src points at its row 0) into tile[ROWS][DP],
// zero past seqlen and past head_dim. The THREADS threads of the threadgroup share the copy.
template <uint ROWS, uint DP, uint THREADS, typename Tile>
inline void load_tile(Tile tile, device const half *src, uint first, uint seqlen, uint head_dim,
                      uint tid) {
    for (uint e = tid; e < ROWS * DP; e += THREADS) {
        const uint r = e / DP;
        const uint d = e % DP;
        const uint row = first + r;
        tile[r][d] = (row < seqlen && d < head_dim) ? src[ulong(row) * head_dim + d] : half(0);
    }
}

// Reads one row of head_dim halves (zero-padded to DP) as float.
template <uint DP>
inline void load_row(thread float *dst, device const half *src, uint head_dim) {
    for (uint d = 0; d < DP; ++d) {
        dst[d] = d < head_dim ? float(src[d]) : 0.0f;
    }
}

template <uint DP, typename Row>
inline float dot_row(thread const float *a, Row b) {
    float acc = 0.0f;
    for (uint d = 0; d < DP; ++d) {
        acc = fma(a[d], float(b[d]), acc);
    }
    return acc;
}

// D_i = sum_d dout[i][d] * out[i][d], accumulated in float32.
inline float row_delta(device const half *dout, device const half *out, uint head_dim) {
    float acc = 0.0f;
    for (uint d = 0; d < head_dim; ++d) {
        acc = fma(float(dout[d]), float(out[d]), acc);
    }
    return acc;
}

template <uint BK, uint DP>
struct KeyValueTiles {
    half k[BK][DP];
    half v[BK][DP];
};

template <uint BQ, uint DP>
struct QueryTiles {
    half q[BQ][DP];
    half dout[BQ][DP];
    float lse[BQ];
    float delta[BQ];
};

// Where one thread of a query-row kernel (forward, backward dQ) works: row `row` of query head `h`
// of batch `b`, in a threadgroup that owns BQ consecutive rows.
struct QueryRow {
    uint b;
    uint h;
    uint row;
    bool valid;           // row < seqlen_q
    uint keys;            // keys this row sees (0 for an invalid row)
    uint block_keys;      // keys the block's last row sees: the tiles the threadgroup must visit
    ulong row_start;      // element offset of the row in q/out/dout/dq (row 0 when invalid)
    ulong kv_head_start;  // element offset of the row's KV head in k/v
};

template <uint BQ>
inline QueryRow query_row(constant FlashAttentionParams &p, uint3 tgid, uint tid) {
    QueryRow r;
    r.b = tgid.z;
    r.h = tgid.y;
    r.row = tgid.x * BQ + tid;
    r.valid = r.row < p.seqlen_q;
    r.keys = r.valid ? visible_keys(p, r.row) : 0;
    r.block_keys = visible_keys(p, min(tgid.x * BQ + BQ, p.seqlen_q) - 1);
    r.row_start = head_offset(r.b, p.num_heads, r.h, p.seqlen_q, p.head_dim) +
                  ulong(r.valid ? r.row : 0) * p.head_dim;
    const uint kv_head = r.h / (p.num_heads / p.num_kv_heads);
    r.kv_head_start = head_offset(r.b, p.num_kv_heads, kv_head, p.seqlen_k, p.head_dim);
    return r;
}

// Loads the K and V tiles of keys [kv0, kv0 + BK) for the threadgroup; returns how many of them
// the calling thread's row sees. Called the same number of times by every thread (its barriers).
template <uint DP, uint BQ, uint BK, typename Tiles>
inline uint load_key_value_tiles(Tiles tiles, device const half *k, device const half *v,
                                 constant FlashAttentionParams &p, QueryRow r, uint kv0, uint tid) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    load_tile<BK, DP, BQ>(tiles->k, k + r.kv_head_start, kv0, p.seqlen_k, p.head_dim, tid);
    load_tile<BK, DP, BQ>(tiles->v, v + r.kv_head_start, kv0, p.seqlen_k, p.head_dim, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return r.keys > kv0 ? min(BK, r.keys - kv0) : 0u;
}

// Forward: one thread per query row of a BQ-row block; K/V tiles of BK keys.
template <uint DP, uint BQ, uint BK, typename Tiles>
inline void attention_forward(device const half *q, device const half *k, device const half *v,
                              device half *out, device float *lse,
                              constant FlashAttentionParams &p, Tiles tiles, uint3 tgid, uint tid) {
    const QueryRow r = query_row<BQ>(p, tgid, tid);

    float q_row[DP];
    load_row<DP>(q_row, q + r.row_start, r.valid ? p.head_dim : 0);
    float o[DP];
    for (uint d = 0; d < DP; ++d) {
        o[d] = 0.0f;
    }
    float m = -1.0e30f;  // running max of the scores seen so far; finite on purpose
    float l = 0.0f;      // running sum of exp(score - m)

    for (uint kv0 = 0; kv0 < r.block_keys; kv0 += BK) {
        const uint n = load_key_value_tiles<DP, BQ, BK>(tiles, k, v, p, r, kv0, tid);
        if (n > 0) {
            float s[BK];
            float tile_max = m;
            for (uint j = 0; j < n; ++j) {
                s[j] = dot_row<DP>(q_row, tiles->k[j]) * p.softmax_scale;
                tile_max = max(tile_max, s[j]);
            }
            const float correction = exp(m - tile_max);
            l *= correction;
            for (uint d = 0; d < DP; ++d) {
                o[d] *= correction;
            }
            for (uint j = 0; j < n; ++j) {
                const float pj = exp(s[j] - tile_max);
                l += pj;
                for (uint d = 0; d < DP; ++d) {
                    o[d] = fma(pj, float(tiles->v[j][d]), o[d]);
                }
            }
            m = tile_max;
        }
    }

    if (r.valid) {
        const float inv_l = r.keys > 0 ? 1.0f / l : 0.0f;
        for (uint d = 0; d < p.head_dim; ++d) {
            out[r.row_start + d] = half(o[d] * inv_l);
        }
        const ulong lse_index = (ulong(r.b) * p.num_heads + r.h) * p.seqlen_q + r.row;
        lse[lse_index] = r.keys > 0 ? m + log(l) : -INFINITY;
    }
}

// Backward dQ: one thread per query row; dq = softmax_scale * sum_j P_ij (dP_ij - D_i) k_j.
template <uint DP, uint BQ, uint BK, typename Tiles>
inline void attention_backward_dq(device const half *dout, device const half *q,
                                  device const half *k, device const half *v,
                                  device const half *out, device const float *lse,
                                  constant FlashAttentionParams &p, device half *dq, Tiles tiles,
                                  uint3 tgid, uint tid) {
    const QueryRow r = query_row<BQ>(p, tgid, tid);
    const uint row_dim = r.valid ? p.head_dim : 0;

    float q_row[DP];
    float do_row[DP];
    float dq_acc[DP];
    load_row<DP>(q_row, q + r.row_start, row_dim);
    load_row<DP>(do_row, dout + r.row_start, row_dim);
    for (uint d = 0; d < DP; ++d) {
        dq_acc[d] = 0.0f;
    }
    const float delta = row_delta(dout + r.row_start, out + r.row_start, row_dim);
    const float row_lse =
        r.keys > 0 ? lse[(ulong(r.b) * p.num_heads + r.h) * p.seqlen_q + r.row] : 0.0f;

    for (uint kv0 = 0; kv0 < r.block_keys; kv0 += BK) {
        const uint n = load_key_value_tiles<DP, BQ, BK>(tiles, k, v, p, r, kv0, tid);
        for (uint j = 0; j < n; ++j) {
            const float pj = exp(dot_row<DP>(q_row, tiles->k[j]) * p.softmax_scale - row_lse);
            const float dp = dot_row<DP>(do_row, tiles->v[j]);
            const float ds = pj * (dp - delta);
            for (uint d = 0; d < DP; ++d) {
                dq_acc[d] = fma(ds, float(tiles->k[j][d]), dq_acc[d]);
            }
        }
    }

    if (r.valid) {
        for (uint d = 0; d < p.head_dim; ++d) {
            dq[r.row_start + d] = half(dq_acc[d] * p.softmax_scale);
        }
    }
}

// Backward dK/dV: one thread per key row of a BK-key block of one KV head; loops over the query
// heads of its GQA group in order, so the sums over the group are deterministic.
// dv_j = sum_i P_ij dout_i; dk_j = softmax_scale * sum_i P_ij (dP_ij - D_i) q_i.
template <uint DP, uint BQ, uint BK, typename Tiles>
inline void attention_backward_dkv(device const half *dout, device const half *q,
                                   device const half *k, device const half *v,
                                   device const half *out, device const float *lse,
                                   constant FlashAttentionParams &p, device half *dk,
                                   device half *dv, Tiles tiles, uint3 tgid, uint tid) {
    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint key = tgid.x * BK + tid;
    const bool key_valid = key < p.seqlen_k;
    const uint block_first_row = first_row_seeing(p, tgid.x * BK);
    const uint key_first_row = key_valid ? first_row_seeing(p, key) : p.seqlen_q;
    const ulong kv_head_start = head_offset(b, p.num_kv_heads, kv_head, p.seqlen_k, p.head_dim);
    const ulong key_start = kv_head_start + ulong(key_valid ? key : 0) * p.head_dim;
    const uint key_dim = key_valid ? p.head_dim : 0;

    float k_row[DP];
    float v_row[DP];
    float dk_acc[DP];
    float dv_acc[DP];
    load_row<DP>(k_row, k + key_start, key_dim);
    load_row<DP>(v_row, v + key_start, key_dim);
    for (uint d = 0; d < DP; ++d) {
        dk_acc[d] = 0.0f;
        dv_acc[d] = 0.0f;
    }

    for (uint g = 0; g < group; ++g) {
        const uint h = kv_head * group + g;
        const ulong q_head = head_offset(b, p.num_heads, h, p.seqlen_q, p.head_dim);
        const ulong lse_head = (ulong(b) * p.num_heads + h) * p.seqlen_q;
        for (uint q0 = block_first_row; q0 < p.seqlen_q; q0 += BQ) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            load_tile<BQ, DP, BK>(tiles->q, q + q_head, q0, p.seqlen_q, p.head_dim, tid);
            load_tile<BQ, DP, BK>(tiles->dout, dout + q_head, q0, p.seqlen_q, p.head_dim, tid);
            for (uint i = tid; i < BQ; i += BK) {
                const uint row = q0 + i;
                const bool seen = row < p.seqlen_q && visible_keys(p, row) > 0;
                const ulong row_start = q_head + ulong(seen ? row : 0) * p.head_dim;
                tiles->lse[i] = seen ? lse[lse_head + row] : 0.0f;
                tiles->delta[i] = row_delta(dout + row_start, out + row_start, seen ? p.head_dim : 0);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            const uint rows = min(BQ, p.seqlen_q - q0);
            const uint first = key_first_row > q0 ? min(key_first_row - q0, rows) : 0u;
            for (uint i = first; i < rows; ++i) {
                float s = 0.0f;
                float dp = 0.0f;
                for (uint d = 0; d < DP; ++d) {
                    s = fma(float(tiles->q[i][d]), k_row[d], s);
                    dp = fma(float(tiles->dout[i][d]), v_row[d], dp);
                }
                const float pij = exp(s * p.softmax_scale - tiles->lse[i]);
                const float ds = pij * (dp - tiles->delta[i]);
                for (uint d = 0; d < DP; ++d) {
                    dv_acc[d] = fma(pij, float(tiles->dout[i][d]), dv_acc[d]);
                    dk_acc[d] = fma(ds, float(tiles->q[i][d]), dk_acc[d]);
                }
            }
        }
    }

    if (key_valid) {
        for (uint d = 0; d < p.head_dim; ++d) {
            dk[key_start + d] = half(dk_acc[d] * p.softmax_scale);
            dv[key_start + d] = half(dv_acc[d]);
        }
    }
}

// The kernels of one head-dim bucket. The threadgroup storage type of kernel K is K_threadgroup,
// so a host (the CPU engine) can size it.
#define FA_DEFINE_KERNELS(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                      \
    typedef KeyValueTiles<FWD_BK, DP> flash_attention_forward_d##DP##_threadgroup;                 \
    typedef KeyValueTiles<FWD_BK, DP> flash_attention_backward_dq_d##DP##_threadgroup;             \
    typedef QueryTiles<BWD_BQ, DP> flash_attention_backward_dkv_d##DP##_threadgroup;               \
                                                                                                   \
    kernel void flash_attention_forward_d##DP(                                                     \
        device const half *q [[buffer(FA_FORWARD_BUFFER_Q)]],                                      \
        device const half *k [[buffer(FA_FORWARD_BUFFER_K)]],                                      \
        device const half *v [[buffer(FA_FORWARD_BUFFER_V)]],                                      \
        device half *out [[buffer(FA_FORWARD_BUFFER_OUT)]],                                        \
        device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],                                       \
        constant FlashAttentionParams &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],                \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        threadgroup flash_attention_forward_d##DP##_threadgroup tiles;                             \
        attention_forward<DP, FWD_BQ, FWD_BK>(q, k, v, out, lse, params, &tiles, tgid, tid);       \
    }                                                                                              \
                                                                                                   \
    kernel void flash_attention_backward_dq_d##DP(                                                 \
        device const half *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                               \
        device const half *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                     \
        device const half *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                     \
        device const half *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                     \
        device const half *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                 \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams &params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device half *dq [[buffer(FA_BACKWARD_BUFFER_DQ)]],                                         \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        threadgroup flash_attention_backward_dq_d##DP##_threadgroup tiles;                         \
        attention_backward_dq<DP, BWD_BQ, FWD_BK>(dout, q, k, v, out, lse, params, dq, &tiles,     \
                                                  tgid, tid);                                      \
    }                                                                                              \
                                                                                                   \
    kernel void flash_attention_backward_dkv_d##DP(                                                \
        device const half *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],                               \
        device const half *q [[buffer(FA_BACKWARD_BUFFER_Q)]],                                     \
        device const half *k [[buffer(FA_BACKWARD_BUFFER_K)]],                                     \
        device const half *v [[buffer(FA_BACKWARD_BUFFER_V)]],                                     \
        device const half *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],                                 \
        device const float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],                                \
        constant FlashAttentionParams &params [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],               \
        device half *dk [[buffer(FA_BACKWARD_BUFFER_DK)]],                                         \
        device half *dv [[buffer(FA_BACKWARD_BUFFER_DV)]],                                         \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint tid [[thread_index_in_threadgroup]]) {                                                \
        threadgroup flash_attention_backward_dkv_d##DP##_threadgroup tiles;                        \
        attention_backward_dkv<DP, BWD_BQ, BWD_BK>(dout, q, k, v, out, lse, params, dk, dv,        \
                                                   &tiles, tgid, tid);                             \
    }

FA_HEAD_DIM_BUCKETS(FA_DEFINE_KERNELS)

// fa_merge_attention: two results over disjoint key sets -> the result over their union
// (flash_attention_merge.h).
kernel void flash_attention_merge(device const half *out_a [[buffer(FA_MERGE_BUFFER_OUT_A)]],
                                  device const float *lse_a [[buffer(FA_MERGE_BUFFER_LSE_A)]],
                                  device const half *out_b [[buffer(FA_MERGE_BUFFER_OUT_B)]],
                                  device const float *lse_b [[buffer(FA_MERGE_BUFFER_LSE_B)]],
                                  device half *out [[buffer(FA_MERGE_BUFFER_OUT)]],
                                  device float *lse [[buffer(FA_MERGE_BUFFER_LSE)]],
                                  constant FlashAttentionParams &params [[buffer(FA_MERGE_BUFFER_PARAMS)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]]) {
    attention_merge(out_a, lse_a, out_b, lse_b, out, lse, params, tgid, tid);
}
