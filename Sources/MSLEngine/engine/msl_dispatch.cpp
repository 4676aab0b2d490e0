// The engine's C API (msl_engine.h): validates a dispatch, spreads its threadgroups over worker
// threads (the calling thread plus one new thread per further core) and collects the first error.
//
// Threadgroups are claimed in linear order (x fastest) from a shared counter; each worker runs
// one threadgroup at a time on its own OS thread, which is what keeps `threadgroup` variables
// (static thread_local) private to a threadgroup. Results do not depend on which worker runs a
// threadgroup, so they are deterministic for race-free kernels.
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "msl_engine.h"
#include "msl_kernel_registry.hpp"
#include "msl_text.hpp"
#include "msl_threadgroup.hpp"

namespace msl_engine {
namespace {

std::atomic<uint32_t> configured_workers{0};
thread_local msl_engine_dispatch_stats last_stats{};
thread_local bool count_device_reads = false;

uint32_t detected_cores() {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        const int n = CPU_COUNT(&set);
        if (n > 0) return uint32_t(n);
    }
#endif
    const unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? n : 1;
}

void copy_message(const std::string &text, char *message, size_t capacity) {
    if (message == nullptr || capacity == 0) return;
    const size_t n = text.size() < capacity - 1 ? text.size() : capacity - 1;
    memcpy(message, text.data(), n);
    message[n] = '\0';
}

// The first failure of a dispatch by threadgroup index, shared by its workers.
struct dispatch_outcome {
    std::mutex mutex;
    std::atomic<bool> failed{false};
    uint64_t index = UINT64_MAX;
    msl_engine_status status = MSL_ENGINE_SUCCESS;
    std::string message;
    std::atomic<bool> cancelled{false};
    std::atomic<uint64_t> completed{0};
    std::atomic<uint64_t> switches{0};
    std::atomic<uint64_t> matrix_multiplies{0};
    std::atomic<uint64_t> barriers{0};
    std::atomic<uint64_t> bytes_read[MSL_ENGINE_COUNTED_BUFFERS] = {};
    std::atomic<uint32_t> constants_read{0};

    void record(uint64_t at, msl_engine_status s, std::string text) {
        std::lock_guard<std::mutex> lock(mutex);
        failed.store(true, std::memory_order_relaxed);
        if (at < index) {
            index = at;
            status = s;
            message = std::move(text);
        }
    }
};

struct dispatch_job {
    const kernel_entry *kernel;
    kernel_args args;
    metal::uint3 groups;
    metal::uint3 threads;
    uint64_t total;
    const msl_engine_function_constant *constants;
    uint32_t constant_count;
    const msl_engine_cancellation *cancellation;
    uint64_t start_epoch;
    bool count_reads;
    std::atomic<uint64_t> next{0};
    dispatch_outcome outcome;

    bool cancel_requested() const {
        return cancellation != nullptr && msl_engine_cancellation_epoch(cancellation) != start_epoch;
    }

    void work() {
        threadgroup_runner runner;
        runner.watch(cancellation, start_epoch);
        runner.specialize(constants, constant_count, count_reads);
        std::string text;
        uint64_t done = 0;
        while (!outcome.failed.load(std::memory_order_relaxed)) {
            if (cancel_requested()) {
                outcome.cancelled.store(true, std::memory_order_relaxed);
                break;
            }
            const uint64_t i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= total) break;
            const metal::uint3 position(uint32_t(i % groups.x), uint32_t((i / groups.x) % groups.y),
                                        uint32_t(i / (uint64_t(groups.x) * groups.y)));
            const msl_engine_status s = runner.run(*kernel, args, position, threads, groups, &text);
            if (s == MSL_ENGINE_CANCELLED) {
                outcome.cancelled.store(true, std::memory_order_relaxed);
                break;
            }
            if (s != MSL_ENGINE_SUCCESS) {
                outcome.record(i, s, text);
                break;
            }
            ++done;
        }
        outcome.completed.fetch_add(done, std::memory_order_relaxed);
        outcome.switches.fetch_add(runner.switches(), std::memory_order_relaxed);
        outcome.matrix_multiplies.fetch_add(runner.matrix_multiplies(), std::memory_order_relaxed);
        outcome.barriers.fetch_add(runner.barriers(), std::memory_order_relaxed);
        for (uint32_t i = 0; i < MSL_ENGINE_COUNTED_BUFFERS; ++i) {
            outcome.bytes_read[i].fetch_add(runner.bytes_read()[i], std::memory_order_relaxed);
        }
        outcome.constants_read.fetch_or(runner.constants_read(), std::memory_order_relaxed);
    }
};

msl_engine_status validate(const kernel_entry &k, const msl_engine_buffer *buffers,
                           uint32_t buffer_count, msl_engine_size groups,
                           msl_engine_size threads, std::string *text) {
    const std::string where = format("kernel '%s' (%s)", k.name,
                                     source_location(k.file, k.line).c_str());
    if (threads.width == 0 || threads.height == 0 || threads.depth == 0) {
        *text = format("%s: threads per threadgroup (%u, %u, %u) has a zero size", where.c_str(),
                       threads.width, threads.height, threads.depth);
        return MSL_ENGINE_INVALID_DISPATCH;
    }
    if (groups.width == 0 || groups.height == 0 || groups.depth == 0) {
        *text = format("%s: threadgroups per grid (%u, %u, %u) has a zero size", where.c_str(),
                       groups.width, groups.height, groups.depth);
        return MSL_ENGINE_INVALID_DISPATCH;
    }
    const uint64_t per_group = uint64_t(threads.width) * threads.height * threads.depth;
    if (per_group > MSL_ENGINE_MAX_THREADS_PER_THREADGROUP) {
        *text = format("%s: %llu threads per threadgroup (%u x %u x %u) exceed the limit of %u",
                       where.c_str(), (unsigned long long)per_group, threads.width, threads.height,
                       threads.depth, MSL_ENGINE_MAX_THREADS_PER_THREADGROUP);
        return MSL_ENGINE_INVALID_DISPATCH;
    }
    if (k.threadgroup_memory_length > MSL_ENGINE_MAX_THREADGROUP_MEMORY) {
        *text = format("%s declares %zu bytes of threadgroup memory; the limit is %u bytes (32 KiB)",
                       where.c_str(), k.threadgroup_memory_length,
                       MSL_ENGINE_MAX_THREADGROUP_MEMORY);
        return MSL_ENGINE_THREADGROUP_MEMORY_EXCEEDED;
    }
    if (buffer_count < k.buffer_count || (k.buffer_count > 0 && buffers == nullptr)) {
        *text = format("%s reads %u buffers but the dispatch binds %u", where.c_str(),
                       k.buffer_count, buffers == nullptr ? 0u : buffer_count);
        return MSL_ENGINE_INVALID_DISPATCH;
    }
    for (uint32_t i = 0; i < k.buffer_count; ++i) {
        if (buffers[i].contents == nullptr) {
            *text = format("%s: buffer %u is null", where.c_str(), i);
            return MSL_ENGINE_INVALID_DISPATCH;
        }
    }
    return MSL_ENGINE_SUCCESS;
}

msl_engine_status validate_constants(const kernel_entry &k, const msl_engine_function_constant *constants,
                                     uint32_t count, std::string *text) {
    const std::string where = format("kernel '%s' (%s)", k.name,
                                     source_location(k.file, k.line).c_str());
    if (count > MSL_ENGINE_MAX_FUNCTION_CONSTANTS || (count > 0 && constants == nullptr)) {
        *text = format("%s: %u function constants%s; at most %u are allowed", where.c_str(), count,
                       constants == nullptr ? " and no list" : "", MSL_ENGINE_MAX_FUNCTION_CONSTANTS);
        return MSL_ENGINE_INVALID_DISPATCH;
    }
    for (uint32_t i = 0; i < count; ++i) {
        const msl_engine_function_constant &c = constants[i];
        if (c.type != MSL_ENGINE_CONSTANT_BOOL && c.type != MSL_ENGINE_CONSTANT_UINT) {
            *text = format("%s: function constant %u has unknown type %u", where.c_str(), c.index, c.type);
            return MSL_ENGINE_INVALID_DISPATCH;
        }
        if (c.type == MSL_ENGINE_CONSTANT_BOOL && c.value > 1) {
            *text = format("%s: bool function constant %u has value %u; a bool is 0 or 1", where.c_str(),
                           c.index, c.value);
            return MSL_ENGINE_INVALID_DISPATCH;
        }
        for (uint32_t j = 0; j < i; ++j) {
            if (constants[j].index == c.index) {
                *text = format("%s: function constant %u is set twice", where.c_str(), c.index);
                return MSL_ENGINE_INVALID_DISPATCH;
            }
        }
    }
    return MSL_ENGINE_SUCCESS;
}

} // namespace
} // namespace msl_engine

using namespace msl_engine;

extern "C" uint64_t msl_engine_cancellation_epoch(const msl_engine_cancellation *cancellation) {
    return __atomic_load_n(&cancellation->epoch, __ATOMIC_ACQUIRE);
}

extern "C" void msl_engine_cancel(msl_engine_cancellation *cancellation) {
    __atomic_fetch_add(&cancellation->epoch, 1, __ATOMIC_RELEASE);
}

extern "C" msl_engine_status msl_engine_dispatch(const char *kernel_name,
                                                 const msl_engine_buffer *buffers,
                                                 uint32_t buffer_count,
                                                 msl_engine_size threadgroups_per_grid,
                                                 msl_engine_size threads_per_threadgroup,
                                                 char *message, size_t message_capacity) {
    return msl_engine_dispatch_cancellable(kernel_name, buffers, buffer_count, threadgroups_per_grid,
                                           threads_per_threadgroup, nullptr, 0, message,
                                           message_capacity);
}

extern "C" msl_engine_status msl_engine_dispatch_cancellable(
    const char *kernel_name, const msl_engine_buffer *buffers, uint32_t buffer_count,
    msl_engine_size threadgroups_per_grid, msl_engine_size threads_per_threadgroup,
    const msl_engine_cancellation *cancellation, uint64_t start_epoch, char *message,
    size_t message_capacity) {
    return msl_engine_dispatch_specialized(kernel_name, buffers, buffer_count, nullptr, 0,
                                           threadgroups_per_grid, threads_per_threadgroup,
                                           cancellation, start_epoch, message, message_capacity);
}

extern "C" msl_engine_status msl_engine_dispatch_specialized(
    const char *kernel_name, const msl_engine_buffer *buffers, uint32_t buffer_count,
    const msl_engine_function_constant *constants, uint32_t constant_count,
    msl_engine_size threadgroups_per_grid, msl_engine_size threads_per_threadgroup,
    const msl_engine_cancellation *cancellation, uint64_t start_epoch, char *message,
    size_t message_capacity) {
    const auto start = std::chrono::steady_clock::now();
    last_stats = msl_engine_dispatch_stats{};
    copy_message(std::string(), message, message_capacity);
    const kernel_entry *kernel = kernel_name == nullptr ? nullptr : find_kernel(kernel_name);
    if (kernel == nullptr) {
        copy_message(kernel_name == nullptr
                         ? std::string("kernel name is null")
                         : format("unknown kernel '%s': no kernel of that name is registered",
                                  kernel_name),
                     message, message_capacity);
        return MSL_ENGINE_UNKNOWN_KERNEL;
    }
    std::string text;
    msl_engine_status invalid = validate(*kernel, buffers, buffer_count, threadgroups_per_grid,
                                         threads_per_threadgroup, &text);
    if (invalid == MSL_ENGINE_SUCCESS) {
        invalid = validate_constants(*kernel, constants, constant_count, &text);
    }
    if (invalid != MSL_ENGINE_SUCCESS) {
        copy_message(text, message, message_capacity);
        return invalid;
    }

    dispatch_job job;
    job.kernel = kernel;
    job.args = kernel_args{buffers, buffer_count};
    job.groups = metal::uint3(threadgroups_per_grid.width, threadgroups_per_grid.height,
                              threadgroups_per_grid.depth);
    job.threads = metal::uint3(threads_per_threadgroup.width, threads_per_threadgroup.height,
                               threads_per_threadgroup.depth);
    job.total = uint64_t(job.groups.x) * job.groups.y * job.groups.z;
    job.constants = constants;
    job.constant_count = constant_count;
    job.cancellation = cancellation;
    job.start_epoch = start_epoch;
    job.count_reads = count_device_reads;

    uint64_t wanted = msl_engine_worker_count();
    if (wanted > job.total) wanted = job.total;
    std::vector<std::thread> helpers;
    for (uint64_t w = 1; w < wanted; ++w) {
        try {
            helpers.emplace_back([&job] { job.work(); });
        } catch (const std::system_error &) {
            break; // fewer workers still finish the dispatch
        }
    }
    job.work();
    for (std::thread &t : helpers) t.join();

    last_stats.workers = uint32_t(helpers.size() + 1);
    last_stats.threadgroups = job.outcome.completed.load();
    last_stats.fiber_switches = job.outcome.switches.load();
    last_stats.simdgroup_multiply_accumulates = job.outcome.matrix_multiplies.load();
    last_stats.threadgroup_barriers = job.outcome.barriers.load();
    for (uint32_t i = 0; i < MSL_ENGINE_COUNTED_BUFFERS; ++i) {
        last_stats.device_bytes_read[i] = job.outcome.bytes_read[i].load();
    }
    last_stats.function_constants_read = job.outcome.constants_read.load();
    last_stats.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (job.outcome.failed.load()) {
        copy_message(job.outcome.message, message, message_capacity);
        return job.outcome.status;
    }
    if (job.outcome.cancelled.load() && last_stats.threadgroups < job.total) {
        copy_message(format("kernel '%s' cancelled after %llu of %llu threadgroups", kernel->name,
                            (unsigned long long)last_stats.threadgroups,
                            (unsigned long long)job.total),
                     message, message_capacity);
        return MSL_ENGINE_CANCELLED;
    }
    return MSL_ENGINE_SUCCESS;
}

extern "C" int msl_engine_has_kernel(const char *kernel_name) {
    return kernel_name != nullptr && find_kernel(kernel_name) != nullptr;
}

extern "C" const char *msl_engine_kernel_name(size_t index) {
    const kernel_entry *k = kernel_at(index);
    return k == nullptr ? nullptr : k->name;
}

extern "C" int msl_engine_describe_kernel(const char *kernel_name, msl_engine_kernel_info *info) {
    const kernel_entry *k = kernel_name == nullptr ? nullptr : find_kernel(kernel_name);
    if (k == nullptr || info == nullptr) return 0;
    *info = msl_engine_kernel_info{k->buffer_count, k->threadgroup_memory_length, k->file, k->line};
    return 1;
}

extern "C" uint32_t msl_engine_worker_count(void) {
    const uint32_t configured = configured_workers.load();
    return configured > 0 ? configured : detected_cores();
}

extern "C" void msl_engine_set_worker_count(uint32_t workers) { configured_workers.store(workers); }

extern "C" void msl_engine_count_device_reads(int enabled) { count_device_reads = enabled != 0; }

extern "C" void msl_engine_last_dispatch_stats(msl_engine_dispatch_stats *stats) {
    if (stats != nullptr) *stats = last_stats;
}
