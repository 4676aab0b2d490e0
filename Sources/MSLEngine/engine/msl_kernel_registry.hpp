// The registry contract between kernel translation units and the engine: each kernel compiled
// from MSL gets an entry (name, a function that binds its buffers and built-ins, its buffer count,
// its threadgroup memory size, its source location); tables of entries are registered with the
// engine and looked up by name at dispatch.
#ifndef MSL_KERNEL_REGISTRY_HPP
#define MSL_KERNEL_REGISTRY_HPP

#include <stddef.h>
#include <stdint.h>

#include "msl_engine.h"
#include "msl_vector_types.h"

namespace msl_engine {

/// The dispatch's buffers, as bound with [[buffer(i)]]; the engine has checked that at least the
/// kernel entry's buffer_count buffers are present and non-null.
struct kernel_args {
    const msl_engine_buffer *buffers;
    uint32_t buffer_count;

    /// Buffer `index`'s contents as T * (for `device T *p [[buffer(index)]]`).
    template <class T> T *buffer(uint32_t index) const {
        return static_cast<T *>(buffers[index].contents);
    }
    /// Buffer `index`'s contents as T & (for `constant T &p [[buffer(index)]]`).
    template <class T> T &constant_ref(uint32_t index) const {
        return *static_cast<T *>(buffers[index].contents);
    }
    /// Buffer `index`'s length in bytes.
    size_t length(uint32_t index) const { return buffers[index].length; }
};

/// Metal's kernel built-ins (MSL specification 5.2.3.6) for the thread being run.
struct builtins {
    metal::uint3 threadgroup_position_in_grid, thread_position_in_threadgroup,
        thread_position_in_grid, threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
    uint32_t thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
        threads_per_simdgroup, simdgroups_per_threadgroup;
};

/// Runs the kernel for one thread: binds args and built-ins to the MSL kernel's parameters.
using kernel_function = void (*)(const kernel_args &, const builtins &);

/// One kernel the engine can dispatch.
struct kernel_entry {
    const char *name;   ///< the kernel's name, as dispatched (e.g. "flash_attention_forward_d64")
    kernel_function run;
    uint32_t buffer_count;            ///< buffers the kernel reads: indices 0..buffer_count-1
    size_t threadgroup_memory_length; ///< bytes of `threadgroup` storage the kernel declares
    const char *file;                 ///< where the kernel is defined (for messages)
    unsigned line;
};

/// The attention kernels' table, defined in flash_attention_kernels.cpp (no static-init magic).
const kernel_entry *flash_attention_kernel_table(size_t *count);

/// Registers further tables (test kernels). Thread-safe; registering the same table again is a
/// no-op. Entries must outlive the process's use of the engine (static tables). A name that is
/// already registered keeps its first entry.
void register_kernels(const kernel_entry *entries, size_t count);

/// The index-th registered entry (tables in registration order), or null past the last one.
const kernel_entry *kernel_at(size_t index);

/// The entry named `name`, or null. The attention kernels' table is always registered.
const kernel_entry *find_kernel(const char *name);

} // namespace msl_engine

#endif
