"""float16, bfloat16 and float32; the "bhsd" and "bshd" layouts and strided views read in place;
head_dim_v != head_dim (DeepSeek's MLA pair 192/128): each under the accuracy rule of its dtype."""

from __future__ import annotations

import itertools
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam

from conftest import judge, make_inputs, to_bhsd

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
LAYOUTS = ["bhsd", "bshd"]
# (head_dim, head_dim_v): equal ones, a value dim below and above the query dim, a one-element one.
HEAD_DIMS = [(64, 64), (80, 48), (24, 96), (8, 1)]


def _name(dtype) -> str:
    return np.dtype(dtype).name


# dtype x layout x (MHA, GQA) x causal, cycling through the head-dim pairs so that every dtype and
# layout meets several of them; seqlens around a block edge, Nq != Nk.
GRID = [
    (dtype, layout, kv_heads, causal, HEAD_DIMS[i % len(HEAD_DIMS)])
    for i, (dtype, layout, kv_heads, causal) in enumerate(itertools.product(DTYPES, LAYOUTS, [4, 2], [False, True]))
]


def _label(case):
    dtype, layout, kv_heads, causal, (d, dv) = case
    return f"{_name(dtype)}-{layout}-Hkv{kv_heads}-{'causal' if causal else 'full'}-D{d}-Dv{dv}"


@pytest.mark.parametrize("case", GRID, ids=_label)
def test_grid_within_the_rule_of_each_dtype(ctx, case):
    dtype, layout, kv_heads, causal, (head_dim, head_dim_v) = case
    q, k, v, dout = make_inputs(len(_label(case)), 2, 4, kv_heads, 19, 37, head_dim,
                                head_dim_v=head_dim_v, dtype=dtype, layout=layout)
    judge(ctx, q, k, v, dout, dict(causal=causal), _label(case), layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_mla_head_dim_192_and_head_dim_v_128(ctx, dtype):
    # DeepSeek's MLA: q and k carry 128 no-PE + 64 RoPE dims, v 128; FlashAttention's layout.
    q, k, v, dout = make_inputs(192, 1, 4, 4, 40, 40, 192, head_dim_v=128, dtype=dtype, layout="bshd")
    out, _, (dq, dk, dv) = judge(ctx, q, k, v, dout, dict(causal=True), f"MLA {_name(dtype)}", "bshd")
    assert out.shape == (1, 40, 4, 128) and dq.shape == dk.shape == (1, 40, 4, 192) and dv.shape == (1, 40, 4, 128)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=_name)
def test_head_dim_256_with_a_narrower_value(ctx, dtype):
    # The 256 bucket's shared K/V buffer (forward) and Q/dO and K/V buffers (backward): V's tile
    # overwrites K's with zeros past head_dim_v; 70 rows take the dense forward's 32-row blocks.
    q, k, v, dout = make_inputs(256, 1, 2, 1, 70, 75, 256, head_dim_v=200, dtype=dtype, layout="bshd")
    judge(ctx, q, k, v, dout, dict(causal=True), f"head_dim 256/200 {_name(dtype)}", "bshd")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_bshd_equals_bhsd_bit_for_bit(ctx, dtype):
    q, k, v, dout = make_inputs(31, 2, 4, 2, 21, 33, 32, head_dim_v=16, dtype=dtype, layout="bshd")
    out, lse = ctx.forward(q, k, v, causal=True, layout="bshd")
    grads = ctx.backward(dout, q, k, v, out, lse, causal=True, layout="bshd")
    contiguous = [np.ascontiguousarray(to_bhsd(a, "bshd")) for a in (q, k, v, dout)]
    want_out, want_lse = ctx.forward(*contiguous[:3], causal=True)
    want_grads = ctx.backward(contiguous[3], *contiguous[:3], want_out, want_lse, causal=True)
    assert out.flags.c_contiguous and out.shape == (2, 21, 4, 16)
    np.testing.assert_array_equal(to_bhsd(out, "bshd").view(np.uint8), want_out.view(np.uint8))
    np.testing.assert_array_equal(lse, want_lse)
    for got, want in zip(grads, want_grads):
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(to_bhsd(got, "bshd").view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_packed_qkv_slices_are_read_in_place(spied, dtype):
    ctx, spy = spied
    batch, seqlen, heads, head_dim = 2, 23, 3, 40
    rng = np.random.default_rng(41)
    qkv = rng.standard_normal((batch, seqlen, 3, heads, head_dim)).astype(dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = rng.standard_normal((batch, seqlen, heads, head_dim)).astype(dtype)
    assert not q.flags.c_contiguous
    out, lse = ctx.forward(q, k, v, causal=True, layout="bshd")
    assert spy.addresses["fa_forward"][:3] == [a.ctypes.data for a in (q, k, v)]
    assert spy.addresses["fa_forward"][3] == out.ctypes.data
    assert out.flags.c_contiguous and out.shape == q.shape
    grads = ctx.backward(dout, q, k, v, out, lse, causal=True, layout="bshd")
    assert spy.addresses["fa_backward"][:5] == [a.ctypes.data for a in (dout, q, k, v, out)]
    contiguous = [np.ascontiguousarray(a) for a in (q, k, v)]
    want_out, want_lse = ctx.forward(*contiguous, causal=True, layout="bshd")
    np.testing.assert_array_equal(out.view(np.uint8), want_out.view(np.uint8))
    np.testing.assert_array_equal(lse, want_lse)
    want_grads = ctx.backward(dout, *contiguous, want_out, want_lse, causal=True, layout="bshd")
    for got, want in zip(grads, want_grads):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_views_that_need_a_copy_give_the_same_result(spied):
    ctx, spy = spied
    q, k, v, dout = make_inputs(42, 1, 2, 2, 17, 17, 16, dtype=ml_dtypes.bfloat16)
    want_out, want_lse = ctx.forward(q, k, v)
    wide = np.zeros(q.shape[:3] + (32,), dtype=q.dtype)
    wide[..., ::2] = q
    strided_last_axis = wide[..., ::2]
    reversed_rows = q[:, :, ::-1].copy()[:, :, ::-1]
    broadcast_batch = np.broadcast_to(k[:1], (3,) + k.shape[1:])
    for label, view in (("last axis strided", strided_last_axis), ("negative strides", reversed_rows)):
        out, lse = ctx.forward(view, k, v)
        assert spy.addresses["fa_forward"][0] != view.ctypes.data, label
        np.testing.assert_array_equal(out.view(np.uint16), want_out.view(np.uint16), err_msg=label)
        assert out.flags.c_contiguous
    out, _ = ctx.forward(np.concatenate([q] * 3), broadcast_batch, np.broadcast_to(v, broadcast_batch.shape))
    for b in range(3):
        np.testing.assert_array_equal(out[b].view(np.uint16), want_out[0].view(np.uint16))


def test_outputs_follow_the_memory_order_of_their_inputs(ctx):
    # A bhsd call on arrays stored (B, L, H, D): out and the grads come back stored the same way.
    q, k, v, dout = make_inputs(43, 1, 2, 1, 9, 12, 8, head_dim_v=4, layout="bshd")
    views = [to_bhsd(a, "bshd") for a in (q, k, v, dout)]
    out, lse = ctx.forward(*views[:3])
    assert out.shape == (1, 2, 9, 4) and out.transpose(0, 2, 1, 3).flags.c_contiguous
    grads = ctx.backward(views[3], *views[:3], out, lse)
    for grad, like in zip(grads, views[:3]):
        assert grad.shape == like.shape and grad.transpose(0, 2, 1, 3).flags.c_contiguous


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=_name)
def test_a_batch_seqlen_heads_call_copies_no_input(ctx, dtype):
    # tracemalloc sees NumPy's data allocations: a (B, L, H, D) call may allocate its outputs and
    # nothing of the size of an input.
    q, k, v, dout = make_inputs(44, 1, 4, 4, 256, 256, 64, dtype=dtype, layout="bshd")
    ctx.forward(q, k, v, layout="bshd")  # warm-up: kernels and caches outside the measurement
    small = q.nbytes // 8
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        out, lse = ctx.forward(q, k, v, layout="bshd")
        _, forward_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before_backward, _ = tracemalloc.get_traced_memory()
        grads = ctx.backward(dout, q, k, v, out, lse, layout="bshd")
        _, backward_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert forward_peak - before <= out.nbytes + lse.nbytes + small, forward_peak - before
    outputs = sum(g.nbytes for g in grads)
    assert backward_peak - before_backward <= outputs + small, backward_peak - before_backward


def test_module_functions_take_the_layout(ctx):
    q, k, v, dout = make_inputs(45, 1, 2, 2, 8, 8, 16, dtype=np.float32, layout="bshd")
    out, lse = fam.forward(q, k, v, layout="bshd")
    np.testing.assert_array_equal(out, ctx.forward(q, k, v, layout="bshd")[0])
    np.testing.assert_array_equal(fam.attention(q, k, v, layout="bshd"), out)
    for got, want in zip(fam.backward(dout, q, k, v, out, lse, layout="bshd"),
                         ctx.backward(dout, q, k, v, out, lse, layout="bshd")):
        np.testing.assert_array_equal(got, want)
