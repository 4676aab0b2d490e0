// The kernel catalogue: every kernel of the library, what it binds and what it reads. The one list
// that the Metal entry points (flash_attention_kernels.h, instantiated by flash_attention.metal),
// the CPU engine's table (Sources/MSLEngine), the CUDA check build's kernels and the Swift dispatch
// plan's kernel table (Sources/CFlashAttentionMetal) expand. Plain preprocessor text, so that C
// includes it too. Adding a kernel is one FA_KERNELS entry (and its buffer list where no existing
// one fits) plus its body: docs/contributing.md, "Adding a kernel".
#ifndef FLASH_ATTENTION_CATALOGUE_H
#define FLASH_ATTENTION_CATALOGUE_H

#include "flash_attention_params.h"

// FA_KERNELS(X, ...) calls X(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, ...) once per
// kernel, passing its own trailing arguments on:
// - KERNEL: the name after flash_attention_; its template body is kernel_<KERNEL>
//   (flash_attention_kernels.h).
// - INSTANCES: `bucket`, one instance per dtype and head-dim bucket, named
//   flash_attention_<KERNEL>_<dtype>_d<head_dim_max>; `decode_bucket`, the same for the buckets
//   up to FA_DECODE_MAX_HEAD_DIM (FA_IF_DECODE); `decode_mma_bucket`, the same for the buckets
//   the MMA decode serves (FA_IF_DECODE_MMA); `tensor_bucket`, the same for the half and bfloat
//   buckets that have a Metal 4 tensor-op kernel (FA_IF_TENSOR, flash_attention_tensor.h), which
//   only the tensor-op library (flash_attention_tensor.metal, MSL 4.0) and the CPU engine define;
//   `dtype`, one per dtype, flash_attention_<KERNEL>_<dtype>; `once`, one, flash_attention_<KERNEL>.
// - BUFFERS: a buffer list, BUFFERS(B, T) calling B(INDEX, NAME, TYPE, ACCESS, SPACE) per buffer in
//   [[buffer(INDEX)]] order: TYPE the element type (T, the instance's dtype, or float, uchar, int,
//   FlashAttentionParams), ACCESS `read` or `write`, SPACE `device_memory` (a pointer),
//   `constant_memory` (a reference; hosts without a constant address space may bind it as a device
//   pointer) or `constant_array` (a pointer to an array of unknown length in the constant address
//   space: the forward's and backward's parameters, one struct or a varlen pass's sequence table,
//   which sequence_params indexes). An index past the last listed one is never bound; a gap (the dense KV-cache kernel's
//   9 and 10) is a slot the kernel does not read.
// - READS: the function constants the kernel reads (FA_FUNCTION_CONSTANTS), READS(C) calling
//   C(INDEX) per constant: its pipeline is specialised for exactly those.
// - STORAGE: its threadgroup storage, `none` or, by INSTANCES: the member of
//   KernelTraits<T, DP> (bucket kinds), a template of the dtype (dtype), a type (once).
// - BUILTINS: its MSL built-in arguments after the buffers, BUILTINS(A) calling A(TYPE, NAME,
//   ATTRIBUTE) per argument.
#define FA_KERNELS(X, ...)                                                                                       \
    X(forward, bucket, FA_FORWARD_BUFFERS, FA_READS_FORWARD, forward_storage,                                    \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_split, bucket, FA_FORWARD_SPLIT_BUFFERS, FA_READS_SCORE, forward_storage, FA_BUILTINS_SIMDGROUP,   \
      __VA_ARGS__)                                                                                               \
    X(forward_decode, decode_bucket, FA_FORWARD_SPLIT_BUFFERS, FA_READS_SCORE, decode_storage,                   \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_kvcache, bucket, FA_KV_CACHE_BUFFERS, FA_READS_FORWARD, forward_storage,                           \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_split_kvcache, bucket, FA_KV_CACHE_SPLIT_BUFFERS, FA_READS_SCORE, forward_storage,                 \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_decode_kvcache, decode_bucket, FA_KV_CACHE_SPLIT_BUFFERS, FA_READS_SCORE, decode_storage,          \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_decode_mma_kvcache, decode_mma_bucket, FA_KV_CACHE_SPLIT_BUFFERS, FA_READS_SCORE, decode_storage,      \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_spec, decode_bucket, FA_FORWARD_SPLIT_BUFFERS, FA_READS_SCORE, spec_storage, FA_BUILTINS_SIMDGROUP, \
      __VA_ARGS__)                                                                                               \
    X(forward_spec_kvcache, decode_bucket, FA_KV_CACHE_SPLIT_BUFFERS, FA_READS_SCORE, spec_storage,              \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(forward_combine, dtype, FA_FORWARD_COMBINE_BUFFERS, FA_READS_SINKS, none, FA_BUILTINS_THREAD, __VA_ARGS__) \
    X(backward_delta, dtype, FA_BACKWARD_DELTA_BUFFERS, FA_READS_NONE, DeltaStorage, FA_BUILTINS_THREAD,         \
      __VA_ARGS__)                                                                                               \
    X(backward_lse_residual, bucket, FA_BACKWARD_LSE_RESIDUAL_BUFFERS, FA_READS_SCORE_AND_SINKS,                 \
      lse_residual_storage, FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                  \
    X(backward_dq, bucket, FA_BACKWARD_DQ_BUFFERS, FA_READS_GRADIENTS, dq_storage, FA_BUILTINS_SIMDGROUP,        \
      __VA_ARGS__)                                                                                               \
    X(backward_dkv, bucket, FA_BACKWARD_DKV_BUFFERS, FA_READS_GRADIENTS, dkv_storage, FA_BUILTINS_SIMDGROUP,     \
      __VA_ARGS__)                                                                                               \
    X(backward_dkv_split, bucket, FA_BACKWARD_DKV_SPLIT_BUFFERS, FA_READS_GRADIENTS, dkv_storage,                \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                        \
    X(backward_dkv_reduce, dtype, FA_BACKWARD_DKV_REDUCE_BUFFERS, FA_READS_NONE, none, FA_BUILTINS_THREAD,       \
      __VA_ARGS__)                                                                                               \
    X(backward_dsinks, once, FA_BACKWARD_DSINKS_BUFFERS, FA_READS_NONE, DsinksStorage, FA_BUILTINS_THREAD,       \
      __VA_ARGS__)                                                                                               \
    X(varlen_sequences, once, FA_VARLEN_BUFFERS, FA_READS_NONE, VarlenSequencesStorage,                          \
      FA_BUILTINS_THREAD_INDEX, __VA_ARGS__)                                                                     \
    X(merge, dtype, FA_MERGE_BUFFERS, FA_READS_NONE, none, FA_BUILTINS_THREAD, __VA_ARGS__)              \
    X(forward_tensor, tensor_bucket, FA_FORWARD_BUFFERS, FA_READS_FORWARD, tensor_forward_storage,            \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                     \
    X(backward_dq_tensor, tensor_bucket, FA_BACKWARD_DQ_BUFFERS, FA_READS_GRADIENTS, tensor_dq_storage,       \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)                                                                     \
    X(backward_dkv_tensor, tensor_bucket, FA_BACKWARD_DKV_BUFFERS, FA_READS_GRADIENTS, tensor_dkv_storage,    \
      FA_BUILTINS_SIMDGROUP, __VA_ARGS__)

// ---- buffer lists ----------------------------------------------------------------------------

// Forward: q, k, v in; out, lse out; the optional inputs (bound to a placeholder when absent).
#define FA_FORWARD_BUFFERS(B, T)                                                                   \
    B(FA_FORWARD_BUFFER_Q, q, T, read, device_memory)                                              \
    B(FA_FORWARD_BUFFER_K, k, T, read, device_memory)                                              \
    B(FA_FORWARD_BUFFER_V, v, T, read, device_memory)                                              \
    B(FA_FORWARD_BUFFER_OUT, out, T, write, device_memory)                                         \
    B(FA_FORWARD_BUFFER_LSE, lse, float, write, device_memory)                                     \
    B(FA_FORWARD_BUFFER_PARAMS, params, FlashAttentionParams, read, constant_array)                \
    B(FA_FORWARD_BUFFER_MASK, mask, uchar, read, device_memory)                                    \
    B(FA_FORWARD_BUFFER_ALIBI, alibi, float, read, device_memory)                                  \
    B(FA_FORWARD_BUFFER_SINKS, sinks, float, read, device_memory)
// The split-KV forward's chunks: the forward's buffers and the partial results they write.
#define FA_FORWARD_SPLIT_BUFFERS(B, T)                                                             \
    FA_FORWARD_BUFFERS(B, T)                                                                       \
    B(FA_FORWARD_BUFFER_PARTIAL_OUT, partial_out, float, write, device_memory)                     \
    B(FA_FORWARD_BUFFER_PARTIAL_LSE, partial_lse, float, write, device_memory)
// The split-KV combine: reads the partial results.
#define FA_FORWARD_COMBINE_BUFFERS(B, T)                                                           \
    FA_FORWARD_BUFFERS(B, T)                                                                       \
    B(FA_FORWARD_BUFFER_PARTIAL_OUT, partial_out, float, read, device_memory)                      \
    B(FA_FORWARD_BUFFER_PARTIAL_LSE, partial_lse, float, read, device_memory)
// A KV cache's block table, scales and biases, after the forward's (and the split's) buffers.
#define FA_KV_CACHE_TABLE_BUFFERS(B, T)                                                            \
    B(FA_KV_CACHE_BUFFER_TABLE, kv_table, int, read, device_memory)                                \
    B(FA_KV_CACHE_BUFFER_K_SCALES, k_scales, T, read, device_memory)                               \
    B(FA_KV_CACHE_BUFFER_K_BIASES, k_biases, T, read, device_memory)                               \
    B(FA_KV_CACHE_BUFFER_V_SCALES, v_scales, T, read, device_memory)                               \
    B(FA_KV_CACHE_BUFFER_V_BIASES, v_biases, T, read, device_memory)
#define FA_KV_CACHE_BUFFERS(B, T) FA_FORWARD_BUFFERS(B, T) FA_KV_CACHE_TABLE_BUFFERS(B, T)
#define FA_KV_CACHE_SPLIT_BUFFERS(B, T) FA_FORWARD_SPLIT_BUFFERS(B, T) FA_KV_CACHE_TABLE_BUFFERS(B, T)

// Backward: the inputs every backward kernel binds, delta and the lse residual written by the
// kernel that computes them (DELTA, RESIDUAL: `read` or `write`).
#define FA_BACKWARD_BUFFERS(B, T, DELTA, RESIDUAL)                                                 \
    B(FA_BACKWARD_BUFFER_DOUT, dout, T, read, device_memory)                                       \
    B(FA_BACKWARD_BUFFER_Q, q, T, read, device_memory)                                             \
    B(FA_BACKWARD_BUFFER_K, k, T, read, device_memory)                                             \
    B(FA_BACKWARD_BUFFER_V, v, T, read, device_memory)                                             \
    B(FA_BACKWARD_BUFFER_OUT, out, T, read, device_memory)                                         \
    B(FA_BACKWARD_BUFFER_LSE, lse, float, read, device_memory)                                     \
    B(FA_BACKWARD_BUFFER_PARAMS, params, FlashAttentionParams, read, constant_array)               \
    B(FA_BACKWARD_BUFFER_DELTA, delta, float, DELTA, device_memory)                                \
    B(FA_BACKWARD_BUFFER_MASK, mask, uchar, read, device_memory)                                   \
    B(FA_BACKWARD_BUFFER_ALIBI, alibi, float, read, device_memory)                                 \
    B(FA_BACKWARD_BUFFER_SINKS, sinks, float, read, device_memory)                                 \
    B(FA_BACKWARD_BUFFER_LSE_RESIDUAL, lse_residual, float, RESIDUAL, device_memory)
#define FA_BACKWARD_DELTA_BUFFERS(B, T) FA_BACKWARD_BUFFERS(B, T, write, read)
#define FA_BACKWARD_LSE_RESIDUAL_BUFFERS(B, T) FA_BACKWARD_BUFFERS(B, T, read, write)
#define FA_BACKWARD_DQ_BUFFERS(B, T)                                                               \
    FA_BACKWARD_BUFFERS(B, T, read, read)                                                          \
    B(FA_BACKWARD_BUFFER_DQ, dq, T, write, device_memory)
#define FA_BACKWARD_DKV_BUFFERS(B, T)                                                              \
    FA_BACKWARD_BUFFERS(B, T, read, read)                                                          \
    B(FA_BACKWARD_BUFFER_DK, dk, T, write, device_memory)                                          \
    B(FA_BACKWARD_BUFFER_DV, dv, T, write, device_memory)
// The split dK/dV: its partial sums (FA_BACKWARD_BUFFER_PARTIAL_DK), then their reduction into dk, dv.
#define FA_BACKWARD_DKV_SPLIT_BUFFERS(B, T)                                                        \
    FA_BACKWARD_BUFFERS(B, T, read, read)                                                          \
    B(FA_BACKWARD_BUFFER_PARTIAL_DK, partial_dk, float, write, device_memory)                      \
    B(FA_BACKWARD_BUFFER_PARTIAL_DV, partial_dv, float, write, device_memory)
#define FA_BACKWARD_DKV_REDUCE_BUFFERS(B, T)                                                       \
    FA_BACKWARD_DKV_BUFFERS(B, T)                                                                  \
    B(FA_BACKWARD_BUFFER_PARTIAL_DK, partial_dk, float, read, device_memory)                       \
    B(FA_BACKWARD_BUFFER_PARTIAL_DV, partial_dv, float, read, device_memory)
// dsinks reads only lse, delta, sinks and the lse residual (float), whatever the dtype: its one
// instance takes uchar for T.
#define FA_BACKWARD_DSINKS_BUFFERS(B, T)                                                           \
    FA_BACKWARD_BUFFERS(B, T, read, read)                                                          \
    B(FA_BACKWARD_BUFFER_DSINKS, dsinks, float, write, device_memory)

// fa_merge_attention: two parts' out and lse in, their merge out.
#define FA_MERGE_BUFFERS(B, T)                                                                     \
    B(FA_MERGE_BUFFER_OUT_A, out_a, T, read, device_memory)                                        \
    B(FA_MERGE_BUFFER_LSE_A, lse_a, float, read, device_memory)                                    \
    B(FA_MERGE_BUFFER_OUT_B, out_b, T, read, device_memory)                                        \
    B(FA_MERGE_BUFFER_LSE_B, lse_b, float, read, device_memory)                                    \
    B(FA_MERGE_BUFFER_OUT, out, T, write, device_memory)                                           \
    B(FA_MERGE_BUFFER_LSE, lse, float, write, device_memory)                                       \
    B(FA_MERGE_BUFFER_PARAMS, params, FlashAttentionParams, read, constant_memory)

// The first dispatch of a varlen pass: cu_seqlens in, the sequence table out.
#define FA_VARLEN_BUFFERS(B, T)                                                                    \
    B(FA_VARLEN_BUFFER_CU_SEQLENS_Q, cu_seqlens_q, int, read, device_memory)                       \
    B(FA_VARLEN_BUFFER_CU_SEQLENS_K, cu_seqlens_k, int, read, device_memory)                       \
    B(FA_VARLEN_BUFFER_TABLE, table, FlashAttentionParams, write, device_memory)                   \
    B(FA_VARLEN_BUFFER_PARAMS, params, FlashAttentionParams, read, constant_memory)

// ---- function constants read ------------------------------------------------------------------

// The score features in every kernel that computes scores; the sinks where a kernel starts or ends
// a row's softmax (the dense forward and the lse residual start it at the sink; the split forward
// leaves it to its combine); dropout where P meets V or dP (the dense forward, dQ, dK/dV: a problem
// with dropout is never split).
#define FA_READS_SCORE(C)                                                                          \
    C(FA_FUNCTION_CONSTANT_MASK_TYPE) C(FA_FUNCTION_CONSTANT_SOFTCAP) C(FA_FUNCTION_CONSTANT_ALIBI)
#define FA_READS_SINKS(C) C(FA_FUNCTION_CONSTANT_SINKS)
#define FA_READS_SCORE_AND_SINKS(C) FA_READS_SCORE(C) FA_READS_SINKS(C)
#define FA_READS_DROPOUT(C) C(FA_FUNCTION_CONSTANT_DROPOUT)
#define FA_READS_FORWARD(C) FA_READS_SCORE_AND_SINKS(C) FA_READS_DROPOUT(C)
#define FA_READS_GRADIENTS(C) FA_READS_SCORE(C) FA_READS_DROPOUT(C)
#define FA_READS_NONE(C)

// ---- built-ins ---------------------------------------------------------------------------------

#define FA_BUILTINS_SIMDGROUP(A)                                                                   \
    A(uint3, tgid, threadgroup_position_in_grid)                                                   \
    A(uint, sgid, simdgroup_index_in_threadgroup)                                                  \
    A(uint, lane, thread_index_in_simdgroup)
#define FA_BUILTINS_THREAD(A)                                                                      \
    A(uint3, tgid, threadgroup_position_in_grid)                                                   \
    A(uint, tid, thread_index_in_threadgroup)
#define FA_BUILTINS_THREAD_INDEX(A) A(uint, tid, thread_index_in_threadgroup)

// ---- expanding the catalogue -------------------------------------------------------------------
// Helpers every consumer shares. FA_KERNELS(FA_AT_BUCKET, F, T, SUFFIX, DP) calls
// F(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP) for the kernels that have
// an instance in bucket DP of dtype T (name suffix SUFFIX); FA_AT_TENSOR the same for the tensor-op
// kernels (never expanded by FA_AT_BUCKET: their source needs MSL 4.0 and its own library);
// FA_AT_DTYPE (DP 0) those that have one per dtype; FA_AT_ONCE (T uchar, SUFFIX and DP unused) the
// others.
#define FA_AT_BUCKET(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, F, T, SUFFIX, DP)       \
    FA_AT_BUCKET_##INSTANCES(DP, F(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP))
#define FA_AT_BUCKET_bucket(DP, ...) __VA_ARGS__
#define FA_AT_BUCKET_decode_bucket(DP, ...) FA_IF_DECODE(DP, __VA_ARGS__)
#define FA_AT_BUCKET_decode_mma_bucket(DP, ...) FA_IF_DECODE_MMA(DP, __VA_ARGS__)
#define FA_AT_BUCKET_tensor_bucket(DP, ...)
#define FA_AT_BUCKET_dtype(DP, ...)
#define FA_AT_BUCKET_once(DP, ...)
#define FA_AT_TENSOR(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, F, T, SUFFIX, DP)       \
    FA_AT_TENSOR_##INSTANCES(DP, F(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP))
#define FA_AT_TENSOR_bucket(DP, ...)
#define FA_AT_TENSOR_decode_bucket(DP, ...)
#define FA_AT_TENSOR_decode_mma_bucket(DP, ...)
#define FA_AT_TENSOR_tensor_bucket(DP, ...) FA_IF_TENSOR(DP, __VA_ARGS__)
#define FA_AT_TENSOR_dtype(DP, ...)
#define FA_AT_TENSOR_once(DP, ...)
#define FA_AT_DTYPE(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, F, T, SUFFIX, DP)        \
    FA_AT_DTYPE_##INSTANCES(F(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP))
#define FA_AT_DTYPE_bucket(...)
#define FA_AT_DTYPE_decode_bucket(...)
#define FA_AT_DTYPE_decode_mma_bucket(...)
#define FA_AT_DTYPE_tensor_bucket(...)
#define FA_AT_DTYPE_dtype(...) __VA_ARGS__
#define FA_AT_DTYPE_once(...)
#define FA_AT_ONCE(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, F, T, SUFFIX, DP)         \
    FA_AT_ONCE_##INSTANCES(F(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP))
#define FA_AT_ONCE_bucket(...)
#define FA_AT_ONCE_decode_bucket(...)
#define FA_AT_ONCE_decode_mma_bucket(...)
#define FA_AT_ONCE_tensor_bucket(...)
#define FA_AT_ONCE_dtype(...)
#define FA_AT_ONCE_once(...) __VA_ARGS__

// The instance's name, e.g. flash_attention_forward_f16_d64.
#define FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP) FA_KERNEL_NAME_##INSTANCES(KERNEL, SUFFIX, DP)
#define FA_KERNEL_NAME_bucket(KERNEL, SUFFIX, DP) flash_attention_##KERNEL##_##SUFFIX##_d##DP
#define FA_KERNEL_NAME_decode_bucket(KERNEL, SUFFIX, DP) flash_attention_##KERNEL##_##SUFFIX##_d##DP
#define FA_KERNEL_NAME_decode_mma_bucket(KERNEL, SUFFIX, DP) flash_attention_##KERNEL##_##SUFFIX##_d##DP
#define FA_KERNEL_NAME_tensor_bucket(KERNEL, SUFFIX, DP) flash_attention_##KERNEL##_##SUFFIX##_d##DP
#define FA_KERNEL_NAME_dtype(KERNEL, SUFFIX, DP) flash_attention_##KERNEL##_##SUFFIX
#define FA_KERNEL_NAME_once(KERNEL, SUFFIX, DP) flash_attention_##KERNEL

// FA_IF_STORAGE(STORAGE, ...): the arguments unless STORAGE is `none`.
#define FA_IF_STORAGE(STORAGE, ...) FA_CAT(FA_IF_STORAGE_, FA_IS_NONE(STORAGE))(__VA_ARGS__)
#define FA_IF_STORAGE_0(...) __VA_ARGS__
#define FA_IF_STORAGE_1(...)
#define FA_IS_NONE(STORAGE) FA_SECOND(FA_NONE_PROBE_##STORAGE, 0, ~)
#define FA_NONE_PROBE_none ~, 1
#define FA_SECOND(...) FA_SECOND_(__VA_ARGS__)
#define FA_SECOND_(A, B, ...) B

// A list of `, item` expansions without its first comma: FA_TAIL(0 LIST).
#define FA_TAIL(...) FA_TAIL_(__VA_ARGS__)
#define FA_TAIL_(FIRST, ...) __VA_ARGS__
#define FA_CAT(A, B) FA_CAT_(A, B)
#define FA_CAT_(A, B) A##B
#define FA_STRING(X) FA_STRING_(X)
#define FA_STRING_(X) #X

#endif
