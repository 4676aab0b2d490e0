"""The split-KV forward (decode: seqlen_q <= 8 over long KV caches) against the float64 reference
under the accuracy rule. Which shapes take it is pinned by the Swift DispatchPlan tests; these run
such shapes on the CPU engine."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flash_attention_metal import accuracy

from conftest import assert_within_rule, make_inputs

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal): one query (every key visible) and
# a staircase of up to 8, GQA, MQA and MHA, every head-dim bucket, GQA groups of 16 x 8 rows that
# need several packed row blocks (the tiled split kernel), seqlen_k not a multiple of the chunk.
DECODE = [
    (1, 4, 1, 1, 600, 64, False),
    (1, 4, 2, 8, 1000, 128, True),
    (2, 6, 3, 3, 513, 40, True),
    (1, 2, 2, 8, 700, 256, True),
    (1, 9, 3, 1, 2048, 64, True),
    (1, 8, 1, 8, 777, 192, True),
    (1, 3, 3, 5, 512, 1, True),
    (1, 16, 1, 8, 1100, 96, True),
]


def _chunk_kernel(q, k) -> str:
    """The kernel that writes the chunks (KeyValueSplit.swift): decode where one of its blocks holds
    a KV head's packed rows, heads / kv_heads x seqlen_q (8 up to head_dim 128, 4 up to 256), else
    the spec kernel where one of its blocks holds them (up to head_dim 256: 16 rows, float32's 8
    above head_dim 128), else the tiled split kernel."""
    _, heads, seqlen_q, head_dim = q.shape
    block = 8 if head_dim <= 128 else 4 if head_dim <= 256 else 0
    packed = heads // k.shape[1] * seqlen_q
    if packed <= block:
        return "decode"
    spec = 8 if q.dtype == np.float32 and head_dim > 128 else 16
    return "spec" if head_dim <= 256 and packed <= spec else "split"


def _split_forward(ctx, q, k, v, **options):
    """ctx.forward, asserting from its profile that the split-KV path ran: the decode, spec or tiled
    split kernel over key chunks, then their combine, and no dense forward."""
    out, lse = ctx.forward(q, k, v, **options)
    kernels = [dispatch.kernel for dispatch in ctx.last_profile.dispatches]
    split = _chunk_kernel(q, k)
    assert kernels and kernels[0].startswith(f"flash_attention_forward_{split}_"), kernels
    assert any(name.startswith("flash_attention_forward_combine_") for name in kernels), kernels
    assert not any(re.fullmatch(r"flash_attention_forward_(f16|bf16|f32)_d\d+", name) for name in kernels), kernels
    return out, lse


def _label(case):
    b, h, hk, nq, nk, d, causal = case
    return f"B{b}-H{h}-Hkv{hk}-Nq{nq}-Nk{nk}-D{d}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", DECODE, ids=_label)
def test_decode_within_rule_and_deterministic(ctx, case):
    b, h, hk, nq, nk, d, causal = case
    q, k, v, _ = make_inputs(sum(case[:6]), b, h, hk, nq, nk, d)
    out, lse = _split_forward(ctx, q, k, v, causal=causal)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), _label(case))
    again, again_lse = _split_forward(ctx, q, k, v, causal=causal)
    np.testing.assert_array_equal(out.view(np.uint16), again.view(np.uint16))
    np.testing.assert_array_equal(lse.view(np.uint32), again_lse.view(np.uint32))


def test_chunk_that_some_rows_do_not_see(ctx):
    # 4 x 9 (batch x KV heads) threadgroups per chunk give 9 chunks of 288 keys for 2305 keys: the
    # last chunk holds key 2304 alone, which causal rows 0-6 of 8 do not see (their partial lse is
    # -inf and must weigh nothing in the combine).
    q, k, v, _ = make_inputs(31, 4, 9, 9, 8, 2305, 32)
    out, lse = _split_forward(ctx, q, k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), "empty last chunk")


def test_decode_on_large_scores(ctx):
    # Scores near 144, whose exp overflows float32: the combine must weigh chunks by
    # exp(lse_c - max_c lse_c), not exp(lse_c).
    q, k, v, _ = make_inputs(32, 1, 4, 1, 2, 1500, 16)
    q = (q.astype(np.float32) + 6).astype(np.float16)
    k = (k.astype(np.float32) + 6).astype(np.float16)
    out, lse = _split_forward(ctx, q, k, v)
    assert np.min(lse) > 100
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse), "large scores")


@pytest.mark.parametrize("window_size", [(256, 0), (40, -1), (300, 3)], ids=str)
def test_decode_with_a_window_that_starts_inside_a_key_tile(ctx, window_size):
    # 4 rows over 600 keys split into chunks; the window's first key is not on a key tile, so a
    # chunk's tiles must start at the chunk's own tile grid or its last tile reads the next
    # chunk's keys as well (those keys then count twice in the combine).
    q, k, v, _ = make_inputs(33, 2, 8, 2, 4, 600, 64)
    out, lse = _split_forward(ctx, q, k, v, causal=True, window_size=window_size)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True, window_size=window_size),
                       f"window {window_size}")
