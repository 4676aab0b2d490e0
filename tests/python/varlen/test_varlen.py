"""Variable-length batches (forward_varlen, backward_varlen): each sequence of a packed batch meets
the accuracy rule against the float64 reference and equals the dense call on that sequence alone;
empty sequences; strided views; validation; wrong tables through the C ABI; the work counters."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _varlen, accuracy, reference
from flash_attention_metal.reference import sequence_view

# The dense forward takes the split-KV path at up to this many query rows (FA_SPLIT_MAX_QUERY_ROWS),
# which merges its chunks in another order than the varlen pass: bit identity is checked above it.
SPLIT_MAX_QUERY_ROWS = 8

# (dtype, num_heads, num_kv_heads, head_dim, head_dim_v, query lengths, key lengths, options):
# lengths 0 and 1, GQA/MQA, head_dim_v != head_dim, each option, every dtype.
CASES = {
    "f16-gqa-causal": (np.float16, 4, 2, 64, 64, [0, 1, 17, 40, 9], [3, 0, 17, 33, 12], dict(causal=True)),
    "bf16-mqa-window-softcap-alibi-bh-sinks": (
        ml_dtypes.bfloat16, 4, 1, 32, 40, [12, 0, 33, 1], [20, 5, 30, 0],
        dict(window_size=(8, 4), softcap=20.0, alibi_per_batch=True, sinks=True)),
    "f32-alibi-h": (np.float32, 2, 2, 40, 40, [25, 3, 0, 16], [25, 7, 9, 16], dict(alibi=True)),
    "f16-causal-sinks-d128": (np.float16, 2, 1, 128, 128, [1, 35, 18], [1, 20, 40], dict(causal=True, sinks=True)),
}


def _table(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(case, seed=0):
    dtype, h, hk, d, dv, lq, lk, opts = case
    rng = np.random.default_rng(seed)
    tq, tk = sum(lq), sum(lk)
    q = rng.standard_normal((tq, h, d)).astype(dtype)
    k = rng.standard_normal((tk, hk, d)).astype(dtype)
    v = rng.standard_normal((tk, hk, dv)).astype(dtype)
    dout = rng.standard_normal((tq, h, dv)).astype(dtype)
    options = dict(causal=opts.get("causal", False), window_size=opts.get("window_size", (-1, -1)),
                   softcap=opts.get("softcap", 0.0))
    if opts.get("alibi"):
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, h).astype(np.float32)
    if opts.get("alibi_per_batch"):
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (len(lq), h)).astype(np.float32)
    if opts.get("sinks"):
        options["sinks"] = rng.uniform(-1, 1, h).astype(np.float32)
    tables = (_table(lq), _table(lk), max(lq), max(lk))
    return (q, k, v, dout), tables, options


def _sequence_options(options, b):
    alibi = options.get("alibi_slopes")
    if alibi is not None and alibi.ndim == 2:
        return dict(options, alibi_slopes=np.ascontiguousarray(alibi[b]))
    return options


def _spans(cu_q, cu_k):
    return [(b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(len(cu_q) - 1)]


def _dkv_splits(ctx, key_rows: int) -> int:
    """The splits of the GQA group in the last backward's dK/dV (GroupSplit.swift; 1: unsplit), from
    its grid: key blocks (32 keys in every bucket of CASES) times the splits."""
    for d in ctx.last_profile.dispatches:
        if "_dkv_split_" in d.kernel:
            return d.threadgroups[0] // -(-key_rows // 32)
    return 1


def _assert_passes(metrics, label):
    assert all(m.passed for m in metrics), f"{label}\n{accuracy.describe(metrics)}"


@pytest.mark.parametrize("name", CASES)
def test_each_sequence_meets_the_rule_and_equals_the_dense_call(ctx, name):
    (q, k, v, dout), tables, options = _inputs(CASES[name])
    out, lse = ctx.forward_varlen(q, k, v, *tables, **options)
    grads = ctx.backward_varlen(dout, q, k, v, out, lse, *tables, **options)
    varlen_splits = _dkv_splits(ctx, tables[3])
    dq, dk, dv = grads[:3]
    sinks = options.get("sinks")
    dsinks_bound, ref_dsinks = 0.0, np.zeros(q.shape[1])
    for b, rows, keys in _spans(tables[0], tables[1]):
        label = f"{name} sequence {b} ({rows.stop - rows.start} rows, {keys.stop - keys.start} keys)"
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            assert not out[rows].astype(np.float32).any(), label
            expected = np.broadcast_to(-np.inf if sinks is None else sinks[:, None], lse[:, rows].shape)
            np.testing.assert_array_equal(lse[:, rows], expected, err_msg=label)
            assert not dq[rows].astype(np.float32).any(), label
            continue
        seq = _sequence_options(options, b)
        sq, sk, sv, sd = (sequence_view(x, span) for x, span in ((q, rows), (k, keys), (v, keys), (dout, rows)))
        so, sl = sequence_view(out, rows), lse[None, :, rows]
        _assert_passes(accuracy.evaluate_forward(sq, sk, sv, so, sl, **seq), label)
        metrics = accuracy.evaluate_backward(sd, sq, sk, sv, sequence_view(dq, rows), sequence_view(dk, keys),
                                             sequence_view(dv, keys), None if sinks is None else grads[3], **seq)
        _assert_passes(metrics[:3], label)
        # The same kernels on the sequence alone: the same bits (backward given the same lse), where
        # both plans cut the dK/dV group alike; other split counts regroup dk's and dv's float32
        # sums, a rounding difference (tests/python/kernels/test_dkv_group_split.py).
        dense = ctx.backward(sd, sq, sk, sv, so, np.ascontiguousarray(sl), **seq)
        same_split = _dkv_splits(ctx, keys.stop - keys.start) == varlen_splits
        for n, (ours, theirs) in enumerate(zip((dq[rows], dk[keys], dv[keys]), dense[:3])):
            theirs = np.swapaxes(theirs[0], 0, 1)
            if n == 0 or same_split:
                np.testing.assert_array_equal(ours, theirs, err_msg=label)
                continue
            a, b = ours.astype(np.float32), theirs.astype(np.float32)
            unit = float(ml_dtypes.finfo(q.dtype).eps) + 16 * float(np.finfo(np.float32).eps)
            assert np.abs(a - b).max() <= unit * np.abs(b).max(), label
        if rows.stop - rows.start > SPLIT_MAX_QUERY_ROWS:
            dense_out, dense_lse = ctx.forward(sq, sk, sv, **seq)
            np.testing.assert_array_equal(out[rows], np.swapaxes(dense_out[0], 0, 1), err_msg=label)
            np.testing.assert_array_equal(lse[:, rows], dense_lse[0], err_msg=label)
        if sinks is not None:
            # dsinks sums the sequences' parts: its error is at most the sum of their bounds.
            dsinks_bound += metrics[3].bound
            ref_dsinks += reference.backward(sd, sq, sk, sv, **seq)[3]
    # Rows of a sequence without queries have no gradient to give; keys without queries get zero.
    for b, rows, keys in _spans(tables[0], tables[1]):
        if rows.stop == rows.start:
            assert not dk[keys].astype(np.float32).any() and not dv[keys].astype(np.float32).any()
    if sinks is not None:
        assert np.max(np.abs(grads[3] - ref_dsinks)) <= dsinks_bound


def test_reference_varlen_is_the_dense_reference_per_sequence():
    (q, k, v, dout), tables, options = _inputs(CASES["bf16-mqa-window-softcap-alibi-bh-sinks"])
    out, lse = reference.forward_varlen(q, k, v, tables[0], tables[1], **options)
    grads = reference.backward_varlen(dout, q, k, v, tables[0], tables[1], **options)
    rows, keys = slice(12, 12), slice(20, 25)  # sequence 1: no queries, 5 keys
    assert not grads[1][keys].any() and not grads[2][keys].any()
    rows, keys = slice(12 + 33, 12 + 34), slice(55, 55)  # sequence 3: one query, no keys
    assert not out[rows].any() and not grads[0][rows].any()
    np.testing.assert_array_equal(lse[:, rows][:, 0], options["sinks"])
    rows, keys = slice(12, 45), slice(25, 55)  # sequence 2
    seq = _sequence_options(options, 2)
    dense_out, dense_lse = reference.forward(sequence_view(q, rows), sequence_view(k, keys), sequence_view(v, keys),
                                             **seq)
    np.testing.assert_array_equal(out[rows], np.swapaxes(dense_out[0], 0, 1))
    np.testing.assert_array_equal(lse[:, rows], dense_lse[0])


def test_strided_views_are_read_in_place_and_give_the_same_bits(ctx):
    (q, _, _, dout), tables, _ = _inputs(CASES["f16-gqa-causal"])
    tables = (tables[0], tables[0], tables[2], tables[2])
    # q, k, v as slices of one fused projection (tokens, 3, heads, dim): strided rows, read in place.
    fused = np.random.default_rng(3).standard_normal((q.shape[0], 3, 4, 64)).astype(np.float16)
    qs, ks, vs = fused[:, 0], fused[:, 1, :2], fused[:, 2, :2]
    strided = ctx.forward_varlen(qs, ks, vs, *tables, causal=True)
    contiguous = ctx.forward_varlen(*(np.ascontiguousarray(x) for x in (qs, ks, vs)), *tables, causal=True)
    for ours, theirs in zip(strided, contiguous):
        np.testing.assert_array_equal(ours, theirs)
    grads = ctx.backward_varlen(dout, qs, ks, vs, *strided, *tables, causal=True)
    expected = ctx.backward_varlen(dout, *(np.ascontiguousarray(x) for x in (qs, ks, vs)), *strided, *tables,
                                   causal=True)
    for ours, theirs in zip(grads, expected):
        np.testing.assert_array_equal(ours, theirs)
    # Head-major memory ((heads, total, dim) transposed): the head stride exceeds the row stride.
    head_major = [np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2) for x in (qs, ks, vs)]
    for ours, theirs in zip(ctx.forward_varlen(*head_major, *tables, causal=True), contiguous):
        np.testing.assert_array_equal(ours, theirs)


BAD_TABLES = {
    "float dtype": (np.array([0.0, 2.0]), TypeError, "cu_seqlens_q must have dtype int32"),
    "2-D": (np.zeros((1, 2), np.int32), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    "one entry": (np.zeros(1, np.int32), ValueError, "batch >= 1"),
    "first not 0": (np.array([1, 4], np.int32), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    "decreasing": (np.array([0, 3, 2, 4], np.int32), ValueError, "must be non-decreasing"),
    "last not total": (np.array([0, 3], np.int32), ValueError, r"cu_seqlens_q\[-1\] \(3\) must equal total_q"),
}


@pytest.mark.parametrize("name", BAD_TABLES)
def test_bad_tables_are_refused_naming_the_argument(name):
    table, error, message = BAD_TABLES[name]
    q = np.zeros((4, 2, 8), np.float16)
    cu_k = np.array([0, 4], np.int32) if table.shape != (4,) else np.array([0, 1, 2, 4], np.int32)
    with pytest.raises(error, match=message):
        fam.forward_varlen(q, q, q, table, cu_k, 4, 4)


def test_other_arguments_are_checked():
    q = np.zeros((4, 2, 8), np.float16)
    cu = np.array([0, 1, 4], np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(2\) must be at least the longest sequence of cu_seqlens_q \(3\)"):
        fam.forward_varlen(q, q, q, cu, cu, 2, 3)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        fam.forward_varlen(q, q, q, cu, cu, 3, 3.0)
    with pytest.raises(ValueError, match="cu_seqlens_q shape .* and cu_seqlens_k shape .* must be equal"):
        fam.forward_varlen(q, q, q, cu, np.array([0, 4], np.int32), 3, 4)
    with pytest.raises(ValueError, match="q must be 3-D|q must have 3 dimensions|3-D"):
        fam.forward_varlen(q[None], q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match=r"alibi_slopes shape \(3, 2\) must be"):
        fam.forward_varlen(q, q, q, cu, cu, 3, 3, alibi_slopes=np.zeros((3, 2), np.float32))
    out, lse = fam.forward_varlen(q, q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match=r"lse shape \(2, 3\) must be \(num_heads, total_q\)"):
        fam.backward_varlen(q, q, q, q, out, lse[:, :3], cu, cu, 3, 3)


def test_all_empty_totals_need_no_call():
    q = np.zeros((0, 2, 8), np.float32)
    k = np.zeros((5, 2, 8), np.float32)
    cu_q, cu_k = np.array([0, 0, 0], np.int32), np.array([0, 2, 5], np.int32)
    out, lse = fam.forward_varlen(q, k, k, cu_q, cu_k, 0, 3)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    dq, dk, dv = fam.backward_varlen(out, q, k, k, out, lse, cu_q, cu_k, 0, 3)
    assert dk.shape == k.shape and not dk.any() and not dv.any()


# Tables the Python layer refuses, sent through the C ABI as they are: the kernels clamp every
# value into the tensors, so the call returns (wrong numbers where the table is wrong) and never
# reads or writes out of bounds (the CUDA check build runs such a table under memcheck).
WRONG = {
    "past the end": ([0, 5, 900], [0, 7, 4000]),
    "negative and decreasing": ([0, -50, 3], [9, 2, -1]),
    "int32 extremes": ([-(2**31), 2**31 - 1, 0], [2**31 - 1, -(2**31), 2**31 - 1]),
}


@pytest.mark.parametrize("name", WRONG)
def test_wrong_tables_through_the_abi_stay_in_bounds(ctx, name):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((20, 2, 32)).astype(np.float16)
    k = rng.standard_normal((24, 1, 32)).astype(np.float16)
    cu_q, cu_k = (np.array(t, np.int32) for t in WRONG[name])
    good = _varlen.check_varlen(q, k, k, np.array([0, 5, 20], np.int32), np.array([0, 7, 24], np.int32), 20, 24,
                                True, None)
    # The checked call with the wrong tables swapped in (what a C caller can send).
    bad = _varlen.Varlen(good.shape, cu_q, cu_k, 20, 24, True, good.scale, good.options)
    out, lse = _varlen.forward(ctx, q, k, k, bad)
    grads = _varlen.backward(ctx, out, q, k, k, out, np.where(np.isnan(lse), -np.inf, lse), bad)
    assert out.shape == q.shape and all(g.shape == x.shape for g, x in zip(grads, (q, k, k)))


def test_threadgroups_past_a_sequence_do_no_work(ctx):
    # 8 sequences of 17 ... 1000 tokens (4096 in all), causal, head_dim 64: the varlen pass's matrix
    # products are the sum of the dense call's over the sequences alone (issue 22 allows 1.15x).
    lengths = [17, 100, 250, 400, 529, 800, 1000, 1000]
    assert sum(lengths) == 4096
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4096, 1, 64)).astype(np.float16)
    table = _table(lengths)
    ctx.forward_varlen(q, q, q, table, table, 1000, 1000, causal=True)
    varlen = sum(d.simdgroup_multiply_accumulates for d in ctx.last_profile.dispatches)
    dense = 0
    for b, rows, _ in _spans(table, table):
        view = sequence_view(q, rows)
        ctx.forward(view, view, view, causal=True)
        dense += sum(d.simdgroup_multiply_accumulates for d in ctx.last_profile.dispatches)
    print(f"varlen MMAs {varlen}, dense per sequence {dense}, ratio {varlen / dense:.4f}")
    assert varlen <= 1.15 * dense
