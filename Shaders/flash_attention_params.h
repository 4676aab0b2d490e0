// The one definition of what the host passes to the FlashAttention kernels: the parameter struct,
// the buffer indices and the table of head-dim buckets. Included by flash_attention.metal (Metal,
// the CPU engine, the CUDA check build) and by the C target that the Swift dispatch plan uses.
#ifndef FLASH_ATTENTION_PARAMS_H
#define FLASH_ATTENTION_PARAMS_H

#if defined(__METAL_VERSION__)
typedef uint fa_u32;
#else
#include <stdint.h>
typedef uint32_t fa_u32;
#endif

// The Metal Shading Language version the kernels are compiled as, everywhere: the run-time
// compile (MTLCompileOptions.languageVersion), build.sh's `xcrun metal -std=metal3.0` and the
// address-space check (__METAL_VERSION__ 300). MSL 3.0 is macOS 13 / iOS 16, the package's
// platforms; simdgroup_matrix needs 2.3.
#define FA_MSL_VERSION_MAJOR 3
#define FA_MSL_VERSION_MINOR 0

// Every field is 4 bytes, so the layout is the same in MSL, C, C++ and Swift.
typedef struct FlashAttentionParams {
    fa_u32 batch;
    fa_u32 num_heads;
    fa_u32 num_kv_heads;
    fa_u32 seqlen_q;
    fa_u32 seqlen_k;
    fa_u32 head_dim;
    fa_u32 causal;        // 0 or 1; bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q
    float softmax_scale;  // applied to q . k before the softmax
} FlashAttentionParams;

// Buffer indices: forward.
#define FA_FORWARD_BUFFER_Q 0
#define FA_FORWARD_BUFFER_K 1
#define FA_FORWARD_BUFFER_V 2
#define FA_FORWARD_BUFFER_OUT 3
#define FA_FORWARD_BUFFER_LSE 4
#define FA_FORWARD_BUFFER_PARAMS 5
#define FA_FORWARD_BUFFER_COUNT 6

// Buffer indices: both backward kernels read these.
#define FA_BACKWARD_BUFFER_DOUT 0
#define FA_BACKWARD_BUFFER_Q 1
#define FA_BACKWARD_BUFFER_K 2
#define FA_BACKWARD_BUFFER_V 3
#define FA_BACKWARD_BUFFER_OUT 4
#define FA_BACKWARD_BUFFER_LSE 5
#define FA_BACKWARD_BUFFER_PARAMS 6
// backward_dq writes dq; backward_dkv writes dk and dv.
#define FA_BACKWARD_BUFFER_DQ 7
#define FA_BACKWARD_BUFFER_DK 7
#define FA_BACKWARD_BUFFER_DV 8
#define FA_BACKWARD_DQ_BUFFER_COUNT 8
#define FA_BACKWARD_DKV_BUFFER_COUNT 9

// Largest supported head_dim; the last bucket of the table below.
#define FA_MAX_HEAD_DIM 256

// Head-dim buckets: X(head_dim_max, forward_block_q, forward_block_k, backward_block_q,
// backward_block_k). A problem uses the first bucket whose head_dim_max >= head_dim. Each kernel
// instance is named <kernel>_d<head_dim_max>, e.g. flash_attention_forward_d64.
// Threads per threadgroup: forward and backward_dq use one thread per query row (block_q);
// backward_dkv uses one thread per key row (backward_block_k).
// Threadgroup memory (half = 2 bytes, must stay within 32 KiB):
//   forward, backward_dq: K and V tiles, 2 * block_k * head_dim_max * 2 bytes
//   backward_dkv:        Q and dout tiles, 2 * block_q * head_dim_max * 2 bytes, plus 8 * block_q
#define FA_HEAD_DIM_BUCKETS(X) \
    X(32, 64, 64, 32, 64)      \
    X(64, 64, 64, 32, 64)      \
    X(96, 64, 32, 32, 64)      \
    X(128, 64, 32, 32, 64)     \
    X(192, 32, 32, 32, 32)     \
    X(256, 32, 16, 16, 32)

#endif
