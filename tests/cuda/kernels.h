// Host entry points of the CUDA check build: launch the kernels of Shaders/flash_attention.metal
// (compiled as CUDA by kernels.cu) with the dispatch contract of the Metal library. Every kernel
// runs FA_THREADS_PER_THREADGROUP threads per threadgroup (block); block sizes and grids come from
// the dtype's table (FA_HEAD_DIM_BUCKETS for f16 and bf16, FA_HEAD_DIM_BUCKETS_F32 for f32), the
// bucket being the first whose head_dim_max >= max(head_dim, head_dim_v), as in the Metal plan.
// Launches are asynchronous on the default stream and return the launch error
// (cudaErrorInvalidValue for an unknown dtype or an unsupported head_dim or head_dim_v).
//
// `dtype` is FA_DTYPE_F16, FA_DTYPE_BF16 or FA_DTYPE_F32, the element type of q, k, v, out, dout,
// dq, dk and dv (device pointers, each addressed through its strides in params: element
// (b, h, i, d) at b * batch + h * head + i * seq + d); q, dq (B, H, Nq, head_dim), k, dk
// (B, Hkv, Nk, head_dim), v, dv (B, Hkv, Nk, head_dim_v), out, dout (B, H, Nq, head_dim_v); lse,
// delta and lse_residual (B, H, Nq) contiguous float32.
//
// Score modifiers (issue 15) come through params (window_left/right with causal folded into
// window_right = 0, softcap, mask_type and mask strides, has_alibi and alibi_batch_stride,
// has_sinks) and the optional inputs of FaCudaScoreInputs; each launch first sets the kernels'
// function constants (mask type, softcap, ALiBi and sinks on or off) from params, the values the
// Metal plan's specialisation gives them.
#ifndef FA_GPU_KERNELS_H
#define FA_GPU_KERNELS_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "flash_attention_params.h"

// The optional inputs of the score modifiers, device pointers, null when params say they are
// absent (the Metal backend binds a placeholder buffer there; null makes any read of it an error
// that compute-sanitizer reports): attn_mask (uchar for FA_MASK_BOOL, the call's dtype for
// FA_MASK_ADDITIVE, float for FA_MASK_ADDITIVE_F32; pair (b, h, i, j) at b * mask.batch +
// h * mask.head + i * mask.seq + j), alibi slopes (float32, slope of (b, h) at
// b * alibi_batch_stride + h) and sinks (float32 [num_heads]).
struct FaCudaScoreInputs {
    const void *mask = nullptr;
    const float *alibi = nullptr;
    const float *sinks = nullptr;
};

// The head_dim_max of the bucket a problem uses (0 for an unknown dtype or an unsupported head_dim
// or head_dim_v): kernel instance names end in _d<head_dim_max>.
unsigned fa_cuda_bucket(const FlashAttentionParams &params, int dtype);

// Forward: writes out and lse. One launch of flash_attention_forward_<dtype>_d<DP>.
cudaError_t fa_cuda_forward(const FlashAttentionParams &params, int dtype, const void *q,
                            const void *k, const void *v, void *out, float *lse,
                            const FaCudaScoreInputs &inputs = {});

// Split-KV forward, the Metal plan's two dispatches for short queries:
// flash_attention_forward_decode_<dtype>_d<DP> (where FA_DECODE_SERVES the (H / Hkv) x Nq packed
// rows; row blocks of FA_DECODE_ROWS(DP)) or flash_attention_forward_split_<dtype>_d<DP> (other
// shapes; row blocks of FWD_BQ) over (kv_chunks x row blocks, Hkv, B), a row block holding (H / Hkv) x Nq query rows of
// one KV head, writes one normalised partial result per chunk of params.kv_chunk_keys keys into
// partial_out (B, H, kv_chunks, Nq, head_dim_v) and partial_lse (B, H, kv_chunks, Nq, 2: the
// chunk's max and log sum), float32 workspaces;
// flash_attention_forward_combine_<dtype> over (Nq, H, B) merges them into out and lse (and adds
// the sinks to the denominator).
// params.kv_chunks and kv_chunk_keys come from fa_cuda_split_keys.
cudaError_t fa_cuda_forward_split(const FlashAttentionParams &params, int dtype, const void *q,
                                  const void *k, const void *v, void *out, float *lse,
                                  float *partial_out, float *partial_lse,
                                  const FaCudaScoreInputs &inputs = {});

// Splits the keys into at most `chunks` chunks of whole forward key tiles (FWD_BK of the dtype's
// bucket): sets params->kv_chunk_keys to the smallest such multiple that covers seqlen_k in
// `chunks` chunks, and params->kv_chunks to the number of chunks that gives. The Metal plan picks
// its own count (a function of the shape); the kernels must be right for any. False for an
// unsupported dtype or head dim, or chunks == 0.
bool fa_cuda_split_keys(FlashAttentionParams *params, int dtype, unsigned chunks);

// Elements of each of the backward pass's two float32 workspaces, delta (D_i = rowsum(dout * out))
// and lse_residual: B * H * Nq.
size_t fa_cuda_delta_elements(const FlashAttentionParams &params);

// Backward, the dispatches of the Metal backend in order: delta (writes `delta`); lse residual
// (writes `lse_residual`: for a row whose |lse| >= 256 and whose lse is the one the forward gives,
// R = log sum_j exp(S_ij - lse_i) recomputed from the scores, what float32 lse = max + log(l)
// lost of log(l); 0 for every other row); dQ (writes dq),
// dK/dV (writes dk and dv), both with P = exp((S - lse) - R); and with params.has_sinks dsinks
// (writes dsinks, float32 [num_heads]; cudaErrorInvalidValue when null); out and lse are the
// forward's.
cudaError_t fa_cuda_backward(const FlashAttentionParams &params, int dtype, const void *dout,
                             const void *q, const void *k, const void *v, const void *out,
                             const float *lse, float *delta, float *lse_residual, void *dq,
                             void *dk, void *dv, const FaCudaScoreInputs &inputs = {},
                             float *dsinks = nullptr);

// The dispatches one by one, for tests whose dK/dV would cost too much (large_offsets.cu). Every
// backward kernel binds lse_residual (the delta kernel does not read it).
cudaError_t fa_cuda_backward_delta(const FlashAttentionParams &params, int dtype, const void *dout,
                                   const void *q, const void *k, const void *v, const void *out,
                                   const float *lse, float *delta, const float *lse_residual,
                                   const FaCudaScoreInputs &inputs = {});
// flash_attention_backward_lse_residual_<dtype>_d<DP> over the forward's grid
// (ceil(Nq / FWD_BQ), H, B): a block none of whose rows has |lse| >= 256 writes 0; otherwise it
// runs the forward's scores and online softmax again (without V) for R.
cudaError_t fa_cuda_backward_lse_residual(const FlashAttentionParams &params, int dtype,
                                          const void *dout, const void *q, const void *k,
                                          const void *v, const void *out, const float *lse,
                                          const float *delta, float *lse_residual,
                                          const FaCudaScoreInputs &inputs = {});
cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &params, int dtype, const void *dout,
                                const void *q, const void *k, const void *v, const void *out,
                                const float *lse, const float *delta, const float *lse_residual,
                                void *dq, const FaCudaScoreInputs &inputs = {});
cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &params, int dtype, const void *dout,
                                 const void *q, const void *k, const void *v, const void *out,
                                 const float *lse, const float *delta, const float *lse_residual,
                                 void *dk, void *dv, const FaCudaScoreInputs &inputs = {});

// flash_attention_backward_dsinks over (H, 1, 1): dsinks[h] = -sum over b, i of
// exp((sinks[h] - lse) - R) * delta; after the delta and lse residual dispatches (the Metal plan
// runs it last). cudaErrorInvalidValue without params.has_sinks, sinks or dsinks.
cudaError_t fa_cuda_backward_dsinks(const FlashAttentionParams &params, const float *lse,
                                    const float *delta, const float *lse_residual,
                                    const float *sinks, float *dsinks);

// Variable-length batches (Shaders/flash_attention_varlen.h): `params` describe the packed problem
// (batch 1, seqlen_q = total_q, seqlen_k = total_k rows, sequences = the number of sequences; q
// (total_q, H, D) and the others addressed through their head and seq strides); cu_seqlens_q and
// cu_seqlens_k int32 device tables (sequences + 1, clamped by the kernels, so a wrong one stays in
// bounds); table a device workspace of sequences + 1 FlashAttentionParams. Each pass first writes
// the table, then launches the dense pass's kernels over (blocks of max_seqlen, heads, sequences)
// reading it; lse, delta, lse_residual are (H, total_q).
struct FaCudaVarlen {
    const int *cu_seqlens_q = nullptr;
    const int *cu_seqlens_k = nullptr;
    FlashAttentionParams *table = nullptr;
    unsigned max_seqlen_q = 0;
    unsigned max_seqlen_k = 0;
};

cudaError_t fa_cuda_varlen_forward(const FlashAttentionParams &params, int dtype, const FaCudaVarlen &varlen,
                                   const void *q, const void *k, const void *v, void *out, float *lse,
                                   const FaCudaScoreInputs &inputs = {});
cudaError_t fa_cuda_varlen_backward(const FlashAttentionParams &params, int dtype, const FaCudaVarlen &varlen,
                                    const void *dout, const void *q, const void *k, const void *v,
                                    const void *out, const float *lse, float *delta, float *lse_residual,
                                    void *dq, void *dk, void *dv, const FaCudaScoreInputs &inputs = {},
                                    float *dsinks = nullptr);

// KV caches (Shaders/flash_attention_kv_cache.h, issue 24): k and v are a cache (device pointers)
// laid out as params' kv_* fields and k/v strides say: contiguous per sequence (kv_page_rows 0;
// k (B, Hkv, rows, head_dim) through the strides) or paged (kv_page_rows rows per block; block n
// at n * k.batch; block_table (B, kv_max_blocks) int32 of block numbers in [0, kv_num_blocks)),
// elements of the dtype (kv_bits 0) or mx.quantize's packed uint32 words (kv_bits 4 or 8, strides
// in words) with scales and biases (the dtype, one per kv_group_size elements, laid out like the
// words). The kernels clamp table values and block indices: a wrong table or seqlen_k past the
// table reads wrong rows but never outside the cache.
struct FaCudaKVCache {
    const int *block_table = nullptr;
    const void *k_scales = nullptr;
    const void *k_biases = nullptr;
    const void *v_scales = nullptr;
    const void *v_biases = nullptr;
};

// The KV-cache forward: with partial_out null, flash_attention_forward_kvcache_<dtype>_d<DP> over
// the dense forward's grid; else the split-KV forward of fa_cuda_forward_split with the
// `_decode_kvcache_` (Nq <= FA_SPLIT_MAX_QUERY_ROWS) or `_split_kvcache_` instance, then the
// combine (params.kv_chunks and kv_chunk_keys from fa_cuda_split_keys).
cudaError_t fa_cuda_kvcache_forward(const FlashAttentionParams &params, int dtype, const FaCudaKVCache &cache,
                                    const void *q, const void *k, const void *v, void *out, float *lse,
                                    float *partial_out, float *partial_lse,
                                    const FaCudaScoreInputs &inputs = {});

#endif
