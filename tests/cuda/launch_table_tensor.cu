// The Metal 4 tensor-op kernels of Shaders/ compiled as CUDA (flash_attention_tensor.metal: the
// catalogue's tensor_bucket instances, forward, dQ and dK/dV at half and bfloat), with matmul2d
// and cooperative tensors from metal_tensor_ops.h, launched by name for launch_table.cu's
// fa_cuda_launch (launch_table.h). A unit of its own, as in Metal (the tensor-op library): its
// function constants and its cooperative-tensor layout are this unit's. The layout is
// FLASH_ATTENTION_TENSOR_LAYOUT's ("permuted", else the M5 map), selected before the first
// launch, as the CPU engine reads it (docs/tensor-ops.md).
#include "metal_cuda.h"
#include "flash_attention_tensor.metal"
#include "metal_cuda_end.h"

#define FA_CUDA_TABLE FA_CUDA_TENSOR_INSTANCES
#include "kernel_table.h"

#include <cstdlib>

cudaError_t fa_cuda_launch_tensor(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
                                  const FaCudaConstant *constants, size_t count) {
    static const cudaError_t selected = fa_cuda::select_tensor_layout(std::getenv("FLASH_ATTENTION_TENSOR_LAYOUT"));
    if (selected != cudaSuccess) {
        return selected;
    }
    return launch_from_table(kernel_name, grid, block, buffers, constants, count);
}
