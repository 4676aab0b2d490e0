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


class _Spy:
    """Stands in for the loaded library and records any compute call."""

    def __init__(self, real):
        self._real = real
        self.calls = []

    def __getattr__(self, name):
        attribute = getattr(self._real, name)
        if name in ("fa_forward", "fa_backward"):
            def record(*args):
                self.calls.append(name)
                return attribute(*args)
            return record
        return attribute


@pytest.fixture()
def guarded(monkeypatch):
    """A Context whose native compute calls are recorded; the test fails if any happens."""
    context = fam.Context(fam.default_backend())
    spy = _Spy(context._native.lib)
    native = type(context._native)(context._native.ffi, spy, context._native.path, context._native.header_path)
    monkeypatch.setattr(context, "_native", native)
    yield context
    assert spy.calls == [], "a native call ran despite invalid arguments"


def make_inputs(seed: int, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                *, head_dim_v: int | None = None, dtype=np.float16, layout: str = "bhsd"):
    """N(0, 1) q, k, v, dout of the given attention shape in ``dtype`` and ``layout``; v and dout
    have head_dim_v (default head_dim) last. The same seed gives the same values in both layouts."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rng = np.random.default_rng(seed)
    shapes = [(batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
              (batch, kv_heads, seqlen_k, head_dim_v), (batch, heads, seqlen_q, head_dim_v)]
    arrays = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    if layout == "bshd":
        arrays = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in arrays]
    return tuple(arrays)


def to_bhsd(array: np.ndarray, layout: str) -> np.ndarray:
    """The (B, H, N, D) view of an array in ``layout``, as the reference takes it."""
    return array if layout == "bhsd" else array.transpose(0, 2, 1, 3)


def assert_within_rule(metrics: list[accuracy.Metric], label: str) -> None:
    """Fails with every metric's numbers when any is outside the accuracy rule."""
    assert all(m.passed for m in metrics), f"{label}\n{accuracy.describe(metrics)}"
