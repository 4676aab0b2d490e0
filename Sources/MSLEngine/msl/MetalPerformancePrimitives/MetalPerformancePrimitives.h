// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> for the CPU engine: Metal 4's tensor
// operations as the engine emulates them (msl_tensor_ops.h). Include it after <metal_stdlib>,
// exactly as Metal source does.
#ifndef MSL_ENGINE_METAL_PERFORMANCE_PRIMITIVES
#define MSL_ENGINE_METAL_PERFORMANCE_PRIMITIVES

#include "../msl_tensor_ops.h"

#endif
