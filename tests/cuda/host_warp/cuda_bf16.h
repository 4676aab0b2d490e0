// cuda_bf16.h for the simulated warp (cuda_runtime.h beside it): __nv_bfloat16 over the host's
// __bf16, whose conversion from float rounds to nearest even, as __float2bfloat16 does.
#ifndef FA_HOST_WARP_CUDA_BF16_H
#define FA_HOST_WARP_CUDA_BF16_H
#include "cuda_runtime.h"
struct __nv_bfloat16 {
    __bf16 value;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : value(static_cast<__bf16>(f)) {}
    operator float() const { return static_cast<float>(value); }
};
#endif
