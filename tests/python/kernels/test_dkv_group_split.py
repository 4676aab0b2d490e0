"""The backward's dK/dV over few KV heads (GroupSplit.swift): the plan cuts each KV head's GQA group
over several threadgroups (flash_attention_backward_dkv_split, then backward_dkv_reduce adds the
float32 partial sums in split order) exactly where that raises the modelled occupancy of the GPU's
threadgroup slots. Checked on the CPU engine, planning for other GPUs with FLASH_ATTENTION_GPU_CORES:
the split taken as the rule says, gradients within the accuracy rule for KV heads 1 and 2 on every
dtype with causal, window, varlen and dropout, bit-identical reruns, what changing the split
count may change (the grouping of the float32 sums only), and the workspace's bound on a huge
problem (planned, not run)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_attention_metal import accuracy, dropout

from conftest import assert_within_rule, make_inputs

CORES_VARIABLE = "FLASH_ATTENTION_GPU_CORES"
# Shaders/flash_attention_params.h
CORE_THREADGROUP_BYTES = 61440
MIN_OCCUPANCY = 90
MAX_WORKSPACE_BYTES = 64 << 20
# dK/dV threadgroups per core at head_dim 64 (the occupancy table there), keys per block (32).
DKV_RESIDENT_D64 = {"f16": 3, "bf16": 3, "f32": 2}
DKV_BLOCK_K_D64 = 32


def expected_splits(threadgroups: int, group: int, cores: int, resident: int, max_splits: int = 1 << 32) -> int:
    """The plan's rule (GroupSplit.splits), restated: the unsplit grid unless its slots are busy less
    than MIN_OCCUPANCY percent of its waves, else the smallest divisor of the group that reaches it,
    else the divisor with the highest occupancy (the smallest of equals) of at most 10 waves; never
    more than max_splits (the workspace bound)."""
    slots = cores * resident

    def occupancy(s):
        n = threadgroups * s
        return n / (-(-n // slots) * slots)

    if group == 1 or max_splits < 2 or occupancy(1) * 100 >= MIN_OCCUPANCY:
        return 1
    best = 1
    for s in range(2, min(group, max_splits, -(-10 * slots // threadgroups)) + 1):
        if group % s:
            continue
        if occupancy(s) * 100 >= MIN_OCCUPANCY:
            return s
        if occupancy(s) > occupancy(best):
            best = s
    return best


def dkv_dispatches(ctx) -> dict[str, tuple[int, int, int]]:
    """{kernel family: grid} of the last backward's dK/dV dispatches (dkv, dkv_split, dkv_reduce)."""
    found = {}
    for d in ctx.last_profile.dispatches:
        for family in ("backward_dkv_split", "backward_dkv_reduce", "backward_dkv"):
            if f"flash_attention_{family}_" in d.kernel:
                found[family] = (d.threadgroups, d.threadgroup_memory)
                break
    return found


def backward(ctx, monkeypatch, cores, q, k, v, dout, forward=None, **options):
    """The gradients planned for `cores` GPU cores, and the dK/dV dispatches; the forward's out and
    lse (`forward`, else computed for the same cores: its split-KV chunking follows them too)."""
    monkeypatch.setenv(CORES_VARIABLE, str(cores))
    out, lse = forward if forward is not None else ctx.forward(q, k, v, **options)
    grads = ctx.backward(dout, q, k, v, out, lse, **options)
    return grads, dkv_dispatches(ctx)


@pytest.mark.parametrize("kv_heads,cores", [(1, 1), (1, 4), (1, 10), (2, 2), (2, 40), (8, 10), (8, 40)])
def test_split_taken_where_the_rule_says(ctx, monkeypatch, kv_heads, cores):
    """8 query heads, 160 keys of head_dim 64 (5 key blocks): the split dispatch's grid is the key
    blocks x the rule's splits, followed by the reduce; without a split the unsplit kernel alone."""
    q, k, v, dout = make_inputs(3, 1, 8, kv_heads, 16, 160, 64)
    _, found = backward(ctx, monkeypatch, cores, q, k, v, dout)
    kernel = "backward_dkv_split" if "backward_dkv_split" in found else "backward_dkv"
    grid, memory = found[kernel]
    splits = expected_splits(5 * kv_heads, 8 // kv_heads, cores, CORE_THREADGROUP_BYTES // memory)
    if splits == 1:
        assert set(found) == {"backward_dkv"}
        assert grid == (5, kv_heads, 1)
    else:
        assert set(found) == {"backward_dkv_split", "backward_dkv_reduce"}
        assert grid == (5 * splits, kv_heads, 1)
        assert found["backward_dkv_reduce"][0] == (-(-160 // 16), kv_heads, 1)


def test_the_rule_splits_few_kv_heads_only():
    """The documented shape (B 1, H 32, 4K tokens, head_dim 128, 2 threadgroups per core): 1 KV
    head splits 4 ways on 40 cores, 2 KV heads 2 ways; 8 KV heads and 10 cores keep the unsplit grid."""
    blocks = 4096 // 32
    assert [expected_splits(blocks * kv, 32 // kv, 10, 2) for kv in (1, 2, 8)] == [1, 1, 1]
    assert [expected_splits(blocks * kv, 32 // kv, 40, 2) for kv in (1, 2, 8)] == [4, 2, 1]


DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32}
# (kv_heads, heads, seqlen_q, seqlen_k, head_dim, options): KV heads 1 and 2, H up to 8.
CASES = {
    "mqa-causal": (1, 8, 40, 72, 64, dict(causal=True)),
    "gqa2-window": (2, 8, 33, 65, 32, dict(window_size=(12, 5))),
    "mqa-h4-plain-d96": (1, 4, 24, 50, 96, {}),
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_gradients_within_the_rule(ctx, monkeypatch, case, dtype):
    kv_heads, heads, seqlen_q, seqlen_k, head_dim, options = CASES[case]
    q, k, v, dout = make_inputs(11, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype=DTYPES[dtype])
    grads, found = backward(ctx, monkeypatch, 40, q, k, v, dout, **options)
    assert "backward_dkv_split" in found
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, **options), f"{case} {dtype}")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_split_with_dropout_within_the_rule(ctx, monkeypatch, kv_heads):
    batch, heads, seqlen_q, seqlen_k = 2, 4, 30, 45
    q, k, v, dout = make_inputs(5, batch, heads, kv_heads, seqlen_q, seqlen_k, 64)
    drop = (0.25, 77, 3)
    call = dict(causal=True, dropout_p=drop[0], dropout_seed=drop[1], dropout_offset=drop[2])
    grads, found = backward(ctx, monkeypatch, 40, q, k, v, dout, **call)
    assert "backward_dkv_split" in found
    mask = dropout.reference_mask(drop, batch, heads, seqlen_q, seqlen_k)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, dropout_mask=mask, causal=True),
                       f"dropout, {kv_heads} KV heads")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_split_varlen_each_sequence_within_the_rule(ctx, monkeypatch, kv_heads):
    """Packed sequences (one empty): each sequence's dk and dv meet the rule against its own
    reference, and the split's partial rows of one sequence never reach another's."""
    heads, head_dim = 4, 32
    lengths_q, lengths_k = [9, 0, 26, 14], [20, 7, 33, 14]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    rng = np.random.default_rng(2)
    q = rng.standard_normal((cu_q[-1], heads, head_dim)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    monkeypatch.setenv(CORES_VARIABLE, "40")
    tables = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    out, lse = ctx.forward_varlen(q, k, v, *tables, causal=True)
    dq, dk, dv = ctx.backward_varlen(dout, q, k, v, out, lse, *tables, causal=True)
    assert "backward_dkv_split" in dkv_dispatches(ctx)
    for b in range(len(lengths_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            assert not dk[sk].any() and not dv[sk].any()
            continue
        view = [np.ascontiguousarray(x.transpose(1, 0, 2)[None]) for x in (dout[sq], q[sq], k[sk], v[sk])]
        metrics = accuracy.evaluate_backward(*view, *(np.ascontiguousarray(x.transpose(1, 0, 2)[None])
                                                      for x in (dq[sq], dk[sk], dv[sk])), causal=True)
        assert_within_rule(metrics, f"sequence {b}")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_reruns_bit_identical_and_split_counts_differ_in_rounding_only(ctx, monkeypatch, dtype):
    """What the design guarantees: a plan (shape and core count) gives the same bits on every run;
    dq does not depend on the split; two core counts with the same split give the same bits; and
    other split counts add the same float32 products in other groupings, so dk and dv move by
    rounding only (within a unit of the dtype at the tensor's scale, and within the rule)."""
    q, k, v, dout = make_inputs(8, 1, 8, 1, 24, 288, 64, dtype=DTYPES[dtype])
    blocks = -(-288 // DKV_BLOCK_K_D64)
    forward = ctx.forward(q, k, v, causal=True)
    runs = {}
    for cores in range(1, 13):
        s = expected_splits(blocks, 8, cores, DKV_RESIDENT_D64[dtype])
        if s in runs and len(runs[s]) == 2:
            continue
        grads, found = backward(ctx, monkeypatch, cores, q, k, v, dout, forward, causal=True)
        kernel = "backward_dkv_split" if s > 1 else "backward_dkv"
        assert found[kernel][0][0] == blocks * s, (cores, s)
        runs.setdefault(s, []).append((cores, grads))
    assert {1, 8} <= set(runs) and len(runs) >= 3, sorted(runs)
    first = runs[1][0][1]
    for s, results in runs.items():
        for _, grads in results:
            assert np.array_equal(grads[0], first[0])
        if len(results) == 2:
            assert all(np.array_equal(a, b) for a, b in zip(results[0][1], results[1][1])), s
        again, _ = backward(ctx, monkeypatch, results[0][0], q, k, v, dout, forward, causal=True)
        assert all(np.array_equal(a, b) for a, b in zip(results[0][1], again)), s
        # Regrouped float32 sums differ by a few float32 units at the tensor's scale; the rounding
        # to the dtype then moves an element by at most one of its units (measured: 0.3 of a
        # float16 unit, 6 float32 units at the largest element).
        for name, a, b in zip(("dk", "dv"), results[0][1][1:], first[1:]):
            a, b = a.astype(np.float32), b.astype(np.float32)
            scale = np.abs(b).max() * (float(ml_dtypes.finfo(DTYPES[dtype]).eps) + 16 * float(np.finfo(np.float32).eps))
            assert np.abs(a - b).max() <= scale, (name, s)
        assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *results[0][1], causal=True), f"splits {s}")


@pytest.mark.parametrize("kv_heads,seqlen,uncapped,capped", [(1, 4096, 32, 16), (2, 4096, 16, 8), (1, 131072, 2, 1)])
def test_huge_problem_gets_a_bounded_workspace(monkeypatch, kv_heads, seqlen, uncapped, capped):
    """B 1, H 32, head_dim 128 (float16: 2 dK/dV threadgroups per core, key blocks of 32) planned for
    4096 GPU cores: the occupancy rule alone would split 1 KV head over 4K tokens 32 ways (128 MiB
    of float32 workspace: 4 MiB per split) and 2 KV heads 16 ways (128 MiB); the plan takes the
    most splits within MAX_WORKSPACE_BYTES (FA_DKV_SPLIT_MAX_WORKSPACE_BYTES), 16 and 8 (64 MiB),
    and none at 128K tokens, where one split's workspace alone (128 MiB) is over it. Planned only."""
    from flash_attention_metal import _abi, _native, plan
    from flash_attention_metal._validation import Shape
    library = _native.native()
    problem = _abi.new_problem(library.ffi, library.lib, Shape(1, 32, kv_heads, seqlen, seqlen, 128), True, 0.125,
                               "float16", {})
    monkeypatch.setenv(CORES_VARIABLE, "4096")
    made = plan.create(problem, "backward")
    blocks, per_split = seqlen // 32 * kv_heads, kv_heads * seqlen * 2 * 128 * 4
    assert expected_splits(blocks, 32 // kv_heads, 4096, 2) == uncapped
    assert expected_splits(blocks, 32 // kv_heads, 4096, 2, MAX_WORKSPACE_BYTES // per_split) == capped
    names = [d.kernel_name for d in made.dispatches]
    if capped == 1:
        assert "flash_attention_backward_dkv_f16_d128" in names
        assert not any("partial_d" in b.role for b in made.buffers)
        return
    split = next(d for d in made.dispatches if d.kernel_name == "flash_attention_backward_dkv_split_f16_d128")
    assert split.threadgroups_per_grid == (seqlen // 32 * capped, kv_heads, 1)
    workspace = made.buffer("partial_dk").byte_count + made.buffer("partial_dv").byte_count
    assert workspace == capped * per_split <= MAX_WORKSPACE_BYTES
