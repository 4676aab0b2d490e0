// Test kernels for SIMD-group matrices (one SIMD-group of 32 threads each).
#include <metal_stdlib>
using namespace metal;

// d = a * b + c for 8x8 row-major float matrices; also reports each lane's thread_elements() of a.
kernel void matrix_multiply_float(device const float *a [[buffer(0)]],
                                  device const float *b [[buffer(1)]],
                                  device const float *c [[buffer(2)]],
                                  device float *d [[buffer(3)]],
                                  device float *elements [[buffer(4)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
    simdgroup_float8x8 ma, mb, mc, md;
    simdgroup_load(ma, a);
    simdgroup_load(mb, b);
    simdgroup_load(mc, c);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_store(md, d);
    elements[lane * 2] = ma.thread_elements()[0];
    elements[lane * 2 + 1] = ma.thread_elements()[1];
}

// d = a * b + c for 8x8 row-major half matrices.
kernel void matrix_multiply_half(device const half *a [[buffer(0)]],
                                 device const half *b [[buffer(1)]],
                                 device const half *c [[buffer(2)]],
                                 device half *d [[buffer(3)]]) {
    simdgroup_half8x8 ma, mb, mc, md;
    simdgroup_load(ma, a);
    simdgroup_load(mb, b);
    simdgroup_load(mc, c);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_store(md, d);
}

// From a 16x16 row-major source: loads the tile at column 8, row 0 transposed, multiplies it by
// the identity made with the diagonal constructor, scales each lane's elements by (lane + 1)
// through thread_elements(), and stores it at column 0, row 8 of a 16x16 output.
kernel void matrix_layout(device const float *src [[buffer(0)]],
                          device float *dst [[buffer(1)]],
                          uint lane [[thread_index_in_simdgroup]]) {
    simdgroup_float8x8 tile;
    simdgroup_load(tile, src, 16, ulong2(8, 0), true);
    const simdgroup_float8x8 identity(1.0f);
    simdgroup_float8x8 product;
    simdgroup_multiply(product, tile, identity);
    product.thread_elements() *= float(lane + 1);
    simdgroup_store(product, dst, 16, ulong2(0, 8));
    simdgroup_float8x8 filled = make_filled_simdgroup_matrix<float, 8, 8>(2.0f);
    simdgroup_store(filled, dst, 16, ulong2(8, 0));
}

// A matrix operation in a SIMD-group of 16 threads.
kernel void matrix_partial_group(device const float *src [[buffer(0)]],
                                 device float *dst [[buffer(1)]]) {
    simdgroup_float8x8 tile;
    simdgroup_load(tile, src); // SITE: partial-matrix-load
    simdgroup_store(tile, dst);
}
