"""One test per validation rule of the score options (attn_mask, window_size, softcap, alibi_slopes,
sinks); each runs before any native call (``guarded`` fails the test if one happens)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from conftest import both_raise, make_inputs

# batch 2, num_heads 4, num_kv_heads 2, seqlen_q 5, seqlen_k 6, head_dim 8.
SHAPE = (2, 4, 2, 5, 6, 8)


def re_shape(shape) -> str:
    return str(shape).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("window_size", [(-2, 0), (0, -5), (2**31, 0), (5, 2**40)])
def test_window_sides_are_minus_one_or_a_key_count(guarded, inputs, window_size):
    rule = r"window_size must be a \(left, right\) pair, each -1 \(unbounded\) or a number of keys from 0 to 2147483647"
    both_raise(guarded, inputs, ValueError, rule + rf", got \({window_size[0]}, {window_size[1]}\)", window_size=window_size)


@pytest.mark.parametrize("window_size", [3, (1, 2, 3), (1,), "-1,-1", None, (1.0, 2), (True, 0), (np.float32(1), 1)])
def test_window_is_a_pair_of_ints(guarded, inputs, window_size):
    both_raise(guarded, inputs, TypeError, r"window_size must be a \(left, right\) pair", window_size=window_size)


def test_window_accepts_lists_and_numpy_ints(ctx):
    q, k, v, _ = make_inputs(1, 1, 2, 2, 7, 7, 8)
    want = ctx.forward(q, k, v, window_size=(2, 1))[0]
    for window_size in ([2, 1], (np.int64(2), np.int32(1))):
        np.testing.assert_array_equal(ctx.forward(q, k, v, window_size=window_size)[0], want)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), 1e39, 10**400])
def test_softcap_is_finite_and_not_negative(guarded, inputs, softcap):
    both_raise(guarded, inputs, ValueError, r"softcap must be finite and >= 0 \(0 is off", softcap=softcap)


@pytest.mark.parametrize("softcap", [None, "50", True, 1j, np.array([1.0])])
def test_softcap_is_a_real_number(guarded, inputs, softcap):
    both_raise(guarded, inputs, TypeError, r"softcap must be a real number \(0.0 is off\)", softcap=softcap)


def test_softcap_that_rounds_to_zero_in_float32_is_rejected(guarded, inputs):
    both_raise(guarded, inputs, ValueError, r"softcap 1e-50 rounds to 0 in float32, which turns it off", softcap=1e-50)


@pytest.mark.parametrize("name, shapes", [
    ("alibi_slopes", r"\(num_heads,\) = \(4,\) or \(batch, num_heads\) = \(2, 4\)"),
    ("sinks", r"\(num_heads,\) = \(4,\)"),
])
@pytest.mark.parametrize("shape", [(2,), (4, 2), (1, 4), (2, 4, 1), ()])
def test_slopes_and_sinks_have_their_shapes(guarded, inputs, name, shapes, shape):
    array = np.zeros(shape, np.float32)
    both_raise(guarded, inputs, ValueError, rf"{name} shape {re_shape(shape)} must be {shapes}", **{name: array})


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("dtype", [np.float16, np.float64, ml_dtypes.bfloat16, np.int32, ">f4"])
def test_slopes_and_sinks_are_float32(guarded, inputs, name, dtype):
    array = np.zeros(4, dtype)
    rule = rf"{name} must have dtype float32 \(native byte order\), got {np.dtype(dtype).name}"
    both_raise(guarded, inputs, TypeError, rule, **{name: array})


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("value", [[0.5, 1.0], (0.5,) * 4, 1.0])
def test_slopes_and_sinks_are_arrays(guarded, inputs, name, value):
    both_raise(guarded, inputs, TypeError, rf"{name} must be a numpy.ndarray of float32", **{name: value})


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_slopes_and_sinks_are_finite(guarded, inputs, name, bad):
    array = np.zeros(4, np.float32)
    array[2] = bad
    both_raise(guarded, inputs, ValueError, rf"{name} must be finite, got {bad} at index \(2,\)", **{name: array})


def test_per_batch_slopes_must_be_finite_too(guarded, inputs):
    slopes = np.zeros((2, 4), np.float32)
    slopes[1, 3] = np.nan
    both_raise(guarded, inputs, ValueError, r"alibi_slopes must be finite, got nan at index \(1, 3\)", alibi_slopes=slopes)


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (3, 1, 1, 6), (1, 4, 4, 6), (6, 5), (7,), (1, 2, 1, 1)])
def test_mask_must_broadcast_to_batch_heads_queries_keys(guarded, inputs, shape):
    rule = (rf"attn_mask shape {re_shape(shape)} is not broadcastable to \(batch, num_heads, seqlen_q, seqlen_k\) = "
            r"\(2, 4, 5, 6\)")
    both_raise(guarded, inputs, ValueError, rule, attn_mask=np.ones(shape, bool))


def test_mask_is_indexed_batch_heads_queries_keys_in_the_bshd_layout(guarded):
    q, k, v, _ = make_inputs(2, *SHAPE, layout="bshd")
    with pytest.raises(ValueError, match=r"attn_mask shape \(2, 5, 4, 6\) is not broadcastable"):
        guarded.forward(q, k, v, layout="bshd", attn_mask=np.ones((2, 5, 4, 6), bool))


@pytest.mark.parametrize("shape", [(), (1, 1, 1, 1, 6)])
def test_mask_is_one_to_four_d(guarded, inputs, shape):
    both_raise(guarded, inputs, ValueError, rf"attn_mask must be 1-D to 4-D, .* got {len(shape)}-D",
          attn_mask=np.ones(shape, bool))


def test_mask_has_no_empty_axis(guarded, inputs):
    both_raise(guarded, inputs, ValueError, r"attn_mask has a zero-sized dimension", attn_mask=np.ones((2, 1, 0, 6), bool))


@pytest.mark.parametrize("q_dtype, mask_dtype, allowed", [
    (np.float16, np.float64, "bool, float16 or float32"),
    (np.float16, ml_dtypes.bfloat16, "bool, float16 or float32"),
    (ml_dtypes.bfloat16, np.float16, "bool, bfloat16 or float32"),
    (np.float32, np.float16, "bool or float32"),
    (np.float16, np.int8, "bool, float16 or float32"),
    (np.float16, np.uint8, "bool, float16 or float32"),
])
def test_mask_is_bool_or_additive_in_the_dtype_or_float32(guarded, q_dtype, mask_dtype, allowed):
    q, k, v, dout = make_inputs(3, *SHAPE, dtype=q_dtype)
    args = dict(q=q, k=k, v=v, dout=dout, out=np.zeros_like(q), lse=np.zeros(q.shape[:3], np.float32))
    rule = rf"attn_mask must have dtype {allowed}, got {np.dtype(mask_dtype).name}"
    both_raise(guarded, args, TypeError, rule, attn_mask=np.zeros((5, 6), mask_dtype))


@pytest.mark.parametrize("value", [[[True] * 6] * 5, np.ma.masked_array(np.ones((5, 6), bool))])
def test_mask_is_a_plain_array(guarded, inputs, value):
    both_raise(guarded, inputs, TypeError, r"attn_mask (must be a numpy.ndarray, got list|is a numpy masked array)",
          attn_mask=value)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bad, name", [(np.nan, "NaN"), (np.inf, r"\+inf")])
def test_additive_mask_has_no_nan_or_plus_inf(guarded, inputs, dtype, bad, name):
    mask = np.zeros((1, 4, 5, 6), dtype)
    mask[0, 2, 3, 1] = bad
    rule = rf"attn_mask holds {name} \(first at index \(0, 2, 3, 1\) of its 4-D form\): an additive mask must not"
    both_raise(guarded, inputs, ValueError, rule, attn_mask=mask)


def test_nan_is_found_in_a_broadcast_bfloat16_mask(guarded):
    q, k, v, dout = make_inputs(4, *SHAPE, dtype=ml_dtypes.bfloat16)
    mask = np.zeros(6, ml_dtypes.bfloat16)
    mask[4] = np.nan
    with pytest.raises(ValueError, match=r"attn_mask holds NaN \(first at index \(0, 0, 0, 4\)"):
        guarded.forward(q, k, v, attn_mask=np.broadcast_to(mask, (2, 4, 5, 6)))


def test_minus_inf_in_an_additive_mask_is_allowed(ctx):
    q, k, v, _ = make_inputs(5, *SHAPE)
    mask = np.zeros((5, 6), np.float16)
    mask[:, 0] = -np.inf
    out, lse = ctx.forward(q, k, v, attn_mask=mask)
    want_out, want_lse = ctx.forward(q, k, v, attn_mask=mask != -np.inf)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)


def test_module_functions_check_the_options_before_loading_the_library(library_missing, inputs):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with pytest.raises(ValueError, match="window_size must be"):
        fam.forward(q, k, v, window_size=(-3, 0))
    with pytest.raises(ValueError, match="softcap must be finite"):
        fam.attention(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="sinks must have dtype float32"):
        fam.backward(inputs["dout"], q, k, v, inputs["out"], inputs["lse"], sinks=np.zeros(4))
    with pytest.raises(fam.FlashAttentionError) as caught:
        fam.forward(q, k, v, window_size=(3, 0), attn_mask=np.ones(6, bool))
    assert caught.value.status_name == "LIBRARY_NOT_FOUND"
