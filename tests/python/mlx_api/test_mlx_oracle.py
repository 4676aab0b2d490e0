"""The library against an implementation nobody here wrote: MLX's
``mx.fast.scaled_dot_product_attention``, forward and gradients (``mx.vjp``), run on MLX's CPU
backend (``mlx[cpu]`` from PyPI on Linux; the same CPU code on a Mac, so the bound does not depend
on the machine).

The rule is the accuracy rule with MLX in both roles: ``ref`` is MLX in float32 on the same float16
inputs (exact conversions), ``base`` is MLX in float16, and a result passes when
``max|ours - ref| <= 2 * max|base - ref| + 1e-5`` for out and ``3 *`` for dq, dk, dv. Nothing of
the library's own reference or baseline is used but ``reference.visible_keys``, to find the query
rows without keys (below).

MLX aligns causal masks bottom-right as the library does. The one difference is a query row that
sees no key (causal with seqlen_q > seqlen_k): MLX returns the mean of V there, the library 0 (as
FlashAttention does). Such rows are left out of the out comparison, and their dout rows are zero
for both implementations, so their (different) gradients do not reach dk and dv.

For attention masks and sinks, the other way round: the float64 reference that judges the library
under the accuracy rule is held against MLX in float32 (forward, gradients and dsinks), so their
semantics (PyTorch's True = may attend, additive -inf, a sink's logit in the denominator) are those
of an implementation nobody here wrote.
"""

from __future__ import annotations

import numpy as np
import pytest

from flash_attention_metal import accuracy, reference

from conftest import make_inputs

mx = pytest.importorskip("mlx.core")

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal): GQA and MQA, seqlen_q != seqlen_k
# both ways (with and without rows that see no key), decode, batch > 1, head_dim 32 to 256.
GRID = [
    (2, 4, 4, 64, 64, 32, False),
    (2, 4, 4, 64, 64, 32, True),
    (1, 3, 3, 17, 17, 40, False),
    (1, 8, 2, 48, 96, 64, True),
    (2, 6, 1, 40, 40, 64, True),
    (1, 4, 2, 96, 40, 64, True),
    (1, 4, 1, 70, 33, 96, False),
    (2, 2, 2, 33, 77, 128, True),
    (1, 4, 2, 1, 100, 128, True),
    (1, 2, 1, 57, 45, 160, True),
    (1, 2, 2, 40, 100, 192, False),
    (1, 2, 1, 50, 50, 256, True),
    (2, 2, 1, 80, 30, 256, True),
]


def _label(case):
    b, h, hk, nq, nk, d, causal = case
    return f"B{b}-H{h}-Hkv{hk}-Nq{nq}-Nk{nk}-D{d}-{'causal' if causal else 'full'}"


def _mlx(q, k, v, dout, causal: bool, dtype):
    """MLX's out, dq, dk, dv as float64, computed on the CPU in ``dtype``."""
    scale = 1.0 / np.sqrt(q.shape[-1])

    def attention(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None,
                                                    stream=mx.cpu)

    with mx.stream(mx.cpu):
        (out,), grads = mx.vjp(attention, [mx.array(a).astype(dtype) for a in (q, k, v)],
                               [mx.array(dout).astype(dtype)])
        results = [out, *grads]
        mx.eval(results)
        return [np.array(r.astype(mx.float32)).astype(np.float64) for r in results]


@pytest.mark.parametrize("case", GRID, ids=_label)
def test_forward_and_gradients_match_mlx(ctx, case):
    *shape, causal = case
    q, k, v, dout = make_inputs(sum(shape) + 7, *shape)
    seen = reference.visible_keys(q.shape[2], k.shape[2], causal).any(axis=1)
    dout[:, :, ~seen] = 0
    out, lse = ctx.forward(q, k, v, causal=causal)
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, causal=causal)
    ref = _mlx(q, k, v, dout, causal, mx.float32)
    base = _mlx(q, k, v, dout, causal, mx.float16)
    ours = [out[:, :, seen], dq, dk, dv]
    ref[0], base[0] = ref[0][:, :, seen], base[0][:, :, seen]
    report = []
    for name, mine, exact, framework in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        error = float(np.max(np.abs(mine.astype(np.float64) - exact), initial=0.0))
        bound = accuracy.bound(name, float(np.max(np.abs(framework - exact), initial=0.0)), exact)
        report.append((name, error, bound))
    text = "\n".join(f"{n}: max|ours - mlx float32| {e:.3e}, bound {b:.3e}" for n, e, b in report)
    assert all(np.isfinite(e) and e <= b for _, e, b in report), f"{_label(case)}\n{text}"


# Masks and sinks, which MLX's fast attention takes too (not the window, softcap or ALiBi): the
# float64 reference that judges the library (flash_attention_metal.reference) agrees with MLX in
# float32 on the same inputs, forward and gradients, dsinks included (through mx.vjp).
OPTION_CASES = {
    "bool padding mask, GQA": dict(shape=(2, 4, 2, 24, 40), mask="padding"),
    "additive mask with -inf, causal": dict(shape=(1, 4, 4, 40, 40), mask="additive", causal=True),
    "sinks, MQA": dict(shape=(2, 4, 1, 30, 50), sinks=True),
    "sinks and bool mask, decode": dict(shape=(2, 6, 2, 1, 90), mask="padding", sinks=True),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_reference_matches_mlx_on_masks_and_sinks(name):
    case = OPTION_CASES[name]
    batch, heads, kv_heads, seqlen_q, seqlen_k = case["shape"]
    rng = np.random.default_rng(len(name))
    q, k, v, dout = make_inputs(len(name), batch, heads, kv_heads, seqlen_q, seqlen_k, 32, dtype=np.float32)
    options, mlx_mask = {}, "causal" if case.get("causal") else None
    if case.get("mask") == "padding":
        lengths = rng.integers(seqlen_k // 2, seqlen_k + 1, size=batch)
        options["attn_mask"] = (np.arange(seqlen_k) < lengths[:, None])[:, None, None, :]
    elif case.get("mask") == "additive":
        additive = rng.standard_normal((1, heads, seqlen_q, seqlen_k)).astype(np.float32)
        additive[rng.random(additive.shape) < 0.2] = -np.inf
        # Every row keeps its diagonal key (MLX and the library differ on rows without keys).
        additive[..., np.arange(seqlen_q), np.arange(seqlen_q) + seqlen_k - seqlen_q] = 0.0
        options["attn_mask"] = additive
    if "attn_mask" in options:
        mlx_mask = mx.array(options["attn_mask"])
        if case.get("causal"):
            mlx_mask = mx.where(mx.array(reference.visible_keys(seqlen_q, seqlen_k, True)), mlx_mask, -np.inf)
    inputs = [mx.array(a) for a in (q, k, v)]
    if case.get("sinks"):
        options["sinks"] = rng.standard_normal(heads).astype(np.float32)
        inputs.append(mx.array(options["sinks"]))

    def attention(q, k, v, sinks=None):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / np.sqrt(32), mask=mlx_mask, sinks=sinks,
                                                    stream=mx.cpu)

    with mx.stream(mx.cpu):
        (out,), grads = mx.vjp(attention, inputs, [mx.array(dout)])
        mx.eval(out, grads)
    theirs = [np.array(a).astype(np.float64) for a in (out, *grads)]
    ours = [reference.forward(q, k, v, causal=case.get("causal", False), **options)[0],
            *reference.backward(dout, q, k, v, causal=case.get("causal", False), **options)]
    assert len(ours) == len(theirs) == (5 if case.get("sinks") else 4)
    for label, mine, mlx_value in zip(("out", "dq", "dk", "dv", "dsinks"), ours, theirs):
        scale = max(1.0, float(np.max(np.abs(mine))))
        np.testing.assert_allclose(mine, mlx_value, rtol=0, atol=2e-5 * scale, err_msg=f"{name}: {label}")
