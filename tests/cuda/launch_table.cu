// The kernels of Shaders/ compiled as CUDA (kernels.cu) and a table that launches them by their
// Metal name with the buffers of a dispatch plan, for replay.cu: the plan picks the kernel, the
// grid and every buffer; this only maps a name to its __global__ launcher, whose parameters are
// the Metal kernel's buffers in [[buffer(i)]] order (the parameter struct by value at its index).
// Dense problems only: the launchers' trailing `table` (a varlen pass's sequence table) is null,
// and the KV-cache launchers are not listed.
#include "kernels.cu"

#include "launch_table.h"

#include <cstring>
#include <tuple>
#include <utility>

namespace {

// The launcher argument at position I: the parameter struct, a buffer bound at [[buffer(I)]], or
// null for the varlen sequence table.
template <typename A>
A argument(void *const *buffers, size_t index, const FlashAttentionParams &params) {
    if constexpr (std::is_same_v<A, FlashAttentionParams>) {
        return params;
    } else if constexpr (std::is_same_v<A, FlashAttentionParams *>) {
        return nullptr;
    } else {
        return static_cast<A>(buffers[index]);
    }
}

template <typename... Args, size_t... I>
cudaError_t launch_with(void (*kernel)(Args...), dim3 grid, dim3 block, void *const *buffers,
                        const FlashAttentionParams &params, std::index_sequence<I...>) {
    // As kernels.cu's launches: the function constants the Metal plan specialises for, from params.
    if (const cudaError_t error = specialise(params); error != cudaSuccess) {
        return error;
    }
    kernel<<<grid, block>>>(argument<Args>(buffers, I, params)...);
    return cudaGetLastError();
}

template <typename... Args>
constexpr size_t arity(void (*)(Args...)) {
    return sizeof...(Args);
}

template <auto Kernel>
cudaError_t launch(dim3 grid, dim3 block, void *const *buffers, const FlashAttentionParams &params) {
    return launch_with(Kernel, grid, block, buffers, params, std::make_index_sequence<arity(Kernel)>{});
}

// dsinks' CUDA launcher takes only the float32 buffers the kernel reads.
cudaError_t launch_dsinks(dim3 grid, dim3 block, void *const *buffers, const FlashAttentionParams &params) {
    if (const cudaError_t error = specialise(params); error != cudaSuccess) {
        return error;
    }
    auto at = [&](int index) { return static_cast<float *>(buffers[index]); };
    fa_cuda_backward_dsinks_kernel<<<grid, block>>>(at(FA_BACKWARD_BUFFER_LSE), params, at(FA_BACKWARD_BUFFER_DELTA),
                                                    at(FA_BACKWARD_BUFFER_SINKS),
                                                    at(FA_BACKWARD_BUFFER_LSE_RESIDUAL),
                                                    at(FA_BACKWARD_BUFFER_DSINKS));
    return cudaGetLastError();
}

struct Entry {
    const char *name;
    cudaError_t (*launch)(dim3, dim3, void *const *, const FlashAttentionParams &);
};

#define FA_REPLAY_NAME(KERNEL, SUFFIX, DP) "flash_attention_" #KERNEL "_" #SUFFIX "_d" #DP
#define FA_REPLAY_ENTRY(KERNEL, SUFFIX, DP) {FA_REPLAY_NAME(KERNEL, SUFFIX, DP), &launch<fa_cuda_##KERNEL##_##SUFFIX##_d##DP>},
#define FA_REPLAY_BUCKET(SUFFIX, DP, ...)                                                          \
    FA_REPLAY_ENTRY(forward, SUFFIX, DP)                                                           \
    FA_REPLAY_ENTRY(forward_split, SUFFIX, DP)                                                     \
    FA_IF_DECODE(DP, FA_REPLAY_ENTRY(forward_decode, SUFFIX, DP))                                  \
    FA_REPLAY_ENTRY(backward_lse_residual, SUFFIX, DP)                                             \
    FA_REPLAY_ENTRY(backward_dq, SUFFIX, DP)                                                       \
    FA_REPLAY_ENTRY(backward_dkv, SUFFIX, DP)                                                      \
    FA_REPLAY_ENTRY(backward_dkv_split, SUFFIX, DP)
#define FA_REPLAY_F16(...) FA_REPLAY_BUCKET(f16, __VA_ARGS__)
#define FA_REPLAY_BF16(...) FA_REPLAY_BUCKET(bf16, __VA_ARGS__)
#define FA_REPLAY_F32(...) FA_REPLAY_BUCKET(f32, __VA_ARGS__)
#define FA_REPLAY_DTYPE(SUFFIX)                                                                    \
    {"flash_attention_forward_combine_" #SUFFIX, &launch<fa_cuda_forward_combine_##SUFFIX>},       \
    {"flash_attention_backward_delta_" #SUFFIX, &launch<fa_cuda_backward_delta_##SUFFIX>},       \
    {"flash_attention_backward_dkv_reduce_" #SUFFIX, &launch<fa_cuda_backward_dkv_reduce_##SUFFIX>},
const Entry kEntries[] = {
    FA_HEAD_DIM_BUCKETS(FA_REPLAY_F16) FA_HEAD_DIM_BUCKETS(FA_REPLAY_BF16) FA_HEAD_DIM_BUCKETS_F32(FA_REPLAY_F32)
    FA_REPLAY_DTYPE(f16) FA_REPLAY_DTYPE(bf16) FA_REPLAY_DTYPE(f32)
    {"flash_attention_backward_dsinks", &launch_dsinks},
};
#undef FA_REPLAY_DTYPE
#undef FA_REPLAY_F32
#undef FA_REPLAY_BF16
#undef FA_REPLAY_F16
#undef FA_REPLAY_BUCKET
#undef FA_REPLAY_ENTRY
#undef FA_REPLAY_NAME

}  // namespace

cudaError_t fa_cuda_launch(const char *kernel_name, dim3 grid, dim3 block, void *const *buffers,
                           const FlashAttentionParams &params) {
    for (const Entry &entry : kEntries) {
        if (std::strcmp(entry.name, kernel_name) == 0) {
            return entry.launch(grid, block, buffers, params);
        }
    }
    return cudaErrorInvalidDeviceFunction;
}
