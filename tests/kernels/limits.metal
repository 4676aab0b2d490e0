// Test kernels for the dispatch limits.
#include <metal_stdlib>
using namespace metal;

// 8193 floats: 4 bytes over Apple's 32 KiB of threadgroup memory.
struct oversized_threadgroup {
    float values[8193];
};

kernel void oversized_threadgroup_memory(device float *out [[buffer(0)]],
                                         uint tid [[thread_index_in_threadgroup]]) {
    threadgroup oversized_threadgroup big;
    big.values[tid] = float(tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = big.values[tid];
}

// A deterministic float reduction: simd_sum per SIMD-group, then thread 0 adds the partial sums.
struct partial_sums_threadgroup {
    float sums[32];
};

kernel void float_reduction(device const float *in [[buffer(0)]],
                            device float *out [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint simd_group [[simdgroup_index_in_threadgroup]],
                            uint simd_groups [[simdgroups_per_threadgroup]],
                            uint3 group [[threadgroup_position_in_grid]],
                            uint3 size [[threads_per_threadgroup]]) {
    threadgroup partial_sums_threadgroup partial;
    const float x = exp(in[group.x * size.x + tid]) * 1.0e-3f;
    const float s = simd_sum(x);
    if (lane == 0) {
        partial.sums[simd_group] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float total = 0.0f;
        for (uint i = 0; i < simd_groups; ++i) {
            total += partial.sums[i];
        }
        out[group.x] = total;
    }
}
