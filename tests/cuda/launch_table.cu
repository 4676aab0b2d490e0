// The kernels of Shaders/ compiled as CUDA, every instance of the kernel catalogue
// (Shaders/flash_attention_catalogue.h, expanded by kernel_table.h: dense, split-KV, decode,
// KV-cache, varlen, merge), launched by name for replay.cu and large_offsets.cu (launch_table.h).
//
// gpu_check.sh copies Shaders/ into its build folder with the `device` address-space word renamed
// to `fa_device` (metal_cuda.h says why) and puts that folder first on the include path.
#include "metal_cuda.h"
#include "flash_attention.metal"
#include "metal_cuda_end.h"

#include "kernel_table.h"

#include <cstring>

static_assert(FA_THREADS_PER_THREADGROUP % 32 == 0, "threadgroups are whole SIMD-groups (warps)");

cudaError_t fa_cuda_launch(const char *kernel_name, dim3 grid, dim3 block, const FaCudaBuffers &buffers,
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
