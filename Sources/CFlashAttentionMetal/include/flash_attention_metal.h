/*
 * libFlashAttentionMetal: exact, memory-efficient attention for Apple GPUs, with a CPU engine that
 * runs the same Metal kernels anywhere. This header is the one ABI contract for C, C++,
 * Objective-C, Swift and Python (whose cffi binding reads the declarations between the
 * FA_CDEF_BEGIN and FA_CDEF_END markers; keep them free of preprocessor lines).
 *
 * Math: FlashAttention-2 (Dao, 2023), Algorithm 1 (forward) and Algorithm 2 (backward).
 *
 * Tensors (element type problem->dtype: float16, bfloat16 or float32, the same for all of them):
 *   q, dq             [batch][num_heads][seqlen_q][head_dim]
 *   out, dout         [batch][num_heads][seqlen_q][head_dim_v]
 *   k, dk             [batch][num_kv_heads][seqlen_k][head_dim]
 *   v, dv             [batch][num_kv_heads][seqlen_k][head_dim_v]
 *   lse               float32, contiguous [batch][num_heads][seqlen_q]
 * Each tensor but lse is laid out by its fa_strides (default: contiguous, row-major): any layout
 * whose last axis is contiguous, e.g. FlashAttention's (batch, seqlen, heads, head_dim) or a slice
 * q = qkv[:, :, 0] of a packed projection, is used in place. Pointers point at element [0][0][0][0].
 * Products accumulate in float32; each output is rounded to its dtype once (to nearest even).
 * lse is the natural log of sum_j exp(softmax_scale * q_i . k_j) over the keys row i sees.
 * causal masks are aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
 * A row that sees no key gets out = 0, lse = -inf and zero gradients.
 * GQA/MQA: num_heads % num_kv_heads == 0; query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Outputs must not overlap: no output of a call (out, lse, dq, dk, dv, dsinks) may share a byte
 * with another output or an input of that call, the buffers being the bytes from each one's first
 * to its last element as its strides lay it out (so interleaved slices of one packed buffer count
 * as overlapping, as NumPy's may_share_memory says). Checked before anything runs:
 * FA_STATUS_INVALID_ARGUMENT, e.g. "out must not overlap k", nothing written.
 *
 * Errors: every function returns an fa_status; on failure fa_last_error_message() (per thread)
 * says what was wrong, naming the argument and the rule. Output buffers of a call that fails after
 * validation are filled with NaN so that nothing half-written looks valid. No function aborts or
 * prints.
 */
#ifndef FLASH_ATTENTION_METAL_H
#define FLASH_ATTENTION_METAL_H

#include <stddef.h>
#include <stdint.h>

/* The version of this header and of the library built with it, "MAJOR.MINOR.PATCH": the project's
 * one definition of its version (fa_version() returns it; the Python package takes its version from
 * this line). "Since" notes below name the version that added a declaration. */
#define FA_VERSION "0.3.0"

#ifdef __cplusplus
extern "C" {
#endif

/* FA_CDEF_BEGIN */

/* Result of every call. */
typedef enum fa_status {
    FA_STATUS_SUCCESS = 0,
    FA_STATUS_INVALID_ARGUMENT = 1,    /* a null pointer, a bad dimension or scale */
    FA_STATUS_UNSUPPORTED = 2,         /* valid but outside what the kernels support (head_dim) */
    FA_STATUS_BACKEND_UNAVAILABLE = 3, /* e.g. FA_BACKEND_METAL where Metal is absent */
    FA_STATUS_OUT_OF_MEMORY = 4,
    FA_STATUS_EXECUTION_FAILED = 5,    /* the device or the CPU engine reported an error */
    FA_STATUS_INTERNAL_ERROR = 6,
    FA_STATUS_CANCELLED = 7            /* fa_context_cancel stopped the call; its outputs hold NaN */
} fa_status;

typedef enum fa_backend {
    FA_BACKEND_AUTO = 0,  /* Metal where available, else CPU */
    FA_BACKEND_METAL = 1, /* an Apple GPU through Metal */
    FA_BACKEND_CPU = 2    /* the CPU engine running the same .metal kernels */
} fa_backend;

/* Opaque. A context may be used from several threads at once. */
typedef struct fa_context fa_context;

/* Element type of q, k, v, out, dout, dq, dk, dv. bfloat16 needs MSL 3.1 on the Metal backend
 * (macOS 14, iOS 17); below that a bfloat16 call fails with FA_STATUS_UNSUPPORTED. */
typedef enum fa_dtype {
    FA_DTYPE_FLOAT16 = 0,
    FA_DTYPE_BFLOAT16 = 1,
    FA_DTYPE_FLOAT32 = 2
} fa_dtype;

/* Element strides of a [batch][heads][seqlen][head_dim] tensor whose last axis is contiguous:
 * element (b, h, i, d) is at b * batch + h * head + i * seq + d. All three 0 means contiguous
 * row-major. Otherwise each must be at least 1, and a written tensor must not overlap itself. */
typedef struct fa_strides {
    int64_t batch;
    int64_t head;
    int64_t seq;
} fa_strides;

/* Kinds of attn_mask (PyTorch's conventions). Scores are s = softcap(softmax_scale * q . k)
 * - slope * |i + seqlen_k - seqlen_q - j| + additive mask; keys hidden by the window, the causal mask
 * or a boolean mask get no weight. A row left without keys gets out 0, lse -inf (or the sink's
 * logit with sinks) and zero gradients. */
typedef enum fa_attn_mask_type {
    FA_ATTN_MASK_NONE = 0,
    FA_ATTN_MASK_BOOL = 1,             /* uint8_t, nonzero = may attend */
    FA_ATTN_MASK_ADDITIVE = 2,         /* elements of problem->dtype, added to the scores */
    FA_ATTN_MASK_ADDITIVE_FLOAT32 = 3  /* float, added to the scores */
} fa_attn_mask_type;

/* One attention problem. Set struct_size to sizeof(fa_problem) so the ABI can grow: a caller
 * whose struct_size ends before a field gets that field's default (0.1 callers: float16,
 * head_dim_v = head_dim, contiguous tensors). */
typedef struct fa_problem {
    uint32_t struct_size;
    uint32_t batch;
    uint32_t num_heads;
    uint32_t num_kv_heads;
    uint32_t seqlen_q;
    uint32_t seqlen_k;
    uint32_t head_dim;      /* of q and k: 1 ... fa_max_head_dim() */
    uint32_t causal;        /* 0 or 1 */
    float softmax_scale;    /* finite; the usual value is 1 / sqrt(head_dim) */
    /* Since 0.2.0. */
    uint32_t dtype;         /* fa_dtype; default FA_DTYPE_FLOAT16 */
    uint32_t head_dim_v;    /* of v, out, dout, dv: 1 ... fa_max_head_dim(); 0 means head_dim */
    fa_strides q;           /* the layouts; all-zero strides mean contiguous */
    fa_strides k;
    fa_strides v;
    fa_strides out;
    fa_strides dout;        /* backward only, like dq, dk, dv */
    fa_strides dq;
    fa_strides dk;
    fa_strides dv;
    /* Masks and score modifiers; zero-initialised fields leave them off. */
    uint32_t use_window;    /* 1: FlashAttention's sliding window (window_left, window_right) */
    int32_t window_left;    /* query i sees key j iff i + s - window_left <= j <= i + s + window_right, */
    int32_t window_right;   /* s = seqlen_k - seqlen_q; -1 = unbounded side; causal = window_right 0 */
    float softcap;          /* > 0: scores become softcap * tanh(score / softcap); 0: off */
    uint32_t attn_mask_type;        /* fa_attn_mask_type */
    const void *attn_mask;          /* element (b, h, i, j) at b*strides.batch + h*strides.head */
    fa_strides attn_mask_strides;   /* + i*strides.seq + j; a 0 stride broadcasts that axis */
    const float *alibi_slopes;      /* NULL, or [num_heads] or [batch][num_heads] float32 */
    uint32_t alibi_per_batch;       /* 1: alibi_slopes is [batch][num_heads] */
    const float *sinks;             /* NULL, or [num_heads] float32 logits of one virtual key per head */
    float *dsinks;                  /* backward with sinks: [num_heads] float32 output */
} fa_problem;

/* The library's version, FA_VERSION of the header it was built with. Static storage. */
const char *fa_version(void);

/* Largest head_dim and head_dim_v the kernels support. */
uint32_t fa_max_head_dim(void);

/* A short name for a status, e.g. "FA_STATUS_UNSUPPORTED". Static storage. */
const char *fa_status_name(fa_status status);

/* The message of the last failed call on this thread ("" if none). Valid until the next call on
 * this thread. */
const char *fa_last_error_message(void);

/* Creates a context for backend. On success *out_context owns a device, a command queue and the
 * compiled kernels (Metal) or the CPU engine. FA_BACKEND_AUTO never fails where the CPU engine works:
 * it falls back to it when Metal cannot run the kernels (see fa_context_backend_note). Errors:
 * INVALID_ARGUMENT (null out_context, unknown backend), BACKEND_UNAVAILABLE (FA_BACKEND_METAL: no
 * Metal, or no Apple-silicon GPU), EXECUTION_FAILED (FA_BACKEND_METAL: the shaders do not compile). */
fa_status fa_context_create(fa_backend backend, fa_context **out_context);

/* Destroys a context; null is ignored. */
void fa_context_destroy(fa_context *context);

/* "metal" or "cpu" (for FA_BACKEND_AUTO: the backend of the latest call). Static storage; null for
 * a null context. */
const char *fa_context_backend_name(const fa_context *context);

/* The device: the Metal device name, or a description of the CPU engine. Valid while the context
 * lives; null for a null context. */
const char *fa_context_device_name(const fa_context *context);

/* Why the backend is what it is, for users; "" when there is nothing to say. Metal: where the
 * kernels came from (a precompiled .metallib next to the library, or the embedded source compiled
 * when the context was created). FA_BACKEND_AUTO on the CPU engine: why Metal is not used (no Metal
 * device, not an Apple-silicon GPU, the shaders did not compile, a kernel's pipeline could not be
 * built, the device was lost). Can change after a call of an FA_BACKEND_AUTO context; each text
 * stays valid while the context lives. Null for a null context. */
const char *fa_context_backend_note(const fa_context *context);

/* Cancels the calls in flight on context: every fa_forward, fa_backward or merge that started on
 * it before this call stops early (the CPU engine within its current threadgroups, Metal before its
 * next command buffer) and returns FA_STATUS_CANCELLED with its outputs filled with NaN, unless it
 * had already finished its work. Calls that start afterwards run normally. Thread-safe, lock-free;
 * returns at once without waiting for the calls to stop. Errors: INVALID_ARGUMENT (null context). */
fa_status fa_context_cancel(fa_context *context);

/* Forward pass: out = softmax(softmax_scale * q k^T, masked) v, and lse.
 * Tensors as described above (elements of problem->dtype); out and lse must not overlap each other
 * or q, k, v, attn_mask, alibi_slopes, sinks. Errors: INVALID_ARGUMENT, UNSUPPORTED,
 * EXECUTION_FAILED, CANCELLED. */
fa_status fa_forward(fa_context *context, const fa_problem *problem,
                     const void *q, const void *k, const void *v,
                     void *out, float *lse);

/* Backward pass: dq, dk, dv from dout and the q, k, v, out, lse of the forward pass
 * (FlashAttention-2, Dao 2023, Algorithm 2: P = exp(S - lse), D = rowsum(dout * out)).
 * dk and dv sum over the query heads that share a KV head. Deterministic.
 * Where |lse| >= 256, float32 lse may have lost part of log(row sum) beside the row max (a row
 * whose every key gets -FLT_MAX from an additive mask: lse rounds to the max). For such rows the
 * backward recomputes the softmax normaliser from the scores when lse is the one fa_forward gives
 * these keys: equal to it, or within 4-8 ulp for seqlen_q <= 8 (the split-KV forward merges
 * chunks in another order). Any other lse, such as the lse of a longer row in blockwise or ring
 * attention over key blocks, is used as given, except where it rounds to the block's own value
 * (e.g. -FLT_MAX over every block): then the block's own normaliser is used.
 * lse must be what fa_forward returned: a NaN or +inf element, or -inf on a row that sees a key
 * (one that its causal mask, window and attn_mask leave visible, or a sink whose logit is not
 * -inf), is INVALID_ARGUMENT naming the element, e.g. "lse[0][3][17] is -inf, but that query row
 * sees key 0 ...". The library reads lse (and, for -inf rows, their attn_mask row) before any
 * kernel runs; the kernels also give a row whose lse is not finite a zero gradient, so no NaN or
 * inf reaches dq, dk, dv or dsinks from lse.
 * Errors: INVALID_ARGUMENT, UNSUPPORTED, EXECUTION_FAILED, CANCELLED. */
fa_status fa_backward(fa_context *context, const fa_problem *problem,
                      const void *dout, const void *q, const void *k, const void *v,
                      const void *out, const float *lse,
                      void *dq, void *dk, void *dv);

/* Merges two attention results over disjoint key sets of the same queries into the result over
 * their union: the log-sum-exp combine of split-KV decoding and ring attention (FlashAttention-2's
 * online-softmax rescaling applied to whole parts). Per row, with m = max(lse_a, lse_b),
 * w_a = exp(lse_a - m), w_b = exp(lse_b - m):
 *   out = (w_a out_a + w_b out_b) / (w_a + w_b),   lse = m + log(w_a + w_b),
 * computed in float32 and rounded once to dtype. A part with lse = -inf (it saw no key)
 * contributes nothing and its out is not used (it may hold anything, NaN included); a row that is
 * empty in both parts gets out = 0 and lse = -inf; no NaN comes from -inf. A NaN lse propagates.
 * Layout: out_a, out_b, out [rows][head_dim] elements of dtype (an fa_dtype: float16, bfloat16 or
 * float32); lse_a, lse_b, lse float32 [rows]. The out and lse of fa_forward are such arrays with
 * rows = batch * num_heads * seqlen_q, so merging fa_forward over keys k[:, :, :s] with fa_forward
 * over k[:, :, s:] gives fa_forward over all keys (for causal masks, choose parts whose masks are
 * the restriction of the full mask). rows in 1 ... 2^32 - 1, head_dim in 1 ... fa_max_head_dim().
 * Errors: INVALID_ARGUMENT (also for an output overlapping another argument, see fa_forward),
 * UNSUPPORTED, EXECUTION_FAILED, CANCELLED. Since 0.3.0. */
fa_status fa_merge_attention_v2(fa_context *context, uint64_t rows, uint32_t head_dim, uint32_t dtype,
                                const void *out_a, const float *lse_a,
                                const void *out_b, const float *lse_b,
                                void *out, float *lse);

/* fa_merge_attention_v2 with dtype FA_DTYPE_FLOAT16 (the 0.2 entry point; float16 as uint16_t bit
 * patterns). */
fa_status fa_merge_attention(fa_context *context, uint64_t rows, uint32_t head_dim,
                             const uint16_t *out_a, const float *lse_a,
                             const uint16_t *out_b, const float *lse_b,
                             uint16_t *out, float *lse);

/* Profiling. A context keeps, for each thread, the profile of that thread's last successful
 * fa_forward, fa_backward or fa_merge_attention on it: the kernels it dispatched, in order, and
 * the time they took. A failed call leaves the previous profile in place. Read it on the thread
 * that made the call: fa_context_last_profile gives the time and the number of dispatches, then
 * fa_context_last_profile_dispatch reads dispatch 0 ... dispatch_count - 1 (the two agree as long
 * as the thread makes no call on the context in between). */

/* The time of the last call. Set struct_size to sizeof(fa_profile) so the ABI can grow; the
 * library fills the fields it knows and leaves struct_size as it is. */
typedef struct fa_profile {
    uint32_t struct_size;
    uint32_t dispatch_count; /* kernels the call dispatched; 0 when this thread has no successful
                                call on the context yet (then seconds is 0) */
    double seconds;          /* Metal: GPU time of the call's command buffers, gpuEndTime -
                                gpuStartTime summed over them. CPU engine: the engine's wall time
                                of the call's dispatches, summed. */
    uint32_t command_buffers; /* pieces the pass ran in: Metal, one command buffer each (ranges of
                                 batch entries or KV heads of at most 2^35 FLOP, against the GPU
                                 watchdog); CPU engine, 1. 0 when dispatch_count is 0. */
} fa_profile;

/* One dispatched kernel of the last call. Set struct_size to sizeof(fa_dispatch_profile).
 * Counters the backend cannot measure are UINT64_MAX (Metal: both counters) and times it cannot
 * measure are NaN (Metal: per-dispatch seconds; only the call's total is timed). */
typedef struct fa_dispatch_profile {
    uint32_t struct_size;
    uint32_t threadgroups_per_grid[3];      /* x, y, z, as in dispatchThreadgroups */
    uint32_t threads_per_threadgroup[3];    /* x, y, z */
    uint32_t threadgroup_memory_length;     /* bytes of static threadgroup memory: Metal, the
                                               pipeline's staticThreadgroupMemoryLength; CPU
                                               engine, the kernel's threadgroup storage */
    uint64_t simdgroup_multiply_accumulates; /* 8x8x8 simdgroup_multiply_accumulate and
                                                simdgroup_multiply products executed, one per
                                                SIMD-group call (CPU engine; UINT64_MAX on Metal) */
    uint64_t threadgroup_barriers;           /* threadgroup barriers executed, one per threadgroup
                                                and barrier (CPU engine; UINT64_MAX on Metal) */
    double seconds;                          /* wall time of this dispatch (CPU engine; NaN on
                                                Metal) */
    char kernel_name[64];                    /* NUL-terminated, e.g. "flash_attention_forward_f16_d64" */
    char specialization[128];                /* NUL-terminated: the function constants the kernel
                                                was compiled with, "name=value" separated by
                                                spaces (a bool as 0 or 1), e.g. "fa_mask_type=0
                                                fa_has_softcap=1"; empty for a kernel without */
} fa_dispatch_profile;

/* Fills *profile with the calling thread's last profile on context (see above).
 * Errors: INVALID_ARGUMENT (null context or profile, struct_size below sizeof(fa_profile)). */
fa_status fa_context_last_profile(const fa_context *context, fa_profile *profile);

/* Fills *dispatch with dispatch `index` (0-based, in dispatch order) of the calling thread's last
 * profile on context. Errors: INVALID_ARGUMENT (null context or dispatch, struct_size below
 * sizeof(fa_dispatch_profile), index not below the profile's dispatch_count). */
fa_status fa_context_last_profile_dispatch(const fa_context *context, uint32_t index,
                                           fa_dispatch_profile *dispatch);

/* FA_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif
