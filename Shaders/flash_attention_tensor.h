// The Metal 4 tensor-op forward (issue 37; docs/tensor-ops.md): S = Q K^T and O += P V on
// mpp::tensor_ops::matmul2d with cooperative tensors, the online softmax in float32 between them.
// Only the tensor-op library (flash_attention_tensor.metal, MSL 4.0) and the CPU engine (through its
// emulation, Sources/MSLEngine/msl/msl_tensor_ops.h) compile it: include after <metal_stdlib>,
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> and flash_attention_kernels.h.
//
// A threadgroup owns FA_TENSOR_BLOCK_Q query rows of one head; each of its FA_SIMDGROUPS SIMD-groups
// owns FA_TENSOR_ROWS of them and works alone (no threadgroup barrier): its Q rows stay in a left
// cooperative tensor, K and V tiles of FA_TENSOR_BLOCK_K keys are read by matmul2d straight from
// device memory as tensors (reads past seqlen_k and head_dim give 0), O accumulates in a destination
// cooperative tensor. The layout of a cooperative tensor is implementation defined, so the kernel
// never assumes one: S goes to the SIMD-group's slice of threadgroup memory with store(), the
// softmax runs there in a known layout (lane l takes row l / 2, half of the keys), P is read back by
// matmul2d as a tensor, and O's rows are found with get_multidimensional_index. That costs a 2 KiB
// round trip per tile that MLX's NAX kernel avoids by relying on the M5 fragment map; a variant
// relying on it (only under MLX's exact descriptor, only where the plan established M5) is future
// work (docs/tensor-ops.md).
//
// Numerics: Q K^T with half/bfloat operands (exact products) into float32; P stays float32 and
// enters P V with relaxed_precision (M5 truncates it to 10 mantissa bits: the accuracy rule's
// tensor-op term); exponentials as every kernel's (exp_of); every mask, softcap, ALiBi, sink and
// dropout decision from the shared helpers (flash_attention_scores.h, _features.h, _blocks.h).
#ifndef FLASH_ATTENTION_TENSOR_H
#define FLASH_ATTENTION_TENSOR_H

// Threadgroup storage: each SIMD-group's S/P tile and the per-row factor O is scaled by (the
// tile's softmax correction, then 1 / l).
struct TensorForwardStorage {
    float s[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K];
    float row_scale[FA_SIMDGROUPS][FA_TENSOR_ROWS];
};

// The tensor-op backward's storage (flash_attention_tensor_backward.h, included below).
struct TensorBackwardQueryStorage;
struct TensorBackwardKeyValueStorage;

// The tensor-op kernels of bucket DP (catalogue STORAGE of the tensor_bucket kernels).
template <typename T, uint DP>
struct TensorKernelTraits {
    typedef TensorForwardStorage tensor_forward_storage;
    typedef TensorBackwardQueryStorage tensor_dq_storage;
    typedef TensorBackwardKeyValueStorage tensor_dkv_storage;
    static_assert(sizeof(T) == 2, "the tensor-op kernels take half and bfloat");
    static_assert(DP % 16 == 0, "head_dim buckets of the tensor-op kernels are whole 16-column fragments");
    static_assert(sizeof(TensorForwardStorage) <= 32768, "threadgroup storage above 32 KiB");
    static_assert((FA_TENSOR_BUCKET_MASK >> (DP / 32) & 1) == 1, "FA_TENSOR_BUCKET_MASK disagrees with FA_IF_TENSOR");
    static_assert(FA_TENSOR_BLOCK_Q == FA_SIMDGROUPS * FA_TENSOR_ROWS, "a tensor-op SIMD-group owns FA_TENSOR_ROWS rows");
};

typedef dextents<int32_t, 2> TensorExtents;

// `rows` rows from `first` of a matrix of `cols` columns whose rows are `stride` elements apart, as a
// rank-2 tensor (dimension 0 the columns). The plan takes these kernels only where every row stride
// fits int32 (TensorOps.rowStridesFitTensors); rows and cols are at most a tile's and FA_MAX_HEAD_DIM. E carries the address space (device const T, threadgroup
// float), deduced from the pointer, so that callers never spell it.
template <typename E>
inline tensor<E, TensorExtents, tensor_inline> rows_tensor(E *first, uint cols, uint rows, ulong stride) {
    return tensor<E, TensorExtents, tensor_inline>(first, TensorExtents(int32_t(cols), int32_t(rows)),
                                                   array<int32_t, 2>{1, int32_t(stride)});
}

// One SIMD-group's FA_TENSOR_ROWS query rows from r0 (the first row past seqlen_q ends them):
// Algorithm 1 over the tiles of keys some of them see.
template <typename T, uint DP, typename Storage>
inline void attention_forward_tensor(device const T *q, device const T *k, device const T *v, device T *out,
                                     device float *lse, device const uchar *mask, device const float *alibi,
                                     device const float *sinks, constant FlashAttentionParams &p,
                                     Storage tg, uint3 tgid, uint sgid, uint lane) {
    constexpr uint R = FA_TENSOR_ROWS;
    constexpr uint BK = FA_TENSOR_BLOCK_K;
    constexpr uint HALF = BK / 2;
    typedef mpp::tensor_ops::matmul2d_descriptor Descriptor;
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint r0 = (tgid.x + p.block_offset) * FA_TENSOR_BLOCK_Q + sgid * R;
    // Uniform over the SIMD-group, and no threadgroup barrier follows.
    if (r0 >= p.seqlen_q) {
        return;
    }
    const uint rows = min(R, p.seqlen_q - r0);
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    auto s = tg->s[sgid];
    auto row_scale = tg->row_scale[sgid];
    // The softmax's share of this lane: row `mine` of the tile, keys [c0, c0 + HALF) of each tile.
    const uint mine = lane / 2;
    const uint c0 = (lane & 1) * HALF;
    const uint row = r0 + mine;
    const RowModifiers mods = row_modifiers(p, alibi, b, h, row);
    const uint stream = dropout_stream(p, b, h);
    const uint key_begin = key_range(p, r0).first;
    const uint key_end = key_range(p, r0 + rows - 1).end;
    const KeyRange unmasked = unmasked_keys(p, r0, R);

    // S (R x BK) = Q (R x DP) K^T: K's rows are the tensor of the transposed right operand.
    constexpr Descriptor qk_desc(R, BK, DP, false, true, false, Descriptor::mode::multiply);
    mpp::tensor_ops::matmul2d<qk_desc, execution_simdgroup> qk;
    // O (R x DP) += P (R x BK) V (BK x DP); P is float32, truncated by relaxed precision.
    constexpr Descriptor pv_desc(R, DP, BK, false, false, true, Descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<pv_desc, execution_simdgroup> pv;

    auto q_rows = qk.template get_left_input_cooperative_tensor<T, T, float>();
    q_rows.load(rows_tensor(q + head_offset(p.q, b, h) + ulong(r0) * p.q.seq, p.head_dim, rows, p.q.seq));
    device const T *k_head = k + head_offset(p.k, b, kv_head);
    device const T *v_head = v + head_offset(p.v, b, kv_head);
    // P, this SIMD-group's tile of threadgroup memory, as the left operand of P V.
    auto p_tile = rows_tensor(&s[0][0], BK, R, BK);
    // A tile's tensors span at most BK keys (int32 extents whatever seqlen_k; reads stop at its end).
    auto v_tile = rows_tensor(v_head + ulong(key_begin) * p.v.seq, p.head_dim_v, min(p.seqlen_k - key_begin, BK),
                              p.v.seq);
    auto o = pv.template get_destination_cooperative_tensor<decltype(p_tile), decltype(v_tile), float>();
    for (uint i = 0; i < o.get_capacity(); ++i) {
        o[i] = 0.0f;
    }

    // A sink is a virtual key of logit sinks[h] and no value: the row starts with its weight (one
    // lane of the pair counts it).
    float m = sinks_on(p) ? sinks[h] : -INFINITY;
    float l = sinks_on(p) && c0 == 0 ? 1.0f : 0.0f;
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        auto k_tile = rows_tensor(k_head + ulong(kv0) * p.k.seq, p.head_dim, min(p.seqlen_k - kv0, BK), p.k.seq);
        auto scores = qk.template get_destination_cooperative_tensor<decltype(q_rows), decltype(k_tile), float>();
        qk.run(q_rows, k_tile, scores);
        scores.store(p_tile);
        simdgroup_barrier(mem_flags::mem_threadgroup);

        // Online softmax of this lane's half row; P replaces S in place.
        const bool masked = !tile_unmasked(unmasked, kv0, BK);
        const TileWindow window = tile_window(mods.keys, kv0 + c0, masked);
        float x[HALF];
        float tile_max = -INFINITY;
        for (uint c = 0; c < HALF; ++c) {
            float t;
            x[c] = score<T>(p, mask, s[mine][c0 + c], row, kv0 + c0 + c, mods, window.visible(c), t);
            tile_max = max(tile_max, x[c]);
        }
        const float m_next = max(m, max(tile_max, simd_shuffle_xor(tile_max, 1)));
        // As forward_tile: no NaN from -inf - -inf, and a +inf score drops a finite past.
        const float m_base = softmax_shift(m_next);
        const float correction = m_next == INFINITY ? float(m == INFINITY) : exp_of(m - m_base);
        l *= correction;
        for (uint c = 0; c < HALF; c += 2) {
            const float p0 = exp_of(x[c] - m_base);
            const float p1 = exp_of(x[c + 1] - m_base);
            l += p0 + p1;
            // Dropout multiplies what enters P V, not l (lse is of the scores).
            DropoutFactors keep;
            keep.first = 1.0f;
            keep.second = 1.0f;
            if (dropout_on(p)) {
                keep = dropout_factors(p, stream, row, kv0 + c0 + c);
            }
            s[mine][c0 + c] = p0 * keep.first;
            s[mine][c0 + c + 1] = p1 * keep.second;
        }
        m = m_next;
        if (c0 == 0) {
            row_scale[mine] = correction;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);

        // O rows rescaled by their correction, found through the index functions (any layout).
        for (uint i = 0; i < o.get_capacity(); ++i) {
            if (o.is_valid_element(i)) {
                o[i] *= row_scale[o.get_multidimensional_index(i)[1]];
            }
        }
        v_tile = rows_tensor(v_head + ulong(kv0) * p.v.seq, p.head_dim_v, min(p.seqlen_k - kv0, BK), p.v.seq);
        pv.run(p_tile, v_tile, o);
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    l += simd_shuffle_xor(l, 1);
    if (c0 == 0) {
        row_scale[mine] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0; i < o.get_capacity(); ++i) {
        if (o.is_valid_element(i)) {
            o[i] *= row_scale[o.get_multidimensional_index(i)[1]];
        }
    }
    // store() writes only inside the extents: rows past seqlen_q and columns past head_dim_v stay.
    o.store(rows_tensor(out + head_offset(p.out, b, h) + ulong(r0) * p.out.seq, p.head_dim_v, rows, p.out.seq));
    if (c0 == 0 && row < p.seqlen_q) {
        lse[lse_index(p, b, h, row)] = row_lse(m, l);
    }
}

// The catalogue body of forward_tensor (flash_attention_kernels.h conventions: a varlen pass's
// sequence struct, its rows and keys).
template <typename T, uint DP, typename Storage>
inline void kernel_forward_tensor(FA_PARAMETERS(FA_FORWARD_BUFFERS, T), Storage tg, uint3 tgid, uint sgid,
                                  uint lane) {
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * FA_TENSOR_BLOCK_Q, p.seqlen_q)) {
        return;
    }
    attention_forward_tensor<T, DP>(FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), FA_QUERY_ROWS(out),
                                    lse + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), sinks, p, tg,
                                    sequence_tgid(p, tgid), sgid, lane);
}

#include "flash_attention_tensor_backward.h"

// The entry points of the tensor-op kernels of bucket DP (FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_F16)).
#define FA_DEFINE_TENSOR_F16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_DEFINE_KERNEL, half, f16, DP)
#define FA_DEFINE_TENSOR_BF16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_DEFINE_KERNEL, bfloat, bf16, DP)

#endif
