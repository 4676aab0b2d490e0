// Host-side ground truth for the CUDA check build: the float64 reference and the float16 "base"
// of the accuracy rule (docs: ../../../shared/design.md, "Accuracy rule"; the same math as
// python/flash_attention_metal/reference.py and accuracy.py). Plain C++17, no CUDA.
#ifndef FA_GPU_REFERENCE_H
#define FA_GPU_REFERENCE_H

#include <cstddef>
#include <cstdint>
#include <vector>

// One attention problem. Layout: q, dout, out (batch, num_heads, seqlen_q, head_dim); k, v
// (batch, num_kv_heads, seqlen_k, head_dim); lse (batch, num_heads, seqlen_q); row-major.
struct AttentionShape {
    int batch;
    int num_heads;
    int num_kv_heads;  // divides num_heads; query head h reads KV head h / (num_heads / num_kv_heads)
    int seqlen_q;
    int seqlen_k;
    int head_dim;
    bool causal;          // bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q
    float softmax_scale;  // multiplies q . k before the softmax

    size_t q_elements() const { return size_t(batch) * num_heads * seqlen_q * head_dim; }
    size_t kv_elements() const { return size_t(batch) * num_kv_heads * seqlen_k * head_dim; }
    size_t lse_elements() const { return size_t(batch) * num_heads * seqlen_q; }
};

// Number of keys query row `row` sees (a prefix of the keys; 0 for an empty row).
int visible_keys(const AttentionShape &shape, int row);

// float16 inputs as raw binary16 bits: q, k, v and the output gradient dout (shaped like q).
struct AttentionInputs {
    std::vector<uint16_t> q, k, v, dout;
};

// float64 results: forward (out, lse; lse is -inf on empty rows) and the gradients of
// sum(dout * out) with dk, dv summed over each GQA group (FlashAttention-2, Algorithm 2).
struct ReferenceResult {
    std::vector<double> out, lse, dq, dk, dv;
};

// The float16 baseline, each value already rounded to float16 (stored as float).
struct BaseResult {
    std::vector<float> out, dq, dk, dv;
};

// Ground truth: float64 math on the float16 inputs.
ReferenceResult reference_attention(const AttentionShape &shape, const AttentionInputs &in);

// What a float16 framework computes: every matrix product (S, P@V; dP, dS@K, dS^T@Q, P^T@dout)
// accumulated in float32 and rounded to float16, softmax in float32 and P rounded to float16,
// D = rowsum(dout * out) in float32, dS rounded to float16; dk, dv rounded per query head, then
// summed over the GQA group in float32 and rounded once (the backward of repeating KV heads).
BaseResult base_attention(const AttentionShape &shape, const AttentionInputs &in);

#endif
