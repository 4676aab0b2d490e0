// The kernel registry (msl_kernel_registry.hpp): tables of entries looked up by name.
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "msl_kernel_registry.hpp"

namespace msl_engine {
namespace {

struct table {
    const kernel_entry *entries;
    size_t count;
};

std::mutex registry_mutex;

// Test hook (tests/python/kernels/test_planted_faults.py, docs/testing.md): the environment variable
// MSL_ENGINE_KERNELS_OVERRIDE names a shared object built from an edited copy of the kernels that
// exports `const kernel_entry *msl_engine_kernels_override(size_t *count)`; its table replaces the
// built-in one for the whole process. One that cannot be loaded leaves no attention kernel at all,
// so every dispatch fails: a test run never falls back to the unedited kernels unnoticed.
constexpr const char *kOverrideVariable = "MSL_ENGINE_KERNELS_OVERRIDE";

table attention_kernels() {
    size_t count = 0;
    const char *path = getenv(kOverrideVariable);
    if (path == nullptr || *path == '\0') {
        const kernel_entry *entries = flash_attention_kernel_table(&count);
        return table{entries, count};
    }
    using table_function = const kernel_entry *(*)(size_t *);
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    void *symbol = handle ? dlsym(handle, "msl_engine_kernels_override") : nullptr;
    auto function = reinterpret_cast<table_function>(symbol);
    if (function == nullptr) {
        return table{nullptr, 0};
    }
    const kernel_entry *entries = function(&count);
    return table{entries, count};
}

// Leaked on purpose: lookups may happen from worker threads during process exit.
std::vector<table> &tables() {
    static std::vector<table> *all = [] {
        auto *v = new std::vector<table>();
        v->push_back(attention_kernels());
        return v;
    }();
    return *all;
}

} // namespace

void register_kernels(const kernel_entry *entries, size_t count) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const table &t : tables()) {
        if (t.entries == entries) return;
    }
    tables().push_back(table{entries, count});
}

const kernel_entry *find_kernel(const char *name) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const table &t : tables()) {
        for (size_t i = 0; i < t.count; ++i) {
            if (strcmp(t.entries[i].name, name) == 0) return &t.entries[i];
        }
    }
    return nullptr;
}

const kernel_entry *kernel_at(size_t index) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const table &t : tables()) {
        if (index < t.count) return &t.entries[index];
        index -= t.count;
    }
    return nullptr;
}

} // namespace msl_engine
