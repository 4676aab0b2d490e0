// One attention problem of the CUDA check build on the host: its shape, score modifiers and inputs.
// tests/cuda/judge.py judges results with python/flash_attention_metal's reference and accuracy
// rule; this header only describes what dump.h writes. Plain C++17, no CUDA.
#ifndef FA_GPU_PROBLEM_H
#define FA_GPU_PROBLEM_H

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtype_bits.h"

// attn_mask's kinds (FA_MASK_* of flash_attention_params.h): boolean (True = may attend),
// additive in the problem's dtype, additive float32.
enum class MaskKind { none, boolean, additive, additive_f32 };

// The score modifiers of a problem (issue 15), with python/flash_attention_metal/reference.py's
// semantics. Scores, in this order: softcap * tanh(softmax_scale * q.k / softcap) (softcap > 0;
// else softmax_scale * q.k), minus slope * |i + seqlen_k - seqlen_q - j| (ALiBi), plus the additive
// mask. Query i sees key j iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k -
// seqlen_q + window_right (-1: that side unbounded; causal makes window_right 0), a boolean mask
// allows it and an additive mask entry is not -inf. A sink is one virtual key per head of logit
// sinks[h] and no value, in every row's softmax denominator.
struct ScoreOptions {
    int window_left = -1;
    int window_right = -1;
    float softcap = 0.0f;
    MaskKind mask = MaskKind::none;
    bool mask_per_batch = false;  // mask shape (B|1, H|1, seqlen_q, seqlen_k): size-1 axes
    bool mask_per_head = false;   // broadcast (stride 0 on the device)
    bool alibi = false;
    bool alibi_per_batch = false;  // slopes (batch, num_heads) instead of (num_heads,)
    bool sinks = false;
};

// One attention problem. Host tensors are contiguous and row-major in the logical order: q, dq
// (batch, num_heads, seqlen_q, head_dim); k, dk (batch, num_kv_heads, seqlen_k, head_dim); v, dv
// (batch, num_kv_heads, seqlen_k, head_dim_v); out, dout (batch, num_heads, seqlen_q, head_dim_v);
// lse (batch, num_heads, seqlen_q); mask (mask_batches, mask_heads, seqlen_q, seqlen_k); alibi
// slopes (alibi_batches, num_heads); sinks and dsinks (num_heads). (Where they live on the device
// is the plan's business.)
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
    DType dtype;          // of q, k, v, dout, an additive mask and every output but lse, dsinks
    ScoreOptions options = {};

    size_t q_elements() const { return size_t(batch) * num_heads * seqlen_q * head_dim; }
    size_t k_elements() const { return size_t(batch) * num_kv_heads * seqlen_k * head_dim; }
    size_t v_elements() const { return size_t(batch) * num_kv_heads * seqlen_k * head_dim_v; }
    size_t out_elements() const { return size_t(batch) * num_heads * seqlen_q * head_dim_v; }
    size_t lse_elements() const { return size_t(batch) * num_heads * seqlen_q; }
    int mask_batches() const { return options.mask_per_batch ? batch : 1; }
    int mask_heads() const { return options.mask_per_head ? num_heads : 1; }
    size_t mask_elements() const {
        return options.mask == MaskKind::none
                   ? 0
                   : size_t(mask_batches()) * mask_heads() * seqlen_q * seqlen_k;
    }
    int alibi_batches() const { return options.alibi_per_batch ? batch : 1; }
    size_t alibi_elements() const {
        return options.alibi ? size_t(alibi_batches()) * num_heads : 0;
    }
    // The window's right side with causal folded in (0 when causal), as the library passes it.
    int window_right() const { return causal ? 0 : options.window_right; }
};

// The inputs q, k, v and the output gradient dout (shaped like out), as float values that the
// shape's dtype represents exactly; mask (boolean: 0 or 1; additive: values of the dtype, or of
// float32 for MaskKind::additive_f32, -inf allowed), alibi slopes and sinks (float32), each empty
// when the shape has none.
struct AttentionInputs {
    std::vector<float> q, k, v, dout, mask, alibi, sinks;
};

// Index of pair (i, j) of (b, h) in the host mask (size-1 axes broadcast).
inline size_t mask_index(const AttentionShape &s, int b, int h, int i, int j) {
    const size_t mb = s.options.mask_per_batch ? size_t(b) : 0;
    const size_t mh = s.options.mask_per_head ? size_t(h) : 0;
    return ((mb * size_t(s.mask_heads()) + mh) * size_t(s.seqlen_q) + size_t(i)) * size_t(s.seqlen_k) +
           size_t(j);
}

#endif
