// The one definition of what the host passes to the FlashAttention kernels: the parameter struct,
// the buffer indices and the table of head-dim buckets. Included by flash_attention.metal (Metal,
// the CPU engine, the CUDA check build) and by the C target that the Swift dispatch plan uses.
#ifndef FLASH_ATTENTION_PARAMS_H
#define FLASH_ATTENTION_PARAMS_H

#if defined(__METAL_VERSION__)
typedef uint fa_u32;
typedef int fa_i32;
typedef ulong fa_u64;
#else
#include <stdint.h>
typedef uint32_t fa_u32;
typedef int32_t fa_i32;
typedef uint64_t fa_u64;
#endif

// The Metal Shading Language version the kernels are compiled as, everywhere: the run-time
// compile (MTLCompileOptions.languageVersion), build.sh's `xcrun metal -std=metal3.0` and the
// address-space check (__METAL_VERSION__ 300 to 410: PyTorch and MLX compile at their SDK's newest
// version, so the kernels must compile at each). MSL 3.0 is macOS 13 / iOS 16, the package's
// platforms; simdgroup_matrix needs 2.3. The bfloat16 kernels need MSL 3.1 (macOS 14 / iOS 17,
// where the compiler defines __HAVE_BFLOAT__): the run-time compile asks for it where the OS has
// it, and the bfloat16 instances exist only then.
#define FA_MSL_VERSION_MAJOR 3
#define FA_MSL_VERSION_MINOR 0
#define FA_MSL_BFLOAT_VERSION_MINOR 1

// One bit per dtype, for FA_DTYPES (flash_attention.metal): the dtypes whose kernels a compile
// defines.
#define FA_DTYPE_MASK_F16 1
#define FA_DTYPE_MASK_F32 2
#define FA_DTYPE_MASK_BF16 4

// Where a [batch][heads][seqlen][head_dim] tensor's rows are: element (b, h, i, d) is at
// b * batch + h * head + i * seq + d (in elements; the last axis is contiguous).
typedef struct FlashAttentionStrides {
    fa_u64 batch;
    fa_u64 head;
    fa_u64 seq;
} FlashAttentionStrides;

// The 8-byte fields come first and the 4-byte ones after, so MSL, C, C++ and Swift lay the struct
// out identically (natural alignment, no padding between fields).
typedef struct FlashAttentionParams {
    FlashAttentionStrides q;
    FlashAttentionStrides k;
    FlashAttentionStrides v;
    FlashAttentionStrides out;
    FlashAttentionStrides dout;  // backward only, like the three below
    FlashAttentionStrides dq;
    FlashAttentionStrides dk;
    FlashAttentionStrides dv;
    FlashAttentionStrides mask;  // attn_mask's (batch, head, query row) strides; 0 broadcasts
    fa_u64 alibi_batch_stride;   // alibi_slopes: 0 for (num_heads,), num_heads for (batch, num_heads)
    // Dropout on P (flash_attention_philox.h: the mask of every element from these): the Philox key
    // and the counter's base. Read only where dropout_threshold is not 0.
    fa_u64 dropout_seed;
    fa_u64 dropout_offset;
    fa_u32 batch;
    fa_u32 num_heads;
    fa_u32 num_kv_heads;
    fa_u32 seqlen_q;
    fa_u32 seqlen_k;
    fa_u32 head_dim;      // of q and k (and dq, dk)
    fa_u32 head_dim_v;    // of v, out, dout and dv
    // Sliding window, bottom-right aligned (causal is window_right 0): query i sees key j iff
    // i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right;
    // -1 leaves that side unbounded.
    fa_i32 window_left;
    fa_i32 window_right;
    float softmax_scale;  // applied to q . k before the softmax
    float softcap;        // > 0: scores become softcap * tanh(score / softcap); 0: off
    fa_u32 mask_type;     // FA_MASK_*: attn_mask's kind
    fa_u32 has_alibi;     // 1: add -slope * |i + seqlen_k - seqlen_q - j| to the scores
    fa_u32 has_sinks;     // 1: one virtual key per head with logit sinks[h] and no value
    fa_u32 kv_chunks;     // split-KV forward only: chunks of keys per (batch, KV head), else 1
    fa_u32 kv_chunk_keys; // split-KV forward only: keys per chunk (a multiple of the key tile)
    // The edge paths, chosen once per call by the host (0, the common case, takes neither):
    // 1: some tile copy cannot move 16-byte chunks (the address of a bound q, k, v, out or dout,
    // one of their strides, head_dim or head_dim_v is not a multiple of 16 bytes), so every copy
    // takes the checked scalar path (flash_attention_loader.h).
    fa_u32 scalar_copies;
    // 1: a whole 8-column fragment of the bucket lies past head_dim or head_dim_v (rounded up to
    // a multiple of 8), so the products skip the zero fragments past them (the active-fragment
    // test). Columns past head_dim inside a fragment are zero in the tiles and need no test.
    fa_u32 partial_columns;
    // Added to a threadgroup's x index (threadgroup_position_in_grid.x) by the kernels whose x
    // axis is a block of rows: query blocks (forward, split-KV forward, lse residual, delta, dQ)
    // and key blocks (dK/dV). A piece of a long pass dispatches a range of blocks, starting here
    // (PlanPieces.swift); 0 (a value-initialised struct's) runs the grid from block 0.
    fa_u32 block_offset;
    // KV-cache forward only (flash_attention_kv_cache.h; 0 elsewhere). k and v are caches: rows
    // of batch element b at k + head_offset(p.k, b, head) + t * p.k.seq (contiguous, kv_page_rows
    // 0) or, paged, block table[b][t / kv_page_rows] (kv_max_blocks entries per row, values
    // clamped into [0, kv_num_blocks)) with p.k.batch between blocks. kv_bits 4 or 8: k and v
    // are mx.quantize's packed uint32 words (strides in words) with scales and biases of
    // kv_group_size elements per entry laid out like the words; 0: the dtype.
    fa_u32 kv_page_rows;
    fa_u32 kv_max_blocks;
    fa_u32 kv_num_blocks;
    fa_u32 kv_bits;
    fa_u32 kv_group_size;
    // Variable-length batches (packed sequences, FlashAttention's varlen call; flash_attention_varlen.h).
    // 0: a dense problem. Otherwise the number of sequences: the host's struct then describes the
    // packed tensors as one batch entry of seqlen_q = total_q rows and seqlen_k = total_k keys, and
    // the kernels other than the sequence table's and dsinks read their threadgroup's sequence's own
    // struct from the table that flash_attention_varlen_sequences wrote (bound at the parameter
    // index in place of the host's): seqlen_q and seqlen_k that sequence's lengths, seq_q0 and
    // seq_k0 its first query row and key in the packed tensors.
    fa_u32 sequences;
    fa_u32 seq_q0;
    fa_u32 seq_k0;
    // Rows per head of lse, delta and the lse residual in a sequence's struct: the packed total_q
    // (they are [num_heads][total_q]); unused (0) in a dense problem, whose rows per head are seqlen_q.
    fa_u32 lse_rows;
    // Dropout (FlashAttention's: on P after the softmax, lse of the undropped scores): an element
    // is dropped iff its Philox word is below dropout_threshold (0: no dropout, and the kernels
    // compiled without it: FA_FUNCTION_CONSTANT_DROPOUT); kept ones are multiplied by
    // dropout_scale = 1 / (1 - dropout_p). The stream of the counter of (batch entry b, query head
    // h) as the kernel sees them is dropout_stream0 + b * dropout_heads + h: the call's
    // b' * num_heads + h' for the whole problem's indices (a piece of a split plan starts at
    // stream0 = its first batch entry and head; a varlen sequence's struct at its index b').
    fa_u32 dropout_threshold;
    float dropout_scale;
    fa_u32 dropout_stream0;
    fa_u32 dropout_heads;
    // Backward dK/dV over few KV heads (backward_dkv_split; 0 or 1 elsewhere): the GQA group of
    // each (batch entry, KV head, key block) is cut into this many splits of consecutive query
    // heads, each a threadgroup writing float32 partial sums that backward_dkv_reduce adds in order.
    fa_u32 dkv_splits;
} FlashAttentionParams;

// Element types of q, k, v, out, dout, dq, dk, dv (one per call); lse and the workspaces are float.
// Kernel instances are named with the dtype's suffix: f16 (half), bf16 (bfloat, MSL 3.1) and f32.
#define FA_DTYPE_F16 0
#define FA_DTYPE_BF16 1
#define FA_DTYPE_F32 2

// attn_mask kinds. Score order: s = softcap(softmax_scale * q . k) - slope * |distance| + additive
// mask; keys hidden by the window, the causal mask or a false boolean mask get no weight.
#define FA_MASK_NONE 0
#define FA_MASK_BOOL 1      // uchar, nonzero = may attend
#define FA_MASK_ADDITIVE 2  // the call's dtype, added to the scores
#define FA_MASK_ADDITIVE_F32 3

// Function constants: the score features that choose a kernel's code path are fixed when its
// pipeline is built (MSL `constant T name [[function_constant(index)]]`, set with
// MTLFunctionConstantValues), so the common path has no per-element test of them. The kernels read
// them only through flash_attention_features.h.
// X(INDEX, TYPE, NAME, VALUE): constant NAME of MSL type TYPE (bool or uint) at INDEX; its value for
// a call is VALUE, an expression of that call's FlashAttentionParams `p` (a bool's is 0 or 1). The
// dispatch plan gives each dispatch the constants its kernel reads (DispatchPlan.swift); the CPU
// engine and the CUDA check build take them per dispatch; hosts that cannot set function constants
// prepend `#define FA_FUNCTION_CONSTANTS_PREDEFINED 1` and `constant TYPE NAME = value;` lines.
#define FA_FUNCTION_CONSTANT_MASK_TYPE 0
#define FA_FUNCTION_CONSTANT_SOFTCAP 1
#define FA_FUNCTION_CONSTANT_ALIBI 2
#define FA_FUNCTION_CONSTANT_SINKS 3
#define FA_FUNCTION_CONSTANT_DROPOUT 4
#define FA_FUNCTION_CONSTANT_COUNT 5
#define FA_FUNCTION_CONSTANTS(X)                                                                   \
    X(FA_FUNCTION_CONSTANT_MASK_TYPE, uint, fa_mask_type, (p).mask_type)                           \
    X(FA_FUNCTION_CONSTANT_SOFTCAP, bool, fa_has_softcap, (p).softcap > 0.0f)                      \
    X(FA_FUNCTION_CONSTANT_ALIBI, bool, fa_has_alibi, (p).has_alibi != 0)                          \
    X(FA_FUNCTION_CONSTANT_SINKS, bool, fa_has_sinks, (p).has_sinks != 0)                          \
    X(FA_FUNCTION_CONSTANT_DROPOUT, bool, fa_has_dropout, (p).dropout_threshold != 0)
// How C and Swift name the two MSL types a constant can have.
#define FA_FUNCTION_CONSTANT_TYPE_bool 0
#define FA_FUNCTION_CONSTANT_TYPE_uint 1

// Buffer indices: forward. The optional inputs (attn_mask, alibi_slopes, sinks) are bound to a
// placeholder buffer when absent; the kernels read them only when params say they exist.
#define FA_FORWARD_BUFFER_Q 0
#define FA_FORWARD_BUFFER_K 1
#define FA_FORWARD_BUFFER_V 2
#define FA_FORWARD_BUFFER_OUT 3
#define FA_FORWARD_BUFFER_LSE 4
#define FA_FORWARD_BUFFER_PARAMS 5
#define FA_FORWARD_BUFFER_MASK 6
#define FA_FORWARD_BUFFER_ALIBI 7
#define FA_FORWARD_BUFFER_SINKS 8
#define FA_FORWARD_BUFFER_COUNT 9
// Split-KV forward (short queries over long KV caches): both of its kernels bind 0 ... 10.
// forward_split writes one partial result per chunk of keys: partial_out (float32
// [batch][num_heads][kv_chunks][seqlen_q][head_dim], normalised) and partial_lse (float32
// [batch][num_heads][kv_chunks][seqlen_q][2], each chunk's running max and log of its sum: -inf and
// 0 for a chunk the row does not see), workspaces the
// backend allocates; forward_combine merges them into out and lse.
#define FA_FORWARD_BUFFER_PARTIAL_OUT 9
#define FA_FORWARD_BUFFER_PARTIAL_LSE 10
#define FA_FORWARD_SPLIT_BUFFER_COUNT 11
// KV-cache forward kernels (dense and split, flash_attention_kv_cache.h): the forward's buffers
// (and the split's partial results), then the block table (int32 [batch][kv_max_blocks]; a
// placeholder for contiguous caches) and the scales and biases of quantized K and V
// (placeholders when unquantized).
#define FA_KV_CACHE_BUFFER_TABLE 11
#define FA_KV_CACHE_BUFFER_K_SCALES 12
#define FA_KV_CACHE_BUFFER_K_BIASES 13
#define FA_KV_CACHE_BUFFER_V_SCALES 14
#define FA_KV_CACHE_BUFFER_V_BIASES 15
#define FA_KV_CACHE_BUFFER_COUNT 16

// Buffer indices: flash_attention_merge (fa_merge_attention), out and lse of two parts in, their
// merge out; rows laid out as forward's out and lse.
#define FA_MERGE_BUFFER_OUT_A 0
#define FA_MERGE_BUFFER_LSE_A 1
#define FA_MERGE_BUFFER_OUT_B 2
#define FA_MERGE_BUFFER_LSE_B 3
#define FA_MERGE_BUFFER_OUT 4
#define FA_MERGE_BUFFER_LSE 5
#define FA_MERGE_BUFFER_PARAMS 6
#define FA_MERGE_BUFFER_COUNT 7
// flash_attention_merge threadgroups: FA_MERGE_ROWS_PER_THREADGROUP rows, each row's head_dim
// elements strided over FA_MERGE_THREADS_PER_ROW threads (a SIMD-group on Apple GPUs, so a row's
// loads and stores are contiguous): FA_THREADS_PER_THREADGROUP threads, like every kernel.
#define FA_MERGE_ROWS_PER_THREADGROUP FA_SIMDGROUPS
#define FA_MERGE_THREADS_PER_ROW 32

// Buffer indices: backward. A backward pass is four dispatches (five with sinks):
// backward_delta writes delta (D_i = rowsum(dout * out), float32 [batch][num_heads][seqlen_q], a
// workspace the backend allocates); backward_lse_residual writes lse_residual (float32, the same
// shape, a workspace: what float32 lse cannot hold of rows whose |lse| is huge, 0 elsewhere); then
// backward_dq writes dq and backward_dkv writes dk and dv, both reading delta and lse_residual;
// with sinks, backward_dsinks writes dsinks (float32 [num_heads]). Every backward kernel binds
// 0 ... FA_BACKWARD_BUFFER_LSE_RESIDUAL and then its outputs.
#define FA_BACKWARD_BUFFER_DOUT 0
#define FA_BACKWARD_BUFFER_Q 1
#define FA_BACKWARD_BUFFER_K 2
#define FA_BACKWARD_BUFFER_V 3
#define FA_BACKWARD_BUFFER_OUT 4
#define FA_BACKWARD_BUFFER_LSE 5
#define FA_BACKWARD_BUFFER_PARAMS 6
#define FA_BACKWARD_BUFFER_DELTA 7
#define FA_BACKWARD_BUFFER_MASK 8
#define FA_BACKWARD_BUFFER_ALIBI 9
#define FA_BACKWARD_BUFFER_SINKS 10
#define FA_BACKWARD_BUFFER_LSE_RESIDUAL 11
#define FA_BACKWARD_BUFFER_DQ 12
#define FA_BACKWARD_BUFFER_DK 12
#define FA_BACKWARD_BUFFER_DV 13
#define FA_BACKWARD_BUFFER_DSINKS 12
#define FA_BACKWARD_BUFFER_PARTIAL_DK 14
#define FA_BACKWARD_BUFFER_PARTIAL_DV 15
#define FA_BACKWARD_DELTA_BUFFER_COUNT 12
#define FA_BACKWARD_LSE_RESIDUAL_BUFFER_COUNT 12
#define FA_BACKWARD_DQ_BUFFER_COUNT 13
#define FA_BACKWARD_DKV_BUFFER_COUNT 14
#define FA_BACKWARD_DSINKS_BUFFER_COUNT 13
#define FA_BACKWARD_DKV_SPLIT_BUFFER_COUNT 16
#define FA_BACKWARD_DKV_REDUCE_BUFFER_COUNT 16
// The split dK/dV (few KV heads): with its GQA group cut over dkv_splits threadgroups,
// backward_dkv_split writes partial_dk and partial_dv (float32 workspaces,
// [batch][num_kv_heads][dkv_splits][seqlen_k][head_dim] and head_dim_v; a varlen pass's seqlen_k the
// packed total) at 14 and 15, then backward_dkv_reduce sums each element's splits in split order
// into dk and dv, FA_DKV_REDUCE_ROWS key rows per threadgroup. The plan splits only where the
// unsplit grid would keep the GPU's threadgroup slots less than FA_DKV_SPLIT_MIN_OCCUPANCY percent
// busy over its waves (GroupSplit.swift), and never into more splits than keep the two workspaces
// together within FA_DKV_SPLIT_MAX_WORKSPACE_BYTES (64 MiB; no split where two would not fit): the
// memory a backward call adds is bounded whatever the shape and the planned core count. (On GPUs of
// up to 80 cores the rule alone stays below it: a split grid has at most 10 waves of slots.)
#define FA_DKV_REDUCE_ROWS 16
#define FA_DKV_SPLIT_MIN_OCCUPANCY 90
#define FA_DKV_SPLIT_MAX_WORKSPACE_BYTES 67108864

// Buffer indices: flash_attention_varlen_sequences, the first dispatch of a varlen pass. It reads
// cu_seqlens_q and cu_seqlens_k (int32, sequences + 1 each) and the host's parameters, and writes the
// sequence table (FlashAttentionParams [sequences + 1]: the host's struct, then one per sequence)
// that the pass's other kernels bind at their parameter index.
#define FA_VARLEN_BUFFER_CU_SEQLENS_Q 0
#define FA_VARLEN_BUFFER_CU_SEQLENS_K 1
#define FA_VARLEN_BUFFER_TABLE 2
#define FA_VARLEN_BUFFER_PARAMS 3
#define FA_VARLEN_BUFFER_COUNT 4

// Largest supported head_dim and head_dim_v: the last bucket of FA_HEAD_DIM_BUCKETS (float16 and
// bfloat16). float32's table (FA_HEAD_DIM_BUCKETS_F32) stops at FA_MAX_HEAD_DIM_F32: its tiles at
// 512 would not fit 32 KiB even at 8 x 8 (see that table), so larger head dims are UNSUPPORTED there.
#define FA_MAX_HEAD_DIM 576
#define FA_MAX_HEAD_DIM_F32 256

// Every kernel runs FA_SIMDGROUPS SIMD-groups of 32 threads per threadgroup. A kernel owns a block
// of rows (query rows for forward and dQ, key rows for dK/dV); each SIMD-group owns 8 of them and
// a slice of head_dim: with B owned rows, the 4 SIMD-groups form (B / 8) row groups x (32 / B)
// head_dim slices, so the float32 accumulators of a lane cover 8 x (head_dim_max * B / 32)
// elements. Blocking the accumulators over head_dim (32 / B = 2 slices in the backward kernels at
// head_dim 192 and 256) keeps them in registers without recomputing S: the slices' partial
// products Q K^T (and dO V^T) are summed through threadgroup memory.
#define FA_SIMDGROUPS 4
#define FA_THREADS_PER_THREADGROUP (FA_SIMDGROUPS * 32)
// Rows of one threadgroup of the backward_delta kernel (one thread per row).
#define FA_DELTA_BLOCK_ROWS FA_THREADS_PER_THREADGROUP

// Split-KV forward. With few query rows per head the dense forward fills one mostly padded row
// block per head and launches only batch x num_heads threadgroups, each streaming the whole cache
// alone. The split kernels pack the query rows of a GQA group into blocks per KV head (each K/V
// element is read once per chunk and row block, not once per query head) and split the keys into
// chunks: for seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS the decode kernel (flash_attention_decode.h) where
// it serves the rows (FA_DECODE_SERVES), else the tiled split kernel; for seqlen_q <=
// FA_SPLIT_TILED_MAX_QUERY_ROWS the tiled split kernel when the dense grid has fewer threadgroups
// than the GPU holds at once. Chunks of at least FA_SPLIT_MIN_CHUNK_KEYS keys, as many
// as give every core two waves of threadgroups (KeyValueSplit.swift; docs/decode.md); the plan is
// a function of the shape and the planned core count alone, so results are deterministic.
#define FA_SPLIT_MAX_QUERY_ROWS 8
#define FA_SPLIT_TILED_MAX_QUERY_ROWS 64
#define FA_SPLIT_MIN_CHUNK_KEYS 64
// The GPU core count plans assume without the FLASH_ATTENTION_GPU_CORES override: 10, the GPU of
// the base M1-M4 chips (Apple's tech specs), so the CPU engine plans as for that GPU.
#define FA_NOMINAL_GPU_CORES 10
// The decode forward (flash_attention_decode.h): each threadgroup takes up to FA_DECODE_ROWS(DP)
// packed rows, whose q and output slices every lane keeps in registers (FA_DECODE_ROWS(DP) x DP / 32
// floats of each, 32 at most: both within FA_MAX_ACCUMULATOR_FLOATS, asserted at the kernel), and
// stores FA_SIMDGROUPS such states in threadgroup memory once, at the end
// (FA_DECODE_THREADGROUP_BYTES). It serves a split problem whose packed rows per KV head
// (group x seqlen_q) fit one threadgroup, up to head_dim FA_DECODE_MAX_HEAD_DIM (FA_DECODE_SERVES):
// more rows would be more row blocks, each reading the whole cache, where the tiled split kernel
// reads it once per forward_block_q rows (K/V tiles shared by its SIMD-groups); wider rows would
// outgrow the registers. Buckets above FA_DECODE_MAX_HEAD_DIM have no decode instance.
// The block's rows take the smallest instance of 1, 2, 4 or FA_DECODE_ROWS(DP) rows that holds its
// live rows, whose key loop takes FA_DECODE_KEYS(ROWS, E) keys per iteration and SIMD-group (E:
// elements of a row per lane): their loads in flight at once, one rescale of the outputs per
// iteration; 4, or 2 where ROWS x E reaches 32 (the K/V slices would outgrow the registers).
#define FA_DECODE_MAX_HEAD_DIM 256
#define FA_DECODE_ROWS(DP) ((DP) <= 128 ? 8 : 4)
#define FA_DECODE_KEYS(ROWS, E) ((ROWS) * (E) >= 32 ? 2 : 4)
#define FA_DECODE_THREADGROUP_BYTES(DP) (FA_SIMDGROUPS * FA_DECODE_ROWS(DP) * ((DP) + 2) * 4)
#define FA_DECODE_SERVES(DP, PACKED_ROWS) ((DP) <= FA_DECODE_MAX_HEAD_DIM && (PACKED_ROWS) <= FA_DECODE_ROWS(DP))
// The MMA decode over a quantized cache (flash_attention_decode_mma.h): in place of the decode
// kernel for a cache quantized to BITS = 8 or 4 bits whose head_dim and head_dim_v are the
// bucket's DP, 32, 64 or 128 (a lane's quarter of a row lies in one quantization group). The
// vector decode's key loop grows with the rows and dequantizes per row slice; the MMA decode's
// costs the same for 1-8 rows, at or below the vector one's for every g from 2 (docs/decode.md:
// 8-bit and 4-bit at 1.88x and 2.73x float16's keys per second at head_dim 128 by the cost model,
// 1.88x and 2.50x at 64, where the vector decode gives 4-bit 2.84x and 2.02x at g = 1, 1.27x and
// 1.01x at g = 8).
// FA_IF_DECODE_MMA(DP, ...): the arguments where bucket DP has an MMA decode instance, the buckets
// FA_DECODE_MMA_SERVES names (no instance elsewhere: no plan could reach it); KernelTraits
// static_asserts that the two agree.
#define FA_IF_DECODE_MMA(DP, ...) FA_IF_DECODE_MMA_##DP(__VA_ARGS__)
#define FA_IF_DECODE_MMA_32(...) __VA_ARGS__
#define FA_IF_DECODE_MMA_64(...) __VA_ARGS__
#define FA_IF_DECODE_MMA_96(...)
#define FA_IF_DECODE_MMA_128(...) __VA_ARGS__
#define FA_IF_DECODE_MMA_192(...)
#define FA_IF_DECODE_MMA_256(...)
#define FA_IF_DECODE_MMA_512(...)
#define FA_IF_DECODE_MMA_576(...)
#define FA_DECODE_MMA_SERVES(DP, HEAD_DIM, HEAD_DIM_V, BITS, PACKED_ROWS)                          \
    (((DP) == 32 || (DP) == 64 || (DP) == 128) && (HEAD_DIM) == (DP) && (HEAD_DIM_V) == (DP) &&     \
     ((BITS) == 8 || (BITS) == 4) && FA_DECODE_SERVES(DP, PACKED_ROWS))
// The spec forward (speculative-decoding verify widths, chunked prefill): the tiled split kernel
// with blocks of FA_SPEC_BLOCK_Q(forward_block_q) packed rows (16, or the bucket's forward_block_q
// where smaller), instantiated with the decode kernel (FA_IF_DECODE). It serves a split problem
// whose packed rows per KV head do not fit a decode block but fit one spec block
// (FA_SPEC_SERVES): one block per KV head and chunk reads each K/V byte once, and its SIMD-groups
// own 8 rows x half of head_dim, half the products per key of a 32-row block (which would pad 16
// rows to 32); the cost model puts it at the DRAM bound up to 16 packed rows (docs/decode.md).
#define FA_SPEC_ROWS 16
#define FA_SPEC_BLOCK_Q(FWD_BQ) ((FWD_BQ) < FA_SPEC_ROWS ? (FWD_BQ) : FA_SPEC_ROWS)
#define FA_SPEC_SERVES(DP, FWD_BQ, PACKED_ROWS)                                                    \
    ((DP) <= FA_DECODE_MAX_HEAD_DIM && !FA_DECODE_SERVES(DP, PACKED_ROWS) &&                       \
     (PACKED_ROWS) <= FA_SPEC_BLOCK_Q(FWD_BQ))
// FA_IF_DECODE(DP, ...): the arguments where bucket DP has a decode instance (DP <=
// FA_DECODE_MAX_HEAD_DIM), nothing above. The preprocessor cannot compare, hence a line per bucket;
// KernelTraits (flash_attention_traits.h) static_asserts that each line agrees with FA_DECODE_MAX_HEAD_DIM.
#define FA_IF_DECODE(DP, ...) FA_IF_DECODE_##DP(__VA_ARGS__)
#define FA_IF_DECODE_32(...) __VA_ARGS__
#define FA_IF_DECODE_64(...) __VA_ARGS__
#define FA_IF_DECODE_96(...) __VA_ARGS__
#define FA_IF_DECODE_128(...) __VA_ARGS__
#define FA_IF_DECODE_192(...) __VA_ARGS__
#define FA_IF_DECODE_256(...) __VA_ARGS__
#define FA_IF_DECODE_512(...)
#define FA_IF_DECODE_576(...)
// FA_IF_TENSOR(DP, ...): the arguments where half/bfloat bucket DP has a Metal 4 tensor-op forward
// (flash_attention_tensor.h, docs/tensor-ops.md: head_dim 64, 96, 128 and 256), nothing elsewhere;
// FA_TENSOR_BUCKET_MASK has bit DP / 32 of each such bucket (bits 2, 3, 4, 8), for the host's
// routing (a plain number, which Swift imports; TensorKernelTraits checks it against FA_IF_TENSOR).
#define FA_IF_TENSOR(DP, ...) FA_IF_TENSOR_##DP(__VA_ARGS__)
#define FA_IF_TENSOR_32(...)
#define FA_IF_TENSOR_64(...) __VA_ARGS__
#define FA_IF_TENSOR_96(...) __VA_ARGS__
#define FA_IF_TENSOR_128(...) __VA_ARGS__
#define FA_IF_TENSOR_192(...)
#define FA_IF_TENSOR_256(...) __VA_ARGS__
#define FA_IF_TENSOR_512(...)
#define FA_IF_TENSOR_576(...)
#define FA_TENSOR_BUCKET_MASK 284u
// The tensor-op forward's tiles (MLX's NAX attention: 64 query rows, 32 keys, 4 SIMD-groups of 16
// rows; docs/tensor-ops.md argues them per head dim): FA_TENSOR_ROWS query rows per SIMD-group,
// FA_TENSOR_BLOCK_Q (FA_SIMDGROUPS x FA_TENSOR_ROWS, checked in flash_attention_tensor.h) per
// threadgroup, key tiles of FA_TENSOR_BLOCK_K.
#define FA_TENSOR_ROWS 16
#define FA_TENSOR_BLOCK_Q 64
#define FA_TENSOR_BLOCK_K 32
// From bucket FA_TENSOR_PAIR_DP up the forward splits head_dim over SIMD-group pairs (MLX's d256
// split): two SIMD-groups share 16 rows, each owning half of O's columns, so a threadgroup holds
// FA_TENSOR_PAIR_BLOCK_Q (FA_TENSOR_BLOCK_Q / 2) rows. Plain numbers: Swift imports them.
#define FA_TENSOR_PAIR_DP 256
#define FA_TENSOR_PAIR_BLOCK_Q 32
// Bytes one thread moves per load and store of a tile copy (flash_attention_loader.h); rows whose
// address, strides or width are not multiples of it take the checked scalar copy (scalar_copies).
#define FA_CHUNK_BYTES 16
// Threadgroup tiles are stored with rows padded by 8 elements (16 bytes of half, 32 of float),
// against bank conflicts between the rows a SIMD-group reads (MLX steel attention does the same).
#define FA_TILE_PAD 8

// Head-dim buckets of the 2-byte dtypes (f16, bf16):
// X(head_dim_max, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ): per kernel the
// rows it owns and the rows of the tiles it streams (forward: BQ query rows, K/V tiles of BK keys;
// dQ: BQ query rows, K/V tiles of BK keys; dK/dV: BK key rows, Q/dO tiles of BQ query rows). A
// problem uses the first bucket whose head_dim_max >= max(head_dim, head_dim_v) (V tiles are as
// wide as K tiles; products skip the zero columns past either); kernel instances are named
// <kernel>_<dtype>_d<head_dim_max>, e.g. flash_attention_forward_f16_d64.
// Why these sizes: the forward follows MLX's steel attention (BQ 32 = 4 SIMD-groups x 8 rows; K/V
// tiles of 32 keys, 16 from head_dim 128), whose published throughput on M-series GPUs is 87-97 %
// of a measured f16 matmul ceiling. Up to head_dim 256 the forward keeps 32 query rows, each
// SIMD-group the whole head_dim of 8 of them (no partial sums), as MLX does: at 192 its tiles fit
// ((32 + 2 x 16) x 200 halves, 25.6 KB); at 256 K and V share one buffer, as in MLX's
// steel_attention.h (KV_smem, which K and then V occupy): (32 + 16) x 264 halves and a placeholder
// V row, 25.9 KB, a lane keeping 64 accumulator floats. Sharing costs two barriers per key tile
// (4, where the 16 rows over two head_dim slices met 3: 2 for the tiles, 1 for the partial S),
// two thirds as many per key and query row. metal-flash-attention's alternative, blocking head_dim
// through threadgroup memory, would take a barrier pair per head_dim block of every product.
// The backward kernels from 192 split the accumulators over two head_dim slices (16 rows, see
// above); at 256 their streamed tiles have 16 rows, so that S and dP are two independent 8x8
// chains per SIMD-group, not one, and their two streamed tiles share one buffer (dQ: V, then K;
// dK/dV: Q, then dO, then Q again), 2 barriers per tile more for dQ and 4 for dK/dV. At 512
// (Gemma's global layers) and 576 (DeepSeek's MLA decode with absorbed weights: head_dim 576,
// head_dim_v 512, which takes the 576 bucket) every kernel owns 8 rows split over 4 head_dim
// slices, so a lane keeps the accumulators of d256's backward (512) or 12.5 % more (576; see
// FA_MAX_ACCUMULATOR_FLOATS), and the backward's two streamed tiles share one buffer. The
// backward follows metal-flash-attention's three kernels (D pre-pass, dQ over query blocks, dK/dV
// over key blocks with K, V, dK, dV resident); its tiles are the largest that keep each kernel's
// threadgroup storage within 32 KiB (static_assert in KernelTraits, flash_attention_traits.h), where a kernel's two
// streamed tiles share one buffer when both do not fit (then a placeholder row replaces one):
//   forward: (BQ + 2 BK) (DP + 8) halves, shared (BQ + BK + 1) (DP + 8)
//            (+ 4 x 8 x BK floats when split over head_dim)
//   dQ:      2 (BQ + BK) (DP + 8) halves, shared (2 BQ + BK + 1) (DP + 8)
//            (+ 2 x 4 x 8 x BK floats when split)
//   dK/dV:   2 (BK + BQ) (DP + 8) halves, shared (2 BK + BQ + 1) (DP + 8), + 3 x BQ floats
//            (+ 2 x 4 x 8 x BQ floats when split)
#define FA_HEAD_DIM_BUCKETS(X)           \
    X(32, 32, 32, 32, 32, 32, 32)        \
    X(64, 32, 32, 32, 32, 32, 32)        \
    X(96, 32, 32, 32, 32, 32, 32)        \
    X(128, 32, 16, 32, 16, 32, 16)       \
    X(192, 32, 16, 16, 16, 16, 16)       \
    X(256, 32, 16, 16, 16, 16, 16)       \
    X(512, 8, 8, 8, 8, 8, 8)             \
    X(576, 8, 8, 8, 8, 8, 8)

// Occupancy. An Apple7/8 GPU core has about 60 KB of threadgroup memory (metal-benchmarks,
// philipturner; at most 32 KiB per threadgroup), so a kernel whose threadgroup uses B bytes runs at
// most FA_CORE_THREADGROUP_BYTES / B threadgroups per core at once. Threadgroup bytes per kernel
// and bucket (the engine's sizeof of each <kernel>_threadgroup struct) / threadgroups per core:
//   half, bfloat   forward        dQ             dK/dV
//   d32            7696 / 7       10256 / 5      10640 / 5
//   d64           13840 / 4       18448 / 3      18832 / 3
//   d96           19984 / 3       26640 / 2      27024 / 2
//   d128          17424 / 3       26128 / 2      26320 / 2
//   d192          25616 / 2       29696 / 2      29888 / 2
//   d256          25888 / 2       29968 / 2      30160 / 2
//   d512          25984 / 2       28048 / 2      28144 / 2
//   d576          29056 / 2       31248 / 1      31344 / 1
//   float
//   d32           15376 / 3       20496 / 2      20880 / 2
//   d64           27664 / 2       27664 / 2      27856 / 2
//   d96           26640 / 2       30720 / 2      30912 / 1
//   d128          28160 / 2       28160 / 2      28256 / 2
//   d192          20224 / 3       27648 / 2      27744 / 2
//   d256          26368 / 2       28448 / 2      28544 / 2
//   backward_delta: 20480 / 3 (half, bfloat), 24576 / 2 (float); the other kernels use less.
// The target, checked by KernelTraits: at least FA_FORWARD_MIN_THREADGROUPS_PER_CORE forward
// threadgroups per core for half and bfloat up to head_dim 128 (MLX's steel attention fits 4).
// float32's tiles take twice the bytes: its buckets trade rows for 2 threadgroups per core.
#define FA_CORE_THREADGROUP_BYTES 61440
#define FA_FORWARD_MIN_THREADGROUPS_PER_CORE 3

// Registers. A kernel owning ROWS rows keeps, per lane, FA_ACCUMULATOR_FLOATS(DP, ROWS) float32
// accumulator elements of each output it sums over keys or queries (forward and split: O; dQ: dQ;
// dK/dV: dK and dV, twice that): a SIMD-group's 8 rows x DP / (32 / ROWS) head_dim columns over
// its 32 lanes. The budget, checked by KernelTraits so that no bucket's accumulators outgrow
// the registers (no spills by construction): FA_MAX_ACCUMULATOR_FLOATS per lane per kernel.
//   half, bfloat   forward  dQ  dK/dV        float   forward  dQ  dK/dV
//   d32                 8    8     16        d32           8   8     16
//   d64                16   16     32        d64          16  16     32
//   d96                24   24     48        d96          24  12     24
//   d128               32   32     64        d128         16  16     32
//   d192               48   24     48        d192         12  12     24
//   d256               64   32     64        d256         16  16     32
//   d512               32   32     64
//   d576               36   36     72
// d512 keeps exactly d256's backward; d576's dK/dV (72) sets the budget.
#define FA_ACCUMULATOR_FLOATS(DP, ROWS) ((DP) * (ROWS) / FA_THREADS_PER_THREADGROUP)
#define FA_MAX_ACCUMULATOR_FLOATS 72

// Head-dim buckets of float32, whose tiles take twice the bytes: the owned rows and tiles shrink
// (down to 8 x 8 at head_dim 192 and 256, 4 head_dim slices). Where even that exceeds 32 KiB
// (the backward kernels at 256) the two streamed tiles share one buffer (see the storage structs).
// The 2-byte dtypes' 32-row forward at 256 would need (32 + 16 + 1) x 1056 bytes, 51.7 KB, even
// with K and V sharing a buffer.
#define FA_HEAD_DIM_BUCKETS_F32(X)       \
    X(32, 32, 32, 32, 32, 32, 32)        \
    X(64, 32, 32, 32, 16, 32, 16)        \
    X(96, 32, 16, 16, 16, 16, 16)        \
    X(128, 16, 16, 16, 8, 16, 8)         \
    X(192, 8, 8, 8, 8, 8, 8)             \
    X(256, 8, 8, 8, 8, 8, 8)

#endif
