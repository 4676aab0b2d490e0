"""Shared fixtures of the Python tests: the context under test and input makers.

The context is the default one, so ``FLASH_ATTENTION_METAL_BACKEND`` picks the backend (auto: Metal
on an Apple GPU, else the CPU engine running the .metal kernels). The library must be built
(./build.sh); these tests fail rather than skip without it.
"""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy


@pytest.fixture(scope="session")
def ctx() -> fam.Context:
    return fam.default_context()


def make_inputs(seed: int, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int):
    """float16 N(0, 1) q, k, v, dout of the given attention shape."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(np.float16)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(np.float16)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    return q, k, v, dout


def assert_within_rule(metrics: list[accuracy.Metric], label: str) -> None:
    """Fails with every metric's numbers when any is outside the accuracy rule."""
    assert all(m.passed for m in metrics), f"{label}\n{accuracy.describe(metrics)}"


def causal_parts(ctx, q, k, v, split: int, causal: bool):
    """(out, lse) of attention over keys [0, split) and over keys [split, seqlen_k), each with the
    restriction of the full mask, computed by the library.

    Non-causal: both parts are plain forwards. Causal (bottom-right, query i sees key j iff
    j <= i + Nk - Nq): the second part is causal over its Nk - split keys (the same offset). In the
    first part row i sees key j < split iff j <= i + Nk - Nq, i.e. the rows i < Nq - Nk + split
    see a bottom-right causal staircase over the split keys with Nq - Nk + split queries, and the
    later rows see every key of the part.
    """
    k_a, v_a, k_b, v_b = k[:, :, :split], v[:, :, :split], k[:, :, split:], v[:, :, split:]
    part_b = ctx.forward(q, k_b, v_b, causal=causal)
    if not causal:
        return ctx.forward(q, k_a, v_a), part_b
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    staircase = min(max(seqlen_q - seqlen_k + split, 0), seqlen_q)
    outs, lses = [], []
    if staircase > 0:
        out, lse = ctx.forward(q[:, :, :staircase], k_a, v_a, causal=True)
        outs.append(out)
        lses.append(lse)
    if staircase < seqlen_q:
        out, lse = ctx.forward(q[:, :, staircase:], k_a, v_a)
        outs.append(out)
        lses.append(lse)
    return (np.concatenate(outs, axis=2), np.concatenate(lses, axis=2)), part_b
