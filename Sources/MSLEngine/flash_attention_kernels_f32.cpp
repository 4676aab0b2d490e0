// The float32 kernels for the CPU engine (flash_attention_kernels.hpp).
#include "flash_attention_kernels.hpp"

FA_ENGINE_TARGET_BEGIN
FA_DEFINE_DTYPE_KERNELS(float, f32)
FA_HEAD_DIM_BUCKETS_F32(FA_DEFINE_F32)
FA_ENGINE_TARGET_END

FA_ENGINE_TABLE(f32, FA_ENGINE_DTYPE_ENTRIES(float, f32) FA_HEAD_DIM_BUCKETS_F32(FA_ENGINE_F32_ENTRIES))
