// Entries that let the engine run the kernels of Shaders/flash_attention.metal, compiled here from
// the unmodified source: each entry binds the kernel's [[buffer(i)]] arguments and built-ins.
#include "msl_kernel_registry.hpp"

// On x86-64 the kernels are compiled for AVX2/F16C/FMA: without F16C every half<->float
// conversion is a library call and the engine runs about ten times slower. The table is empty on a
// CPU without those features, so the CPU backend reports that instead of faulting.
#if defined(__x86_64__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma"))), apply_to = function)
#endif
#include "../../Shaders/flash_attention.metal"
#if defined(__x86_64__)
#pragma clang attribute pop
#endif

namespace {

using msl_engine::builtins;
using msl_engine::kernel_args;

// Kernel signatures per element type T (see the kernel definitions in the .metal file).
#define FA_OPTIONAL_TYPES const uchar *, const float *, const float *
// The backward kernels' optional inputs and the lse residual (an output of backward_lse_residual).
#define FA_BACKWARD_OPTIONAL_TYPES FA_OPTIONAL_TYPES, const float *
template <class T>
using ForwardKernel = void (*)(const T *, const T *, const T *, T *, float *,
                               const FlashAttentionParams *, FA_OPTIONAL_TYPES, uint3, uint, uint);
template <class T>
using ForwardSplitKernel = void (*)(const T *, const T *, const T *, T *, float *,
                                    const FlashAttentionParams *, FA_OPTIONAL_TYPES, float *,
                                    float *, uint3, uint, uint);
// The KV-cache forward kernels bind the cache's table, scales and biases after the others.
#define FA_KV_CACHE_TYPES(T) const int *, const T *, const T *, const T *, const T *
template <class T>
using ForwardKvCacheKernel = void (*)(const T *, const T *, const T *, T *, float *,
                                      const FlashAttentionParams *, FA_OPTIONAL_TYPES,
                                      FA_KV_CACHE_TYPES(T), uint3, uint, uint);
template <class T>
using ForwardSplitKvCacheKernel = void (*)(const T *, const T *, const T *, T *, float *,
                                           const FlashAttentionParams *, FA_OPTIONAL_TYPES, float *,
                                           float *, FA_KV_CACHE_TYPES(T), uint3, uint, uint);
template <class T>
using ForwardCombineKernel = void (*)(const T *, const T *, const T *, T *, float *,
                                      const FlashAttentionParams *, FA_OPTIONAL_TYPES,
                                      const float *, const float *, uint3, uint);
template <class T>
using BackwardDeltaKernel = void (*)(const T *, const T *, const T *, const T *, const T *,
                                     const float *, const FlashAttentionParams *, float *,
                                     FA_BACKWARD_OPTIONAL_TYPES, uint3, uint);
template <class T>
using BackwardLseResidualKernel = void (*)(const T *, const T *, const T *, const T *, const T *,
                                           const float *, const FlashAttentionParams *,
                                           const float *, FA_OPTIONAL_TYPES, float *, uint3, uint,
                                           uint);
template <class T>
using BackwardDqKernel = void (*)(const T *, const T *, const T *, const T *, const T *,
                                  const float *, const FlashAttentionParams *, const float *,
                                  FA_BACKWARD_OPTIONAL_TYPES, T *, uint3, uint, uint);
template <class T>
using BackwardDkvKernel = void (*)(const T *, const T *, const T *, const T *, const T *,
                                   const float *, const FlashAttentionParams *, const float *,
                                   FA_BACKWARD_OPTIONAL_TYPES, T *, T *, uint3, uint, uint);
template <typename T>
using MergeKernel = void (*)(const T *, const float *, const T *, const float *, T *, float *,
                             const FlashAttentionParams &, uint3, uint);

// The buffers every forward kernel binds, in [[buffer(i)]] order up to the parameters.
#define FA_FORWARD_INPUTS(T, a)                                                                    \
    a.buffer<const T>(FA_FORWARD_BUFFER_Q), a.buffer<const T>(FA_FORWARD_BUFFER_K),                \
        a.buffer<const T>(FA_FORWARD_BUFFER_V), a.buffer<T>(FA_FORWARD_BUFFER_OUT),                \
        a.buffer<float>(FA_FORWARD_BUFFER_LSE),                                                    \
        a.buffer<const FlashAttentionParams>(FA_FORWARD_BUFFER_PARAMS),                            \
        a.buffer<const uchar>(FA_FORWARD_BUFFER_MASK), a.buffer<const float>(FA_FORWARD_BUFFER_ALIBI), \
        a.buffer<const float>(FA_FORWARD_BUFFER_SINKS)

// The optional inputs every backward kernel binds after delta.
#define FA_BACKWARD_OPTIONALS(a)                                                                   \
    a.buffer<const uchar>(FA_BACKWARD_BUFFER_MASK), a.buffer<const float>(FA_BACKWARD_BUFFER_ALIBI), \
        a.buffer<const float>(FA_BACKWARD_BUFFER_SINKS)
// Those and the lse residual, as the kernels that read it bind them.
#define FA_BACKWARD_READS(a)                                                                       \
    FA_BACKWARD_OPTIONALS(a), a.buffer<const float>(FA_BACKWARD_BUFFER_LSE_RESIDUAL)

// The buffers every backward kernel binds, in [[buffer(i)]] order up to the parameters.
#define FA_BACKWARD_INPUTS(T, a)                                                                   \
    a.buffer<const T>(FA_BACKWARD_BUFFER_DOUT), a.buffer<const T>(FA_BACKWARD_BUFFER_Q),           \
        a.buffer<const T>(FA_BACKWARD_BUFFER_K), a.buffer<const T>(FA_BACKWARD_BUFFER_V),          \
        a.buffer<const T>(FA_BACKWARD_BUFFER_OUT), a.buffer<const float>(FA_BACKWARD_BUFFER_LSE),  \
        a.buffer<const FlashAttentionParams>(FA_BACKWARD_BUFFER_PARAMS)

template <class T, ForwardKernel<T> Kernel>
void run_forward(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(T, a), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

template <class T, ForwardSplitKernel<T> Kernel>
void run_forward_split(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(T, a), a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_OUT),
           a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_LSE), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

#define FA_KV_CACHE_INPUTS(T, a)                                                                   \
    a.buffer<const int>(FA_KV_CACHE_BUFFER_TABLE), a.buffer<const T>(FA_KV_CACHE_BUFFER_K_SCALES), \
        a.buffer<const T>(FA_KV_CACHE_BUFFER_K_BIASES),                                            \
        a.buffer<const T>(FA_KV_CACHE_BUFFER_V_SCALES), a.buffer<const T>(FA_KV_CACHE_BUFFER_V_BIASES)

template <class T, ForwardKvCacheKernel<T> Kernel>
void run_forward_kvcache(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(T, a), FA_KV_CACHE_INPUTS(T, a), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

template <class T, ForwardSplitKvCacheKernel<T> Kernel>
void run_forward_split_kvcache(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(T, a), a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_OUT),
           a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_LSE), FA_KV_CACHE_INPUTS(T, a),
           t.threadgroup_position_in_grid, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
}

template <class T, ForwardCombineKernel<T> Kernel>
void run_forward_combine(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(T, a), a.buffer<const float>(FA_FORWARD_BUFFER_PARTIAL_OUT),
           a.buffer<const float>(FA_FORWARD_BUFFER_PARTIAL_LSE), t.threadgroup_position_in_grid,
           t.thread_index_in_threadgroup);
}

template <class T, BackwardDeltaKernel<T> Kernel>
void run_backward_delta(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(T, a), a.buffer<float>(FA_BACKWARD_BUFFER_DELTA),
           FA_BACKWARD_READS(a), t.threadgroup_position_in_grid, t.thread_index_in_threadgroup);
}

template <class T, BackwardLseResidualKernel<T> Kernel>
void run_backward_lse_residual(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(T, a), a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA),
           FA_BACKWARD_OPTIONALS(a), a.buffer<float>(FA_BACKWARD_BUFFER_LSE_RESIDUAL),
           t.threadgroup_position_in_grid, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
}

template <class T, BackwardDqKernel<T> Kernel>
void run_backward_dq(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(T, a), a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA),
           FA_BACKWARD_READS(a), a.buffer<T>(FA_BACKWARD_BUFFER_DQ), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

template <class T, BackwardDkvKernel<T> Kernel>
void run_backward_dkv(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(T, a), a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA),
           FA_BACKWARD_READS(a), a.buffer<T>(FA_BACKWARD_BUFFER_DK), a.buffer<T>(FA_BACKWARD_BUFFER_DV),
           t.threadgroup_position_in_grid, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
}

template <typename T, MergeKernel<T> Kernel>
void run_merge(const kernel_args &a, const builtins &t) {
    Kernel(a.buffer<const T>(FA_MERGE_BUFFER_OUT_A), a.buffer<const float>(FA_MERGE_BUFFER_LSE_A),
           a.buffer<const T>(FA_MERGE_BUFFER_OUT_B), a.buffer<const float>(FA_MERGE_BUFFER_LSE_B),
           a.buffer<T>(FA_MERGE_BUFFER_OUT), a.buffer<float>(FA_MERGE_BUFFER_LSE),
           a.constant_ref<const FlashAttentionParams>(FA_MERGE_BUFFER_PARAMS),
           t.threadgroup_position_in_grid, t.thread_index_in_threadgroup);
}

void run_backward_dsinks(const kernel_args &a, const builtins &t) {
    flash_attention_backward_dsinks(
        a.buffer<const uchar>(FA_BACKWARD_BUFFER_DOUT), a.buffer<const uchar>(FA_BACKWARD_BUFFER_Q),
        a.buffer<const uchar>(FA_BACKWARD_BUFFER_K), a.buffer<const uchar>(FA_BACKWARD_BUFFER_V),
        a.buffer<const uchar>(FA_BACKWARD_BUFFER_OUT), a.buffer<const float>(FA_BACKWARD_BUFFER_LSE),
        a.buffer<const FlashAttentionParams>(FA_BACKWARD_BUFFER_PARAMS),
        a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA), FA_BACKWARD_READS(a),
        a.buffer<float>(FA_BACKWARD_BUFFER_DSINKS), t.threadgroup_position_in_grid,
        t.thread_index_in_threadgroup);
}

void run_varlen_sequences(const kernel_args &a, const builtins &t) {
    flash_attention_varlen_sequences(
        a.buffer<const int>(FA_VARLEN_BUFFER_CU_SEQLENS_Q), a.buffer<const int>(FA_VARLEN_BUFFER_CU_SEQLENS_K),
        a.buffer<FlashAttentionParams>(FA_VARLEN_BUFFER_TABLE),
        a.constant_ref<const FlashAttentionParams>(FA_VARLEN_BUFFER_PARAMS), t.thread_index_in_threadgroup);
}

constexpr const char *kSource = "Shaders/flash_attention.metal";

#define FA_KERNEL_ENTRY(T, NAME, RUN, BUFFERS)                                                     \
    {#NAME, RUN<T, NAME>, BUFFERS, sizeof(NAME##_threadgroup), kSource, 0},

// The combine and merge kernels declare no threadgroup storage.
#define FA_DTYPE_ENTRIES(T, SUFFIX)                                                                \
    {"flash_attention_merge_" #SUFFIX, run_merge<T, flash_attention_merge_##SUFFIX>,               \
     FA_MERGE_BUFFER_COUNT, 0, kSource, 0},                                                        \
        {"flash_attention_forward_combine_" #SUFFIX,                                               \
         run_forward_combine<T, flash_attention_forward_combine_##SUFFIX>,                         \
         FA_FORWARD_SPLIT_BUFFER_COUNT, 0, kSource, 0},                                            \
        {"flash_attention_backward_delta_" #SUFFIX,                                                \
         run_backward_delta<T, flash_attention_backward_delta_##SUFFIX>,                           \
         FA_BACKWARD_DELTA_BUFFER_COUNT, sizeof(flash_attention_backward_delta_##SUFFIX##_threadgroup), \
         kSource, 0},

#define FA_BUCKET_ENTRIES(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)             \
    FA_KERNEL_ENTRY(T, flash_attention_forward_##SUFFIX##_d##DP, run_forward,                      \
                    FA_FORWARD_BUFFER_COUNT)                                                       \
    FA_KERNEL_ENTRY(T, flash_attention_forward_split_##SUFFIX##_d##DP, run_forward_split,          \
                    FA_FORWARD_SPLIT_BUFFER_COUNT)                                                 \
    FA_IF_DECODE(DP, FA_KERNEL_ENTRY(T, flash_attention_forward_decode_##SUFFIX##_d##DP,           \
                                     run_forward_split, FA_FORWARD_SPLIT_BUFFER_COUNT))            \
    FA_KERNEL_ENTRY(T, flash_attention_forward_kvcache_##SUFFIX##_d##DP, run_forward_kvcache,      \
                    FA_KV_CACHE_BUFFER_COUNT)                                                      \
    FA_KERNEL_ENTRY(T, flash_attention_forward_split_kvcache_##SUFFIX##_d##DP,                     \
                    run_forward_split_kvcache, FA_KV_CACHE_BUFFER_COUNT)                           \
    FA_IF_DECODE(DP, FA_KERNEL_ENTRY(T, flash_attention_forward_decode_kvcache_##SUFFIX##_d##DP,   \
                                     run_forward_split_kvcache, FA_KV_CACHE_BUFFER_COUNT))         \
    FA_KERNEL_ENTRY(T, flash_attention_backward_lse_residual_##SUFFIX##_d##DP,                     \
                    run_backward_lse_residual, FA_BACKWARD_LSE_RESIDUAL_BUFFER_COUNT)              \
    FA_KERNEL_ENTRY(T, flash_attention_backward_dq_##SUFFIX##_d##DP, run_backward_dq,              \
                    FA_BACKWARD_DQ_BUFFER_COUNT)                                                   \
    FA_KERNEL_ENTRY(T, flash_attention_backward_dkv_##SUFFIX##_d##DP, run_backward_dkv,            \
                    FA_BACKWARD_DKV_BUFFER_COUNT)

#define FA_F16_ENTRIES(...) FA_BUCKET_ENTRIES(half, f16, __VA_ARGS__)
#define FA_BF16_ENTRIES(...) FA_BUCKET_ENTRIES(bfloat, bf16, __VA_ARGS__)
#define FA_F32_ENTRIES(...) FA_BUCKET_ENTRIES(float, f32, __VA_ARGS__)

const msl_engine::kernel_entry kTable[] = {
    {"flash_attention_backward_dsinks", run_backward_dsinks, FA_BACKWARD_DSINKS_BUFFER_COUNT,
     sizeof(flash_attention_backward_dsinks_threadgroup), kSource, 0},
    {"flash_attention_varlen_sequences", run_varlen_sequences, FA_VARLEN_BUFFER_COUNT,
     sizeof(flash_attention_varlen_sequences_threadgroup), kSource, 0},
    FA_DTYPE_ENTRIES(half, f16) FA_HEAD_DIM_BUCKETS(FA_F16_ENTRIES)
    FA_DTYPE_ENTRIES(bfloat, bf16) FA_HEAD_DIM_BUCKETS(FA_BF16_ENTRIES)
    FA_DTYPE_ENTRIES(float, f32) FA_HEAD_DIM_BUCKETS_F32(FA_F32_ENTRIES)};

} // namespace

const msl_engine::kernel_entry *msl_engine::flash_attention_kernel_table(size_t *count) {
#if defined(__x86_64__)
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
          __builtin_cpu_supports("fma"))) {
        *count = 0;
        return kTable;
    }
#endif
    *count = sizeof kTable / sizeof kTable[0];
    return kTable;
}
