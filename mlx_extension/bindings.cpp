// The Python module flash_attention_metal._mlx_ext (nanobind in MLX's domain, so mx.array passes
// through MLX's own type caster). Imported by flash_attention_metal.mlx after mlx.core.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_mlx_ext, m) {
    m.doc() = "flash_attention_metal's MLX primitives (fused forward and backward); use flash_attention_metal.mlx";
    m.def(
        "attention",
        [](const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale, bool causal,
           const std::optional<mlx::core::array>& mask, const std::optional<mlx::core::array>& sinks,
           float dropout_p, uint64_t dropout_seed, uint64_t dropout_offset, mlx::core::StreamOrDevice stream) {
            return flash_attention_mlx::attention(q, k, v, scale, causal, mask, sinks,
                                                  {dropout_p, dropout_seed, dropout_offset}, stream)[0];
        },
        "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a, "mask"_a = nb::none(), "sinks"_a = nb::none(),
        "dropout_p"_a = 0.0f, "dropout_seed"_a = 0, "dropout_offset"_a = 0, "stream"_a = nb::none(),
        "Attention out (B, H, Lq, Dv) of the fused forward node (its vjp is the fused backward node). "
        "mask: None, a bool array or an additive array broadcastable to (B, H, Lq, Lk); sinks: None or "
        "(H,); dropout_p, dropout_seed, dropout_offset: the library's dropout (p 0 off). Raises ValueError naming "
        "the argument for what the library refuses.");
    m.def(
        "forward_with_lse",
        [](const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale, bool causal,
           const std::optional<mlx::core::array>& mask, const std::optional<mlx::core::array>& sinks,
           mlx::core::StreamOrDevice stream) {
            return flash_attention_mlx::attention(q, k, v, scale, causal, mask, sinks, {}, stream);
        },
        "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a, "mask"_a = nb::none(), "sinks"_a = nb::none(),
        "stream"_a = nb::none(),
          "[out, lse] of the forward node. No gradient flows through lse (its cotangent is not used): "
          "for code with its own vjp (ring attention).");
    m.def("backward", &flash_attention_mlx::attention_backward, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a,
          "scale"_a, "causal"_a, "stream"_a = nb::none(),
          "[dq, dk, dv] of the backward node; lse may be that of a longer row (blockwise or ring attention).");
    m.def(
        "long_pass_refusal",
        [](const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, bool causal,
           bool backward) {
            flash_attention_mlx::Options options{1.0f, causal, FA_ATTN_MASK_NONE, false};
            return flash_attention_mlx::long_pass_refusal(flash_attention_mlx::make_problem(options, q, k, v, nullptr),
                                                          backward ? FA_PASS_BACKWARD : FA_PASS_FORWARD);
        },
        "q"_a, "k"_a, "v"_a, "causal"_a, "backward"_a,
        "Why the GPU stream would refuse this pass of these (B, H, L, D) arrays ('' when it runs): more work "
        "than one command buffer may hold against the GPU watchdog (eval_gpu cannot commit in pieces).");
    m.def("tensor_ops", &flash_attention_mlx::tensor_ops_route,
          "The tensor-op route of the last pass on MLX's GPU stream and why ('' before the first): 'tensor ops: "
          "...' or 'simdgroup kernels: ...', with the compiler's message where the tensor-op library failed.");
    m.attr("ABI_VERSION") = FA_VERSION;
}
