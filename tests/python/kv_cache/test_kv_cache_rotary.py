"""flash_attn_with_kvcache's rotary embeddings (rotary_cos, rotary_sin, interleaved and not),
cache_leftpad and FlashAttention's hints, on the CPU engine.

The rotation is checked against an independent float64 form (each pair of elements as a complex
number times cos + i sin), rounded once to the dtype: the appended cache rows must equal it bit for
bit; out and lse are judged under the accuracy rule against the float64 reference on the rotated
query and the sequence's keys. The positions follow FlashAttention's test_flash_attn_kvcache
(tests/test_flash_attn.py): key row j at cache_seqlens + j; query row i at cache_seqlens + i when
causal or local, else at cache_seqlens. Left padding: batch element b attends to cache rows
[cache_leftpad[b], cache_seqlens[b] + seqlen_new) as a sequence of its own.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy, quantized, reference

from conftest import assert_within_rule

BF16 = np.dtype(ml_dtypes.bfloat16)
FIXTURE = Path(fam.__file__).resolve().parent / "data" / "smollm2_attention.npz"


def _rows(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _tables(rng, seqlen_ro, rotary_dim, dtype):
    angle = rng.random((seqlen_ro, rotary_dim // 2)) * 2 * np.pi
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rotated(x, cos, sin, positions, interleaved):
    """x (B, S, H, D) rotated in float64 as complex pairs, row s of b at positions[b, s]; rounded
    once to x's dtype."""
    half = cos.shape[1]
    out = np.array(x, dtype=np.float64)
    turn = (np.asarray(cos, np.float64) + 1j * np.asarray(sin, np.float64))[positions][:, :, None, :]
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    z = (out[..., first] + 1j * out[..., second]) * turn
    out[..., first], out[..., second] = z.real, z.imag
    return out.astype(x.dtype)


def _judge(q, out, lse, keys, values, label, **options):
    """out (B, Sq, H, Dv) and lse of each batch element against its float64 keys and values."""
    qb = q.transpose(0, 2, 1, 3)
    for b, (kb, vb) in enumerate(zip(keys, values)):
        slopes = options.get("alibi_slopes")
        per = dict(options, alibi_slopes=slopes if slopes is None or slopes.ndim == 1 else slopes[b:b + 1])
        metrics = accuracy.evaluate_forward(qb[b:b + 1], kb.astype(q.dtype), vb.astype(q.dtype),
                                            out[b:b + 1].transpose(0, 2, 1, 3), lse[b:b + 1],
                                            exact_kv=(kb, vb), **per)
        assert_within_rule(metrics, f"{label} batch {b}")


def _paged(rng, caches, page):
    batch, capacity = caches[0].shape[:2]
    blocks = batch * (capacity // page)
    table = rng.permutation(blocks + 2)[:blocks].reshape(batch, -1).astype(np.int32)
    t = np.arange(capacity)
    paged = []
    for cache in caches:
        pages = np.zeros((blocks + 2, page) + cache.shape[2:], cache.dtype)
        for b in range(batch):
            pages[table[b, t // page], t % page] = cache[b]
        paged.append(pages)
    return paged, table


# (label, dtype, seqlen_q, seqlen_new, head_dim, rotary_dim, options)
ROTARY = [
    ("decode f16 causal", np.float16, 1, 1, 64, 64, dict(causal=True)),
    ("chunk bf16 causal partial", BF16, 6, 6, 64, 32, dict(causal=True)),
    ("chunk f16 local", np.float16, 5, 3, 32, 16, dict(window_size=(7, 2))),
    ("chunk f32 neither", np.float32, 4, 2, 48, 48, dict()),
    ("chunk f16 window wider than the cache", np.float16, 3, 3, 32, 32, dict(window_size=(64, 64))),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("case", ROTARY, ids=[c[0] for c in ROTARY])
def test_rotary(ctx, case, interleaved, paged):
    label, dtype, seqlen_q, new, head_dim, rotary_dim, options = case
    rng = np.random.default_rng(len(label) + 2 * interleaved + paged)
    batch, heads, kv_heads, capacity, page = 2, 4, 2, 32, 8
    q = _rows(rng, (batch, seqlen_q, heads, head_dim), dtype)
    k, v = (_rows(rng, (batch, new, kv_heads, head_dim), dtype) for _ in range(2))
    k_cache, v_cache = (_rows(rng, (batch, capacity, kv_heads, head_dim), dtype) for _ in range(2))
    seqlens = np.int32([0, capacity - seqlen_q - 1])
    cos, sin = _tables(rng, capacity, rotary_dim, dtype)
    table = None
    kc, vc = k_cache.copy(), v_cache.copy()
    if paged:
        (kc, vc), table = _paged(rng, [kc, vc], page)
    out, lse = fam.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, rotary_cos=cos,
                                           rotary_sin=sin, rotary_interleaved=interleaved, return_softmax_lse=True,
                                           context=ctx, **options)
    positions_k = seqlens[:, None] + np.arange(new)
    own_rows = options.get("causal") or any(0 <= side < capacity for side in options.get("window_size", (-1, -1)))
    positions_q = seqlens[:, None] + (np.arange(seqlen_q) if own_rows else np.zeros(seqlen_q, np.int64))
    k_rot = _rotated(k, cos, sin, positions_k, interleaved)
    q_rot = _rotated(q, cos, sin, positions_q, interleaved)
    assert not np.array_equal(k_rot, k)
    keys, values = [], []
    for b in range(batch):
        rows = seqlens[b] + np.arange(new)
        written = kc[table[b, rows // page], rows % page] if paged else kc[b, rows]
        assert np.array_equal(written.view(np.uint8), k_rot[b].view(np.uint8)), f"{label}: appended keys"
        keys.append(np.concatenate([k_cache[b, :seqlens[b]], k_rot[b]]).astype(np.float64).transpose(1, 0, 2)[None])
        values.append(np.concatenate([v_cache[b, :seqlens[b]], v[b]]).astype(np.float64).transpose(1, 0, 2)[None])
    _judge(q_rot, out, lse, keys, values, label, **options)


def test_rotary_on_smollm2_rows(ctx):
    """SmolLM2-135M's layer-14 rows of the fixture (40 prompt tokens) appended as one chunk after
    20 cached rows, with the model's own rotary tables (NeoX pairs, theta 100000, head_dim 64)."""
    with np.load(FIXTURE) as data:
        q, k, v = (data[f"prefill_layer14_len40_{n}"].transpose(0, 2, 1, 3) for n in "qkv")
    rng = np.random.default_rng(7)
    cached, capacity = 20, 64
    inv_freq = 100000.0 ** (-np.arange(0, 64, 2) / 64)
    angle = np.arange(capacity)[:, None] * inv_freq[None]
    cos, sin = np.cos(angle).astype(np.float16), np.sin(angle).astype(np.float16)
    k_cache = np.zeros((1, capacity, 3, 64), np.float16)
    v_cache = np.zeros_like(k_cache)
    k_cache[0, :cached] = k[0, :cached] * np.float16(0.5)
    v_cache[0, :cached] = _rows(rng, (cached, 3, 64), np.float16)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    out, lse = fam.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cached, rotary_cos=cos,
                                           rotary_sin=sin, rotary_interleaved=False, causal=True,
                                           return_softmax_lse=True, context=ctx)
    positions = cached + np.arange(40)[None]
    k_rot, q_rot = _rotated(k, cos, sin, positions, False), _rotated(q, cos, sin, positions, False)
    assert np.array_equal(k_cache[0, cached:cached + 40], k_rot[0])
    keys = np.concatenate([before_k[0, :cached], k_rot[0]]).astype(np.float64).transpose(1, 0, 2)[None]
    values = np.concatenate([before_v[0, :cached], v[0]]).astype(np.float64).transpose(1, 0, 2)[None]
    _judge(q_rot, out, lse, [keys], [values], "smollm2 layer 14", causal=True)


# (label, dtype, seqlen_q, seqlen_new, bits, options)
LEFTPAD = [
    ("decode f16 causal append", np.float16, 1, 1, None, dict(causal=True)),
    ("chunk bf16 causal no append", BF16, 4, 0, None, dict(causal=True, window_size=(5, 0))),
    ("chunk f16 alibi append", np.float16, 3, 3, None,
     dict(causal=True, alibi_slopes=np.float32([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))),
    ("decode f16 8-bit cache", np.float16, 1, 1, 8, dict()),
]


@pytest.mark.parametrize("batch_idx", [False, True], ids=["slots", "cache_batch_idx"])
@pytest.mark.parametrize("case", LEFTPAD, ids=[c[0] for c in LEFTPAD])
def test_leftpad(ctx, case, batch_idx):
    label, dtype, seqlen_q, new, bits, options = case
    rng = np.random.default_rng(len(label) + batch_idx)
    batch, heads, kv_heads, head_dim, capacity = 2, 4, 2, 64, 40
    q = _rows(rng, (batch, seqlen_q, heads, head_dim), dtype)
    k, v = (_rows(rng, (batch, new, kv_heads, head_dim), dtype) for _ in range(2)) if new else (None, None)
    plain = [_rows(rng, (batch + 1, capacity, kv_heads, head_dim), dtype) for _ in range(2)]
    caches = [quantized.quantize(c, 64, bits) for c in plain] if bits else plain
    seqlens, leftpad = np.int32([21, 30]), np.int32([9, 30 if new else 26])
    slots = np.int32([2, 0]) if batch_idx else None
    copies = [tuple(a.copy() for a in c) if bits else c.copy() for c in caches]
    out, lse = fam.flash_attn_with_kvcache(q, *copies, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                           cache_batch_idx=slots, bits=bits, return_softmax_lse=True, context=ctx,
                                           **options)
    sequences = reference.kvcache_sequences(*caches, seqlens, k=k, v=v, cache_batch_idx=slots, bits=bits)
    keys = [kb[:, :, leftpad[b]:] for b, (kb, _) in enumerate(sequences)]
    values = [vb[:, :, leftpad[b]:] for b, (_, vb) in enumerate(sequences)]
    _judge(q, out, lse, keys, values, label, **options)


def test_leftpad_zero_is_bit_identical_and_hints_change_nothing(ctx):
    """cache_leftpad of zeros, num_splits 0, 1 or 7 and rotary_interleaved without tables give
    the plain call's bits."""
    rng = np.random.default_rng(3)
    q = _rows(rng, (2, 2, 4, 64), np.float16)
    k_cache, v_cache = (_rows(rng, (2, 24, 2, 64), np.float16) for _ in range(2))
    call = dict(cache_seqlens=np.int32([5, 24]), causal=True, context=ctx)
    plain = fam.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    for hints in (dict(cache_leftpad=np.int32([0, 0])), dict(num_splits=1), dict(num_splits=0),
                  dict(num_splits=7, rotary_interleaved=False)):
        assert np.array_equal(fam.flash_attn_with_kvcache(q, k_cache, v_cache, **call, **hints), plain), hints


def test_refusals_come_before_any_write(ctx):
    rng = np.random.default_rng(4)
    q = _rows(rng, (2, 3, 4, 32), np.float16)
    k, v = (_rows(rng, (2, 3, 2, 32), np.float16) for _ in range(2))
    k_cache, v_cache = (_rows(rng, (2, 16, 2, 32), np.float16) for _ in range(2))
    before = k_cache.copy()
    cos, sin = _tables(rng, 16, 32, np.float16)
    seqlens = np.int32([2, 12])
    cases = [
        (dict(rotary_cos=cos[:14], rotary_sin=sin[:14], causal=True), ValueError,
         r"rotary_cos has 14 rows \(seqlen_ro\) but batch element 1 is rotated at position 14"),
        (dict(rotary_cos=cos, rotary_sin=sin[:, :4]), ValueError, "rotary_sin must have rotary_cos's shape"),
        (dict(rotary_cos=cos.astype(np.float32), rotary_sin=sin), TypeError, "rotary_cos must have q's dtype"),
        (dict(rotary_cos=np.concatenate([cos, cos], 1), rotary_sin=np.concatenate([sin, sin], 1)), ValueError,
         r"rotary_dim = 2 x that = 64 must be at most head_dim \(32\)"),
        (dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1), TypeError, "rotary_interleaved must be a bool"),
        (dict(cache_leftpad=np.int32([3, 0])), ValueError, r"cache_leftpad\[0\] = 3: must lie in \[0, cache_seqlens\]"),
        (dict(cache_leftpad=np.int64([0, 0])), TypeError, "cache_leftpad must have dtype int32"),
        (dict(num_splits="auto"), TypeError, "num_splits must be an int"),
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            fam.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, context=ctx, **extra)
        assert np.array_equal(k_cache, before), extra
    # Non-causal, non-local: the query rows all sit at cache_seqlens, so 15 rows suffice there.
    fam.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, rotary_cos=cos[:15],
                                rotary_sin=sin[:15], context=ctx)


def test_capacity_error_is_flashattention_s_type():
    """FlashAttention's test_flash_attn_kvcache_paged_block_table_bounds: a length past the block
    table's capacity is a RuntimeError mentioning block_table (here also a ValueError)."""
    q = np.zeros((1, 1, 1, 64), np.float16)
    cache = np.zeros((4, 16, 1, 64), np.float16)
    table = np.zeros((1, 1), np.int32)
    for new, seqlen in ((None, 17), (np.zeros((1, 1, 1, 64), np.float16), 16)):
        with pytest.raises(RuntimeError, match="block_table") as caught:
            fam.flash_attn_with_kvcache(q, cache, cache.copy(), new, new, cache_seqlens=np.int32([seqlen]),
                                        block_table=table)
        assert isinstance(caught.value, (ValueError, fam.FlashAttentionError))
    fam.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=np.int32([16]), block_table=table)


def test_tensor_like_window_size(ctx):
    """A 1-D integer array is a window pair (FlashAttention's tests pass a tensor); floats are not."""
    rng = np.random.default_rng(5)
    q, k, v = (_rows(rng, (1, 2, 8, 32), np.float16) for _ in range(3))
    out = ctx.attention(q, k, v, window_size=np.int64([2, 1]))
    assert np.array_equal(out, ctx.attention(q, k, v, window_size=(2, 1)))
    with pytest.raises(TypeError, match="window_size"):
        ctx.attention(q, k, v, window_size=np.float32([2, 1]))
