"""Edges of the front ends found trying them as a new user would (issue 36, items 1-7): the KV
cache validated by the library before its append and refusing a q that views the rows it appends,
NumPy scalars and arrays for softmax_scale and window_size, PyTorch index tensors of int64, empty
tensors and autocast in the PyTorch and MLX drop-ins, and the MLX drop-in's contract (sinks dtype,
non-finite masks and sinks)."""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam

from conftest import make_inputs


def _cache_call(dtype, head_dim):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 2, head_dim)).astype(dtype)
    k_cache = np.zeros((1, 16, 1, head_dim), dtype=dtype)
    v_cache = np.zeros_like(k_cache)
    k, v = (rng.standard_normal((1, 1, 1, head_dim)).astype(dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v


def test_kv_cache_is_not_written_when_the_library_refuses_the_call(ctx):
    # float32 has no kernels above head_dim 256: FA_STATUS_UNSUPPORTED, before the append.
    q, k_cache, v_cache, k, v = _cache_call(np.float32, 300)
    with pytest.raises(fam.FlashAttentionError, match="head_dim") as caught:
        fam.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, context=ctx)
    assert caught.value.status_name == "FA_STATUS_UNSUPPORTED"
    assert not k_cache.any() and not v_cache.any()


def test_kv_cache_refuses_q_k_v_that_view_the_cache(ctx):
    q, k_cache, v_cache, k, v = _cache_call(np.float32, 32)
    for name, view in (("q", k_cache[:, 3:5]), ("k", k_cache[:, 3:4]), ("v", v_cache[:, 3:4])):
        args = {"q": q, "k": k, "v": v, name: view}
        with pytest.raises(ValueError, match=f"must not overlap {name}"):
            fam.flash_attn_with_kvcache(args["q"], k_cache, v_cache, args["k"], args["v"], cache_seqlens=3,
                                        context=ctx)
    # Without an append nothing is written, so q may view the cache.
    out = fam.flash_attn_with_kvcache(k_cache[:, 3:5], k_cache, v_cache, cache_seqlens=4, context=ctx)
    assert np.all(np.isfinite(out))


def test_numpy_scalars_and_arrays_for_scale_and_window(ctx):
    q, k, v, _ = make_inputs(2, 1, 2, 1, 5, 7, 16)
    out, lse = ctx.forward(q, k, v, softmax_scale=0.1, window_size=(3, 0))
    out2, lse2 = ctx.forward(q, k, v, softmax_scale=np.array(0.1), window_size=np.array([3, 0]))
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)
    with pytest.raises(TypeError, match="window_size"):
        ctx.forward(q, k, v, window_size=np.array([3.0, 0.0]))
    with pytest.raises(TypeError, match="softmax_scale"):
        ctx.forward(q, k, v, softmax_scale=np.array([0.1]))


# ---- PyTorch ------------------------------------------------------------------------------------


def test_torch_index_tensors_name_the_torch_conversion():
    torch = pytest.importorskip("torch")
    from flash_attention_metal.torch import flash_attn_varlen_func, flash_attn_with_kvcache

    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 2, 6])  # int64, as torch.tensor of Python ints
    with pytest.raises(TypeError, match=r"cu_seqlens_q\.to\(torch\.int32\)"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4)
    cache = torch.zeros(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"cache_seqlens\.to\(torch\.int32\)"):
        flash_attn_with_kvcache(q[None, :1], cache, cache, cache_seqlens=torch.tensor([3]))


@pytest.mark.parametrize("shape_q, shape_k", [((0, 2, 4, 8), (0, 2, 5, 8)), ((1, 2, 0, 8), (1, 2, 5, 8)),
                                              ((1, 2, 4, 8), (1, 2, 0, 8))])
def test_torch_sdpa_empty_tensors_match_pytorch(shape_q, shape_k):
    torch = pytest.importorskip("torch")
    from flash_attention_metal.torch import scaled_dot_product_attention

    q = torch.randn(shape_q, requires_grad=True)
    k, v = torch.randn(shape_k), torch.randn(shape_k)
    out = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    out.sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any()


def test_torch_autocast_gives_the_autocast_dtype():
    torch = pytest.importorskip("torch")
    from flash_attention_metal.torch import flash_attn_func, scaled_dot_product_attention

    q = torch.randn(1, 2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = scaled_dot_product_attention(q, q, q)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        fa = flash_attn_func(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    assert ours.dtype == theirs.dtype == fa.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)


def test_torch_backward_gives_nan_gradients_for_nan_inputs():
    # GradScaler skips a step on non-finite gradients; an exception would end training instead.
    torch = pytest.importorskip("torch")
    from flash_attention_metal.torch import scaled_dot_product_attention

    q, k, v = (torch.randn(1, 2, 70, 16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        k[0, 0, 69, 3] = float("nan")  # seen by the last row only; rows 0-63 read no tile holding it
    scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert torch.isnan(q.grad[0, 0, 69]).all() and torch.isfinite(q.grad[0, 0, :64]).all()
    assert torch.isnan(k.grad[0, 0]).any() and torch.isfinite(q.grad[0, 1]).all()


# ---- MLX ----------------------------------------------------------------------------------------


def _mlx():
    mx = pytest.importorskip("mlx.core")
    from flash_attention_metal import mlx as fam_mlx
    if not fam_mlx.NATIVE:
        pytest.skip(fam_mlx.PATH_NOTE)
    return mx, fam_mlx


def test_mlx_sinks_that_would_promote_are_a_value_error():
    # MLX's test_sdpa_attention_sinks: float32 sinks with a float16 call.
    mx, fam_mlx = _mlx()
    q = mx.random.normal((1, 2, 3, 16)).astype(mx.float16)
    with pytest.raises(ValueError, match="promote"):
        fam_mlx.scaled_dot_product_attention(q, q, q, scale=0.25, sinks=mx.zeros((2,), dtype=mx.float32))
    fam_mlx.scaled_dot_product_attention(q.astype(mx.float32), q.astype(mx.float32), q.astype(mx.float32),
                                         scale=0.25, sinks=mx.zeros((2,), dtype=mx.float16))


def test_mlx_refuses_non_finite_masks_and_sinks_on_the_cpu_stream():
    mx, fam_mlx = _mlx()
    q = mx.random.normal((1, 2, 3, 16))
    for bad in (float("nan"), float("inf")):
        mask = mx.array(np.where(np.arange(4)[None, :] == 2, bad, 0.0).astype(np.float32) * np.ones((3, 1), np.float32))
        with pytest.raises((ValueError, RuntimeError), match="mask holds"):
            mx.eval(fam_mlx.scaled_dot_product_attention(q, mx.random.normal((1, 2, 4, 16)),
                                                         mx.random.normal((1, 2, 4, 16)), scale=0.25, mask=mask))
        with pytest.raises((ValueError, RuntimeError), match=r"sinks\[1\]"):
            mx.eval(fam_mlx.scaled_dot_product_attention(q, q, q, scale=0.25, sinks=mx.array([0.0, bad])))


def test_mlx_empty_arrays_match_mlx():
    mx, fam_mlx = _mlx()
    full, empty = mx.random.normal((1, 2, 3, 8)), mx.zeros((1, 2, 0, 8))
    for q, kv in ((empty, full), (full, empty)):
        ours = fam_mlx.scaled_dot_product_attention(q, kv, kv, scale=0.5)
        theirs = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.5)
        assert ours.shape == theirs.shape and bool(mx.array_equal(ours, theirs))


def test_mlx_gradients_are_nan_not_errors():
    mx, fam_mlx = _mlx()
    q = mx.random.normal((1, 2, 3, 16))
    k = mx.array(np.where(np.arange(16) == 3, np.nan, 1.0).astype(np.float32) * np.ones((1, 2, 4, 1), np.float32))

    def loss(q):
        return fam_mlx.scaled_dot_product_attention(q, k, k, scale=0.25).sum()

    grad = mx.grad(loss)(q)
    assert bool(mx.isnan(grad).all())
