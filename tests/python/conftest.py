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
