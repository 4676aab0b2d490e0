// The float16 kernels for the CPU engine (flash_attention_kernels.hpp).
#include "flash_attention_kernels.hpp"

FA_ENGINE_TARGET_BEGIN
FA_DEFINE_DTYPE_KERNELS(half, f16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16)
FA_ENGINE_TARGET_END

FA_ENGINE_TABLE(f16, FA_ENGINE_DTYPE_ENTRIES(half, f16) FA_HEAD_DIM_BUCKETS(FA_ENGINE_F16_ENTRIES))
