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
    fa_u32 kv_chunks;     // split-KV forward only: chunks of keys per (batch, KV head), else 1
    fa_u32 kv_chunk_keys; // split-KV forward only: keys per chunk (a multiple of the key tile)
} FlashAttentionParams;

// Buffer indices: forward.
#define FA_FORWARD_BUFFER_Q 0
#define FA_FORWARD_BUFFER_K 1
#define FA_FORWARD_BUFFER_V 2
#define FA_FORWARD_BUFFER_OUT 3
#define FA_FORWARD_BUFFER_LSE 4
#define FA_FORWARD_BUFFER_PARAMS 5
#define FA_FORWARD_BUFFER_COUNT 6
// Split-KV forward (short queries over long KV caches): both of its kernels bind 0 ... 7.
// forward_split writes one partial result per chunk of keys: partial_out (float32
// [batch][num_heads][kv_chunks][seqlen_q][head_dim], normalised) and partial_lse (float32
// [batch][num_heads][kv_chunks][seqlen_q], -inf for a chunk the row does not see), workspaces the
// backend allocates; forward_combine merges them into out and lse.
#define FA_FORWARD_BUFFER_PARTIAL_OUT 6
#define FA_FORWARD_BUFFER_PARTIAL_LSE 7
#define FA_FORWARD_SPLIT_BUFFER_COUNT 8

// Buffer indices: every backward kernel binds 0 ... FA_BACKWARD_BUFFER_DELTA. A backward pass is
// three dispatches: backward_delta writes delta (D_i = rowsum(dout * out), float32
// [batch][num_heads][seqlen_q], a workspace the backend allocates), then backward_dq writes dq and
// backward_dkv writes dk and dv, both reading delta.
#define FA_BACKWARD_BUFFER_DOUT 0
#define FA_BACKWARD_BUFFER_Q 1
#define FA_BACKWARD_BUFFER_K 2
#define FA_BACKWARD_BUFFER_V 3
#define FA_BACKWARD_BUFFER_OUT 4
#define FA_BACKWARD_BUFFER_LSE 5
#define FA_BACKWARD_BUFFER_PARAMS 6
#define FA_BACKWARD_BUFFER_DELTA 7
#define FA_BACKWARD_BUFFER_DQ 8
#define FA_BACKWARD_BUFFER_DK 8
#define FA_BACKWARD_BUFFER_DV 9
#define FA_BACKWARD_DELTA_BUFFER_COUNT 8
#define FA_BACKWARD_DQ_BUFFER_COUNT 9
#define FA_BACKWARD_DKV_BUFFER_COUNT 10

// Largest supported head_dim; the last bucket of the table below.
#define FA_MAX_HEAD_DIM 256

// Every kernel runs FA_SIMDGROUPS SIMD-groups of 32 threads per threadgroup. A kernel owns a block
// of rows (query rows for forward and dQ, key rows for dK/dV); each SIMD-group owns 8 of them and
// a slice of head_dim: with B owned rows, the 4 SIMD-groups form (B / 8) row groups x (32 / B)
// head_dim slices, so the float32 accumulators of a lane cover 8 x (head_dim_max * B / 32)
// elements. Blocking the accumulators over head_dim (32 / B = 2 slices at head_dim 192 and 256)
// keeps them in registers without recomputing S: the slices' partial products Q K^T (and dO V^T)
// are summed through threadgroup memory.
#define FA_SIMDGROUPS 4
#define FA_THREADS_PER_THREADGROUP (FA_SIMDGROUPS * 32)
// Rows of one threadgroup of the backward_delta kernel (one thread per row).
#define FA_DELTA_BLOCK_ROWS FA_THREADS_PER_THREADGROUP

// Split-KV forward (decode). Chosen when seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS: with that few rows
// per head the dense forward fills one mostly padded row block per head and launches only
// batch x num_heads threadgroups, each streaming the whole cache alone. The split kernel packs
// the query rows of a GQA group into one block per KV head (each K/V element is read once per
// chunk and KV head, not once per query head) and splits the keys into chunks of at least
// FA_SPLIT_MIN_CHUNK_KEYS, as many as give FA_SPLIT_TARGET_THREADGROUPS threadgroups (4 per core
// of an 80-core GPU). The chunking is a function of the shape alone, so results are deterministic.
#define FA_SPLIT_MAX_QUERY_ROWS 8
#define FA_SPLIT_MIN_CHUNK_KEYS 256
#define FA_SPLIT_TARGET_THREADGROUPS 320
// Threadgroup tiles of half are stored with rows padded by 8 halves (16 bytes), against bank
// conflicts between the rows a SIMD-group reads (MLX steel attention does the same).
#define FA_TILE_PAD 8

// Head-dim buckets: X(head_dim_max, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ): per kernel the
// rows it owns and the rows of the tiles it streams (forward: BQ query rows, K/V tiles of BK keys;
// dQ: BQ query rows, K/V tiles of BK keys; dK/dV: BK key rows, Q/dO tiles of BQ query rows). A
// problem uses the first bucket whose head_dim_max >= head_dim; kernel instances are named
// <kernel>_d<head_dim_max>, e.g. flash_attention_forward_d64.
// Why these sizes: the forward follows MLX's steel attention (BQ 32 = 4 SIMD-groups x 8 rows; K/V
// tiles of 32 keys, 16 from head_dim 128), whose published throughput on M-series GPUs is 87-97 %
// of a measured f16 matmul ceiling. From head_dim 192 the accumulators are split over two head_dim
// slices (BQ 16, see above) where MLX keeps 8 x 256 floats per SIMD-group in registers. The
// backward follows metal-flash-attention's three kernels (D pre-pass, dQ over query blocks, dK/dV
// over key blocks with K, V, dK, dV resident); its tiles are the largest that keep each kernel's
// threadgroup storage within 32 KiB (static_assert at the instantiation):
//   forward: (BQ + 2 BK) (DP + 8) halves (+ 4 x 8 x BK floats when split over head_dim)
//   dQ:      2 (BQ + BK) (DP + 8) halves + 2 x 8 x BK floats per partial set
//   dK/dV:   2 (BK + BQ) (DP + 8) halves + 2 x BQ floats + 2 x 8 x BQ floats per partial set
#define FA_HEAD_DIM_BUCKETS(X)           \
    X(32, 32, 32, 32, 32, 32, 32)        \
    X(64, 32, 32, 32, 32, 32, 32)        \
    X(96, 32, 32, 32, 32, 32, 32)        \
    X(128, 32, 16, 32, 16, 32, 16)       \
    X(192, 16, 16, 16, 16, 16, 16)       \
    X(256, 16, 16, 16, 8, 16, 8)

#endif
