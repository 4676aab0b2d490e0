// Host entry points of the CUDA check build: launch the kernels of Shaders/flash_attention.metal
// (compiled as CUDA by kernels.cu) with the dispatch contract of the Metal library.
#ifndef FA_GPU_KERNELS_H
#define FA_GPU_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "flash_attention_params.h"

// The row of FA_HEAD_DIM_BUCKETS a head_dim uses: the first whose head_dim_max >= head_dim.
struct FaCudaBucket {
    unsigned head_dim_max;
    unsigned forward_block_q;
    unsigned forward_block_k;
    unsigned backward_block_q;
    unsigned backward_block_k;
};

// Finds the bucket of `head_dim`; false when head_dim is 0 or above FA_MAX_HEAD_DIM.
bool fa_cuda_bucket(unsigned head_dim, FaCudaBucket *bucket);

// Forward on device pointers (float16 as raw bits): q (B, H, Nq, D), k and v (B, Hkv, Nk, D) in,
// out (B, H, Nq, D) float16 and lse (B, H, Nq) float32 out. One launch of
// flash_attention_forward_d<DP>: grid (ceil(Nq / forward_block_q), H, B), forward_block_q threads.
// Returns the launch error (cudaErrorInvalidValue for an unsupported head_dim); asynchronous.
cudaError_t fa_cuda_forward(const FlashAttentionParams &params, const uint16_t *q,
                            const uint16_t *k, const uint16_t *v, uint16_t *out, float *lse);

// Backward on device pointers: dout, q, out like q; k, v; lse from the forward; writes dq (like q),
// dk and dv (like k). Launches flash_attention_backward_dq_d<DP> (grid (ceil(Nq /
// backward_block_q), H, B), backward_block_q threads) then flash_attention_backward_dkv_d<DP>
// (grid (ceil(Nk / backward_block_k), Hkv, B), backward_block_k threads) on the default stream.
cudaError_t fa_cuda_backward(const FlashAttentionParams &params, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const uint16_t *out, const float *lse, uint16_t *dq, uint16_t *dk,
                             uint16_t *dv);

// Backward dQ alone: one launch of flash_attention_backward_dq_d<DP> (grid (ceil(Nq /
// backward_block_q), H, B), backward_block_q threads) writing dq (like q). For tests whose dK/dV
// would cost too much, e.g. large_offsets.cu. Asynchronous; cudaErrorInvalidValue for an
// unsupported head_dim.
cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &params, const uint16_t *dout,
                                const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, uint16_t *dq);

// Backward dK/dV alone: one launch of flash_attention_backward_dkv_d<DP> (grid (ceil(Nk /
// backward_block_k), Hkv, B), backward_block_k threads) writing dk and dv (like k).
cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &params, const uint16_t *dout,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const uint16_t *out, const float *lse, uint16_t *dk,
                                 uint16_t *dv);

#endif
