"""The tensor-op backward (issue 37: backward_dq_tensor, backward_dkv_tensor on the CPU engine's matmul2d
emulation) forced with FLASH_ATTENTION_TENSOR_OPS=1: gradients against the float64 reference under the
accuracy rule's tensor-op term, every head-dim bucket it serves (64, 96, 128, 256), float16 and
bfloat16, every option of the simdgroup backward (GQA, causal, window, masks, softcap, ALiBi, sinks,
dropout, varlen), in the M5 cooperative-tensor layout and in the permuted one (a kernel that assumed a
layout fails there), and one real model's backward (the SmolLM2 fixture's GQA prefill). The forward
feeding each backward runs the simdgroup kernels, so a failure names the backward."""

from __future__ import annotations

import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy, dropout
from flash_attention_metal.reference import sequence_view

from conftest import make_inputs

BF16 = ml_dtypes.bfloat16
LAYOUTS = ["m5", "permuted"]
TENSOR_KERNELS = ("backward_dq_tensor", "backward_dkv_tensor")

# (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options): each option at least once,
# each head-dim bucket in both dtypes, rows and keys that end inside a 64-row block and a 32-key tile.
CASES = {
    "f16-d64-plain": (np.float16, 1, 2, 2, 37, 45, 64, {}),
    "bf16-d64-causal-gqa": (BF16, 2, 4, 2, 50, 33, 64, dict(causal=True)),
    "f16-d96-window": (np.float16, 1, 2, 1, 70, 60, 80, dict(window_size=(11, 6))),
    "bf16-d96-alibi-bool-mask": (BF16, 2, 2, 2, 33, 40, 96, dict(alibi="per batch and head", attn_mask="bool")),
    "f16-d128-softcap-sinks": (np.float16, 1, 2, 1, 40, 70, 128, dict(softcap=1.5, sinks=True)),
    "bf16-d128-additive-mask-causal": (BF16, 1, 2, 2, 66, 66, 112, dict(attn_mask="additive", causal=True)),
    "f16-d256-dropout-gqa": (np.float16, 1, 4, 2, 36, 40, 256, dict(dropout=(0.3, 2024, 17))),
    "bf16-d256-window-alibi": (BF16, 1, 2, 2, 20, 45, 200, dict(window_size=(-1, 4), alibi="per head")),
}


def _options(spec: dict, rng, batch, heads, seqlen_q, seqlen_k, dtype) -> dict:
    """The library's and the reference's keyword arguments for a case's option spec."""
    options = {name: spec[name] for name in ("causal", "window_size", "softcap") if name in spec}
    if spec.get("alibi") == "per head":
        options["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, heads + 1, dtype=np.float32) / heads)
    elif spec.get("alibi") == "per batch and head":
        options["alibi_slopes"] = rng.uniform(0.0, 0.5, (batch, heads)).astype(np.float32)
    if spec.get("attn_mask") == "bool":
        options["attn_mask"] = rng.random((batch, heads, seqlen_q, seqlen_k)) < 0.8
    elif spec.get("attn_mask") == "additive":
        additive = 2 * rng.standard_normal((batch, heads, seqlen_q, seqlen_k))
        additive[rng.random(additive.shape) < 0.15] = -np.inf
        options["attn_mask"] = additive.astype(dtype)
    if spec.get("sinks"):
        options["sinks"] = (2 * rng.standard_normal(heads)).astype(np.float32)
    return options


@pytest.fixture(params=LAYOUTS)
def tensor_layout(request, monkeypatch) -> str:
    """The cooperative-tensor layout of the emulation (read when a cooperative tensor is made)."""
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_LAYOUT", request.param)
    return request.param


def _route(monkeypatch, forced: str) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", forced)


def _kernels(ctx) -> list[str]:
    return [d.kernel for d in ctx.last_profile.dispatches]


def _tensor_backward(ctx, monkeypatch, dout, q, k, v, **options):
    """out, lse from the simdgroup forward, then the backward forced onto the tensor-op kernels
    (asserted from the profile); returns (out, lse, grads)."""
    _route(monkeypatch, "0")
    out, lse = ctx.forward(q, k, v, **options)
    _route(monkeypatch, "1")
    grads = ctx.backward(dout, q, k, v, out, lse, **options)
    ran = _kernels(ctx)
    for name in TENSOR_KERNELS:
        assert any(f"_{name}_" in kernel for kernel in ran), (name, ran)
    return out, lse, grads


def _assert_within_tensor_rule(metrics, label):
    # FLASH_ATTENTION_TENSOR_OPS' term: the truncated float32 operands (dS, P) of relaxed precision.
    failed = [m for m in metrics if not m.passed]
    assert not failed, f"{label}\n{accuracy.describe(metrics)}"


@pytest.mark.parametrize("name", CASES)
def test_gradients_within_the_tensor_op_rule(ctx, monkeypatch, tensor_layout, name):
    dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, spec = CASES[name]
    q, k, v, dout = make_inputs(zlib.crc32(name.encode()), batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                dtype=dtype)
    options = _options(spec, np.random.default_rng(7), batch, heads, seqlen_q, seqlen_k, dtype)
    reference_options = dict(options)
    if "dropout" in spec:
        p, seed, offset = spec["dropout"]
        options.update(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
        reference_options["dropout_mask"] = dropout.reference_mask(spec["dropout"], batch, heads, seqlen_q, seqlen_k)
    _, _, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, **options)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    metrics = accuracy.evaluate_backward(dout, q, k, v, *grads, tensor_ops=True, **reference_options)
    _assert_within_tensor_rule(metrics, f"{name} layout={tensor_layout}")


# head_dim 256: dQ splits head_dim over SIMD-group pairs (32 query rows a threadgroup; 69 rows end
# with a threadgroup whose second pair has none). Every option in both dtypes; head_dim 200 and
# head_dim_v != head_dim leave the second member part or none of a matrix's columns.
PAIR_CASES = {
    "d256-causal-gqa": (1, 4, 2, 69, 45, 256, 256, dict(causal=True)),
    "d256-softcap-sinks": (1, 2, 1, 40, 70, 256, 256, dict(softcap=1.5, sinks=True)),
    "d256-bool-mask-alibi": (2, 2, 2, 33, 40, 256, 256, dict(alibi="per batch and head", attn_mask="bool")),
    "d256-additive-mask-window": (1, 2, 2, 35, 37, 256, 256, dict(attn_mask="additive", window_size=(7, 3))),
    "d200-dropout": (1, 2, 1, 37, 41, 200, 200, dict(dropout=(0.25, 77, 3), causal=True)),
    "d256-dv128": (1, 2, 1, 36, 40, 256, 128, dict(causal=True)),
    "d160-dv256": (1, 2, 2, 33, 29, 160, 256, dict(alibi="per head")),
}


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", PAIR_CASES)
def test_head_dim_256_pairs_within_the_tensor_op_rule(ctx, monkeypatch, tensor_layout, name, dtype):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, spec = PAIR_CASES[name]
    q, k, v, dout = make_inputs(zlib.crc32(name.encode()), batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                head_dim_v=head_dim_v, dtype=dtype)
    options = _options(spec, np.random.default_rng(5), batch, heads, seqlen_q, seqlen_k, dtype)
    reference_options = dict(options)
    if "dropout" in spec:
        p, seed, offset = spec["dropout"]
        options.update(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
        reference_options["dropout_mask"] = dropout.reference_mask(spec["dropout"], batch, heads, seqlen_q, seqlen_k)
    _, _, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, **options)
    (dq_dispatch,) = [d for d in ctx.last_profile.dispatches if "_backward_dq_tensor_" in d.kernel]
    # One threadgroup per 32 query rows (FA_TENSOR_PAIR_BLOCK_Q).
    assert dq_dispatch.kernel.endswith("_d256") and dq_dispatch.threadgroups[0] == -(-seqlen_q // 32)
    metrics = accuracy.evaluate_backward(dout, q, k, v, *grads, tensor_ops=True, **reference_options)
    _assert_within_tensor_rule(metrics, f"{name} layout={tensor_layout}")


def test_head_dim_256_pairs_rerun_and_layouts_give_the_same_bits(ctx, monkeypatch):
    """The pair dQ sums each score's two partials in one order: reruns and both layouts agree."""
    q, k, v, dout = make_inputs(13, 1, 2, 1, 40, 50, 256)
    results = []
    for layout in LAYOUTS + ["m5"]:
        monkeypatch.setenv("FLASH_ATTENTION_TENSOR_LAYOUT", layout)
        results.append(_tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)[2])
    assert all(np.array_equal(a, b) for first, other in zip(results, results[1:]) for a, b in zip(first, other))


def test_the_rule_can_fail_and_the_route_can_be_forbidden(ctx, monkeypatch):
    """A wrong gradient fails the tensor-op rule; FLASH_ATTENTION_TENSOR_OPS=0 keeps the simdgroup
    kernels; reruns of the tensor-op backward give the same bits (no atomics)."""
    q, k, v, dout = make_inputs(3, 1, 2, 2, 40, 40, 64)
    out, lse, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)
    again = ctx.backward(dout, q, k, v, out, lse, causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(grads, again))
    wrong = grads[1].copy()
    wrong[0, 0, 5] += np.float16(0.05) * np.abs(wrong).max()
    metrics = accuracy.evaluate_backward(dout, q, k, v, grads[0], wrong, grads[2], causal=True, tensor_ops=True)
    assert [m.name for m in metrics if not m.passed] == ["dk"]
    _route(monkeypatch, "0")
    ctx.backward(dout, q, k, v, out, lse, causal=True)
    assert not any("tensor" in kernel for kernel in _kernels(ctx))


def test_varlen_sequences_equal_their_dense_calls(ctx, monkeypatch, tensor_layout):
    """A variable-length batch through the tensor-op kernels: each sequence's gradients are the
    dense tensor-op call's bits (lengths 0 and 1, GQA, causal) and within the rule."""
    lengths_q, lengths_k = [17, 0, 1, 70], [20, 3, 9, 66]
    rng = np.random.default_rng(11)
    q = rng.standard_normal((sum(lengths_q), 4, 64)).astype(np.float16)
    k = rng.standard_normal((sum(lengths_k), 2, 64)).astype(np.float16)
    v = rng.standard_normal((sum(lengths_k), 2, 64)).astype(np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    tables = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    _route(monkeypatch, "0")
    out, lse = ctx.forward_varlen(q, k, v, *tables, causal=True)
    _route(monkeypatch, "1")
    dq, dk, dv = ctx.backward_varlen(dout, q, k, v, out, lse, *tables, causal=True)
    assert all(any(f"_{name}_" in kernel for kernel in _kernels(ctx)) for name in TENSOR_KERNELS)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        sq, sk, sv, sd = (sequence_view(x, span) for x, span in ((q, rows), (k, keys), (v, keys), (dout, rows)))
        dense = ctx.backward(sd, sq, sk, sv, sequence_view(out, rows), np.ascontiguousarray(lse[None, :, rows]),
                             causal=True)
        for ours, theirs in zip((dq[rows], dk[keys], dv[keys]), dense):
            np.testing.assert_array_equal(ours, np.swapaxes(theirs[0], 0, 1), err_msg=f"sequence {b}")
        metrics = accuracy.evaluate_backward(sd, sq, sk, sv, *dense, causal=True, tensor_ops=True)
        _assert_within_tensor_rule(metrics, f"sequence {b} layout={tensor_layout}")


SMOLLM2 = Path(fam.__file__).resolve().parent / "data" / "smollm2_attention.npz"


def test_smollm2_prefill_backward(ctx, monkeypatch, tensor_layout):
    """A real model's backward: SmolLM2-135M's causal GQA prefill (9 query heads over 3 KV heads,
    head_dim 64, float16) with a seeded output gradient."""
    with np.load(SMOLLM2) as data:
        name = next(str(n) for n in data["cases"] if str(n).startswith("prefill_"))
        q, k, v = (data[f"{name}_{part}"] for part in ("q", "k", "v"))
    dout = np.random.default_rng(zlib.crc32(name.encode())).standard_normal(q.shape).astype(np.float16)
    _, _, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)
    metrics = accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True, tensor_ops=True)
    _assert_within_tensor_rule(metrics, f"{name} layout={tensor_layout}")


def test_long_sequence_within_the_rule(ctx, monkeypatch):
    """600 causal rows over 600 keys: up to 19 key tiles per row block, 19 query tiles per key block."""
    q, k, v, dout = make_inputs(29, 1, 1, 1, 600, 600, 64)
    _, _, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)
    _assert_within_tensor_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True, tensor_ops=True),
                               "long")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_lse_gives_the_simdgroup_kernels_pattern(ctx, monkeypatch, value):
    """A row whose lse is NaN or +inf makes its gradients NaN, -inf zero, as the simdgroup
    backward (the same NaN and zero entries; the finite ones within the rule's reach of each other)."""
    q, k, v, dout = make_inputs(31, 1, 2, 1, 40, 40, 64)
    _route(monkeypatch, "0")
    out, lse = ctx.forward(q, k, v)
    lse[0, 1, 4] = value
    simdgroup = ctx.backward(dout, q, k, v, out, lse)
    _route(monkeypatch, "1")
    tensor = ctx.backward(dout, q, k, v, out, lse)
    assert any("_backward_dq_tensor_" in kernel for kernel in _kernels(ctx))
    for ours, theirs in zip(tensor, simdgroup):
        ours, theirs = ours.astype(np.float32), theirs.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
        np.testing.assert_array_equal(ours == 0, theirs == 0)
        finite = np.isfinite(theirs)
        np.testing.assert_allclose(ours[finite], theirs[finite], rtol=0.05, atol=0.05)
    if value == -np.inf:
        assert np.all(tensor[0][0, 1, 4] == 0)
    else:
        assert np.all(np.isnan(tensor[0][0, 1, 4])) and np.isnan(tensor[1]).all()


def test_strided_layouts_give_the_contiguous_bits(ctx, monkeypatch):
    """bshd tensors and q, k, v sliced in place from one packed qkv tensor (row strides of 3 heads'
    columns, unaligned starts): the tensor-op kernels read rows through the strides and give the
    contiguous bhsd call's bits."""
    q, k, v, dout = make_inputs(37, 1, 2, 2, 45, 45, 64)
    _, _, expected = _tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)
    bshd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, dout)]
    _route(monkeypatch, "0")
    out, lse = ctx.forward(*bshd[:3], causal=True, layout="bshd")
    _route(monkeypatch, "1")
    grads = ctx.backward(bshd[3], *bshd[:3], out, lse, causal=True, layout="bshd")
    for ours, theirs in zip(grads, expected):
        np.testing.assert_array_equal(ours.transpose(0, 2, 1, 3), theirs)
    packed = np.empty((1, 45, 2, 3 * 64 + 1), np.float16)
    packed[..., 1:65], packed[..., 65:129], packed[..., 129:] = bshd[0], bshd[1], bshd[2]
    views = [packed[..., 1:65], packed[..., 65:129], packed[..., 129:]]
    grads = ctx.backward(bshd[3], *views, out, lse, causal=True, layout="bshd")
    assert any("_backward_dq_tensor_" in kernel for kernel in _kernels(ctx))
    for ours, theirs in zip(grads, expected):
        np.testing.assert_array_equal(ours.transpose(0, 2, 1, 3), theirs)


@pytest.mark.parametrize("head_dim, head_dim_v", [(64, 40), (96, 128)])
def test_head_dim_v_differs(ctx, monkeypatch, tensor_layout, head_dim, head_dim_v):
    """v and dout narrower or wider than q and k (the bucket of the wider): dV over head_dim_v
    columns, dQ and dK over head_dim."""
    q, k, v, dout = make_inputs(41, 1, 2, 1, 50, 37, head_dim, head_dim_v=head_dim_v, dtype=BF16)
    _, _, grads = _tensor_backward(ctx, monkeypatch, dout, q, k, v, causal=True)
    assert grads[2].shape == v.shape
    _assert_within_tensor_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True, tensor_ops=True),
                               f"head_dim {head_dim} head_dim_v {head_dim_v} layout={tensor_layout}")
