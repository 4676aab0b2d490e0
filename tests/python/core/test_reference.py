"""The float64 reference and the float16 baseline, checked without the library."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_attention_metal import accuracy, reference

from conftest import make_inputs
from naive_attention import naive_forward, numeric_gradients


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 9, 8), (1, 3, 1, 9, 4, 5), (1, 2, 2, 1, 6, 3)])
def test_forward_matches_naive_loops(shape, causal):
    q, k, v, _ = make_inputs(1, *shape)
    out, lse = reference.forward(q, k, v, causal=causal, softmax_scale=0.3)
    want_out, want_lse = naive_forward(q, k, v, 0.3, causal=causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_finite_differences(causal):
    q, k, v, dout = make_inputs(2, 1, 4, 2, 5, 7, 3)
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout))
    grads = reference.backward(dout, q, k, v, causal=causal)

    def loss(q_, k_, v_):
        return float(np.sum(dout * reference.forward(q_, k_, v_, causal=causal, softmax_scale=1 / np.sqrt(3))[0]))

    for name, grad, numeric in zip("qkv", grads, numeric_gradients(loss, [q, k, v])):
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=f"d{name}")


def test_causal_is_bottom_right_and_empty_rows_are_zero():
    q, k, v, dout = make_inputs(3, 1, 2, 2, 6, 3, 4)
    out, lse = reference.forward(q, k, v, causal=True)
    # Query i sees key j iff j <= i + 3 - 6: rows 0..2 see nothing, row 3 sees key 0 only.
    assert np.all(out[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    np.testing.assert_allclose(out[:, :, 3], v[:, :, 0].astype(float), rtol=1e-12)
    dq, dk, dv = reference.backward(dout, q, k, v, causal=True)
    assert np.all(dq[:, :, :3] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_keys_propagate_and_only_the_mask_makes_a_row_empty(bad):
    q, k, v, dout = make_inputs(3, 1, 2, 2, 6, 3, 4)
    k[:, :, 2, 1] = bad  # key 2 is seen by query row 5 only (bottom-right causal, Nq 6, Nk 3)
    v[:, :, 2, 0] = bad  # rows that never see key 2 must not read its value either (0 * nan)
    q[:, :, 5, 1] = 1  # so that an infinite key makes the score +inf (exp(inf - inf) is NaN)
    out, lse = reference.forward(q, k, v, causal=True)
    # Rows 0..2 see no key: the mask, not the values, makes them empty.
    assert np.all(out[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    # Rows 3 and 4 do not see key 2: untouched by it.
    assert np.all(np.isfinite(out[:, :, 3:5])) and np.all(np.isfinite(lse[:, :, 3:5]))
    # Row 5 sees it: out NaN, never the empty-row marker; lse NaN for a NaN score, +inf for a +inf
    # one (PyTorch's and MLX's rule, docs/semantics.md).
    assert np.all(np.isnan(out[:, :, 5]))
    assert np.all(np.isnan(lse[:, :, 5])) if np.isnan(bad) else np.all(lse[:, :, 5] == np.inf)
    dq, dk, dv = reference.backward(dout, q, k, v, causal=True)
    assert np.all(dq[:, :, :3] == 0)
    assert np.all(np.isfinite(dq[:, :, 3:5])) and np.all(np.isnan(dq[:, :, 5]))
    assert np.all(np.isnan(dk)) and np.all(np.isnan(dv[:, :, 2]))


def test_decode_causal_equals_non_causal():
    q, k, v, _ = make_inputs(4, 1, 2, 2, 1, 64, 16)
    causal, _ = reference.forward(q, k, v, causal=True)
    full, _ = reference.forward(q, k, v, causal=False)
    np.testing.assert_array_equal(causal, full)


def test_gqa_maps_head_h_to_kv_head_h_div_group():
    q, k, v, _ = make_inputs(5, 1, 8, 2, 4, 4, 8)
    out, _ = reference.forward(q, k, v)
    for h in range(8):
        alone, _ = reference.forward(q[:, h : h + 1], k[:, h // 4 : h // 4 + 1], v[:, h // 4 : h // 4 + 1])
        np.testing.assert_allclose(out[:, h : h + 1], alone, rtol=1e-12)


def test_gqa_gradients_sum_over_the_group():
    q, k, v, dout = make_inputs(6, 1, 4, 2, 5, 5, 8)
    _, dk, dv = reference.backward(dout, q, k, v)
    _, dk_full, dv_full = reference.backward(dout, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1))
    np.testing.assert_allclose(dk, dk_full[:, 0::2] + dk_full[:, 1::2], rtol=1e-12)
    np.testing.assert_allclose(dv, dv_full[:, 0::2] + dv_full[:, 1::2], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_float16_baseline_is_close_to_reference_but_not_exact(causal):
    q, k, v, dout = make_inputs(7, 2, 2, 1, 33, 40, 32)
    base_out, _ = accuracy.base_forward(q, k, v, causal=causal)
    ref_out, _ = reference.forward(q, k, v, causal=causal)
    assert base_out.dtype == np.float16
    error = accuracy.max_abs_error(base_out, ref_out)
    assert 1e-5 < error < 1e-2
    for base, ref in zip(accuracy.base_backward(dout, q, k, v, causal=causal),
                         reference.backward(dout, q, k, v, causal=causal)):
        assert base.dtype == np.float16
        assert 1e-5 < accuracy.max_abs_error(base, ref) < 5e-2


def test_rule_accepts_the_reference_and_rejects_a_perturbed_result():
    q, k, v, dout = make_inputs(8, 1, 2, 2, 16, 16, 16)
    out, lse = reference.forward(q, k, v)
    assert all(m.passed for m in accuracy.evaluate_forward(q, k, v, out.astype(np.float16), lse.astype(np.float32)))
    worse = out + 10 * accuracy.max_abs_error(accuracy.base_forward(q, k, v)[0], out)
    metrics = {m.name: m for m in accuracy.evaluate_forward(q, k, v, worse, lse + 1e-3 * np.maximum(1, abs(lse)))}
    assert not metrics["out"].passed and not metrics["lse"].passed


def test_rule_fails_nan_and_misplaced_infinities():
    q, k, v, dout = make_inputs(9, 1, 1, 1, 4, 2, 8)
    out, lse = reference.forward(q, k, v, causal=True)
    nan_out = out.copy()
    nan_out[0, 0, 3, 0] = np.nan
    assert not accuracy.evaluate_forward(q, k, v, nan_out, lse, causal=True)[0].passed
    finite_lse = np.where(np.isneginf(lse), -1e4, lse)
    assert not accuracy.lse_metric(finite_lse, lse).passed
    grads = [g.copy() for g in reference.backward(dout, q, k, v, causal=True)]
    grads[1][0, 0, 0, 0] = np.inf
    assert not accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True)[1].passed


@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_forward_matches_naive_loops(causal):
    q, k, v, _ = make_inputs(10, 1, 4, 2, 6, 9, 5, head_dim_v=3)
    out, lse = reference.forward(q, k, v, causal=causal)
    assert out.shape == (1, 4, 6, 3)
    want_out, want_lse = naive_forward(q, k, v, 1 / np.sqrt(5), causal=causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


def test_head_dim_v_backward_matches_finite_differences():
    q, k, v, dout = (a.astype(np.float64) for a in make_inputs(11, 1, 2, 1, 4, 5, 3, head_dim_v=2))
    grads = reference.backward(dout, q, k, v, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def loss(q_, k_, v_):
        return float(np.sum(dout * reference.forward(q_, k_, v_, causal=True)[0]))

    for name, grad, numeric in zip("qkv", grads, numeric_gradients(loss, [q, k, v])):
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=f"d{name}")


def test_reference_rejects_dout_without_head_dim_v():
    q, k, v, dout = make_inputs(12, 1, 2, 2, 4, 4, 8, head_dim_v=4)
    with pytest.raises(ValueError, match=r"dout shape \(1, 2, 4, 8\) must be \(B, H, Nq, Dv\)"):
        reference.backward(np.zeros(q.shape), q, k, v)


# (dtype, forward error range, backward error range) of the base on N(0, 1) inputs: each dtype's
# own rounding level (float16 eps 2^-10, bfloat16 2^-7, float32 2^-23).
BASE_LEVELS = [
    (np.float16, (1e-4, 3e-3), (1e-4, 6e-3)),
    (ml_dtypes.bfloat16, (2e-3, 3e-2), (3e-3, 6e-2)),
    (np.float32, (1e-8, 3e-6), (1e-8, 3e-6)),
]


@pytest.mark.parametrize("dtype, forward_range, backward_range", BASE_LEVELS,
                         ids=[np.dtype(d).name for d, _, _ in BASE_LEVELS])
def test_baseline_computes_in_the_inputs_dtype(dtype, forward_range, backward_range):
    q, k, v, dout = make_inputs(7, 2, 2, 1, 33, 40, 32, head_dim_v=24, dtype=dtype)
    base_out, _ = accuracy.base_forward(q, k, v, causal=True)
    ref_out, _ = reference.forward(q, k, v, causal=True)
    assert base_out.dtype == dtype and base_out.shape == ref_out.shape
    assert forward_range[0] < accuracy.max_abs_error(base_out, ref_out) < forward_range[1]
    for base, ref in zip(accuracy.base_backward(dout, q, k, v, causal=True),
                         reference.backward(dout, q, k, v, causal=True)):
        assert base.dtype == dtype and base.shape == ref.shape
        assert backward_range[0] < accuracy.max_abs_error(base, ref) < backward_range[1]


def test_float32_baseline_is_the_plain_float32_computation():
    q, k, v, _ = make_inputs(13, 1, 2, 2, 9, 11, 8, dtype=np.float32)
    scores = (q @ np.swapaxes(k, -1, -2)) * np.float32(1 / np.sqrt(8))
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    base_out, _ = accuracy.base_forward(q, k, v)
    np.testing.assert_allclose(base_out, want, rtol=0, atol=4 * np.finfo(np.float32).eps)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_rule_per_dtype_accepts_the_rounded_reference_and_rejects_a_coarser_result(dtype):
    q, k, v, dout = make_inputs(14, 1, 2, 2, 24, 24, 16, head_dim_v=8, dtype=dtype)
    out, lse = reference.forward(q, k, v)
    assert all(m.passed for m in accuracy.evaluate_forward(q, k, v, out.astype(dtype), lse.astype(np.float32)))
    # A result rounded to a coarser dtype (float32 through float16, 16-bit dtypes through 4
    # significant bits) is what a kernel that rounds P or O once too often gives: it must fail.
    coarse = np.float16 if dtype == np.float32 else None
    worse = out.astype(coarse) if coarse else np.round(out * 16) / 16
    assert not accuracy.evaluate_forward(q, k, v, worse, lse)[0].passed
    grads = reference.backward(dout, q, k, v)
    assert all(m.passed for m in accuracy.evaluate_backward(dout, q, k, v, *(g.astype(dtype) for g in grads)))
