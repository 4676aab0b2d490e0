// The kernels of Shaders/flash_attention.metal compiled as CUDA, and their launchers.
//
// gpu_check.sh copies Shaders/ into its build folder with the `device` address-space word renamed
// to `fa_device` (see metal_cuda.h for why) and puts that folder first on the include path, so
// the #include below reads the unmodified kernel source apart from that one word.
#include "metal_cuda.h"
#include "flash_attention.metal"
#include "metal_cuda_end.h"

#include "kernels.h"

#include <initializer_list>
#include <type_traits>

namespace {

constexpr unsigned kThreads = FA_THREADS_PER_THREADGROUP;
constexpr unsigned kSimdWidth = 32;  // Apple GPUs' SIMD-group and NVIDIA's warp
static_assert(kThreads % kSimdWidth == 0, "threadgroups are whole SIMD-groups");

unsigned ceil_div(unsigned n, unsigned d) { return (n + d - 1) / d; }

}  // namespace

// The MSL built-ins from CUDA's: every threadgroup is 1-D, so thread_index_in_threadgroup is
// threadIdx.x, and its SIMD-groups are consecutive runs of 32 threads (warps).
#define FA_CUDA_TGID make_uint3(blockIdx.x, blockIdx.y, blockIdx.z)
#define FA_CUDA_SGID (threadIdx.x / kSimdWidth)
#define FA_CUDA_LANE (threadIdx.x % kSimdWidth)

// One __global__ launcher per MSL kernel (MSL passes the built-ins as parameters, CUDA has them
// as blockIdx/threadIdx). The parameter struct travels by value (kernel parameter space,
// read-only like Metal's constant address space).

// The kernels that run over sequences take `table`, null for a dense problem; for a varlen one the
// sequence table in device memory (flash_attention_varlen.h), which they read in the place of
// params (its entry 0 is the host's struct, the others follow it). The forward and backward
// kernels take the parameters as a pointer (a constant array: flash_attention_varlen.h).
#define FA_CUDA_PARAMS (table != nullptr ? table : &params)

// The kernels of one dtype that do not depend on the bucket.
#define FA_CUDA_DTYPE_LAUNCHERS(T, SUFFIX)                                                         \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_combine_##SUFFIX(                  \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, const float *partial_out,       \
        const float *partial_lse) {                                                                \
        flash_attention_forward_combine_##SUFFIX(q, k, v, out, lse, &params, mask, alibi, sinks,   \
                                                 partial_out, partial_lse, FA_CUDA_TGID,           \
                                                 threadIdx.x);                                     \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_delta_##SUFFIX(                   \
        const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,        \
        FlashAttentionParams params, float *delta, const uchar *mask, const float *alibi,          \
        const float *sinks, const float *lse_residual, FlashAttentionParams *table) {              \
        flash_attention_backward_delta_##SUFFIX(dout, q, k, v, out, lse, FA_CUDA_PARAMS, delta, mask, \
                                                alibi, sinks, lse_residual, FA_CUDA_TGID,          \
                                                threadIdx.x);                                      \
    }

// The kernels of one dtype and head-dim bucket.
#define FA_CUDA_LAUNCHERS(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)             \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_##SUFFIX##_d##DP(                  \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, FlashAttentionParams *table) {  \
        flash_attention_forward_##SUFFIX##_d##DP(q, k, v, out, lse, FA_CUDA_PARAMS, mask, alibi, sinks, \
                                                 FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);        \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_split_##SUFFIX##_d##DP(            \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, float *partial_out,             \
        float *partial_lse) {                                                                      \
        flash_attention_forward_split_##SUFFIX##_d##DP(q, k, v, out, lse, &params, mask, alibi,     \
                                                       sinks, partial_out, partial_lse,            \
                                                       FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);  \
    }                                                                                              \
    FA_IF_DECODE(DP,                                                                               \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_decode_##SUFFIX##_d##DP(           \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, float *partial_out,             \
        float *partial_lse) {                                                                      \
        flash_attention_forward_decode_##SUFFIX##_d##DP(q, k, v, out, lse, &params, mask, alibi,    \
                                                        sinks, partial_out, partial_lse,           \
                                                        FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE); \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_forward_spec_##SUFFIX##_d##DP(             \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, float *partial_out,             \
        float *partial_lse) {                                                                      \
        flash_attention_forward_spec_##SUFFIX##_d##DP(q, k, v, out, lse, &params, mask, alibi,      \
                                                      sinks, partial_out, partial_lse,             \
                                                      FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);   \
    })                                                                                             \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_lse_residual_##SUFFIX##_d##DP(    \
        const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,        \
        FlashAttentionParams params, const float *delta, const uchar *mask, const float *alibi,    \
        const float *sinks, float *lse_residual, FlashAttentionParams *table) {                    \
        flash_attention_backward_lse_residual_##SUFFIX##_d##DP(                                    \
            dout, q, k, v, out, lse, FA_CUDA_PARAMS, delta, mask, alibi, sinks, lse_residual,      \
            FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);                                             \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_dq_##SUFFIX##_d##DP(              \
        const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,        \
        FlashAttentionParams params, const float *delta, const uchar *mask, const float *alibi,    \
        const float *sinks, const float *lse_residual, T *dq, FlashAttentionParams *table) {       \
        flash_attention_backward_dq_##SUFFIX##_d##DP(dout, q, k, v, out, lse, FA_CUDA_PARAMS, delta, mask, \
                                                     alibi, sinks, lse_residual, dq, FA_CUDA_TGID, \
                                                     FA_CUDA_SGID, FA_CUDA_LANE);                  \
    }                                                                                              \
    __global__ void __launch_bounds__(kThreads) fa_cuda_backward_dkv_##SUFFIX##_d##DP(             \
        const T *dout, const T *q, const T *k, const T *v, const T *out, const float *lse,        \
        FlashAttentionParams params, const float *delta, const uchar *mask, const float *alibi,    \
        const float *sinks, const float *lse_residual, T *dk, T *dv, FlashAttentionParams *table) { \
        flash_attention_backward_dkv_##SUFFIX##_d##DP(dout, q, k, v, out, lse, FA_CUDA_PARAMS, delta, \
                                                      mask, alibi, sinks, lse_residual, dk, dv,    \
                                                      FA_CUDA_TGID, FA_CUDA_SGID, FA_CUDA_LANE);   \
    }

// The KV-cache kernels of one dtype and bucket (Shaders/flash_attention_kv_cache.h), one signature
// for the three (the dense kernel has no partial results: it ignores them).
#define FA_CUDA_KV_CACHE_LAUNCHER(T, NAME, ...)                                                    \
    __global__ void __launch_bounds__(kThreads) fa_cuda_##NAME(                                    \
        const T *q, const T *k, const T *v, T *out, float *lse, FlashAttentionParams params,      \
        const uchar *mask, const float *alibi, const float *sinks, float *partial_out,             \
        float *partial_lse, FaCudaKVCache c) {                                                     \
        flash_attention_##NAME(q, k, v, out, lse, &params, mask, alibi, sinks, __VA_ARGS__          \
                               c.block_table, static_cast<const T *>(c.k_scales),                  \
                               static_cast<const T *>(c.k_biases),                                 \
                               static_cast<const T *>(c.v_scales),                                 \
                               static_cast<const T *>(c.v_biases), FA_CUDA_TGID, FA_CUDA_SGID,     \
                               FA_CUDA_LANE);                                                      \
    }
#define FA_CUDA_KV_CACHE_LAUNCHERS(T, SUFFIX, DP, ...)                                             \
    FA_CUDA_KV_CACHE_LAUNCHER(T, forward_kvcache_##SUFFIX##_d##DP, )                               \
    FA_CUDA_KV_CACHE_LAUNCHER(T, forward_split_kvcache_##SUFFIX##_d##DP, partial_out, partial_lse,) \
    FA_IF_DECODE(DP, FA_CUDA_KV_CACHE_LAUNCHER(T, forward_decode_kvcache_##SUFFIX##_d##DP,         \
                                               partial_out, partial_lse,)                          \
                     FA_CUDA_KV_CACHE_LAUNCHER(T, forward_spec_kvcache_##SUFFIX##_d##DP,           \
                                               partial_out, partial_lse,))

// The first dispatch of a varlen pass: writes the sequence table from the cu_seqlens tables.
__global__ void __launch_bounds__(kThreads) fa_cuda_varlen_sequences_kernel(
    const int *cu_seqlens_q, const int *cu_seqlens_k, FlashAttentionParams *table,
    FlashAttentionParams params) {
    flash_attention_varlen_sequences(cu_seqlens_q, cu_seqlens_k, table, params, threadIdx.x);
}

#define FA_CUDA_LAUNCHERS_F16(...)                                                                 \
    FA_CUDA_LAUNCHERS(half, f16, __VA_ARGS__) FA_CUDA_KV_CACHE_LAUNCHERS(half, f16, __VA_ARGS__)
#define FA_CUDA_LAUNCHERS_BF16(...)                                                                \
    FA_CUDA_LAUNCHERS(bfloat, bf16, __VA_ARGS__) FA_CUDA_KV_CACHE_LAUNCHERS(bfloat, bf16, __VA_ARGS__)
#define FA_CUDA_LAUNCHERS_F32(...)                                                                 \
    FA_CUDA_LAUNCHERS(float, f32, __VA_ARGS__) FA_CUDA_KV_CACHE_LAUNCHERS(float, f32, __VA_ARGS__)
FA_CUDA_DTYPE_LAUNCHERS(half, f16)
FA_HEAD_DIM_BUCKETS(FA_CUDA_LAUNCHERS_F16)
FA_CUDA_DTYPE_LAUNCHERS(bfloat, bf16)
FA_HEAD_DIM_BUCKETS(FA_CUDA_LAUNCHERS_BF16)
FA_CUDA_DTYPE_LAUNCHERS(float, f32)
FA_HEAD_DIM_BUCKETS_F32(FA_CUDA_LAUNCHERS_F32)
// dsinks reads only lse, delta, sinks and lse_residual (float32), whatever the dtype: one instance.
__global__ void __launch_bounds__(kThreads) fa_cuda_backward_dsinks_kernel(
    const float *lse, FlashAttentionParams params, const float *delta, const float *sinks,
    const float *lse_residual, float *dsinks) {
    flash_attention_backward_dsinks(nullptr, nullptr, nullptr, nullptr, nullptr, lse, &params, delta,
                                    nullptr, nullptr, sinks, lse_residual, dsinks, FA_CUDA_TGID,
                                    threadIdx.x);
}
#undef FA_CUDA_LAUNCHERS_F16
#undef FA_CUDA_LAUNCHERS_BF16
#undef FA_CUDA_LAUNCHERS_F32
#undef FA_CUDA_LAUNCHERS
#undef FA_CUDA_KV_CACHE_LAUNCHERS
#undef FA_CUDA_KV_CACHE_LAUNCHER
#undef FA_CUDA_DTYPE_LAUNCHERS
#undef FA_CUDA_PARAMS
#undef FA_CUDA_TGID
#undef FA_CUDA_SGID
#undef FA_CUDA_LANE

namespace {

// One row of a dtype's bucket table: the block sizes the grids need (read from the table through
// the X-macro, never written down twice) and that bucket's launchers.
template <typename T>
struct Bucket {
    typedef T Element;
    unsigned head_dim_max, forward_block_q, forward_block_k, dq_block_q, dkv_block_k;
    void (*forward)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                    const uchar *, const float *, const float *, FlashAttentionParams *);
    void (*forward_split)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                          const uchar *, const float *, const float *, float *, float *);
    void (*backward_lse_residual)(const T *, const T *, const T *, const T *, const T *,
                                  const float *, FlashAttentionParams, const float *,
                                  const uchar *, const float *, const float *, float *,
                                  FlashAttentionParams *);
    void (*backward_dq)(const T *, const T *, const T *, const T *, const T *, const float *,
                        FlashAttentionParams, const float *, const uchar *, const float *,
                        const float *, const float *, T *, FlashAttentionParams *);
    void (*backward_dkv)(const T *, const T *, const T *, const T *, const T *, const float *,
                         FlashAttentionParams, const float *, const uchar *, const float *,
                         const float *, const float *, T *, T *, FlashAttentionParams *);
    // The KV-cache instances: dense, tiled split.
    typedef void (*KVCacheKernel)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                                  const uchar *, const float *, const float *, float *, float *,
                                  FaCudaKVCache);
    KVCacheKernel forward_kvcache, forward_split_kvcache;
    // Last, so that buckets without decode and spec instances (FA_IF_DECODE) leave them null.
    void (*forward_decode)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                           const uchar *, const float *, const float *, float *, float *);
    KVCacheKernel forward_decode_kvcache;
    void (*forward_spec)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                         const uchar *, const float *, const float *, float *, float *);
    KVCacheKernel forward_spec_kvcache;
};

// The split-KV kernel that writes a problem's chunks, as the Metal plan picks it (KeyValueSplit).
enum SplitKernel { kSplitDecode, kSplitSpec, kSplitTiled };

// A dtype: its buckets and its bucket-independent kernels.
template <typename T>
struct DtypeKernels {
    const Bucket<T> *buckets;
    unsigned bucket_count;
    void (*forward_combine)(const T *, const T *, const T *, T *, float *, FlashAttentionParams,
                            const uchar *, const float *, const float *, const float *,
                            const float *);
    void (*backward_delta)(const T *, const T *, const T *, const T *, const T *, const float *,
                           FlashAttentionParams, float *, const uchar *, const float *,
                           const float *, const float *, FlashAttentionParams *);

    // The first bucket whose head_dim_max >= max(head_dim, head_dim_v); null when none is.
    const Bucket<T> *bucket(const FlashAttentionParams &p) const {
        if (p.head_dim < 1 || p.head_dim_v < 1) {
            return nullptr;
        }
        const unsigned widest = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
        for (unsigned i = 0; i < bucket_count; ++i) {
            if (widest <= buckets[i].head_dim_max) {
                return &buckets[i];
            }
        }
        return nullptr;
    }
};

#define FA_CUDA_BUCKET(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                \
    Bucket<T>{DP,                                                                                  \
              FWD_BQ,                                                                              \
              FWD_BK,                                                                              \
              DQ_BQ,                                                                               \
              DKV_BK,                                                                              \
              fa_cuda_forward_##SUFFIX##_d##DP,                                                    \
              fa_cuda_forward_split_##SUFFIX##_d##DP,                                              \
              fa_cuda_backward_lse_residual_##SUFFIX##_d##DP,                                      \
              fa_cuda_backward_dq_##SUFFIX##_d##DP,                                                \
              fa_cuda_backward_dkv_##SUFFIX##_d##DP,                                               \
              fa_cuda_forward_kvcache_##SUFFIX##_d##DP,                                            \
              fa_cuda_forward_split_kvcache_##SUFFIX##_d##DP,                                      \
              FA_IF_DECODE(DP, fa_cuda_forward_decode_##SUFFIX##_d##DP,                            \
                           fa_cuda_forward_decode_kvcache_##SUFFIX##_d##DP,                        \
                           fa_cuda_forward_spec_##SUFFIX##_d##DP,                                  \
                           fa_cuda_forward_spec_kvcache_##SUFFIX##_d##DP)},
#define FA_CUDA_BUCKET_F16(...) FA_CUDA_BUCKET(half, f16, __VA_ARGS__)
#define FA_CUDA_BUCKET_BF16(...) FA_CUDA_BUCKET(bfloat, bf16, __VA_ARGS__)
#define FA_CUDA_BUCKET_F32(...) FA_CUDA_BUCKET(float, f32, __VA_ARGS__)
const Bucket<half> kF16Buckets[] = {FA_HEAD_DIM_BUCKETS(FA_CUDA_BUCKET_F16)};
const Bucket<bfloat> kBF16Buckets[] = {FA_HEAD_DIM_BUCKETS(FA_CUDA_BUCKET_BF16)};
const Bucket<float> kF32Buckets[] = {FA_HEAD_DIM_BUCKETS_F32(FA_CUDA_BUCKET_F32)};
#undef FA_CUDA_BUCKET_F16
#undef FA_CUDA_BUCKET_BF16
#undef FA_CUDA_BUCKET_F32
#undef FA_CUDA_BUCKET

template <typename T, unsigned N>
constexpr unsigned count_of(const T (&)[N]) {
    return N;
}

const DtypeKernels<half> kF16{kF16Buckets, count_of(kF16Buckets), fa_cuda_forward_combine_f16,
                              fa_cuda_backward_delta_f16};
const DtypeKernels<bfloat> kBF16{kBF16Buckets, count_of(kBF16Buckets),
                                 fa_cuda_forward_combine_bf16, fa_cuda_backward_delta_bf16};
const DtypeKernels<float> kF32{kF32Buckets, count_of(kF32Buckets), fa_cuda_forward_combine_f32,
                               fa_cuda_backward_delta_f32};

// Calls f(kernels) with the dtype's table; cudaErrorInvalidValue for an unknown dtype.
template <typename F>
cudaError_t with_dtype(int dtype, F f) {
    switch (dtype) {
        case FA_DTYPE_F16:
            return f(kF16);
        case FA_DTYPE_BF16:
            return f(kBF16);
        case FA_DTYPE_F32:
            return f(kF32);
        default:
            return cudaErrorInvalidValue;
    }
}

template <typename T>
const T *typed(const void *p) {
    return static_cast<const T *>(p);
}
template <typename T>
T *typed(void *p) {
    return static_cast<T *>(p);
}

const uchar *mask_of(const FaCudaScoreInputs &x) { return static_cast<const uchar *>(x.mask); }

// The function constants of the launches that follow (FA_FUNCTION_CONSTANTS, each value computed
// from the parameter struct as the Metal plan computes it): a value per launch, as Metal
// specialises a pipeline per dispatch. Every launch gets all of them; the CPU engine checks that
// the plan gives each kernel those it reads.
cudaError_t specialise(const FlashAttentionParams &p) {
    metal::function_constant_values c{};
#define FA_CUDA_CONSTANT(INDEX, TYPE, NAME, VALUE)                                                \
    c.set |= 1u << (INDEX);                                                                        \
    c.type[INDEX] = metal::function_constant_type<TYPE>::value;                                    \
    c.value[INDEX] = unsigned(VALUE);
    FA_FUNCTION_CONSTANTS(FA_CUDA_CONSTANT)
#undef FA_CUDA_CONSTANT
    return cudaMemcpyToSymbol(metal::function_constants, &c, sizeof c);
}

// The launches, per dtype. Each picks the dtype's bucket and launches its kernel over the grid of
// the Metal dispatch plan (x fastest).
// The grid's x extent over `rows` rows (the longest sequence's with varlen), its z extent.
unsigned grid_rows(const FlashAttentionParams &p, const FaCudaVarlen *varlen, bool keys) {
    return varlen == nullptr ? (keys ? p.seqlen_k : p.seqlen_q)
                             : (keys ? varlen->max_seqlen_k : varlen->max_seqlen_q);
}
unsigned grid_batch(const FlashAttentionParams &p) { return p.sequences == 0 ? p.batch : p.sequences; }
FlashAttentionParams *table_of(const FaCudaVarlen *varlen) {
    return varlen == nullptr ? nullptr : varlen->table;
}

template <typename T>
cudaError_t forward(const DtypeKernels<T> &kernels, const FlashAttentionParams &p, const void *q,
                    const void *k, const void *v, void *out, float *lse,
                    const FaCudaScoreInputs &x, const FaCudaVarlen *varlen = nullptr) {
    const Bucket<T> *b = kernels.bucket(p);
    if (b == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    const dim3 grid(ceil_div(grid_rows(p, varlen, false), b->forward_block_q), p.num_heads, grid_batch(p));
    b->forward<<<grid, kThreads>>>(typed<T>(q), typed<T>(k), typed<T>(v), typed<T>(out), lse, p,
                                   mask_of(x), x.alibi, x.sinks, table_of(varlen));
    return cudaGetLastError();
}

template <typename T>
cudaError_t split_keys(const DtypeKernels<T> &kernels, FlashAttentionParams *p, unsigned chunks) {
    const Bucket<T> *b = kernels.bucket(*p);
    if (b == nullptr || chunks == 0) {
        return cudaErrorInvalidValue;
    }
    const unsigned tile = b->forward_block_k;
    p->kv_chunk_keys = ceil_div(ceil_div(p->seqlen_k, chunks), tile) * tile;
    p->kv_chunks = ceil_div(p->seqlen_k, p->kv_chunk_keys);
    return cudaSuccess;
}

// The split-KV forward's two dispatches: `chunks(bucket, decode, grid)` launches the chunks'
// kernel (plain or KV-cache instance), then the combine.
template <typename T, typename Chunks>
cudaError_t forward_split(const DtypeKernels<T> &kernels, const FlashAttentionParams &p,
                          const void *q, const void *k, const void *v, void *out, float *lse,
                          float *partial_out, float *partial_lse, const FaCudaScoreInputs &x,
                          Chunks chunks) {
    const Bucket<T> *b = kernels.bucket(p);
    if (b == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    // As the Metal plan: the decode kernel where it serves the packed rows, else the spec kernel
    // where it does, else the tiled one.
    const unsigned rows = p.num_heads / p.num_kv_heads * p.seqlen_q;
    const SplitKernel kernel = FA_DECODE_SERVES(b->head_dim_max, rows) ? kSplitDecode
                               : FA_SPEC_SERVES(b->head_dim_max, b->forward_block_q, rows) ? kSplitSpec
                                                                                            : kSplitTiled;
    const unsigned block = kernel == kSplitDecode ? FA_DECODE_ROWS(b->head_dim_max)
                           : kernel == kSplitSpec ? FA_SPEC_BLOCK_Q(b->forward_block_q)
                                                  : b->forward_block_q;
    chunks(b, kernel, dim3(p.kv_chunks * ceil_div(rows, block), p.num_kv_heads, p.batch));
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) {
        return error;
    }
    kernels.forward_combine<<<dim3(p.seqlen_q, p.num_heads, p.batch), kThreads>>>(
        typed<T>(q), typed<T>(k), typed<T>(v), typed<T>(out), lse, p, mask_of(x), x.alibi,
        x.sinks, partial_out, partial_lse);
    return cudaGetLastError();
}

template <typename T>
cudaError_t backward_delta(const DtypeKernels<T> &kernels, const FlashAttentionParams &p,
                           const void *dout, const void *q, const void *k, const void *v,
                           const void *out, const float *lse, float *delta,
                           const float *lse_residual, const FaCudaScoreInputs &x,
                           const FaCudaVarlen *varlen = nullptr) {
    if (kernels.bucket(p) == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    const dim3 grid(ceil_div(grid_rows(p, varlen, false), FA_DELTA_BLOCK_ROWS), p.num_heads, grid_batch(p));
    kernels.backward_delta<<<grid, kThreads>>>(typed<T>(dout), typed<T>(q), typed<T>(k),
                                               typed<T>(v), typed<T>(out), lse, p, delta,
                                               mask_of(x), x.alibi, x.sinks, lse_residual,
                                               table_of(varlen));
    return cudaGetLastError();
}

template <typename T>
cudaError_t backward_lse_residual(const DtypeKernels<T> &kernels, const FlashAttentionParams &p,
                                  const void *dout, const void *q, const void *k, const void *v,
                                  const void *out, const float *lse, const float *delta,
                                  float *lse_residual, const FaCudaScoreInputs &x,
                                  const FaCudaVarlen *varlen = nullptr) {
    const Bucket<T> *b = kernels.bucket(p);
    if (b == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    // The forward's row blocks: the residual recomputes the forward's m and l tile by tile.
    const dim3 grid(ceil_div(grid_rows(p, varlen, false), b->forward_block_q), p.num_heads, grid_batch(p));
    b->backward_lse_residual<<<grid, kThreads>>>(typed<T>(dout), typed<T>(q), typed<T>(k),
                                                 typed<T>(v), typed<T>(out), lse, p, delta,
                                                 mask_of(x), x.alibi, x.sinks, lse_residual,
                                                 table_of(varlen));
    return cudaGetLastError();
}

template <typename T>
cudaError_t backward_dq(const DtypeKernels<T> &kernels, const FlashAttentionParams &p,
                        const void *dout, const void *q, const void *k, const void *v,
                        const void *out, const float *lse, const float *delta,
                        const float *lse_residual, void *dq, const FaCudaScoreInputs &x,
                        const FaCudaVarlen *varlen = nullptr) {
    const Bucket<T> *b = kernels.bucket(p);
    if (b == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    const dim3 grid(ceil_div(grid_rows(p, varlen, false), b->dq_block_q), p.num_heads, grid_batch(p));
    b->backward_dq<<<grid, kThreads>>>(typed<T>(dout), typed<T>(q), typed<T>(k), typed<T>(v),
                                       typed<T>(out), lse, p, delta, mask_of(x), x.alibi, x.sinks,
                                       lse_residual, typed<T>(dq), table_of(varlen));
    return cudaGetLastError();
}

template <typename T>
cudaError_t backward_dkv(const DtypeKernels<T> &kernels, const FlashAttentionParams &p,
                         const void *dout, const void *q, const void *k, const void *v,
                         const void *out, const float *lse, const float *delta,
                         const float *lse_residual, void *dk, void *dv,
                         const FaCudaScoreInputs &x, const FaCudaVarlen *varlen = nullptr) {
    const Bucket<T> *b = kernels.bucket(p);
    if (b == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    const dim3 grid(ceil_div(grid_rows(p, varlen, true), b->dkv_block_k), p.num_kv_heads, grid_batch(p));
    b->backward_dkv<<<grid, kThreads>>>(typed<T>(dout), typed<T>(q), typed<T>(k), typed<T>(v),
                                        typed<T>(out), lse, p, delta, mask_of(x), x.alibi,
                                        x.sinks, lse_residual, typed<T>(dk), typed<T>(dv),
                                        table_of(varlen));
    return cudaGetLastError();
}

}  // namespace

unsigned fa_cuda_bucket(const FlashAttentionParams &p, int dtype);

namespace {

// The edge paths of a launch, chosen as the library's plan and backends choose them
// (FlashAttentionParams.scalar_copies and partial_columns, Problem.swift): the checked scalar copy
// when a tensor the kernels copy in tiles (those in `copied`, null for unbound) starts at an
// address, or has head_dim, head_dim_v or a stride that is not a multiple of FA_CHUNK_BYTES
// bytes; the active-fragment test when a whole 8-column fragment of the bucket lies past head_dim
// or head_dim_v.
FlashAttentionParams edge_paths(FlashAttentionParams p, int dtype,
                                std::initializer_list<const void *> copied) {
    const uint64_t size = dtype == FA_DTYPE_F32 ? 4 : 2;
    const auto aligned = [&](uint64_t elements) { return elements * size % FA_CHUNK_BYTES == 0; };
    const auto strides_aligned = [&](const FlashAttentionStrides &s) {
        return aligned(s.batch) && aligned(s.head) && aligned(s.seq);
    };
    bool chunks = aligned(p.head_dim) && aligned(p.head_dim_v) && strides_aligned(p.q) &&
                  strides_aligned(p.k) && strides_aligned(p.v) && strides_aligned(p.out) &&
                  strides_aligned(p.dout);
    for (const void *tensor : copied) {
        chunks = chunks && reinterpret_cast<uintptr_t>(tensor) % FA_CHUNK_BYTES == 0;
    }
    const unsigned width = fa_cuda_bucket(p, dtype);
    p.scalar_copies = chunks ? 0u : 1u;
    const auto fragment_columns = [](unsigned dim) { return (dim + 7) / 8 * 8; };
    p.partial_columns =
        fragment_columns(p.head_dim) == width && fragment_columns(p.head_dim_v) == width ? 0u : 1u;
    return p;
}

}  // namespace

unsigned fa_cuda_bucket(const FlashAttentionParams &p, int dtype) {
    unsigned head_dim_max = 0;
    with_dtype(dtype, [&](const auto &kernels) {
        const auto *b = kernels.bucket(p);
        head_dim_max = b != nullptr ? b->head_dim_max : 0;
        return cudaSuccess;
    });
    return head_dim_max;
}

cudaError_t fa_cuda_forward(const FlashAttentionParams &given, int dtype, const void *q, const void *k,
                            const void *v, void *out, float *lse, const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {q, k, v});
    return with_dtype(dtype, [&](const auto &kernels) {
        return forward(kernels, p, q, k, v, out, lse, x);
    });
}

bool fa_cuda_split_keys(FlashAttentionParams *p, int dtype, unsigned chunks) {
    return with_dtype(dtype, [&](const auto &kernels) { return split_keys(kernels, p, chunks); }) ==
           cudaSuccess;
}

cudaError_t fa_cuda_forward_split(const FlashAttentionParams &given, int dtype, const void *q,
                                  const void *k, const void *v, void *out, float *lse,
                                  float *partial_out, float *partial_lse,
                                  const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {q, k, v});
    return with_dtype(dtype, [&](const auto &kernels) {
        using T = typename std::remove_pointer<decltype(kernels.buckets)>::type::Element;
        return forward_split(kernels, p, q, k, v, out, lse, partial_out, partial_lse, x,
                             [&](const Bucket<T> *b, SplitKernel kernel, dim3 grid) {
                                 (kernel == kSplitDecode ? b->forward_decode
                                  : kernel == kSplitSpec ? b->forward_spec
                                                         : b->forward_split)<<<grid, kThreads>>>(
                                     typed<T>(q), typed<T>(k), typed<T>(v), typed<T>(out), lse, p,
                                     mask_of(x), x.alibi, x.sinks, partial_out, partial_lse);
                             });
    });
}

cudaError_t fa_cuda_kvcache_forward(const FlashAttentionParams &given, int dtype, const FaCudaKVCache &cache,
                                    const void *q, const void *k, const void *v, void *out, float *lse,
                                    float *partial_out, float *partial_lse, const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {q, k, v});
    return with_dtype(dtype, [&](const auto &kernels) {
        using T = typename std::remove_pointer<decltype(kernels.buckets)>::type::Element;
        const auto launch = [&](typename Bucket<T>::KVCacheKernel kernel, dim3 grid) {
            kernel<<<grid, kThreads>>>(typed<T>(q), typed<T>(k), typed<T>(v), typed<T>(out), lse, p,
                                       mask_of(x), x.alibi, x.sinks, partial_out, partial_lse, cache);
        };
        if (partial_out == nullptr) {
            const Bucket<T> *b = kernels.bucket(p);
            if (b == nullptr) {
                return cudaErrorInvalidValue;
            }
            if (const cudaError_t error = specialise(p); error != cudaSuccess) {
                return error;
            }
            launch(b->forward_kvcache, dim3(ceil_div(p.seqlen_q, b->forward_block_q), p.num_heads, p.batch));
            return cudaGetLastError();
        }
        return forward_split(kernels, p, q, k, v, out, lse, partial_out, partial_lse, x,
                             [&](const Bucket<T> *b, SplitKernel kernel, dim3 grid) {
                                 launch(kernel == kSplitDecode ? b->forward_decode_kvcache
                                        : kernel == kSplitSpec ? b->forward_spec_kvcache
                                                               : b->forward_split_kvcache,
                                        grid);
                             });
    });
}

size_t fa_cuda_delta_elements(const FlashAttentionParams &p) {
    return size_t(p.batch) * p.num_heads * p.seqlen_q;
}

cudaError_t fa_cuda_backward_delta(const FlashAttentionParams &given, int dtype, const void *dout,
                                   const void *q, const void *k, const void *v, const void *out,
                                   const float *lse, float *delta, const float *lse_residual,
                                   const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {dout, q, k, v, out});
    return with_dtype(dtype, [&](const auto &kernels) {
        return backward_delta(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, x);
    });
}

cudaError_t fa_cuda_backward_lse_residual(const FlashAttentionParams &given, int dtype,
                                          const void *dout, const void *q, const void *k,
                                          const void *v, const void *out, const float *lse,
                                          const float *delta, float *lse_residual,
                                          const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {dout, q, k, v, out});
    return with_dtype(dtype, [&](const auto &kernels) {
        return backward_lse_residual(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, x);
    });
}

cudaError_t fa_cuda_backward_dq(const FlashAttentionParams &given, int dtype, const void *dout,
                                const void *q, const void *k, const void *v, const void *out,
                                const float *lse, const float *delta, const float *lse_residual,
                                void *dq, const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {dout, q, k, v, out});
    return with_dtype(dtype, [&](const auto &kernels) {
        return backward_dq(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, dq, x);
    });
}

cudaError_t fa_cuda_backward_dkv(const FlashAttentionParams &given, int dtype, const void *dout,
                                 const void *q, const void *k, const void *v, const void *out,
                                 const float *lse, const float *delta, const float *lse_residual,
                                 void *dk, void *dv, const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {dout, q, k, v, out});
    return with_dtype(dtype, [&](const auto &kernels) {
        return backward_dkv(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, dk, dv, x);
    });
}

cudaError_t fa_cuda_backward_dsinks(const FlashAttentionParams &p, const float *lse,
                                    const float *delta, const float *lse_residual,
                                    const float *sinks, float *dsinks) {
    if (p.has_sinks == 0 || sinks == nullptr || dsinks == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t error = specialise(p); error != cudaSuccess) {
        return error;
    }
    fa_cuda_backward_dsinks_kernel<<<dim3(p.num_heads, 1, 1), kThreads>>>(lse, p, delta, sinks,
                                                                          lse_residual, dsinks);
    return cudaGetLastError();
}

cudaError_t fa_cuda_backward(const FlashAttentionParams &p, int dtype, const void *dout,
                             const void *q, const void *k, const void *v, const void *out,
                             const float *lse, float *delta, float *lse_residual, void *dq,
                             void *dk, void *dv, const FaCudaScoreInputs &x, float *dsinks) {
    cudaError_t error =
        fa_cuda_backward_delta(p, dtype, dout, q, k, v, out, lse, delta, lse_residual, x);
    if (error == cudaSuccess) {
        error = fa_cuda_backward_lse_residual(p, dtype, dout, q, k, v, out, lse, delta,
                                              lse_residual, x);
    }
    if (error == cudaSuccess) {
        error = fa_cuda_backward_dq(p, dtype, dout, q, k, v, out, lse, delta, lse_residual, dq, x);
    }
    if (error == cudaSuccess) {
        error = fa_cuda_backward_dkv(p, dtype, dout, q, k, v, out, lse, delta, lse_residual, dk,
                                     dv, x);
    }
    if (error == cudaSuccess && p.has_sinks != 0) {
        error = fa_cuda_backward_dsinks(p, lse, delta, lse_residual, x.sinks, dsinks);
    }
    return error;
}

namespace {

// The sequence table of a varlen pass, written on the device from the device tables.
cudaError_t write_sequence_table(const FlashAttentionParams &p, const FaCudaVarlen &varlen) {
    if (p.sequences == 0 || varlen.table == nullptr || varlen.cu_seqlens_q == nullptr ||
        varlen.cu_seqlens_k == nullptr) {
        return cudaErrorInvalidValue;
    }
    fa_cuda_varlen_sequences_kernel<<<1, kThreads>>>(varlen.cu_seqlens_q, varlen.cu_seqlens_k,
                                                     varlen.table, p);
    return cudaGetLastError();
}

}  // namespace

cudaError_t fa_cuda_varlen_forward(const FlashAttentionParams &given, int dtype, const FaCudaVarlen &varlen,
                                   const void *q, const void *k, const void *v, void *out, float *lse,
                                   const FaCudaScoreInputs &x) {
    const FlashAttentionParams p = edge_paths(given, dtype, {q, k, v});
    cudaError_t error = write_sequence_table(p, varlen);
    if (error == cudaSuccess) {
        error = with_dtype(dtype, [&](const auto &kernels) {
            return forward(kernels, p, q, k, v, out, lse, x, &varlen);
        });
    }
    return error;
}

cudaError_t fa_cuda_varlen_backward(const FlashAttentionParams &given, int dtype, const FaCudaVarlen &varlen,
                                    const void *dout, const void *q, const void *k, const void *v,
                                    const void *out, const float *lse, float *delta, float *lse_residual,
                                    void *dq, void *dk, void *dv, const FaCudaScoreInputs &x, float *dsinks) {
    const FlashAttentionParams p = edge_paths(given, dtype, {dout, q, k, v, out});
    cudaError_t error = write_sequence_table(p, varlen);
    const auto each = [&](auto launch) {
        if (error == cudaSuccess) {
            error = with_dtype(dtype, launch);
        }
    };
    each([&](const auto &kernels) { return backward_delta(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, x, &varlen); });
    each([&](const auto &kernels) {
        return backward_lse_residual(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, x, &varlen);
    });
    each([&](const auto &kernels) {
        return backward_dq(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, dq, x, &varlen);
    });
    each([&](const auto &kernels) {
        return backward_dkv(kernels, p, dout, q, k, v, out, lse, delta, lse_residual, dk, dv, x, &varlen);
    });
    if (error == cudaSuccess && p.has_sinks != 0) {
        // dsinks sums over all rows of the packed problem with the host's struct.
        error = fa_cuda_backward_dsinks(p, lse, delta, lse_residual, x.sinks, dsinks);
    }
    return error;
}
