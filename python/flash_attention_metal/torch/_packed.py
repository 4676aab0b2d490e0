"""FlashAttention's packed entry points (``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func``, Dao-AILab/flash-attention
flash_attn/flash_attn_interface.py): the packed tensor split into views along its packing axis
(no copy: the operators read strided views in place) and handed to ``flash_attn_func`` or
``flash_attn_varlen_func``. Autograd's unbind stacks the gradients of the views back into one
gradient of the packed tensor's shape. Only the packed tensor's own shape is checked here (so its
errors name it); everything else is the unpacked functions' checks.
"""

from __future__ import annotations

import torch

from ._interface import flash_attn_func
from ._tensors import DTYPES, check_index
from ._varlen import flash_attn_varlen_func


def _unpack(name: str, packed, layout: str, axis: int, count: int) -> tuple:
    """``packed``'s ``count`` views along ``axis``, after checking that it is a non-empty tensor of a
    supported dtype with ``layout``'s dimensions and ``count`` entries on that axis (TypeError or
    ValueError naming ``name``)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype not in DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {packed.dtype}")
    wanted = layout.count(",") + 1
    if packed.dim() != wanted or packed.shape[axis] != count:
        raise ValueError(f"{name} must have shape {layout} ({wanted} dimensions, {count} on dimension {axis}), "
                         f"got {tuple(packed.shape)}")
    if packed.numel() == 0:
        raise ValueError(f"{name} has an empty dimension (shape {tuple(packed.shape)}); every dimension must be at "
                         "least 1")
    return packed.unbind(axis)


def _check_kv_matches_q(q, kv, batch_axis: int | None) -> None:
    """kv's batch size (dimension ``batch_axis``, None in the varlen layout) and headdim must be q's
    (the unpacked functions would name k instead of kv)."""
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        return  # the unpacked function names q
    if batch_axis is not None and q.shape[0] != kv.shape[batch_axis]:
        raise ValueError(f"kv's batch_size {kv.shape[batch_axis]} must be q's {q.shape[0]}")
    if kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv's headdim {kv.shape[-1]} must be q's {q.shape[-1]}")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's ``flash_attn_qkvpacked_func``: ``flash_attn_func`` on q, k and v stacked in
    one tensor (self-attention; nheads equal for q, k and v).

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim); float16, bfloat16 or float32; CPU or MPS.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as ``flash_attn_func``'s.

    Returns:
        out (batch_size, seqlen, nheads, headdim), or with return_attn_probs (out, softmax_lse,
        S_dmask), as ``flash_attn_func``'s, bit for bit. The gradient flows to qkv (one tensor of
        qkv's shape).

    Raises:
        TypeError, ValueError: a qkv that is not a tensor of that shape and a supported dtype (named),
        or ``flash_attn_func``'s errors.
    """
    q, k, v = _unpack("qkv", qkv, "(batch_size, seqlen, 3, nheads, headdim)", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's ``flash_attn_kvpacked_func``: ``flash_attn_func`` with k and v stacked in
    one tensor (MQA/GQA: nheads a multiple of nheads_k).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); float16, bfloat16 or float32; CPU or MPS.
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim), q's dtype and device.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as ``flash_attn_func``'s (causal aligned bottom-right).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim), or with return_attn_probs (out, softmax_lse,
        S_dmask), as ``flash_attn_func``'s, bit for bit. Gradients flow to q and kv.

    Raises:
        TypeError, ValueError: a kv that is not a tensor of that shape and a supported dtype, or
        whose batch_size or headdim differ from q's (named), or ``flash_attn_func``'s errors.
    """
    k, v = _unpack("kv", kv, "(batch_size, seqlen_k, 2, nheads_k, headdim)", 2, 2)
    _check_kv_matches_q(q, kv, 0)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """FlashAttention's ``flash_attn_varlen_qkvpacked_func``: ``flash_attn_varlen_func`` on q, k and
    v stacked in one tensor, the same cu_seqlens and max_seqlen for queries and keys; CPU tensors.

    Args:
        qkv: (total, 3, nheads, headdim); float16, bfloat16 or float32.
        cu_seqlens: int32 (batch_size + 1,), cumulative sequence lengths starting at 0, last = total.
        max_seqlen: int, at least the longest sequence.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as ``flash_attn_varlen_func``'s.

    Returns:
        out (total, nheads, headdim), or with return_attn_probs (out, softmax_lse (nheads, total),
        S_dmask), as ``flash_attn_varlen_func``'s, bit for bit. The gradient flows to qkv.

    Raises:
        TypeError, ValueError: a qkv that is not a tensor of that shape and a supported dtype, a
        cu_seqlens that is not int32 (named), or ``flash_attn_varlen_func``'s errors.
    """
    q, k, v = _unpack("qkv", qkv, "(total, 3, nheads, headdim)", 1, 3)
    check_index("cu_seqlens", cu_seqlens)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's ``flash_attn_varlen_kvpacked_func``: ``flash_attn_varlen_func`` with k and v
    stacked in one tensor; CPU tensors.

    Args:
        q: (total_q, nheads, headdim); float16, bfloat16 or float32.
        kv: (total_k, 2, nheads_k, headdim), q's dtype; nheads a multiple of nheads_k.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs: as
            ``flash_attn_varlen_func``'s.

    Returns:
        out (total_q, nheads, headdim), or with return_attn_probs the tuple of
        ``flash_attn_varlen_func``, bit for bit. Gradients flow to q and kv.

    Raises:
        TypeError, ValueError: a kv that is not a tensor of that shape and a supported dtype, or
        whose headdim differs from q's (named), or ``flash_attn_varlen_func``'s errors.
    """
    k, v = _unpack("kv", kv, "(total_k, 2, nheads_k, headdim)", 1, 2)
    _check_kv_matches_q(q, kv, None)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
