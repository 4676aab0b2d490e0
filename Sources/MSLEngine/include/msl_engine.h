/*
 * The CPU threadgroup engine: runs Metal Shading Language kernels, compiled as C++ against the
 * project's <metal_stdlib> compatibility header, with Metal's execution model: a grid of
 * threadgroups spread over worker threads (one per core); the threads of a threadgroup are fibers
 * sharing threadgroup memory; barriers; SIMD-groups of 32 lanes.
 */
#ifndef MSL_ENGINE_H
#define MSL_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum msl_engine_status {
    MSL_ENGINE_SUCCESS = 0,
    MSL_ENGINE_UNKNOWN_KERNEL = 1,
    MSL_ENGINE_INVALID_DISPATCH = 2,          /* zero sizes, > 1024 threads, missing buffers */
    MSL_ENGINE_THREADGROUP_MEMORY_EXCEEDED = 3, /* > 32 KiB */
    MSL_ENGINE_BARRIER_DIVERGENCE = 4,        /* a barrier not reached by every thread, or at different sites */
    MSL_ENGINE_SIMDGROUP_DIVERGENCE = 5,      /* a SIMD-group function not reached by every lane alike */
    MSL_ENGINE_OUT_OF_MEMORY = 6
} msl_engine_status;

/* A buffer bound at index i of the kernel's [[buffer(i)]] arguments. */
typedef struct msl_engine_buffer {
    void *contents;
    size_t length; /* bytes */
} msl_engine_buffer;

typedef struct msl_engine_size {
    uint32_t width;
    uint32_t height;
    uint32_t depth;
} msl_engine_size;

/* Runs kernel_name over threadgroups_per_grid threadgroups of threads_per_threadgroup threads,
 * like dispatchThreadgroups:threadsPerThreadgroup:. buffers[i] is bound at [[buffer(i)]].
 * Returns when every threadgroup has finished or the first error stopped the dispatch; on error a
 * message naming the kernel (and the source line, where there is one) is written to message
 * (NUL-terminated, truncated to message_capacity; message may be null). Thread-safe. */
msl_engine_status msl_engine_dispatch(const char *kernel_name,
                                      const msl_engine_buffer *buffers, uint32_t buffer_count,
                                      msl_engine_size threadgroups_per_grid,
                                      msl_engine_size threads_per_threadgroup,
                                      char *message, size_t message_capacity);

/* Whether a kernel of that name is registered. */
int msl_engine_has_kernel(const char *kernel_name);

/* Worker threads a dispatch uses (the number of cores). */
uint32_t msl_engine_worker_count(void);

#ifdef __cplusplus
}
#endif

#endif
