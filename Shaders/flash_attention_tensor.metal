// FlashAttention for Apple GPUs: the Metal 4 tensor-op kernels (flash_attention_tensor.h), a library
// of their own, compiled at MSL 4.0 (MetalPerformancePrimitives), so that a compiler that refuses
// them loses only the tensor-op path; the other kernels are in flash_attention.metal. Instantiated
// for half and bfloat at the buckets of FA_IF_TENSOR.

#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

using namespace metal;

#include "flash_attention_kernels.h"
#include "flash_attention_tensor.h"

FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_F16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_BF16)
