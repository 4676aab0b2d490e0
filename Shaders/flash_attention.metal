// FlashAttention for Apple GPUs: the kernel instances. The kernels are listed in
// flash_attention_catalogue.h, their bodies are in the headers flash_attention_kernels.h includes;
// this file names the dtypes and head-dim buckets they are instantiated for.

#include <metal_stdlib>

using namespace metal;

#include "flash_attention_kernels.h"

// The dtypes this compile instantiates (FA_DTYPE_MASK_* of flash_attention_params.h), every one
// unless a prelude defines FA_DTYPES: a host whose compile of the whole source fails compiles each
// dtype alone, so that a compiler failure loses only that dtype's kernels.
#ifndef FA_DTYPES
#define FA_DTYPES (FA_DTYPE_MASK_F16 | FA_DTYPE_MASK_F32 | FA_DTYPE_MASK_BF16)
#endif

FA_DEFINE_ONCE_KERNELS()
#if FA_DTYPES & FA_DTYPE_MASK_F16
FA_DEFINE_DTYPE_KERNELS(half, f16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16)
#endif
#if FA_DTYPES & FA_DTYPE_MASK_F32
FA_DEFINE_DTYPE_KERNELS(float, f32)
FA_HEAD_DIM_BUCKETS_F32(FA_DEFINE_F32)
#endif
// bfloat needs MSL 3.1 (macOS 14, iOS 17); older compilers get the other dtypes.
#if (!defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)) && (FA_DTYPES & FA_DTYPE_MASK_BF16)
FA_DEFINE_DTYPE_KERNELS(bfloat, bf16)
FA_HEAD_DIM_BUCKETS(FA_DEFINE_BF16)
#endif
