"""flash_attn_varlen_func with a block_table (paged K/V for packed sequences, vLLM's layout), forward
only as in FlashAttention: NumPy and PyTorch on the CPU engine against the float64 varlen reference
on the gathered keys under the accuracy rule, and against the contiguous varlen call; SmolLM2
fixture rows as well as random ones; the checks of the tables."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy, reference

from conftest import assert_within_rule

BF16 = np.dtype(ml_dtypes.bfloat16)
FIXTURE = Path(fam.__file__).resolve().parent / "data" / "smollm2_attention.npz"


def _page(rng, k, v, cu_k, page, spare=3):
    """Packed k, v moved into shuffled pages: (k_cache, v_cache, block_table)."""
    lengths = np.diff(cu_k)
    max_blocks = max(1, -(-int(lengths.max()) // page))
    blocks = len(lengths) * max_blocks + spare
    table = rng.permutation(blocks)[:len(lengths) * max_blocks].reshape(len(lengths), max_blocks).astype(np.int32)
    caches = [rng.standard_normal((blocks, page) + x.shape[1:]).astype(x.dtype) for x in (k, v)]
    for b, n in enumerate(lengths):
        t = np.arange(n)
        for cache, x in zip(caches, (k, v)):
            cache[table[b, t // page], t % page] = x[cu_k[b]:cu_k[b] + n]
    return caches[0], caches[1], table


def _judge(q, k, v, cu_q, cu_k, out, lse, label, **options):
    """Per sequence: the dense rule on its rows and keys (out 0 and lse -inf without keys)."""
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        slopes = options.get("alibi_slopes")
        per = dict(options, alibi_slopes=slopes if slopes is None or slopes.ndim == 1 else slopes[b])
        qb, kb, vb = (reference.sequence_view(x, s) for x, s in ((q, rows), (k, keys), (v, keys)))
        if keys.stop == keys.start:
            assert not out[rows].any() and np.isneginf(lse[:, rows]).all(), f"{label} sequence {b} without keys"
            continue
        metrics = accuracy.evaluate_forward(qb, kb, vb, reference.sequence_view(out, rows),
                                            lse[None, :, rows], **per)
        assert_within_rule(metrics, f"{label} sequence {b}")


# (label, dtype, query lengths, key lengths, heads, kv_heads, head_dim, page, options)
CASES = [
    ("f16 causal GQA", np.float16, [5, 0, 17, 1], [9, 4, 17, 30], 4, 2, 64, 16, dict(causal=True)),
    ("bf16 window", BF16, [8, 8, 3], [8, 20, 0], 2, 2, 32, 8, dict(causal=True, window_size=(4, 0))),
    ("f32 alibi per sequence", np.float32, [3, 6], [11, 6], 3, 1, 48, 5,
     dict(alibi_slopes=np.float32([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]]))),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_varlen_numpy(case):
    label, dtype, lens_q, lens_k, heads, kv_heads, head_dim, page, options = case
    rng = np.random.default_rng(len(label))
    cu_q, cu_k = (np.int32(np.concatenate([[0], np.cumsum(n)])) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], heads, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(dtype) for _ in range(2))
    k_cache, v_cache, table = _page(rng, k, v, cu_k, page)
    out, lse = fam.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table,
                                  **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (heads, cu_q[-1])
    _judge(q, k, v, cu_q, cu_k, out, lse, label, **options)
    # The contiguous call on the same sequences is judged by the same rule (the kernels differ:
    # KV-cache loads and tiles, so the bits may too).
    contiguous, contiguous_lse = fam.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    _judge(q, k, v, cu_q, cu_k, contiguous, contiguous_lse, f"{label} contiguous", **options)


def test_paged_varlen_smollm2_rows():
    """Two SmolLM2-135M sequences of the fixture packed: a 40-token causal prefill (layer 14) and a
    decode step over 71 cached keys (layer 29), their keys in shuffled 16-row pages."""
    with np.load(FIXTURE) as data:
        parts = [[data[f"{case}_{n}"][0].transpose(1, 0, 2) for n in "qkv"]
                 for case in ("prefill_layer14_len40", "decode_layer29_step30")]
    q, k, v = (np.concatenate([p[i] for p in parts]) for i in range(3))
    cu_q, cu_k = np.int32([0, 40, 41]), np.int32([0, 40, 111])
    k_cache, v_cache, table = _page(np.random.default_rng(1), k, v, cu_k, 16)
    out, lse = fam.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, 40, 71, block_table=table, causal=True)
    _judge(q, k, v, cu_q, cu_k, out, lse, "smollm2", causal=True)


def test_paged_varlen_checks():
    q = np.zeros((4, 2, 32), np.float16)
    cache = np.zeros((6, 8, 1, 32), np.float16)
    cu_q, table = np.int32([0, 2, 4]), np.int32([[0, 1], [2, 3]])
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k gives sequence 1 17 keys, more than block_table holds"):
        fam.forward_varlen(q, cache, cache, cu_q, np.int32([0, 3, 20]), 2, 17, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9"):
        fam.forward_varlen(q, cache, cache, cu_q, np.int32([0, 3, 12]), 2, 9, block_table=np.int32([[0, 1], [2, 9]]))
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch 2, max_blocks\)"):
        fam.forward_varlen(q, cache, cache, cu_q, np.int32([0, 3, 12]), 2, 9, block_table=np.int32([[0, 1]]))
    with pytest.raises(ValueError, match=r"max_seqlen_k \(5\) must be at least the longest sequence"):
        fam.forward_varlen(q, cache, cache, cu_q, np.int32([0, 3, 12]), 2, 5, block_table=table)
    # Unused entries (past a sequence's keys) are not read, so they may be anything.
    fam.forward_varlen(q, cache, cache, cu_q, np.int32([0, 3, 11]), 2, 8, block_table=np.int32([[0, -1], [2, 77]]))


def test_paged_varlen_torch():
    torch = pytest.importorskip("torch")
    from flash_attention_metal.torch import flash_attn_varlen_func

    rng = np.random.default_rng(2)
    cu_q, cu_k = np.int32([0, 3, 10]), np.int32([0, 12, 19])
    q = rng.standard_normal((10, 4, 32)).astype(np.float16)
    k, v = (rng.standard_normal((19, 2, 32)).astype(np.float16) for _ in range(2))
    k_cache, v_cache, table = _page(rng, k, v, cu_k, 8)
    expected, _ = fam.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, 7, 12, block_table=table, causal=True,
                                     window_size=(3, 0))
    tensors = [torch.from_numpy(a) for a in (q, k_cache, v_cache, cu_q, cu_k, table)]
    out = flash_attn_varlen_func(*tensors[:5], 7, 12, causal=True, window_size=torch.tensor([3, 0]),
                                 block_table=tensors[5])
    assert np.array_equal(out.numpy(), expected)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_varlen_func(tensors[0].clone().requires_grad_(), *tensors[1:5], 7, 12, block_table=tensors[5])
    with torch.no_grad():
        flash_attn_varlen_func(tensors[0].clone().requires_grad_(), *tensors[1:5], 7, 12, block_table=tensors[5])
    from flash_attention_metal.torch._paged_varlen import paged_varlen_forward
    torch.library.opcheck(paged_varlen_forward, (*tensors[:5], 7, 12, tensors[5], None, 0.125, True, -1, -1, 0.0))
