"""The float64 reference and the baseline with the score options (attn_mask, window_size, softcap,
alibi_slopes, sinks), checked without the library: against loops written from the definitions, by
finite differences (the softcap's tanh, the sinks' dsinks), and the baseline's error level."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_attention_metal import accuracy, reference

from conftest import make_inputs
from naive_attention import naive_forward, numeric_gradients


def _options(rng, batch, heads, seqlen_q, seqlen_k, dtype=np.float16):
    """One of each option, at values that make each of them matter."""
    additive = rng.standard_normal((1, heads, seqlen_q, seqlen_k))
    additive[rng.random(additive.shape) < 0.2] = -np.inf
    return {
        "bool mask": dict(attn_mask=rng.random((batch, 1, seqlen_q, seqlen_k)) < 0.7),
        "additive mask": dict(attn_mask=additive.astype(dtype)),
        "window": dict(window_size=(2, 1)),
        "left window": dict(window_size=(3, -1)),
        "softcap": dict(softcap=0.7),
        "alibi": dict(alibi_slopes=rng.uniform(0.1, 1.0, heads).astype(np.float32)),
        "alibi per batch": dict(alibi_slopes=rng.uniform(0.1, 1.0, (batch, heads)).astype(np.float32)),
        "sinks": dict(sinks=rng.standard_normal(heads).astype(np.float32)),
        "all": dict(attn_mask=additive[:, :, :1].astype(np.float32), window_size=(4, 2), softcap=1.5, causal=True,
                    alibi_slopes=rng.uniform(0.1, 1.0, heads).astype(np.float32),
                    sinks=rng.standard_normal(heads).astype(np.float32)),
    }


OPTION_NAMES = list(_options(np.random.default_rng(0), 1, 1, 1, 1))


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 6, 9, 5), (1, 2, 1, 9, 4, 3)])
def test_forward_matches_naive_loops(shape, name):
    q, k, v, _ = make_inputs(21, *shape)
    options = _options(np.random.default_rng(22), shape[0], shape[1], shape[3], shape[4])[name]
    out, lse = reference.forward(q, k, v, softmax_scale=0.6, **options)
    want_out, want_lse = naive_forward(q, k, v, 0.6, **options)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


@pytest.mark.parametrize("name", ["softcap", "alibi per batch", "additive mask", "all"])
def test_backward_matches_finite_differences(name):
    q, k, v, dout = (a.astype(np.float64) for a in make_inputs(23, 1, 2, 1, 4, 5, 3))
    options = _options(np.random.default_rng(24), 1, 2, 4, 5, np.float64)[name]
    grads = reference.backward(dout, q, k, v, **options)
    tensors = [q, k, v] + ([options["sinks"].astype(np.float64)] if "sinks" in options else [])
    assert len(grads) == len(tensors)

    def loss(q_, k_, v_, sinks_=None):
        changed = dict(options, sinks=sinks_) if sinks_ is not None else options
        return float(np.sum(dout * reference.forward(q_, k_, v_, **changed)[0]))

    for name_, grad, numeric in zip(("dq", "dk", "dv", "dsinks"), grads, numeric_gradients(loss, tensors)):
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=name_)


def test_window_is_bottom_right_and_causal_is_right_zero():
    visible = reference.visible_keys(3, 6, False, (1, 0))
    # s = 3: query i sees keys i + 3 - 1 ... i + 3.
    np.testing.assert_array_equal(visible, [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(reference.visible_keys(5, 4, True), reference.visible_keys(5, 4, False, (-1, 0)))
    np.testing.assert_array_equal(reference.visible_keys(5, 4, True, (2, 3)), reference.visible_keys(5, 4, False, (2, 0)))


def _row_one_empty(kind: str):
    """(seqlen_q, seqlen_k, options) whose query row 1 sees no key, by ``kind``."""
    if kind == "all -inf additive":
        mask = np.zeros((4, 6), np.float32)
        mask[1] = -np.inf
        return 4, 6, dict(attn_mask=mask)
    if kind == "all-false bool":
        mask = np.ones((1, 1, 4, 6), bool)
        mask[..., 1, :] = False
        return 4, 6, dict(attn_mask=mask)
    # seqlen_q 6 > seqlen_k 4: query i sees keys i - 3 ... i - 2, so rows 0 and 1 see none.
    return 6, 4, dict(window_size=(1, 0))


EMPTY_ROW_KINDS = ["all -inf additive", "all-false bool", "window"]


@pytest.mark.parametrize("kind", EMPTY_ROW_KINDS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_without_keys_follow_the_empty_row_rule(kind, with_sinks):
    seqlen_q, seqlen_k, options = _row_one_empty(kind)
    q, k, v, dout = make_inputs(25, 1, 2, 2, seqlen_q, seqlen_k, 8)
    if with_sinks:
        options["sinks"] = np.array([0.5, -2.0], np.float32)
    out, lse = reference.forward(q, k, v, **options)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isfinite(out))
    want = np.array([0.5, -2.0]) if with_sinks else np.full(2, -np.inf)
    np.testing.assert_array_equal(lse[0, :, 1], want)
    grads = reference.backward(dout, q, k, v, **options)
    assert np.all(grads[0][:, :, 1] == 0) and all(np.all(np.isfinite(g)) for g in grads)


def test_sinks_add_their_weight_to_the_denominator():
    q, k, v, _ = make_inputs(26, 1, 2, 2, 5, 7, 8)
    sinks = np.array([1.0, -1.0], np.float32)
    out, lse = reference.forward(q, k, v)
    sunk_out, sunk_lse = reference.forward(q, k, v, sinks=sinks)
    np.testing.assert_allclose(sunk_lse, np.logaddexp(lse, sinks[None, :, None]), rtol=1e-12)
    np.testing.assert_allclose(sunk_out, out * np.exp(lse - sunk_lse)[..., None], rtol=1e-12, atol=1e-15)


# (dtype, forward error range, backward error range) of the base with every option at once, on
# N(0, 1) inputs: each dtype's own rounding level, as test_reference.BASE_LEVELS without options.
BASE_LEVELS = [
    (np.float16, (1e-4, 5e-3), (1e-4, 1e-2)),
    (ml_dtypes.bfloat16, (1e-3, 5e-2), (1e-3, 1e-1)),
    (np.float32, (1e-8, 5e-6), (1e-8, 5e-6)),
]


@pytest.mark.parametrize("dtype, forward_range, backward_range", BASE_LEVELS,
                         ids=[np.dtype(d).name for d, _, _ in BASE_LEVELS])
def test_baseline_with_every_option_computes_in_the_inputs_dtype(dtype, forward_range, backward_range):
    q, k, v, dout = make_inputs(27, 2, 4, 2, 33, 40, 32, dtype=dtype)
    options = _options(np.random.default_rng(28), 2, 4, 33, 40, dtype)["all"]
    base_out, base_lse = accuracy.base_forward(q, k, v, **options)
    ref_out, ref_lse = reference.forward(q, k, v, **options)
    assert base_out.dtype == dtype and base_lse.dtype == np.float32
    assert forward_range[0] < accuracy.max_abs_error(base_out, ref_out) < forward_range[1]
    bases = accuracy.base_backward(dout, q, k, v, **options)
    refs = reference.backward(dout, q, k, v, **options)
    assert len(bases) == 4 and bases[3].dtype == np.float32 and bases[3].shape == (4,)
    for base, ref in zip(bases[:3], refs[:3]):
        assert base.dtype == dtype
        assert backward_range[0] < accuracy.max_abs_error(base, ref) < backward_range[1]


def test_dsinks_rule_accepts_the_rounded_reference_and_rejects_a_perturbed_result():
    q, k, v, dout = make_inputs(29, 2, 2, 2, 24, 30, 16)
    options = dict(sinks=np.array([0.3, -0.4], np.float32), window_size=(8, 8))
    out, lse = reference.forward(q, k, v, **options)
    *grads, dsinks = reference.backward(dout, q, k, v, **options)
    metrics = accuracy.evaluate_backward(dout, q, k, v, *(g.astype(np.float16) for g in grads),
                                         dsinks.astype(np.float32), **options)
    assert [m.name for m in metrics] == ["dq", "dk", "dv", "dsinks"] and all(m.passed for m in metrics)
    # dsinks from the lse without its sink, or off by a few percent, must fail.
    wrong = -reference.sink_terms(dout.astype(np.float64), out, reference.forward(q, k, v, window_size=(8, 8))[1],
                                  options["sinks"]).sum(axis=(0, 2))
    for bad in (wrong, dsinks * 1.03):
        metric = accuracy.evaluate_backward(dout, q, k, v, *grads, bad, **options)[3]
        assert not metric.passed, accuracy.describe([metric])
    with pytest.raises(ValueError, match="dsinks must be given"):
        accuracy.evaluate_backward(dout, q, k, v, *grads, **options)


def test_dsinks_rule_rejects_a_3_percent_error_in_bfloat16_over_256_rows():
    # The bound grows with the square root of the rows, as the error of a sum of independent row
    # errors does; the former one (the row errors summed in absolute value) grew with the rows and
    # let this 3 % error through (bound 1.7e-1 against an error of 3.6e-2).
    q, k, v, dout = make_inputs(5, 2, 4, 2, 256, 128, 64, dtype=ml_dtypes.bfloat16)
    options = dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32))
    *grads, dsinks = reference.backward(dout, q, k, v, **options)
    exact = accuracy.evaluate_backward(dout, q, k, v, *grads, dsinks, **options)[3]
    assert exact.passed, accuracy.describe([exact])
    metric = accuracy.evaluate_backward(dout, q, k, v, *grads, dsinks * 1.03, **options)[3]
    assert not metric.passed, accuracy.describe([metric])
