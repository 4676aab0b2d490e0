// Host-side ground truth for the CUDA check build: the float64 reference and the per-dtype "base"
// of the accuracy rule (docs: ../../../shared/design.md, "Accuracy rule"; the same math as
// python/flash_attention_metal/reference.py and accuracy.py). Plain C++17, no CUDA.
#ifndef FA_GPU_REFERENCE_H
#define FA_GPU_REFERENCE_H

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtype_bits.h"

// One attention problem. Host tensors are contiguous and row-major in the logical order: q, dq
// (batch, num_heads, seqlen_q, head_dim); k, dk (batch, num_kv_heads, seqlen_k, head_dim); v, dv
// (batch, num_kv_heads, seqlen_k, head_dim_v); out, dout (batch, num_heads, seqlen_q, head_dim_v);
// lse (batch, num_heads, seqlen_q). (Where they live on the device is the harness's business.)
struct AttentionShape {
    int batch;
    int num_heads;
    int num_kv_heads;  // divides num_heads; query head h reads KV head h / (num_heads / kv_heads)
    int seqlen_q;
    int seqlen_k;
    int head_dim;    // of q and k
    int head_dim_v;  // of v and out
    bool causal;          // bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q
    float softmax_scale;  // multiplies q . k before the softmax
    DType dtype;          // of q, k, v, dout and every output but lse

    size_t q_elements() const { return size_t(batch) * num_heads * seqlen_q * head_dim; }
    size_t k_elements() const { return size_t(batch) * num_kv_heads * seqlen_k * head_dim; }
    size_t v_elements() const { return size_t(batch) * num_kv_heads * seqlen_k * head_dim_v; }
    size_t out_elements() const { return size_t(batch) * num_heads * seqlen_q * head_dim_v; }
    size_t lse_elements() const { return size_t(batch) * num_heads * seqlen_q; }
};

// Number of keys query row `row` sees (a prefix of the keys; 0 for an empty row).
int visible_keys(const AttentionShape &shape, int row);

// The inputs q, k, v and the output gradient dout (shaped like out), as float values that the
// shape's dtype represents exactly.
struct AttentionInputs {
    std::vector<float> q, k, v, dout;
};

// float64 results: forward (out, lse; lse is -inf on empty rows) and the gradients of
// sum(dout * out) with dk, dv summed over each GQA group (FlashAttention-2, Algorithm 2).
struct ReferenceResult {
    std::vector<double> out, lse, dq, dk, dv;
};

// The baseline, each value already rounded to the dtype (stored as float).
struct BaseResult {
    std::vector<float> out, dq, dk, dv;
};

// Ground truth: float64 math on the inputs.
ReferenceResult reference_attention(const AttentionShape &shape, const AttentionInputs &in);

// What a framework computes in the shape's dtype: every matrix product (S, P@V; dP, dS@K, dS^T@Q,
// P^T@dout) accumulated in float32 and rounded to the dtype, softmax in float32 and P rounded to
// the dtype, D = rowsum(dout * out) in float32, dS rounded to the dtype; dk, dv rounded per query
// head, then summed over the GQA group in float32 and rounded once (the backward of repeating KV
// heads). For float32 every rounding is to float32 itself: the plain float32 computation.
BaseResult base_attention(const AttentionShape &shape, const AttentionInputs &in);

#endif
