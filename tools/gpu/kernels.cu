// The kernels of Shaders/flash_attention.metal compiled as CUDA, and their launchers.
//
// gpu_check.sh copies Shaders/ into its build folder with the `device` address-space word renamed
// to `fa_device` (see metal_cuda.h for why) and puts that folder first on the include path, so
// the #include below reads the unmodified kernel source apart from that one word.
#include "metal_cuda.h"
#include "flash_attention.metal"
#include "metal_cuda_end.h"

#include "kernels.h"

namespace {

unsigned ceil_div(unsigned n, unsigned d) { return (n + d - 1) / d; }

const half *as_half(const uint16_t *p) { return reinterpret_cast<const half *>(p); }
half *as_half(uint16_t *p) { return reinterpret_cast<half *>(p); }

}  // namespace

// One __global__ launcher per MSL kernel: MSL passes the built-ins as parameters, CUDA has them
// as blockIdx/threadIdx. Every kernel uses a 1-D threadgroup, so thread_index_in_threadgroup is
// threadIdx.x. The parameter struct travels by value (kernel parameter space, read-only like
// Metal's constant address space).
#define FA_CUDA_LAUNCHERS(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                    \
    __global__ void __launch_bounds__(FWD_BQ)                                                    \
        fa_cuda_forward_d##DP(const half *q, const half *k, const half *v, half *out,           \
                              float *lse, FlashAttentionParams params) {                         \
        flash_attention_forward_d##DP(q, k, v, out, lse, params,                                 \
                                      make_uint3(blockIdx.x, blockIdx.y, blockIdx.z),            \
                                      threadIdx.x);                                              \
    }                                                                                            \
    __global__ void __launch_bounds__(BWD_BQ) fa_cuda_backward_dq_d##DP(                         \
        const half *dout, const half *q, const half *k, const half *v, const half *out,         \
        const float *lse, FlashAttentionParams params, half *dq) {                               \
        flash_attention_backward_dq_d##DP(dout, q, k, v, out, lse, params, dq,                   \
                                          make_uint3(blockIdx.x, blockIdx.y, blockIdx.z),        \
                                          threadIdx.x);                                          \
    }                                                                                            \
    __global__ void __launch_bounds__(BWD_BK) fa_cuda_backward_dkv_d##DP(                        \
        const half *dout, const half *q, const half *k, const half *v, const half *out,         \
        const float *lse, FlashAttentionParams params, half *dk, half *dv) {                     \
        flash_attention_backward_dkv_d##DP(dout, q, k, v, out, lse, params, dk, dv,              \
                                           make_uint3(blockIdx.x, blockIdx.y, blockIdx.z),       \
                                           threadIdx.x);                                         \
    }

FA_HEAD_DIM_BUCKETS(FA_CUDA_LAUNCHERS)

bool fa_cuda_bucket(unsigned head_dim, FaCudaBucket *bucket) {
    if (head_dim == 0) {
        return false;
    }
#define FA_CUDA_FIND_BUCKET(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                  \
    if (head_dim <= DP) {                                                                        \
        *bucket = FaCudaBucket{DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK};                              \
        return true;                                                                             \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_FIND_BUCKET)
#undef FA_CUDA_FIND_BUCKET
    return false;
}

cudaError_t fa_cuda_forward(const FlashAttentionParams &p, const uint16_t *q, const uint16_t *k,
                            const uint16_t *v, uint16_t *out, float *lse) {
#define FA_CUDA_FORWARD(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                      \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                   \
        const dim3 grid(ceil_div(p.seqlen_q, FWD_BQ), p.num_heads, p.batch);                     \
        fa_cuda_forward_d##DP<<<grid, FWD_BQ>>>(as_half(q), as_half(k), as_half(v),              \
                                                as_half(out), lse, p);                           \
        return cudaGetLastError();                                                               \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_FORWARD)
#undef FA_CUDA_FORWARD
    return cudaErrorInvalidValue;
}

cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &p, const uint16_t *dout,
                                const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, uint16_t *dq) {
#define FA_CUDA_BACKWARD_DQ(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                  \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                   \
        const dim3 grid(ceil_div(p.seqlen_q, BWD_BQ), p.num_heads, p.batch);                     \
        fa_cuda_backward_dq_d##DP<<<grid, BWD_BQ>>>(as_half(dout), as_half(q), as_half(k),       \
                                                    as_half(v), as_half(out), lse, p,            \
                                                    as_half(dq));                                \
        return cudaGetLastError();                                                               \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_BACKWARD_DQ)
#undef FA_CUDA_BACKWARD_DQ
    return cudaErrorInvalidValue;
}

cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &p, const uint16_t *dout,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const uint16_t *out, const float *lse, uint16_t *dk,
                                 uint16_t *dv) {
#define FA_CUDA_BACKWARD_DKV(DP, FWD_BQ, FWD_BK, BWD_BQ, BWD_BK)                                 \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                   \
        const dim3 grid(ceil_div(p.seqlen_k, BWD_BK), p.num_kv_heads, p.batch);                  \
        fa_cuda_backward_dkv_d##DP<<<grid, BWD_BK>>>(as_half(dout), as_half(q), as_half(k),      \
                                                     as_half(v), as_half(out), lse, p,           \
                                                     as_half(dk), as_half(dv));                  \
        return cudaGetLastError();                                                               \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_BACKWARD_DKV)
#undef FA_CUDA_BACKWARD_DKV
    return cudaErrorInvalidValue;
}

cudaError_t fa_cuda_backward(const FlashAttentionParams &p, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const uint16_t *out, const float *lse, uint16_t *dq, uint16_t *dk,
                             uint16_t *dv) {
    const cudaError_t dq_error = fa_cuda_backward_dq(p, dout, q, k, v, out, lse, dq);
    if (dq_error != cudaSuccess) {
        return dq_error;
    }
    return fa_cuda_backward_dkv(p, dout, q, k, v, out, lse, dk, dv);
}
