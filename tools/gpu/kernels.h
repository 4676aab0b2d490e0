// Host entry points of the CUDA check build: launch the kernels of Shaders/flash_attention.metal
// (compiled as CUDA by kernels.cu) with the dispatch contract of the Metal library. Every kernel
// runs FA_THREADS_PER_THREADGROUP threads per threadgroup (block); block sizes and grids come from
// FA_HEAD_DIM_BUCKETS. Launches are asynchronous on the default stream and return the launch error
// (cudaErrorInvalidValue for an unsupported head_dim). Tensors are device pointers, float16 as
// raw bits: q, out, dout, dq (B, H, Nq, D); k, v, dk, dv (B, Hkv, Nk, D); lse and delta (B, H, Nq)
// float32.
#ifndef FA_GPU_KERNELS_H
#define FA_GPU_KERNELS_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "flash_attention_params.h"

// Forward: writes out and lse. One launch of flash_attention_forward_d<DP>.
cudaError_t fa_cuda_forward(const FlashAttentionParams &params, const uint16_t *q,
                            const uint16_t *k, const uint16_t *v, uint16_t *out, float *lse);

// Split-KV forward (decode), the Metal plan's two dispatches for short queries:
// flash_attention_forward_split_d<DP> over (kv_chunks x row blocks, Hkv, B), where a row block is
// FWD_BQ of the (H / Hkv) x Nq query rows of one KV head, writes one normalised partial result
// per chunk of params.kv_chunk_keys keys into partial_out (B, H, kv_chunks, Nq, D) and partial_lse
// (B, H, kv_chunks, Nq), float32 workspaces; flash_attention_forward_combine over (Nq, H, B)
// merges them into out and lse. params.kv_chunks and kv_chunk_keys come from fa_cuda_split_keys.
cudaError_t fa_cuda_forward_split(const FlashAttentionParams &params, const uint16_t *q,
                                  const uint16_t *k, const uint16_t *v, uint16_t *out, float *lse,
                                  float *partial_out, float *partial_lse);

// Splits the keys into at most `chunks` chunks of whole forward key tiles (FWD_BK of the bucket):
// sets params->kv_chunk_keys to the smallest such multiple that covers seqlen_k in `chunks`
// chunks, and params->kv_chunks to the number of chunks that gives. The Metal plan picks its own
// count (a function of the shape); the kernels must be right for any. False for an unsupported
// head_dim or chunks == 0.
bool fa_cuda_split_keys(FlashAttentionParams *params, unsigned chunks);

// Elements of the backward pass's delta workspace (D_i = rowsum(dout * out), float32): B * H * Nq.
size_t fa_cuda_delta_elements(const FlashAttentionParams &params);

// Backward, the three dispatches of the Metal backend in order: delta (writes `delta`), dQ (writes
// dq), dK/dV (writes dk and dv); out and lse are the forward's.
cudaError_t fa_cuda_backward(const FlashAttentionParams &params, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const uint16_t *out, const float *lse, float *delta, uint16_t *dq,
                             uint16_t *dk, uint16_t *dv);

// The dispatches one by one, for tests whose dK/dV would cost too much (large_offsets.cu).
cudaError_t fa_cuda_backward_delta(const FlashAttentionParams &params, const uint16_t *dout,
                                   const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                   const uint16_t *out, const float *lse, float *delta);
cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &params, const uint16_t *dout,
                                const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, const float *delta,
                                uint16_t *dq);
cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &params, const uint16_t *dout,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const uint16_t *out, const float *lse, const float *delta,
                                 uint16_t *dk, uint16_t *dv);

#endif
