// The CUDA check build's kernel table, expanded from the kernel catalogue
// (Shaders/flash_attention_catalogue.h): one __global__ per kernel instance, named
// fa_cuda_kernel_<instance>, that binds the kernel's buffers from FaCudaBuffers by [[buffer(i)]]
// index and its built-ins from CUDA's, and kFaCudaKernels, the instances by name. The parameter
// struct is bound as a device pointer like every buffer (the CUDA build has no constant address
// space; a varlen pass binds its sequence table there). Included by launch_table.cu after the
// kernels (metal_cuda.h, flash_attention.metal, metal_cuda_end.h).
#ifndef FA_GPU_KERNEL_TABLE_H
#define FA_GPU_KERNEL_TABLE_H

#include "launch_table.h"

// The MSL built-ins from CUDA's: every threadgroup is 1-D, so thread_index_in_threadgroup is
// threadIdx.x, and its SIMD-groups are consecutive runs of 32 threads (warps, Apple's SIMD width).

#define FA_CUDA_BUFFER(INDEX, NAME, TYPE, ACCESS, SPACE) , FA_CUDA_BUFFER_##SPACE(INDEX, TYPE, ACCESS)
#define FA_CUDA_BUFFER_device_memory(INDEX, TYPE, ACCESS) static_cast<FA_ACCESS_##ACCESS TYPE *>(b.at[INDEX])
#define FA_CUDA_BUFFER_constant_memory(INDEX, TYPE, ACCESS) *static_cast<TYPE *>(b.at[INDEX])
#define FA_CUDA_BUFFER_constant_array(INDEX, TYPE, ACCESS) static_cast<TYPE *>(b.at[INDEX])
#define FA_CUDA_BUILTIN(TYPE, NAME, ATTRIBUTE) , FA_CUDA_BUILTIN_##ATTRIBUTE
#define FA_CUDA_BUILTIN_threadgroup_position_in_grid make_uint3(blockIdx.x, blockIdx.y, blockIdx.z)
#define FA_CUDA_BUILTIN_simdgroup_index_in_threadgroup (threadIdx.x / 32)
#define FA_CUDA_BUILTIN_thread_index_in_simdgroup (threadIdx.x % 32)
#define FA_CUDA_BUILTIN_thread_index_in_threadgroup threadIdx.x
#define FA_CUDA_BUFFER_INDEX_FITS(INDEX, NAME, TYPE, ACCESS, SPACE) &&(INDEX) < FA_CUDA_MAX_BUFFERS

#define FA_CUDA_KERNEL(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP)        \
    static_assert(true BUFFERS(FA_CUDA_BUFFER_INDEX_FITS, T), "a buffer index past FaCudaBuffers"); \
    __global__ void __launch_bounds__(FA_THREADS_PER_THREADGROUP)                                  \
        FA_CAT(fa_cuda_kernel_, FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP))(FaCudaBuffers b) {  \
        FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)(                                             \
            FA_TAIL(0 BUFFERS(FA_CUDA_BUFFER, T) BUILTINS(FA_CUDA_BUILTIN)));                      \
    }
#define FA_CUDA_TABLE_ENTRY(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, T, SUFFIX, DP)   \
    {FA_STRING(FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP)),                                     \
     FA_CAT(fa_cuda_kernel_, FA_KERNEL_NAME(KERNEL, INSTANCES, SUFFIX, DP))},

// Every instance the Metal library has, for F (FA_CUDA_KERNEL or FA_CUDA_TABLE_ENTRY).
#define FA_CUDA_F16(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, half, f16, DP)
#define FA_CUDA_BF16(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, bfloat, bf16, DP)
#define FA_CUDA_F32(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, float, f32, DP)
#define FA_CUDA_INSTANCES                                                                          \
    FA_KERNELS(FA_AT_ONCE, FA_CUDA_EACH, uchar, , 0)                                               \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, half, f16, 0) FA_HEAD_DIM_BUCKETS(FA_CUDA_F16)           \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, bfloat, bf16, 0) FA_HEAD_DIM_BUCKETS(FA_CUDA_BF16)       \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, float, f32, 0) FA_HEAD_DIM_BUCKETS_F32(FA_CUDA_F32)

#define FA_CUDA_EACH FA_CUDA_KERNEL
FA_CUDA_INSTANCES
#undef FA_CUDA_EACH

// An instance by name, as the Metal plan names it.
struct FaCudaKernel {
    const char *name;
    void (*launch)(FaCudaBuffers);
};

#define FA_CUDA_EACH FA_CUDA_TABLE_ENTRY
static const FaCudaKernel kFaCudaKernels[] = {FA_CUDA_INSTANCES};
#undef FA_CUDA_EACH

#endif
