// cuda_fp16.h for the simulated warp (cuda_runtime.h beside it): __half over the host's _Float16,
// whose conversion from float rounds to nearest even, as __float2half does.
#ifndef FA_HOST_WARP_CUDA_FP16_H
#define FA_HOST_WARP_CUDA_FP16_H
#include "cuda_runtime.h"
struct __half {
    _Float16 value;
    __half() = default;
    __half(float f) : value(static_cast<_Float16>(f)) {}
    operator float() const { return static_cast<float>(value); }
};
typedef __half half;
#endif
