"""Backward's lse: no value is refused, on any path (FlashAttention and PyTorch check none).
NaN and +inf, which forward gives a row with a NaN or +inf score, make that row's gradients NaN;
-inf, forward's lse of a row without visible keys, gives that row zero gradients (also where the
row does see keys: it weighs every key 0). Shape, dtype and overlap checks stay."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_inputs


def _forward_backward(ctx, edit, **options):
    q, k, v, dout = make_inputs(3, 1, 2, 1, 6, 4, 16)
    out, lse = ctx.forward(q, k, v, **options)
    lse = lse.copy()
    edit(lse)
    return ctx.backward(dout, q, k, v, out, lse, **options)


def _set(value, *index):
    return lambda lse: lse.__setitem__(index, value)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_and_plus_infinity_give_nan_gradients_of_that_row(ctx, value):
    dq, dk, dv = _forward_backward(ctx, _set(value, 0, 1, 4))
    assert np.all(np.isnan(dq[0, 1, 4])) and np.all(np.isfinite(np.delete(dq[0], 4, axis=1)[1]))
    assert np.all(np.isfinite(dq[0, 0]))
    assert np.all(np.isnan(dk)) and np.isnan(dv).any()


def test_minus_infinity_gives_zero_gradients_of_that_row(ctx):
    dq, dk, dv = _forward_backward(ctx, _set(-np.inf, 0, 0, 5), causal=True)
    assert np.all(dq[0, 0, 5] == 0)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in (dq, dk, dv))


def test_minus_infinity_on_rows_without_keys_gives_zero_gradient(ctx):
    # 6 queries on 4 keys, causal: queries 0 and 1 see none; forward gives them lse -inf.
    dq, dk, dv = _forward_backward(ctx, lambda lse: np.testing.assert_array_equal(lse[:, :, :2], -np.inf), causal=True)
    assert np.all(dq[:, :, :2] == 0)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in (dq, dk, dv))


def test_with_sinks_nan_lse_reaches_dsinks(ctx):
    sinks = np.array([0.5, -1.0], dtype=np.float32)
    dq, dk, dv, dsinks = _forward_backward(ctx, _set(np.nan, 0, 1, 0), sinks=sinks)
    assert np.isnan(dsinks[1]) and np.isfinite(dsinks[0])
    dq, dk, dv, dsinks = _forward_backward(ctx, _set(-np.inf, 0, 1, 0), sinks=sinks)
    assert np.all(np.isfinite(dsinks)) and np.all(dq[0, 1, 0] == 0)


def test_varlen_accepts_every_lse(ctx):
    q, k, v, dout = (x[0].transpose(1, 0, 2).copy() for x in make_inputs(5, 1, 2, 2, 6, 6, 16))
    cu = np.array([0, 2, 6], dtype=np.int32)
    out, lse = ctx.forward_varlen(q, k, v, cu, cu, 4, 4, causal=True)
    for value, check in ((np.nan, np.isnan), (np.inf, np.isnan), (-np.inf, lambda g: g == 0)):
        edited = lse.copy()
        edited[1, 3] = value
        dq, dk, dv = ctx.backward_varlen(dout, q, k, v, out, edited, cu, cu, 4, 4, causal=True)
        assert np.all(check(dq[3, 1])), value
        assert np.all(np.isfinite(dq[:3])) and np.all(np.isfinite(dq[3, 0]))


def test_shape_and_dtype_are_still_checked(ctx):
    with pytest.raises(ValueError, match="lse shape"):
        ctx.backward(*_shapes_with_lse(np.zeros((1, 2, 5), dtype=np.float32)))
    with pytest.raises(TypeError, match="lse"):
        ctx.backward(*_shapes_with_lse(np.zeros((1, 2, 6), dtype=np.float64)))


def _shapes_with_lse(lse):
    q, k, v, dout = make_inputs(3, 1, 2, 1, 6, 4, 16)
    return dout, q, k, v, np.zeros_like(dout), lse
