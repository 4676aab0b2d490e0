"""NaN in, NaN out (docs/semantics.md, "Non-finite values") on every kernel: the dense forward,
the tiled split-KV and decode kernels with their combine, varlen, the KV cache, the backward and the
merge. NaN and infinities are placed in q, k and v, and a finite softmax_scale overflows the scores,
at the first, a middle and the last key of a key tile (32 keys here) and of a 64-key split chunk.
Oracles: the float64 reference (fed the scores rounded to float32 where the scale overflows them, as
the kernels compute them), PyTorch's SDPA and MLX's sdpa (CPU), on the rows that see a key."""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import reference

F32 = np.float32
D = 32
# Key positions: 64 opens the second 64-key chunk and a 32-key tile, 79 is a tile's middle, 95 a
# tile's last key, 127 the chunk's last key.
KEYS = (64, 79, 95, 127)
SEQLEN_K = 160
# (name, heads, kv_heads, seqlen_q, kernel that writes the result): seqlen_q 72 > 64 takes the
# dense forward; 32 packed query rows of one query the tiled split kernel; 16 the spec kernel; 8 the
# decode kernel.
PATHS = [("dense", 2, 1, 72, "flash_attention_forward_f32_"),
         ("split", 32, 1, 1, "flash_attention_forward_split_f32_"),
         ("spec", 16, 1, 1, "flash_attention_forward_spec_f32_"),
         ("decode", 4, 1, 2, "flash_attention_forward_decode_f32_")]
# Where the non-finite value goes: one element of key j's k or v, all of one query row, or key j's
# k made 1e4 for a scale of 1.1e34, whose product overflows float32 (q row 0 is ones).
PLACES = ["k", "v", "q", "scale"]


def _inputs(heads, kv_heads, seqlen_q, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, seqlen_q, D)).astype(F32)
    k = rng.standard_normal((1, kv_heads, SEQLEN_K, D)).astype(F32)
    v = rng.standard_normal((1, kv_heads, SEQLEN_K, D)).astype(F32)
    return q, k, v


def _place(q, k, v, place, value, key):
    """Puts `value` (or, for "scale", its sign) at `key`; returns the softmax_scale to use."""
    if place == "k":
        k[0, 0, key, 7] = value
    elif place == "v":
        v[0, 0, key, 3] = value
    elif place == "q":
        q[0, :, -1, 5] = value  # the last query row of every head
    else:
        q[:] = 0
        q[0, :, 0] = 1
        k[0, 0, key] = 1e4 if value > 0 else -1e4
        return 1.1e34
    return None


def reference_forward(q, k, v, scale=None, **options):
    """reference.forward, but with the scaled products rounded to float32 (the kernels' float32
    scores: an overflow becomes +-inf), then the reference's score options and softmax in float64."""
    scale = reference.default_scale(q.shape[3], scale)
    kf = reference.expand_kv(k.astype(np.float64), q.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (scale * (q.astype(np.float64) @ np.swapaxes(kf, -1, -2))).astype(F32).astype(np.float64)
    scores, _, keys = reference.modify_scores(scaled, **options)
    probabilities, lse = reference.softmax(scores, keys, options.get("sinks"))
    return reference.masked_matmul(probabilities, keys, reference.expand_kv(v.astype(np.float64), q.shape[1])), lse


def assert_matches(ours, ref, what, tol=2e-5, leak=None):
    """NaN, +inf and -inf exactly where ref has them; elsewhere finite and within tol (relative to
    max(1, |ref|)). `leak` (boolean, broadcast to ref) marks where a NaN may also come from 0 x NaN
    at a hidden key (docs/semantics.md), which is then accepted."""
    ours = np.asarray(ours, dtype=np.float64)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        expected = kind(ref)
        assert np.array_equal(kind(ours)[expected], expected[expected]), f"{what}: {kind.__name__} missing"
    finite = np.isfinite(ref)
    if leak is not None:
        finite &= ~(np.isnan(ours) & np.broadcast_to(leak, ref.shape))
    diff = np.abs(ours[finite] - ref[finite])
    assert np.all(diff <= tol * np.maximum(1, np.abs(ref[finite]))), f"{what}: max diff {diff.max(initial=0)}"


def _run(ctx, path, q, k, v, **options):
    out, lse = ctx.forward(q, k, v, **options)
    kernels = [d.kernel for d in ctx.last_profile.dispatches]
    assert kernels[0].startswith(path[4]), kernels
    return out, lse


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_forward_follows_the_reference(ctx, path, place, value):
    if place == "scale" and np.isnan(value):
        pytest.skip("a finite scale overflows to +-inf, never NaN")
    for key in KEYS:
        q, k, v = _inputs(*path[1:4], seed=key)
        scale = _place(q, k, v, place, value, key)
        out, lse = _run(ctx, path, q, k, v, softmax_scale=scale, causal=True)
        ref_out, ref_lse = reference_forward(q, k, v, scale, causal=True)
        label = f"{path[0]} {place}={value} at key {key}"
        # Rows that do not see key `key` may meet its NaN value in a tile they share (0 x NaN).
        leak = None if place != "v" else ~reference.visible_keys(q.shape[2], SEQLEN_K, True)[:, key, None]
        assert_matches(out, ref_out, label + " out", leak=leak)
        assert_matches(lse, ref_lse, label + " lse", tol=1e-5)
        if place in ("k", "q") and np.isnan(value):
            assert np.isnan(out).any() and np.isnan(lse).any(), label


def test_issue_reproducer_nan_key_is_not_hidden_by_its_chunk(ctx):
    # issue 36: one NaN in a key used to drop its whole 64-key chunk on the decode path.
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 1, 64)).astype(F32)
    k, v = (rng.standard_normal((1, 2, 2000, 64)).astype(F32) for _ in range(2))
    k[0, 0, 3, 7] = np.nan
    out, lse = ctx.forward(q, k, v)
    assert np.all(np.isnan(out[0, :4])) and np.all(np.isnan(lse[0, :4]))
    assert np.all(np.isfinite(out[0, 4:])) and np.all(np.isfinite(lse[0, 4:]))


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_masks_hide_non_finite_keys_and_rows(ctx, path):
    """A key hidden by a boolean or an additive -inf mask never reaches a forward result through its
    k (NaN or +inf), and a row hidden entirely gets out 0 and lse -inf even if its q is NaN."""
    q, k, v = _inputs(*path[1:4])
    k[0, 0, 79, 1] = np.nan
    k[0, 0, 127, 2] = np.inf
    q[0, :, -1] = np.nan
    keep = np.ones((q.shape[2], SEQLEN_K), dtype=bool)
    keep[:, [79, 127]] = False
    keep[-1] = False
    additive = np.where(keep, F32(0), F32(-np.inf))
    for mask in (keep, additive):
        out, lse = _run(ctx, path, q, k, v, attn_mask=mask)
        assert np.all(out[0, :, -1] == 0) and np.all(lse[0, :, -1] == -np.inf)
        ref_out, ref_lse = reference.forward(q, k, v, attn_mask=mask)
        assert_matches(out, ref_out, f"{path[0]} {mask.dtype} mask out")
        assert_matches(lse, ref_lse, f"{path[0]} {mask.dtype} mask lse", tol=1e-5)


def test_masks_sinks_and_scale_are_refused_by_name(ctx):
    q, k, v = _inputs(2, 1, 4)
    for bad in (np.nan, np.inf):
        mask = np.zeros((4, SEQLEN_K), dtype=F32)
        mask[1, 70] = bad
        with pytest.raises(ValueError, match="attn_mask"):
            ctx.forward(q, k, v, attn_mask=mask)
        with pytest.raises(ValueError, match="sinks"):
            ctx.forward(q, k, v, sinks=np.array([0.0, bad], dtype=F32))
        with pytest.raises(ValueError, match="softmax_scale"):
            ctx.forward(q, k, v, softmax_scale=bad)


def test_sinks_with_non_finite_scores(ctx):
    q, k, v = _inputs(4, 1, 2)
    k[0, 0, 64, 0] = np.nan
    sinks = np.array([0.5, -1.0, 2.0, 0.0], dtype=F32)
    out, lse = _run(ctx, PATHS[-1], q, k, v, sinks=sinks, causal=True)
    ref_out, ref_lse = reference.forward(q, k, v, sinks=sinks, causal=True)
    assert_matches(out, ref_out, "sinks out")
    assert_matches(lse, ref_lse, "sinks lse", tol=1e-5)


def test_combine_ignores_an_empty_chunk_whose_partial_output_is_nan(ctx):
    # 16 packed rows (the tiled split kernel), 129 keys: the last chunk holds key 128 alone, which
    # the causal row 0 of 2 does not see; its partial out there is 0 x NaN = NaN with lse -inf,
    # and must weigh nothing: row 0 stays exact.
    q, k, v = _inputs(16, 1, 2)
    k, v = k[:, :, :129].copy(), v[:, :, :129].copy()
    v[0, 0, 128] = np.nan
    out, lse = _run(ctx, ("split",) + PATHS[1][1:], q, k, v, causal=True)
    ref_out, ref_lse = reference.forward(q, k, v, causal=True)
    assert np.all(np.isfinite(out[0, :, 0])) and np.all(np.isnan(out[0, :, 1]))
    assert_matches(out, ref_out, "combine out")
    assert_matches(lse, ref_lse, "combine lse", tol=1e-5)


def test_merge_attention_rule():
    rng = np.random.default_rng(5)
    out_a, out_b = (rng.standard_normal((5, 8)).astype(F32) for _ in range(2))
    lse_a = np.array([0.5, np.nan, np.inf, -np.inf, 1.0], dtype=F32)
    lse_b = np.array([1.5, 0.0, 2.0, 0.3, -np.inf], dtype=F32)
    out_a[3] = np.nan  # an empty part's out is never read
    out, lse = fam.merge_attention(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention(out_a, lse_a, out_b, lse_b)
    assert np.all(np.isnan(out[1:3])) and np.isnan(lse[1]) and lse[2] == np.inf
    assert_matches(out, ref_out, "merge out")
    assert_matches(lse, ref_lse, "merge lse", tol=1e-6)


def test_varlen_and_kv_cache(ctx):
    q, k, v = _inputs(2, 1, 72)
    k[0, 0, 95, 4] = np.nan
    # varlen: two sequences (keys 0-79 and 80-159); the NaN key belongs to the second.
    qv, kv, vv = (x[0].transpose(1, 0, 2).copy() for x in (q[:, :, :64], k, v))
    cu_q, cu_k = np.array([0, 32, 64], dtype=np.int32), np.array([0, 80, 160], dtype=np.int32)
    out, lse = ctx.forward_varlen(qv, kv, vv, cu_q, cu_k, 32, 80, causal=True)
    for s in range(2):
        ref_out, ref_lse = reference.forward(*(x[None].transpose(0, 2, 1, 3) for x in (
            qv[cu_q[s]:cu_q[s + 1]], kv[cu_k[s]:cu_k[s + 1]], vv[cu_k[s]:cu_k[s + 1]])), causal=True)
        assert_matches(out[cu_q[s]:cu_q[s + 1]].transpose(1, 0, 2), ref_out[0], f"varlen out {s}")
        assert_matches(lse[:, cu_q[s]:cu_q[s + 1]], ref_lse[0], f"varlen lse {s}", tol=1e-5)
    # KV cache (decode): one query per sequence over 150 cached rows and one appended.
    k_cache = np.zeros((1, SEQLEN_K, 1, D), dtype=F32)
    v_cache = np.zeros_like(k_cache)
    k_cache[0, :150, 0] = k[0, 0, :150]
    v_cache[0, :150, 0] = v[0, 0, :150]
    qd = q[:, :, :1].transpose(0, 2, 1, 3).copy()
    out, lse = fam.flash_attn_with_kvcache(qd, k_cache, v_cache, k[:, :, 150:151].transpose(0, 2, 1, 3).copy(),
                                           v[:, :, 150:151].transpose(0, 2, 1, 3).copy(),
                                           cache_seqlens=np.array([150], dtype=np.int32),
                                           return_softmax_lse=True, context=ctx)
    assert np.all(np.isnan(out)) and np.all(np.isnan(lse))


@pytest.mark.parametrize("place", ["k", "v", "q", "scale"])
def test_backward_gives_nan_gradients_not_errors(ctx, place):
    q, k, v = _inputs(2, 1, 72)
    key = 64 if place == "scale" else 95  # row 0, whose q the scale case sets, sees keys up to 88
    scale = _place(q, k, v, place, np.inf if place == "scale" else np.nan, key)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(F32)
    out, lse = ctx.forward(q, k, v, softmax_scale=scale, causal=True)
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=True)
    # Rows that see key 95 (a row with a non-finite q: the last) get NaN gradients; the others may
    # meet a NaN of a hidden key through 0 x NaN in a shared tile (docs/semantics.md).
    seen = reference.visible_keys(72, SEQLEN_K, True)[:, key] if place != "q" else np.arange(72) == 71
    if place == "scale":
        seen = np.arange(72) == 0
    assert np.all(np.isnan(dq[0][:, seen])), place
    # dv = P^T dout holds no v: a NaN value leaves it finite (as PyTorch's), the others reach it.
    assert np.isnan(dk).any() and np.isnan(dv).any() == (place != "v"), place
    rows = ~seen & ~np.isnan(dq[0]).any(axis=(0, 2))
    ref = reference.backward(dout, q, k, v, causal=True, softmax_scale=scale)
    finite = np.isfinite(ref[0][0][:, rows])
    np.testing.assert_allclose(dq[0][:, rows][finite], ref[0][0][:, rows][finite], atol=2e-4, rtol=2e-4)


def _framework_outputs(q, k, v, scale, mask):
    """(name, out) of PyTorch's SDPA and MLX's sdpa (CPU), float32, each where installed."""
    results = []
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask), scale=scale,
                enable_gqa=True)
        results.append(("pytorch", out.numpy()))
    try:
        import mlx.core as mx
    except ImportError:
        mx = None
    if mx is not None:
        with mx.stream(mx.cpu):
            out = mx.fast.scaled_dot_product_attention(*(mx.array(x) for x in (q, k, v)), scale=scale,
                                                       mask=mx.array(mask))
            results.append(("mlx", np.array(out)))
    if not results:
        pytest.skip("neither PyTorch nor MLX is installed")
    return results


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_forward_matches_pytorch_and_mlx(ctx, path, place, value):
    if place == "scale" and np.isnan(value):
        pytest.skip("a finite scale overflows to +-inf, never NaN")
    key = KEYS[2]
    q, k, v = _inputs(*path[1:4], seed=7)
    scale = _place(q, k, v, place, value, key)
    out, _ = _run(ctx, path, q, k, v, softmax_scale=scale, causal=True)
    mask = reference.visible_keys(q.shape[2], SEQLEN_K, True)
    # The rows that see the value; PyTorch and MLX also spread a NaN of a hidden key (they add the
    # mask's -inf to a NaN score), so the other rows are compared where both are finite.
    seen = mask[:, key] if place in ("k", "v") else np.ones(q.shape[2], dtype=bool)
    for name, theirs in _framework_outputs(q, k, v, scale or D ** -0.5, mask):
        theirs = theirs.astype(np.float64)
        label = f"{path[0]} {place}={value} against {name}"
        assert_matches(out[:, :, seen], theirs[:, :, seen], label, tol=1e-4)
        both = np.isfinite(out[:, :, ~seen]) & np.isfinite(theirs[:, :, ~seen])
        np.testing.assert_allclose(out[:, :, ~seen][both], theirs[:, :, ~seen][both], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_row_whose_scores_all_overflow_to_minus_inf_sees_no_key(ctx, path):
    # -inf from an overflow means "not visible", as from a mask: out 0, lse -inf, zero gradients.
    _, heads, kv_heads, seqlen_q, _ = path
    q = np.ones((1, heads, seqlen_q, D), dtype=F32)
    k = np.full((1, kv_heads, SEQLEN_K, D), -1e4, dtype=F32)
    v = np.random.default_rng(0).standard_normal(k.shape).astype(F32)
    out, lse = _run(ctx, path, q, k, v, softmax_scale=1.1e34)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    if path[0] == "dense":
        grads = ctx.backward(np.ones_like(out), q, k, v, out, lse, softmax_scale=1.1e34)
        assert all(np.all(g == 0) for g in grads)
