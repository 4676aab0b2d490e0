"""How torch tensors reach the library, on either device: the (batch, heads, seqlen, head_dim)
views it reads in place, attn_mask's ABI form, the memory layout of the outputs, and the
``fa_problem`` of a call.

The ABI addresses a tensor by element [0, 0, 0, 0] and three element strides (``fa_strides``), its
last axis contiguous: any such view (a transpose of FlashAttention's (batch, seqlen, heads,
head_dim) layout, a slice of a packed QKV projection) is used in place; others, and views that
repeat memory through a zero stride (``expand``), are copied once.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from .._abi import abi_strides, mask_kind, mask_strides, new_problem, set_score_fields
from .._validation import Shape

#: The dtypes of q, k, v, dout and the outputs (one per call); lse is float32.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float16"`` for torch.float16, and so on."""
    return str(dtype).rpartition(".")[2]


def check_index(name: str, t) -> None:
    """An index table (cu_seqlens, cache_seqlens, block_table, cache_batch_idx) must be an int32
    tensor, FlashAttention's dtype for it; else TypeError with PyTorch's conversion (torch.tensor
    of Python ints is int64)."""
    if isinstance(t, torch.Tensor) and t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor (FlashAttention's dtype for it), got {t.dtype}; convert "
                        f"it with {name}.to(torch.int32)")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of CPU tensor ``t`` (same memory, so writes reach the tensor); bfloat16 as
    ml_dtypes.bfloat16 through its bits."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor on NumPy array ``a``'s memory (the inverse of ``as_numpy``)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def shape_of(q, k, v) -> Shape:
    """The problem's sizes from (B, H, S, D) q, k, v."""
    batch, num_heads, seqlen_q, head_dim = q.shape
    return Shape(batch, num_heads, k.shape[1], seqlen_q, k.shape[2], head_dim, v.shape[3])


def abi_tensor(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A (B, H, S, D) tensor as the ABI takes it (``_abi.abi_strides``, the rules of every front
    end): itself when the ABI can address it in place, else a contiguous copy; and its (batch,
    head, seq) element strides."""
    strides = abi_strides(t.shape, t.stride())
    if strides is None:
        t = t.contiguous()
        strides = abi_strides(t.shape, t.stride())
    return t, strides


def distinct(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask with every axis that repeats one slice (stride 0, from ``expand``) cut to that slice:
    its distinct values, a view."""
    return mask[tuple(slice(0, 1) if size > 1 and stride == 0 else slice(None)
                      for size, stride in zip(mask.shape, mask.stride()))]


def abi_mask(mask: torch.Tensor, seqlen_k: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A 4-D attn_mask whose axes are each 1 or the problem's size (broadcast ones expanded with
    stride 0) as the ABI takes it: its key axis contiguous and of seqlen_k elements (copied once when
    it is not, with its other axes kept as small as given), and its (batch, head, row) strides, 0
    for an axis of one slice (broadcast)."""
    mask = distinct(mask)
    if mask.shape[3] != seqlen_k or (seqlen_k > 1 and mask.stride(3) != 1):
        mask = mask.expand(*mask.shape[:3], seqlen_k).contiguous()
    return mask, mask_strides(mask.shape, mask.stride())


def new_output(shape, dtype: torch.dtype, device, bshd: bool) -> torch.Tensor:
    """An empty (B, H, S, D) tensor, laid out in memory as (B, S, H, D) when ``bshd`` (so that its
    transpose(1, 2) is contiguous, FlashAttention's layout) and contiguous otherwise. The real and
    the fake implementations of the operators both allocate through this, so their strides agree."""
    batch, heads, seqlen, dim = shape
    if bshd:
        return torch.empty((batch, seqlen, heads, dim), dtype=dtype, device=device).transpose(1, 2)
    return torch.empty((batch, heads, seqlen, dim), dtype=dtype, device=device)


@dataclass(frozen=True)
class Call:
    """One pass as the library takes it: its fa_problem and its tensors by role name ("q", "lse",
    "attn_mask", ...) in ABI form (the problem's strides are theirs; keep them alive for the call)."""

    problem: object
    tensors: dict


def _call(library, q, k, v, tensors: dict, attn_mask, alibi_slopes, *, scale, causal, window, softcap,
          address, dropout=None) -> Call:
    """The Call of (B, H, S, D) q, k, v with ``tensors`` (role -> tensor, lse included) and the
    options, every tensor but lse and the optional inputs put in ABI form here. ``address(t)`` is
    what the problem's pointer fields get for an optional input (its data_ptr() on the host, a
    presence marker for a plan). The library judges the sizes (head_dim, heads) when it is given
    the problem, before it writes anything."""
    shape = shape_of(q, k, v)
    views = {role: abi_tensor(t) for role, t in tensors.items() if role != "lse"}
    abi = {role: t for role, (t, _) in views.items()}
    abi["lse"] = tensors["lse"].contiguous()
    mask = alibi = None
    if attn_mask is not None:
        m, strides = abi_mask(attn_mask, k.shape[2])
        abi["attn_mask"] = m
        mask = (address(m), strides, mask_kind(dtype_name(m.dtype)))
    if alibi_slopes is not None:
        abi["alibi_slopes"] = slopes = alibi_slopes.contiguous()
        alibi = (address(slopes), slopes.dim() == 2)
    p = new_problem(library.ffi, library.lib, shape, causal, scale, dtype_name(q.dtype),
                    {role: strides for role, (_, strides) in views.items()})
    set_score_fields(p, library.ffi, library.lib, window=window, softcap=softcap, mask=mask, alibi=alibi,
                     dropout=dropout)
    return Call(p, abi)


def forward_call(library, q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, address,
                 dropout=None):
    """(out, lse, Call) of a forward pass: the outputs allocated (``new_output``; lse float32
    (B, H, S) contiguous) and the Call that writes them. Arguments as the forward operator's,
    ``window`` None or a pair, ``dropout`` None or (dropout_p, seed, offset); ``address`` as for
    ``_call``."""
    out = new_output(q.shape[:3] + (v.shape[3],), q.dtype, q.device, bshd)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    call = _call(library, q, k, v, {"q": q, "k": k, "v": v, "out": out, "lse": lse}, attn_mask, alibi_slopes,
                 scale=scale, causal=causal, window=window, softcap=softcap, address=address, dropout=dropout)
    return out, lse, call


def backward_call(library, dout, q, k, v, out, lse, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd,
                  address, dropout=None):
    """((dq, dk, dv), Call) of a backward pass, as ``forward_call``."""
    grads = tuple(new_output(t.shape, q.dtype, q.device, bshd) for t in (q, k, v))
    tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": grads[0], "dk": grads[1],
               "dv": grads[2]}
    call = _call(library, q, k, v, tensors, attn_mask, alibi_slopes, scale=scale, causal=causal, window=window,
                 softcap=softcap, address=address, dropout=dropout)
    return grads, call
