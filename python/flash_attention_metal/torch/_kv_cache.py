"""FlashAttention's ``flash_attn_with_kvcache`` on CPU tensors: the custom operator
``flash_attention_metal::kvcache_forward`` (forward only, with a fake implementation), running the
NumPy layer's call (flash_attention_metal.kv_cache) on the CPU engine over NumPy views of the
tensors, so that the new rows are appended into the caller's cache tensors in place: the operator
declares k_cache, v_cache and a quantized cache's scales and biases as mutated. Every table and
length is checked there, in host memory, before anything is written.

This module has no ``from __future__ import annotations``: custom_op reads the annotations as types.
"""

import numbers
from typing import Optional

import torch
from torch import Tensor

from .. import _validation, kv_cache
from . import _host
from ._tensors import DTYPES, as_numpy, check_index, from_numpy

_NAMESPACE = "flash_attention_metal"
_CACHE_PARTS = ("k_cache", "v_cache", "k_scales", "k_biases", "v_scales", "v_biases")


def _cache(packed: Tensor, scales: Optional[Tensor], biases: Optional[Tensor]):
    """The NumPy layer's form of one cache: its array, or (packed, scales, biases)."""
    if scales is None:
        return as_numpy(packed)
    return as_numpy(packed), as_numpy(scales), as_numpy(biases)


def _optional(t: Optional[Tensor]):
    return None if t is None else as_numpy(t)


@torch.library.custom_op(f"{_NAMESPACE}::kvcache_forward", mutates_args=_CACHE_PARTS, device_types="cpu")
def kvcache_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scales: Optional[Tensor],
                    k_biases: Optional[Tensor], v_scales: Optional[Tensor], v_biases: Optional[Tensor],
                    k: Optional[Tensor], v: Optional[Tensor], cache_seqlens: Tensor, block_table: Optional[Tensor],
                    cache_batch_idx: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                    group_size: int, bits: int, bhsd: bool, rotary_cos: Optional[Tensor] = None,
                    rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = True,
                    cache_leftpad: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``kv_cache.flash_attn_with_kvcache`` (bits 0: plain caches), q and k rotated
    and k and v appended into the caches in place first."""
    out, lse = kv_cache.flash_attn_with_kvcache(
        as_numpy(q), _cache(k_cache, k_scales, k_biases), _cache(v_cache, v_scales, v_biases), _optional(k),
        _optional(v), cache_seqlens=as_numpy(cache_seqlens), block_table=_optional(block_table),
        cache_batch_idx=_optional(cache_batch_idx), softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=_optional(alibi_slopes),
        sinks=_optional(sinks), return_softmax_lse=True, group_size=group_size, bits=bits or None,
        layout="bhsd" if bhsd else "bshd", context=_host.context(), rotary_cos=_optional(rotary_cos),
        rotary_sin=_optional(rotary_sin), rotary_interleaved=rotary_interleaved,
        cache_leftpad=_optional(cache_leftpad))
    return from_numpy(out), torch.from_numpy(lse)


def _head_dim_v(v_cache: Tensor, v_scales: Optional[Tensor], bits: int) -> int:
    return v_cache.shape[3] if v_scales is None else v_cache.shape[3] * 32 // bits


@kvcache_forward.register_fake
def _forward_fake(q, k_cache, v_cache, k_scales, k_biases, v_scales, v_biases, k, v, cache_seqlens, block_table,
                  cache_batch_idx, alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap,
                  group_size, bits, bhsd, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                  cache_leftpad=None):
    # The NumPy layer returns out contiguous in the call's layout and lse (B, H, Sq) contiguous.
    return q.new_empty(q.shape[:3] + (_head_dim_v(v_cache, v_scales, bits),)), \
        q.new_empty((q.shape[0], q.shape[1 if bhsd else 2], q.shape[2 if bhsd else 1]), dtype=torch.float32)


def _split(name: str, cache, bits) -> tuple:
    """(packed or array, scales, biases) of a cache argument, each checked to be a CPU tensor."""
    parts = tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)
    if bits is None and len(parts) != 1:
        raise ValueError(f"{name} is a (packed, scales, biases) triple, which needs bits (4 or 8) and group_size")
    if bits is not None and len(parts) != 3:
        raise ValueError(f"bits={bits} is given, so {name} must be mx.quantize's (packed, scales, biases)")
    for n, t in enumerate(parts):
        label = name if len(parts) == 1 else f"{name}[{n}]"
        _check_tensor(label, t)
        if t.device.type != "cpu":
            raise NotImplementedError(f"{label} is on {t.device}: flash_attn_with_kvcache runs on CPU tensors only")
    return parts if len(parts) == 3 else (parts[0], None, None)


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, sinks=None, group_size=64,
                            bits=None, layout="bshd"):
    """FlashAttention's ``flash_attn_with_kvcache`` (its argument order; forward only) on CPU
    tensors: appends k, v to the caches in place at cache_seqlens, then attends q to each
    sequence's cache_seqlens + seqlen_new keys (bottom-right causal, so new rows see themselves and
    the cache before them).

    Args:
        q: (batch, seqlen_q, nheads, headdim) (``layout="bshd"``, the default) or (batch, nheads,
            seqlen_q, headdim) (``"bhsd"``); float16, bfloat16 or float32.
        k_cache, v_cache: contiguous (batch_cache, seqlen_cache, nheads_k, headdim[_v]) or, with
            block_table, paged (num_blocks, page_block_size, nheads_k, headdim[_v]) in q's dtype
            (middle axes swapped for "bhsd"); any page_block_size >= 1. Or, with ``bits`` 4 or 8 and
            ``group_size`` 32, 64 or 128, each mx.quantize's (packed torch.uint32 (..., headdim *
            bits / 32), scales, biases (..., headdim / group_size) in q's dtype); appended rows are
            quantized by MLX's rule. Written in place when k, v are given (allocate long-lived
            caches page-aligned with ``flash_attention_metal.empty_cache`` and ``torch.from_numpy``
            so that the Metal backend reads them without a copy).
        k, v: None, or the new rows (batch, seqlen_new, nheads_k, headdim[_v]) in q's dtype.
        cache_seqlens: int or int32 tensor (batch,): rows already cached per sequence; None: the
            whole capacity (seqlen_cache, or max_blocks x page_block_size). cache_seqlens +
            seqlen_new must lie in [1, capacity].
        cache_batch_idx: None or int32 (batch,): the cache slot of each batch element (contiguous
            caches only; distinct when appending).
        block_table: None or int32 (batch, max_blocks): each sequence's blocks in order; the entries
            holding one of its rows must lie in [0, num_blocks).
        softmax_scale: None means 1 / sqrt(headdim). causal, window_size (bottom-right aligned),
            softcap, alibi_slopes (float32 (nheads,) or (batch, nheads)), sinks (float32 (nheads,)):
            as ``flash_attn_func``.
        return_softmax_lse: also return lse, float32 (batch, nheads, seqlen_q).
        rotary_cos, rotary_sin: None, or both (seqlen_ro, rotary_dim / 2) in q's dtype (any even
            rotary_dim <= headdim): q and k rotated before the append, k's row j at position
            cache_seqlens[b] + j, q's row i at cache_seqlens[b] + i when causal or local, else at
            cache_seqlens[b] (FlashAttention's rule); needs k and v.
        rotary_interleaved: True: GPT-J pairs (2i, 2i + 1); False: GPT-NeoX (i, i + rotary_dim / 2).
        cache_leftpad: None or int32 (batch,): the first cache row attended per sequence
            (contiguous caches only).
        num_splits: an int; FlashAttention's hint, accepted and ignored.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) ((batch, nheads, seqlen_q, headdim_v) for "bhsd")
        in q's dtype, contiguous; with return_softmax_lse, (out, lse).

    Raises:
        TypeError, ValueError: invalid arguments, named, before any cache is written;
        flash_attention_metal.errors.CapacityError (a ValueError and a RuntimeError):
        cache_seqlens + seqlen_new beyond the capacity.
        NotImplementedError: tensors not on the CPU, or a tensor that requires grad (there is no
        backward).
        FlashAttentionError: the library reported an error.
    """
    kv_cache.check_num_splits(num_splits)
    named = {"q": q, "k": k, "v": v, "block_table": block_table, "cache_batch_idx": cache_batch_idx,
             "alibi_slopes": alibi_slopes, "sinks": sinks, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
             "cache_leftpad": cache_leftpad}
    for name, t in named.items():
        if t is None:
            continue
        _check_tensor(name, t)
        if t.device.type != "cpu":
            raise NotImplementedError(f"{name} is on {t.device}: flash_attn_with_kvcache runs on CPU tensors only")
        if t.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(f"{name} requires grad: flash_attn_with_kvcache has no backward; detach it")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must have dtype float16, bfloat16 or float32, got {q.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions, got shape {tuple(q.shape)}")
    k_parts, v_parts = _split("k_cache", k_cache, bits), _split("v_cache", v_cache, bits)
    bhsd = _validation.check_layout(layout) == "bhsd"
    batch = q.shape[0]
    if cache_seqlens is None:
        rows = k_parts[0].shape[2 if bhsd else 1]
        cache_seqlens = rows if block_table is None or block_table.dim() != 2 else rows * block_table.shape[1]
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32)
    _check_tensor("cache_seqlens", cache_seqlens)
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):
        check_index(name, t)
    scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[3])
    left, right = _validation.check_window_size(window_size) or (-1, -1)
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    out, lse = kvcache_forward(q, k_parts[0], v_parts[0], k_parts[1], k_parts[2], v_parts[1], v_parts[2], k, v,
                               cache_seqlens, block_table, cache_batch_idx, alibi_slopes, sinks, scale, bool(causal),
                               left, right, float(softcap), int(group_size), int(bits or 0), bhsd, rotary_cos,
                               rotary_sin, rotary_interleaved, cache_leftpad)
    return (out, lse) if return_softmax_lse else out
