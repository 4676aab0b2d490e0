"""The score options on the library (attn_mask, window_size, softcap, alibi_slopes, sinks), forward
and backward, under the accuracy rule of each dtype: an all-pairs sample of their combinations with
causal, GQA, dtype and layout; rows left without keys; decode shapes (the split-KV forward); the
identities between options; how a mask reaches the ABI (strides, no expansion)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from allpairspy import AllPairs

import flash_attention_metal as fam
from flash_attention_metal import accuracy

from conftest import assert_within_rule, judge, make_inputs

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
HEADS = 4
# (batch, seqlen_q, seqlen_k, head_dim), cycled over the cases: edges of the 32-row blocks,
# seqlen_q below, equal to and above seqlen_k.
SHAPES = [(2, 37, 45, 32), (1, 64, 64, 64), (2, 50, 33, 40), (1, 20, 96, 16)]
FACTORS = {
    "mask": ["none", "bool padding", "bool full", "additive 2-D float32", "additive full"],
    "window": [(-1, -1), (11, 6), (7, -1), (-1, 4)],
    "softcap": [0.0, 1.5],
    "alibi": ["none", "per head", "per batch and head"],
    "sinks": [False, True],
    "causal": [False, True],
    "kv_heads": [4, 2, 1],
    "dtype": list(DTYPES),
    "layout": ["bhsd", "bshd"],
}
CASES = [dict(zip(FACTORS, row)) for row in AllPairs(list(FACTORS.values()))]


def _label(case) -> str:
    return "-".join(f"{value}" for value in case.values()).replace(" ", "_")


def make_mask(kind: str, rng, batch: int, seqlen_q: int, seqlen_k: int, dtype):
    """A mask of ``kind``: a padding mask (batch, 1, 1, seqlen_k) keeping a prefix of each batch's
    keys; full random ones; additive ones with some -inf."""
    if kind == "bool padding":
        lengths = rng.integers(seqlen_k // 2, seqlen_k + 1, size=batch)
        return (np.arange(seqlen_k) < lengths[:, None])[:, None, None, :]
    if kind == "bool full":
        return rng.random((batch, HEADS, seqlen_q, seqlen_k)) < 0.8
    shape = (seqlen_q, seqlen_k) if kind == "additive 2-D float32" else (batch, HEADS, seqlen_q, seqlen_k)
    additive = 2 * rng.standard_normal(shape)
    additive[rng.random(shape) < 0.15] = -np.inf
    return additive.astype(np.float32 if kind == "additive 2-D float32" else dtype)


def case_options(case, rng, batch, seqlen_q, seqlen_k, dtype) -> dict:
    """The keyword arguments of a grid case (the same for the library and the reference)."""
    options = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"])
    if case["mask"] != "none":
        options["attn_mask"] = make_mask(case["mask"], rng, batch, seqlen_q, seqlen_k, dtype)
    if case["alibi"] == "per head":
        # BLOOM's slopes: 2^(-8 (h + 1) / num_heads).
        options["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, HEADS + 1, dtype=np.float32) / HEADS)
    elif case["alibi"] == "per batch and head":
        options["alibi_slopes"] = rng.uniform(0.0, 0.5, (batch, HEADS)).astype(np.float32)
    if case["sinks"]:
        options["sinks"] = (2 * rng.standard_normal(HEADS)).astype(np.float32)
    return options


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_label(c) for c in CASES])
def test_all_pairs_of_options_within_the_rule(ctx, index):
    case = CASES[index]
    batch, seqlen_q, seqlen_k, head_dim = SHAPES[index % len(SHAPES)]
    dtype = DTYPES[case["dtype"]]
    rng = np.random.default_rng(100 + index)
    q, k, v, dout = make_inputs(200 + index, batch, HEADS, case["kv_heads"], seqlen_q, seqlen_k, head_dim,
                                dtype=dtype, layout=case["layout"])
    judge(ctx, q, k, v, dout, case_options(case, rng, batch, seqlen_q, seqlen_k, dtype), _label(case),
          case["layout"])


def _row_one_empty(kind: str, dtype):
    """(seqlen_q, seqlen_k, options) that leave query row 1 without keys, by ``kind``."""
    if kind == "all -inf additive":
        mask = np.zeros((1, HEADS, 40, 70), dtype)
        mask[:, :, 1] = -np.inf
        return 40, 70, dict(attn_mask=mask)
    if kind == "all-false bool":
        mask = np.ones((40, 70), bool)
        mask[1] = False
        return 40, 70, dict(attn_mask=mask, softcap=2.0)
    # seqlen_q 70 > seqlen_k 40 with window (3, 0): query i sees keys i - 33 ... i - 30, so rows
    # 0 ... 29 see none, in a block whose other rows do.
    return 70, 40, dict(window_size=(3, 0), alibi_slopes=np.full(HEADS, 0.3, np.float32))


@pytest.mark.parametrize("kind", ["all -inf additive", "all-false bool", "window"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_rows_without_keys_follow_the_empty_row_rule(ctx, kind, with_sinks, dtype):
    seqlen_q, seqlen_k, options = _row_one_empty(kind, dtype)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    if with_sinks:
        options["sinks"] = sinks
    q, k, v, dout = make_inputs(31, 2, HEADS, 2, seqlen_q, seqlen_k, 32, dtype=dtype)
    out, lse, grads = judge(ctx, q, k, v, dout, options, f"{kind} sinks={with_sinks}")
    assert np.all(out[:, :, 1].astype(np.float32) == 0)
    want = np.broadcast_to(sinks[None] if with_sinks else -np.inf, (2, HEADS))
    np.testing.assert_array_equal(lse[:, :, 1], want)
    assert np.all(grads[0][:, :, 1].astype(np.float32) == 0)
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in (out, *grads))


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options): short queries over long KV
# caches take the split-KV forward (seqlen_q <= 8): the decode kernel, the spec kernel where the
# packed rows outgrow a decode block but fit 16 (2 x 8), or the tiled split kernel (8 x 8); each with
# a window, ALiBi or sinks.
DECODE = [
    (1, 8, 2, 1, 600, 64, dict(window_size=(255, 0))),
    (2, 4, 4, 5, 700, 32, dict(causal=True, window_size=(300, -1), sinks=np.array([1, 0, -1, 3], np.float32))),
    (1, 8, 1, 8, 1030, 128, dict(causal=True, alibi_slopes=2.0 ** -np.arange(1, 9, dtype=np.float32))),
    (2, 6, 3, 3, 513, 40, dict(alibi_slopes=np.linspace(0.01, 0.1, 12, dtype=np.float32).reshape(2, 6),
                               sinks=np.linspace(-2, 2, 6, dtype=np.float32), softcap=5.0)),
    (1, 4, 2, 8, 900, 64, dict(causal=True, window_size=(100, 0), sinks=np.full(4, 4.0, np.float32))),
]


@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Nq{c[3]}-Nk{c[4]}-{'-'.join(c[6])}")
def test_decode_shapes_within_the_rule(ctx, case):
    *shape, options = case
    q, k, v, dout = make_inputs(sum(shape), *shape)
    out, lse = ctx.forward(q, k, v, **options)
    assert ctx.last_profile.dispatches[0].kernel.startswith(("flash_attention_forward_decode",
                                                             "flash_attention_forward_spec",
                                                             "flash_attention_forward_split"))
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, **options), f"decode {shape}")
    grads = ctx.backward(dout, q, k, v, out, lse, **options)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, **options), f"decode backward {shape}")


def test_decode_with_a_padding_mask_and_an_empty_row(ctx):
    # The split forward with a mask, and a sequence whose padding hides every key: out 0, lse -inf.
    q, k, v, _ = make_inputs(32, 3, 4, 2, 2, 800, 64)
    lengths = np.array([800, 321, 0])
    mask = (np.arange(800) < lengths[:, None])[:, None, None, :]
    out, lse = ctx.forward(q, k, v, attn_mask=mask)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, attn_mask=mask), "decode padding")
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint8)


def _assert_same_results(ctx, q, k, v, dout, first: dict, second: dict):
    """forward and backward of the two option sets agree bit for bit."""
    results = []
    for options in (first, second):
        out, lse = ctx.forward(q, k, v, **options)
        results.append((out, lse, *ctx.backward(dout, q, k, v, out, lse, **options)))
    for got, want in zip(*results):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_identities_between_options(ctx):
    q, k, v, dout = make_inputs(33, 2, HEADS, 2, 45, 45, 32)
    rng = np.random.default_rng(33)
    # causal=True is window right = 0; a window wider than the keys is no window.
    _assert_same_results(ctx, q, k, v, dout, dict(causal=True), dict(window_size=(-1, 0)))
    _assert_same_results(ctx, q, k, v, dout, dict(), dict(window_size=(45, 45)))
    # A broadcast mask is the expanded one; a bool mask is the additive 0 / -inf one.
    padding = (np.arange(45) < np.array([[30], [45]]))[:, None, None, :]
    _assert_same_results(ctx, q, k, v, dout, dict(attn_mask=padding),
                         dict(attn_mask=np.broadcast_to(padding, (2, HEADS, 45, 45)).copy()))
    _assert_same_results(ctx, q, k, v, dout, dict(attn_mask=padding),
                         dict(attn_mask=np.where(padding, 0.0, -np.inf).astype(np.float16)))
    # ALiBi slopes per head are those slopes for every batch.
    slopes = rng.uniform(0, 1, HEADS).astype(np.float32)
    _assert_same_results(ctx, q, k, v, dout, dict(alibi_slopes=slopes), dict(alibi_slopes=np.stack([slopes] * 2)))


def test_bool_and_float32_masks_in_every_dtype(ctx):
    for dtype in DTYPES.values():
        q, k, v, dout = make_inputs(34, 1, HEADS, 1, 33, 40, 16, dtype=dtype)
        mask = np.where(np.random.default_rng(34).random((33, 40)) < 0.3, -np.inf, 0.5).astype(np.float32)
        judge(ctx, q, k, v, dout, dict(attn_mask=mask, causal=True), f"float32 mask {np.dtype(dtype).name}")


def test_dsinks_is_the_reduction_of_its_own_lse_and_out(ctx):
    # dsinks[h] = -sum over b and i of exp(sinks[h] - lse) * rowsum(dout * out), with the lse and out
    # the backward was given: float32 accumulation only.
    q, k, v, dout = make_inputs(35, 2, HEADS, 2, 70, 50, 32, dtype=ml_dtypes.bfloat16)
    sinks = np.array([0.0, 1.0, -3.0, 5.0], np.float32)
    out, lse = ctx.forward(q, k, v, sinks=sinks, causal=True)
    *_, dsinks = ctx.backward(dout, q, k, v, out, lse, sinks=sinks, causal=True)
    terms = np.exp(sinks[None, :, None] - lse.astype(np.float64)) * np.sum(
        dout.astype(np.float64) * out.astype(np.float64), axis=-1)
    np.testing.assert_allclose(dsinks, -terms.sum(axis=(0, 2)), rtol=0, atol=1e-5 * np.abs(terms).sum(axis=(0, 2)).max())


def test_results_are_deterministic_with_every_option(ctx):
    q, k, v, dout = make_inputs(36, 2, HEADS, 1, 40, 77, 64)
    options = dict(attn_mask=make_mask("additive full", np.random.default_rng(36), 2, 40, 77, np.float16),
                   window_size=(20, 3), softcap=2.0, alibi_slopes=np.full(HEADS, 0.1, np.float32),
                   sinks=np.ones(HEADS, np.float32))
    _assert_same_results(ctx, q, k, v, dout, options, options)


def test_module_functions_take_the_options(ctx):
    q, k, v, dout = make_inputs(37, 1, HEADS, 2, 9, 12, 8)
    options = dict(window_size=(3, 1), sinks=np.zeros(HEADS, np.float32), attn_mask=np.ones(12, bool))
    out, lse = fam.forward(q, k, v, **options)
    np.testing.assert_array_equal(out, ctx.forward(q, k, v, **options)[0])
    np.testing.assert_array_equal(fam.attention(q, k, v, **options), out)
    grads = fam.backward(dout, q, k, v, out, lse, **options)
    assert len(grads) == 4
    for got, want in zip(grads, ctx.backward(dout, q, k, v, out, lse, **options)):
        np.testing.assert_array_equal(got, want)


def test_broadcast_masks_are_passed_in_place_with_zero_strides(spied):
    ctx, spy = spied
    lib = ctx._native.lib
    q, k, v, dout = make_inputs(38, 2, HEADS, 2, 24, 40, 16)
    padding = np.arange(40) < np.array([[[[25]]], [[[40]]]])  # (2, 1, 1, 40)
    out, lse = ctx.forward(q, k, v, attn_mask=padding)
    ctx.backward(dout, q, k, v, out, lse, attn_mask=padding)
    assert spy.masks == [(padding.ctypes.data, (40, 0, 0), lib.FA_ATTN_MASK_BOOL)] * 2
    # A NumPy broadcast view over heads and rows: one slice of it, in place.
    additive = np.zeros((24, 40), np.float16)
    view = np.broadcast_to(additive, (2, HEADS, 24, 40))
    ctx.forward(q, k, v, attn_mask=view)
    assert spy.masks[-1] == (additive.ctypes.data, (0, 0, 40), lib.FA_ATTN_MASK_ADDITIVE)
    # A float32 mask of a float16 call, per head: (1, H, 1, Nk).
    per_head = np.zeros((1, HEADS, 1, 40), np.float32)
    ctx.forward(q, k, v, attn_mask=per_head)
    assert spy.masks[-1] == (per_head.ctypes.data, (0, 40, 0), lib.FA_ATTN_MASK_ADDITIVE_FLOAT32)


def test_masks_whose_key_axis_is_not_contiguous_are_copied_once(spied):
    ctx, spy = spied
    q, k, v, _ = make_inputs(39, 2, HEADS, 2, 24, 40, 16)
    rng = np.random.default_rng(39)
    full = rng.random((2, HEADS, 24, 40)) < 0.7
    want = ctx.forward(q, k, v, attn_mask=full)
    wide = np.zeros((2, HEADS, 24, 80), bool)
    wide[..., ::2] = full
    column = full[..., :1]  # (2, H, 24, 1): one value per row, broadcast over the keys
    for label, mask, expected in (("strided key axis", wide[..., ::2], full),
                                  ("reversed keys", full[..., ::-1].copy()[..., ::-1], full),
                                  ("key axis of size 1", column, np.broadcast_to(column, full.shape))):
        got = ctx.forward(q, k, v, attn_mask=mask)
        address, strides, _ = spy.masks[-1]
        assert address != mask.ctypes.data and strides == (HEADS * 24 * 40, 24 * 40, 40), label
        reference_result = ctx.forward(q, k, v, attn_mask=np.ascontiguousarray(expected))
        for a, b in zip(got, reference_result):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=label)
    np.testing.assert_array_equal(_bits(ctx.forward(q, k, v, attn_mask=wide[..., ::2])[0]), _bits(want[0]))


def test_a_size_one_key_axis_is_expanded_without_the_other_axes(spied):
    ctx, spy = spied
    q, k, v, _ = make_inputs(40, 2, HEADS, 2, 24, 40, 16)
    ctx.forward(q, k, v, attn_mask=np.array([[[[True]]], [[[False]]]]))  # (2, 1, 1, 1)
    _, strides, _ = spy.masks[-1]
    assert strides == (40, 0, 0)


# Finite scores near +-FLT_MAX (the kernels keep scores in natural units and take only x - max to
# base 2 for exp2).
def test_a_row_masked_with_the_float32_minimum_is_the_uniform_average(ctx):
    # Hugging Face's additive masks use numpy.finfo(float32).min, not -inf: a row where every key
    # gets it still weighs its keys (equally, once float32 absorbs the scores), as PyTorch does.
    q, k, v, _ = make_inputs(41, 1, 2, 2, 8, 8, 16)
    mask = np.zeros((8, 8), np.float32)
    mask[3] = np.finfo(np.float32).min
    out, lse = ctx.forward(q, k, v, attn_mask=mask)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, attn_mask=mask), "float32 minimum row")


# Rows whose every key gets a huge finite additive value (Hugging Face's float32 or float16
# minimum for a fully padded row, masked_fill(-1e9)): float32 lse = max + log(row sum) cannot hold
# the log beside such a max, so the backward must not take P = exp(score - lse) at its word.
HUGE_FILLS = {"f32min": np.finfo(np.float32).min, "1e9": -1e9, "f16min": -65504.0, "3e4": -3e4}


@pytest.mark.parametrize("fill", HUGE_FILLS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_masked_with_a_huge_finite_value_have_exact_gradients(ctx, fill, dtype):
    q, k, v, dout = make_inputs(43, 2, HEADS, 2, 50, 90, 64, dtype=DTYPES[dtype])
    mask = np.zeros((2, HEADS, 50, 90), np.float32)
    mask[:, :, 3] = HUGE_FILLS[fill]
    mask[1, 2, 40:] = HUGE_FILLS[fill]
    mask[0, 1, 7, :30] = HUGE_FILLS[fill]
    judge(ctx, q, k, v, dout, dict(attn_mask=mask), f"fill {fill}")
    # The same in the input dtype where it holds the value, and with sinks.
    if -HUGE_FILLS[fill] <= float(ml_dtypes.finfo(DTYPES[dtype]).max):
        sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
        judge(ctx, q, k, v, dout, dict(attn_mask=mask.astype(DTYPES[dtype]), sinks=sinks), f"fill {fill} sinks")


def test_decode_rows_masked_with_the_float32_minimum_have_exact_gradients(ctx):
    # The split-KV forward's lse (merged from chunks) before the same backward.
    q, k, v, dout = make_inputs(44, 2, HEADS, 2, 3, 600, 32)
    mask = np.zeros((2, 1, 3, 600), np.float32)
    mask[0, :, 1] = np.finfo(np.float32).min
    out, lse = ctx.forward(q, k, v, attn_mask=mask)
    assert ctx.last_profile.dispatches[0].kernel.startswith("flash_attention_forward_decode")
    grads = ctx.backward(dout, q, k, v, out, lse, attn_mask=mask)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, attn_mask=mask), "decode f32min")


def test_key_blocks_with_the_global_lse_of_huge_scores_give_their_share(ctx):
    # Ring attention's use of the backward: each key block with the whole row's lse returns its
    # share of the gradients. With |lse| >= 256 the residual pass must keep that lse as given.
    q, k, v, dout = make_inputs(45, 1, HEADS, 2, 40, 80, 32, dtype=np.float32)
    scale = 60.0
    out, lse = ctx.forward(q, k, v, softmax_scale=scale)
    assert np.mean(np.abs(lse) >= 256) > 0.9
    parts = [ctx.backward(dout, q, k[:, :, keys], v[:, :, keys], out, lse, softmax_scale=scale)
             for keys in (slice(0, 40), slice(40, 80))]
    dq = parts[0][0] + parts[1][0]
    dk, dv = (np.concatenate([part[i] for part in parts], axis=2) for i in (1, 2))
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, dq, dk, dv, softmax_scale=scale), "blockwise")


def test_a_huge_finite_additive_value_gives_no_nan(ctx):
    q, k, v, _ = make_inputs(42, 1, 2, 2, 8, 8, 16)
    mask = np.zeros((8, 8), np.float32)
    mask[3, 5] = 3e38
    out, lse = ctx.forward(q, k, v, attn_mask=mask)
    assert np.all(np.isfinite(out.astype(np.float32))) and np.all(np.isfinite(lse))
    np.testing.assert_array_equal(out[0, :, 3], v[0, :, 5])
