// Test kernel for the engine's function constants (msl_engine_dispatch_specialized): declared as
// the attention kernels declare theirs (Shaders/flash_attention_features.h), read or not read
// depending on another constant.
#include <metal_stdlib>
using namespace metal;

#if defined(MSL_FUNCTION_CONSTANT)
MSL_FUNCTION_CONSTANT(0, bool, fc_use_count)
MSL_FUNCTION_CONSTANT(5, uint, fc_count)
#else
constant bool fc_use_count [[function_constant(0)]];
constant uint fc_count [[function_constant(5)]];
#endif

// out[tid] = fc_count + tid when fc_use_count, else tid: fc_count is read only when fc_use_count.
kernel void function_constant_reader(device uint *out [[buffer(0)]],
                                     uint tid [[thread_index_in_threadgroup]]) {
    out[tid] = fc_use_count ? fc_count + tid : tid;
}
