"""Paged K/V for packed sequences (FlashAttention's ``flash_attn_varlen_func(..., block_table=...)``,
as vLLM-style engines call it): q is packed (total_q, heads, dim), k and v are paged caches
(num_blocks, page_block_size, kv_heads, dim[_v]), sequence b's keys are its first
cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows through block_table[b] (row t in block
block_table[b, t // page_block_size], row t % page_block_size).

Forward only, as in FlashAttention-2 (its FlashAttnVarlenFunc saves the paged k and v as if packed,
and tests/test_flash_attn.py's test_flash_attn_varlen_causal checks no gradient with a block
table). The sequences run through the KV-cache kernels (``kv_cache``, no append), one launch per
distinct (query rows, key rows) pair; the tables are checked in host memory before each launch
(nothing is written but the fresh outputs).
"""

from __future__ import annotations

import numpy as np

from . import _validation, _varlen, kv_cache
from .errors import CapacityError


def check(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table) -> tuple:
    """(cu_seqlens_q, key lengths int64 (batch,)) after every check that needs no library."""
    _varlen.check_packed("q", q)
    for name, cache in (("k", k_cache), ("v", v_cache)):
        _validation.check_array(name, cache)
        _validation.check_same_dtype(name, cache, q)
    cu_q = _varlen.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "total_q (q.shape[0])")
    _validation.check_int32_array("cu_seqlens_k", cu_seqlens_k)
    total_k = int(cu_seqlens_k[-1]) if cu_seqlens_k.ndim == 1 and len(cu_seqlens_k) else 0
    cu_k = _varlen.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "its own last entry")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q shape {cu_q.shape} and cu_seqlens_k shape {cu_k.shape} must be equal "
                         f"(one entry per sequence, plus one)")
    _varlen.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
    _varlen.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    batch = len(cu_q) - 1
    _validation.check_int32_array("block_table", block_table)
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch {batch}, max_blocks), got {block_table.shape}")
    lengths = np.diff(cu_k.astype(np.int64))
    capacity = block_table.shape[1] * k_cache.shape[1]
    if (lengths > capacity).any():
        b = int(np.flatnonzero(lengths > capacity)[0])
        raise CapacityError(f"cu_seqlens_k gives sequence {b} {int(lengths[b])} keys, more than block_table holds "
                            f"(max_blocks x page_block_size = {capacity})")
    used = np.arange(block_table.shape[1])[None, :] * k_cache.shape[1] < lengths[:, None]
    bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
    if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {i}] = {int(block_table[b, i])}: must lie in [0, {k_cache.shape[0]}) (the "
                         f"caches' blocks) for every block that holds one of the sequence's keys")
    return cu_q, lengths


def forward(context, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, *,
            causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """(out (total_q, heads, head_dim_v) in q's dtype, lse float32 (heads, total_q)) of the packed
    queries over their paged keys; a row that sees no key has out 0 and lse -inf (sinks[h] with
    sinks), as ``forward_varlen``. Raises TypeError or ValueError (CapacityError past the table) naming the
    argument, before any launch."""
    cu_q, lengths = check(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    rows_q = np.diff(cu_q.astype(np.int64))
    total_q, heads = q.shape[:2]
    out = np.zeros((total_q, heads, v_cache.shape[3]), dtype=q.dtype)
    # A row without keys: lse -inf, or the sink's logit (its only term) with sinks.
    empty = -np.inf if sinks is None else np.asarray(sinks, dtype=np.float32)[:, None]
    lse = np.broadcast_to(np.float32(empty), (heads, total_q)).copy()
    call = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, sinks=sinks,
                return_softmax_lse=True, context=context)
    groups = sorted({(int(n), int(s)) for n, s in zip(rows_q, lengths) if n and s})
    for n, s in groups:
        batches = np.flatnonzero((rows_q == n) & (lengths == s))
        rows = cu_q[batches, None] + np.arange(n)
        slopes = alibi_slopes if alibi_slopes is None or np.ndim(alibi_slopes) == 1 else alibi_slopes[batches]
        out_g, lse_g = kv_cache.flash_attn_with_kvcache(
            q[rows], k_cache, v_cache, cache_seqlens=lengths[batches].astype(np.int32),
            block_table=np.ascontiguousarray(block_table[batches]), alibi_slopes=slopes, **call)
        out[rows] = out_g
        lse[:, rows] = lse_g.transpose(1, 0, 2)
    return out, lse
