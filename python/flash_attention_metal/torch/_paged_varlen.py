"""``flash_attn_varlen_func(..., block_table=...)`` on CPU tensors: the custom operator
``flash_attention_metal::paged_varlen_forward`` (forward only, as in FlashAttention-2, with a fake
implementation), running the NumPy layer's paged varlen call (flash_attention_metal._paged_varlen)
on the CPU engine over NumPy views of the tensors.

This module has no ``from __future__ import annotations``: custom_op reads the annotations as types.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import _paged_varlen
from . import _host
from ._tensors import as_numpy, check_index, from_numpy

_NAMESPACE = "flash_attention_metal"


@torch.library.custom_op(f"{_NAMESPACE}::paged_varlen_forward", mutates_args=(), device_types="cpu")
def paged_varlen_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, block_table: Tensor, alibi_slopes: Optional[Tensor],
                         softmax_scale: float, causal: bool, window_left: int, window_right: int,
                         softcap: float) -> tuple[Tensor, Tensor]:
    """(out (total_q, H, Dv) in q's dtype, lse float32 (H, total_q)): ``_paged_varlen.forward``."""
    out, lse = _paged_varlen.forward(
        _host.context(), as_numpy(q), as_numpy(k_cache), as_numpy(v_cache), as_numpy(cu_seqlens_q),
        as_numpy(cu_seqlens_k), max_seqlen_q, max_seqlen_k, as_numpy(block_table), causal=causal,
        softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else as_numpy(alibi_slopes))
    return from_numpy(out), torch.from_numpy(lse)


@paged_varlen_forward.register_fake
def _forward_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                  alibi_slopes, softmax_scale, causal, window_left, window_right, softcap):
    return q.new_empty(q.shape[:2] + (v_cache.shape[3],)), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
            scale: float, causal: bool, window: tuple, softcap: float) -> Tensor:
    """out of the paged varlen call; NotImplementedError when a gradient is wanted (no backward,
    as in FlashAttention, whose backward would misread the paged k and v as packed)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flash_attn_varlen_func with block_table is forward only (as in FlashAttention): "
                                  "no gradient flows to q or the paged k and v; detach them or use torch.no_grad()")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.device.type != "cpu":
        raise NotImplementedError(f"block_table is on {block_table.device}: flash_attn_varlen_func runs on CPU "
                                  "tensors only")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("block_table", block_table)):
        check_index(name, t)
    out, _ = paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                  int(max_seqlen_k), block_table, alibi_slopes, scale, bool(causal), window[0],
                                  window[1], float(softcap))
    return out
