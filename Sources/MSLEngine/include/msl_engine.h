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
    MSL_ENGINE_OUT_OF_MEMORY = 6,
    MSL_ENGINE_CANCELLED = 7,                 /* msl_engine_dispatch_cancellable: stopped before every threadgroup finished */
    MSL_ENGINE_FUNCTION_CONSTANT_UNSET = 8    /* a thread read a function constant the dispatch does not set (or sets
                                                 with another type) */
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

/* A function constant of a dispatch: the value of the kernel's MSL_FUNCTION_CONSTANT(index, type,
 * name) declaration (<metal_stdlib>), the engine's model of MSL's
 * `constant type name [[function_constant(index)]]`, which Metal fixes when it builds a pipeline
 * (MTLFunctionConstantValues). type is the declared type, value its bits (a bool's 0 or 1). */
typedef enum msl_engine_constant_type {
    MSL_ENGINE_CONSTANT_BOOL = 0,
    MSL_ENGINE_CONSTANT_UINT = 1
} msl_engine_constant_type;

typedef struct msl_engine_function_constant {
    uint32_t index;
    uint32_t type; /* msl_engine_constant_type */
    uint32_t value;
} msl_engine_function_constant;

/* Function constants one dispatch may set. */
#define MSL_ENGINE_MAX_FUNCTION_CONSTANTS 32u

/* Runs kernel_name over threadgroups_per_grid threadgroups of threads_per_threadgroup threads,
 * like dispatchThreadgroups:threadsPerThreadgroup:. buffers[i] is bound at [[buffer(i)]].
 * Returns when every threadgroup has finished or the first error stopped the dispatch; on error a
 * message naming the kernel (and the source line, where there is one) is written to message
 * (NUL-terminated, truncated to message_capacity; message may be null). Thread-safe.
 * Errors: MSL_ENGINE_UNKNOWN_KERNEL (name not registered); MSL_ENGINE_INVALID_DISPATCH (a zero
 * size, more than 1024 threads per threadgroup, fewer buffers than the kernel reads or a null
 * one); MSL_ENGINE_THREADGROUP_MEMORY_EXCEEDED (the kernel declares more than 32 KiB);
 * MSL_ENGINE_BARRIER_DIVERGENCE / MSL_ENGINE_SIMDGROUP_DIVERGENCE (a threadgroup broke the MSL
 * rules; the message names the threadgroup and the call sites); MSL_ENGINE_OUT_OF_MEMORY.
 * After an error, output buffers may be partly written. When several threadgroups fail, the one
 * with the lowest linear index (x fastest) is reported, so the message is deterministic. */
msl_engine_status msl_engine_dispatch(const char *kernel_name,
                                      const msl_engine_buffer *buffers, uint32_t buffer_count,
                                      msl_engine_size threadgroups_per_grid,
                                      msl_engine_size threads_per_threadgroup,
                                      char *message, size_t message_capacity);

/* Cancellation shared by the dispatches of one owner (the library keeps one per context): a counter
 * that cancelling advances. A dispatch is given the epoch read when its call started and stops once
 * the epoch has moved on, so a cancel stops the work in flight and never work started after it.
 * Zero-initialize it and touch `epoch` only through the two functions below (atomic, lock-free,
 * thread-safe). */
typedef struct msl_engine_cancellation {
    uint64_t epoch;
} msl_engine_cancellation;

/* The current epoch of cancellation. */
uint64_t msl_engine_cancellation_epoch(const msl_engine_cancellation *cancellation);

/* Advances the epoch: every dispatch started at an earlier epoch stops (see below).
 * Returns at once; it does not wait for the dispatches to stop. */
void msl_engine_cancel(msl_engine_cancellation *cancellation);

/* msl_engine_dispatch that cancellation can stop (null: never): every worker reads the epoch before
 * it starts a threadgroup and every few dozen fiber switches inside one, and stops once it differs
 * from start_epoch, abandoning the threadgroup it runs part-way (as after an error). Returns
 * MSL_ENGINE_CANCELLED (message: the kernel and how many threadgroups completed) when any
 * threadgroup was left unrun or unfinished; a cancel after the last threadgroup finished leaves a
 * successful dispatch. Everything else as msl_engine_dispatch. */
msl_engine_status msl_engine_dispatch_cancellable(const char *kernel_name,
                                                  const msl_engine_buffer *buffers,
                                                  uint32_t buffer_count,
                                                  msl_engine_size threadgroups_per_grid,
                                                  msl_engine_size threads_per_threadgroup,
                                                  const msl_engine_cancellation *cancellation,
                                                  uint64_t start_epoch,
                                                  char *message, size_t message_capacity);

/* msl_engine_dispatch_cancellable with function constants: constants[0 ... constant_count - 1]
 * (null when constant_count is 0) hold the values the kernel's function constants read, at most
 * MSL_ENGINE_MAX_FUNCTION_CONSTANTS with distinct indices. A thread that reads a constant the list
 * lacks, or has with another type, fails the dispatch with MSL_ENGINE_FUNCTION_CONSTANT_UNSET (the
 * message names the constant and its index): Metal refuses to build a pipeline whose kernel reads a
 * function constant without a value (MTLLibrary.makeFunction(name:constantValues:)); the engine
 * finds it when a thread reads it. A bad list (too long, an index twice, an unknown type, a bool
 * value other than 0 or 1) is MSL_ENGINE_INVALID_DISPATCH. The other dispatch functions set none. */
msl_engine_status msl_engine_dispatch_specialized(const char *kernel_name,
                                                  const msl_engine_buffer *buffers,
                                                  uint32_t buffer_count,
                                                  const msl_engine_function_constant *constants,
                                                  uint32_t constant_count,
                                                  msl_engine_size threadgroups_per_grid,
                                                  msl_engine_size threads_per_threadgroup,
                                                  const msl_engine_cancellation *cancellation,
                                                  uint64_t start_epoch,
                                                  char *message, size_t message_capacity);

/* Whether a kernel of that name is registered (1) or not (0). */
int msl_engine_has_kernel(const char *kernel_name);

/* The name of the index-th registered kernel (0-based, in registration order), or null when index
 * is not below the number of registered kernels: how a host lists the kernels (static storage). */
const char *msl_engine_kernel_name(size_t index);

/* A registered kernel, as its engine entry describes it. */
typedef struct msl_engine_kernel_info {
    uint32_t buffer_count;            /* buffers the kernel reads: indices 0..buffer_count-1 */
    size_t threadgroup_memory_length; /* bytes of threadgroup storage it declares */
    const char *file;                 /* where it is defined (static storage) */
    unsigned line;                    /* 0 when the entry does not say */
} msl_engine_kernel_info;

/* Fills *info for the kernel named kernel_name and returns 1; returns 0 when no kernel of that
 * name is registered (info untouched). */
int msl_engine_describe_kernel(const char *kernel_name, msl_engine_kernel_info *info);

/* Worker threads a dispatch uses: the value set with msl_engine_set_worker_count, else the number
 * of cores this process may run on. A dispatch never uses more workers than threadgroups. */
uint32_t msl_engine_worker_count(void);

/* Sets the number of worker threads for later dispatches; 0 restores one per core. Results do not
 * depend on it (threadgroups are independent); tests use it to show that. */
void msl_engine_set_worker_count(uint32_t workers);

/* Buffers whose device reads a dispatch counts: [[buffer(0)]] ... [[buffer(15)]]. */
#define MSL_ENGINE_COUNTED_BUFFERS 16

/* Whether the calling thread's later dispatches count the bytes their kernels read from each
 * buffer (msl_engine_dispatch_stats.device_bytes_read): 1 on, 0 off (the default). Off, a counted
 * load costs one test instead of finding its buffer, and the counts stay zero. */
void msl_engine_count_device_reads(int enabled);

/* What the calling thread's last msl_engine_dispatch did. */
typedef struct msl_engine_dispatch_stats {
    uint32_t workers;        /* OS threads that ran threadgroups */
    uint64_t threadgroups;   /* threadgroups run to completion */
    uint64_t fiber_switches; /* context switches between threads and the worker's own context
                                (each switch from one context to another counts one) */
    uint64_t simdgroup_multiply_accumulates; /* 8x8x8 simdgroup_multiply_accumulate and
                                                simdgroup_multiply products, one per SIMD-group
                                                collective (not one per lane) */
    uint64_t threadgroup_barriers; /* threadgroup_barrier releases, one per threadgroup and barrier
                                      (not one per thread) */
    uint64_t device_bytes_read[MSL_ENGINE_COUNTED_BUFFERS]; /* bytes the kernel read from buffer i
                                      ([[buffer(i)]], i < MSL_ENGINE_COUNTED_BUFFERS) through
                                      MSL_COUNT_DEVICE_READ, the hook the kernels' loaders call at
                                      each device load (a load outside every buffer is not counted);
                                      zero unless msl_engine_count_device_reads turned counting on */
    uint32_t function_constants_read; /* bit i: some thread read the dispatch's constants[i]
                                         (msl_engine_dispatch_specialized) */
    double seconds;          /* wall time of the dispatch */
} msl_engine_dispatch_stats;

/* Copies the statistics of the calling thread's last dispatch (zeros before the first one). */
void msl_engine_last_dispatch_stats(msl_engine_dispatch_stats *stats);

/* Apple GPU limits the engine enforces. */
#define MSL_ENGINE_MAX_THREADS_PER_THREADGROUP 1024u
#define MSL_ENGINE_MAX_THREADGROUP_MEMORY 32768u
#define MSL_ENGINE_SIMD_WIDTH 32u

#ifdef __cplusplus
}
#endif

#endif
