// The Metal 4 tensor-op kernels (Shaders/flash_attention_tensor.h) for the CPU engine, run through
// its matmul2d emulation (msl/msl_tensor_ops.h); the tensor-op library's instances
// (Shaders/flash_attention_tensor.metal), one translation unit (flash_attention_kernels.hpp).
#include "flash_attention_kernels.hpp"

#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

FA_ENGINE_TARGET_BEGIN
#include "../../Shaders/flash_attention_tensor.h"
FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_F16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_BF16)
FA_ENGINE_TARGET_END

#define FA_ENGINE_TENSOR_F16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_ENGINE_ENTRY, half, f16, DP)
#define FA_ENGINE_TENSOR_BF16_ENTRIES(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_ENGINE_ENTRY, bfloat, bf16, DP)
FA_ENGINE_TABLE(tensor, FA_HEAD_DIM_BUCKETS(FA_ENGINE_TENSOR_F16_ENTRIES)
                            FA_HEAD_DIM_BUCKETS(FA_ENGINE_TENSOR_BF16_ENTRIES))
