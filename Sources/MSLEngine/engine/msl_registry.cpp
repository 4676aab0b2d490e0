// The kernel registry (msl_kernel_registry.hpp): tables of entries looked up by name.
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

// Leaked on purpose: lookups may happen from worker threads during process exit.
std::vector<table> &tables() {
    static std::vector<table> *all = [] {
        auto *v = new std::vector<table>();
        size_t count = 0;
        const kernel_entry *entries = flash_attention_kernel_table(&count);
        v->push_back(table{entries, count});
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
