// Launches any kernel instance of Shaders/ compiled as CUDA by its Metal name, as an exported
// plan's dispatch gives it (launch_table.cu and, for the tensor-op kernels, launch_table_tensor.cu
// over the catalogue's tables, kernel_table.h): the plan picks the kernel, the grid, every buffer
// and the function constants; nothing here knows a kernel.
#ifndef FA_GPU_LAUNCH_TABLE_H
#define FA_GPU_LAUNCH_TABLE_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "flash_attention_params.h"

// The device pointers of a dispatch by [[buffer(i)]] index, the parameter struct's too (in device
// memory: the CUDA build binds constant buffers as device pointers, so a varlen pass binds its
// sequence table there as Metal does); null where the plan binds nothing. The KV-cache kernels
// bind the most (kernel_table.h asserts that every catalogue index fits).
#define FA_CUDA_MAX_BUFFERS FA_KV_CACHE_BUFFER_COUNT
struct FaCudaBuffers {
    void *at[FA_CUDA_MAX_BUFFERS] = {};
};

// One function constant of a dispatch, as fa_plan_specialization gives it: [[function_constant(
// index)]], type FA_FUNCTION_CONSTANT_TYPE_bool or _uint (fa_specialization_type's values), value.
struct FaCudaConstant {
    uint32_t index, type, value;
};

// Launches `kernel_name` over `grid` threadgroups of `block` threads with `buffers`, its function
// constants exactly `constants[0 ... count)` (a constant the kernel reads but the dispatch does not
// set traps in the kernel, as Metal refuses to build such a pipeline). Asynchronous, on the default
// stream. Errors: cudaErrorInvalidDeviceFunction for a name the catalogue does not hold,
// cudaErrorInvalidValue for a block other than (FA_THREADS_PER_THREADGROUP, 1, 1) or a constant
// whose index or type the kernels do not have; else the launch's.
cudaError_t fa_cuda_launch(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
                           const FaCudaConstant *constants, size_t count);

// fa_cuda_launch for the tensor-op library's kernels only (launch_table_tensor.cu; fa_cuda_launch
// calls it for a name its own table lacks). Its first call selects the cooperative-tensor layout
// by FLASH_ATTENTION_TENSOR_LAYOUT.
cudaError_t fa_cuda_launch_tensor(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
                                  const FaCudaConstant *constants, size_t count);

#endif
