// The CUDA check build's kernel table, expanded from the kernel catalogue
// (Shaders/flash_attention_catalogue.h): one __global__ per kernel instance of FA_CUDA_TABLE,
// named fa_cuda_kernel_<instance>, that binds the kernel's buffers from FaCudaBuffers by
// [[buffer(i)]] index and its built-ins from CUDA's; kFaCudaKernels, the instances by name; and
// launch_from_table, which launches one of them with a dispatch's function constants. The
// parameter struct is bound as a device pointer like every buffer (the CUDA build has no constant
// address space; a varlen pass binds its sequence table there). Included after the kernels
// (metal_cuda.h, the .metal file, metal_cuda_end.h) by the unit of each Metal library, with
// FA_CUDA_TABLE defined as its instance list: launch_table.cu (flash_attention.metal,
// FA_CUDA_INSTANCES) and launch_table_tensor.cu (flash_attention_tensor.metal, the Metal 4
// tensor-op kernels, FA_CUDA_TENSOR_INSTANCES). Each unit has its own function constants and
// tensor layout (static device variables of metal_cuda.h and metal_tensor_ops.h), so each
// launches only its own kernels.
#ifndef FA_GPU_KERNEL_TABLE_H
#define FA_GPU_KERNEL_TABLE_H

#include "launch_table.h"

#include <cstring>

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

// Every instance the Metal library (flash_attention.metal) has, through FA_CUDA_EACH
// (FA_CUDA_KERNEL or FA_CUDA_TABLE_ENTRY).
#define FA_CUDA_F16(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, half, f16, DP)
#define FA_CUDA_BF16(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, bfloat, bf16, DP)
#define FA_CUDA_F32(DP, ...) FA_KERNELS(FA_AT_BUCKET, FA_CUDA_EACH, float, f32, DP)
#define FA_CUDA_INSTANCES                                                                          \
    FA_KERNELS(FA_AT_ONCE, FA_CUDA_EACH, uchar, , 0)                                               \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, half, f16, 0) FA_HEAD_DIM_BUCKETS(FA_CUDA_F16)           \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, bfloat, bf16, 0) FA_HEAD_DIM_BUCKETS(FA_CUDA_BF16)       \
    FA_KERNELS(FA_AT_DTYPE, FA_CUDA_EACH, float, f32, 0) FA_HEAD_DIM_BUCKETS_F32(FA_CUDA_F32)
// Every instance the tensor-op library (flash_attention_tensor.metal) has: half and bfloat at the
// buckets of FA_IF_TENSOR.
#define FA_CUDA_TENSOR_F16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_CUDA_EACH, half, f16, DP)
#define FA_CUDA_TENSOR_BF16(DP, ...) FA_KERNELS(FA_AT_TENSOR, FA_CUDA_EACH, bfloat, bf16, DP)
#define FA_CUDA_TENSOR_INSTANCES FA_HEAD_DIM_BUCKETS(FA_CUDA_TENSOR_F16) FA_HEAD_DIM_BUCKETS(FA_CUDA_TENSOR_BF16)

#ifndef FA_CUDA_TABLE
#error "define FA_CUDA_TABLE (FA_CUDA_INSTANCES or FA_CUDA_TENSOR_INSTANCES) before kernel_table.h"
#endif

#define FA_CUDA_EACH FA_CUDA_KERNEL
FA_CUDA_TABLE
#undef FA_CUDA_EACH

// An instance by name, as the Metal plan names it.
struct FaCudaKernel {
    const char *name;
    void (*launch)(FaCudaBuffers);
};

#define FA_CUDA_EACH FA_CUDA_TABLE_ENTRY
static const FaCudaKernel kFaCudaKernels[] = {FA_CUDA_TABLE};
#undef FA_CUDA_EACH

static_assert(FA_THREADS_PER_THREADGROUP % 32 == 0, "threadgroups are whole SIMD-groups (warps)");

// fa_cuda_launch (launch_table.h) for the instances of this unit's table: cudaErrorInvalidDeviceFunction
// for a name the table does not hold, else the same errors.
static cudaError_t launch_from_table(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
                                     const FaCudaConstant *constants, size_t count) {
    const FaCudaKernel *kernel = nullptr;
    for (const FaCudaKernel &k : kFaCudaKernels) {
        if (std::strcmp(k.name, kernel_name) == 0) {
            kernel = &k;
        }
    }
    if (kernel == nullptr) {
        return cudaErrorInvalidDeviceFunction;
    }
    if (block.x != FA_THREADS_PER_THREADGROUP || block.y != 1 || block.z != 1) {
        return cudaErrorInvalidValue;
    }
    // The dispatch's specialisation, as Metal builds a pipeline per dispatch: only these are set.
    metal::function_constant_values values{};
    for (size_t i = 0; i < count; ++i) {
        const FaCudaConstant &c = constants[i];
        if (c.index >= FA_FUNCTION_CONSTANT_COUNT ||
            (c.type != FA_FUNCTION_CONSTANT_TYPE_bool && c.type != FA_FUNCTION_CONSTANT_TYPE_uint)) {
            return cudaErrorInvalidValue;
        }
        values.set |= 1u << c.index;
        values.type[c.index] = static_cast<unsigned char>(c.type);
        values.value[c.index] = c.value;
    }
    static_assert(metal::function_constant_type<bool>::value == FA_FUNCTION_CONSTANT_TYPE_bool &&
                      metal::function_constant_type<unsigned>::value == FA_FUNCTION_CONSTANT_TYPE_uint,
                  "metal_cuda.h's constant types are the plan's");
    if (const cudaError_t error = cudaMemcpyToSymbol(metal::function_constants, &values, sizeof values);
        error != cudaSuccess) {
        return error;
    }
    kernel->launch<<<grid, block>>>(buffers);
    return cudaGetLastError();
}

#endif
