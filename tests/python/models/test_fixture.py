"""The library on real attention inputs: the all-MiniLM-L6-v2 fixture shipped in the package.

The fixture (python/flash_attention_metal/data/minilm_attention.npz, made by
examples/make_minilm_fixture.py) holds q, k, v captured from the model's layers and a seeded
output gradient. No model package is needed here. The format tests always run; the accuracy tests
skip only when libFlashAttentionMetal has not been built.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fa
from flash_attention_metal import accuracy

FIXTURE = Path(fa.__file__).resolve().parent / "data" / "minilm_attention.npz"


def _load() -> dict:
    with np.load(FIXTURE) as data:
        return {key: data[key] for key in data.files}


ARRAYS = _load()
CASES = [str(name) for name in ARRAYS["cases"]]


def _case(name: str):
    return tuple(ARRAYS[f"{name}_{part}"] for part in ("q", "k", "v", "dout"))


def test_fixture_is_small_and_lists_its_cases():
    assert FIXTURE.stat().st_size <= 1_200_000
    assert len(CASES) >= 4
    assert len({int(name.split("_len")[1]) for name in CASES}) >= 4, "several sequence lengths"
    assert "dout_note" in ARRAYS and "seeded" in str(ARRAYS["dout_note"])


@pytest.mark.parametrize("name", CASES)
def test_case_arrays_are_real_float16_attention_inputs(name):
    q, k, v, dout = _case(name)
    tokens = int(name.split("_len")[1])
    for array in (q, k, v, dout):
        assert array.dtype == np.float16
        assert array.shape == (1, 12, tokens, 32)
        assert np.isfinite(array).all()
    # Real activations, not placeholders: distinct heads and a non-trivial spread of values.
    assert not np.array_equal(q[0, 0], q[0, 1])
    assert float(np.abs(k).max()) > 1.0


@pytest.mark.parametrize("name", CASES)
def test_dout_follows_the_documented_recipe(name):
    q, _, _, dout = _case(name)
    expected = np.random.default_rng(zlib.crc32(name.encode())).standard_normal(q.shape).astype(np.float16)
    np.testing.assert_array_equal(dout, expected)


def _assert_passes(metrics, label):
    failed = [m for m in metrics if not m.passed]
    assert not failed, f"{label}\n{accuracy.describe(metrics)}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", CASES)
def test_forward_meets_the_accuracy_rule(context, name, causal):
    q, k, v, _ = _case(name)
    out, lse = context.forward(q, k, v, causal=causal)
    assert out.dtype == np.float16 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:3]
    _assert_passes(accuracy.evaluate_forward(q, k, v, out, lse, causal=causal), f"{name} causal={causal}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", CASES)
def test_backward_meets_the_accuracy_rule(context, name, causal):
    q, k, v, dout = _case(name)
    out, lse = context.forward(q, k, v, causal=causal)
    dq, dk, dv = context.backward(dout, q, k, v, out, lse, causal=causal)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.dtype == np.float16 and grad.shape == like.shape
    _assert_passes(accuracy.evaluate_backward(dout, q, k, v, dq, dk, dv, causal=causal),
                   f"{name} causal={causal}")


def test_causal_differs_from_full_attention_on_real_input(context):
    # Guards against a causal flag that is silently ignored on these shapes.
    name = max(CASES, key=lambda n: int(n.split("_len")[1]))
    q, k, v, _ = _case(name)
    full, _ = context.forward(q, k, v, causal=False)
    causal, _ = context.forward(q, k, v, causal=True)
    # The last query sees every key either way; the first sees only key 0, so its output is v[0].
    np.testing.assert_allclose(full[:, :, -1].astype(np.float32), causal[:, :, -1].astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(causal[:, :, 0].astype(np.float32), v[:, :, 0].astype(np.float32), atol=2e-3)
    assert np.abs(full[:, :, 0].astype(np.float32) - causal[:, :, 0].astype(np.float32)).max() > 1e-2
