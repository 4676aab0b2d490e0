// Entries that let the engine run the kernels of Shaders/flash_attention.metal, compiled here from
// the unmodified source: one per instance of the kernel catalogue (flash_attention_catalogue.h),
// binding the kernel's [[buffer(i)]] arguments and built-ins.
#include "msl_kernel_registry.hpp"

#include <initializer_list>

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

constexpr const char *kSource = "Shaders/flash_attention.metal";

// A kernel's buffer count: its largest [[buffer(i)]] index + 1.
constexpr uint32_t buffer_count(std::initializer_list<uint32_t> ends) {
    uint32_t count = 0;
    for (uint32_t end : ends) {
        count = end > count ? end : count;
    }
    return count;
}

// One catalogue kernel's arguments from the dispatch's buffers and built-ins.
#define FA_ENGINE_BUFFER(INDEX, NAME, TYPE, ACCESS, SPACE) , FA_ENGINE_BUFFER_##SPACE(INDEX, TYPE, ACCESS)
#define FA_ENGINE_BUFFER_device_memory(INDEX, TYPE, ACCESS) a.buffer<FA_ACCESS_##ACCESS TYPE>(INDEX)
#define FA_ENGINE_BUFFER_constant_memory(INDEX, TYPE, ACCESS) a.constant_ref<const TYPE>(INDEX)
#define FA_ENGINE_BUFFER_constant_array(INDEX, TYPE, ACCESS) a.buffer<const TYPE>(INDEX)
#define FA_ENGINE_BUILTIN(TYPE, NAME, ATTRIBUTE) , t.ATTRIBUTE
#define FA_ENGINE_BUFFER_END(INDEX, NAME, TYPE, ACCESS, SPACE) , (INDEX) + 1u

// The table entry of one instance (flash_attention_catalogue.h): its name, a trampoline that binds
// the kernel's [[buffer(i)]] arguments and built-ins, its buffer count and threadgroup bytes.
#define FA_ENGINE_ENTRY(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP)       \
    {FA_STRING(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)),                                     \
     [](const kernel_args &a, const builtins &t) {                                                 \
         FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)(                                            \
             FA_TAIL(0 BUFFERS(FA_ENGINE_BUFFER, T) BUILTINS(FA_ENGINE_BUILTIN)));                 \
     },                                                                                            \
     buffer_count({0u BUFFERS(FA_ENGINE_BUFFER_END, T)}),                                          \
     0 FA_IF_STORAGE(STORAGE, +sizeof(FA_CAT(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP), _threadgroup))), \
     kSource, 0},

#define FA_F16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, half, f16, DP)
#define FA_BF16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, bfloat, bf16, DP)
#define FA_F32_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, float, f32, DP)
#define FA_DTYPE_ENTRIES(T, SUFFIX) FA_KERNELS(FA_AT_DTYPE, FA_ENGINE_ENTRY, T, SUFFIX, 0)

const msl_engine::kernel_entry kTable[] = {
    FA_KERNELS(FA_AT_ONCE, FA_ENGINE_ENTRY, uchar, , 0)
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
