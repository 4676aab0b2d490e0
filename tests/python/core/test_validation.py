"""One test per validation rule; each runs before any native call."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from conftest import both_raise, make_inputs, run_backward, run_forward


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.float64, np.int16, ml_dtypes.float8_e4m3fn])
def test_qkv_must_be_float16_bfloat16_or_float32(guarded, inputs, name, dtype):
    inputs[name] = inputs[name].astype(dtype)
    rule = rf"{name} must have dtype float16, bfloat16 or float32, got {np.dtype(dtype).name}"
    both_raise(guarded, inputs, TypeError, rule)


@pytest.mark.parametrize("name", ["k", "v", "dout", "out"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_every_tensor_must_have_q_dtype(guarded, inputs, name, dtype):
    inputs[name] = inputs[name].astype(dtype)
    rule = rf"{name} must have q's dtype float16, got {np.dtype(dtype).name} \(q, k, v, dout and out share one dtype"
    with pytest.raises(TypeError, match=rule):
        run_backward(guarded, inputs)
    if name in ("k", "v"):
        with pytest.raises(TypeError, match=rule):
            run_forward(guarded, inputs)


@pytest.mark.parametrize("layout", ["BSHD", "bsdh", "", "sbhd"])
def test_layout_must_be_bhsd_or_bshd(guarded, inputs, layout):
    rule = rf"layout must be 'bhsd' \(batch, num_heads, seqlen, head_dim\) or 'bshd' .*got {layout!r}"
    both_raise(guarded, inputs, ValueError, rule, layout=layout)


@pytest.mark.parametrize("layout", [None, 1, b"bshd"])
def test_layout_must_be_a_str(guarded, inputs, layout):
    with pytest.raises(TypeError, match=rf"layout must be a str \('bhsd' or 'bshd'\), got {type(layout).__name__}"):
        run_forward(guarded, inputs, layout=layout)


def test_bshd_shapes_are_read_in_bshd_order(guarded):
    # (B, L, H, D): seqlen_q 5, heads 4; k seqlen_k 6, kv heads 2.
    # (How the heads are read: core/test_library_rules.py, the library's rule.)
    q, k, v, dout = make_inputs(0, 2, 4, 2, 5, 6, 8, head_dim_v=3, layout="bshd")
    with pytest.raises(ValueError, match=r"v shape \(2, 5, 2, 3\) must equal k shape \(2, 6, 2, 8\) but for the "
                                         r"last axis \(head_dim_v\): \(batch, seqlen, num_heads\) in layout 'bshd'"):
        guarded.forward(q, k, v[:, :5], layout="bshd")
    with pytest.raises(ValueError, match="k batch size 1 must equal q batch size 2"):
        guarded.forward(q, k[:1], v[:1], layout="bshd")


def test_dout_and_out_need_head_dim_v(guarded):
    q, k, v, dout = make_inputs(0, 1, 2, 2, 5, 6, 8, head_dim_v=4)
    out = np.zeros(dout.shape, dtype=np.float16)
    lse = np.zeros(q.shape[:3], dtype=np.float32)
    rule = r"dout shape \(1, 2, 5, 8\) must equal q shape \(1, 2, 5, 8\) with head_dim_v 4 as the last axis"
    with pytest.raises(ValueError, match=rule):
        guarded.backward(np.zeros(q.shape, np.float16), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"out shape \(1, 2, 5, 8\) must equal q shape"):
        guarded.backward(dout, q, k, v, np.zeros(q.shape, np.float16), lse)


def test_inputs_must_be_arrays(guarded, inputs):
    inputs["q"] = inputs["q"].tolist()
    with pytest.raises(TypeError, match="q must be a numpy.ndarray, got list"):
        run_forward(guarded, inputs)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_inputs_must_be_4d(guarded, inputs, name):
    inputs[name] = inputs[name][0]
    with pytest.raises(ValueError, match=rf"{name} must be 4-D, got 3-D"):
        run_forward(guarded, inputs)


def test_zero_sized_dimensions_are_rejected(guarded, inputs):
    inputs["q"] = inputs["q"][:, :, :0]
    with pytest.raises(ValueError, match="q has a zero-sized dimension"):
        run_forward(guarded, inputs)


def test_batch_must_match(guarded, inputs):
    inputs["k"] = inputs["k"][:1]
    with pytest.raises(ValueError, match="k batch size 1 must equal q batch size 2"):
        run_forward(guarded, inputs)


def test_head_dim_must_match(guarded, inputs):
    inputs["k"] = inputs["k"][..., :4]
    with pytest.raises(ValueError, match="k head_dim 4 must equal q head_dim 8"):
        run_forward(guarded, inputs)


def test_v_must_match_k_seqlen(guarded, inputs):
    inputs["v"] = inputs["v"][:, :, :3]
    with pytest.raises(ValueError, match=r"v shape .* must equal k shape"):
        run_forward(guarded, inputs)


def test_lse_must_be_float32(guarded, inputs):
    inputs["lse"] = inputs["lse"].astype(np.float64)
    with pytest.raises(TypeError, match="lse must have dtype float32, got float64"):
        run_backward(guarded, inputs)


def test_lse_shape_must_be_batch_heads_seqlen_q(guarded, inputs):
    inputs["lse"] = inputs["lse"][:, :2]
    with pytest.raises(ValueError, match=r"lse shape \(2, 2, 5\) must be \(batch, num_heads, seqlen_q\)"):
        run_backward(guarded, inputs)


@pytest.mark.parametrize("name", ["dout", "out"])
def test_dout_and_out_must_have_q_shape(guarded, inputs, name):
    inputs[name] = inputs[name][:, :, :4]
    with pytest.raises(ValueError, match=rf"{name} shape .* must equal q shape"):
        run_backward(guarded, inputs)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e39, -1e39,
                                   pytest.param(10**400, id="10**400"),
                                   pytest.param(Fraction(-(10**400), 3), id="-10**400/3")])
def test_softmax_scale_must_be_finite(guarded, inputs, scale):
    rule = r"softmax_scale must be finite and representable as float32 \(\|softmax_scale\| <= 3.402823e\+38\)"
    both_raise(guarded, inputs, ValueError, rule, softmax_scale=scale)


@pytest.mark.parametrize("name", ["q", "k", "v", "dout", "out", "lse"])
def test_non_native_byte_order_is_rejected_and_named(guarded, inputs, name):
    inputs[name] = inputs[name].astype(inputs[name].dtype.newbyteorder(">"))
    expected = "float32" if name == "lse" else "float16"
    rule = f"{name} must be native-byte-order {expected}, got big-endian {expected}"
    with pytest.raises(TypeError, match=rule):
        run_backward(guarded, inputs)
    if name in ("q", "k", "v"):
        with pytest.raises(TypeError, match=rule):
            run_forward(guarded, inputs)


@pytest.mark.parametrize("name", ["q", "k", "v", "dout", "out", "lse"])
def test_masked_arrays_are_rejected(guarded, inputs, name):
    inputs[name] = np.ma.masked_array(inputs[name], mask=np.zeros(inputs[name].shape, dtype=bool))
    rule = rf"{name} is a numpy masked array; masked arrays are not supported .*{name}\.filled\(value\) or {name}\.data"
    with pytest.raises(TypeError, match=rule):
        run_backward(guarded, inputs)
    if name in ("q", "k", "v"):
        with pytest.raises(TypeError, match=rule):
            run_forward(guarded, inputs)


def test_arguments_are_checked_before_the_library_is_loaded(library_missing, inputs):
    wrong = {name: array.astype(np.float64) for name, array in inputs.items()}
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16 or float32, got float64"):
        fam.forward(wrong["q"], wrong["k"], wrong["v"])
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16 or float32, got float64"):
        fam.attention(wrong["q"], wrong["k"], wrong["v"])
    with pytest.raises(TypeError, match="dout must have dtype float16, bfloat16 or float32, got float64"):
        fam.backward(wrong["dout"], inputs["q"], inputs["k"], inputs["v"], inputs["out"], inputs["lse"])
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        fam.forward(inputs["q"], inputs["k"], inputs["v"], softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="layout must be 'bhsd'"):
        fam.forward(inputs["q"], inputs["k"], inputs["v"], layout="BHSD")
    # Valid arguments then need the library, which is missing.
    with pytest.raises(fam.FlashAttentionError) as caught:
        fam.forward(inputs["q"], inputs["k"], inputs["v"])
    assert caught.value.status_name == "LIBRARY_NOT_FOUND"


@pytest.mark.parametrize("scale", ["0.5", True, np.bool_(False), [0.5], 1j])
def test_softmax_scale_must_be_a_real_number(guarded, inputs, scale):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None"):
        run_forward(guarded, inputs, softmax_scale=scale)


@pytest.mark.parametrize("causal", [1, 0, "yes", None, 1.0])
def test_causal_must_be_a_bool(guarded, inputs, causal):
    both_raise(guarded, inputs, TypeError, "causal must be a bool", causal=causal)


def test_numpy_scalars_are_accepted(ctx, inputs):
    out, _ = ctx.forward(inputs["q"], inputs["k"], inputs["v"], causal=np.bool_(True), softmax_scale=np.float32(0.25))
    want, _ = ctx.forward(inputs["q"], inputs["k"], inputs["v"], causal=True, softmax_scale=0.25)
    np.testing.assert_array_equal(out, want)


def test_non_contiguous_inputs_give_the_contiguous_result(ctx):
    q, k, v, dout = make_inputs(1, 2, 2, 2, 12, 10, 16)
    # Transposed storage (B, N, H, D) viewed as (B, H, N, D), and a strided slice.
    q_t = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    k_wide = np.zeros(k.shape[:3] + (32,), dtype=np.float16)
    k_wide[..., ::2] = k
    k_s = k_wide[..., ::2]
    assert not q_t.flags.c_contiguous and not k_s.flags.c_contiguous
    out, lse = ctx.forward(q_t, k_s, v, causal=True)
    want_out, want_lse = ctx.forward(q, k, v, causal=True)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    dout_reversed = dout[:, :, ::-1].copy()[:, :, ::-1]
    assert not dout_reversed.flags.c_contiguous
    grads = ctx.backward(dout_reversed, q_t, k_s, v, out, lse, causal=True)
    for got, want in zip(grads, ctx.backward(dout, q, k, v, want_out, want_lse, causal=True)):
        np.testing.assert_array_equal(got, want)


def test_read_only_inputs_work_and_outputs_are_fresh(ctx):
    q, k, v, dout = make_inputs(2, 1, 2, 2, 8, 8, 8)
    for a in (q, k, v, dout):
        a.flags.writeable = False
    out, lse = ctx.forward(q, k, v)
    grads = ctx.backward(dout, q, k, v, out, lse)
    for result in (out, lse, *grads):
        assert result.flags.owndata and result.flags.writeable and result.flags.c_contiguous
        assert not any(np.shares_memory(result, a) for a in (q, k, v, dout))


# Outputs the caller provides (out=, lse=, dq=, dk=, dv=): checked like inputs, before any call.

def _given(inputs):
    return dict(out=np.empty_like(inputs["q"]), lse=np.empty(inputs["q"].shape[:3], np.float32),
                dq=np.empty_like(inputs["q"]), dk=np.empty_like(inputs["k"]), dv=np.empty_like(inputs["v"]))


def _call_with(context, args, name, array):
    if name in ("out", "lse"):
        run_forward(context, args, **{name: array})
    else:
        run_backward(context, args, **{name: array})


@pytest.mark.parametrize("name", ["out", "lse", "dq", "dk", "dv"])
def test_given_outputs_must_have_the_result_dtype(guarded, inputs, name):
    wrong = _given(inputs)[name].astype(np.float64)
    with pytest.raises(TypeError, match=rf"^{name} must have dtype"):
        _call_with(guarded, inputs, name, wrong)


@pytest.mark.parametrize("name", ["out", "lse", "dq", "dk", "dv"])
def test_given_outputs_must_have_the_result_shape(guarded, inputs, name):
    given = _given(inputs)[name]
    wrong = np.empty(given.shape[:-1] + (given.shape[-1] + 1,), given.dtype)
    with pytest.raises(ValueError, match=rf"^{name} shape .* must be"):
        _call_with(guarded, inputs, name, wrong)


@pytest.mark.parametrize("name", ["out", "lse", "dq"])
def test_given_outputs_must_be_writable(guarded, inputs, name):
    given = _given(inputs)[name]
    given.flags.writeable = False
    with pytest.raises(ValueError, match=rf"^{name} is read-only"):
        _call_with(guarded, inputs, name, given)


def test_given_outputs_must_be_addressable_in_place(guarded, inputs):
    # An output is written in place, never copied back: a strided last axis, a zero stride or a
    # non-contiguous lse is refused rather than silently left unwritten.
    q = inputs["q"]
    wide = np.empty(q.shape[:3] + (2 * q.shape[3],), q.dtype)
    with pytest.raises(ValueError, match=r"^out must be writable in place"):
        run_forward(guarded, inputs, out=wide[..., ::2])
    with pytest.raises(ValueError, match=r"^dk must be writable in place"):
        one = np.empty(inputs["k"].shape[1:], q.dtype)
        run_backward(guarded, inputs, dk=np.lib.stride_tricks.as_strided(one, inputs["k"].shape, (0,) + one.strides))
    lse_t = np.empty(q.shape[:3][::-1], np.float32).T
    with pytest.raises(ValueError, match=r"^lse must be writable in place \(C-contiguous"):
        run_forward(guarded, inputs, lse=lse_t)


@pytest.mark.parametrize("name, other", [("out", "q"), ("dq", "dout"), ("dk", "k"), ("dv", "out")])
def test_given_outputs_must_not_overlap_inputs(guarded, inputs, name, other):
    shape = _given(inputs)[name].shape
    with pytest.raises(ValueError, match=rf"^{name} shares memory with {other}"):
        _call_with(guarded, inputs, name, inputs[other].reshape(-1)[: int(np.prod(shape))].reshape(shape))


def test_given_outputs_must_not_overlap_each_other(guarded, inputs):
    given = _given(inputs)
    with pytest.raises(ValueError, match=r"^lse shares memory with out"):
        lse = given["out"].reshape(-1).view(np.float32)[: given["lse"].size].reshape(given["lse"].shape)
        run_forward(guarded, inputs, out=given["out"], lse=lse)
    with pytest.raises(ValueError, match=r"^dv shares memory with dk"):
        run_backward(guarded, inputs, dk=given["dk"], dv=given["dk"])
