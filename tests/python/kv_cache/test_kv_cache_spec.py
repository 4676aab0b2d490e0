"""Speculative-decoding and chunked-prefill widths over a KV cache (issue 38 items 3 and 4) on the CPU
engine: the spec kernel (9-16 packed rows per KV head) over contiguous, paged and quantized caches
in every dtype against the float64 reference under the accuracy rule, bottom-right causal among the
new rows; the tiled KV-cache kernels' chunk copies of a paged cache (pages smaller than, equal to
and larger than a tile; unquantized and quantized) bit-identical to the same rows contiguous; and the
bytes the spec kernel reads per call."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import quantized

from test_kv_cache import _check, _paged, _rows

BF16 = np.dtype(ml_dtypes.bfloat16)
SUFFIX = {np.dtype(np.float16): "f16", BF16: "bf16", np.dtype(np.float32): "f32"}

# (seqlen_q, heads, kv_heads, head_dim): packed rows per KV head 16 (2 rows x 8), 12 (12 x 1) and
# 10 (5 x 2), each above a decode block (8 rows up to head_dim 128, 4 at 256) and within 16
# (float32's spec block has 8 rows at head_dim 256, like its forward: the first two shapes).
SHAPES = [(2, 16, 2, 64), (12, 2, 2, 128), (5, 4, 2, 256)]
CACHES = ["contiguous", "paged 16", "paged 5", "8-bit", "4-bit paged"]


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("cache", CACHES)
def test_spec_widths_over_every_cache(ctx, dtype, cache):
    shapes = SHAPES[:2] if dtype == np.float32 else SHAPES
    seqlen_q, heads, kv_heads, head_dim = shapes[(CACHES.index(cache) + len(SUFFIX[np.dtype(dtype)])) % len(shapes)]
    rng = np.random.default_rng(CACHES.index(cache) * 7 + head_dim)
    batch, capacity = 2, 176
    seqlens = np.int32([150, 61])
    q = _rows(rng, (batch, seqlen_q, heads, head_dim), dtype)
    k_cache, v_cache = (_rows(rng, (batch, capacity, kv_heads, head_dim), dtype) for _ in range(2))
    k, v = (_rows(rng, (batch, seqlen_q, kv_heads, head_dim), dtype) for _ in range(2))
    bits = {"8-bit": 8, "4-bit paged": 4}.get(cache)
    if bits:
        k_cache, v_cache = (quantized.quantize(c, 64, bits) for c in (k_cache, v_cache))
    table = None
    if cache.startswith("paged") or cache == "4-bit paged":
        (k_cache, v_cache), table = _paged(rng, [k_cache, v_cache], 5 if cache == "paged 5" else 16)
    _check(ctx, q, k_cache, v_cache, k, v, seqlens, f"spec {cache}", block_table=table, bits=bits, causal=True)
    assert ctx.last_profile.dispatches[0].kernel == f"flash_attention_forward_spec_kvcache_{SUFFIX[np.dtype(dtype)]}_d{head_dim}"


def test_spec_with_a_window_softcap_alibi_and_sinks(ctx):
    """Every option of the split kernels on the spec path: a window, softcap, ALiBi, sinks."""
    rng = np.random.default_rng(11)
    batch, seqlen_q, heads, kv_heads, head_dim, capacity = 1, 4, 8, 2, 64, 300
    q = _rows(rng, (batch, seqlen_q, heads, head_dim), np.float16)
    k_cache, v_cache = (_rows(rng, (batch, capacity, kv_heads, head_dim), np.float16) for _ in range(2))
    (k_cache, v_cache), table = _paged(rng, [k_cache, v_cache], 16)
    _check(ctx, q, k_cache, v_cache, None, None, np.int32([290]), "spec options", block_table=table, causal=True,
           window_size=(100, 0), softcap=8.0, alibi_slopes=np.linspace(0.01, 0.2, heads, dtype=np.float32),
           sinks=np.linspace(-1, 1, heads, dtype=np.float32))
    assert ctx.last_profile.dispatches[0].kernel == "flash_attention_forward_spec_kvcache_f16_d64"


# (label, dtype, seqlen_q, heads, kv_heads, head_dim, page, kernel, bits): the dense KV-cache kernel
# (a prefill chunk of 72 rows) and the tiled split one (32 packed rows) over pages smaller than a
# key tile (5), equal (16, 32) and larger (48); d128 f16 and d64 bf16 copy K in the paired layout,
# f32 row-major; head_dim 36 in half is off 16-byte boundaries (CacheKV's element copy); quantized
# caches take the dequantizing chunk copy, contiguous and paged alike.
PAGED = [
    ("dense f16 d128 page 5", np.float16, 72, 2, 1, 128, 5, "kvcache", None),
    ("dense bf16 d64 page 48", BF16, 72, 4, 2, 64, 48, "kvcache", None),
    ("split f16 d128 page 16", np.float16, 4, 16, 2, 128, 16, "split_kvcache", None),
    ("split f32 d96 page 32", np.float32, 8, 8, 2, 96, 32, "split_kvcache", None),
    ("split f16 d36 page 5 (element copy)", np.float16, 8, 8, 2, 36, 5, "split_kvcache", None),
    ("dense 8-bit f16 d128 page 5", np.float16, 72, 2, 1, 128, 5, "kvcache", 8),
    ("split 4-bit bf16 d64 page 16", BF16, 4, 16, 2, 64, 16, "split_kvcache", 4),
    ("dense 4-bit f32 d64 page 48", np.float32, 72, 2, 2, 64, 48, "kvcache", 4),
]


@pytest.mark.parametrize("case", PAGED, ids=[c[0] for c in PAGED])
def test_paged_tiles_equal_the_contiguous_ones_bit_for_bit(ctx, case):
    label, dtype, seqlen_q, heads, kv_heads, head_dim, page, kernel, bits = case
    rng = np.random.default_rng(len(label))
    batch, capacity = 2, 160
    seqlens = np.int32([157, 70])
    q = _rows(rng, (batch, seqlen_q, heads, head_dim), dtype)
    k_cache, v_cache = (_rows(rng, (batch, capacity, kv_heads, head_dim), dtype) for _ in range(2))
    if bits:
        k_cache, v_cache = (quantized.quantize(c, 64, bits) for c in (k_cache, v_cache))
    options = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True, bits=bits, context=ctx)
    out, lse = fam.flash_attn_with_kvcache(q, k_cache, v_cache, **options)
    assert ctx.last_profile.dispatches[0].kernel.startswith(f"flash_attention_forward_{kernel}_")
    (pk, pv), table = _paged(rng, [k_cache, v_cache], page)
    paged_out, paged_lse = fam.flash_attn_with_kvcache(q, pk, pv, block_table=table, **options)
    assert ctx.last_profile.dispatches[0].kernel.startswith(f"flash_attention_forward_{kernel}_")
    assert np.array_equal(out, paged_out) and np.array_equal(lse, paged_lse), label
    _check(ctx, q, pk, pv, None, None, seqlens, label, block_table=table, bits=bits, causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_spec_reads_the_cache_once(ctx, paged, monkeypatch):
    """16 packed rows per KV head (4 rows x 4 heads over 1 KV head): the spec kernel's one block per
    KV head and chunk reads every K and V row once (device_bytes_read of k and v, the CPU engine's
    count), where 16 rows of 4 heads in the dense forward would read the cache once per head."""
    monkeypatch.setenv("FLASH_ATTENTION_COUNT_DEVICE_READS", "1")
    rng = np.random.default_rng(9)
    heads, kv_heads, head_dim, keys = 4, 1, 128, 512
    q = _rows(rng, (1, 4, heads, head_dim), np.float16)
    k_cache, v_cache = (_rows(rng, (1, keys, kv_heads, head_dim), np.float16) for _ in range(2))
    table = None
    if paged:
        (k_cache, v_cache), table = _paged(rng, [k_cache, v_cache], 16)
    fam.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=keys, block_table=table, context=ctx)
    spec = ctx.last_profile.dispatches[0]
    assert spec.kernel == "flash_attention_forward_spec_kvcache_f16_d128"
    cache_bytes = keys * kv_heads * head_dim * 2
    for read in spec.device_bytes_read[1:3]:
        assert 1.0 <= read / cache_bytes <= 1.1, read / cache_bytes
