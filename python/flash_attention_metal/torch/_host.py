"""The operators on CPU tensors: the library's CPU engine through the C ABI, each tensor's
``data_ptr()`` handed over in place (bfloat16 has no NumPy dtype, and no copy is needed).

Checks that need the data (an additive attn_mask free of NaN and +inf, finite ALiBi slopes) run
here, on host memory; the MPS path cannot make them without a synchronisation.
"""

from __future__ import annotations

import threading

import torch

from ..context import Context
from ._tensors import backward_call, distinct, forward_call

_lock = threading.Lock()
_context: Context | None = None


def context() -> Context:
    """The CPU-engine context that the CPU tensors of every call run on, made on first use."""
    global _context
    with _lock:
        if _context is None:
            _context = Context("cpu")
        return _context


def _check_data(attn_mask, alibi_slopes) -> None:
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        # On the mask's distinct values: a broadcast mask is never expanded in memory.
        values = distinct(attn_mask)
        for bad, what in ((torch.isnan(values), "NaN"), (torch.isposinf(values), "+inf")):
            if bad.any():
                index = tuple(int(i) for i in bad.nonzero()[0])
                raise ValueError(f"attn_mask holds {what} (first at index {index} of its 4-D form): an additive "
                                 "mask must not hold NaN or +inf (its rows would be NaN); use -inf to hide a key")
    if alibi_slopes is not None and not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError("alibi_slopes must be finite")


def _pointers(ffi, call, roles):
    return [ffi.cast("float *" if role == "lse" else "void *", call.tensors[role].data_ptr()) for role in roles]


def forward(q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, dropout=None):
    """(out, lse) of fa_forward; arguments as the forward operator's (``window`` None or a pair,
    ``dropout`` None or (dropout_p, seed, offset))."""
    _check_data(attn_mask, alibi_slopes)
    ctx = context()
    out, lse, call = forward_call(ctx._native, q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap,
                                  bshd, torch.Tensor.data_ptr, dropout)
    ctx._call("fa_forward", call.problem, *_pointers(ctx._native.ffi, call, ("q", "k", "v", "out", "lse")))
    return out, lse


def backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, dropout=None):
    """(dq, dk, dv) of fa_backward; arguments as the backward operator's."""
    _check_data(attn_mask, alibi_slopes)
    ctx = context()
    grads, call = backward_call(ctx._native, dout, q, k, v, out, lse, attn_mask, alibi_slopes, scale, causal,
                                window, softcap, bshd, torch.Tensor.data_ptr, dropout)
    roles = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    ctx._call("fa_backward", call.problem, *_pointers(ctx._native.ffi, call, roles))
    return grads
