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
// From bucket FA_TENSOR_PAIR_DP (256) up, two SIMD-groups share each FA_TENSOR_ROWS rows, each
// owning half of head_dim (MLX's d256 split; unsplit, O alone would be 128 floats a lane, all the
// registers a thread addresses): FA_TENSOR_PAIR_BLOCK_Q rows a threadgroup, two threadgroup
// barriers per key tile (the TensorTiling<true> overloads here and in the backward's dQ).
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

// The pair forward's storage (head_dim split over SIMD-group pairs): each SIMD-group's partial S
// tile, and per pair its P tile, row factors of the tile and the rows' final 1 / l.
struct TensorPairForwardStorage {
    float s[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K];
    float p[FA_SIMDGROUPS / 2][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K];
    float row_scale[FA_SIMDGROUPS / 2][FA_TENSOR_ROWS];
    float row_norm[FA_SIMDGROUPS / 2][FA_TENSOR_ROWS];
};

// The tensor-op backward's storage (flash_attention_tensor_backward.h, included below).
struct TensorBackwardQueryStorage;
struct TensorPairBackwardQueryStorage;
struct TensorBackwardKeyValueStorage;

// Whether bucket DP's forward and dQ split head_dim over SIMD-group pairs, and their query rows
// per threadgroup (dK/dV keeps FA_TENSOR_BLOCK_Q keys).
constexpr bool tensor_pairs(uint dp) {
    return dp >= FA_TENSOR_PAIR_DP;
}

constexpr uint tensor_block_q(uint dp) {
    return tensor_pairs(dp) ? FA_TENSOR_PAIR_BLOCK_Q : FA_TENSOR_BLOCK_Q;
}

// The forward's and dQ's storage and bodies by tiling (a tag: overloads, not a branch).
template <bool PAIRS>
struct TensorTiling {
    typedef TensorForwardStorage forward_storage;
    typedef TensorBackwardQueryStorage dq_storage;
};

template <>
struct TensorTiling<true> {
    typedef TensorPairForwardStorage forward_storage;
    typedef TensorPairBackwardQueryStorage dq_storage;
};

// The tensor-op kernels of bucket DP (catalogue STORAGE of the tensor_bucket kernels).
template <typename T, uint DP>
struct TensorKernelTraits {
    typedef typename TensorTiling<tensor_pairs(DP)>::forward_storage tensor_forward_storage;
    typedef typename TensorTiling<tensor_pairs(DP)>::dq_storage tensor_dq_storage;
    typedef TensorBackwardKeyValueStorage tensor_dkv_storage;
    static_assert(sizeof(T) == 2, "the tensor-op kernels take half and bfloat");
    static_assert(DP % 16 == 0, "head_dim buckets of the tensor-op kernels are whole 16-column fragments");
    static_assert(!tensor_pairs(DP) || DP % 32 == 0, "a pair's halves of head_dim are whole fragments");
    static_assert(sizeof(tensor_forward_storage) <= 32768, "threadgroup storage above 32 KiB");
    static_assert((FA_TENSOR_BUCKET_MASK >> (DP / 32) & 1) == 1, "FA_TENSOR_BUCKET_MASK disagrees with FA_IF_TENSOR");
    static_assert(FA_TENSOR_BLOCK_Q == FA_SIMDGROUPS * FA_TENSOR_ROWS, "a tensor-op SIMD-group owns FA_TENSOR_ROWS rows");
    static_assert(FA_TENSOR_PAIR_BLOCK_Q * 2 == FA_TENSOR_BLOCK_Q, "a pair of SIMD-groups owns FA_TENSOR_ROWS rows");
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

// Sets every slot of a cooperative tensor to 0 (multiply_accumulate starts from its contents).
template <typename C>
inline void clear_slots(thread C &c) {
    for (uint i = 0; i < c.get_capacity(); ++i) {
        c[i] = 0.0f;
    }
}

// One tile's online softmax for this lane's share: N scores `x` of row `row` at keys key0..
// (the tile's from kv0; LANES adjacent lanes share the row), into P at `p_row` (dropout applied:
// it multiplies what enters P V, not l); m and l carried over tiles (l is this lane's share).
// Returns the factor of the row's O (the tile's correction).
template <typename T, uint N, uint LANES, typename Row>
inline float tensor_softmax_share(constant FlashAttentionParams &p, device const uchar *mask, thread float *x,
                                  Row p_row, uint row, uint kv0, uint key0, KeyRange unmasked, RowModifiers mods,
                                  uint stream, thread float &m, thread float &l) {
    const bool masked = !tile_unmasked(unmasked, kv0, FA_TENSOR_BLOCK_K);
    const TileWindow window = tile_window(mods.keys, key0, masked);
    float tile_max = -INFINITY;
    for (uint c = 0; c < N; ++c) {
        float t;
        x[c] = score<T>(p, mask, x[c], row, key0 + c, mods, window.visible(c), t);
        tile_max = max(tile_max, x[c]);
    }
    for (uint step = 1; step < LANES; step *= 2) {
        tile_max = max(tile_max, simd_shuffle_xor(tile_max, step));
    }
    const float m_next = max(m, tile_max);
    // As forward_tile: no NaN from -inf - -inf, and a +inf score drops a finite past.
    const float m_base = softmax_shift(m_next);
    const float correction = m_next == INFINITY ? float(m == INFINITY) : exp_of(m - m_base);
    l *= correction;
    for (uint c = 0; c < N; c += 2) {
        const float p0 = exp_of(x[c] - m_base);
        const float p1 = exp_of(x[c + 1] - m_base);
        l += p0 + p1;
        DropoutFactors keep;
        keep.first = 1.0f;
        keep.second = 1.0f;
        if (dropout_on(p)) {
            keep = dropout_factors(p, stream, row, key0 + c);
        }
        p_row[c] = p0 * keep.first;
        p_row[c + 1] = p1 * keep.second;
    }
    m = m_next;
    return correction;
}

// The row sum of l over the LANES adjacent lanes that share a row.
template <uint LANES>
inline float row_total(float l) {
    for (uint step = 1; step < LANES; step *= 2) {
        l += simd_shuffle_xor(l, step);
    }
    return l;
}

// Multiplies each row of a FA_TENSOR_ROWS-row accumulator by its factor, the rows found through
// the index functions (any layout).
template <typename C, typename Factors>
inline void scale_rows(thread C &o, Factors row_scale) {
    for (uint i = 0; i < o.get_capacity(); ++i) {
        if (o.is_valid_element(i)) {
            o[i] *= row_scale[o.get_multidimensional_index(i)[1]];
        }
    }
}

// O's rows times their factor into `rows` rows of out (columns col0 + the accumulator's, below
// cols), element by element: a cooperative tensor's store() takes only its own element type (float),
// out holds T.
template <typename T, typename C, typename Factors>
inline void store_rows(device T *o_rows, thread C &o, Factors row_scale, uint rows, uint col0,
                       uint cols, ulong stride) {
    for (uint i = 0; i < o.get_capacity(); ++i) {
        if (o.is_valid_element(i)) {
            const auto at = o.get_multidimensional_index(i);
            const uint o_col = col0 + uint(at[0]);
            const uint o_row = uint(at[1]);
            if (o_row < rows && o_col < cols) {
                o_rows[ulong(o_row) * stride + o_col] = T(o[i] * row_scale[o_row]);
            }
        }
    }
}

// One SIMD-group's FA_TENSOR_ROWS query rows from r0 (the first row past seqlen_q ends them):
// Algorithm 1 over the tiles of keys some of them see. Buckets below FA_TENSOR_PAIR_DP.
template <typename T, uint DP, typename Storage>
inline void attention_forward_tensor(device const T *q, device const T *k, device const T *v, device T *out,
                                     device float *lse, device const uchar *mask, device const float *alibi,
                                     device const float *sinks, constant FlashAttentionParams &p,
                                     Storage tg, uint3 tgid, uint sgid, uint lane, TensorTiling<false>) {
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
    clear_slots(o);

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
        float x[HALF];
        for (uint c = 0; c < HALF; ++c) {
            x[c] = s[mine][c0 + c];
        }
        const float correction = tensor_softmax_share<T, HALF, 2>(p, mask, x, &s[mine][c0], row, kv0, kv0 + c0,
                                                                  unmasked, mods, stream, m, l);
        if (c0 == 0) {
            row_scale[mine] = correction;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);

        scale_rows(o, row_scale);
        v_tile = rows_tensor(v_head + ulong(kv0) * p.v.seq, p.head_dim_v, min(p.seqlen_k - kv0, BK), p.v.seq);
        pv.run(p_tile, v_tile, o);
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    l = row_total<2>(l);
    if (c0 == 0) {
        row_scale[mine] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    // Rows past seqlen_q, columns past head_dim_v stay.
    store_rows(out + head_offset(p.out, b, h) + ulong(r0) * p.out.seq, o, row_scale, rows, 0, p.head_dim_v,
               p.out.seq);
    if (c0 == 0 && row < p.seqlen_q) {
        lse[lse_index(p, b, h, row)] = row_lse(m, l);
    }
}

// The columns of a head_dim-wide matrix that pair member `half` owns: [col0, col0 + the result).
inline uint pair_columns(uint head_dim, uint col0, uint width) {
    return head_dim > col0 ? min(width, head_dim - col0) : 0;
}

// Bucket FA_TENSOR_PAIR_DP and up (MLX's d256 split): SIMD-groups 2j and 2j + 1 own the same
// FA_TENSOR_ROWS query rows from r0, member `half_of` (sgid & 1) the head_dim columns
// [half_of * DP / 2, (half_of + 1) * DP / 2) of Q, K, V and O. Per key tile: each forms its
// partial S = Q_half K_half^T (16 x 32 over DP / 2) and stores it; barrier; member h sums the two
// partials (member 0's first) of rows [8h, 8h + 8) and runs their softmax (4 lanes a row, 8 keys
// each) into the pair's P and row factors; barrier; each rescales its half of O and runs
// P V_half into it. O is 16 x DP / 2 floats per SIMD-group (64 a lane at DP 256, as the d128
// kernel's). The threadgroup's SIMD-groups all run every key tile of its rows (two barriers per
// tile reach all of them): a pair whose rows are all past seqlen_q only meets the barriers, and a
// tile none of a pair's rows see is masked.
template <typename T, uint DP, typename Storage>
inline void attention_forward_tensor(device const T *q, device const T *k, device const T *v, device T *out,
                                     device float *lse, device const uchar *mask, device const float *alibi,
                                     device const float *sinks, constant FlashAttentionParams &p,
                                     Storage tg, uint3 tgid, uint sgid, uint lane, TensorTiling<true>) {
    constexpr uint R = FA_TENSOR_ROWS;
    constexpr uint BK = FA_TENSOR_BLOCK_K;
    constexpr uint LANES = 4;
    constexpr uint N = BK / LANES;
    constexpr uint DH = DP / 2;
    typedef mpp::tensor_ops::matmul2d_descriptor Descriptor;
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint block_row = (tgid.x + p.block_offset) * FA_TENSOR_PAIR_BLOCK_Q;
    const uint pair = sgid / 2;
    const uint half_of = sgid & 1;
    const uint col0 = half_of * DH;
    const uint r0 = block_row + pair * R;
    // Uniform over the SIMD-group; the barriers below are met either way.
    const bool live = r0 < p.seqlen_q;
    const uint rows = live ? min(R, p.seqlen_q - r0) : 0;
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    // The softmax's share of this lane: row `mine` of the pair's tile, keys [c0, c0 + N).
    const uint mine = half_of * (R / 2) + lane / LANES;
    const uint c0 = (lane % LANES) * N;
    const uint row = r0 + mine;
    const RowModifiers mods = row_modifiers(p, alibi, b, h, live ? row : block_row);
    const uint stream = dropout_stream(p, b, h);
    // The threadgroup's keys (kernel_forward_tensor returned for a block past seqlen_q).
    const uint key_begin = key_range(p, block_row).first;
    const uint key_end = key_range(p, min(block_row + FA_TENSOR_PAIR_BLOCK_Q, p.seqlen_q) - 1).end;
    const KeyRange unmasked = unmasked_keys(p, r0, R);
    // Threadgroup pointers by auto: the CPU engine's threadgroup is a storage class.
    auto p_rows = &tg->p[pair][0][0];
    auto row_scale = tg->row_scale[pair];

    // Partial S (R x BK) over this member's DH columns; O_half (R x DH) += P (R x BK) V_half.
    constexpr Descriptor qk_desc(R, BK, DH, false, true, false, Descriptor::mode::multiply);
    mpp::tensor_ops::matmul2d<qk_desc, execution_simdgroup> qk;
    constexpr Descriptor pv_desc(R, DH, BK, false, false, true, Descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<pv_desc, execution_simdgroup> pv;

    const uint q_cols = pair_columns(p.head_dim, col0, DH);
    const uint v_cols = pair_columns(p.head_dim_v, col0, DH);
    auto q_rows = qk.template get_left_input_cooperative_tensor<T, T, float>();
    if (live) {
        q_rows.load(rows_tensor(q + head_offset(p.q, b, h) + ulong(r0) * p.q.seq + col0, q_cols, rows, p.q.seq));
    }
    device const T *k_head = k + head_offset(p.k, b, kv_head) + col0;
    device const T *v_head = v + head_offset(p.v, b, kv_head) + col0;
    auto partial = rows_tensor(&tg->s[sgid][0][0], BK, R, BK);
    auto p_tile = rows_tensor(p_rows, BK, R, BK);
    auto v_tile = rows_tensor(v_head, v_cols, 0, p.v.seq);
    auto o = pv.template get_destination_cooperative_tensor<decltype(p_tile), decltype(v_tile), float>();
    clear_slots(o);

    float m = sinks_on(p) ? sinks[h] : -INFINITY;
    float l = sinks_on(p) && c0 == 0 ? 1.0f : 0.0f;
    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        if (live) {
            auto k_tile = rows_tensor(k_head + ulong(kv0) * p.k.seq, q_cols, min(p.seqlen_k - kv0, BK), p.k.seq);
            auto scores =
                qk.template get_destination_cooperative_tensor<decltype(q_rows), decltype(k_tile), float>();
            qk.run(q_rows, k_tile, scores);
            scores.store(partial);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (live) {
            float x[N];
            for (uint c = 0; c < N; ++c) {
                x[c] = tg->s[2 * pair][mine][c0 + c] + tg->s[2 * pair + 1][mine][c0 + c];
            }
            const float correction = tensor_softmax_share<T, N, LANES>(p, mask, x, p_rows + mine * BK + c0, row,
                                                                       kv0, kv0 + c0, unmasked, mods, stream, m, l);
            if (c0 == 0) {
                row_scale[mine] = correction;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (live) {
            scale_rows(o, row_scale);
            v_tile = rows_tensor(v_head + ulong(kv0) * p.v.seq, v_cols, min(p.seqlen_k - kv0, BK), p.v.seq);
            pv.run(p_tile, v_tile, o);
        }
    }

    // 1 / l apart from row_scale, which the partner may still read for the last tile.
    l = row_total<LANES>(l);
    if (live && c0 == 0) {
        tg->row_norm[pair][mine] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!live) {
        return;
    }
    store_rows(out + head_offset(p.out, b, h) + ulong(r0) * p.out.seq, o, tg->row_norm[pair], rows, col0,
               p.head_dim_v, p.out.seq);
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
    if (block_past_end((tgid.x + p.block_offset) * tensor_block_q(DP), p.seqlen_q)) {
        return;
    }
    attention_forward_tensor<T, DP>(FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), FA_QUERY_ROWS(out),
                                    lse + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), sinks, p, tg,
                                    sequence_tgid(p, tgid), sgid, lane, TensorTiling<tensor_pairs(DP)>());
}

#include "flash_attention_tensor_backward.h"

// The entry points of the tensor-op kernels of bucket DP (FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_F16)).
#define FA_DEFINE_TENSOR_F16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_DEFINE_KERNEL, half, f16, DP)
#define FA_DEFINE_TENSOR_BF16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_DEFINE_KERNEL, bfloat, bf16, DP)

#endif
