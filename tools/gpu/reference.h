// Host-side ground truth for the CUDA check build: the float64 reference and the per-dtype "base"
// of the accuracy rule (docs: ../../../shared/design.md, "Accuracy rule"; the same math as
// python/flash_attention_metal/reference.py and accuracy.py). Plain C++17, no CUDA.
#ifndef FA_GPU_REFERENCE_H
#define FA_GPU_REFERENCE_H

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
// is the harness's business.)
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
size_t mask_index(const AttentionShape &shape, int b, int h, int i, int j);

// Whether query row i of (b, h) may weigh key j: the window (causal folded in) and the mask.
bool key_visible(const AttentionShape &shape, const AttentionInputs &in, int b, int h, int i,
                 int j);

// float64 results: forward (out, lse; lse is -inf on empty rows, sinks[h] with sinks) and the
// gradients of sum(dout * out) with dk, dv summed over each GQA group (FlashAttention-2,
// Algorithm 2); with sinks, dsinks (num_heads) = -sum over b, i of sink_terms, the rows' terms
// exp(sinks[h] - lse) * D with D = rowsum(dout * out) (B, H, Nq). empty: 1 for a row that sees no
// key (B, H, Nq).
struct ReferenceResult {
    std::vector<double> out, lse, dq, dk, dv, dsinks, sink_terms;
    std::vector<char> empty;
};

// The baseline, each value already rounded to the dtype (stored as float); lse and, with sinks,
// sink_terms in float32 (accuracy.py's base_forward and _dsinks_metric).
struct BaseResult {
    std::vector<float> out, dq, dk, dv, lse, sink_terms;
};

// Ground truth: float64 math on the inputs.
ReferenceResult reference_attention(const AttentionShape &shape, const AttentionInputs &in);

// What a framework computes in the shape's dtype: every matrix product (S, P@V; dP, dS@K, dS^T@Q,
// P^T@dout) accumulated in float32 and rounded to the dtype, softmax in float32 and P rounded to
// the dtype, D = rowsum(dout * out) in float32, dS rounded to the dtype; dk, dv rounded per query
// head, then summed over the GQA group in float32 and rounded once (the backward of repeating KV
// heads). Softcap, ALiBi and the additive mask in float32 on the rounded scaled S, the sinks in the
// float32 softmax's denominator, dS through the softcap's 1 - tanh^2 in float32 (accuracy.py). For
// float32 every rounding is to float32 itself: the plain float32 computation, products summed by
// fma in index order, the harness's stand-in for NumPy's blocked order (the second of baselines()).
BaseResult base_attention(const AttentionShape &shape, const AttentionInputs &in);

// accuracy.py's STREAM_WIDTH and LSE_RESIDUAL_MIN: the streamed baseline's key tile, and the |lse|
// from which its backward corrects P by the float32 lse's residual.
constexpr int kStreamWidth = 8;
constexpr float kLseResidualMin = 256.0f;

// The float32 baseline in the kernels' streamed order (accuracy.py's _streamed_forward and
// _streamed_backward, the same float32 operations in the same order): every reduction (S over
// head_dim, O over keys, dP over head_dim_v, dQ over keys, dK and dV over the rows of all query
// heads of a GQA group, head after head) one rounded product at a time in index order; the online
// softmax's running max, sum (NumPy's pairwise sum of the tile's weights) and rescale of O once per
// kStreamWidth keys, the sink joining the denominator last; P recomputed from the streamed lse,
// less its residual where |lse| >= kLseResidualMin; D = rowsum(dout * out) as NumPy sums it. Only
// meaningful for float32 inputs (nothing is rounded to another dtype).
BaseResult streamed_base_attention(const AttentionShape &shape, const AttentionInputs &in);

// The baselines the accuracy rule takes, each tensor's base error being the largest of theirs
// (accuracy.py's _metric): base_attention alone for float16 and bfloat16; for float32 first
// streamed_base_attention (whose sink_terms dsinks is judged by, as accuracy.py's base_backward),
// then base_attention.
std::vector<BaseResult> baselines(const AttentionShape &shape, const AttentionInputs &in);

#endif
