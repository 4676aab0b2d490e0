// Ends the MSL spelling opened by metal_cuda.h: include right after the Metal source, so that the
// keyword macros (inline, kernel, constant, thread, threadgroup) do not rewrite the CUDA and C++
// code that follows.
#undef inline
#undef kernel
#undef threadgroup
#undef constant
#undef thread
#undef fa_device
