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

using ForwardKernel = void (*)(const half *, const half *, const half *, half *, float *,
                               const FlashAttentionParams &, uint3, uint, uint);
using ForwardSplitKernel = void (*)(const half *, const half *, const half *, half *, float *,
                                    const FlashAttentionParams &, float *, float *, uint3, uint,
                                    uint);
using BackwardDqKernel = void (*)(const half *, const half *, const half *, const half *,
                                  const half *, const float *, const FlashAttentionParams &,
                                  const float *, half *, uint3, uint, uint);
using BackwardDkvKernel = void (*)(const half *, const half *, const half *, const half *,
                                   const half *, const float *, const FlashAttentionParams &,
                                   const float *, half *, half *, uint3, uint, uint);
using MergeKernel = void (*)(const half *, const float *, const half *, const float *, half *, float *,
                             const FlashAttentionParams &, uint3, uint);

template <ForwardKernel Kernel>
void run_forward(const kernel_args &a, const builtins &t) {
    Kernel(a.buffer<const half>(FA_FORWARD_BUFFER_Q), a.buffer<const half>(FA_FORWARD_BUFFER_K),
           a.buffer<const half>(FA_FORWARD_BUFFER_V), a.buffer<half>(FA_FORWARD_BUFFER_OUT),
           a.buffer<float>(FA_FORWARD_BUFFER_LSE),
           a.constant_ref<const FlashAttentionParams>(FA_FORWARD_BUFFER_PARAMS),
           t.threadgroup_position_in_grid, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
}

// The buffers both split-KV forward kernels bind, in [[buffer(i)]] order up to the parameters.
#define FA_FORWARD_INPUTS(a)                                                                       \
    a.buffer<const half>(FA_FORWARD_BUFFER_Q), a.buffer<const half>(FA_FORWARD_BUFFER_K),          \
        a.buffer<const half>(FA_FORWARD_BUFFER_V), a.buffer<half>(FA_FORWARD_BUFFER_OUT),          \
        a.buffer<float>(FA_FORWARD_BUFFER_LSE),                                                    \
        a.constant_ref<const FlashAttentionParams>(FA_FORWARD_BUFFER_PARAMS)

template <ForwardSplitKernel Kernel>
void run_forward_split(const kernel_args &a, const builtins &t) {
    Kernel(FA_FORWARD_INPUTS(a), a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_OUT),
           a.buffer<float>(FA_FORWARD_BUFFER_PARTIAL_LSE), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

void run_forward_combine(const kernel_args &a, const builtins &t) {
    flash_attention_forward_combine(FA_FORWARD_INPUTS(a),
                                    a.buffer<const float>(FA_FORWARD_BUFFER_PARTIAL_OUT),
                                    a.buffer<const float>(FA_FORWARD_BUFFER_PARTIAL_LSE),
                                    t.threadgroup_position_in_grid, t.thread_index_in_threadgroup);
}

// The buffers every backward kernel binds, in [[buffer(i)]] order up to the parameters.
#define FA_BACKWARD_INPUTS(a)                                                                      \
    a.buffer<const half>(FA_BACKWARD_BUFFER_DOUT), a.buffer<const half>(FA_BACKWARD_BUFFER_Q),     \
        a.buffer<const half>(FA_BACKWARD_BUFFER_K), a.buffer<const half>(FA_BACKWARD_BUFFER_V),    \
        a.buffer<const half>(FA_BACKWARD_BUFFER_OUT),                                              \
        a.buffer<const float>(FA_BACKWARD_BUFFER_LSE),                                             \
        a.constant_ref<const FlashAttentionParams>(FA_BACKWARD_BUFFER_PARAMS)

void run_backward_delta(const kernel_args &a, const builtins &t) {
    flash_attention_backward_delta(FA_BACKWARD_INPUTS(a), a.buffer<float>(FA_BACKWARD_BUFFER_DELTA),
                                   t.threadgroup_position_in_grid, t.thread_index_in_threadgroup);
}

template <BackwardDqKernel Kernel>
void run_backward_dq(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(a), a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA),
           a.buffer<half>(FA_BACKWARD_BUFFER_DQ), t.threadgroup_position_in_grid,
           t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup);
}

template <BackwardDkvKernel Kernel>
void run_backward_dkv(const kernel_args &a, const builtins &t) {
    Kernel(FA_BACKWARD_INPUTS(a), a.buffer<const float>(FA_BACKWARD_BUFFER_DELTA),
           a.buffer<half>(FA_BACKWARD_BUFFER_DK), a.buffer<half>(FA_BACKWARD_BUFFER_DV),
           t.threadgroup_position_in_grid, t.simdgroup_index_in_threadgroup,
           t.thread_index_in_simdgroup);
}

template <MergeKernel Kernel>
void run_merge(const kernel_args &a, const builtins &t) {
    Kernel(a.buffer<const half>(FA_MERGE_BUFFER_OUT_A), a.buffer<const float>(FA_MERGE_BUFFER_LSE_A),
           a.buffer<const half>(FA_MERGE_BUFFER_OUT_B), a.buffer<const float>(FA_MERGE_BUFFER_LSE_B),
           a.buffer<half>(FA_MERGE_BUFFER_OUT), a.buffer<float>(FA_MERGE_BUFFER_LSE),
           a.constant_ref<const FlashAttentionParams>(FA_MERGE_BUFFER_PARAMS),
           t.threadgroup_position_in_grid, t.thread_index_in_threadgroup);
}

constexpr const char *kSource = "Shaders/flash_attention.metal";

#define FA_KERNEL_ENTRY(NAME, RUN, BUFFERS)                                                        \
    {#NAME, RUN<NAME>, BUFFERS, sizeof(NAME##_threadgroup), kSource, 0},

#define FA_BUCKET_ENTRIES(DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                        \
    FA_KERNEL_ENTRY(flash_attention_forward_d##DP, run_forward, FA_FORWARD_BUFFER_COUNT)           \
    FA_KERNEL_ENTRY(flash_attention_forward_split_d##DP, run_forward_split,                        \
                    FA_FORWARD_SPLIT_BUFFER_COUNT)                                                 \
    FA_KERNEL_ENTRY(flash_attention_backward_dq_d##DP, run_backward_dq,                            \
                    FA_BACKWARD_DQ_BUFFER_COUNT)                                                   \
    FA_KERNEL_ENTRY(flash_attention_backward_dkv_d##DP, run_backward_dkv,                          \
                    FA_BACKWARD_DKV_BUFFER_COUNT)

// The combine, delta and merge kernels declare no threadgroup storage.
const msl_engine::kernel_entry kTable[] = {
    {"flash_attention_forward_combine", run_forward_combine, FA_FORWARD_SPLIT_BUFFER_COUNT, 0, kSource, 0},
    {"flash_attention_backward_delta", run_backward_delta, FA_BACKWARD_DELTA_BUFFER_COUNT, 0, kSource, 0},
    {"flash_attention_merge", run_merge<flash_attention_merge>, FA_MERGE_BUFFER_COUNT, 0, kSource, 0},
    FA_HEAD_DIM_BUCKETS(FA_BUCKET_ENTRIES)};

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
