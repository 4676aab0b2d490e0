"""The custom operators ``flash_attention_metal::forward`` and ``flash_attention_metal::backward``
(``torch.library.custom_op``), their fake implementations (shapes and strides without computing,
for ``torch.compile`` and FakeTensor tracing) and the autograd formula joining them.

Both take (batch, heads, seqlen, head_dim) views of any strides with the library's semantics:
``causal`` aligned bottom-right, the sliding window ``window_left``/``window_right`` (-1 unbounded),
``softcap`` (0 off), dropout (``dropout_p`` 0 off, the mask drawn from ``dropout_seed`` and
``dropout_offset``, each in [0, 2**63)), an optional attn_mask (4-D, each axis 1 or the problem's size; bool, the call's
dtype or float32) and optional ALiBi slopes (float32 (heads,) or (batch, heads)). ``bshd`` lays the
outputs out in memory as (batch, seqlen, heads, head_dim). CPU tensors run on the CPU engine
(``_host``), MPS tensors on the exported plan (``_mps``). lse has no gradient (it is marked
non-differentiable); attn_mask and alibi_slopes get none (the public functions refuse them when
they require one).

This module has no ``from __future__ import annotations``: custom_op reads the annotations as types.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _host, _mps
from ._tensors import new_output

_NAMESPACE = "flash_attention_metal"


def _window(left: int, right: int):
    return None if (left, right) == (-1, -1) else (left, right)


def _dropout(p: float, seed: int, offset: int):
    return None if p == 0.0 else (p, seed, offset)


@torch.library.custom_op(f"{_NAMESPACE}::forward", mutates_args=(), device_types="cpu")
def forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
            softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
            bshd: bool, dropout_p: float, dropout_seed: int, dropout_offset: int) -> tuple[Tensor, Tensor]:
    """(out, lse): out (B, H, Sq, Dv) in q's dtype, lse float32 (B, H, Sq), FlashAttention-2's forward."""
    return _host.forward(q, k, v, attn_mask, alibi_slopes, softmax_scale, causal, _window(window_left, window_right),
                         softcap, bshd, _dropout(dropout_p, dropout_seed, dropout_offset))


@forward.register_kernel("mps")
def _forward_mps(q, k, v, attn_mask, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, bshd,
                 dropout_p, dropout_seed, dropout_offset):
    return _mps.forward(q, k, v, attn_mask, alibi_slopes, softmax_scale, causal, _window(window_left, window_right),
                        softcap, bshd, _dropout(dropout_p, dropout_seed, dropout_offset))


@forward.register_fake
def _forward_fake(q, k, v, attn_mask, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, bshd,
                  dropout_p, dropout_seed, dropout_offset):
    out = new_output(q.shape[:3] + (v.shape[3],), q.dtype, q.device, bshd)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::backward", mutates_args=(), device_types="cpu")
def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor],
             alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int, window_right: int,
             softcap: float, bshd: bool, dropout_p: float, dropout_seed: int,
             dropout_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from dout and the forward's q, k, v, out, lse (FlashAttention-2, Algorithm 2)."""
    return _host.backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes, softmax_scale, causal,
                          _window(window_left, window_right), softcap, bshd,
                          _dropout(dropout_p, dropout_seed, dropout_offset))


@backward.register_kernel("mps")
def _backward_mps(dout, q, k, v, out, lse, attn_mask, alibi_slopes, softmax_scale, causal, window_left, window_right,
                  softcap, bshd, dropout_p, dropout_seed, dropout_offset):
    return _mps.backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes, softmax_scale, causal,
                         _window(window_left, window_right), softcap, bshd,
                         _dropout(dropout_p, dropout_seed, dropout_offset))


@backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, attn_mask, alibi_slopes, softmax_scale, causal, window_left, window_right,
                   softcap, bshd, dropout_p, dropout_seed, dropout_offset):
    return tuple(new_output(t.shape, q.dtype, q.device, bshd) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    # options: the scalars from softmax_scale on, dropout's seed and offset included (the backward
    # regenerates the forward's mask from them).
    q, k, v, attn_mask, alibi_slopes, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _forward_backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes, *ctx.options)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.options))


forward.register_autograd(_forward_backward, setup_context=_setup_context)
