"""Backward's lse: NaN and +inf are refused in Python (ValueError, naming the element); -inf is
accepted on rows that see no key and refused by the library, naming the element and a key the
row sees, on rows that see one (causal, window, masks and sinks decide which)."""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam

from conftest import make_inputs


def _forward_backward(ctx, edit, **options):
    q, k, v, dout = make_inputs(3, 1, 2, 1, 6, 4, 16)
    out, lse = ctx.forward(q, k, v, **options)
    lse = lse.copy()
    edit(lse)
    return ctx.backward(dout, q, k, v, out, lse, **options)


@pytest.mark.parametrize("value, text", [(np.nan, "nan"), (np.inf, "inf")])
def test_nan_and_plus_infinity_are_value_errors(ctx, value, text):
    def edit(lse):
        lse[0, 1, 4] = value

    with pytest.raises(ValueError, match=rf"lse\[0, 1, 4\] is {text}: backward needs the lse that forward returned"):
        _forward_backward(ctx, edit)


def test_minus_infinity_on_a_row_that_sees_keys(ctx):
    def edit(lse):
        lse[0, 0, 5] = -np.inf

    with pytest.raises(fam.FlashAttentionError) as caught:
        _forward_backward(ctx, edit, causal=True)
    assert caught.value.status_name == "FA_STATUS_INVALID_ARGUMENT"
    assert caught.value.message.startswith("lse[0][0][5] is -inf, but that query row sees key 0")


def test_minus_infinity_on_rows_without_keys_gives_zero_gradient(ctx):
    # 6 queries on 4 keys, causal: queries 0 and 1 see none; forward gives them lse -inf.
    dq, dk, dv = _forward_backward(ctx, lambda lse: np.testing.assert_array_equal(lse[:, :, :2], -np.inf), causal=True)
    assert np.all(dq[:, :, :2] == 0)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in (dq, dk, dv))


def test_the_mask_decides(ctx):
    mask = np.ones((6, 4), dtype=bool)
    mask[3] = False
    mask[4] = [False, False, False, True]

    def hide(rows):
        def edit(lse):
            lse[:, :, rows] = -np.inf
        return edit

    dq, _, _ = _forward_backward(ctx, hide([3]), attn_mask=mask)
    assert np.all(dq[:, :, 3] == 0)
    with pytest.raises(fam.FlashAttentionError, match=r"lse\[0\]\[0\]\[4\] is -inf, but that query row sees key 3"):
        _forward_backward(ctx, hide([4]), attn_mask=mask)


def test_with_sinks_every_row_sees_its_sink(ctx):
    with pytest.raises(fam.FlashAttentionError, match=r"lse\[0\]\[1\]\[0\] is -inf, but that query row sees its sink"):
        _forward_backward(ctx, lambda lse: lse.__setitem__((0, 1, 0), -np.inf),
                          sinks=np.array([0.5, -1.0], dtype=np.float32))
