"""flash_attn_with_kvcache (flash_attention_metal.torch) on CPU tensors: a prefill chunk appended
into a paged cache whose pages are shuffled, in place, against PyTorch's SDPA on the gathered cache
and the library's rule against the float64 reference; an 8-bit mx.quantize cache; opcheck of the
custom operator (which declares the caches mutated); the refusals. About 2 s."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch_oracles import to_numpy, within  # noqa: E402

import flash_attention_metal as fam  # noqa: E402
from flash_attention_metal import accuracy, quantized, reference  # noqa: E402
from flash_attention_metal.torch import flash_attn_with_kvcache  # noqa: E402
from flash_attention_metal.torch._kv_cache import kvcache_forward  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 32, 16
TABLE = [[4, 1, 6], [0, 5, 2]]  # 7 blocks of 16 rows; block 3 is unused
SEQLENS = [5, 20]


def _paged(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(7, PAGE, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(2, 3, HEADS, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(2, 3, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v, torch.tensor(TABLE, dtype=torch.int32), torch.tensor(SEQLENS, dtype=torch.int32)


def _gathered(cache, table, length):
    """(1, H_kv, length, D): a sequence's first rows of a paged cache, in order."""
    t = torch.arange(length)
    return cache[table[t // PAGE], t % PAGE].transpose(0, 1)[None]


def _sdpa(q, keys, values):
    # Bottom-right causal (SDPA's is_causal is top-left when the query is shorter than the keys).
    sq, sk = q.shape[2], keys.shape[2]
    mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_append_in_place_like_sdpa_and_the_reference(dtype):
    q, k_cache, v_cache, k, v, table, seqlens = _paged(dtype, 0)
    before = [to_numpy(c).copy() for c in (k_cache, v_cache)]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                       causal=True, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, HEADS, 3) and lse.dtype == torch.float32
    # Appended in place at cache_seqlens, nothing else written.
    for cache, new, old in ((k_cache, k, before[0]), (v_cache, v, before[1])):
        written = np.zeros(old.shape[:2], bool)
        for b, start in enumerate(SEQLENS):
            t = np.arange(start, start + 3)
            assert torch.equal(cache[table[b, t // PAGE], t % PAGE], new[b])
            written[np.asarray(TABLE)[b, t // PAGE], t % PAGE] = True
        assert np.array_equal(to_numpy(cache)[~written], old[~written])
    sequences = reference.kvcache_sequences(*before, np.int32(SEQLENS), k=to_numpy(k), v=to_numpy(v),
                                            block_table=np.int32(TABLE))
    for b, (keys64, values64) in enumerate(sequences):
        qb = q[b:b + 1].transpose(1, 2)
        keys, values = (_gathered(c, table[b], SEQLENS[b] + 3) for c in (k_cache, v_cache))
        ours = out[b:b + 1].transpose(1, 2)
        ok, figures = within(ours, _sdpa(qb, keys, values), _sdpa(qb.double(), keys.double(), values.double()))
        assert ok, f"batch {b} against PyTorch: {figures}"
        metrics = accuracy.evaluate_forward(to_numpy(qb), to_numpy(keys), to_numpy(values), to_numpy(ours),
                                            to_numpy(lse[b:b + 1]), causal=True, exact_kv=(keys64, values64))
        assert all(m.passed for m in metrics), accuracy.describe(metrics)


def test_quantized_cache_appends_by_mlx_rule():
    gen = torch.Generator().manual_seed(2)
    rows = np.random.default_rng(2).standard_normal((2, 40, KV_HEADS, 64)).astype(np.float16)
    caches = [tuple(torch.from_numpy(a) for a in quantized.quantize(rows, 64, 8)) for _ in range(2)]
    before = [tuple(a.numpy().copy() for a in c) for c in caches]
    q = torch.randn(2, 1, HEADS, 64, generator=gen).half()
    k, v = (torch.randn(2, 1, KV_HEADS, 64, generator=gen).half() for _ in range(2))
    out, lse = flash_attn_with_kvcache(q, caches[0], caches[1], k, v, cache_seqlens=30, return_softmax_lse=True,
                                       bits=8)
    expected = quantized.quantize(k.numpy()[:, 0], 64, 8)
    assert all(np.array_equal(a[:, 30].numpy(), e) for a, e in zip(caches[0], expected))
    sequences = reference.kvcache_sequences(*before, 30, k=k.numpy(), v=v.numpy(), bits=8)
    for b, (keys, values) in enumerate(sequences):
        metrics = accuracy.evaluate_forward(q.numpy()[b:b + 1].transpose(0, 2, 1, 3), keys.astype(np.float16),
                                            values.astype(np.float16), out.numpy()[b:b + 1].transpose(0, 2, 1, 3),
                                            lse.numpy()[b:b + 1], exact_kv=(keys, values))
        assert all(m.passed for m in metrics), accuracy.describe(metrics)


def test_opcheck():
    q, k_cache, v_cache, k, v, table, seqlens = _paged(torch.float16, 1)
    args = (q, k_cache, v_cache, None, None, None, None, k, v, seqlens, table, None, None, None, 0.25, True, -1, -1,
            0.0, 64, 0, False)
    torch.library.opcheck(kvcache_forward, args)
    rows = np.random.default_rng(3).standard_normal((2, 20, KV_HEADS, 64)).astype(np.float16)
    (kp, ks, kb), (vp, vs, vb) = ([torch.from_numpy(a) for a in quantized.quantize(rows, 64, 4)] for _ in range(2))
    q4 = torch.randn(2, 1, HEADS, 64).half()
    new = torch.randn(2, 1, KV_HEADS, 64).half()
    torch.library.opcheck(kvcache_forward, (q4, kp, vp, ks, kb, vs, vb, new, new, seqlens.clamp(max=19), None, None,
                                            None, None, 0.125, False, -1, -1, 0.0, 64, 4, False))


def test_refusals_leave_the_cache_untouched():
    q, k_cache, v_cache, k, v, table, seqlens = _paged(torch.float16, 4)
    before = k_cache.clone()
    bad = table.clone()
    bad[1, 1] = 9
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9: must lie in \[0, 7\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=bad)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 46"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 46], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] = 46.*block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 46], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(ValueError, match="cache_leftpad cannot be combined with block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                cache_leftpad=seqlens)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                rotary_cos=torch.ones(64, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, num_splits=1.0)
    with pytest.raises(NotImplementedError, match="q requires grad"):
        flash_attn_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, cache_seqlens=seqlens,
                                block_table=table)
    with pytest.raises(ValueError, match="bits=8 is given, so k_cache must be"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, bits=8)
    # A rule of the library's (no Python copy), asked of it before the append.
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        flash_attn_with_kvcache(q[:, :, :3], k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(k_cache, before)
    # Without cache_seqlens every sequence's cache is full: 48 rows each, no append.
    out = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())


def test_empty_cache_backs_a_tensor_in_place():
    array = fam.empty_cache((7, PAGE, KV_HEADS, DIM), np.float16)
    cache = torch.from_numpy(array)
    assert cache.data_ptr() % fam.kv_cache.PAGE_BYTES == 0


def test_rotary_and_leftpad_match_the_numpy_layer():
    """rotary_cos/rotary_sin (both pairings), cache_leftpad, a tensor window_size and the hints
    give the NumPy layer's bits (which tests/python/test_kv_cache_rotary.py judges), caches
    included; opcheck covers the operator with the new arguments."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, HEADS, DIM, generator=gen).half()
    k, v = (torch.randn(2, 3, KV_HEADS, DIM, generator=gen).half() for _ in range(2))
    caches = [torch.randn(2, 32, KV_HEADS, DIM, generator=gen).half() for _ in range(2)]
    angle = torch.rand(32, DIM // 4, generator=gen) * 6.283
    cos, sin = angle.cos().half(), angle.sin().half()
    seqlens, leftpad = torch.tensor([4, 20], dtype=torch.int32), torch.tensor([1, 7], dtype=torch.int32)
    for interleaved in (True, False):
        ours = [c.clone() for c in caches]
        out = flash_attn_with_kvcache(q, *ours, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                      cache_leftpad=leftpad, causal=True, window_size=torch.tensor([6, 0]),
                                      rotary_interleaved=interleaved, num_splits=1)
        theirs = [c.numpy().copy() for c in caches]
        expected = fam.flash_attn_with_kvcache(q.numpy(), *theirs, k.numpy(), v.numpy(), rotary_cos=cos.numpy(),
                                               rotary_sin=sin.numpy(), cache_seqlens=seqlens.numpy(),
                                               cache_leftpad=leftpad.numpy(), causal=True, window_size=(6, 0),
                                               rotary_interleaved=interleaved)
        assert np.array_equal(out.numpy(), expected)
        assert all(np.array_equal(a.numpy(), b) for a, b in zip(ours, theirs))
    torch.library.opcheck(kvcache_forward, (q, *[c.clone() for c in caches], None, None, None, None, k, v, seqlens,
                                            None, None, None, None, 0.125, True, -1, -1, 0.0, 64, 0, False, cos, sin,
                                            False, leftpad))
