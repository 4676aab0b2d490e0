// Ends the MSL spelling opened by metal_cuda.h: include right after the Metal source, so that the
// keyword macros (inline, kernel, constant, thread, threadgroup) and the vector names (float2, ...)
// do not rewrite the CUDA and C++ code that follows.
#undef inline
#undef kernel
#undef threadgroup
#undef constant
#undef thread
#undef fa_device
#undef float2
#undef float4
#undef half2
#undef half4
#undef bfloat2
#undef bfloat4
#undef int2
#undef int4
#undef uint2
#undef uint4
#undef ushort2
#undef ushort4
#undef ulong2
#undef ulong4
