// MLX primitives of flash_attention_metal: the library's fused forward and backward as MLX graph
// nodes, so that mx.compile, mx.vmap and mx.grad see them (MLX's examples/extensions pattern).
// Math: FlashAttention-2 (Dao, 2023), Algorithm 1 (forward) and Algorithm 2 (backward); the
// semantics are those of the C ABI, Sources/CFlashAttentionMetal/include/flash_attention_metal.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flash_attention_metal.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace flash_attention_mlx {

namespace mx = mlx::core;

// Dropout on the attention probabilities (fa_problem's dropout_p, dropout_seed, dropout_offset):
// p 0 is off. The backward node gets the forward's, and regenerates its mask.
struct Dropout {
    float p = 0.0f;
    uint64_t seed = 0;
    uint64_t offset = 0;

    bool operator==(const Dropout& other) const {
        return p == other.p && seed == other.seed && offset == other.offset;
    }
};

// What a forward or backward node computes besides its input arrays. The node's inputs end with
// the mask (when mask_type is not FA_ATTN_MASK_NONE) and then the sinks (when has_sinks).
struct Options {
    float scale;
    bool causal;
    fa_attn_mask_type mask_type;  // NONE, BOOL (bool array) or ADDITIVE_FLOAT32 (float32 array)
    bool has_sinks;                // sinks: float32 [num_heads]
    Dropout dropout;

    bool operator==(const Options& other) const {
        return scale == other.scale && causal == other.causal && mask_type == other.mask_type &&
               has_sinks == other.has_sinks && dropout == other.dropout;
    }
};

// out = softmax(scale * q k^T + mask, with sinks) v as one graph node with outputs (out, lse).
//   q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv): one of float16, bfloat16, float32.
//   mask: None, a bool array (true = may attend) or an additive array, broadcastable to
//   (B, H, Lq, Lk); sinks: None or (H,) logits of one virtual key per head; dropout: FlashAttention's
//   dropout on P (the library's Philox mask of (seed, offset, batch, head, row, key)).
//   Returns out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) float32 (of the undropped scores).
// Throws std::invalid_argument naming the argument and the rule (the library's own checks, run
// before anything is evaluated) for bad shapes, dtypes or scale.
std::vector<mx::array> attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                 bool causal, const std::optional<mx::array>& mask,
                                 const std::optional<mx::array>& sinks, Dropout dropout = {},
                                 mx::StreamOrDevice s = {});

// The backward node on its own: (dq, dk, dv) of attention from dout and the forward's q, k, v, out
// and lse, which may be the lse of a longer row (ring attention over key blocks: the library uses
// it as given). No mask or sinks. Same dtype rules and errors as attention().
std::vector<mx::array> attention_backward(const mx::array& dout, const mx::array& q, const mx::array& k,
                                          const mx::array& v, const mx::array& out, const mx::array& lse,
                                          float scale, bool causal, mx::StreamOrDevice s = {});

// What both nodes share: their Options (equivalent nodes have equal ones, for mx.compile's
// common-subexpression elimination) and the refusal of forward-mode differentiation.
class Node : public mx::Primitive {
  public:
    Node(mx::Stream stream, Options options) : mx::Primitive(stream), options_(options) {}

    std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                               const std::vector<int>& argnums) override;
    bool is_equivalent(const mx::Primitive& other) const override;

  protected:
    Options options_;
};

// The forward node: inputs q, k, v[, mask][, sinks]; outputs out, lse.
class Forward : public Node {
  public:
    using Node::Node;

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                               const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
    std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                             const std::vector<int>& axes) override;
    std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
    const char* name() const override { return "FlashAttentionForward"; }
};

// The backward node: inputs dout, q, k, v, out, lse[, mask][, sinks]; outputs dq, dk, dv[, dsinks
// float32 (H,)]. Its vjp is refused (no second derivatives).
class Backward : public Node {
  public:
    using Node::Node;

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                               const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
    std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                             const std::vector<int>& axes) override;
    std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
    const char* name() const override { return "FlashAttentionBackward"; }
};

// The library's problem description of a node's arrays (contiguous tensors; the mask's size-1
// axes broadcast through 0 strides). Pointers are only marked present (the plan reads no memory);
// the evaluators point them at the data.
fa_problem make_problem(const Options& options, const mx::array& q, const mx::array& k, const mx::array& v,
                        const mx::array* mask);

// Every input of a node is made row-contiguous when the node is built (the library is handed
// contiguous tensors); throws std::logic_error if one is not, which would be a bug here.
void require_contiguous(const std::vector<mx::array>& inputs);

// Work one Metal command buffer may hold against macOS's GPU watchdog: the Swift host's budget
// (the header's FA_PLAN_PIECE_FLOPS_LOG2, 2^35 FLOP), which fa_plan_create cuts passes by.
constexpr uint64_t kMaxFlopsPerCommandBuffer = uint64_t{1} << FA_PLAN_PIECE_FLOPS_LOG2;

// Why MLX's GPU stream cannot run `pass` of `problem`, "" when it can: the library would cut the
// pass into more than one command buffer of kMaxFlopsPerCommandBuffer, and an MLX extension cannot
// end MLX's command buffer inside eval_gpu (MLX adds its completion handler afterwards), so a long
// pass would run as one command buffer that the watchdog may kill. The message names the limit and
// the ways around it. "" as well for a problem the library refuses (check_problem reports that).
std::string long_pass_refusal(const fa_problem& problem, fa_pass pass);

// The tensor-op route of the last pass eval_gpu encoded and why (fa_plan_tensor_ops: "tensor ops:
// ..." or "simdgroup kernels: ...", with the compiler's message where the tensor-op library failed
// to compile); "" before the first, and always with an MLX without Metal.
std::string tensor_ops_route();

// Throws std::invalid_argument with the library's message when the problem is not one it runs
// (the checks of fa_forward/fa_backward, without touching memory).
void check_problem(const fa_problem& problem, fa_pass pass);

}  // namespace flash_attention_mlx
