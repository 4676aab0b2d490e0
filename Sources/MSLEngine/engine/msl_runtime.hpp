// The interface between <metal_stdlib> (compiled into kernel translation units) and the engine
// that runs the kernel's threads as fibers: barriers and SIMD-group collective operations.
//
// A collective is a rendezvous of the active lanes of one 32-lane SIMD-group: each lane deposits
// a slot (pointers to its input and output, one integer argument) and suspends; when every active
// lane has arrived at the same call site, the engine runs the operation's combine function once
// over all slots, then resumes the lanes. Inputs and outputs live on the lanes' own fiber stacks,
// which stay valid while the lanes are suspended.
#ifndef MSL_RUNTIME_HPP
#define MSL_RUNTIME_HPP

#include <stddef.h>
#include <stdint.h>

namespace msl_engine {

/// One lane's part of a SIMD-group collective operation.
struct simd_slot {
    const void *in; ///< the lane's input value (type known to the combine function)
    void *out;      ///< where the lane's result goes
    uint32_t arg;   ///< lane index, shuffle delta or mask, depending on the operation
};

/// What a combine function found wrong; the engine turns it into the error message.
enum class simd_fault_kind {
    inactive_source, ///< a lane reads a lane that is inactive (returned, or past a partial group)
    invalid_lane,    ///< a lane index outside 0..31
    nonuniform_lane, ///< simd_broadcast with different source lanes in one SIMD-group
    partial_matrix,  ///< a simdgroup_matrix operation without all 32 lanes active
};

struct simd_fault {
    simd_fault_kind kind;
    uint32_t lane;   ///< the lane that asked
    uint32_t source; ///< the lane (or index) it asked for
};

/// Computes a collective's results: slots[l] is valid for each set bit l of active_mask. Returns
/// false and fills *fault when the lanes ask for something MSL leaves undefined.
typedef bool (*simd_combine_fn)(const simd_slot *slots, uint32_t active_mask, simd_fault *fault);

namespace runtime {

/// The operation name of simdgroup_multiply_accumulate (simdgroup_multiply calls it): the engine
/// counts each completed collective of this name as one 8x8x8 multiply-accumulate.
inline constexpr char matrix_multiply_accumulate_operation[] = "simdgroup_multiply_accumulate";

/// Suspends the calling thread until every thread of its threadgroup reaches a barrier at the
/// same call site (file:line); a mismatch or a returned thread fails the threadgroup. A no-op
/// outside a dispatch.
void threadgroup_barrier(const char *file, unsigned line);

/// Runs one collective operation named `operation` for the calling lane (see the file comment).
/// Outside a dispatch the caller is lane 0 of a one-lane SIMD-group and faults are ignored.
void simd_collective(const char *operation, simd_combine_fn combine, const void *in, void *out,
                     uint32_t arg, const char *file, unsigned line);

/// Counts a read of `bytes` bytes at `address` against the dispatch buffer that holds it
/// (msl_engine_dispatch_stats.device_bytes_read); nothing outside a dispatch or any buffer.
void device_read(const void *address, size_t bytes);

/// The calling thread's index in its SIMD-group (0..31); 0 outside a dispatch.
uint32_t simd_lane();

/// The value of the dispatch's function constant `index` declared with `type`
/// (msl_engine_constant_type) and `name`. When the dispatch does not set it with that type, the
/// threadgroup fails (MSL_ENGINE_FUNCTION_CONSTANT_UNSET) and the calling thread never resumes.
/// A function constant exists only in a dispatch: reading one outside traps. The first read of
/// each constant by a worker comes here; later ones take the cache below.
uint32_t function_constant(uint32_t index, uint32_t type, const char *name);

/// Function constants with an index below this are cached per worker (constant_cache).
inline constexpr uint32_t cached_constants = 64;

/// The function constants a worker thread has already read in the dispatch it runs: bit i of
/// known[type] says that constant i was set with that type and read once (function_constant
/// checked it and counted the read), value[i] is its value. A read of a known constant is a
/// load, not a call; everything else (a constant the dispatch lacks, another type, a first read,
/// a read outside a dispatch) takes function_constant. The worker sets it up before its first
/// threadgroup and clears it after its last.
struct constant_cache {
    uint64_t known[2];
    uint32_t value[cached_constants];
};

/// Whether the kernels' device reads (MSL_COUNT_DEVICE_READ) are counted in the dispatch the
/// worker thread runs (msl_engine_count_device_reads): off, a read costs one test.
struct read_counting {
    bool on;
};

} // namespace runtime
} // namespace msl_engine

// C-style thread-local storage (no initialisation wrapper on access, unlike C++ thread_local):
// kernels built into another shared object (the planted-fault test builds) reach the engine's.
extern __thread msl_engine::runtime::constant_cache msl_engine_constant_cache;
extern __thread msl_engine::runtime::read_counting msl_engine_read_counting;

namespace msl_engine {
namespace runtime {

} // namespace runtime
} // namespace msl_engine

#endif
