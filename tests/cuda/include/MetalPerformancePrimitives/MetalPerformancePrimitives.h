// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> for the CUDA check build: Metal 4's
// tensor ops as tests/cuda/metal_tensor_ops.h emulates them. metal_cuda.h (the <metal_stdlib>
// here) has included them already, so this include, after <metal_stdlib> as in Metal source,
// only checks that order.
#ifndef FA_METAL_TENSOR_OPS_H
#error "include <metal_stdlib> (tests/cuda/metal_cuda.h) before <MetalPerformancePrimitives/MetalPerformancePrimitives.h>"
#endif
