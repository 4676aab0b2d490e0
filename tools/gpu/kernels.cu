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

constexpr unsigned kThreads = FA_THREADS_PER_THREADGROUP;
constexpr unsigned kSimdWidth = 32;  // Apple GPUs' SIMD-group and NVIDIA's warp
static_assert(kThreads % kSimdWidth == 0, "threadgroups are whole SIMD-groups");

unsigned ceil_div(unsigned n, unsigned d) { return (n + d - 1) / d; }

const half *as_half(const uint16_t *p) { return reinterpret_cast<const half *>(p); }
half *as_half(uint16_t *p) { return reinterpret_cast<half *>(p); }

}  // namespace

// The MSL built-ins from CUDA's: every threadgroup is 1-D, so thread_index_in_threadgroup is
// threadIdx.x, and its SIMD-groups are consecutive runs of 32 threads (warps).
#define FA_CUDA_TGID make_uint3(blockIdx.x, blockIdx.y, blockIdx.z)
#define FA_CUDA_SGID (threadIdx.x / kSimdWidth)
#define FA_CUDA_LANE (threadIdx.x % kSimdWidth)

// One __global__ launcher per MSL kernel (MSL passes the built-ins as parameters, CUDA has them
// as blockIdx/threadIdx). The parameter struct travels by value (kernel parameter space,
// read-only like Metal's constant address space).
__global__ void __launch_bounds__(kThreads)
    fa_cuda_forward_combine_kernel(const half *q, const half *k, const half *v, half *out,
                                   float *lse, FlashAttentionParams params,
                                   const float *partial_out, const float *partial_lse) {
    flash_attention_forward_combine(q, k, v, out, lse, params, partial_out, partial_lse,
                                    FA_CUDA_TGID, threadIdx.x);
}

__global__ void __launch_bounds__(kThreads)
    fa_cuda_backward_delta_kernel(const half *dout, const half *q, const half *k, const half *v,
                                  const half *out, const float *lse, FlashAttentionParams params,
                                  float *delta) {
    flash_attention_backward_delta(dout, q, k, v, out, lse, params, delta, FA_CUDA_TGID,
                                   threadIdx.x);
}

#define FA_CUDA_LAUNCHERS(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                        \
    __global__ void __launch_bounds__(kThreads)                                                    \
        fa_cuda_forward_d##DP(const half *q, const half *k, const half *v, half *out, float *lse,  \
                              FlashAttentionParams params) {                                       \
        flash_attention_forward_d##DP(q, k, v, out, lse, params, FA_CUDA_TGID, FA_CUDA_SGID,      \
                                      FA_CUDA_LANE);                                               \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_split_d##DP(                       \
        const half *q, const half *k, const half *v, half *out, float *lse,                       \
        FlashAttentionParams params, float *partial_out, float *partial_lse) {                    \
        flash_attention_forward_split_d##DP(q, k, v, out, lse, params, partial_out, partial_lse,  \
                                            FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);             \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_dq_d##DP(                         \
        const half *dout, const half *q, const half *k, const half *v, const half *out,           \
        const float *lse, FlashAttentionParams params, const float *delta, half *dq) {            \
        flash_attention_backward_dq_d##DP(dout, q, k, v, out, lse, params, delta, dq,             \
                                          FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);               \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_dkv_d##DP(                        \
        const half *dout, const half *q, const half *k, const half *v, const half *out,           \
        const float *lse, FlashAttentionParams params, const float *delta, half *dk, half *dv) {  \
        flash_attention_backward_dkv_d##DP(dout, q, k, v, out, lse, params, delta, dk, dv,        \
                                           FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);              \
    }

FA_HEAD_DIM_BUCKETS(FA_CUDA_LAUNCHERS)
#undef FA_CUDA_LAUNCHERS
#undef FA_CUDA_TGID
#undef FA_CUDA_SGID
#undef FA_CUDA_LANE

// Each host function below picks the first bucket whose head_dim_max >= head_dim and launches
// that bucket's kernel over the grid of the Metal dispatch plan (x fastest).
cudaError_t fa_cuda_forward(const FlashAttentionParams &p, const uint16_t *q, const uint16_t *k,
                            const uint16_t *v, uint16_t *out, float *lse) {
#define FA_CUDA_FORWARD(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                          \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                     \
        const dim3 grid(ceil_div(p.seqlen_q, FWD_BQ), p.num_heads, p.batch);                       \
        fa_cuda_forward_d##DP<<<grid, kThreads>>>(as_half(q), as_half(k), as_half(v),              \
                                                  as_half(out), lse, p);                           \
        return cudaGetLastError();                                                                 \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_FORWARD)
#undef FA_CUDA_FORWARD
    return cudaErrorInvalidValue;
}

bool fa_cuda_split_keys(FlashAttentionParams *p, unsigned chunks) {
    if (chunks == 0) {
        return false;
    }
#define FA_CUDA_SPLIT_KEYS(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                       \
    if (p->head_dim >= 1 && p->head_dim <= DP) {                                                   \
        p->kv_chunk_keys = ceil_div(ceil_div(p->seqlen_k, chunks), FWD_BK) * FWD_BK;               \
        p->kv_chunks = ceil_div(p->seqlen_k, p->kv_chunk_keys);                                    \
        return true;                                                                               \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_SPLIT_KEYS)
#undef FA_CUDA_SPLIT_KEYS
    return false;
}

cudaError_t fa_cuda_forward_split(const FlashAttentionParams &p, const uint16_t *q,
                                  const uint16_t *k, const uint16_t *v, uint16_t *out, float *lse,
                                  float *partial_out, float *partial_lse) {
#define FA_CUDA_FORWARD_SPLIT(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                    \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                     \
        const unsigned row_blocks = ceil_div(p.num_heads / p.num_kv_heads * p.seqlen_q, FWD_BQ);   \
        const dim3 grid(p.kv_chunks * row_blocks, p.num_kv_heads, p.batch);                        \
        fa_cuda_forward_split_d##DP<<<grid, kThreads>>>(as_half(q), as_half(k), as_half(v),        \
                                                        as_half(out), lse, p, partial_out,         \
                                                        partial_lse);                              \
        const cudaError_t error = cudaGetLastError();                                              \
        if (error != cudaSuccess) {                                                                \
            return error;                                                                          \
        }                                                                                          \
        fa_cuda_forward_combine_kernel<<<dim3(p.seqlen_q, p.num_heads, p.batch), kThreads>>>(      \
            as_half(q), as_half(k), as_half(v), as_half(out), lse, p, partial_out, partial_lse);   \
        return cudaGetLastError();                                                                 \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_FORWARD_SPLIT)
#undef FA_CUDA_FORWARD_SPLIT
    return cudaErrorInvalidValue;
}

size_t fa_cuda_delta_elements(const FlashAttentionParams &p) {
    return size_t(p.batch) * p.num_heads * p.seqlen_q;
}

cudaError_t fa_cuda_backward_delta(const FlashAttentionParams &p, const uint16_t *dout,
                                   const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                   const uint16_t *out, const float *lse, float *delta) {
    if (p.head_dim < 1 || p.head_dim > FA_MAX_HEAD_DIM) {
        return cudaErrorInvalidValue;
    }
    const dim3 grid(ceil_div(p.seqlen_q, FA_DELTA_BLOCK_ROWS), p.num_heads, p.batch);
    fa_cuda_backward_delta_kernel<<<grid, kThreads>>>(as_half(dout), as_half(q), as_half(k),
                                                      as_half(v), as_half(out), lse, p, delta);
    return cudaGetLastError();
}

cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &p, const uint16_t *dout,
                                const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, const float *delta,
                                uint16_t *dq) {
#define FA_CUDA_BACKWARD_DQ(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                      \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                     \
        const dim3 grid(ceil_div(p.seqlen_q, DQ_BQ), p.num_heads, p.batch);                        \
        fa_cuda_backward_dq_d##DP<<<grid, kThreads>>>(as_half(dout), as_half(q), as_half(k),       \
                                                      as_half(v), as_half(out), lse, p, delta,     \
                                                      as_half(dq));                                \
        return cudaGetLastError();                                                                 \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_BACKWARD_DQ)
#undef FA_CUDA_BACKWARD_DQ
    return cudaErrorInvalidValue;
}

cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &p, const uint16_t *dout,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const uint16_t *out, const float *lse, const float *delta,
                                 uint16_t *dk, uint16_t *dv) {
#define FA_CUDA_BACKWARD_DKV(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                     \
    if (p.head_dim >= 1 && p.head_dim <= DP) {                                                     \
        const dim3 grid(ceil_div(p.seqlen_k, DKV_BK), p.num_kv_heads, p.batch);                    \
        fa_cuda_backward_dkv_d##DP<<<grid, kThreads>>>(as_half(dout), as_half(q), as_half(k),      \
                                                       as_half(v), as_half(out), lse, p, delta,    \
                                                       as_half(dk), as_half(dv));                  \
        return cudaGetLastError();                                                                 \
    }
    FA_HEAD_DIM_BUCKETS(FA_CUDA_BACKWARD_DKV)
#undef FA_CUDA_BACKWARD_DKV
    return cudaErrorInvalidValue;
}

cudaError_t fa_cuda_backward(const FlashAttentionParams &p, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const uint16_t *out, const float *lse, float *delta, uint16_t *dq,
                             uint16_t *dk, uint16_t *dv) {
    cudaError_t error = fa_cuda_backward_delta(p, dout, q, k, v, out, lse, delta);
    if (error == cudaSuccess) {
        error = fa_cuda_backward_dq(p, dout, q, k, v, out, lse, delta, dq);
    }
    if (error == cudaSuccess) {
        error = fa_cuda_backward_dkv(p, dout, q, k, v, out, lse, delta, dk, dv);
    }
    return error;
}
