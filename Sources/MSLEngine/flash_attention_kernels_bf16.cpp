// The bfloat16 kernels for the CPU engine (flash_attention_kernels.hpp).
#include "flash_attention_kernels.hpp"

FA_ENGINE_TARGET_BEGIN
FA_DEFINE_DTYPE_KERNELS(bfloat, bf16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_BF16)
FA_ENGINE_TARGET_END

FA_ENGINE_TABLE(bf16, FA_ENGINE_DTYPE_ENTRIES(bfloat, bf16) FA_HEAD_DIM_BUCKETS(FA_ENGINE_BF16_ENTRIES))
