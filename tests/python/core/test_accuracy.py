"""The library's forward and backward against the float64 reference under the accuracy rule."""

from __future__ import annotations

import numpy as np
import pytest

from flash_attention_metal import accuracy

from conftest import assert_within_rule, make_inputs

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal): every required seqlen
# (1, 7, 31, 32, 33, 64, 100, 257) and head_dim (8, 16, 32, 40, 64, 80, 96, 128), causal on and off,
# batch and heads above 1, GQA and MQA, cross-attention with Nq < Nk and Nq > Nk; not the full product.
GRID = [
    (2, 3, 3, 1, 1, 8, False),
    (1, 2, 2, 1, 64, 64, True),
    (2, 3, 3, 7, 7, 8, True),
    (2, 2, 1, 31, 31, 16, True),
    (1, 4, 2, 32, 32, 32, False),
    (2, 2, 2, 33, 33, 40, True),
    (1, 3, 3, 64, 64, 80, False),
    (2, 2, 2, 100, 100, 96, True),
    (1, 2, 2, 257, 257, 128, False),
    (1, 2, 1, 257, 257, 64, True),
    (2, 2, 2, 16, 80, 64, False),
    (2, 2, 2, 80, 16, 64, False),
    (1, 2, 2, 100, 33, 32, True),
    (1, 4, 2, 33, 100, 128, True),
    (1, 2, 2, 7, 257, 40, False),
    (1, 2, 1, 70, 75, 256, True),  # 32-row forward blocks at 256 (K and V share one buffer)
]


def _label(case):
    b, h, hk, nq, nk, d, causal = case
    return f"B{b}-H{h}-Hkv{hk}-Nq{nq}-Nk{nk}-D{d}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", GRID, ids=_label)
def test_forward_and_backward_within_rule(ctx, case):
    *shape, causal = case
    q, k, v, dout = make_inputs(sum(shape), *shape)
    out, lse = ctx.forward(q, k, v, causal=causal)
    assert out.dtype == np.float16 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:3]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), f"forward {_label(case)}")
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, causal=causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == np.float16
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, dq, dk, dv, causal=causal),
                       f"backward {_label(case)}")


@pytest.mark.parametrize("scale", [0.05, 1.0, -0.7])
def test_explicit_softmax_scale(ctx, scale):
    q, k, v, dout = make_inputs(11, 1, 2, 2, 20, 24, 16)
    out, lse = ctx.forward(q, k, v, softmax_scale=scale)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, softmax_scale=scale), f"scale {scale}")
    grads = ctx.backward(dout, q, k, v, out, lse, softmax_scale=scale)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, softmax_scale=scale), f"scale {scale}")


def test_rows_without_keys_give_zero_out_minus_inf_lse_and_zero_grads(ctx):
    q, k, v, dout = make_inputs(12, 1, 2, 2, 64, 32, 32)
    out, lse = ctx.forward(q, k, v, causal=True)
    assert np.all(out[:, :, :32] == 0)
    assert np.all(np.isneginf(lse[:, :, :32])) and np.all(np.isfinite(lse[:, :, 32:]))
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, causal=True)
    assert np.all(dq[:, :, :32] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_decode_causal_equals_non_causal(ctx):
    q, k, v, _ = make_inputs(13, 1, 4, 4, 1, 64, 64)
    np.testing.assert_array_equal(ctx.attention(q, k, v, causal=True), ctx.attention(q, k, v, causal=False))


def test_results_are_bit_identical_across_runs(ctx):
    q, k, v, dout = make_inputs(14, 2, 4, 2, 45, 70, 40)
    first = ctx.forward(q, k, v, causal=True)
    second = ctx.forward(q, k, v, causal=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    grads_1 = ctx.backward(dout, q, k, v, *first, causal=True)
    grads_2 = ctx.backward(dout, q, k, v, *first, causal=True)
    for a, b in zip(grads_1, grads_2):
        np.testing.assert_array_equal(a, b)


def test_attention_returns_forward_out(ctx):
    q, k, v, _ = make_inputs(15, 1, 2, 1, 9, 9, 16)
    np.testing.assert_array_equal(ctx.attention(q, k, v), ctx.forward(q, k, v)[0])
