// Test kernels for threadgroup barriers and threadgroup memory. Lines marked "SITE:" are found by
// the Swift tests, which check that error messages name them.
#include <metal_stdlib>
using namespace metal;

struct exchange_threadgroup {
    uint values[1024];
};

// Each thread writes a value, waits at a barrier, then reads the value of the mirrored thread:
// correct only if the barrier makes every write visible before any read.
kernel void barrier_visibility(device uint *out [[buffer(0)]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint3 group [[threadgroup_position_in_grid]],
                               uint3 size [[threads_per_threadgroup]]) {
    threadgroup exchange_threadgroup shared;
    const uint n = size.x * size.y * size.z;
    shared.values[tid] = tid * 7 + group.x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[group.x * n + tid] = shared.values[n - 1 - tid];
}

// Every thread stamps the shared array with its threadgroup's id, yields at many barriers (while
// other workers run other threadgroups), then counts entries that are not its threadgroup's.
kernel void threadgroup_private(device uint *mismatches [[buffer(0)]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint3 group [[threadgroup_position_in_grid]],
                                uint3 size [[threads_per_threadgroup]]) {
    threadgroup exchange_threadgroup shared;
    const uint n = size.x;
    uint bad = 0;
    for (uint round = 0; round < 8; ++round) {
        shared.values[tid] = group.x * 1000 + round;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = 0; i < n; ++i) {
            bad += shared.values[i] != group.x * 1000 + round ? 1u : 0u;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    mismatches[group.x * n + tid] = bad;
}

// Thread 5 leaves early while the others wait at the barrier.
kernel void divergent_return(device uint *out [[buffer(0)]],
                             uint tid [[thread_index_in_threadgroup]]) {
    if (tid == 5) {
        return;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: return-barrier
    out[tid] = 1;
}

// Two halves of the threadgroup wait at two different barriers.
kernel void divergent_barrier_sites(device uint *out [[buffer(0)]],
                                    uint tid [[thread_index_in_threadgroup]]) {
    if (tid < 16) {
        threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: first-half-barrier
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: second-half-barrier
    }
    out[tid] = 1;
}

// The seed kernels' fault: threads past the last row take a barrier inside a conditional and
// `continue`, while the other threads reach the barrier at the end of the loop body.
kernel void divergent_loop_barrier(device uint *out [[buffer(0)]],
                                   constant uint &rows [[buffer(1)]],
                                   uint tid [[thread_index_in_threadgroup]]) {
    uint acc = 0;
    for (uint block = 0; block < 2; ++block) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid >= rows) {
            threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: skip-barrier
            continue;
        }
        acc += block;
        threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: loop-end-barrier
    }
    out[tid] = acc;
}

// Many barriers and little work: measures fiber switches.
kernel void barrier_storm(device uint *out [[buffer(0)]], constant uint &rounds [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]]) {
    uint acc = tid;
    for (uint i = 0; i < rounds; ++i) {
        acc = acc * 1664525u + 1013904223u;
        threadgroup_barrier(mem_flags::mem_none);
    }
    out[tid] = acc;
}
