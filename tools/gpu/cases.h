// The shapes the CUDA harness runs and their seeded float16 inputs.
#ifndef FA_GPU_CASES_H
#define FA_GPU_CASES_H

#include <string>
#include <vector>

#include "reference.h"

// One problem with a stable name such as "d40_b1_h8x2_q33_k77_causal" (head_dim, batch,
// num_heads x num_kv_heads, seqlen_q, seqlen_k, mask, and "_s<scale>" for a non-default scale).
struct TestCase {
    std::string name;
    AttentionShape shape;
};

// The accuracy grid: every head-dim bucket (head_dim 1, 3, 32, 40, 59, 64, 80, 96, 104, 128, 160,
// 192, 200, 256), causal on and off, GQA 8/2 and MQA, cross-attention both ways (with causal
// empty rows), decode (seqlen_q 1), batch 2, odd lengths, a few longer sequences and scales, and
// short GQA queries (2-8 rows) for the split-KV forward.
std::vector<TestCase> full_grid();

// The sanitizer grid: 26 cases, seqlen <= 100, at least three per head-dim bucket, the same kinds
// of shape (GQA, MQA, cross-attention both ways, decode and short GQA queries that also run the
// split-KV forward, causal empty rows, a custom scale).
std::vector<TestCase> small_grid();

// q, k, v and dout drawn from N(0, 1) and rounded to float16, seeded by the case name (so a
// filtered run sees the same inputs as the full one).
AttentionInputs random_inputs(const TestCase &test_case);

#endif
