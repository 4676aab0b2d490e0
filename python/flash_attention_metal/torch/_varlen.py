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
from . import _host, _paged_varlen
from ._interface import draw_dropout
from ._tensors import as_numpy as _numpy
from ._tensors import check_index
from ._tensors import from_numpy as _tensor

_NAMESPACE = "flash_attention_metal"


def _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale, causal,
             window_left, window_right, softcap, dropout_p, dropout_seed, dropout_offset):
    alibi = None if alibi_slopes is None else _numpy(alibi_slopes)
    check_index("cu_seqlens_q", cu_seqlens_q)
    check_index("cu_seqlens_k", cu_seqlens_k)
    return _varlen.check_varlen(_numpy(q), _numpy(k), _numpy(v), _numpy(cu_seqlens_q), _numpy(cu_seqlens_k),
                                max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi,
                                dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)


@torch.library.custom_op(f"{_NAMESPACE}::varlen_forward", mutates_args=(), device_types="cpu")
def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                   window_left: int, window_right: int, softcap: float, dropout_p: float, dropout_seed: int,
                   dropout_offset: int) -> tuple[Tensor, Tensor]:
    """(out (total_q, H, Dv) in q's dtype, lse float32 (H, total_q)): ``forward_varlen``."""
    checked = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                       causal, window_left, window_right, softcap, dropout_p, dropout_seed, dropout_offset)
    out, lse = _varlen.forward(_host.context(), _numpy(q), _numpy(k), _numpy(v), checked)
    return _tensor(out), torch.from_numpy(lse)


@varlen_forward.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                  causal, window_left, window_right, softcap, dropout_p, dropout_seed, dropout_offset):
    return q.new_empty(q.shape[:2] + (v.shape[2],)), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::varlen_backward", mutates_args=(), device_types="cpu")
def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                    softmax_scale: float, causal: bool, window_left: int, window_right: int,
                    softcap: float, dropout_p: float, dropout_seed: int,
                    dropout_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) like q, k, v: ``backward_varlen``."""
    checked = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                       causal, window_left, window_right, softcap, dropout_p, dropout_seed, dropout_offset)
    grads = _varlen.backward(_host.context(), _numpy(dout), _numpy(q), _numpy(k), _numpy(v), _numpy(out),
                             _numpy(lse), checked)
    return tuple(_tensor(g) for g in grads)


@varlen_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   softmax_scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, dropout_offset):
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
                           deterministic=True, return_attn_probs=False, block_table=None):
    """FlashAttention's ``flash_attn_varlen_func``: exact attention over sequences packed along the
    rows, with a fused backward; CPU tensors.

    Args:
        q: (total_q, nheads, headdim); float16, bfloat16 or float32.
        k: (total_k, nheads_k, headdim); v: (total_k, nheads_k, headdim_v); nheads % nheads_k == 0.
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,), cumulative sequence lengths starting at
            0 (checked: non-decreasing, last = total).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence.
        dropout_p: attention dropout in [0, 1), as ``flash_attn_func``'s (seed and offset drawn from
            the default CPU generator, saved for the backward); sequence b's mask is batch entry
            b's with rows and keys counted from the sequence's start. softmax_scale: None means
            1 / sqrt(headdim).
        causal, window_size, softcap: as ``flash_attn_func``, bottom-right aligned per sequence.
        alibi_slopes: float32 (nheads,) or (batch_size, nheads); no gradient.
        deterministic: accepted either way (the backward is always deterministic).
        return_attn_probs: False returns out; True (out, softmax_lse, S_dmask) with softmax_lse
            float32 (nheads, total_q) (FlashAttention's varlen layout) and S_dmask FlashAttention's
            empty placeholder at dropout_p 0; at dropout_p > 0 S_dmask is refused
            (NotImplementedError): use flash_attn_func's. Not with block_table.
        block_table: None, or int32 (batch_size, max_blocks): k and v are then paged caches
            (num_blocks, page_block_size, nheads_k, headdim[_v]) and sequence b's keys the first
            cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows through block_table[b] (vLLM's layout).
            Forward only, as in FlashAttention: NotImplementedError when q, k or v requires grad
            (under grad mode), with dropout_p > 0 or with return_attn_probs.

    Returns:
        out (total_q, nheads, headdim_v) in q's dtype, differentiable with respect to q, k, v
        (without block_table); with return_attn_probs the tuple above.

    Raises:
        TypeError, ValueError: invalid arguments, named. NotImplementedError: return_attn_probs
        with dropout_p > 0, MPS tensors. FlashAttentionError: the library reported an error.
    """
    dropout_p = _validation.check_dropout_p(dropout_p)
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError("return_attn_probs=True with dropout_p > 0: flash_attn_varlen_func has no S_dmask; "
                                  "use flash_attn_func's (return_attn_probs) or flash_attention_metal.dropout.s_dmask")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise NotImplementedError(f"{name} is on {t.device}: flash_attn_varlen_func runs on CPU tensors only")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D (total_q, nheads, headdim), got shape {tuple(q.shape)}")
    scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[2])
    left, right = _validation.check_window_size(window_size) or (-1, -1)
    if block_table is not None:
        if dropout_p > 0 or return_attn_probs:
            raise NotImplementedError("flash_attn_varlen_func with block_table runs without dropout_p and "
                                      "return_attn_probs (paged K/V is forward-only inference): pass dropout_p=0.0 "
                                      "and return_attn_probs=False")
        return _paged_varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                     alibi_slopes, scale, causal, (left, right), softcap)
    out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, scale,
                              bool(causal), left, right, float(softcap), *draw_dropout(dropout_p, q.device))
    return (out, lse, q.new_empty((0,))) if return_attn_probs else out
