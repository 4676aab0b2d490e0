// Test kernels for SIMD-group functions. Lines marked "SITE:" are found by the Swift tests.
#include <metal_stdlib>
using namespace metal;

constant uint kSimdResults = 14;

// Every SIMD-group function on v = 3 * tid + 1; results land at out[tid * kSimdResults + i].
kernel void simd_functions(device uint *out [[buffer(0)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint lanes [[threads_per_simdgroup]]) {
    const uint v = 3 * tid + 1;
    device uint *r = out + tid * kSimdResults;
    r[0] = simd_shuffle(v, (lane + 3) % lanes);
    r[1] = simd_shuffle_down(v, 5);
    r[2] = simd_shuffle_up(v, 3);
    r[3] = simd_shuffle_xor(v, 6);
    r[4] = simd_broadcast(v, 9);
    r[5] = simd_broadcast_first(v);
    r[6] = simd_sum(v);
    r[7] = simd_max(v);
    r[8] = simd_min(v);
    r[9] = simd_prefix_inclusive_sum(v);
    r[10] = simd_prefix_exclusive_sum(v);
    r[11] = as_type<uint>(simd_sum(float(tid) * 0.5f));
    r[12] = simd_is_first() ? 1u : 0u;
    const uint2 pair = simd_shuffle_down(uint2(v, lane), 1);
    r[13] = pair.x + pair.y * 1000u;
}

// A threadgroup whose last SIMD-group is partial (e.g. 40 threads: 32 + 8 lanes).
kernel void simd_partial(device uint *out [[buffer(0)]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint group [[simdgroup_index_in_threadgroup]],
                         uint groups [[simdgroups_per_threadgroup]]) {
    const uint v = tid + 1;
    device uint *r = out + tid * 7;
    r[0] = simd_sum(v);
    r[1] = simd_max(v);
    r[2] = simd_broadcast_first(v);
    r[3] = simd_shuffle_up(v, 1);
    r[4] = lane;
    r[5] = group;
    r[6] = groups;
}

// simd_shuffle_down in a partial SIMD-group reads lanes that do not exist.
kernel void simd_partial_shuffle_down(device uint *out [[buffer(0)]],
                                      uint tid [[thread_index_in_threadgroup]]) {
    out[tid] = simd_shuffle_down(tid, 4); // SITE: partial-shuffle-down
}

// Lanes that returned are inactive: the others' reduction covers only them (no error).
kernel void simd_after_return(device uint *out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
    out[tid] = 0;
    if (lane >= 16) {
        return;
    }
    out[tid] = simd_sum(tid);
}

// Half of the lanes call simd_sum; the other half goes on to the barrier.
kernel void simd_half_lanes(device uint *out [[buffer(0)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
    uint v = tid;
    if (lane < 16) {
        v = simd_sum(v); // SITE: half-lanes-sum
    }
    threadgroup_barrier(mem_flags::mem_threadgroup); // SITE: half-lanes-barrier
    out[tid] = v;
}

// The two halves of a SIMD-group call different SIMD-group functions.
kernel void simd_different_functions(device uint *out [[buffer(0)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
    uint v = tid;
    if (lane < 16) {
        v = simd_sum(v); // SITE: different-sum
    } else {
        v = simd_max(v); // SITE: different-max
    }
    out[tid] = v;
}

// simd_shuffle with a lane index past 31.
kernel void simd_invalid_lane(device uint *out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
    out[tid] = simd_shuffle(tid, 40); // SITE: invalid-lane
}
