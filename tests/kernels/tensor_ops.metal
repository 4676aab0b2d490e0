// Test kernels for Metal 4 tensor ops (mpp::tensor_ops::matmul2d with cooperative tensors), one
// SIMD-group of 32 threads each. Matrices are row-major.
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

typedef dextents<int32_t, 2> extents2;
typedef mpp::tensor_ops::matmul2d_descriptor descriptor;

// d = a * bᵀ + c as Q·Kᵀ is formed: a 16x16 half, bt 32x16 half (b transposed), c and d 16x32
// float; every operand moves through tensor load/store.
kernel void tensor_matmul_half(device const half *a [[buffer(0)]],
                               device const half *bt [[buffer(1)]],
                               device const float *c [[buffer(2)]],
                               device float *d [[buffer(3)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, true, false,
                                     descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    left.load(tensor<device const half, extents2, tensor_inline>(a, extents2(16, 16)));
    right.load(tensor<device const half, extents2, tensor_inline>(bt, extents2(16, 32)));
    dest.load(tensor<device const float, extents2, tensor_inline>(c, extents2(32, 16)));
    op.run(left, right, dest);
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)));
}

// d = a * b for float a 16x16 and b 16x32 with relaxed_precision set or not (mode multiply).
template <bool Relaxed>
inline void float_product(device const float *a, device const float *b, device float *d) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, Relaxed);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.template get_left_input_cooperative_tensor<float, float, float>();
    auto right = op.template get_right_input_cooperative_tensor<float, float, float>();
    auto dest = op.template get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    left.load(tensor<device const float, extents2, tensor_inline>(a, extents2(16, 16)));
    right.load(tensor<device const float, extents2, tensor_inline>(b, extents2(32, 16)));
    op.run(left, right, dest);
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)));
}

kernel void tensor_matmul_float(device const float *a [[buffer(0)]],
                                device const float *b [[buffer(1)]],
                                device float *exact [[buffer(2)]],
                                device float *relaxed [[buffer(3)]]) {
    float_product<false>(a, b, exact);
    float_product<true>(a, b, relaxed);
}

// d = a * b for half a 16x16, b 16x32, float d: elements placed and read back through
// get_multidimensional_index, valid under any layout.
kernel void tensor_layout_by_index(device const half *a [[buffer(0)]],
                                   device const half *b [[buffer(1)]],
                                   device float *d [[buffer(2)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    for (uint i = 0; i < left.get_capacity(); ++i) {
        const int2 at = left.get_multidimensional_index(i);
        if (left.is_valid_element(i)) left[i] = a[at.y * 16 + at.x];
    }
    for (uint i = 0; i < right.get_capacity(); ++i) {
        const int2 at = right.get_multidimensional_index(i);
        if (right.is_valid_element(i)) right[i] = b[at.y * 32 + at.x];
    }
    op.run(left, right, dest);
    for (uint i = 0; i < dest.get_capacity(); ++i) {
        const int2 at = dest.get_multidimensional_index(i);
        if (dest.is_valid_element(i)) d[at.y * 32 + at.x] = dest[i];
    }
}

// A planted layout assumption: the same product with elements placed by MLX's M5 fragment map
// (16x16 fragments in row-major order, 8 elements each) instead of the index functions.
kernel void tensor_layout_assumed(device const half *a [[buffer(0)]],
                                  device const half *b [[buffer(1)]],
                                  device float *d [[buffer(2)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    const uint qid = lane >> 2;
    const uint fm = (qid & 4) | ((lane >> 1) & 3), fn = 4 * ((qid & 2) | (lane & 1));
    for (uint i = 0; i < 8; ++i) {
        const uint r = fm + 8 * (i / 4), c = fn + i % 4;
        left[i] = a[r * 16 + c];
        right[i] = b[r * 32 + c];
        right[8 + i] = b[r * 32 + 16 + c];
    }
    op.run(left, right, dest);
    for (uint i = 0; i < 8; ++i) {
        const uint r = fm + 8 * (i / 4), c = fn + i % 4;
        d[r * 32 + c] = dest[i];
        d[r * 32 + 16 + c] = dest[8 + i];
    }
}

// Bounds: a 10x12 left operand (rows past 10 and columns past 12 read 0), a full right
// operand, and the product stored into a 10x20 window of a 16x32 buffer (the rest untouched).
kernel void tensor_bounds(device const half *a [[buffer(0)]],
                          device const half *b [[buffer(1)]],
                          device float *d [[buffer(2)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    const int strides[2] = {1, 16};
    left.load(tensor<device const half, extents2, tensor_inline>(a, extents2(12, 10), strides));
    right.load(tensor<device const half, extents2, tensor_inline>(b, extents2(32, 16)));
    op.run(left, right, dest);
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)).slice(12, 6));
}

// Lane 31 returns before run: the scope is incomplete.
kernel void tensor_missing_lane(device const half *a [[buffer(0)]],
                                device float *d [[buffer(1)]],
                                uint lane [[thread_index_in_simdgroup]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    left.load(tensor<device const half, extents2, tensor_inline>(a, extents2(16, 16)));
    if (lane == 31) return;
    op.run(left, right, dest); // SITE: tensor-missing-lane
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)));
}

// Lanes 0..15 run a (16, 32, 16) product, lanes 16..31 one with transpose_left set.
kernel void tensor_divergent_descriptor(device float *d [[buffer(0)]],
                                        uint lane [[thread_index_in_simdgroup]]) {
    constexpr auto plain = descriptor(16, 32, 16, false, false, true);
    constexpr auto transposed = descriptor(16, 32, 16, true, false, true);
    mpp::tensor_ops::matmul2d<plain, execution_simdgroup> op;
    mpp::tensor_ops::matmul2d<transposed, execution_simdgroup> other;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    if (lane < 16) {
        op.run(left, right, dest); // SITE: tensor-plain
    } else {
        other.run(left, right, dest); // SITE: tensor-transposed
    }
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)));
}

// Every lane writes one element past the destination's capacity.
kernel void tensor_capacity_overrun(device float *d [[buffer(0)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    dest[dest.get_capacity()] = 1.0f; // SITE: tensor-capacity
    dest.store(tensor<device float, extents2, tensor_inline>(d, extents2(32, 16)));
}

// The half product of tensor_matmul_half with tensor operands passed to run directly (b not
// transposed: 16x32) and a tensor destination.
kernel void tensor_run_on_tensors(device const half *a [[buffer(0)]],
                                  device const half *b [[buffer(1)]],
                                  device float *d [[buffer(2)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, false, true,
                                     descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto out = tensor<device float, extents2, tensor_inline>(d, extents2(32, 16));
    op.run(tensor<device const half, extents2, tensor_inline>(a, extents2(16, 16)),
           tensor<device const half, extents2, tensor_inline>(b, extents2(32, 16)), out);
}
