// The tensor-op backward (issue 37): dQ and dK/dV on Metal 4's mpp::tensor_ops::matmul2d with
// cooperative tensors, for the tensor-op library (MSL 4.0) and the CPU engine's emulation
// (docs/tensor-ops.md, "Backward"). The same algorithm as the simdgroup kernels
// (flash_attention_backward.h: scores, masks, window, softcap, ALiBi, dropout, GQA, varlen, the lse
// residual; D and the residual come from the same pre-passes), with the four products on matmul2d:
//   dQ:    S = Q K^T, dP = dO V^T (one 16 x 32 x head_dim product each), dQ += dS K
//   dK/dV: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q
// Deterministic, no atomics: every output element has one writer, every sum a fixed order. dQ at
// bucket FA_TENSOR_PAIR_DP and up splits head_dim over SIMD-group pairs as the forward does.
//
// Layout: nothing here assumes where a lane's elements lie. Elementwise work goes through
// get_multidimensional_index / is_valid_element; every operand that moves between products (dS,
// P^T, dS^T) goes through threadgroup memory with cooperative_tensor::store and a tensor operand,
// so the kernels are correct under any layout (FLASH_ATTENTION_TENSOR_LAYOUT=permuted checks it).
// Two destinations of one matmul2d and element types share a layout (Apple's header: a tensor of
// the same operation's destination "with same layout"), so S and dP are combined slot by slot.
//
// Precision: half and bfloat operands multiply exactly into float32; dS, P^T and dS^T enter their
// products as float32 under relaxed_precision (truncated to 10 mantissa bits on M5: the accuracy
// rule's tensor-op term, docs/testing.md).
//
// Included by flash_attention_tensor.h (after its rows_tensor), which the tensor-op library and the
// CPU engine compile; the catalogue's storage of both kernels is TensorKernelTraits' there.
#ifndef FLASH_ATTENTION_TENSOR_BACKWARD_H
#define FLASH_ATTENTION_TENSOR_BACKWARD_H

typedef mpp::tensor_ops::matmul2d_descriptor TensorBackwardDescriptor;

// The products of both kernels, for a head_dim bucket DP and a tile of N = FA_TENSOR_BLOCK_K
// columns (keys in dQ, query rows in dK/dV): the scores (16 x N over head_dim: the right operand's
// tensor holds its rows, read transposed) and the gradients (16 x DP += 16 x N times N x DP).
// (Functions, not static members: MSL wants those in the constant address space.)
template <uint DP>
constexpr TensorBackwardDescriptor tensor_scores_product() {
    return TensorBackwardDescriptor(FA_TENSOR_ROWS, FA_TENSOR_BLOCK_K, DP, false, true, true,
                                    TensorBackwardDescriptor::mode::multiply);
}

template <uint DP>
constexpr TensorBackwardDescriptor tensor_gradient_product() {
    return TensorBackwardDescriptor(FA_TENSOR_ROWS, DP, FA_TENSOR_BLOCK_K, false, false, true,
                                    TensorBackwardDescriptor::mode::multiply_accumulate);
}

// The pad of a float32 score row in threadgroup memory (16 bytes: rows start on distinct banks).
#define FA_TENSOR_SCORE_PAD 4

// Stores scale times a FA_TENSOR_ROWS x DP accumulator into the rows of `dst` (`stride` elements
// apart): rows below `rows` and columns below `cols` only, each element rounded once to T.
template <typename T, typename C>
inline void store_scaled(device T *dst, thread C &acc, uint rows, uint cols, ulong stride, float scale) {
    for (uint i = 0; i < acc.get_capacity(); ++i) {
        if (acc.is_valid_element(i)) {
            const auto at = acc.get_multidimensional_index(i);
            if (uint(at[1]) < rows && uint(at[0]) < cols) {
                dst[ulong(at[1]) * stride + uint(at[0])] = T(acc[i] * scale);
            }
        }
    }
}

// ---- dQ ----------------------------------------------------------------------------------------

// Per SIMD-group: its dS tile and its rows' lse, residual, D and visible keys (0 and none past the
// end). 10.5 KiB whatever the head_dim: K and V are read by matmul2d from device memory.
struct TensorBackwardQueryStorage {
    float ds[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K + FA_TENSOR_SCORE_PAD];
    float lse[FA_SIMDGROUPS][FA_TENSOR_ROWS];
    float residual[FA_SIMDGROUPS][FA_TENSOR_ROWS];
    float delta[FA_SIMDGROUPS][FA_TENSOR_ROWS];
    uint key_first[FA_SIMDGROUPS][FA_TENSOR_ROWS];
    uint key_end[FA_SIMDGROUPS][FA_TENSOR_ROWS];
};

// What dS needs of one query row: its lse (as the backward takes it), residual, D and visible keys.
struct TensorQueryRow {
    float lse;
    float residual;
    float delta;
    KeyRange keys;
};

// Query row r0 + r of `rows` rows before seqlen_q (0 and no keys past the end).
inline TensorQueryRow tensor_query_row(constant FlashAttentionParams &p, device const float *lse,
                                       device const float *delta, device const float *residual, uint b, uint h,
                                       uint r0, uint r, uint rows) {
    const ulong at = lse_index(p, b, h, r < rows ? r0 + r : r0);
    TensorQueryRow q;
    q.lse = r < rows ? backward_row_lse(lse[at]) : 0.0f;
    q.residual = r < rows ? residual[at] : 0.0f;
    q.delta = r < rows ? delta[at] : 0.0f;
    q.keys = visible_keys(p, r0 + r);
    return q;
}

// dS of the score `s` (dP `dp`) of row r0 + r at `key`: P (dP - D) through the softcap, dropout's
// factor on dP, as the simdgroup dQ forms it; `mods` of row r0.
template <typename T>
inline float query_score_gradient(constant FlashAttentionParams &p, device const uchar *mask, TensorQueryRow q,
                                  float s, float dp, uint r0, uint r, uint key, RowModifiers mods, bool masked,
                                  uint stream) {
    const uint row = r0 + r;
    mods.mask_row += ulong(r) * p.mask.seq;
    mods.keys = q.keys;
    float t;
    const float x = score<T>(p, mask, s, row, key, mods, !masked || in_window(mods.keys, key), t);
    const float pe = probability(x, q.lse, q.residual);
    const float kept = dropout_on(p) ? dropout_factor(p, stream, row, key) : 1.0f;
    return through_softcap(p, pe * (dp * kept - q.delta), t);
}

// One threadgroup per FA_TENSOR_BLOCK_Q query rows of one head; each SIMD-group owns
// FA_TENSOR_ROWS of them and works alone (no threadgroup barrier): its Q and dO rows stay in left
// cooperative tensors, each key tile of K and V is a tensor operand read from device memory (its
// extents at most one tile, so int32 whatever seqlen_k; reads past seqlen_k and head_dim give 0),
// dQ accumulates in a destination cooperative tensor. Buckets below FA_TENSOR_PAIR_DP.
template <typename T, uint DP, typename Storage>
inline void attention_backward_dq_tensor(device const T *dout, device const T *q, device const T *k,
                                         device const T *v, device const float *lse,
                                         device const float *delta, device const float *residual,
                                         device const uchar *mask, device const float *alibi,
                                         constant FlashAttentionParams &p, device T *dq, Storage tg,
                                         uint3 tgid, uint sgid, uint lane, TensorTiling<false>) {
    constexpr uint R = FA_TENSOR_ROWS;
    constexpr uint BK = FA_TENSOR_BLOCK_K;
    const uint b = tgid.z;
    const uint h = tgid.y;
    const uint r0 = (tgid.x + p.block_offset) * FA_TENSOR_BLOCK_Q + sgid * R;
    // Uniform over the SIMD-group, and no threadgroup barrier follows.
    if (r0 >= p.seqlen_q) {
        return;
    }
    const uint rows = min(R, p.seqlen_q - r0);
    const uint kv_head = h / (p.num_heads / p.num_kv_heads);
    const uint key_begin = key_range(p, r0).first;
    const uint key_end = key_range(p, r0 + rows - 1).end;
    const KeyRange unmasked = unmasked_keys(p, r0, R);
    const RowModifiers mods = row_modifiers(p, alibi, b, h, r0);
    const uint stream = dropout_stream(p, b, h);
    if (lane < R) {
        const TensorQueryRow q_row = tensor_query_row(p, lse, delta, residual, b, h, r0, lane, rows);
        tg->lse[sgid][lane] = q_row.lse;
        tg->residual[sgid][lane] = q_row.residual;
        tg->delta[sgid][lane] = q_row.delta;
        tg->key_first[sgid][lane] = q_row.keys.first;
        tg->key_end[sgid][lane] = q_row.keys.end;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    constexpr TensorBackwardDescriptor scores_desc = tensor_scores_product<DP>();
    constexpr TensorBackwardDescriptor gradient_desc = tensor_gradient_product<DP>();
    mpp::tensor_ops::matmul2d<scores_desc, execution_simdgroup> scores_op;
    mpp::tensor_ops::matmul2d<gradient_desc, execution_simdgroup> gradient_op;
    auto q_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    q_rows.load(rows_tensor(q + head_offset(p.q, b, h) + ulong(r0) * p.q.seq, p.head_dim, rows, p.q.seq));
    auto dout_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    dout_rows.load(rows_tensor(dout + head_offset(p.dout, b, h) + ulong(r0) * p.dout.seq, p.head_dim_v, rows,
                               p.dout.seq));
    device const T *k_head = k + head_offset(p.k, b, kv_head);
    device const T *v_head = v + head_offset(p.v, b, kv_head);
    auto ds_tile = rows_tensor(&tg->ds[sgid][0][0], BK, R, BK + FA_TENSOR_SCORE_PAD);
    auto k_tile = rows_tensor(k_head + ulong(key_begin) * p.k.seq, p.head_dim, min(BK, p.seqlen_k - key_begin),
                              p.k.seq);
    auto dq_acc =
        gradient_op.template get_destination_cooperative_tensor<decltype(ds_tile), decltype(k_tile), float>();
    clear_slots(dq_acc);

    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        // dP = dO V^T and S = Q K^T: two destinations of one operation, so one layout.
        auto v_tile = rows_tensor(v_head + ulong(kv0) * p.v.seq, p.head_dim_v, min(BK, p.seqlen_k - kv0), p.v.seq);
        auto dp =
            scores_op.template get_destination_cooperative_tensor<decltype(dout_rows), decltype(v_tile), float>();
        scores_op.run(dout_rows, v_tile, dp);
        k_tile = rows_tensor(k_head + ulong(kv0) * p.k.seq, p.head_dim, min(BK, p.seqlen_k - kv0), p.k.seq);
        auto sc =
            scores_op.template get_destination_cooperative_tensor<decltype(q_rows), decltype(k_tile), float>();
        scores_op.run(q_rows, k_tile, sc);

        // dS in place of S, element by element.
        const bool masked = !tile_unmasked(unmasked, kv0, BK);
        for (uint i = 0; i < sc.get_capacity(); ++i) {
            if (sc.is_valid_element(i)) {
                const auto at = sc.get_multidimensional_index(i);
                const uint r = uint(at[1]);
                TensorQueryRow q_row;
                q_row.lse = tg->lse[sgid][r];
                q_row.residual = tg->residual[sgid][r];
                q_row.delta = tg->delta[sgid][r];
                q_row.keys.first = tg->key_first[sgid][r];
                q_row.keys.end = tg->key_end[sgid][r];
                sc[i] = query_score_gradient<T>(p, mask, q_row, sc[i], dp[i], r0, r, kv0 + uint(at[0]), mods, masked,
                                                stream);
            }
        }

        // dQ += dS K, dS through the SIMD-group's tile of threadgroup memory.
        sc.store(ds_tile);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        gradient_op.run(ds_tile, k_tile, dq_acc);
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    store_scaled(dq + head_offset(p.dq, b, h) + ulong(r0) * p.dq.seq, dq_acc, rows, p.head_dim, p.dq.seq,
                 p.softmax_scale);
}

// The pair dQ's storage: each SIMD-group's partial S and dP tiles, and per pair the dS tile (a
// lane's one row's data stays in registers).
struct TensorPairBackwardQueryStorage {
    float s[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K];
    float dp[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K];
    float ds[FA_SIMDGROUPS / 2][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K + FA_TENSOR_SCORE_PAD];
};

// dQ from bucket FA_TENSOR_PAIR_DP up, split as the pair forward (attention_forward_tensor,
// TensorTiling<true>): SIMD-groups 2j and 2j + 1 share 16 query rows, member `half_of` owning the
// head_dim columns [half_of * DP / 2, (half_of + 1) * DP / 2) of Q, dO, K, V and dQ. Per key tile
// each member forms its partial S and dP over its half and stores them; barrier; member h sums the
// pair's partials (member 0's first) for rows [8h, 8h + 8) and writes their dS (4 lanes a row, 8
// keys each; its row's data in registers) to the pair's tile; barrier; each member adds dS K_half
// to its half of dQ. Per lane: dQ 64 floats, Q and dO 32 registers each at DP 256 (the d128
// kernel's 64 + 32 + 32).
template <typename T, uint DP, typename Storage>
inline void attention_backward_dq_tensor(device const T *dout, device const T *q, device const T *k,
                                         device const T *v, device const float *lse,
                                         device const float *delta, device const float *residual,
                                         device const uchar *mask, device const float *alibi,
                                         constant FlashAttentionParams &p, device T *dq, Storage tg,
                                         uint3 tgid, uint sgid, uint lane, TensorTiling<true>) {
    constexpr uint R = FA_TENSOR_ROWS;
    constexpr uint BK = FA_TENSOR_BLOCK_K;
    constexpr uint LANES = 4;
    constexpr uint N = BK / LANES;
    constexpr uint DH = DP / 2;
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
    // This lane's share of the pair's dS: row `mine`, keys [c0, c0 + N) of each tile.
    const uint mine = half_of * (R / 2) + lane / LANES;
    const uint c0 = (lane % LANES) * N;
    // The threadgroup's keys (kernel_backward_dq_tensor returned for a block past seqlen_q).
    const uint key_begin = key_range(p, block_row).first;
    const uint key_end = key_range(p, min(block_row + FA_TENSOR_PAIR_BLOCK_Q, p.seqlen_q) - 1).end;
    const KeyRange unmasked = unmasked_keys(p, r0, R);
    const RowModifiers mods = row_modifiers(p, alibi, b, h, live ? r0 : block_row);
    const uint stream = dropout_stream(p, b, h);
    const TensorQueryRow q_row = tensor_query_row(p, lse, delta, residual, b, h, r0, mine, rows);

    constexpr TensorBackwardDescriptor scores_desc = tensor_scores_product<DH>();
    constexpr TensorBackwardDescriptor gradient_desc = tensor_gradient_product<DH>();
    mpp::tensor_ops::matmul2d<scores_desc, execution_simdgroup> scores_op;
    mpp::tensor_ops::matmul2d<gradient_desc, execution_simdgroup> gradient_op;
    const uint q_cols = pair_columns(p.head_dim, col0, DH);
    const uint v_cols = pair_columns(p.head_dim_v, col0, DH);
    auto q_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    auto dout_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    if (live) {
        q_rows.load(rows_tensor(q + head_offset(p.q, b, h) + ulong(r0) * p.q.seq + col0, q_cols, rows, p.q.seq));
        dout_rows.load(rows_tensor(dout + head_offset(p.dout, b, h) + ulong(r0) * p.dout.seq + col0, v_cols, rows,
                                   p.dout.seq));
    }
    device const T *k_head = k + head_offset(p.k, b, kv_head) + col0;
    device const T *v_head = v + head_offset(p.v, b, kv_head) + col0;
    auto s_partial = rows_tensor(&tg->s[sgid][0][0], BK, R, BK);
    auto dp_partial = rows_tensor(&tg->dp[sgid][0][0], BK, R, BK);
    auto ds_tile = rows_tensor(&tg->ds[pair][0][0], BK, R, BK + FA_TENSOR_SCORE_PAD);
    auto k_tile = rows_tensor(k_head, q_cols, 0, p.k.seq);
    auto dq_acc =
        gradient_op.template get_destination_cooperative_tensor<decltype(ds_tile), decltype(k_tile), float>();
    clear_slots(dq_acc);

    for (uint kv0 = key_begin; kv0 < key_end; kv0 += BK) {
        k_tile = rows_tensor(k_head + ulong(kv0) * p.k.seq, q_cols, min(BK, p.seqlen_k - kv0), p.k.seq);
        if (live) {
            auto v_tile = rows_tensor(v_head + ulong(kv0) * p.v.seq, v_cols, min(BK, p.seqlen_k - kv0), p.v.seq);
            auto dp = scores_op.template get_destination_cooperative_tensor<decltype(dout_rows), decltype(v_tile),
                                                                             float>();
            scores_op.run(dout_rows, v_tile, dp);
            dp.store(dp_partial);
            auto sc =
                scores_op.template get_destination_cooperative_tensor<decltype(q_rows), decltype(k_tile), float>();
            scores_op.run(q_rows, k_tile, sc);
            sc.store(s_partial);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (live) {
            const bool masked = !tile_unmasked(unmasked, kv0, BK);
            for (uint c = 0; c < N; ++c) {
                const uint col = c0 + c;
                const float s = tg->s[2 * pair][mine][col] + tg->s[2 * pair + 1][mine][col];
                const float dp = tg->dp[2 * pair][mine][col] + tg->dp[2 * pair + 1][mine][col];
                tg->ds[pair][mine][col] =
                    query_score_gradient<T>(p, mask, q_row, s, dp, r0, mine, kv0 + col, mods, masked, stream);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (live) {
            gradient_op.run(ds_tile, k_tile, dq_acc);
        }
    }

    if (live) {
        store_scaled(dq + head_offset(p.dq, b, h) + ulong(r0) * p.dq.seq + col0, dq_acc, rows, q_cols, p.dq.seq,
                     p.softmax_scale);
    }
}

// ---- dK and dV ---------------------------------------------------------------------------------

// Per SIMD-group: its P^T tile (then dS^T) and the lse, residual, D and visible keys of the query
// tile's rows.
struct TensorBackwardKeyValueStorage {
    float pt[FA_SIMDGROUPS][FA_TENSOR_ROWS][FA_TENSOR_BLOCK_K + FA_TENSOR_SCORE_PAD];
    float lse[FA_SIMDGROUPS][FA_TENSOR_BLOCK_K];
    float residual[FA_SIMDGROUPS][FA_TENSOR_BLOCK_K];
    float delta[FA_SIMDGROUPS][FA_TENSOR_BLOCK_K];
    uint key_first[FA_SIMDGROUPS][FA_TENSOR_BLOCK_K];
    uint key_end[FA_SIMDGROUPS][FA_TENSOR_BLOCK_K];
};

// One threadgroup per FA_TENSOR_BLOCK_Q keys of one KV head; each SIMD-group owns FA_TENSOR_ROWS
// of them and works alone: its K and V rows stay in left cooperative tensors; over each query head
// of the GQA group in order and each tile of FA_TENSOR_BLOCK_K query rows that sees its keys, Q
// and dO are tensor operands read from device memory; dK and dV accumulate in destinations.
template <typename T, uint DP, typename Storage>
inline void attention_backward_dkv_tensor(device const T *dout, device const T *q, device const T *k,
                                          device const T *v, device const float *lse,
                                          device const float *delta, device const float *residual,
                                          device const uchar *mask, device const float *alibi,
                                          constant FlashAttentionParams &p, device T *dk, device T *dv,
                                          Storage tg, uint3 tgid, uint sgid, uint lane) {
    constexpr uint R = FA_TENSOR_ROWS;
    constexpr uint BQ = FA_TENSOR_BLOCK_K;
    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint key0 = (tgid.x + p.block_offset) * FA_TENSOR_BLOCK_Q + sgid * R;
    // Uniform over the SIMD-group, and no threadgroup barrier follows.
    if (key0 >= p.seqlen_k) {
        return;
    }
    const uint keys = min(R, p.seqlen_k - key0);
    // The query rows that see some key of the SIMD-group's through the window.
    const KeyRange rows = row_range(p, key0, keys);
    auto row_lse = tg->lse[sgid];
    auto row_residual = tg->residual[sgid];
    auto row_delta = tg->delta[sgid];
    auto key_first = tg->key_first[sgid];
    auto key_last = tg->key_end[sgid];

    constexpr TensorBackwardDescriptor scores_desc = tensor_scores_product<DP>();
    constexpr TensorBackwardDescriptor gradient_desc = tensor_gradient_product<DP>();
    mpp::tensor_ops::matmul2d<scores_desc, execution_simdgroup> scores_op;
    mpp::tensor_ops::matmul2d<gradient_desc, execution_simdgroup> gradient_op;
    auto k_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    k_rows.load(rows_tensor(k + head_offset(p.k, b, kv_head) + ulong(key0) * p.k.seq, p.head_dim, keys, p.k.seq));
    auto v_rows = scores_op.template get_left_input_cooperative_tensor<T, T, float>();
    v_rows.load(rows_tensor(v + head_offset(p.v, b, kv_head) + ulong(key0) * p.v.seq, p.head_dim_v, keys,
                            p.v.seq));
    auto pt_tile = rows_tensor(&tg->pt[sgid][0][0], BQ, R, BQ + FA_TENSOR_SCORE_PAD);
    auto q_tile = rows_tensor(q, p.head_dim, 0, p.q.seq);
    auto dout_tile = rows_tensor(dout, p.head_dim_v, 0, p.dout.seq);
    auto dk_acc =
        gradient_op.template get_destination_cooperative_tensor<decltype(pt_tile), decltype(q_tile), float>();
    auto dv_acc =
        gradient_op.template get_destination_cooperative_tensor<decltype(pt_tile), decltype(dout_tile), float>();
    clear_slots(dk_acc);
    clear_slots(dv_acc);

    for (uint g = 0; g < group; ++g) {
        const uint h = kv_head * group + g;
        device const T *q_head = q + head_offset(p.q, b, h);
        device const T *dout_head = dout + head_offset(p.dout, b, h);
        const RowModifiers head_mods = row_modifiers(p, alibi, b, h, 0);
        const uint stream = dropout_stream(p, b, h);
        const ulong head_rows = lse_index(p, b, h, 0);
        for (uint q0 = rows.first; q0 < rows.end; q0 += BQ) {
            // The tile's rows: lane l's is q0 + l (0 and no keys past the end, whose P is 0).
            simdgroup_barrier(mem_flags::mem_threadgroup);
            const uint mine = q0 + lane;
            const ulong at_row = head_rows + (mine < p.seqlen_q ? mine : 0);
            row_lse[lane] = mine < p.seqlen_q ? backward_row_lse(lse[at_row]) : 0.0f;
            row_residual[lane] = mine < p.seqlen_q ? residual[at_row] : 0.0f;
            row_delta[lane] = mine < p.seqlen_q ? delta[at_row] : 0.0f;
            const KeyRange seen = visible_keys(p, mine);
            key_first[lane] = seen.first;
            key_last[lane] = seen.end;
            simdgroup_barrier(mem_flags::mem_threadgroup);

            // S^T = K Q^T and dP^T = V dO^T.
            q_tile = rows_tensor(q_head + ulong(q0) * p.q.seq, p.head_dim, min(BQ, p.seqlen_q - q0), p.q.seq);
            dout_tile = rows_tensor(dout_head + ulong(q0) * p.dout.seq, p.head_dim_v, min(BQ, p.seqlen_q - q0),
                                    p.dout.seq);
            auto st =
                scores_op.template get_destination_cooperative_tensor<decltype(k_rows), decltype(q_tile), float>();
            scores_op.run(k_rows, q_tile, st);
            auto dpt =
                scores_op.template get_destination_cooperative_tensor<decltype(v_rows), decltype(dout_tile), float>();
            scores_op.run(v_rows, dout_tile, dpt);

            // P^T (dropped, for dV) in place of S^T, dS^T (through the softcap) in place of dP^T.
            const bool masked = !tile_unmasked(p, q0, BQ, key0, R);
            for (uint i = 0; i < st.get_capacity(); ++i) {
                if (st.is_valid_element(i)) {
                    const auto at = st.get_multidimensional_index(i);
                    const uint c = uint(at[0]);
                    const uint row = q0 + c;
                    const uint key = key0 + uint(at[1]);
                    RowModifiers m = head_mods;
                    m.mask_row += ulong(row) * p.mask.seq;
                    m.keys.first = key_first[c];
                    m.keys.end = key_last[c];
                    float t;
                    const float x = score<T>(p, mask, st[i], row, key, m, !masked || in_window(m.keys, key), t);
                    const float pe = probability(x, row_lse[c], row_residual[c]);
                    const float kept = dropout_on(p) ? dropout_factor(p, stream, row, key) : 1.0f;
                    st[i] = pe * kept;
                    dpt[i] = through_softcap(p, pe * (dpt[i] * kept - row_delta[c]), t);
                }
            }

            // dV += P^T dO, then dK += dS^T Q, each through the SIMD-group's tile of threadgroup memory.
            st.store(pt_tile);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            gradient_op.run(pt_tile, dout_tile, dv_acc);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            dpt.store(pt_tile);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            gradient_op.run(pt_tile, q_tile, dk_acc);
        }
    }

    store_scaled(dk + head_offset(p.dk, b, kv_head) + ulong(key0) * p.dk.seq, dk_acc, keys, p.head_dim, p.dk.seq,
                 p.softmax_scale);
    store_scaled(dv + head_offset(p.dv, b, kv_head) + ulong(key0) * p.dv.seq, dv_acc, keys, p.head_dim_v, p.dv.seq,
                 1.0f);
}

// ---- catalogue bodies --------------------------------------------------------------------------
// backward_dq_tensor and backward_dkv_tensor (flash_attention_kernels.h conventions: a varlen
// pass's sequence struct, its rows and keys).

template <typename T, uint DP, typename Storage>
inline void kernel_backward_dq_tensor(FA_PARAMETERS(FA_BACKWARD_DQ_BUFFERS, T), Storage tg, uint3 tgid,
                                      uint sgid, uint lane) {
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * tensor_block_q(DP), p.seqlen_q)) {
        return;
    }
    attention_backward_dq_tensor<T, DP>(FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v),
                                        lse + p.seq_q0, delta + p.seq_q0, lse_residual + p.seq_q0, mask,
                                        sequence_alibi(p, alibi, tgid.z), p, FA_QUERY_ROWS(dq), tg,
                                        sequence_tgid(p, tgid), sgid, lane, TensorTiling<tensor_pairs(DP)>());
}

template <typename T, uint DP, typename Storage>
inline void kernel_backward_dkv_tensor(FA_PARAMETERS(FA_BACKWARD_DKV_BUFFERS, T), Storage tg, uint3 tgid,
                                       uint sgid, uint lane) {
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * FA_TENSOR_BLOCK_Q, p.seqlen_k)) {
        return;
    }
    attention_backward_dkv_tensor<T, DP>(FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v),
                                         lse + p.seq_q0, delta + p.seq_q0, lse_residual + p.seq_q0, mask,
                                         sequence_alibi(p, alibi, tgid.z), p, FA_KEY_ROWS(dk), FA_KEY_ROWS(dv),
                                         tg, sequence_tgid(p, tgid), sgid, lane);
}

#endif
