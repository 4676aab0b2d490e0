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
