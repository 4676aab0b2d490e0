"""FlashAttention's ``flash_attn_varlen_func`` on CPU tensors: the custom operators
``flash_attention_metal::varlen_forward`` and ``::varlen_backward`` (with fake implementations and
an autograd formula), running the NumPy layer's varlen calls (flash_attention_metal._varlen) on the
CPU engine over NumPy views of the tensors (bfloat16 through its bits). The cu_seqlens tables are
checked there, in host memory. MPS tensors are not supported yet (the exported plan refuses varlen
problems).

This module has no ``from __future__ import annotations``: custom_op reads the annotations as types.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import _validation, _varlen
from . import _host
from ._tensors import as_numpy as _numpy
from ._tensors import check_index
from ._tensors import from_numpy as _tensor

_NAMESPACE = "flash_attention_metal"


def _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale, causal,
             window_left, window_right, softcap):
    alibi = None if alibi_slopes is None else _numpy(alibi_slopes)
    check_index("cu_seqlens_q", cu_seqlens_q)
    check_index("cu_seqlens_k", cu_seqlens_k)
    return _varlen.check_varlen(_numpy(q), _numpy(k), _numpy(v), _numpy(cu_seqlens_q), _numpy(cu_seqlens_k),
                                max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi)


@torch.library.custom_op(f"{_NAMESPACE}::varlen_forward", mutates_args=(), device_types="cpu")
def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                   window_left: int, window_right: int, softcap: float) -> tuple[Tensor, Tensor]:
    """(out (total_q, H, Dv) in q's dtype, lse float32 (H, total_q)): ``forward_varlen``."""
    checked = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                       causal, window_left, window_right, softcap)
    out, lse = _varlen.forward(_host.context(), _numpy(q), _numpy(k), _numpy(v), checked)
    return _tensor(out), torch.from_numpy(lse)


@varlen_forward.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                  causal, window_left, window_right, softcap):
    return q.new_empty(q.shape[:2] + (v.shape[2],)), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::varlen_backward", mutates_args=(), device_types="cpu")
def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                    softmax_scale: float, causal: bool, window_left: int, window_right: int,
                    softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) like q, k, v: ``backward_varlen``."""
    checked = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                       causal, window_left, window_right, softcap)
    grads = _varlen.backward(_host.context(), _numpy(dout), _numpy(q), _numpy(k), _numpy(v), _numpy(out),
                             _numpy(lse), checked)
    return tuple(_tensor(g) for g in grads)


@varlen_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   softmax_scale, causal, window_left, window_right, softcap):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.sizes = (max_seqlen_q, max_seqlen_k)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _forward_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.sizes,
                                 alibi_slopes, *ctx.options)
    return (dq, dk, dv) + (None,) * (5 + len(ctx.options))


varlen_forward.register_autograd(_forward_backward, setup_context=_setup_context)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=True, return_attn_probs=False):
    """FlashAttention's ``flash_attn_varlen_func``: exact attention over sequences packed along the
    rows, with a fused backward; CPU tensors.

    Args:
        q: (total_q, nheads, headdim); float16, bfloat16 or float32.
        k: (total_k, nheads_k, headdim); v: (total_k, nheads_k, headdim_v); nheads % nheads_k == 0.
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,), cumulative sequence lengths starting at
            0 (checked: non-decreasing, last = total).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence.
        dropout_p: must be 0.0. softmax_scale: None means 1 / sqrt(headdim).
        causal, window_size, softcap: as ``flash_attn_func``, bottom-right aligned per sequence.
        alibi_slopes: float32 (nheads,) or (batch_size, nheads); no gradient.
        deterministic: accepted either way (the backward is always deterministic).
        return_attn_probs: must be False.

    Returns:
        out (total_q, nheads, headdim_v) in q's dtype, differentiable with respect to q, k, v.

    Raises:
        TypeError, ValueError: invalid arguments, named. NotImplementedError: dropout_p != 0,
        return_attn_probs, MPS tensors. FlashAttentionError: the library reported an error.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented; pass 0.0")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs=True: the attention probabilities are never formed; pass False")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise NotImplementedError(f"{name} is on {t.device}: flash_attn_varlen_func runs on CPU tensors only")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D (total_q, nheads, headdim), got shape {tuple(q.shape)}")
    scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[2])
    left, right = window_size
    out, _ = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, scale,
                            bool(causal), int(left), int(right), float(softcap))
    return out
