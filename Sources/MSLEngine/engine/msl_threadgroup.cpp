// The threadgroup scheduler (see msl_threadgroup.hpp) and the runtime entry points that
// <metal_stdlib> calls from kernel code (msl_runtime.hpp).
//
// Scheduling: runnable threads run in queue order until they block (barrier or SIMD collective)
// or return. A blocking or returning lane does the bookkeeping itself and switches straight to
// the next runnable lane (one switch, no round trip through the scheduler, whose context is
// entered only to start and when nothing can run); the last lane to reach a collective runs it
// for its SIMD-group. The queue starts in thread index order; a barrier's release appends every
// thread in index order; a completed collective puts its SIMD-group's lanes first, in lane order,
// so one SIMD-group runs from collective to collective while its lanes' stacks are in cache (MSL
// orders nothing between SIMD-groups short of a barrier). A barrier releases when all threads of the threadgroup wait at the same call site;
// a collective completes when all active lanes of the SIMD-group wait at the same call site.
// Every divergence the MSL rules forbid is reported as soon as it is certain: a thread reaching a
// barrier at another site than the threads already waiting, a thread returning while others wait
// at a barrier (or reaching a barrier after another returned), lanes calling different
// collectives; and when nothing can run any more but threads still wait (lanes of a SIMD-group
// split between a collective and a barrier), the stall is reported with every waiting site.
// The order is fixed, so runs are deterministic.
#include "msl_threadgroup.hpp"

#include <string.h>

#include "msl_text.hpp"

namespace msl_engine {

// faulted: stopped for good by an error found in the lane itself (an unset function constant).
// A lane waiting at a collective stays `ready`: its SIMD-group's arrived mask says it waits.
enum class lane_state : uint8_t { ready, at_barrier, returned, faulted };

/// One thread of the threadgroup being run. What a collective touches comes first, in the lane's
/// first cache line (lanes_ is aligned to one): a SIMD-group's round of a collective visits 32 lanes.
struct alignas(64) lane {
    fiber context;
    threadgroup_runner::simd_group *simd = nullptr; ///< its SIMD-group's state (groups_[group])
    threadgroup_runner *runner = nullptr;
    uint32_t lane_id = 0;
    lane_state state = lane_state::ready;
    uint32_t thread = 0;
    uint32_t group = 0;
    // Where the lane waits at a barrier (at a collective its SIMD-group's state says where).
    const char *operation = nullptr;
    const char *file = nullptr;
    unsigned line = 0;
    builtins ids;
};

} // namespace msl_engine

__thread msl_engine::runtime::constant_cache msl_engine_constant_cache;
__thread msl_engine::runtime::read_counting msl_engine_read_counting;

namespace msl_engine {
namespace {

// The runner of the calling OS thread while it runs a threadgroup; its running_ lane is the
// calling thread of the kernel. A lane switch is a store to running_, not to thread-local storage
// (in a shared library each access to that is a call to __tls_get_addr).
thread_local threadgroup_runner *current_runner = nullptr;

// The kernel thread calling into the engine, or null outside a dispatch: on a lane's stack, the
// lane its first fiber word names (run() writes it), with no thread-local read; elsewhere (a stack
// outside the reserved range) the runner's running lane.
__attribute__((always_inline)) inline lane *current_lane() {
    if (void **locals = fiber_locals()) return static_cast<lane *>(locals[0]);
    const threadgroup_runner *r = current_runner;
    return r == nullptr ? nullptr : r->running();
}

// A threadgroup of the attention kernels makes thousands of switches per key block, and a poll is
// one atomic load: this keeps it off the profile while a cancel still lands within microseconds.
constexpr uint64_t kCancelPollSwitches = 64;

bool same_site(const char *file_a, unsigned line_a, const char *file_b, unsigned line_b) {
    return line_a == line_b && (file_a == file_b || strcmp(file_a, file_b) == 0);
}

std::string fault_text(const simd_fault &f) {
    switch (f.kind) {
    case simd_fault_kind::inactive_source:
        return format("lane %u reads lane %u, which is inactive (past the end of a partial "
                      "SIMD-group, or returned); MSL leaves that value undefined",
                      f.lane, f.source);
    case simd_fault_kind::invalid_lane:
        return format("lane %u asks for lane %u; SIMD lane IDs are 0..31", f.lane, f.source);
    case simd_fault_kind::nonuniform_lane:
        return format("lane %u broadcasts from lane %u while a lower lane names another source "
                      "lane; the source lane must be the same in every lane",
                      f.lane, f.source);
    case simd_fault_kind::partial_matrix:
        return format("simdgroup_matrix operations need all 32 lanes of the SIMD-group, and "
                      "lane %u is inactive (past the end of a partial SIMD-group, or returned)",
                      f.lane);
    }
    return "unknown fault";
}

// A collective outside a dispatch: the caller is lane 0 of a one-lane SIMD-group. Out of line, so
// that its slots do not enlarge the frame of every collective.
[[gnu::noinline, gnu::cold]] void lone_collective(simd_combine_fn combine, const void *in, void *out,
                                                  uint32_t arg) {
    simd_slot slots[32] = {};
    slots[0] = simd_slot{in, out, arg};
    simd_fault ignored{};
    combine(slots, 1u, &ignored);
}

} // namespace

threadgroup_runner::threadgroup_runner() = default;

threadgroup_runner::~threadgroup_runner() {
    specialize(nullptr, 0, false);
    release_fiber_stacks(stacks_.data(), stacks_.size());
}

void threadgroup_runner::specialize(const msl_engine_function_constant *constants, uint32_t count,
                                    bool count_reads) {
    constants_ = constants;
    constant_count_ = count;
    msl_engine_constant_cache.known[0] = 0;
    msl_engine_constant_cache.known[1] = 0;
    msl_engine_read_counting.on = count_reads;
}

void threadgroup_runner::lane_main(void *arg) {
    lane *l = static_cast<lane *>(arg);
    threadgroup_runner *runner = l->runner;
    fiber_started(*runner->switch_source_);
    runner->kernel_->run(*runner->args_, l->ids);
    l->state = lane_state::returned;
    runner->on_return(*l);
    lane *next = runner->next_ready();
    runner->running_ = next;
    runner->switch_source_ = &l->context;
    ++runner->switches_;
    fiber_exit(l->context, next != nullptr ? next->context : runner->scheduler_);
}

__attribute__((always_inline)) inline lane *threadgroup_runner::next_ready() {
    if (status_ != MSL_ENGINE_SUCCESS || (burst_ == 0 && ready_count_ == 0)) return nullptr;
    if (cancellation_ != nullptr && --until_poll_ == 0) {
        until_poll_ = kCancelPollSwitches;
        if (msl_engine_cancellation_epoch(cancellation_) != start_epoch_) {
            status_ = MSL_ENGINE_CANCELLED;
            message_ = format("kernel '%s': threadgroup (%u, %u, %u) cancelled", kernel_->name,
                              position_.x, position_.y, position_.z);
            return nullptr;
        }
    }
    if (burst_ != 0) {
        const uint32_t i = uint32_t(__builtin_ctz(burst_));
        burst_ &= burst_ - 1;
        return &lanes_[burst_first_ + i];
    }
    lane *next = &lanes_[ready_[ready_head_]];
    ready_head_ = (ready_head_ + 1) & ready_mask_;
    --ready_count_;
    return next;
}

__attribute__((always_inline)) inline void threadgroup_runner::switch_from(lane &l) {
    lane *next = next_ready();
    if (next == &l) return; // it completed a collective and runs on
    running_ = next;
    switch_source_ = &l.context;
    ++switches_;
    if (next != nullptr) {
        fiber_hop(l.context, next->context); // lanes share the default floating-point state
    } else {
        fiber_switch(l.context, scheduler_);
    }
    // Resumed by another lane or the scheduler, which set running_ to this lane.
}

void threadgroup_runner::suspend_at_barrier(lane &l) {
    on_barrier(l);
    switch_from(l);
}

// Inlined into runtime::simd_collective, its one caller: a collective is one call.
__attribute__((always_inline)) inline void threadgroup_runner::suspend_at_collective(
    lane &l, const simd_site &site, const void *in, void *out, uint32_t arg) {
    on_simd(l, site, in, out, arg);
    switch_from(l);
}

bool threadgroup_runner::prepare(uint32_t count) {
    if (count > lane_capacity_) {
        lanes_.reset(new lane[count]);
        lane_capacity_ = count;
    }
    while (stacks_.size() < count) {
        const fiber_stack s = acquire_fiber_stack();
        if (s.base == nullptr) return false;
        stacks_.push_back(s);
    }
    uint32_t ring = 1;
    while (ring < count) ring *= 2;
    if (ready_.size() < ring) ready_.resize(ring);
    return true;
}

void threadgroup_runner::make_ready(uint32_t thread) {
    lanes_[thread].state = lane_state::ready;
    ready_[(ready_head_ + ready_count_) & ready_mask_] = thread;
    ++ready_count_;
}

msl_engine_status threadgroup_runner::run(const kernel_entry &kernel, const kernel_args &args,
                                          metal::uint3 position, metal::uint3 threads,
                                          metal::uint3 groups, std::string *message) {
    const uint32_t count = threads.x * threads.y * threads.z;
    if (!prepare(count)) {
        *message = format("kernel '%s': cannot map %u fiber stacks for a threadgroup", kernel.name,
                          count);
        return MSL_ENGINE_OUT_OF_MEMORY;
    }
    kernel_ = &kernel;
    args_ = &args;
    position_ = position;
    count_ = count;
    returned_ = 0;
    barrier_waiting_ = 0;
    status_ = MSL_ENGINE_SUCCESS;
    message_.clear();
    ready_head_ = 0;
    ready_count_ = 0;
    burst_ = 0;
    ready_mask_ = uint32_t(ready_.size()) - 1;
    until_poll_ = kCancelPollSwitches;

    const uint32_t simd_groups = (count + 31) / 32;
    if (groups_.size() < simd_groups) groups_.resize(simd_groups);
    for (uint32_t g = 0; g < simd_groups; ++g) {
        const uint32_t lanes = count - g * 32 < 32 ? count - g * 32 : 32;
        groups_[g].first_thread = g * 32;
        groups_[g].active = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
        groups_[g].arrived = 0;
        groups_[g].counted_for = nullptr;
    }
    for (uint32_t i = 0; i < count; ++i) {
        lane &l = lanes_[i];
        l.thread = i;
        l.group = i / 32;
        l.lane_id = i % 32;
        l.runner = this;
        l.simd = &groups_[i / 32];
        const metal::uint3 local(i % threads.x, (i / threads.x) % threads.y,
                                 i / (threads.x * threads.y));
        l.ids.threadgroup_position_in_grid = position;
        l.ids.thread_position_in_threadgroup = local;
        l.ids.thread_position_in_grid = position * threads + local;
        l.ids.threads_per_threadgroup = threads;
        l.ids.threadgroups_per_grid = groups;
        l.ids.threads_per_grid = groups * threads;
        l.ids.thread_index_in_threadgroup = i;
        l.ids.thread_index_in_simdgroup = i % 32;
        l.ids.simdgroup_index_in_threadgroup = i / 32;
        l.ids.threads_per_simdgroup = 32;
        l.ids.simdgroups_per_threadgroup = simd_groups;
        // Each lane's stack top sits at another offset within a page (a multiple of 64 bytes,
        // i * 5 lines apart), so the hot tops of the lanes' stacks do not all compete for the
        // same sets of the level-1 cache, as they would a whole number of pages apart.
        const size_t shift = (size_t(i) * 5 % 64) * 64;
        fiber_locals_of(stacks_[i])[0] = &l;
        fiber_prepare(l.context, fiber_stack{stacks_[i].base, stacks_[i].size - shift},
                      &threadgroup_runner::lane_main, &l);
        make_ready(i);
    }

    // Lanes continue one another; the scheduler's context resumes only when none can run (all
    // returned, a stall, a failure or a cancel), and then starts the next runnable one, if any.
    current_runner = this;
    while (lane *l = next_ready()) {
        running_ = l;
        switch_source_ = &scheduler_;
        ++switches_;
        fiber_switch(scheduler_, l->context);
        running_ = nullptr;
    }
    current_runner = nullptr;
    if (status_ == MSL_ENGINE_SUCCESS && returned_ < count_) diagnose_stall();
    if (status_ != MSL_ENGINE_SUCCESS) {
        for (uint32_t i = 0; i < count_; ++i) {
            if (lanes_[i].state != lane_state::returned) fiber_discard(lanes_[i].context);
        }
        *message = message_;
    }
    return status_;
}

void threadgroup_runner::fail(msl_engine_status status, const std::string &what) {
    if (status_ != MSL_ENGINE_SUCCESS) return;
    status_ = status;
    message_ = format("kernel '%s' (%s), threadgroup (%u, %u, %u): %s", kernel_->name,
                      source_location(kernel_->file, kernel_->line).c_str(), position_.x,
                      position_.y, position_.z, what.c_str());
}

uint32_t threadgroup_runner::read_function_constant(lane &l, uint32_t index, uint32_t type,
                                                   const char *name) {
    static const char *const type_names[] = {"bool", "uint"};
    const char *declared = type < 2 ? type_names[type] : "?";
    for (uint32_t i = 0; i < constant_count_; ++i) {
        const msl_engine_function_constant &c = constants_[i];
        if (c.index != index) continue;
        if (c.type == type) {
            constants_read_ |= 1u << i;
            if (index < runtime::cached_constants) {
                msl_engine_constant_cache.value[index] = c.value;
                msl_engine_constant_cache.known[type] |= uint64_t(1) << index;
            }
            return c.value;
        }
        fail(MSL_ENGINE_FUNCTION_CONSTANT_UNSET,
             format("thread %u reads function constant '%s' (index %u) as %s, but the dispatch "
                    "sets it as %s",
                    l.thread, name, index, declared, c.type < 2 ? type_names[c.type] : "?"));
        break;
    }
    if (status_ == MSL_ENGINE_SUCCESS) {
        fail(MSL_ENGINE_FUNCTION_CONSTANT_UNSET,
             format("thread %u reads function constant '%s' (index %u, %s), which the dispatch "
                    "does not set; Metal refuses to build a pipeline whose kernel reads a function "
                    "constant without a value",
                    l.thread, name, index, declared));
    }
    l.state = lane_state::faulted;
    switch_from(l); // the failed threadgroup runs no further lane: to the scheduler
    __builtin_trap(); // a faulted lane is discarded, never resumed
}

std::string threadgroup_runner::describe_wait(const lane &l) const {
    return format("%s at %s", l.operation, source_location(l.file, l.line).c_str());
}

void threadgroup_runner::on_return(lane &l) {
    ++returned_;
    simd_group &g = *l.simd;
    g.active &= ~(1u << l.lane_id);
    if (barrier_waiting_ > 0) {
        const lane &waiting = lanes_[barrier_first_thread_];
        fail(MSL_ENGINE_BARRIER_DIVERGENCE,
             format("thread %u returned while threads %s wait at %s; every thread of a "
                    "threadgroup must reach each barrier",
                    l.thread,
                    index_ranges(count_, [&](uint32_t i) {
                        return lanes_[i].state == lane_state::at_barrier;
                    }).c_str(),
                    describe_wait(waiting).c_str()));
        return;
    }
    if (g.arrived != 0 && g.arrived == g.active) complete(g);
}

void threadgroup_runner::on_barrier(lane &l) {
    if (returned_ > 0) {
        fail(MSL_ENGINE_BARRIER_DIVERGENCE,
             format("thread %u waits at %s, but threads %s returned without reaching it; every "
                    "thread of a threadgroup must reach each barrier",
                    l.thread, describe_wait(l).c_str(),
                    index_ranges(count_, [&](uint32_t i) {
                        return lanes_[i].state == lane_state::returned;
                    }).c_str()));
        return;
    }
    if (barrier_waiting_ == 0) {
        barrier_file_ = l.file;
        barrier_line_ = l.line;
        barrier_first_thread_ = l.thread;
    } else if (!same_site(barrier_file_, barrier_line_, l.file, l.line)) {
        fail(MSL_ENGINE_BARRIER_DIVERGENCE,
             format("threads wait at different barriers: threads %s at %s, thread %u at %s; "
                    "every thread of a threadgroup must reach the same barrier",
                    index_ranges(count_, [&](uint32_t i) {
                        return lanes_[i].state == lane_state::at_barrier && i != l.thread;
                    }).c_str(),
                    describe_wait(lanes_[barrier_first_thread_]).c_str(), l.thread,
                    describe_wait(l).c_str()));
        return;
    }
    if (++barrier_waiting_ == count_) {
        barrier_waiting_ = 0;
        ++barriers_;
        for (uint32_t i = 0; i < count_; ++i) make_ready(i);
    }
}

__attribute__((always_inline)) inline void threadgroup_runner::on_simd(lane &l, const simd_site &site,
                                                                     const void *in, void *out,
                                                                     uint32_t arg) {
    simd_group &g = *l.simd;
    if (g.arrived == 0) {
        g.operation = site.operation;
        g.file = site.file;
        g.line = site.line;
        g.combine = site.combine;
        // A combine function serves one operation: its name is compared once per change.
        if (site.combine != g.counted_for) {
            g.counted_for = site.combine;
            g.counted = site.operation == runtime::matrix_multiply_accumulate_operation ||
                        strcmp(site.operation, runtime::matrix_multiply_accumulate_operation) == 0;
        }
    } else if (g.combine != site.combine || !same_site(g.file, g.line, site.file, site.line)) {
        simd_mismatch(l, site.operation, site.file, site.line, g);
        return;
    }
    // Field by field: a copy of a whole slot would read its padding, which no store wrote, and
    // stall the load on the fields just stored.
    simd_slot &slot = g.slots[l.lane_id];
    slot.in = in;
    slot.out = out;
    slot.arg = arg;
    g.arrived |= 1u << l.lane_id;
    if (g.arrived == g.active) complete(g);
}

void threadgroup_runner::simd_mismatch(const lane &l, const char *operation, const char *file,
                                       unsigned line, const simd_group &g) {
    fail(MSL_ENGINE_SIMDGROUP_DIVERGENCE,
         format("SIMD-group %u: lanes %s wait at %s at %s, but lane %u calls %s; every active "
                "lane must reach the same SIMD-group function",
                l.group,
                index_ranges(32, [&](uint32_t i) { return ((g.arrived >> i) & 1u) != 0; }).c_str(),
                g.operation, source_location(g.file, g.line).c_str(), l.lane_id,
                format("%s at %s", operation, source_location(file, line).c_str()).c_str()));
}

void threadgroup_runner::complete(simd_group &g) {
    // Slots of lanes that have not arrived are stale; the combine functions read only g.arrived's.
    simd_fault fault{};
    if (!g.combine(g.slots, g.arrived, &fault)) {
        fail(MSL_ENGINE_SIMDGROUP_DIVERGENCE,
             format("SIMD-group %u: %s at %s: %s", g.first_thread / 32, g.operation,
                    source_location(g.file, g.line).c_str(), fault_text(fault).c_str()));
        return;
    }
    if (g.counted) ++matrix_multiplies_;
    // First in the queue, lowest lane first: the burst (lanes of an earlier collective still
    // in it go back to the front of the queue, ahead of the rest, where they were).
    ready_count_ += uint32_t(__builtin_popcount(burst_));
    while (burst_ != 0) {
        const uint32_t i = 31u - uint32_t(__builtin_clz(burst_));
        burst_ &= ~(1u << i);
        ready_head_ = (ready_head_ - 1) & ready_mask_;
        ready_[ready_head_] = burst_first_ + i;
    }
    burst_ = g.arrived;
    burst_first_ = g.first_thread;
    g.arrived = 0;
}

void threadgroup_runner::count_read(const void *address, size_t bytes) {
    const auto at = reinterpret_cast<uintptr_t>(address);
    const uint32_t n = args_->buffer_count < MSL_ENGINE_COUNTED_BUFFERS ? args_->buffer_count : MSL_ENGINE_COUNTED_BUFFERS;
    for (uint32_t i = 0; i < n; ++i) {
        const auto base = reinterpret_cast<uintptr_t>(args_->buffers[i].contents);
        if (base != 0 && at >= base && at - base < args_->buffers[i].length) {
            bytes_read_[i] += bytes;
            return;
        }
    }
}

void threadgroup_runner::diagnose_stall() {
    for (uint32_t gi = 0; gi < groups_.size(); ++gi) {
        const simd_group &g = groups_[gi];
        if (g.arrived == 0) continue;
        const uint32_t missing = g.active & ~g.arrived;
        const uint32_t other = g.first_thread + uint32_t(__builtin_ctz(missing));
        fail(MSL_ENGINE_SIMDGROUP_DIVERGENCE,
             format("SIMD-group %u: lanes %s wait at %s at %s, but lanes %s never reach it "
                    "(lane %u waits at %s); every active lane must reach the same SIMD-group "
                    "function",
                    gi,
                    index_ranges(32, [&](uint32_t i) { return ((g.arrived >> i) & 1u) != 0; }).c_str(),
                    g.operation, source_location(g.file, g.line).c_str(),
                    index_ranges(32, [&](uint32_t i) { return ((missing >> i) & 1u) != 0; }).c_str(),
                    other - g.first_thread, describe_wait(lanes_[other]).c_str()));
        return;
    }
    fail(MSL_ENGINE_BARRIER_DIVERGENCE,
         format("threads %s wait at %s and can never be released",
                index_ranges(count_, [&](uint32_t i) {
                    return lanes_[i].state == lane_state::at_barrier;
                }).c_str(),
                describe_wait(lanes_[barrier_first_thread_]).c_str()));
}

namespace runtime {

void threadgroup_barrier(const char *file, unsigned line) {
    lane *l = current_lane();
    if (l == nullptr) return;
    l->state = lane_state::at_barrier;
    l->operation = "threadgroup_barrier";
    l->file = file;
    l->line = line;
    l->runner->suspend_at_barrier(*l);
}

void simd_collective(const char *operation, simd_combine_fn combine, const void *in, void *out,
                     uint32_t arg, const char *file, unsigned line) {
    lane *l = current_lane();
    if (l == nullptr) {
        lone_collective(combine, in, out, arg);
        return;
    }
    l->runner->suspend_at_collective(*l, simd_site{operation, combine, file, line}, in, out, arg);
}

void device_read(const void *address, size_t bytes) {
    lane *l = current_lane();
    if (l != nullptr) l->runner->count_read(address, bytes);
}

uint32_t simd_lane() {
    const lane *l = current_lane();
    return l == nullptr ? 0 : l->lane_id;
}

uint32_t function_constant(uint32_t index, uint32_t type, const char *name) {
    lane *l = current_lane();
    if (l == nullptr) __builtin_trap();
    return l->runner->read_function_constant(*l, index, type, name);
}

} // namespace runtime
} // namespace msl_engine
