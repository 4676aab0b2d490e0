// Engine entries for the test kernels: each binds the kernel's [[buffer(i)]] arguments and
// built-ins, and reports sizeof() of the kernel's threadgroup struct (0 when it declares none).
#include "msl_kernel_registry.hpp"

#include "barrier.metal"
#include "bfloat.metal"
#include "counters.metal"
#include "function_constants.metal"
#include "limits.metal"
#include "matrix.metal"
#include "planted_out_of_bounds.metal"
#include "planted_undefined_behaviour.metal"
#include "simd.metal"
#include "tensor_ops.metal"

#include "include/msl_engine_test_kernels.h"

namespace {

using msl_engine::builtins;
using msl_engine::kernel_args;

void run_barrier_visibility(const kernel_args &a, const builtins &t) {
    barrier_visibility(a.buffer<uint>(0), t.thread_index_in_threadgroup,
                       t.threadgroup_position_in_grid, t.threads_per_threadgroup);
}
void run_threadgroup_private(const kernel_args &a, const builtins &t) {
    threadgroup_private(a.buffer<uint>(0), t.thread_index_in_threadgroup,
                        t.threadgroup_position_in_grid, t.threads_per_threadgroup);
}
void run_divergent_return(const kernel_args &a, const builtins &t) {
    divergent_return(a.buffer<uint>(0), t.thread_index_in_threadgroup);
}
void run_divergent_barrier_sites(const kernel_args &a, const builtins &t) {
    divergent_barrier_sites(a.buffer<uint>(0), t.thread_index_in_threadgroup);
}
void run_divergent_loop_barrier(const kernel_args &a, const builtins &t) {
    divergent_loop_barrier(a.buffer<uint>(0), a.constant_ref<const uint>(1),
                           t.thread_index_in_threadgroup);
}
void run_barrier_storm(const kernel_args &a, const builtins &t) {
    barrier_storm(a.buffer<uint>(0), a.constant_ref<const uint>(1), t.thread_index_in_threadgroup);
}
void run_counted_matrix_work(const kernel_args &a, const builtins &t) {
    counted_matrix_work(a.buffer<float>(0), a.constant_ref<const uint>(1),
                        t.thread_index_in_threadgroup, t.threadgroup_position_in_grid,
                        t.threadgroups_per_grid, t.threads_per_threadgroup);
}
void run_counted_reads(const kernel_args &a, const builtins &t) {
    counted_reads(a.buffer<const float>(0), a.buffer<float>(1), t.thread_position_in_grid.x);
}
void run_simd_functions(const kernel_args &a, const builtins &t) {
    simd_functions(a.buffer<uint>(0), t.thread_index_in_threadgroup, t.thread_index_in_simdgroup,
                   t.threads_per_simdgroup);
}
void run_simd_partial(const kernel_args &a, const builtins &t) {
    simd_partial(a.buffer<uint>(0), t.thread_index_in_threadgroup, t.thread_index_in_simdgroup,
                 t.simdgroup_index_in_threadgroup, t.simdgroups_per_threadgroup);
}
void run_simd_partial_shuffle_down(const kernel_args &a, const builtins &t) {
    simd_partial_shuffle_down(a.buffer<uint>(0), t.thread_index_in_threadgroup);
}
void run_simd_after_return(const kernel_args &a, const builtins &t) {
    simd_after_return(a.buffer<uint>(0), t.thread_index_in_threadgroup,
                      t.thread_index_in_simdgroup);
}
void run_simd_half_lanes(const kernel_args &a, const builtins &t) {
    simd_half_lanes(a.buffer<uint>(0), t.thread_index_in_threadgroup, t.thread_index_in_simdgroup);
}
void run_simd_different_functions(const kernel_args &a, const builtins &t) {
    simd_different_functions(a.buffer<uint>(0), t.thread_index_in_threadgroup,
                             t.thread_index_in_simdgroup);
}
void run_simd_invalid_lane(const kernel_args &a, const builtins &t) {
    simd_invalid_lane(a.buffer<uint>(0), t.thread_index_in_threadgroup);
}
void run_matrix_multiply_float(const kernel_args &a, const builtins &t) {
    matrix_multiply_float(a.buffer<const float>(0), a.buffer<const float>(1),
                          a.buffer<const float>(2), a.buffer<float>(3), a.buffer<float>(4),
                          t.thread_index_in_simdgroup);
}
void run_matrix_multiply_half(const kernel_args &a, const builtins &) {
    matrix_multiply_half(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<const half>(2),
                         a.buffer<half>(3));
}
void run_matrix_layout(const kernel_args &a, const builtins &t) {
    matrix_layout(a.buffer<const float>(0), a.buffer<float>(1), t.thread_index_in_simdgroup);
}
void run_matrix_partial_group(const kernel_args &a, const builtins &) {
    matrix_partial_group(a.buffer<const float>(0), a.buffer<float>(1));
}
void run_bfloat_round(const kernel_args &a, const builtins &t) {
    bfloat_round(a.buffer<const float>(0), a.buffer<bfloat>(1), a.buffer<float>(2),
                 t.thread_position_in_grid.x);
}
void run_bfloat_widen_all(const kernel_args &a, const builtins &t) {
    bfloat_widen_all(a.buffer<float>(0), t.thread_position_in_grid.x);
}
void run_bfloat_arithmetic(const kernel_args &a, const builtins &) {
    bfloat_arithmetic(a.buffer<float>(0));
}
void run_matrix_multiply_bfloat(const kernel_args &a, const builtins &) {
    matrix_multiply_bfloat(a.buffer<const bfloat>(0), a.buffer<const bfloat>(1),
                           a.buffer<const float>(2), a.buffer<float>(3));
}
void run_oversized_threadgroup_memory(const kernel_args &a, const builtins &t) {
    oversized_threadgroup_memory(a.buffer<float>(0), t.thread_index_in_threadgroup);
}
void run_float_reduction(const kernel_args &a, const builtins &t) {
    float_reduction(a.buffer<const float>(0), a.buffer<float>(1), t.thread_index_in_threadgroup,
                    t.thread_index_in_simdgroup, t.simdgroup_index_in_threadgroup,
                    t.simdgroups_per_threadgroup, t.threadgroup_position_in_grid,
                    t.threads_per_threadgroup);
}
void run_function_constant_reader(const kernel_args &a, const builtins &t) {
    function_constant_reader(a.buffer<uint>(0), t.thread_index_in_threadgroup);
}
void run_planted_out_of_bounds_read(const kernel_args &a, const builtins &t) {
    planted_out_of_bounds_read(a.buffer<const float>(0), a.buffer<float>(1),
                               a.constant_ref<const uint>(2), t.thread_position_in_grid.x);
}

void run_planted_signed_overflow(const kernel_args &a, const builtins &t) {
    planted_signed_overflow(a.buffer<const int>(0), a.buffer<int>(1), a.constant_ref<const int>(2),
                            t.thread_position_in_grid.x);
}

void run_tensor_matmul_half(const kernel_args &a, const builtins &) {
    tensor_matmul_half(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<const float>(2),
                       a.buffer<float>(3));
}
void run_tensor_matmul_float(const kernel_args &a, const builtins &) {
    tensor_matmul_float(a.buffer<const float>(0), a.buffer<const float>(1), a.buffer<float>(2),
                        a.buffer<float>(3));
}
void run_tensor_layout_by_index(const kernel_args &a, const builtins &) {
    tensor_layout_by_index(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<float>(2));
}
void run_tensor_layout_assumed(const kernel_args &a, const builtins &t) {
    tensor_layout_assumed(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<float>(2),
                          t.thread_index_in_simdgroup);
}
void run_tensor_bounds(const kernel_args &a, const builtins &) {
    tensor_bounds(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<float>(2));
}
void run_tensor_missing_lane(const kernel_args &a, const builtins &t) {
    tensor_missing_lane(a.buffer<const half>(0), a.buffer<float>(1), t.thread_index_in_simdgroup);
}
void run_tensor_divergent_descriptor(const kernel_args &a, const builtins &t) {
    tensor_divergent_descriptor(a.buffer<float>(0), t.thread_index_in_simdgroup);
}
void run_tensor_capacity_overrun(const kernel_args &a, const builtins &) {
    tensor_capacity_overrun(a.buffer<float>(0));
}
void run_tensor_run_on_tensors(const kernel_args &a, const builtins &) {
    tensor_run_on_tensors(a.buffer<const half>(0), a.buffer<const half>(1), a.buffer<float>(2));
}

// LINE is where the kernel is defined; EngineTests checks every one against the .metal source.
#define TEST_KERNEL(NAME, BUFFERS, THREADGROUP_BYTES, FILE, LINE)                                  \
    msl_engine::kernel_entry {                                                                     \
        #NAME, run_##NAME, BUFFERS, THREADGROUP_BYTES, "tests/kernels/" FILE, LINE                 \
    }

const msl_engine::kernel_entry kTestKernels[] = {
    TEST_KERNEL(barrier_visibility, 1, sizeof(exchange_threadgroup), "barrier.metal", 12),
    TEST_KERNEL(threadgroup_private, 1, sizeof(exchange_threadgroup), "barrier.metal", 25),
    TEST_KERNEL(divergent_return, 1, 0, "barrier.metal", 44),
    TEST_KERNEL(divergent_barrier_sites, 1, 0, "barrier.metal", 54),
    TEST_KERNEL(divergent_loop_barrier, 2, 0, "barrier.metal", 66),
    TEST_KERNEL(barrier_storm, 2, 0, "barrier.metal", 83),
    TEST_KERNEL(counted_matrix_work, 2, 0, "counters.metal", 11),
    TEST_KERNEL(counted_reads, 2, 0, "counters.metal", 34),
    TEST_KERNEL(simd_functions, 1, 0, "simd.metal", 8),
    TEST_KERNEL(simd_partial, 1, 0, "simd.metal", 32),
    TEST_KERNEL(simd_partial_shuffle_down, 1, 0, "simd.metal", 49),
    TEST_KERNEL(simd_after_return, 1, 0, "simd.metal", 55),
    TEST_KERNEL(simd_half_lanes, 1, 0, "simd.metal", 66),
    TEST_KERNEL(simd_different_functions, 1, 0, "simd.metal", 78),
    TEST_KERNEL(simd_invalid_lane, 1, 0, "simd.metal", 91),
    TEST_KERNEL(matrix_multiply_float, 5, 0, "matrix.metal", 6),
    TEST_KERNEL(matrix_multiply_half, 4, 0, "matrix.metal", 23),
    TEST_KERNEL(matrix_layout, 2, 0, "matrix.metal", 38),
    TEST_KERNEL(matrix_partial_group, 2, 0, "matrix.metal", 53),
    TEST_KERNEL(bfloat_round, 3, 0, "bfloat.metal", 6),
    TEST_KERNEL(bfloat_widen_all, 1, 0, "bfloat.metal", 15),
    TEST_KERNEL(bfloat_arithmetic, 1, 0, "bfloat.metal", 24),
    TEST_KERNEL(matrix_multiply_bfloat, 4, 0, "bfloat.metal", 57),
    TEST_KERNEL(oversized_threadgroup_memory, 1, sizeof(oversized_threadgroup), "limits.metal", 10),
    TEST_KERNEL(float_reduction, 2, sizeof(partial_sums_threadgroup), "limits.metal", 23),
    TEST_KERNEL(planted_out_of_bounds_read, 3, 0, "planted_out_of_bounds.metal", 6),
    TEST_KERNEL(planted_signed_overflow, 3, 0, "planted_undefined_behaviour.metal", 6),
    TEST_KERNEL(function_constant_reader, 1, 0, "function_constants.metal", 16),
    TEST_KERNEL(tensor_matmul_half, 4, 0, "tensor_ops.metal", 12),
    TEST_KERNEL(tensor_matmul_float, 4, 0, "tensor_ops.metal", 43),
    TEST_KERNEL(tensor_layout_by_index, 3, 0, "tensor_ops.metal", 53),
    TEST_KERNEL(tensor_layout_assumed, 3, 0, "tensor_ops.metal", 78),
    TEST_KERNEL(tensor_bounds, 3, 0, "tensor_ops.metal", 105),
    TEST_KERNEL(tensor_missing_lane, 2, 0, "tensor_ops.metal", 121),
    TEST_KERNEL(tensor_divergent_descriptor, 1, 0, "tensor_ops.metal", 136),
    TEST_KERNEL(tensor_capacity_overrun, 1, 0, "tensor_ops.metal", 154),
    TEST_KERNEL(tensor_run_on_tensors, 3, 0, "tensor_ops.metal", 166),
};

} // namespace

extern "C" void msl_engine_test_kernels_register(void) {
    msl_engine::register_kernels(kTestKernels, sizeof kTestKernels / sizeof kTestKernels[0]);
}
