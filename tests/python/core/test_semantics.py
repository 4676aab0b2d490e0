"""The semantics that the seed kernels got wrong (issue 5): GQA head mapping, MQA, every head-dim
bucket, and scores far from zero, each under the accuracy rule."""

from __future__ import annotations

import numpy as np
import pytest

from flash_attention_metal import accuracy, reference

from conftest import assert_within_rule, make_inputs


def _expand_kv(x: np.ndarray, heads: int, head_of) -> np.ndarray:
    """KV heads laid out per query head: head h gets x[:, head_of(h)]."""
    return np.ascontiguousarray(x[:, [head_of(h) for h in range(heads)]])


def test_gqa_query_head_h_reads_kv_head_h_div_group(ctx):
    heads, kv_heads = 8, 2
    q, k, v, dout = make_inputs(21, 2, heads, kv_heads, 19, 27, 32)
    out, lse = ctx.forward(q, k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), "GQA 8/2 forward")

    by_group = [_expand_kv(x, heads, lambda h: h // (heads // kv_heads)) for x in (k, v)]
    ref_out, _ = reference.forward(q, *by_group, causal=True)
    interleaved = [_expand_kv(x, heads, lambda h: h % kv_heads) for x in (k, v)]
    wrong_out, _ = reference.forward(q, *interleaved, causal=True)
    error = np.max(np.abs(out.astype(np.float64) - ref_out))
    assert error < 1e-2, error
    assert np.max(np.abs(out.astype(np.float64) - wrong_out)) > 100 * error

    # The same query heads run as plain multi-head attention on the expanded K/V: identical out.
    mha_out, _ = ctx.forward(q, *by_group, causal=True)
    np.testing.assert_array_equal(out, mha_out)

    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, causal=True)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, dq, dk, dv, causal=True), "GQA 8/2 backward")


def test_gqa_dk_dv_sum_over_the_group(ctx):
    heads, kv_heads = 6, 2
    q, k, v, dout = make_inputs(22, 1, heads, kv_heads, 23, 23, 16)
    out, lse = ctx.forward(q, k, v)
    _, dk, dv = ctx.backward(dout, q, k, v, out, lse)
    group = heads // kv_heads
    expanded = [_expand_kv(x, heads, lambda h: h // group) for x in (k, v)]
    _, ref_dk, ref_dv = reference.backward(dout, q, *expanded)
    for name, ours, per_head in (("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        summed = per_head.reshape(1, kv_heads, group, 23, 16).sum(axis=2)
        assert np.max(np.abs(ours.astype(np.float64) - summed)) < 2e-2, name


@pytest.mark.parametrize("causal", [False, True])
def test_mqa(ctx, causal):
    q, k, v, dout = make_inputs(23, 2, 8, 1, 33, 41, 64)
    out, lse = ctx.forward(q, k, v, causal=causal)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), "MQA forward")
    grads = ctx.backward(dout, q, k, v, out, lse, causal=causal)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=causal), "MQA backward")


@pytest.mark.parametrize("head_dim", [1, 3, 59, 72, 104, 160, 192, 256])
def test_every_head_dim_bucket(ctx, head_dim):
    causal = head_dim % 2 == 0
    q, k, v, dout = make_inputs(head_dim, 1, 2, 1, 21, 37, head_dim)
    out, lse = ctx.forward(q, k, v, causal=causal)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), f"head_dim {head_dim}")
    grads = ctx.backward(dout, q, k, v, out, lse, causal=causal)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=causal), f"head_dim {head_dim}")


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_scores_far_from_zero(ctx, sign):
    # Scores near +-144: exp of them overflows or underflows float32 unless the online softmax
    # subtracts the running maximum from the first key on.
    q, k, v, dout = make_inputs(24, 1, 2, 2, 40, 40, 16)
    q = (q.astype(np.float32) + 6.0).astype(np.float16)
    k = (k.astype(np.float32) + sign * 6.0).astype(np.float16)
    out, lse = ctx.forward(q, k, v, causal=True)
    assert np.all(np.abs(lse) > 50)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), f"scores {sign:+}")
    grads = ctx.backward(dout, q, k, v, out, lse, causal=True)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True), f"scores {sign:+}")


@pytest.mark.parametrize("causal", [False, True])
def test_scores_below_any_finite_stand_in_for_minus_infinity(ctx, causal):
    # Every score is below -1e30: a kernel that masks with a finite "minus infinity" (-1e30) would
    # treat every key as masked (out 0 or NaN, lse -inf). The reference picks the best key.
    rng = np.random.default_rng(25)
    q = np.ones((1, 1, 4, 16), np.float16)
    k = (-(np.abs(rng.standard_normal((1, 1, 8, 16))) + 0.5)).astype(np.float16)
    v = rng.standard_normal((1, 1, 8, 16)).astype(np.float16)
    out, lse = ctx.forward(q, k, v, causal=causal, softmax_scale=1e29)
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal, softmax_scale=1e29)
    assert np.all(ref_lse < -1e30) and np.all(np.isfinite(lse))
    np.testing.assert_array_equal(out, ref_out.astype(np.float16))
    assert_within_rule([accuracy.lse_metric(lse, ref_lse)], "lse at scores below -1e30")
    # Backward: nothing is NaN and dv is finite. dq and dk are softmax_scale (1e29) times
    # dS = P (dP - D), which is exactly 0 in exact arithmetic here (each row puts all its weight on
    # one key) but a rounding difference of ~1e-7 between dP and D in float32; times 1e29 that
    # overflows float16 (the float16 base overflows too). At |lse| ~ 1e30 a float32 lse is also
    # off by ~1e23 from the exact one, so no kernel recomputing P = exp(S - lse) in float32
    # (FlashAttention-2 included) can recover P there.
    dout = rng.standard_normal(out.shape).astype(np.float16)
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=1e29)
    assert not np.any(np.isnan(dq)) and not np.any(np.isnan(dk)) and np.all(np.isfinite(dv))
