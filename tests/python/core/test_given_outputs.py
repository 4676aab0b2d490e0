"""Outputs the caller provides (``out=``, ``lse=``, ``dq=``, ``dk=``, ``dv=``) are written in place
and hold what fresh outputs hold, bit for bit. (Their validation: test_validation.py.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import make_inputs

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_given_outputs_are_written_in_place_and_equal_fresh_ones(ctx, dtype):
    q, k, v, dout = make_inputs(90, 2, 4, 2, 19, 23, 16, head_dim_v=8, dtype=dtype)
    want_out, want_lse = ctx.forward(q, k, v, causal=True)
    want_grads = ctx.backward(dout, q, k, v, want_out, want_lse, causal=True)
    out = np.full_like(want_out, np.nan)
    lse = np.full_like(want_lse, np.nan)
    got = ctx.forward(q, k, v, causal=True, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    np.testing.assert_array_equal(out.view(np.uint8), want_out.view(np.uint8))
    np.testing.assert_array_equal(lse, want_lse)
    grads = [np.full_like(a, np.nan) for a in (q, k, v)]
    got = ctx.backward(dout, q, k, v, out, lse, causal=True, dq=grads[0], dk=grads[1], dv=grads[2])
    for result, given, want in zip(got, grads, want_grads):
        assert result is given
        np.testing.assert_array_equal(given.view(np.uint8), want.view(np.uint8))


def test_given_outputs_may_be_strided_views(ctx):
    # out written straight into a slice of a (B, L, 2, H, D) buffer in FlashAttention's layout.
    q, k, v, dout = make_inputs(91, 1, 3, 3, 12, 12, 16, layout="bshd")
    want_out, _ = ctx.forward(q, k, v, layout="bshd")
    buffer = np.zeros(q.shape[:2] + (2,) + q.shape[2:], q.dtype)
    out = buffer[:, :, 1]
    ctx.forward(q, k, v, layout="bshd", out=out)
    np.testing.assert_array_equal(out, want_out)
    assert not buffer[:, :, 0].any()


def test_only_some_outputs_may_be_given(ctx):
    q, k, v, dout = make_inputs(92, 1, 2, 1, 8, 8, 8)
    out, lse = ctx.forward(q, k, v)
    dk = np.empty_like(k)
    dq, got_dk, dv = ctx.backward(dout, q, k, v, out, lse, dk=dk)
    want = ctx.backward(dout, q, k, v, out, lse)
    assert got_dk is dk
    for result, expected in zip((dq, dk, dv), want):
        np.testing.assert_array_equal(result, expected)
