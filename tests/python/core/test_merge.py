"""merge_attention: attention over concatenated keys equals the merge of attention over the parts
(within the accuracy rule of the unsplit problem on these N(0, 1) inputs; for real inputs, where
the parts' float16 outputs can cancel, see test_fixture_smollm2.py), the -inf cases, and the
argument checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attention_metal as fam
from flash_attention_metal import accuracy, reference

from conftest import assert_within_rule, causal_parts, make_inputs


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, split, causal)
CASES = [
    (1, 2, 2, 16, 48, 64, 20, False),
    (2, 4, 2, 33, 100, 40, 1, False),
    (1, 3, 1, 7, 7, 128, 6, False),
    (1, 8, 2, 1, 300, 64, 150, True),   # decode: one query sees every key
    (1, 4, 4, 8, 200, 96, 100, True),   # a few queries: the staircase at the end of the keys
    (2, 2, 2, 40, 40, 32, 13, True),    # square: the first part's top rows see a staircase
    (1, 2, 1, 50, 20, 80, 10, True),    # Nq > Nk: the top 30 rows see no key in either part
    (1, 2, 2, 30, 10, 16, 9, True),     # ... and the first part has rows empty in it alone
    (1, 2, 2, 20, 64, 256, 63, True),   # the second part holds one key
]


def _label(case):
    b, h, hk, nq, nk, d, split, causal = case
    return f"B{b}-H{h}-Hkv{hk}-Nq{nq}-Nk{nk}-D{d}-split{split}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_merge_of_parts_is_attention_over_all_keys(ctx, case):
    b, h, hk, nq, nk, d, split, causal = case
    q, k, v, _ = make_inputs(sum(case[:7]), b, h, hk, nq, nk, d)
    (out_a, lse_a), (out_b, lse_b) = causal_parts(ctx, q, k, v, split, causal)
    out, lse = ctx.merge_attention(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), _label(case))
    if causal and nq > nk:
        empty = nq - nk
        assert np.all(np.isneginf(lse[:, :, :empty])) and np.all(out[:, :, :empty] == 0)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES[1::3], ids=_label)
def test_merge_in_every_dtype(ctx, case, dtype):
    b, h, hk, nq, nk, d, split, causal = case
    q, k, v, _ = make_inputs(sum(case[:7]), b, h, hk, nq, nk, d, dtype=dtype)
    (out_a, lse_a), (out_b, lse_b) = causal_parts(ctx, q, k, v, split, causal)
    out, lse = ctx.merge_attention(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), _label(case))


def test_three_parts_in_either_order(ctx):
    q, k, v, _ = make_inputs(5, 1, 4, 2, 3, 90, 64)
    parts = [ctx.forward(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 30), slice(30, 31), slice(31, 90))]
    left = ctx.merge_attention(*ctx.merge_attention(*parts[0], *parts[1]), *parts[2])
    right = ctx.merge_attention(*parts[0], *ctx.merge_attention(*parts[1], *parts[2]))
    for out, lse in (left, right):
        assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse), "three parts")


def test_module_function_and_shapes(ctx):
    rng = np.random.default_rng(3)
    for shape in [(64,), (5, 32), (2, 3, 4, 8), (1, 2, 1, 3, 16)]:
        out_a, out_b = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
        lse_a, lse_b = (rng.standard_normal(shape[:-1]).astype(np.float32) for _ in range(2))
        out, lse = fam.merge_attention(out_a, lse_a, out_b, lse_b)
        assert out.shape == shape and lse.shape == shape[:-1]
        ref_out, ref_lse = reference.merge_attention(out_a, lse_a, out_b, lse_b)
        np.testing.assert_allclose(out, ref_out, rtol=2e-3, atol=1e-3)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_non_contiguous_and_read_only_inputs(ctx):
    rng = np.random.default_rng(4)
    out_a = rng.standard_normal((6, 40)).astype(np.float16)
    out_b = rng.standard_normal((40, 6)).astype(np.float16).T   # transposed storage
    lse_a = rng.standard_normal(12).astype(np.float32)[::2]     # strided
    lse_b = rng.standard_normal(6).astype(np.float32)
    for a in (out_a, lse_b):
        a.flags.writeable = False
    out, lse = ctx.merge_attention(out_a, lse_a, out_b, lse_b)
    want = ctx.merge_attention(out_a, lse_a.copy(), out_b.copy(), lse_b)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])
    assert not any(np.shares_memory(r, a) for r in (out, lse) for a in (out_a, lse_a, out_b, lse_b))


_LSE = st.one_of(st.just(-np.inf), st.floats(-80, 80, width=32))


@settings(max_examples=60, deadline=None)
@given(lses=st.lists(st.tuples(_LSE, _LSE), min_size=1, max_size=40), head_dim=st.integers(1, 96),
       seed=st.integers(0, 2**16))
def test_properties_of_the_minus_infinity_cases(lses, head_dim, seed):
    ctx = fam.default_context()
    rng = np.random.default_rng(seed)
    lse_a = np.array([a for a, _ in lses], dtype=np.float32)
    lse_b = np.array([b for _, b in lses], dtype=np.float32)
    out_a = rng.standard_normal((len(lses), head_dim)).astype(np.float16)
    out_b = rng.standard_normal((len(lses), head_dim)).astype(np.float16)
    # An empty part's out is never read: NaN there must not leak.
    out_a[np.isneginf(lse_a)] = np.nan
    out_b[np.isneginf(lse_b)] = np.nan
    out, lse = ctx.merge_attention(out_a, lse_a, out_b, lse_b)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty_a, empty_b = np.isneginf(lse_a), np.isneginf(lse_b)
    both = empty_a & empty_b
    np.testing.assert_array_equal(np.isneginf(lse), both)
    assert np.all(out[both] == 0)
    # One part empty: the other comes back exactly.
    only_b, only_a = empty_a & ~empty_b, empty_b & ~empty_a
    np.testing.assert_array_equal(out[only_b], out_b[only_b])
    np.testing.assert_array_equal(lse[only_b], lse_b[only_b])
    np.testing.assert_array_equal(out[only_a], out_a[only_a])
    np.testing.assert_array_equal(lse[only_a], lse_a[only_a])
    # Everywhere: the float64 merge, within one float16 rounding of out and float32 lse.
    ref_out, ref_lse = reference.merge_attention(out_a, lse_a, out_b, lse_b)
    finite = ~both
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=2**-10, atol=1e-6)
    # The float16 baseline of the merge is the same float32 math.
    base_out, base_lse = accuracy.base_merge_attention(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(base_out, out, rtol=2**-10, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(base_lse), both)
    np.testing.assert_allclose(base_lse[finite], lse[finite], rtol=1e-6, atol=1e-6)
    # Symmetric, within rounding.
    swapped_out, swapped_lse = ctx.merge_attention(out_b, lse_b, out_a, lse_a)
    np.testing.assert_allclose(swapped_out, out, rtol=2**-10, atol=1e-6)
    np.testing.assert_allclose(swapped_lse, lse, rtol=1e-6)


def test_merging_a_result_with_itself():
    rng = np.random.default_rng(7)
    out_a = rng.standard_normal((9, 64)).astype(np.float16)
    lse_a = rng.uniform(-5, 5, 9).astype(np.float32)
    out, lse = fam.merge_attention(out_a, lse_a, out_a, lse_a)
    np.testing.assert_array_equal(out, out_a)
    np.testing.assert_allclose(lse, lse_a.astype(np.float64) + np.log(2), rtol=1e-6)


def test_nan_lse_propagates():
    out_a = np.ones((2, 8), dtype=np.float16)
    lse_a = np.array([np.nan, 0.0], dtype=np.float32)
    lse_b = np.array([1.0, np.nan], dtype=np.float32)
    out, lse = fam.merge_attention(out_a, lse_a, out_a, lse_b)
    assert np.isnan(lse).all() and np.isnan(out).all()
    assert np.isnan(reference.merge_attention(out_a, lse_a, out_a, lse_b)[1]).all()


@pytest.fixture()
def parts():
    rng = np.random.default_rng(0)
    out = rng.standard_normal((2, 3, 4, 8)).astype(np.float16)
    lse = rng.standard_normal((2, 3, 4)).astype(np.float32)
    return dict(out_a=out, lse_a=lse, out_b=out.copy(), lse_b=lse.copy())


def _merge(args):
    return fam.merge_attention(args["out_a"], args["lse_a"], args["out_b"], args["lse_b"])


@pytest.mark.parametrize("name, dtype, expected", [("out_a", np.float64, "float16, bfloat16 or float32"),
                                                   ("out_b", np.float32, "float16"),
                                                   ("lse_a", np.float16, "float32"), ("lse_b", np.float64, "float32")])
def test_dtypes_are_checked(parts, name, dtype, expected):
    parts[name] = parts[name].astype(dtype)
    with pytest.raises(TypeError, match=rf"{name} must have dtype {expected}, got {np.dtype(dtype).name}"):
        _merge(parts)


@pytest.mark.parametrize("name, change, message", [
    ("out_b", lambda a: a[..., :4], r"out_b shape \(2, 3, 4, 4\) must equal out_a shape \(2, 3, 4, 8\)"),
    ("lse_a", lambda a: a[:, :2], r"lse_a shape \(2, 2, 4\) must be out_a's shape without head_dim, \(2, 3, 4\)"),
    ("lse_b", lambda a: a[..., None], r"lse_b shape \(2, 3, 4, 1\) must be out_a's shape without head_dim"),
    ("out_a", lambda a: a[:, :, :0], r"out_a has a zero-sized dimension"),
    ("out_a", lambda a: np.ones((), np.float16), r"out_a must have at least 1 dimension"),
])
def test_shapes_are_checked(parts, name, change, message):
    parts[name] = change(parts[name])
    with pytest.raises(ValueError, match=message):
        _merge(parts)


def test_arrays_only(parts):
    parts["lse_b"] = parts["lse_b"].tolist()
    with pytest.raises(TypeError, match="lse_b must be a numpy.ndarray, got list"):
        _merge(parts)


def test_head_dim_above_the_supported_range(ctx):
    head_dim = ctx.max_head_dim + 1
    out = np.zeros((2, head_dim), dtype=np.float16)
    lse = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match=rf"head_dim \({head_dim}\) must be at most fa_max_head_dim\(\) \({head_dim - 1}\)"):
        ctx.merge_attention(out, lse, out, lse)


def test_checked_before_the_library_is_loaded(library_missing, parts):
    bad = dict(parts, lse_a=parts["lse_a"].astype(np.float64))
    with pytest.raises(TypeError, match="lse_a must have dtype float32"):
        _merge(bad)
    with pytest.raises(fam.FlashAttentionError) as caught:
        _merge(parts)
    assert caught.value.status_name == "LIBRARY_NOT_FOUND"


def test_profile_of_a_merge(ctx):
    rng = np.random.default_rng(8)
    out_a = rng.standard_normal((3, 5, 64)).astype(np.float16)
    lse_a = rng.standard_normal((3, 5)).astype(np.float32)
    ctx.merge_attention(out_a, lse_a, out_a, lse_a)
    (dispatch,) = ctx.last_profile.dispatches
    assert dispatch.kernel == "flash_attention_merge_f16"
    assert dispatch.threadgroups == (4, 1, 1)  # 15 rows, 4 per threadgroup
    assert dispatch.threads_per_threadgroup == (128, 1, 1)
    if ctx.backend == "cpu":
        assert dispatch.simdgroup_multiply_accumulates == 0 and dispatch.threadgroup_barriers == 0
