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
 * head_dim_v = head_dim, contiguous tensors). A struct_size above this library's sizeof(fa_problem)
 * (a newer header's) is accepted when every byte past it is zero, and is INVALID_ARGUMENT naming
 * the first non-zero byte otherwise (a field this library does not know is set). */
typedef struct fa_problem {
    uint32_t struct_size;
    uint32_t batch;
    uint32_t num_heads;
    uint32_t num_kv_heads;
    uint32_t seqlen_q;
    uint32_t seqlen_k;
    uint32_t head_dim;      /* of q and k: 1 ... fa_max_head_dim() (256 in float32) */
    uint32_t causal;        /* 0 or 1 */
    float softmax_scale;    /* finite; the usual value is 1 / sqrt(head_dim) */
    /* Since 0.2.0. */
    uint32_t dtype;         /* fa_dtype; default FA_DTYPE_FLOAT16 */
    uint32_t head_dim_v;    /* of v, out, dout, dv: 1 ... fa_max_head_dim() (256 in float32); 0 means head_dim */
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
    /* Since 0.4.0 (unreleased): k and v are KV caches (fa_forward only; flash_attn_with_kvcache's). With
     * kv_cache_rows 0 (the default) k and v are plain tensors. Otherwise batch element b attends
     * to its first seqlen_k cache rows:
     *  - contiguous (kv_block_table NULL): k is [batch][num_kv_heads][kv_cache_rows][head_dim]
     *    by its strides (seqlen_k <= kv_cache_rows);
     *  - paged: k is [kv_num_blocks][num_kv_heads][kv_cache_rows][head_dim] (kv_cache_rows = the
     *    page_block_size, any value >= 1; strides.batch between blocks), row t of batch element b
     *    in block kv_block_table[b * kv_max_blocks + t / kv_cache_rows], row t % kv_cache_rows;
     *    seqlen_k <= kv_max_blocks * kv_cache_rows; the entries that hold one of the seqlen_k rows
     *    must lie in [0, kv_num_blocks) (checked in host memory before any kernel runs; the
     *    kernels clamp every entry, so no table reads or writes out of bounds).
     * v likewise with head_dim_v. kv_bits 4 or 8: k and v hold mx.quantize's (affine) packed
     * uint32 words, head_dim * kv_bits / 32 per row, strides counted in words (each a multiple of
     * the words per row); k_scales, k_biases, v_scales, v_biases hold one element of dtype per
     * kv_group_size (32, 64 or 128) elements of a row, laid out like the words (a row's
     * head_dim / kv_group_size entries where its words are); element = scale * q + bias,
     * dequantized in registers. kv_bits 0: elements of dtype, scales and biases NULL.
     * Append a step's new rows into the cache (host memory) before the call. The Metal backend
     * reads a cache in place when its address is a multiple of the VM page (16 KiB on Apple
     * silicon) and the page-rounded span lies in one writable mapping, else copies it once per
     * call: allocate caches with mmap (MAP_ANON) or vm_allocate, bytes rounded up to a multiple
     * of 16384 (Apple's newBufferWithBytesNoCopy disallows malloc'd memory). */
    uint32_t kv_cache_rows;
    const int32_t *kv_block_table;  /* NULL (contiguous) or int32 [batch][kv_max_blocks] */
    uint32_t kv_max_blocks;
    uint32_t kv_num_blocks;
    uint32_t kv_bits;               /* 0, 4 or 8 */
    uint32_t kv_group_size;         /* 32, 64 or 128 when kv_bits != 0 */
    const void *k_scales;
    const void *k_biases;
    const void *v_scales;
    const void *v_biases;
    /* Added after 0.3.0: variable-length batches (FlashAttention's flash_attn_varlen_func). Both tables
     * NULL: a dense problem. Both given: `batch` sequences packed along the rows, seqlen_q = total_q
     * and seqlen_k = total_k rows in all; q (total_q, num_heads, head_dim), k (total_k,
     * num_kv_heads, head_dim), v (total_k, num_kv_heads, head_dim_v), out like q with head_dim_v,
     * lse float32 (num_heads, total_q); their fa_strides give the head and row (seq) strides, the
     * batch stride is ignored (all-zero strides: contiguous (total, heads, dim)). Sequence b is
     * query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]),
     * each attending only within itself with causal and the window bottom-right aligned per
     * sequence; alibi_slopes may be [batch][num_heads]; attn_mask must be NULL. A sequence may be
     * empty: its rows get out 0, lse -inf and zero gradients. The tables are int32 [batch + 1] in
     * host memory (device memory for the exported plan's hosts), starting at 0, non-decreasing,
     * ending at the totals; the library does not read their values on the host: the kernels clamp
     * each value into the tensors, so a wrong table gives wrong numbers and rows left unwritten,
     * never an access out of bounds (the Python package checks tables before the call). The pass
     * covers max_seqlen_q query rows (max_seqlen_k keys for dk, dv) per sequence: each must be at
     * least the longest sequence's length, at least 1 and at most the total. */
    const int32_t *cu_seqlens_q;
    const int32_t *cu_seqlens_k;
    uint32_t max_seqlen_q;
    uint32_t max_seqlen_k;
    /* Added after 0.3.0: dropout on the attention probabilities (FlashAttention's dropout_p), forward
     * and backward (pass the backward the forward's three values). dropout_p in [0, 1); 0 (the
     * default) is off. Each probability P[b, h, i, j] is dropped (0) or kept and multiplied by
     * 1 / (1 - dropout_p), after the softmax: out = (P * mask) V, lse of the undropped scores. The
     * mask is Philox-4x32-10 keyed by dropout_seed with a counter made from dropout_offset and
     * (b, h, i, j) (a varlen sequence: b its index, i and j counted in it); the mapping is
     * specified in Shaders/flash_attention_philox.h, so the backward regenerates the forward's mask
     * (nothing is stored) and every backend draws the same bits. Not with a KV cache
     * (INVALID_ARGUMENT naming dropout_p). */
    float dropout_p;
    uint64_t dropout_seed;
    uint64_t dropout_offset;
} fa_problem;

/* The library's version, FA_VERSION of the header it was built with. Static storage. */
const char *fa_version(void);

/* Largest head_dim and head_dim_v the kernels support (576) in float16 and bfloat16; float32 stops at
 * 256 (FA_STATUS_UNSUPPORTED above, naming head_dim and the dtype: its tiles would not fit 32 KiB). */
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

/* Where a GPU core count comes from (fa_gpu_cores). */
typedef enum fa_gpu_cores_source {
    FA_GPU_CORES_NOMINAL = 0,  /* FA_NOMINAL_GPU_CORES (10): the CPU engine, or no count from the device */
    FA_GPU_CORES_DEVICE = 1,   /* the Metal device's (the IORegistry's gpu-core-count) */
    FA_GPU_CORES_OVERRIDE = 2  /* the FLASH_ATTENTION_GPU_CORES environment variable */
} fa_gpu_cores_source;

/* The GPU core count the split-KV chunks are planned for now (docs/decode.md) and where it comes
 * from (an fa_gpu_cores_source), for calls on context, or for fa_plan_create's plans when context
 * is null (the Metal device the library runs on, as PyTorch's MPS and MLX's GPU paths use them).
 * FLASH_ATTENTION_GPU_CORES wins when set (it is read again at every call); then the device's count
 * (Metal); then the nominal GPU. A profile reports the count a call used (fa_profile.gpu_cores).
 * Errors: INVALID_ARGUMENT (null out_cores or out_source, FLASH_ATTENTION_GPU_CORES not a whole
 * number from 1 to 4096). */
fa_status fa_gpu_cores(const fa_context *context, uint32_t *out_cores, uint32_t *out_source);

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
 * lse is what fa_forward returned; its values are not checked (as FlashAttention and PyTorch): a
 * row whose lse is -inf (no visible key) gets zero gradients, one whose lse is NaN or +inf (a NaN
 * or +inf score; its out is NaN) NaN gradients for every key it sees (docs/semantics.md).
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
 * empty in both parts gets out = 0 and lse = -inf; no NaN comes from -inf. A NaN lse makes the
 * row's out and lse NaN; a +inf lse its out NaN and its lse +inf.
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
                                 batch entries, KV heads or blocks of rows of at most 2^35 FLOP,
                                 against the GPU watchdog); CPU engine, 1. 0 when dispatch_count
                                 is 0. */
    uint32_t gpu_cores;      /* GPU cores the split-KV chunks were planned for: FLASH_ATTENTION_GPU_CORES
                                when set, else the device's (Metal: the IORegistry's gpu-core-count),
                                else FA_NOMINAL_GPU_CORES (CPU engine); docs/decode.md. Added after
                                0.3.0 in what was padding: sizeof(fa_profile) is unchanged. 0
                                when dispatch_count is 0. */
} fa_profile;

/* Buffers whose device reads fa_dispatch_profile.device_bytes_read counts. */
enum { FA_PROFILE_COUNTED_BUFFERS = 16 };

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
    /* Added after 0.3.0 (a struct_size up to the end of specialization is still accepted, this left
     * alone): bytes the dispatch read from the buffer bound at [[buffer(i)]], i <
     * FA_PROFILE_COUNTED_BUFFERS, through the kernels' tile copies and decode slice loads (q, k,
     * v, out, dout). CPU engine with FLASH_ATTENTION_COUNT_DEVICE_READS=1 in the environment at
     * the call (counting slows the engine); UINT64_MAX otherwise and on Metal. */
    uint64_t device_bytes_read[FA_PROFILE_COUNTED_BUFFERS];
} fa_dispatch_profile;

/* Fills *profile with the calling thread's last profile on context (see above).
 * Errors: INVALID_ARGUMENT (null context or profile, struct_size below sizeof(fa_profile)). */
fa_status fa_context_last_profile(const fa_context *context, fa_profile *profile);

/* Fills *dispatch with dispatch `index` (0-based, in dispatch order) of the calling thread's last
 * profile on context. Errors: INVALID_ARGUMENT (null context or dispatch, struct_size below
 * sizeof(fa_dispatch_profile), index not below the profile's dispatch_count). */
fa_status fa_context_last_profile_dispatch(const fa_context *context, uint32_t index,
                                           fa_dispatch_profile *dispatch);

/* ---- The dispatch plan, exported ----
 *
 * Every call runs a plan: the list of kernel dispatches the library computes once for both of its
 * backends (kernel name, specialisation constants, grid, threadgroup size, which buffer is bound at
 * each [[buffer(i)]] and at what byte offset, the parameter bytes) plus the workspaces the kernels
 * share. A framework with its own Metal command encoder (PyTorch's torch.mps.compile_shader, MLX's
 * eval_gpu) builds the plan of a problem here, compiles fa_plan_kernel_source() (or loads
 * fa_plan_metallib_path()) and encodes the dispatches in order on its own buffers, so the kernels
 * run on the framework's stream without a copy or a synchronisation. On the host,
 * fa_plan_execute runs a plan on a context's backend (the CPU engine or Metal) with the caller's
 * buffers. Reading a plan: fa_plan_get_info, then fa_plan_get_buffer for 0 ... buffer_count - 1,
 * fa_plan_get_dispatch for 0 ... dispatch_count - 1 and, per dispatch, fa_plan_get_binding and
 * fa_plan_get_specialization. Every record struct starts with struct_size: set it to the sizeof of
 * the struct you pass (so the ABI can grow); the library fills the fields it knows and leaves
 * struct_size as it is. A plan is immutable and may be read from several threads at once. */

/* The passes a plan can be made for. */
typedef enum fa_pass {
    FA_PASS_FORWARD = 0,  /* q, k, v (+ attn_mask, alibi_slopes, sinks) -> out, lse */
    FA_PASS_BACKWARD = 1, /* dout, q, k, v, out, lse (+ the same options) -> dq, dk, dv (+ dsinks) */
    FA_PASS_MERGE = 2     /* out_a, lse_a, out_b, lse_b -> out, lse (fa_plan_create_merge) */
} fa_pass;

/* What a buffer of a plan holds. Tensors have the problem's dtype and layout (fa_problem); lse,
 * lse_a, lse_b and the workspaces are float32 (but the sequence table); attn_mask has its
 * fa_attn_mask_type's elements. Workspaces (written and read only by the plan's own kernels): delta
 * (D_i = rowsum(dout * out)) and lse_residual (backward), partial_out and partial_lse (the split-KV
 * forward of decode shapes), sequence_table (a variable-length pass), partial_dk and partial_dv
 * (the backward's dK/dV split over the GQA group, few KV heads). */
typedef enum fa_buffer_role {
    FA_BUFFER_ROLE_Q = 0,
    FA_BUFFER_ROLE_K = 1,
    FA_BUFFER_ROLE_V = 2,
    FA_BUFFER_ROLE_OUT = 3,
    FA_BUFFER_ROLE_LSE = 4,
    FA_BUFFER_ROLE_DOUT = 5,
    FA_BUFFER_ROLE_DQ = 6,
    FA_BUFFER_ROLE_DK = 7,
    FA_BUFFER_ROLE_DV = 8,
    FA_BUFFER_ROLE_DELTA = 9,
    FA_BUFFER_ROLE_LSE_RESIDUAL = 10,
    FA_BUFFER_ROLE_PARTIAL_OUT = 11,
    FA_BUFFER_ROLE_PARTIAL_LSE = 12,
    FA_BUFFER_ROLE_ATTN_MASK = 13,
    FA_BUFFER_ROLE_ALIBI_SLOPES = 14,
    FA_BUFFER_ROLE_SINKS = 15,
    FA_BUFFER_ROLE_DSINKS = 16,
    FA_BUFFER_ROLE_OUT_A = 17,
    FA_BUFFER_ROLE_LSE_A = 18,
    FA_BUFFER_ROLE_OUT_B = 19,
    FA_BUFFER_ROLE_LSE_B = 20,
    FA_BUFFER_ROLE_BLOCK_TABLE = 21,  /* int32 kv_block_table (fa_problem); the others below: */
    FA_BUFFER_ROLE_K_SCALES = 22,     /* a quantized KV cache's scales and biases */
    FA_BUFFER_ROLE_K_BIASES = 23,
    FA_BUFFER_ROLE_V_SCALES = 24,
    FA_BUFFER_ROLE_V_BIASES = 25,
    /* Added after 0.3.0: a variable-length pass (fa_problem's cu_seqlens_q and cu_seqlens_k). */
    FA_BUFFER_ROLE_CU_SEQLENS_Q = 26,   /* int32 [batch + 1] cu_seqlens_q, in the device's memory */
    FA_BUFFER_ROLE_CU_SEQLENS_K = 27,   /* int32 [batch + 1] cu_seqlens_k, likewise */
    FA_BUFFER_ROLE_SEQUENCE_TABLE = 28, /* workspace: [batch + 1] parameter structs (params_size bytes
                                           each), written by the pass's first dispatch from the two
                                           tables and bound by the others in place of their
                                           parameter bytes (fa_plan_dispatch.params_from_buffer) */
    /* Added after 0.3.0: the split dK/dV's partial sums (backward, few KV heads; workspaces). */
    FA_BUFFER_ROLE_PARTIAL_DK = 29,
    FA_BUFFER_ROLE_PARTIAL_DV = 30,
    FA_BUFFER_ROLE_COUNT = 31           /* 26 or 29 before those: fa_plan_execute takes each count */
} fa_buffer_role;

/* How a plan uses a buffer. */
typedef enum fa_buffer_usage {
    FA_BUFFER_INPUT = 0,    /* read only; the caller provides it */
    FA_BUFFER_OUTPUT = 1,   /* written (and possibly read back) by the kernels; the caller provides it */
    FA_BUFFER_WORKSPACE = 2, /* allocated by whoever runs the plan, for the duration of the pass; its
                                contents need no initialisation and are garbage afterwards */
    FA_BUFFER_READ_WRITE = 3 /* a KV cache's k, v (and a quantized cache's scales and biases) in a
                                forward pass: the caller's buffer, bound in place (never a fresh buffer
                                in its stead); the pass reads it and may write only the rows it appends
                                at cache_seqlens. No kernel appends yet (callers write new rows before
                                the pass), so a host that copies one in has nothing to copy back. The
                                read-write buffers may overlap one another, no other buffer. */
} fa_buffer_usage;

/* Types of specialisation constants (Metal function constants). */
typedef enum fa_specialization_type {
    FA_SPECIALIZATION_BOOL = 0,  /* MSL bool; value 0 or 1 */
    FA_SPECIALIZATION_UINT32 = 1 /* MSL uint */
} fa_specialization_type;

/* Opaque, immutable. */
typedef struct fa_plan fa_plan;

/* A plan as a whole. */
typedef struct fa_plan_info {
    uint32_t struct_size;
    uint32_t pass;           /* fa_pass */
    uint32_t dispatch_count; /* dispatches, to encode in order 0 ... dispatch_count - 1 */
    uint32_t buffer_count;   /* buffers (roles) the dispatches bind, workspaces included */
    uint32_t piece_count;    /* pieces the dispatches are grouped in (fa_plan_create) */
} fa_plan_info;

/* One buffer of a plan. */
typedef struct fa_plan_buffer {
    uint32_t struct_size;
    uint32_t role;          /* fa_buffer_role; each role appears once */
    uint32_t usage;         /* fa_buffer_usage */
    uint32_t element_size;  /* bytes per element */
    uint64_t byte_count;    /* bytes the kernels may touch from the buffer's start (its element
                               [0][0][0][0]): for a tensor, the span of its layout to its last
                               element; a workspace must have at least this many bytes */
} fa_plan_buffer;

/* One kernel dispatch: dispatchThreadgroups(threadgroups_per_grid, threads_per_threadgroup) of the
 * kernel kernel_name, specialised with its constants, buffers bound as its bindings say and
 * params_size bytes at params (copy them with setBytes) bound at [[buffer(params_index)]], unless
 * params_from_buffer says a binding holds the parameters there. The bindings and params_index
 * together cover every buffer index the kernel reads. A host whose grid is given in threads
 * (dispatchThreads) uses threadgroups_per_grid[i] * threads_per_threadgroup[i]. */
typedef struct fa_plan_dispatch {
    uint32_t struct_size;
    uint32_t piece;                      /* 0 ... piece_count - 1, non-decreasing over the dispatches */
    uint32_t threadgroups_per_grid[3];   /* x, y, z */
    uint32_t threads_per_threadgroup[3]; /* x, y, z */
    uint32_t binding_count;              /* fa_plan_get_binding 0 ... binding_count - 1 */
    uint32_t specialization_count;       /* fa_plan_get_specialization 0 ... count - 1 */
    uint32_t params_index;               /* [[buffer(params_index)]] takes the parameter bytes */
    uint32_t params_size;                /* bytes at params: the kernels' FlashAttentionParams
                                            (Shaders/flash_attention_params.h) with its tail
                                            padding, a multiple of 8 */
    const void *params;                  /* owned by the plan: valid while it lives */
    const char *kernel_name;             /* NUL-terminated; owned by the plan */
    const char *constants_prelude;       /* for hosts that cannot set function constants: the text
                                            to put before fa_plan_kernel_source() to compile this
                                            dispatch's kernel with its constants (see
                                            fa_plan_specialization); NUL-terminated, owned by the plan */
    /* Added after 0.3.0. 0: bind the params bytes at params_index. 1: one of the bindings is at
     * params_index (FA_BUFFER_ROLE_SEQUENCE_TABLE: the dispatches of a variable-length pass after
     * its first read their sequence's parameters from the table it writes); bind that buffer there
     * and not the bytes (params still holds the whole problem's struct, the table's entry 0).
     * fa_plan_get_dispatch refuses such a dispatch (INVALID_ARGUMENT) to a caller whose struct_size
     * ends before this field, so that a host that does not know it never binds the bytes instead. */
    uint32_t params_from_buffer;
} fa_plan_dispatch;

/* One buffer binding of a dispatch: the buffer of `role` at [[buffer(index)]], `byte_offset` bytes
 * from its start (setBuffer(_:offset:index:) with the role's buffer offset by byte_offset). Roles
 * the kernels do not read (an absent optional input) are bound to another buffer of the plan. */
typedef struct fa_plan_binding {
    uint32_t struct_size;
    uint32_t index;        /* [[buffer(index)]] */
    uint32_t role;         /* fa_buffer_role: one of the plan's buffers */
    uint64_t byte_offset;  /* from the start of the role's buffer; a multiple of its element size */
    uint64_t byte_length;  /* bytes from byte_offset the dispatch may touch */
} fa_plan_binding;

/* One specialisation constant of a dispatch: the value of a function constant its kernel reads
 * (exactly those are listed). Metal sets it with MTLFunctionConstantValues
 * (setConstantValue(_:type:index:), index `index`) when it makes the kernel's function. A host that
 * cannot (PyTorch's compile_shader) compiles the dispatch's constants_prelude followed by
 * fa_plan_kernel_source() instead: the preprocessor line that defines
 * FA_FUNCTION_CONSTANTS_PREDEFINED as 1, then "constant bool <name> = true|false;" or
 * "constant uint <name> = <value>;" for every function constant of the kernels in index order (the
 * dispatch's values; false or 0 for those its kernel does not read), and caches one compiled
 * library per prelude text. */
typedef struct fa_plan_specialization {
    uint32_t struct_size;
    uint32_t index;        /* [[function_constant(index)]] */
    uint32_t type;         /* fa_specialization_type */
    uint32_t value;        /* 0 or 1 for FA_SPECIALIZATION_BOOL */
    const char *name;      /* the constant's name in the kernel source; owned by the plan */
} fa_plan_specialization;

/* Makes the plan of `pass` (FA_PASS_FORWARD or FA_PASS_BACKWARD) for `problem`, validated exactly as
 * fa_forward and fa_backward validate it. Of the pointer fields only the presence is read (never the
 * memory): attn_mask (with attn_mask_type), alibi_slopes and sinks say whether those inputs exist,
 * any non-null value will do; dsinks is not read (the backward plan of a problem with sinks writes
 * the dsinks buffer); cu_seqlens_q and cu_seqlens_k make a variable-length plan (since after 0.3.0;
 * before, UNSUPPORTED), whose hosts bind the two tables as FA_BUFFER_ROLE_CU_SEQLENS_Q and _K, and
 * kv_block_table a paged KV cache's (FA_BUFFER_ROLE_BLOCK_TABLE). max_flops_per_piece: 0 gives one piece holding the whole pass; otherwise the
 * pass is cut into pieces of at most that many floating-point operations (ranges of batch entries or
 * of KV heads with their query heads; when one batch entry and KV head alone is larger, one dispatch
 * of it over a range of its query or key blocks, at least one block, the parameter bytes' block_offset
 * at the range's first block; a KV-cache problem only in such block ranges of the whole problem),
 * whose dispatches bind the buffers at the offsets of their range
 * (dispatches of pieces run in order): what the Metal backend does with 2^35 against the GPU
 * watchdog, one command buffer per piece. Pieces compute bit for bit what the whole pass computes.
 * The split-KV chunks are planned for fa_gpu_cores(NULL, ...): the Metal device the library runs on
 * (or FLASH_ATTENTION_GPU_CORES, or the nominal GPU). Its plans name no tensor-op kernel: a host
 * with the tensor-op library uses fa_plan_create_for.
 * Errors: INVALID_ARGUMENT (null problem or out_plan, an unknown pass, anything fa_forward or
 * fa_backward would refuse), UNSUPPORTED (head_dim), OUT_OF_MEMORY. The parameter bytes take the
 * kernels' FA_PLAN_BIND_ALIGNMENT-byte tile copies when head_dim, head_dim_v and every stride of q,
 * k, v, out and dout are multiples of FA_PLAN_BIND_ALIGNMENT bytes: a host that encodes the
 * dispatches itself then binds each of those tensors at such a boundary (copying a view that starts
 * elsewhere, e.g. x[..., 1:65]). */
fa_status fa_plan_create(const fa_problem *problem, fa_pass pass, uint64_t max_flops_per_piece,
                         fa_plan **out_plan);

/* Bytes the kernels' tile copies move per load (16; the kernels' FA_CHUNK_BYTES): see fa_plan_create.
 * Added after 0.3.0. */
enum { FA_PLAN_BIND_ALIGNMENT = 16 };

/* The Metal backend's work per command buffer against the GPU watchdog: 2^FA_PLAN_PIECE_FLOPS_LOG2
 * floating-point operations (2^35, about 15 ms at an M1's FP16 peak). A host that encodes a plan's
 * pieces itself passes it as fa_plan_create's max_flops_per_piece. Added after 0.3.0. */
enum { FA_PLAN_PIECE_FLOPS_LOG2 = 35 };

/* The Metal 4 tensor-op kernels (issue 37, docs/tensor-ops.md) for a host that encodes plans itself.
 * They are a library of their own, fa_plan_tensor_kernel_source(), compiled at MSL 4.0, so that a
 * compile failure loses only the tensor-op path. The host asks fa_tensor_ops_wanted whether to
 * compile it, then names what it has in an fa_plan_target for fa_plan_create_for; the plan takes the
 * tensor-op kernels (names with "_tensor_") where the route allows, as a Metal context does:
 * matrix units (architecture generation 17+, 18+ for a "p" suffix, on macOS/iOS 26.2+) with the
 * library compiled, or FLASH_ATTENTION_TENSOR_OPS=1 with it compiled; never with =0. */
typedef enum fa_tensor_library {
    FA_TENSOR_LIBRARY_NONE = 0,  /* the host compiled none (fa_tensor_ops_wanted said 0, or it cannot) */
    FA_TENSOR_LIBRARY_READY = 1, /* fa_plan_tensor_kernel_source() compiled: its kernels may be named */
    FA_TENSOR_LIBRARY_FAILED = 2 /* its compile (or a pipeline of it) failed; tensor_library_error says why */
} fa_tensor_library;

/* What the host encoding a plan offers (fa_plan_create_for). */
typedef struct fa_plan_target {
    uint32_t struct_size;             /* sizeof(fa_plan_target) */
    uint32_t tensor_library;          /* fa_tensor_library */
    const char *architecture;         /* MTLDevice.architecture.name of the GPU the host encodes on
                                         (e.g. "applegpu_g17s"); NULL: the library's Metal device's */
    const char *tensor_library_error; /* FA_TENSOR_LIBRARY_FAILED: the compiler's message (copied into
                                         the plan's route, fa_plan_tensor_ops); otherwise ignored */
} fa_plan_target;

/* *out_wanted = 1 where a host encoding on a GPU of `architecture` (NULL: the library's Metal
 * device) should compile fa_plan_tensor_kernel_source(): the GPU has matrix units, or
 * FLASH_ATTENTION_TENSOR_OPS is 1 on macOS/iOS 26.2 or later; 0 otherwise, and always with
 * FLASH_ATTENTION_TENSOR_OPS=0. The same
 * test a Metal context makes before compiling the library. Errors: INVALID_ARGUMENT (null out_wanted). */
fa_status fa_tensor_ops_wanted(const char *architecture, uint32_t *out_wanted);

/* fa_plan_create for a host that offers `target` (NULL: as fa_plan_create, no tensor-op library).
 * Errors: those of fa_plan_create; INVALID_ARGUMENT also for a target whose struct_size is below
 * sizeof(fa_plan_target), an unknown tensor_library, or FLASH_ATTENTION_TENSOR_OPS set to anything
 * but 0 or 1. */
fa_status fa_plan_create_for(const fa_problem *problem, fa_pass pass, uint64_t max_flops_per_piece,
                             const fa_plan_target *target, fa_plan **out_plan);

/* The plan's tensor-op route and why, for users: "tensor ops: ..." or "simdgroup kernels: ..."
 * (the override, the device's units, the library's compile error). NUL-terminated, owned by the
 * plan; NULL for a null plan. */
const char *fa_plan_tensor_ops(const fa_plan *plan);

/* The MSL source of the tensor-op kernels (Shaders/flash_attention_tensor.metal, the headers of
 * Shaders/ spliced in; it includes <MetalPerformancePrimitives/MetalPerformancePrimitives.h>):
 * compile it as MSL 4.0 or later, without fast math, as a library of its own; a plan's constants
 * prelude goes before it as before fa_plan_kernel_source(). Static storage; NULL only when out of
 * memory. */
const char *fa_plan_tensor_kernel_source(void);

/* Makes the FA_PASS_MERGE plan of fa_merge_attention for `rows` rows of `head_dim` elements (the
 * same rules). Errors: INVALID_ARGUMENT, UNSUPPORTED. */
fa_status fa_plan_create_merge(uint64_t rows, uint32_t head_dim, fa_plan **out_plan);

/* Destroys a plan; null is ignored. The pointers it handed out become invalid. */
void fa_plan_destroy(fa_plan *plan);

/* Fills *info. Errors: INVALID_ARGUMENT (null plan or info, struct_size below sizeof(fa_plan_info)). */
fa_status fa_plan_get_info(const fa_plan *plan, fa_plan_info *info);

/* Fills *buffer with buffer `index` (0 ... buffer_count - 1, in order of first binding).
 * Errors: INVALID_ARGUMENT (null plan or buffer, struct_size too small, index out of range). */
fa_status fa_plan_get_buffer(const fa_plan *plan, uint32_t index, fa_plan_buffer *buffer);

/* Fills *dispatch with dispatch `index` (0 ... dispatch_count - 1, in encoding order).
 * Errors: INVALID_ARGUMENT (null plan or dispatch, struct_size too small, index out of range). */
fa_status fa_plan_get_dispatch(const fa_plan *plan, uint32_t index, fa_plan_dispatch *dispatch);

/* Fills *binding with binding `index` (0 ... binding_count - 1) of dispatch `dispatch`.
 * Errors: INVALID_ARGUMENT (null plan or binding, struct_size too small, an index out of range). */
fa_status fa_plan_get_binding(const fa_plan *plan, uint32_t dispatch, uint32_t index, fa_plan_binding *binding);

/* Fills *specialization with constant `index` (0 ... specialization_count - 1, by function-constant
 * index) of dispatch `dispatch`. Errors: as fa_plan_get_binding. */
fa_status fa_plan_get_specialization(const fa_plan *plan, uint32_t dispatch, uint32_t index,
                                     fa_plan_specialization *specialization);

/* The Metal Shading Language source of every kernel a plan names, self-contained (the headers of
 * Shaders/ spliced in), for MTLDevice.makeLibrary(source:options:) or torch.mps.compile_shader:
 * compile it as MSL 3.0, or 3.1 for the bfloat16 kernels, without fast math (the kernels rely on
 * infinities). NUL-terminated, static storage; NULL only when the library ran out of memory
 * making its copy. */
const char *fa_plan_kernel_source(void);

/* The path of the precompiled kernels, flash_attention-<hash>-msl<version>.metallib, built by build.sh
 * on a Mac from exactly fa_plan_kernel_source() (one per MSL version: 3.0 for macOS 13 without the
 * bfloat16 kernels, 3.1 for macOS 14, 3.2 for macOS 15) and found next to this library when it was
 * loaded: the newest version this OS runs, never 3.0 where the OS runs 3.1 (it would lose
 * bfloat16: the embedded source compiled at 3.1 keeps it); NULL when there is none (or only the
 * 3.0 one there), e.g. on Linux or where the Metal compiler was not installed. Its kernels take their function constants as the plan's specialisation
 * says. Beside it build.sh may put flash_attention-<hash>-features-off.metallib: the source after
 * the prelude of every feature off (no function constants left), for hosts without function
 * constants such as torch.mps.load_metallib. Static storage. */
const char *fa_plan_metallib_path(void);

/* The path of the precompiled tensor-op kernels, flash_attention-tensor-<hash>-msl4.0.metallib, built
 * by build.sh on a Mac with a macOS 26.2 SDK from exactly fa_plan_tensor_kernel_source() at MSL 4.0
 * and found next to this library as fa_plan_metallib_path() is; NULL before macOS/iOS 26.2 or when
 * there is none. A host that wants the tensor-op library (fa_tensor_ops_wanted) loads it when Metal
 * accepts it, else compiles fa_plan_tensor_kernel_source(); its kernels take their function
 * constants as the plan's specialisation says. Static storage. */
const char *fa_plan_tensor_metallib_path(void);

/* Runs `plan` on context's backend with the caller's buffers: buffers[role] for each fa_buffer_role
 * role below buffer_count (pass FA_BUFFER_ROLE_COUNT entries; a role at or past buffer_count counts
 * as NULL, so a variable-length plan needs buffer_count > FA_BUFFER_ROLE_CU_SEQLENS_K), each
 * pointing at the start of that role's memory of at least the plan's byte_count for it, laid out as
 * the problem says. Every input and output of the plan must be given; workspaces are allocated by the library, so their entries
 * (and those of roles the plan does not use) must be NULL. Outputs must not overlap any other
 * buffer. The CPU engine reads and writes the buffers in place; Metal copies them (a framework with
 * GPU buffers encodes the plan itself). Cancellation, profiles and NaN-filled outputs on failure are
 * as for fa_forward. Errors: INVALID_ARGUMENT (a null context, plan or required buffer, a non-null
 * workspace, overlapping outputs), UNSUPPORTED, EXECUTION_FAILED, CANCELLED, OUT_OF_MEMORY. */
fa_status fa_plan_execute(fa_context *context, const fa_plan *plan, void *const *buffers,
                          uint32_t buffer_count);

/* FA_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif
