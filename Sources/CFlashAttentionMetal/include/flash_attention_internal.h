/* Internal to the library (not part of the ABI): the kernel parameter table for the Swift dispatch
 * plan, and the per-thread error message behind fa_last_error_message(). */
#ifndef FLASH_ATTENTION_INTERNAL_H
#define FLASH_ATTENTION_INTERNAL_H

#include "../../../Shaders/flash_attention_catalogue.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Linked inside the library only: not exported from the shared object. */
#define FA_INTERNAL __attribute__((visibility("hidden")))

/* One row of FA_HEAD_DIM_BUCKETS. */
typedef struct FlashAttentionBucket {
    uint32_t head_dim_max;
    uint32_t forward_block_q;  /* query rows per forward threadgroup */
    uint32_t forward_block_k;  /* keys per K/V tile */
    uint32_t dq_block_q;       /* query rows per backward dQ threadgroup */
    uint32_t dq_block_k;       /* keys per K/V tile */
    uint32_t dkv_block_k;      /* key rows per backward dK/dV threadgroup */
    uint32_t dkv_block_q;      /* query rows per Q/dO tile */
} FlashAttentionBucket;

/* The bytes of FlashAttentionParams up to its last field, dkv_splits (flash_attention_metal.c
 * checks that it is the last); the struct's tail padding follows (a Swift copy of the struct
 * carries whatever bytes its padding had, so exported parameter bytes zero it: equal plans export
 * equal bytes). */
static inline size_t fa_params_field_bytes(void) {
    return offsetof(FlashAttentionParams, dkv_splits) + sizeof(fa_u32);
}

/* Packed query rows per decode threadgroup, and its threadgroup bytes, for a bucket's head_dim_max;
 * whether the decode kernel serves packed_rows rows per KV head (group x seqlen_q) of that bucket. */
static inline uint32_t fa_decode_rows(uint32_t head_dim_max) { return FA_DECODE_ROWS(head_dim_max); }
static inline int fa_decode_serves(uint32_t head_dim_max, uint64_t packed_rows) {
    return FA_DECODE_SERVES(head_dim_max, packed_rows);
}
/* Whether the MMA decode serves a split problem that the decode kernel serves: a cache quantized to
 * bits bits, head_dim and head_dim_v of the bucket (FA_DECODE_MMA_SERVES). */
static inline int fa_decode_mma_serves(uint32_t head_dim_max, uint32_t head_dim, uint32_t head_dim_v, uint32_t bits,
                                       uint64_t packed_rows) {
    return FA_DECODE_MMA_SERVES(head_dim_max, head_dim, head_dim_v, bits, packed_rows);
}
static inline uint32_t fa_decode_threadgroup_bytes(uint32_t head_dim_max) {
    return FA_DECODE_THREADGROUP_BYTES(head_dim_max);
}
/* Packed query rows per spec threadgroup of a bucket (forward_block_q its forward rows), and whether
 * the spec kernel serves packed_rows rows per KV head of that bucket (FA_SPEC_SERVES). */
static inline uint32_t fa_spec_block_q(uint32_t forward_block_q) { return FA_SPEC_BLOCK_Q(forward_block_q); }
static inline int fa_spec_serves(uint32_t head_dim_max, uint32_t forward_block_q, uint64_t packed_rows) {
    return FA_SPEC_SERVES(head_dim_max, forward_block_q, packed_rows);
}

/* Threads per threadgroup of every kernel (FA_SIMDGROUPS SIMD-groups of 32). */
static inline uint32_t fa_threads_per_threadgroup(void) { return FA_THREADS_PER_THREADGROUP; }

/* The first bucket of dtype's table (FA_DTYPE_F16/BF16/F32) whose head_dim_max >= head_dim.
 * Returns 0 (and leaves *bucket alone) when head_dim is 0 or above the table's last bucket
 * (FA_MAX_HEAD_DIM; FA_MAX_HEAD_DIM_F32 for float32), or dtype is unknown. */
FA_INTERNAL int fa_bucket_for_head_dim(uint32_t dtype, uint32_t head_dim, FlashAttentionBucket *bucket);

/* The path of the file this library was loaded from (the shared library, or the app that links it
 * statically), as the dynamic loader gives it; NULL when it cannot say. Owned by the loader. */
FA_INTERNAL const char *fa_loaded_image_path(void);

/* One function constant of FA_FUNCTION_CONSTANTS (flash_attention_params.h). */
typedef struct FlashAttentionFunctionConstant {
    const char *name;      /* as the kernels spell it, e.g. "fa_mask_type" */
    const char *type_name; /* its MSL type: "bool" or "uint" */
    uint32_t type;         /* FA_FUNCTION_CONSTANT_TYPE_bool or FA_FUNCTION_CONSTANT_TYPE_uint */
} FlashAttentionFunctionConstant;

/* Fills *constant with the function constant at index (FA_FUNCTION_CONSTANT_*) and returns 1;
 * returns 0 when index is FA_FUNCTION_CONSTANT_COUNT or more. */
FA_INTERNAL int fa_function_constant(uint32_t index, FlashAttentionFunctionConstant *constant);

/* The value of the function constant at index for a call with *params (FA_FUNCTION_CONSTANTS'
 * VALUE; a bool's is 0 or 1); 0 for an index without a constant. */
FA_INTERNAL uint32_t fa_function_constant_value(uint32_t index, const FlashAttentionParams *params);

/* The kernel catalogue (FA_KERNELS, flash_attention_catalogue.h) for the dispatch plan: one row per
 * kernel, FA_KERNEL_<name> its index. */
#define FA_KERNEL_ID(KERNEL, ...) FA_KERNEL_##KERNEL,
enum { FA_KERNELS(FA_KERNEL_ID) FA_KERNEL_COUNT };
#undef FA_KERNEL_ID

/* How a kernel is instantiated: FA_KERNEL_INSTANCES_BUCKET, flash_attention_<name>_<dtype>_d<head_dim_max>
 * per bucket (DECODE_BUCKET: the buckets up to FA_DECODE_MAX_HEAD_DIM; DECODE_MMA_BUCKET: those of
 * FA_IF_DECODE_MMA; TENSOR_BUCKET: the half and
 * bfloat buckets of FA_TENSOR_BUCKET_MASK, in the tensor-op library); DTYPE,
 * flash_attention_<name>_<dtype>; ONCE, flash_attention_<name>. */
enum {
    FA_KERNEL_INSTANCES_bucket,
    FA_KERNEL_INSTANCES_decode_bucket,
    FA_KERNEL_INSTANCES_decode_mma_bucket,
    FA_KERNEL_INSTANCES_tensor_bucket,
    FA_KERNEL_INSTANCES_dtype,
    FA_KERNEL_INSTANCES_once
};

/* One buffer a kernel binds. */
typedef struct FlashAttentionKernelBuffer {
    uint32_t index;    /* [[buffer(index)]] */
    const char *name;  /* as the kernels spell it: "q", "lse", "mask", "kv_table", "params", ... */
    uint32_t writes;   /* 1: the kernel writes it */
    uint32_t constant; /* 1: the constant address space (the parameter struct) */
} FlashAttentionKernelBuffer;

/* One kernel of the catalogue. */
typedef struct FlashAttentionKernel {
    const char *name;                          /* e.g. "forward_split" */
    uint32_t instances;                        /* FA_KERNEL_INSTANCES_* */
    const FlashAttentionKernelBuffer *buffers; /* in [[buffer(i)]] order */
    uint32_t buffer_count;                     /* entries of buffers */
    uint32_t constants;                        /* bit i: reads function constant i (FA_FUNCTION_CONSTANTS) */
} FlashAttentionKernel;

/* Fills *kernel with catalogue row `index` (FA_KERNEL_*) and returns 1; 0 past the last row. */
FA_INTERNAL int fa_kernel(uint32_t index, FlashAttentionKernel *kernel);

/* Sets this thread's fa_last_error_message(); null clears it. Copies the text. */
FA_INTERNAL void fa_set_last_error(const char *message);

#ifdef __cplusplus
}
#endif

#endif
