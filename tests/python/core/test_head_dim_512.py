"""head_dim 512 (Gemma's global layers) and 576 with head_dim_v 512 (DeepSeek's MLA decode with
absorbed weights): the buckets d512 and d576 of float16 and bfloat16 (flash_attention_params.h),
forward and backward under the accuracy rule on prefill and decode shapes, every score option
once, GQA, bshd and strided views, merge, the exported plan; float32 above 256 is UNSUPPORTED.

Cost: about 15 s of ./build.sh test's pytest (CPU engine, 2 shared cores).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _native, accuracy, plan
from flash_attention_metal._validation import Shape

from conftest import assert_within_rule, judge, make_inputs

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _kernels(ctx) -> list[str]:
    return [d.kernel for d in ctx.last_profile.dispatches]


def _split_kernel(suffix: str, bucket: int) -> str:
    """The kernel that writes a decode call's chunks above head_dim 256: the tiled split kernel
    (the decode kernel has no instance there, FA_DECODE_MAX_HEAD_DIM)."""
    return f"flash_attention_forward_split_{suffix}_d{bucket}"


# (label, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, options, layout)
CASES = [
    ("prefill GQA causal", "float16", 4, 2, 37, 45, 512, 512, dict(causal=True), "bhsd"),
    ("prefill bshd", "bfloat16", 2, 1, 20, 33, 512, 512, {}, "bshd"),
    ("decode GQA", "float16", 4, 1, 1, 300, 512, 512, dict(causal=True), "bhsd"),
    ("decode 3 rows", "bfloat16", 4, 2, 3, 129, 512, 512, dict(causal=True), "bhsd"),
    ("window", "bfloat16", 2, 2, 30, 40, 512, 512, dict(window_size=(7, 3)), "bhsd"),
    ("softcap", "float16", 2, 1, 17, 25, 512, 512, dict(softcap=1.5, causal=True), "bhsd"),
    ("alibi", "float16", 2, 2, 17, 25, 512, 512, dict(alibi_slopes=np.array([0.5, 0.25], np.float32)), "bhsd"),
    ("sinks", "bfloat16", 2, 1, 17, 25, 512, 512, dict(sinks=np.array([1.0, -0.5], np.float32)), "bhsd"),
    ("mla 576/512 prefill", "float16", 4, 1, 33, 40, 576, 512, dict(causal=True), "bhsd"),
    ("mla 576/512 bshd", "bfloat16", 2, 1, 20, 30, 576, 512, {}, "bshd"),
    # Between the buckets: the zero columns past head_dim or head_dim_v are skipped.
    ("300 in d512", "float16", 2, 1, 21, 37, 300, 300, dict(causal=True), "bhsd"),
    ("520/64 in d576", "bfloat16", 2, 2, 9, 30, 520, 64, {}, "bhsd"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_within_the_rule(ctx, case):
    label, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, options, layout = case
    q, k, v, dout = make_inputs(7, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v=head_dim_v,
                                dtype=DTYPES[dtype], layout=layout)
    judge(ctx, q, k, v, dout, options, label, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(ctx, dtype, kind):
    q, k, v, dout = make_inputs(8, 2, 2, 1, 9, 21, 512, dtype=DTYPES[dtype])
    rng = np.random.default_rng(3)
    if kind == "bool":
        mask = rng.random((2, 2, 9, 21)) < 0.7
    else:
        mask = (2 * rng.standard_normal((9, 21))).astype(np.float32)
    judge(ctx, q, k, v, dout, dict(attn_mask=mask, causal=True), f"{kind} mask {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_takes_the_split_path_of_the_576_bucket(ctx, dtype):
    # DeepSeek's MLA decode: one KV head (the latent cache), many query heads, 1 query row.
    q, k, v, _ = make_inputs(9, 2, 8, 1, 1, 600, 576, head_dim_v=512, dtype=DTYPES[dtype])
    out, lse = ctx.forward(q, k, v, causal=True)
    suffix = "f16" if dtype == "float16" else "bf16"
    chunks, combine = _kernels(ctx)
    assert chunks == _split_kernel(suffix, 576) and combine == f"flash_attention_forward_combine_{suffix}"
    assert out.shape == (2, 8, 1, 512)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), f"mla decode {dtype}")


def test_strided_views(ctx):
    # q, k, v as views into wider buffers (rows not contiguous with each other): the checked path.
    q, k, v, _ = make_inputs(10, 1, 4, 2, 19, 35, 520)
    q, k, v = q[..., 4:516], k[..., :512], v[..., 8:]
    out, lse = ctx.forward(q, k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), "strided views")


@pytest.mark.parametrize("head_dim", [512, 576])
def test_merge(ctx, head_dim):
    q, k, v, _ = make_inputs(11, 1, 2, 2, 5, 70, head_dim, head_dim_v=512)
    out_a, lse_a = ctx.forward(q, k[:, :, :30], v[:, :, :30])
    out_b, lse_b = ctx.forward(q, k[:, :, 30:], v[:, :, 30:])
    out, lse = ctx.merge_attention(out_a, lse_a, out_b, lse_b)
    base_a = accuracy.base_forward(q, k[:, :, :30], v[:, :, :30])
    base_b = accuracy.base_forward(q, k[:, :, 30:], v[:, :, 30:])
    base_out = accuracy.base_merge_attention(*base_a, *base_b)[0]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, base_out=base_out), f"merge d{head_dim}")


def test_exported_plan_names_the_new_buckets():
    library = _native.native()

    def kernels(shape: Shape, pass_name: str) -> list[str]:
        problem = _abi.new_problem(library.ffi, library.lib, shape, True, 0.05, "bfloat16", {})
        return [d.kernel_name for d in plan.create(problem, pass_name).dispatches]

    chunks, combine = kernels(Shape(1, 8, 1, 1, 4096, 576, 512), "forward")
    assert chunks == _split_kernel("bf16", 576) and combine == "flash_attention_forward_combine_bf16"
    assert kernels(Shape(1, 8, 2, 100, 100, 512), "forward") == ["flash_attention_forward_bf16_d512"]
    # 26 dK/dV threadgroups of 2 per core on the nominal 10 cores: the group splits in 2 (GroupSplit.swift).
    assert kernels(Shape(1, 8, 2, 100, 100, 512), "backward") == [
        "flash_attention_backward_delta_bf16", "flash_attention_backward_lse_residual_bf16_d512",
        "flash_attention_backward_dq_bf16_d512", "flash_attention_backward_dkv_split_bf16_d512",
        "flash_attention_backward_dkv_reduce_bf16"]
    # Between the buckets: head_dim 300 runs in d512 with the zero columns past it skipped.
    assert kernels(Shape(1, 2, 2, 40, 40, 300), "forward") == ["flash_attention_forward_bf16_d512"]


@pytest.mark.parametrize("head_dim,head_dim_v", [(512, 512), (576, 512), (257, 64), (64, 300)])
def test_float32_above_256_is_unsupported(ctx, head_dim, head_dim_v):
    q, k, v, dout = make_inputs(12, 1, 2, 2, 3, 5, head_dim, head_dim_v=head_dim_v, dtype=np.float32)
    rule = (rf"FA_STATUS_UNSUPPORTED.*head_dim \({head_dim}\) and head_dim_v \({head_dim_v}\) with dtype float32 "
            r"must be at most 256")
    with pytest.raises(fam.FlashAttentionError, match=rule):
        ctx.forward(q, k, v)
    with pytest.raises(fam.FlashAttentionError, match=rule):
        ctx.backward(dout, q, k, v, dout, np.zeros(q.shape[:3], np.float32))


def test_the_largest_head_dim_is_576(ctx):
    assert ctx.max_head_dim == 576
    q, k, v, _ = make_inputs(13, 1, 1, 1, 2, 2, 577)
    with pytest.raises(ValueError, match=r"head_dim \(577\) must be at most fa_max_head_dim\(\) \(576\)"):
        ctx.forward(q, k, v)


def test_torch_wrapper_passes_the_new_sizes_through(ctx):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e 'python[torch]')")
    from flash_attention_metal import torch as fat

    q, k, v, dout = make_inputs(14, 1, 4, 2, 6, 40, 512, dtype=np.float16, layout="bshd")
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    out = fat.flash_attn_func(tq, tk, tv, causal=True)
    grads = torch.autograd.grad(out, (tq, tk, tv), torch.from_numpy(dout))
    # The same kernels on the same bytes: identical to the library's own result.
    ref_out, lse = ctx.forward(q, k, v, causal=True, layout="bshd")
    ref_grads = ctx.backward(dout, q, k, v, ref_out, lse, causal=True, layout="bshd")
    np.testing.assert_array_equal(out.detach().numpy(), ref_out)
    for grad, ref in zip(grads, ref_grads):
        np.testing.assert_array_equal(grad.numpy(), ref)
    q32 = torch.zeros(1, 1, 2, 576)
    with pytest.raises(fam.FlashAttentionError, match=r"with dtype float32 must be at most 256"):
        fat.scaled_dot_product_attention(q32, q32, q32[..., :512])


def test_mlx_wrapper_passes_the_new_sizes_through(ctx):
    mx = pytest.importorskip("mlx.core", reason="MLX is not installed")
    from flash_attention_metal import mlx as fam_mlx

    q, k, v, _ = make_inputs(15, 1, 8, 1, 1, 300, 576, head_dim_v=512, dtype=np.float16)
    out = fam_mlx.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.05)
    np.testing.assert_array_equal(np.array(out), ctx.forward(q, k, v, softmax_scale=0.05)[0])
