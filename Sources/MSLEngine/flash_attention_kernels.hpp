// The CPU engine's build of the kernels of Shaders/: the headers that flash_attention.metal
// instantiates, compiled unmodified as C++ one translation unit per dtype (flash_attention_kernels_
// f16/bf16/f32.cpp, and flash_attention_kernels.cpp for the kernels with one instance), so that
// they build in parallel. Each defines its instances between FA_ENGINE_TARGET_BEGIN and
// FA_ENGINE_TARGET_END and their table with FA_ENGINE_TABLE, one entry per instance of the kernel
// catalogue (flash_attention_catalogue.h) that binds the kernel's [[buffer(i)]] arguments and
// built-ins.
#ifndef MSL_ENGINE_FLASH_ATTENTION_KERNELS_HPP
#define MSL_ENGINE_FLASH_ATTENTION_KERNELS_HPP

#include "msl_kernel_registry.hpp"

#include <initializer_list>

// On x86-64 the kernels are compiled for AVX2/F16C/FMA: without F16C every half<->float
// conversion is a library call and the engine runs about ten times slower. The table is empty on a
// CPU without those features, so the CPU backend reports that instead of faulting.
#if defined(__x86_64__)
#define FA_ENGINE_TARGET_BEGIN                                                                     \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,f16c,fma\"))), apply_to = function)")
#define FA_ENGINE_TARGET_END _Pragma("clang attribute pop")
#else
#define FA_ENGINE_TARGET_BEGIN
#define FA_ENGINE_TARGET_END
#endif

#include <metal_stdlib>

using namespace metal;

FA_ENGINE_TARGET_BEGIN
#include "../../Shaders/flash_attention_kernels.h"
FA_ENGINE_TARGET_END

namespace msl_engine {

// The table of one translation unit's instances.
const kernel_entry *flash_attention_kernels_once(size_t *count);
const kernel_entry *flash_attention_kernels_f16(size_t *count);
const kernel_entry *flash_attention_kernels_bf16(size_t *count);
const kernel_entry *flash_attention_kernels_f32(size_t *count);
const kernel_entry *flash_attention_kernels_tensor(size_t *count);

namespace flash_attention {

constexpr const char *kSource = "Shaders/flash_attention.metal";

// A kernel's buffer count: its largest [[buffer(i)]] index + 1.
constexpr uint32_t buffer_count(std::initializer_list<uint32_t> ends) {
    uint32_t count = 0;
    for (uint32_t end : ends) {
        count = end > count ? end : count;
    }
    return count;
}

} // namespace flash_attention
} // namespace msl_engine

// One catalogue kernel's arguments from the dispatch's buffers and built-ins.
#define FA_ENGINE_BUFFER(INDEX, NAME, TYPE, ACCESS, SPACE) , FA_ENGINE_BUFFER_##SPACE(INDEX, TYPE, ACCESS)
#define FA_ENGINE_BUFFER_device_memory(INDEX, TYPE, ACCESS) a.buffer<FA_ACCESS_##ACCESS TYPE>(INDEX)
#define FA_ENGINE_BUFFER_constant_memory(INDEX, TYPE, ACCESS) a.constant_ref<const TYPE>(INDEX)
#define FA_ENGINE_BUFFER_constant_array(INDEX, TYPE, ACCESS) a.buffer<const TYPE>(INDEX)
#define FA_ENGINE_BUILTIN(TYPE, NAME, ATTRIBUTE) , t.ATTRIBUTE
#define FA_ENGINE_BUFFER_END(INDEX, NAME, TYPE, ACCESS, SPACE) , (INDEX) + 1u

// The table entry of one instance: its name, a trampoline that binds its arguments, its buffer
// count and threadgroup bytes.
#define FA_ENGINE_ENTRY(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP)       \
    {FA_STRING(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)),                                     \
     [](const msl_engine::kernel_args &a, const msl_engine::builtins &t) {                         \
         FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)(                                            \
             FA_TAIL(0 BUFFERS(FA_ENGINE_BUFFER, T) BUILTINS(FA_ENGINE_BUILTIN)));                 \
     },                                                                                            \
     msl_engine::flash_attention::buffer_count({0u BUFFERS(FA_ENGINE_BUFFER_END, T)}),             \
     0 FA_IF_STORAGE(STORAGE, +sizeof(FA_CAT(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP), _threadgroup))), \
     msl_engine::flash_attention::kSource, 0},

// msl_engine::flash_attention_kernels_<PART>: the table of ENTRIES.
#define FA_ENGINE_TABLE(PART, ...)                                                                 \
    namespace {                                                                                    \
    const msl_engine::kernel_entry kTable[] = {__VA_ARGS__};                                       \
    }                                                                                              \
    const msl_engine::kernel_entry *msl_engine::flash_attention_kernels_##PART(size_t *count) {    \
        *count = sizeof kTable / sizeof kTable[0];                                                 \
        return kTable;                                                                             \
    }

// The entries of the instances per dtype and per bucket of dtype T.
#define FA_ENGINE_DTYPE_ENTRIES(T, SUFFIX) FA_KERNELS(FA_AT_DTYPE, FA_ENGINE_ENTRY, T, SUFFIX, 0)
#define FA_ENGINE_F16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, half, f16, DP)
#define FA_ENGINE_BF16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, bfloat, bf16, DP)
#define FA_ENGINE_F32_ENTRIES(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_ENGINE_ENTRY, float, f32, DP)

#endif
