// Test kernels for the engine's counters (msl_engine_dispatch_stats): a known number of SIMD-group
// matrix products and threadgroup barriers per threadgroup.
#include <metal_stdlib>
using namespace metal;

// Every SIMD-group adds the identity to an accumulator `rounds` times with
// simdgroup_multiply_accumulate, each followed by a threadgroup barrier, then multiplies the
// accumulator by the identity once with simdgroup_multiply before a last barrier: rounds + 1
// products per SIMD-group and rounds + 1 barriers per threadgroup. Each thread stores the sum of
// its two elements, so a SIMD-group's outputs sum to 8 * rounds.
kernel void counted_matrix_work(device float *out [[buffer(0)]],
                                constant uint &rounds [[buffer(1)]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint3 group [[threadgroup_position_in_grid]],
                                uint3 groups [[threadgroups_per_grid]],
                                uint3 size [[threads_per_threadgroup]]) {
    const simdgroup_float8x8 identity(1.0f);
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint i = 0; i < rounds; ++i) {
        simdgroup_multiply_accumulate(acc, identity, identity, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_float8x8 product;
    simdgroup_multiply(product, acc, identity);
    threadgroup_barrier(mem_flags::mem_none);
    const uint n = size.x * size.y * size.z;
    const uint linear_group = (group.z * groups.y + group.y) * groups.x + group.x;
    out[linear_group * n + tid] = product.thread_elements()[0] + product.thread_elements()[1];
}

// out[tid] = in[tid], each thread's read of 4 bytes of `in` counted through MSL_COUNT_DEVICE_READ
// (the hook the attention kernels' loaders call): 4 bytes per thread of buffer 0 when the
// dispatch counts device reads, none otherwise.
kernel void counted_reads(device const float *in [[buffer(0)]], device float *out [[buffer(1)]],
                          uint tid [[thread_position_in_grid]]) {
#if defined(MSL_COUNT_DEVICE_READ)
    MSL_COUNT_DEVICE_READ(in + tid, sizeof(float));
#endif
    out[tid] = in[tid];
}
