// The shapes the CUDA harness runs and their seeded inputs.
#ifndef FA_GPU_CASES_H
#define FA_GPU_CASES_H

#include <limits>
#include <string>
#include <vector>

#include "problem.h"

// Where a case's tensors live on the device (layout.h places them; the host tensors of
// problem.h are always contiguous):
//   bhsd    contiguous (batch, heads, seqlen, head_dim), the library's default;
//   bshd    FlashAttention's (batch, seqlen, heads, head_dim) for every tensor;
//   qkv     q, k and v slices of one packed (batch, seqlen, heads + 2 kv_heads, head_dim)
//           projection (q = qkv[:, :, :H], k = qkv[:, :, H:H+Hkv], v = the rest), dq, dk and
//           dv the same slices of one packed gradient; out and dout bshd (needs seqlen_q =
//           seqlen_k and head_dim_v = head_dim);
//   gapped  every tensor with padding between rows, heads and batches (odd strides).
enum class Layout { bhsd, bshd, qkv, gapped };

// One problem with a stable name such as "f16_d40_b1_h8x2_q33_k77_causal": dtype, head_dim (and
// "v<head_dim_v>" when it differs), batch, num_heads x num_kv_heads, seqlen_q, seqlen_k, mask,
// "_s<scale>" for a non-default scale, the score modifiers (cases.cpp: options_name) and
// "_<layout>" for a layout other than bhsd.
struct TestCase {
    std::string name;
    AttentionShape shape;
    Layout layout;
    // An additive mask's value on the keys it hides: -inf, or float32's lowest finite value
    // (Hugging Face's masks; "min" after the mask's name), which hides nothing exactly.
    float mask_hide = -std::numeric_limits<float>::infinity();
};

// The accuracy grid: float16 over every head-dim bucket (head_dim 1, 3, 32, 40, 59, 64, 80, 96,
// 104, 128, 160, 192, 200, 256), causal on and off, GQA 8/2 and MQA, cross-attention both ways
// (with causal empty rows), decode (seqlen_q 1), batch 2, odd lengths, longer sequences and
// scales, short GQA queries (2-8 rows) for the split-KV forward; bfloat16 and float32 over every
// bucket of their tables with the same kinds of shape; strided layouts (bshd, packed qkv, gapped)
// and head_dim_v != head_dim (DeepSeek's MLA pair 192/128 among them) in every dtype; the score
// modifiers of issue 15 in every dtype (sliding windows, a causal window of 512 over 2048 keys,
// windows that leave rows empty, softcap, ALiBi per head and per batch, sinks with dsinks, boolean
// and additive masks broadcast and full, a float32-minimum additive mask, all at once; GQA,
// decode through the split-KV forward, strided layouts); rows whose |lse| >= 256 for the
// backward's lse residual (whole rows at float32's lowest value, with and without sinks; sinks
// with softmax_scale 30).
std::vector<TestCase> full_grid();

// The sanitizer grid: 44 cases, seqlen <= 100, covering every dtype, the buckets, GQA, MQA,
// cross-attention both ways, decode and short GQA queries (split-KV forward), causal empty rows,
// strided layouts, head_dim_v != head_dim and float32 at head_dim 256 (whose backward kernels
// share one tile buffer); and each score modifier at least once (window with empty rows, softcap,
// ALiBi, sinks and the dsinks kernel, boolean and additive masks, split-KV with modifiers); two
// whose lse residual dispatch recomputes rows (|lse| >= 256: whole rows at float32's lowest value;
// sinks with softmax_scale 30), so that racecheck sees its barriers.
std::vector<TestCase> small_grid();

// The layout's name as in case names ("bhsd", "bshd", "qkv", "gapped").
const char *layout_name(Layout layout);

// q, k, v and dout drawn from N(0, 1) and rounded to the case's dtype, seeded by the case name (so
// a filtered run sees the same inputs as the full one); then the modifiers' inputs: a boolean mask
// allowing 3 in 4 pairs, an additive one of N(0, 1) values (in its dtype) hiding 1 in 5 with
// mask_hide, each with one query row hidden entirely per mask head when seqlen_q >= 4; ALiBi's
// standard slopes 2^(-8 (h + 1) / H), times 1 + b / 4 per batch; sinks from N(0, 1) + 1.
AttentionInputs random_inputs(const TestCase &test_case);

#endif
