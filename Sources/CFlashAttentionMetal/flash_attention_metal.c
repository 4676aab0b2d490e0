/* dladdr is a GNU extension in glibc. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "flash_attention_metal.h"
#include "flash_attention_internal.h"

#include <dlfcn.h>
#include <string.h>

static _Thread_local char last_error[1024];

const char *fa_version(void) { return FA_VERSION; }

uint32_t fa_max_head_dim(void) { return FA_MAX_HEAD_DIM; }

const char *fa_status_name(fa_status status) {
    switch (status) {
    case FA_STATUS_SUCCESS: return "FA_STATUS_SUCCESS";
    case FA_STATUS_INVALID_ARGUMENT: return "FA_STATUS_INVALID_ARGUMENT";
    case FA_STATUS_UNSUPPORTED: return "FA_STATUS_UNSUPPORTED";
    case FA_STATUS_BACKEND_UNAVAILABLE: return "FA_STATUS_BACKEND_UNAVAILABLE";
    case FA_STATUS_OUT_OF_MEMORY: return "FA_STATUS_OUT_OF_MEMORY";
    case FA_STATUS_EXECUTION_FAILED: return "FA_STATUS_EXECUTION_FAILED";
    case FA_STATUS_INTERNAL_ERROR: return "FA_STATUS_INTERNAL_ERROR";
    case FA_STATUS_CANCELLED: return "FA_STATUS_CANCELLED";
    }
    return "FA_STATUS_UNKNOWN";
}

const char *fa_last_error_message(void) { return last_error; }

void fa_set_last_error(const char *message) {
    if (message == NULL) {
        last_error[0] = '\0';
        return;
    }
    strncpy(last_error, message, sizeof last_error - 1);
    last_error[sizeof last_error - 1] = '\0';
}

const char *fa_loaded_image_path(void) {
    Dl_info info;
    if (dladdr((const void *)&fa_loaded_image_path, &info) == 0) return NULL;
    return info.dli_fname;
}

#define FA_BUCKET_ROW(dmax, fbq, fbk, dqbq, dqbk, dkvbk, dkvbq) {dmax, fbq, fbk, dqbq, dqbk, dkvbk, dkvbq},
static const FlashAttentionBucket two_byte_table[] = {FA_HEAD_DIM_BUCKETS(FA_BUCKET_ROW)};
static const FlashAttentionBucket float_table[] = {FA_HEAD_DIM_BUCKETS_F32(FA_BUCKET_ROW)};
#undef FA_BUCKET_ROW
/* The largest head dims are the tables' last buckets (the kernels assert that none is larger). */
#define FA_BUCKET_MAX_ROW(dmax, fbq, fbk, dqbq, dqbk, dkvbk, dkvbq) || (dmax) == FA_BUCKET_LIMIT_
#define FA_BUCKET_LIMIT_ FA_MAX_HEAD_DIM
_Static_assert(0 FA_HEAD_DIM_BUCKETS(FA_BUCKET_MAX_ROW), "FA_MAX_HEAD_DIM must be a bucket of FA_HEAD_DIM_BUCKETS");
#undef FA_BUCKET_LIMIT_
#define FA_BUCKET_LIMIT_ FA_MAX_HEAD_DIM_F32
_Static_assert(0 FA_HEAD_DIM_BUCKETS_F32(FA_BUCKET_MAX_ROW),
               "FA_MAX_HEAD_DIM_F32 must be a bucket of FA_HEAD_DIM_BUCKETS_F32");
#undef FA_BUCKET_LIMIT_
#undef FA_BUCKET_MAX_ROW

int fa_bucket_for_head_dim(uint32_t dtype, uint32_t head_dim, FlashAttentionBucket *bucket) {
    const FlashAttentionBucket *table;
    size_t rows;
    switch (dtype) {
    case FA_DTYPE_F16:
    case FA_DTYPE_BF16:
        table = two_byte_table;
        rows = sizeof two_byte_table / sizeof two_byte_table[0];
        break;
    case FA_DTYPE_F32:
        table = float_table;
        rows = sizeof float_table / sizeof float_table[0];
        break;
    default:
        return 0;
    }
    if (head_dim == 0) return 0;
    for (size_t i = 0; i < rows; i++) {
        if (table[i].head_dim_max >= head_dim) {
            *bucket = table[i];
            return 1;
        }
    }
    return 0;
}

_Static_assert(offsetof(FlashAttentionParams, dkv_splits) + sizeof(fa_u32) + 4 == sizeof(FlashAttentionParams),
               "fa_params_field_bytes: dkv_splits must be FlashAttentionParams' last field, 4 bytes of padding "
               "after it");

#define FA_CONSTANT_ROW(INDEX, TYPE, NAME, VALUE) [INDEX] = {#NAME, #TYPE, FA_FUNCTION_CONSTANT_TYPE_##TYPE},
static const FlashAttentionFunctionConstant function_constants[] = {FA_FUNCTION_CONSTANTS(FA_CONSTANT_ROW)};
#undef FA_CONSTANT_ROW
#define FA_CONSTANT_ONE(INDEX, TYPE, NAME, VALUE) +1
_Static_assert(sizeof function_constants / sizeof function_constants[0] == FA_FUNCTION_CONSTANT_COUNT &&
                   0 FA_FUNCTION_CONSTANTS(FA_CONSTANT_ONE) == FA_FUNCTION_CONSTANT_COUNT,
               "FA_FUNCTION_CONSTANTS must number its constants 0 ... FA_FUNCTION_CONSTANT_COUNT - 1");
#undef FA_CONSTANT_ONE

int fa_function_constant(uint32_t index, FlashAttentionFunctionConstant *constant) {
    if (index >= FA_FUNCTION_CONSTANT_COUNT) return 0;
    *constant = function_constants[index];
    return 1;
}

uint32_t fa_function_constant_value(uint32_t index, const FlashAttentionParams *params) {
    const FlashAttentionParams p = *params;
    switch (index) {
#define FA_CONSTANT_CASE(INDEX, TYPE, NAME, VALUE) \
    case INDEX: return (uint32_t)(VALUE);
        FA_FUNCTION_CONSTANTS(FA_CONSTANT_CASE)
#undef FA_CONSTANT_CASE
    }
    return 0;
}

/* The catalogue's buffer lists, one array per kernel (T, the element type, does not matter here). */
#define FA_ACCESS_WRITES_read 0
#define FA_ACCESS_WRITES_write 1
#define FA_SPACE_CONSTANT_device_memory 0
#define FA_SPACE_CONSTANT_constant_memory 1
#define FA_SPACE_CONSTANT_constant_array 1
#define FA_KERNEL_BUFFER(INDEX, NAME, TYPE, ACCESS, SPACE) \
    {INDEX, #NAME, FA_ACCESS_WRITES_##ACCESS, FA_SPACE_CONSTANT_##SPACE},
#define FA_KERNEL_BUFFERS(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, ...) \
    static const FlashAttentionKernelBuffer KERNEL##_buffers[] = {BUFFERS(FA_KERNEL_BUFFER, T)};
FA_KERNELS(FA_KERNEL_BUFFERS)
#undef FA_KERNEL_BUFFERS
#undef FA_KERNEL_BUFFER
#define FA_CONSTANT_BIT(INDEX) | (1u << (INDEX))
#define FA_KERNEL_ROW(KERNEL, INSTANCES, BUFFERS, READS, STORAGE, BUILTINS, ...) \
    [FA_KERNEL_##KERNEL] = {#KERNEL, FA_KERNEL_INSTANCES_##INSTANCES, KERNEL##_buffers, \
                            sizeof KERNEL##_buffers / sizeof KERNEL##_buffers[0], 0u READS(FA_CONSTANT_BIT)},
static const FlashAttentionKernel kernels[] = {FA_KERNELS(FA_KERNEL_ROW)};
#undef FA_KERNEL_ROW
#undef FA_CONSTANT_BIT

int fa_kernel(uint32_t index, FlashAttentionKernel *kernel) {
    if (index >= FA_KERNEL_COUNT) return 0;
    *kernel = kernels[index];
    return 1;
}

_Static_assert(FA_DTYPE_FLOAT16 == FA_DTYPE_F16 && FA_DTYPE_BFLOAT16 == FA_DTYPE_BF16 &&
                   FA_DTYPE_FLOAT32 == FA_DTYPE_F32,
               "fa_dtype and the kernels' dtype numbers must agree");

_Static_assert(FA_ATTN_MASK_NONE == FA_MASK_NONE && FA_ATTN_MASK_BOOL == FA_MASK_BOOL &&
                   FA_ATTN_MASK_ADDITIVE == FA_MASK_ADDITIVE &&
                   FA_ATTN_MASK_ADDITIVE_FLOAT32 == FA_MASK_ADDITIVE_F32,
               "fa_attn_mask_type and the kernels' mask kinds must agree");

_Static_assert(FA_PLAN_BIND_ALIGNMENT == FA_CHUNK_BYTES, "the header's FA_PLAN_BIND_ALIGNMENT is FA_CHUNK_BYTES");

/* The Metal backend passes the parameter struct with setBytes, which takes at most 4 KB. */
_Static_assert(sizeof(FlashAttentionParams) < 4096, "FlashAttentionParams must stay below 4 KB");
