// Runs one threadgroup at a time on the calling OS thread with Metal's execution model: one fiber
// per thread, threadgroup barriers, SIMD-groups of 32 lanes with collective operations, and the
// divergence checks that turn a kernel bug into an error instead of a hang.
#ifndef MSL_THREADGROUP_HPP
#define MSL_THREADGROUP_HPP

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "msl_engine.h"
#include "msl_fiber.hpp"
#include "msl_kernel_registry.hpp"
#include "msl_runtime.hpp"

namespace msl_engine {

struct lane;

/// Where a lane calls a SIMD-group function: the operation, its combine function, the call site.
struct simd_site {
    const char *operation;
    simd_combine_fn combine;
    const char *file;
    unsigned line;
};

/// Executes threadgroups of kernels on the calling OS thread. One runner per worker thread; it
/// keeps its fiber stacks between threadgroups and gives them back to the cache when destroyed.
/// Not thread-safe: a runner belongs to one OS thread. Hidden: the engine's own calls to it are
/// direct, not through the dynamic linker's table.
class __attribute__((visibility("hidden"))) threadgroup_runner {
  public:
    threadgroup_runner();
    ~threadgroup_runner();
    threadgroup_runner(const threadgroup_runner &) = delete;
    threadgroup_runner &operator=(const threadgroup_runner &) = delete;

    /// Runs threadgroup `position` of a grid of `groups` threadgroups of `threads` threads each
    /// (all sizes non-zero, at most 1024 threads: the caller validated them). On failure returns
    /// the status and sets *message (naming kernel, threadgroup and source line). The runner is
    /// usable again afterwards: fibers of a failed threadgroup are abandoned, their stacks reused.
    msl_engine_status run(const kernel_entry &kernel, const kernel_args &args, metal::uint3 position,
                          metal::uint3 threads, metal::uint3 groups, std::string *message);

    /// From now on run() stops a threadgroup part-way once the epoch of `cancellation` differs from
    /// `start_epoch` (null: never): it returns MSL_ENGINE_CANCELLED and abandons the fibers as after
    /// an error. Checked every few dozen fiber switches.
    void watch(const msl_engine_cancellation *cancellation, uint64_t start_epoch) {
        cancellation_ = cancellation;
        start_epoch_ = start_epoch;
    }

    /// From now on run() gives the kernel these function constant values (valid while it runs;
    /// the dispatch validated them), and counts the kernel's device reads or not. Resets the
    /// calling OS thread's cache of constants (msl_runtime.hpp), which the destructor clears.
    void specialize(const msl_engine_function_constant *constants, uint32_t count, bool count_reads);

    /// The value of function constant `index` of `type` for lane `l`, entered in the cache; fails
    /// the threadgroup and parks the lane for good when the dispatch does not set it so
    /// (runtime::function_constant).
    uint32_t read_function_constant(lane &l, uint32_t index, uint32_t type, const char *name);

    /// The lane (kernel thread) running now, null between threadgroups.
    lane *running() const { return running_; }

    /// Bit i: constants[i] of specialize() was read so far.
    uint32_t constants_read() const { return constants_read_; }

    /// Fiber switches done so far (each switch from one context to another counts one).
    uint64_t switches() const { return switches_; }
    /// 8x8x8 SIMD-group matrix multiply-accumulates completed so far (one per SIMD-group call).
    uint64_t matrix_multiplies() const { return matrix_multiplies_; }
    /// Threadgroup barriers released so far (one per threadgroup and barrier).
    uint64_t barriers() const { return barriers_; }
    /// Bytes read so far from each of the first MSL_ENGINE_COUNTED_BUFFERS buffers.
    const uint64_t *bytes_read() const { return bytes_read_; }
    /// Counts a read of `bytes` at `address` against the running threadgroup's buffer holding it.
    void count_read(const void *address, size_t bytes);

    /// Called by lane `l` (running) at a barrier once it has recorded where it waits (state
    /// at_barrier, site), or at a collective with its site and its part (input, output,
    /// argument): does the bookkeeping and continues the next runnable lane directly, or the
    /// scheduler when none can run; returns when `l` is resumed (the collective done).
    void suspend_at_barrier(lane &l);
    void suspend_at_collective(lane &l, const simd_site &site, const void *in, void *out, uint32_t arg);

  private:
    struct simd_group {
        uint32_t first_thread = 0; ///< thread index of lane 0
        uint32_t active = 0;       ///< lanes that exist and have not returned
        uint32_t arrived = 0;      ///< lanes waiting at the pending collective
        bool counted = false;      ///< the pending collective is a matrix multiply-accumulate
        const char *operation = nullptr;
        const char *file = nullptr;
        unsigned line = 0;
        simd_combine_fn combine = nullptr;  ///< of the pending (or last) collective
        simd_combine_fn counted_for = nullptr; ///< the combine function `counted` was decided for
        simd_slot slots[32];       ///< the arrived lanes' parts of the pending collective
    };

    friend struct lane;
    static void lane_main(void *arg);

    bool prepare(uint32_t count);
    void make_ready(uint32_t thread);
    lane *next_ready();
    void switch_from(lane &l);
    void on_return(lane &l);
    void on_barrier(lane &l);
    void on_simd(lane &l, const simd_site &site, const void *in, void *out, uint32_t arg);
    [[gnu::cold, gnu::noinline]] void simd_mismatch(const lane &l, const char *operation,
                                                    const char *file, unsigned line,
                                                    const simd_group &g);
    void complete(simd_group &g);
    void diagnose_stall();
    void fail(msl_engine_status status, const std::string &what);
    std::string describe_wait(const lane &l) const;

    fiber scheduler_;
    std::unique_ptr<lane[]> lanes_;
    uint32_t lane_capacity_ = 0;
    std::vector<fiber_stack> stacks_;
    std::vector<simd_group> groups_;
    std::vector<uint32_t> ready_; ///< ring buffer of runnable thread indices (size a power of 2)
    uint32_t ready_head_ = 0, ready_count_ = 0, ready_mask_ = 0;
    /// Runnable lanes ahead of the ring: bit i is lane burst_first_ + i, lowest first (the lanes
    /// of the last completed collective, resumed without a trip through the ring).
    uint32_t burst_ = 0, burst_first_ = 0;
    lane *running_ = nullptr;        ///< the lane running now (current_lane, msl_threadgroup.cpp)
    fiber *switch_source_ = nullptr; ///< the context that switched to a starting lane (ASan)
    uint64_t until_poll_ = 0;        ///< switches until the next cancellation poll

    const kernel_entry *kernel_ = nullptr;
    const kernel_args *args_ = nullptr;
    metal::uint3 position_;
    uint32_t count_ = 0;
    uint32_t returned_ = 0;
    uint32_t barrier_waiting_ = 0;
    const char *barrier_file_ = nullptr;
    unsigned barrier_line_ = 0;
    uint32_t barrier_first_thread_ = 0;
    msl_engine_status status_ = MSL_ENGINE_SUCCESS;
    std::string message_;
    uint64_t switches_ = 0;
    uint64_t matrix_multiplies_ = 0;
    uint64_t barriers_ = 0;
    uint64_t bytes_read_[MSL_ENGINE_COUNTED_BUFFERS] = {};
    const msl_engine_cancellation *cancellation_ = nullptr;
    uint64_t start_epoch_ = 0;
    const msl_engine_function_constant *constants_ = nullptr;
    uint32_t constant_count_ = 0;
    uint32_t constants_read_ = 0;
};

} // namespace msl_engine

#endif
