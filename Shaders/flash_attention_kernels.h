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
//   backward_dkv_split + backward_dkv_reduce (few KV heads): the same over a part of the group per
//     threadgroup into float32 partial sums, then dk, dv = their sum in split order
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
//
// The kernels are listed once, in flash_attention_catalogue.h; this header defines each one's body
// (kernel_<name>, calling the algorithms of the family headers) and the macros that define the
// entry points, which flash_attention.metal instantiates per dtype and head-dim bucket
// (FA_HEAD_DIM_BUCKETS for half and bfloat, FA_HEAD_DIM_BUCKETS_F32 for float; the decode kernels
// up to FA_DECODE_MAX_HEAD_DIM), named <kernel>_<dtype>_d<head_dim_max>. Threadgroup storage is
// one type per kernel, named <kernel>_threadgroup. Include after <metal_stdlib> and
// `using namespace metal;`.

#ifndef FLASH_ATTENTION_KERNELS_H
#define FLASH_ATTENTION_KERNELS_H

#include "flash_attention_catalogue.h"
#include "flash_attention_traits.h"
#include "flash_attention_decode_mma.h"
#include "flash_attention_varlen.h"

// ---- parameters and arguments from the catalogue's buffer lists ------------------------------

#define FA_ACCESS_read const
#define FA_ACCESS_write
// One buffer as a function parameter (constant buffers are read-only references).
#define FA_PARAMETER(INDEX, NAME, TYPE, ACCESS, SPACE) , FA_PARAMETER_##SPACE(NAME, TYPE, ACCESS)
#define FA_PARAMETER_device_memory(NAME, TYPE, ACCESS) device FA_ACCESS_##ACCESS TYPE *NAME
#define FA_PARAMETER_constant_memory(NAME, TYPE, ACCESS) constant TYPE &NAME
#define FA_PARAMETER_constant_array(NAME, TYPE, ACCESS) constant TYPE *NAME
// A kernel body's parameters: the buffers of list BUFFERS for element type T, in order.
#define FA_PARAMETERS(BUFFERS, T) FA_TAIL(0 BUFFERS(FA_PARAMETER, T))
// An entry point's: the same with their [[buffer(i)]], then the built-ins.
#define FA_ENTRY_PARAMETER(INDEX, NAME, TYPE, ACCESS, SPACE)                                       \
    , FA_PARAMETER_##SPACE(NAME, TYPE, ACCESS) [[buffer(INDEX)]]
#define FA_ENTRY_BUILTIN(TYPE, NAME, ATTRIBUTE) , TYPE NAME [[ATTRIBUTE]]
#define FA_ARGUMENT(INDEX, NAME, TYPE, ACCESS, SPACE) , NAME
#define FA_BUILTIN_ARGUMENT(TYPE, NAME, ATTRIBUTE) , NAME
// A kernel body's buffers as the arguments of a call (the names FA_PARAMETERS gave them).
#define FA_ARGUMENTS(BUFFERS, T) FA_TAIL(0 BUFFERS(FA_ARGUMENT, T))

// A tensor's pointer moved to the first query row (key) of the sequence of struct `p`
// (flash_attention_varlen.h); unmoved in a dense problem, whose seq_q0 and seq_k0 are 0.
#define FA_QUERY_ROWS(X) ((X) + ulong(p.seq_q0) * p.X.seq)
#define FA_KEY_ROWS(X) ((X) + ulong(p.seq_k0) * p.X.seq)

// ---- kernel bodies: kernel_<KERNEL> of each catalogue entry ------------------------------------
// Each takes the kernel's buffers, a pointer to its threadgroup storage (unless it has none) and
// its built-ins, in catalogue order; template arguments <T, DP> (bucket kernels), <T> (dtype
// kernels) or none.

template <typename T, uint DP, typename Storage>
inline void kernel_forward(FA_PARAMETERS(FA_FORWARD_BUFFERS, T), Storage tg, uint3 tgid, uint sgid,
                           uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * K::forward_block_q, p.seqlen_q)) {
        return;
    }
    attention_forward<DP, K::forward_block_q, K::forward_block_k>(
        FA_QUERY_ROWS(q), DeviceKV<T>{FA_KEY_ROWS(k), FA_KEY_ROWS(v)}, FA_QUERY_ROWS(out),
        lse + p.seq_q0,
        mask, sequence_alibi(p, alibi, tgid.z), sinks, p, tg, sequence_tgid(p, tgid), sgid,
        lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_forward_split(FA_PARAMETERS(FA_FORWARD_SPLIT_BUFFERS, T), Storage tg, uint3 tgid,
                                 uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    attention_forward_split<DP, K::forward_block_q, K::forward_block_k>(
        q, DeviceKV<T>{k, v}, mask, alibi, partial_out, partial_lse, *params, tg, tgid, sgid, lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_forward_decode(FA_PARAMETERS(FA_FORWARD_SPLIT_BUFFERS, T), Storage tg, uint3 tgid,
                                  uint sgid, uint lane) {
    attention_forward_decode<DP>(q, DeviceKV<T>{k, v}, mask, alibi, partial_out, partial_lse,
                                 *params, tg, tgid, sgid, lane);
}

// The KV-cache forward kernels (flash_attention_kv_cache.h): the forward kernels with keys and
// values read by the cache's kind (FA_WITH_CACHE_SOURCE: one key loop per kind, chosen once per
// launch); the split ones' chunks are merged by forward_combine.
template <typename T, uint DP, typename Storage>
inline void kernel_forward_kvcache(FA_PARAMETERS(FA_KV_CACHE_BUFFERS, T), Storage tg, uint3 tgid,
                                   uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = *params;
#define FA_FORWARD_KVCACHE(SOURCE)                                                                 \
    attention_forward<DP, K::forward_block_q, K::forward_block_k>(q, SOURCE, out, lse, mask, alibi, sinks, p, tg, \
                                                                  tgid, sgid, lane)
    FA_WITH_CACHE_SOURCE(T, p, FA_FORWARD_KVCACHE)
#undef FA_FORWARD_KVCACHE
}

// A split forward over a KV cache by the cache's kind, BQ packed rows per block (the tiled split
// kernel's forward_block_q, the spec kernel's spec_block_q).
template <typename T, uint DP, uint BQ, typename Storage>
inline void split_kvcache(FA_PARAMETERS(FA_KV_CACHE_SPLIT_BUFFERS, T), Storage tg, uint3 tgid, uint sgid,
                          uint lane) {
    constexpr uint BK = KernelTraits<T, DP>::forward_block_k;
    constant FlashAttentionParams &p = *params;
#define FA_SPLIT_KVCACHE(SOURCE)                                                                   \
    attention_forward_split<DP, BQ, BK>(q, SOURCE, mask, alibi, partial_out, partial_lse, p, tg, tgid, sgid, lane)
    FA_WITH_CACHE_SOURCE(T, p, FA_SPLIT_KVCACHE)
#undef FA_SPLIT_KVCACHE
}

template <typename T, uint DP, typename Storage>
inline void kernel_forward_split_kvcache(FA_PARAMETERS(FA_KV_CACHE_SPLIT_BUFFERS, T), Storage tg,
                                         uint3 tgid, uint sgid, uint lane) {
    split_kvcache<T, DP, KernelTraits<T, DP>::forward_block_q>(FA_ARGUMENTS(FA_KV_CACHE_SPLIT_BUFFERS, T), tg,
                                                                tgid, sgid, lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_forward_decode_kvcache(FA_PARAMETERS(FA_KV_CACHE_SPLIT_BUFFERS, T), Storage tg,
                                          uint3 tgid, uint sgid, uint lane) {
    attention_forward_decode<DP>(q, FA_KV_CACHE_SOURCE(T), mask, alibi, partial_out, partial_lse,
                                 *params, tg, tgid, sgid, lane);
}

// The MMA decode over a quantized cache (FA_DECODE_MMA_SERVES; flash_attention_decode_mma.h).
template <typename T, uint DP, typename Storage>
inline void kernel_forward_decode_mma_kvcache(FA_PARAMETERS(FA_KV_CACHE_SPLIT_BUFFERS, T), Storage tg,
                                              uint3 tgid, uint sgid, uint lane) {
    attention_forward_decode<DP, true>(q, FA_KV_CACHE_SOURCE(T), mask, alibi, partial_out, partial_lse,
                                       *params, tg, tgid, sgid, lane);
}

// The spec forward (FA_SPEC_SERVES): the tiled split kernel with blocks of spec_block_q packed rows.
template <typename T, uint DP, typename Storage>
inline void kernel_forward_spec(FA_PARAMETERS(FA_FORWARD_SPLIT_BUFFERS, T), Storage tg, uint3 tgid, uint sgid,
                                uint lane) {
    typedef KernelTraits<T, DP> K;
    attention_forward_split<DP, K::spec_block_q, K::forward_block_k>(
        q, DeviceKV<T>{k, v}, mask, alibi, partial_out, partial_lse, *params, tg, tgid, sgid, lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_forward_spec_kvcache(FA_PARAMETERS(FA_KV_CACHE_SPLIT_BUFFERS, T), Storage tg, uint3 tgid,
                                        uint sgid, uint lane) {
    split_kvcache<T, DP, KernelTraits<T, DP>::spec_block_q>(FA_ARGUMENTS(FA_KV_CACHE_SPLIT_BUFFERS, T), tg, tgid,
                                                             sgid, lane);
}

template <typename T>
inline void kernel_forward_combine(FA_PARAMETERS(FA_FORWARD_COMBINE_BUFFERS, T), uint3 tgid, uint tid) {
    attention_forward_combine(partial_out, partial_lse, sinks, out, lse, *params, tgid, tid);
}

template <typename T, typename Storage>
inline void kernel_backward_delta(FA_PARAMETERS(FA_BACKWARD_DELTA_BUFFERS, T), Storage tg, uint3 tgid,
                                  uint tid) {
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * FA_DELTA_BLOCK_ROWS, p.seqlen_q)) {
        return;
    }
    attention_backward_delta(FA_QUERY_ROWS(dout), FA_QUERY_ROWS(out), delta + p.seq_q0, p, tg,
                             sequence_tgid(p, tgid), tid);
}

template <typename T, uint DP, typename Storage>
inline void kernel_backward_lse_residual(FA_PARAMETERS(FA_BACKWARD_LSE_RESIDUAL_BUFFERS, T), Storage tg,
                                         uint3 tgid, uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * K::forward_block_q, p.seqlen_q)) {
        return;
    }
    attention_backward_lse_residual<DP, K::forward_block_q, K::forward_block_k>(
        FA_QUERY_ROWS(q), FA_KEY_ROWS(k), lse + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z),
        sinks, lse_residual + p.seq_q0, p, tg, sequence_tgid(p, tgid), sgid, lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_backward_dq(FA_PARAMETERS(FA_BACKWARD_DQ_BUFFERS, T), Storage tg, uint3 tgid,
                               uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * K::dq_block_q, p.seqlen_q)) {
        return;
    }
    attention_backward_dq<DP, K::dq_block_q, K::dq_block_k, K::dq_shared != 0>(
        FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), lse + p.seq_q0,
        delta + p.seq_q0, lse_residual + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), p,
        FA_QUERY_ROWS(dq), tg, sequence_tgid(p, tgid), sgid, lane);
}

template <typename T, uint DP, typename Storage>
inline void kernel_backward_dkv(FA_PARAMETERS(FA_BACKWARD_DKV_BUFFERS, T), Storage tg, uint3 tgid,
                                uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    if (block_past_end((tgid.x + p.block_offset) * K::dkv_block_k, p.seqlen_k)) {
        return;
    }
    const GroupHeads group = {0u, p.num_heads / p.num_kv_heads};
    attention_backward_dkv<DP, K::dkv_block_k, K::dkv_block_q, K::dkv_shared != 0>(
        FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), lse + p.seq_q0,
        delta + p.seq_q0, lse_residual + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), p,
        KeyValueGradients<T>{FA_KEY_ROWS(dk), FA_KEY_ROWS(dv)}, tg, tgid.x + p.block_offset, group,
        sequence_tgid(p, tgid), sgid, lane);
}

// dK/dV over few KV heads: x = key block x dkv_splits + split, each split a part of the GQA group
// writing its partial sums (the host's struct, params[0], holds the rows of the partials).
template <typename T, uint DP, typename Storage>
inline void kernel_backward_dkv_split(FA_PARAMETERS(FA_BACKWARD_DKV_SPLIT_BUFFERS, T), Storage tg, uint3 tgid,
                                      uint sgid, uint lane) {
    typedef KernelTraits<T, DP> K;
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    const uint x = tgid.x + p.block_offset;
    const uint block = x / p.dkv_splits;
    if (block_past_end(block * K::dkv_block_k, p.seqlen_k)) {
        return;
    }
    const uint split = x % p.dkv_splits;
    const uint rows = params[0].seqlen_k;
    attention_backward_dkv<DP, K::dkv_block_k, K::dkv_block_q, K::dkv_shared != 0>(
        FA_QUERY_ROWS(dout), FA_QUERY_ROWS(q), FA_KEY_ROWS(k), FA_KEY_ROWS(v), lse + p.seq_q0,
        delta + p.seq_q0, lse_residual + p.seq_q0, mask, sequence_alibi(p, alibi, tgid.z), p,
        PartialKeyValueGradients{partial_dk + ulong(p.seq_k0) * p.head_dim,
                                 partial_dv + ulong(p.seq_k0) * p.head_dim_v, rows, split},
        tg, block, group_split(p, split), sequence_tgid(p, tgid), sgid, lane);
}

template <typename T>
inline void kernel_backward_dkv_reduce(FA_PARAMETERS(FA_BACKWARD_DKV_REDUCE_BUFFERS, T), uint3 tgid, uint tid) {
    constant FlashAttentionParams &p = sequence_params(params, tgid.z);
    const uint first = (tgid.x + p.block_offset) * FA_DKV_REDUCE_ROWS;
    if (block_past_end(first, p.seqlen_k)) {
        return;
    }
    attention_backward_dkv_reduce(partial_dk + ulong(p.seq_k0) * p.head_dim,
                                  partial_dv + ulong(p.seq_k0) * p.head_dim_v, params[0].seqlen_k,
                                  FA_KEY_ROWS(dk), FA_KEY_ROWS(dv), p, first, sequence_tgid(p, tgid), tid);
}

template <typename Storage>
inline void kernel_backward_dsinks(FA_PARAMETERS(FA_BACKWARD_DSINKS_BUFFERS, uchar), Storage tg,
                                   uint3 tgid, uint tid) {
    attention_backward_dsinks(lse, delta, sinks, lse_residual, dsinks, *params, tg, tgid.x, tid);
}

// The first dispatch of a varlen pass (flash_attention_varlen.h): one threadgroup.
template <typename Storage>
inline void kernel_varlen_sequences(FA_PARAMETERS(FA_VARLEN_BUFFERS, uchar), Storage tg, uint tid) {
    varlen_sequences(cu_seqlens_q, cu_seqlens_k, table, params, tg, tid);
}

// fa_merge_attention(_v2): two results over disjoint key sets -> the result over their union
// (flash_attention_merge.h).
template <typename T>
inline void kernel_merge(FA_PARAMETERS(FA_MERGE_BUFFERS, T), uint3 tgid, uint tid) {
    attention_merge<T>(out_a, lse_a, out_b, lse_b, out, lse, params, tgid, tid);
}

// ---- entry points ------------------------------------------------------------------------------

// The threadgroup storage type of a kernel and the template arguments of its body, by INSTANCES.
#define FA_STORAGE_TYPE(INSTANCES, STORAGE, T, DP) FA_STORAGE_TYPE_##INSTANCES(STORAGE, T, DP)
#define FA_STORAGE_TYPE_bucket(STORAGE, T, DP) KernelTraits<T, DP>::STORAGE
#define FA_STORAGE_TYPE_decode_bucket(STORAGE, T, DP) KernelTraits<T, DP>::STORAGE
#define FA_STORAGE_TYPE_decode_mma_bucket(STORAGE, T, DP) KernelTraits<T, DP>::STORAGE
#define FA_STORAGE_TYPE_tensor_bucket(STORAGE, T, DP) TensorKernelTraits<T, DP>::STORAGE
#define FA_STORAGE_TYPE_dtype(STORAGE, T, DP) STORAGE<T>
#define FA_STORAGE_TYPE_once(STORAGE, T, DP) STORAGE
#define FA_BODY_ARGUMENTS_bucket(T, DP) <T, DP>
#define FA_BODY_ARGUMENTS_decode_bucket(T, DP) <T, DP>
#define FA_BODY_ARGUMENTS_decode_mma_bucket(T, DP) <T, DP>
#define FA_BODY_ARGUMENTS_tensor_bucket(T, DP) <T, DP>
#define FA_BODY_ARGUMENTS_dtype(T, DP) <T>
#define FA_BODY_ARGUMENTS_once(T, DP)

// One named, non-template entry point (C++ for OpenCL, which the static checks compile, has no
// kernel templates) calling its body; its threadgroup storage type is <name>_threadgroup, so a
// host (the CPU engine) can size it.
#define FA_DEFINE_KERNEL(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP)      \
    FA_IF_STORAGE(STORAGE, typedef FA_STORAGE_TYPE(INSTANCES, STORAGE, T, DP)                      \
                               FA_CAT(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP), _threadgroup);) \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)(                                     \
        FA_TAIL(0 BUFFERS(FA_ENTRY_PARAMETER, T) BUILTINS(FA_ENTRY_BUILTIN))) {                    \
        FA_IF_STORAGE(STORAGE,                                                                     \
                      threadgroup FA_CAT(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP), _threadgroup) tg;) \
        kernel_##KERNEL FA_BODY_ARGUMENTS_##INSTANCES(T, DP)(FA_TAIL(                              \
            0 BUFFERS(FA_ARGUMENT, T) FA_IF_STORAGE(STORAGE, , &tg) BUILTINS(FA_BUILTIN_ARGUMENT))); \
    }

// The entry points of bucket DP of element type T (name suffix SUFFIX: f16, bf16, f32), of the
// kernels per dtype, and of the kernels with one instance.
#define FA_DEFINE_BUCKET_KERNELS(T, SUFFIX, DP) FA_KERNELS(FA_AT_BUCKET, FA_DEFINE_KERNEL, T, SUFFIX, DP)
#define FA_DEFINE_DTYPE_KERNELS(T, SUFFIX) FA_KERNELS(FA_AT_DTYPE, FA_DEFINE_KERNEL, T, SUFFIX, 0)
#define FA_DEFINE_ONCE_KERNELS() FA_KERNELS(FA_AT_ONCE, FA_DEFINE_KERNEL, uchar, , 0)
// The bucket kernels of each dtype, for its table: FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16).
#define FA_DEFINE_F16(DP, ...) FA_DEFINE_BUCKET_KERNELS(half, f16, DP)
#define FA_DEFINE_BF16(DP, ...) FA_DEFINE_BUCKET_KERNELS(bfloat, bf16, DP)
#define FA_DEFINE_F32(DP, ...) FA_DEFINE_BUCKET_KERNELS(float, f32, DP)

#endif
