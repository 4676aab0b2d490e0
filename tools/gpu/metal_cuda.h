// CUDA compatibility header: lets the unmodified Metal Shading Language kernels of Shaders/ compile
// as CUDA C++ (nvcc -x cu), so the same source runs on an NVIDIA GPU under compute-sanitizer.
// MSL and CUDA share the execution model (threadgroup = block, threadgroup memory = shared memory,
// SIMD-group = 32-lane warp); only spellings differ, and this header maps them.
//
// One word cannot be a macro: CUDA's __device__ expands to __location__(device), so defining
// `device` would break every CUDA declaration after it. tools/gpu_check.sh therefore rewrites the
// MSL address-space word `device` to `fa_device` in a copy of the sources (sed 's/\bdevice\b/...')
// before compiling; the files in Shaders/ stay untouched.
//
// MSL kernels receive their built-ins (threadgroup_position_in_grid, thread_index_in_threadgroup)
// as parameters, which a CUDA __global__ function cannot. So `kernel` becomes __device__ and
// tools/gpu/kernels.cu generates thin __global__ launchers passing blockIdx and threadIdx.
// Attributes such as [[buffer(0)]] are unknown to nvcc and ignored (C++11 [dcl.attr.grammar]).
//
// Include this header first (the .metal file does so through <metal_stdlib>, see include/), and
// include metal_cuda_end.h after the Metal source: the keyword macros below must not leak into
// other code.
#ifndef FA_METAL_CUDA_H
#define FA_METAL_CUDA_H

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

// MSL scalar names. cuda_fp16.h already declares `typedef __half half` (round-to-nearest-even
// conversions to and from float, like Metal's); the integer names match glibc's typedefs.
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8, "MSL ulong is 64-bit");
static_assert(sizeof(long) == 8, "MSL long is 64-bit");

namespace metal {

// Metal's memory-flag argument of barriers. __syncthreads orders shared and global memory for
// the block, a superset of every flag, so the value only has to exist.
enum class mem_flags : unsigned {
    mem_none = 0,
    mem_device = 1,
    mem_threadgroup = 2,
    mem_texture = 4,
};

// Every thread of the threadgroup (block) waits here; CUDA, like MSL, requires all of them to
// reach the same barrier, and compute-sanitizer synccheck reports those that do not.
__device__ __forceinline__ void threadgroup_barrier(mem_flags) { __syncthreads(); }

// Lanes of one SIMD-group (warp) reconverge; Metal's simdgroup_barrier.
__device__ __forceinline__ void simdgroup_barrier(mem_flags) { __syncwarp(); }

// Float math: min, max, exp, exp2, log, log2, fma, sqrt, rsqrt, abs of float (and min/max of
// unsigned int) already exist in CUDA device code under the MSL names, so none are declared here
// (a second overload in namespace metal would make every call ambiguous).

// MSL's fast:: and precise:: variants; both map to CUDA's accurate functions, so results do not
// depend on which one a kernel picks.
namespace fast {
__device__ __forceinline__ float exp(float x) { return expf(x); }
__device__ __forceinline__ float exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float log(float x) { return logf(x); }
__device__ __forceinline__ float log2(float x) { return log2f(x); }
__device__ __forceinline__ float rsqrt(float x) { return rsqrtf(x); }
}  // namespace fast
namespace precise {
using fast::exp;
using fast::exp2;
using fast::log;
using fast::log2;
using fast::rsqrt;
}  // namespace precise

}  // namespace metal

// Address spaces and function qualifiers. `constant` and `thread` carry no meaning in CUDA's
// generic address space; `threadgroup` variables are block-shared; kernels become device
// functions called by the launchers. Helper functions in MSL have no qualifier, but in CUDA an
// unqualified function is host-only, hence `inline` -> `__device__ inline`.
#define kernel __device__
#define threadgroup __shared__
#define constant
#define thread
#define fa_device
#define inline __device__ inline

#endif
