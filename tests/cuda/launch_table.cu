// The kernels of Shaders/ compiled as CUDA, every instance of the kernel catalogue that
// flash_attention.metal defines (Shaders/flash_attention_catalogue.h, expanded by kernel_table.h:
// dense, split-KV, decode, KV-cache, varlen, merge), launched by name for replay.cu and
// large_offsets.cu (launch_table.h); a name this table lacks goes to the tensor-op library's
// (launch_table_tensor.cu).
//
// gpu_check.sh copies Shaders/ into its build folder with the `device` address-space word renamed
// to `fa_device` (metal_cuda.h says why) and puts that folder first on the include path.
#include "metal_cuda.h"
#include "flash_attention.metal"
#include "metal_cuda_end.h"

#define FA_CUDA_TABLE FA_CUDA_INSTANCES
#include "kernel_table.h"

cudaError_t fa_cuda_launch(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
                           const FaCudaConstant *constants, size_t count) {
    const cudaError_t error = launch_from_table(kernel_name, grid, block, buffers, constants, count);
    return error == cudaErrorInvalidDeviceFunction
               ? fa_cuda_launch_tensor(kernel_name, grid, block, buffers, constants, count)
               : error;
}
