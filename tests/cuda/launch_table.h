// Launches a kernel of Shaders/ compiled as CUDA by its Metal name (launch_table.cu).
#ifndef FA_GPU_LAUNCH_TABLE_H
#define FA_GPU_LAUNCH_TABLE_H

#include <cuda_runtime.h>

#include "flash_attention_params.h"

// Launches `kernel_name` over `grid` threadgroups of `block` threads with `buffers[i]` at
// [[buffer(i)]] and the parameter struct `params` at its index (its function constants computed
// from it, as the Metal plan specialises them); cudaErrorInvalidDeviceFunction for a name the
// table does not hold.
cudaError_t fa_cuda_launch(const char *kernel_name, dim3 grid, dim3 block, void *const *buffers,
                           const FlashAttentionParams &params);

#endif
