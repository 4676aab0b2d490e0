"""The library on real decode-time inputs: the SmolLM2-135M-Instruct fixture shipped in the package.

The fixture (python/flash_attention_metal/data/smollm2_attention.npz, made by
examples/make_smollm2_fixture.py) holds q, k, v of causal GQA prefills and of single-query decode
steps against the float16 KV cache (one of them over 591 keys, the split-KV path), with the float64
reference's out and lse. No model package is
needed here; the library tests skip only when libFlashAttentionMetal has not been built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fa
from flash_attention_metal import accuracy, reference

from conftest import assert_within_rule, causal_parts

FIXTURE = Path(fa.__file__).resolve().parent / "data" / "smollm2_attention.npz"

with np.load(FIXTURE) as _data:
    ARRAYS = {key: _data[key] for key in _data.files}
CASES = [str(name) for name in ARRAYS["cases"]]
DECODE = [name for name in CASES if "decode_" in name]
PROMPT_TOKENS = int(next(name for name in CASES if name.startswith("prefill_")).split("_len")[1])


def _qkv(name: str):
    return tuple(ARRAYS[f"{name}_{part}"] for part in ("q", "k", "v"))


def test_fixture_is_small_and_covers_prefill_and_decode():
    assert FIXTURE.stat().st_size < 2_000_000
    assert sum(name.startswith("prefill_") for name in CASES) >= 3
    assert len(DECODE) >= 6
    assert any(name.startswith("long_decode_") for name in CASES)
    assert "SmolLM2-135M-Instruct" in str(ARRAYS["source_note"])
    assert ARRAYS["tokens"].size > PROMPT_TOKENS


@pytest.mark.parametrize("name", CASES)
def test_case_arrays_are_real_gqa_attention_inputs(name):
    q, k, v = _qkv(name)
    for array in (q, k, v):
        assert array.dtype == np.float16 and np.isfinite(array).all()
    assert q.shape[:2] == (1, 9) and k.shape[:2] == (1, 3) and q.shape[3] == k.shape[3] == 64
    assert v.shape == k.shape
    if name.startswith("long_decode_"):
        assert q.shape[2] == 1 and k.shape[2] == int(name.split("_keys")[1]) > 512
    elif name.startswith("decode_"):
        step = int(name.split("_step")[1])
        assert q.shape[2] == 1 and k.shape[2] == PROMPT_TOKENS + step + 1
    else:
        assert q.shape[2] == k.shape[2] == PROMPT_TOKENS
    # Real activations: distinct heads and the large components of trained queries and keys.
    assert not np.array_equal(q[0, 0], q[0, 1])
    assert float(np.abs(k).max()) > 4.0


def _causal_attention_float64(q, k, v):
    """Bottom-right causal GQA attention in float64, written here apart from reference.py: each
    query head's key head by integer division, scale 1/sqrt(head_dim), the mask as a triangle of
    -inf shifted by seqlen_k - seqlen_q, softmax through its logsumexp."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    k, v = k[:, np.arange(q.shape[1]) // group], v[:, np.arange(q.shape[1]) // group]
    logits = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[3])
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    hidden = np.arange(seqlen_k)[None, :] > np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    logits = np.where(hidden, -np.inf, logits)
    top = logits.max(axis=-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return np.einsum("bhij,bhjd->bhid", np.exp(logits - lse[..., None]), v), lse


@pytest.mark.parametrize("name", CASES)
def test_stored_reference_is_the_reference(name):
    q, k, v = _qkv(name)
    out, lse = reference.forward(q, k, v, causal=True)
    np.testing.assert_allclose(ARRAYS[f"{name}_ref_out"], out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ARRAYS[f"{name}_ref_lse"], lse, rtol=1e-6)
    # And recomputed without reference.py, so that a fault of the reference shared by the fixture's
    # maker and the tests cannot hide.
    out, lse = _causal_attention_float64(q, k, v)
    np.testing.assert_allclose(ARRAYS[f"{name}_ref_out"], out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ARRAYS[f"{name}_ref_lse"], lse, rtol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_forward_meets_the_accuracy_rule(context, name):
    q, k, v = _qkv(name)
    out, lse = context.forward(q, k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), name)
    if name.startswith("long_decode_"):
        kernels = [d.kernel for d in context.last_profile.dispatches]
        assert kernels == ["flash_attention_forward_decode_f16_d64", "flash_attention_forward_combine_f16"], kernels


@pytest.mark.parametrize("name", DECODE)
def test_decode_query_sees_the_whole_cache(context, name):
    # seqlen_q = 1 with a bottom-right causal mask is attention over every cached key.
    q, k, v = _qkv(name)
    causal = context.forward(q, k, v, causal=True)
    full = context.forward(q, k, v)
    np.testing.assert_array_equal(causal[0], full[0])
    np.testing.assert_array_equal(causal[1], full[1])


class _Base:
    """The float16 framework baseline as a ``causal_parts`` context."""

    @staticmethod
    def forward(q, k, v, causal=False):
        return accuracy.base_forward(q, k, v, causal=causal)


@pytest.mark.parametrize("name", CASES)
def test_merge_of_a_split_cache_meets_the_accuracy_rule(context, name):
    # The merged out carries the float16 rounding of each part's out: where the parts' outputs
    # cancel, that exceeds the rounding of the unsplit result (decode_layer0_step0 split at 20 of
    # 41 keys: 1.7x the unsplit problem's bound). So the merge is judged against a float16
    # framework doing the same split: base_forward on each part, merged in float32.
    q, k, v = _qkv(name)
    for split in (1, k.shape[2] // 2, k.shape[2] - 1):
        part_a, part_b = causal_parts(context, q, k, v, split, causal=True)
        out, lse = context.merge_attention(*part_a, *part_b)
        base_a, base_b = causal_parts(_Base, q, k, v, split, causal=True)
        base_out, _ = accuracy.base_merge_attention(*base_a, *base_b)
        assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True, base_out=base_out),
                           f"{name} split {split}")


PREFILL = [name for name in CASES if name.startswith("prefill_")]


@pytest.mark.parametrize("name", PREFILL)
def test_left_padded_batch_with_a_float32_minimum_mask_has_exact_gradients(context, name):
    # A batch as Hugging Face pads it for a causal LM: the prompt, and the prompt again with its
    # first 13 tokens as left padding; the 4-D additive mask holds float32's minimum where a query
    # may not look (padding and the future). The second entry's first 13 query rows see no real
    # key: every key of those rows gets the minimum, a row float32 lse cannot carry into the backward.
    q, k, v = _qkv(name)
    n, pad = q.shape[2], 13
    q2, k2, v2 = (np.concatenate([a, a], axis=0) for a in (q, k, v))
    allowed = np.tril(np.ones((n, n), bool))[None].repeat(2, axis=0)
    allowed[1, :, :pad] = False
    mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    dout = np.random.default_rng(7).standard_normal(q2.shape).astype(q2.dtype)
    out, lse = context.forward(q2, k2, v2, attn_mask=mask)
    assert_within_rule(accuracy.evaluate_forward(q2, k2, v2, out, lse, attn_mask=mask), f"{name} forward")
    grads = context.backward(dout, q2, k2, v2, out, lse, attn_mask=mask)
    assert_within_rule(accuracy.evaluate_backward(dout, q2, k2, v2, *grads, attn_mask=mask), f"{name} backward")
