// The kernels with one instance for the CPU engine, and the table of every instance
// (flash_attention_kernels.hpp).
#include "flash_attention_kernels.hpp"

#include <vector>

FA_ENGINE_TARGET_BEGIN
FA_DEFINE_ONCE_KERNELS()
FA_ENGINE_TARGET_END

FA_ENGINE_TABLE(once, FA_KERNELS(FA_AT_ONCE, FA_ENGINE_ENTRY, uchar, , 0))

const msl_engine::kernel_entry *msl_engine::flash_attention_kernel_table(size_t *count) {
#if defined(__x86_64__)
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
          __builtin_cpu_supports("fma"))) {
        *count = 0;
        return nullptr;
    }
#endif
    // Leaked on purpose, like the registry's tables: lookups may happen during process exit.
    static const std::vector<kernel_entry> *all = [] {
        auto *entries = new std::vector<kernel_entry>();
        for (auto part : {flash_attention_kernels_once, flash_attention_kernels_f16, flash_attention_kernels_bf16,
                          flash_attention_kernels_f32, flash_attention_kernels_tensor}) {
            size_t n = 0;
            const kernel_entry *first = part(&n);
            entries->insert(entries->end(), first, first + n);
        }
        return entries;
    }();
    *count = all->size();
    return all->data();
}
