"""Variable-length batches (FlashAttention's ``flash_attn_varlen_func``): the checks of packed
tensors and cu_seqlens tables in host memory, and the calls through the C ABI's varlen fields
(``fa_problem.cu_seqlens_q`` and friends in flash_attention_metal.h).

A packed tensor (total, heads, dim) reaches the ABI as a one-entry (1, heads, total, dim) view in
place (its head and row strides), the tables as int32 pointers. The library clamps table values in
its kernels and cannot read them on the host; here they are checked before the call, and the grid
covers the longest sequence the table holds (a larger max_seqlen only adds threadgroups that exit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _abi, _layout
from ._validation import (
    DTYPES,
    Shape,
    ScoreOptions,
    check_array,
    check_causal,
    check_int32_array,
    check_same_dtype,
    check_score_options,
    resolve_softmax_scale,
)


@dataclass(frozen=True)
class Varlen:
    """A checked variable-length call: the packed shape (batch = sequences, seqlen = totals), the
    tables (C-contiguous int32), the longest sequences, and the other checked arguments."""

    shape: Shape
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_q: int
    max_k: int
    causal: bool
    scale: float
    options: ScoreOptions


def check_packed(name: str, array, dtypes=DTYPES) -> None:
    """A packed tensor: a 3-D NumPy array (total, heads, dim) of one of ``dtypes``; total may be 0
    (every sequence empty), the other axes not."""
    if isinstance(array, np.ndarray) and array.ndim == 3 and array.shape[0] == 0:
        array = np.empty((1,) + array.shape[1:], dtype=array.dtype)
    check_array(name, array, dtypes=dtypes, ndim=3)


def check_cu_seqlens(name: str, table, total: int, total_name: str) -> np.ndarray:
    """cu_seqlens: int32 of shape (batch + 1,), batch >= 1, starting at 0, non-decreasing, ending at
    ``total``; returns it C-contiguous."""
    check_int32_array(name, table)
    if table.ndim != 1 or table.shape[0] < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got shape {table.shape}")
    if table[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(table[0])}")
    steps = np.diff(table.astype(np.int64))
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(table[i])} > "
                         f"{name}[{i + 1}] = {int(table[i + 1])}")
    if table[-1] != total:
        raise ValueError(f"{name}[-1] ({int(table[-1])}) must equal {total_name} ({total}), the rows of the "
                         f"packed tensors")
    return np.ascontiguousarray(table)


def check_max_seqlen(name: str, value, table: np.ndarray, table_name: str) -> int:
    """max_seqlen: an int at least the longest sequence of ``table``; returns that longest length."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    longest = int(np.max(np.diff(table.astype(np.int64))))
    if value < longest:
        raise ValueError(f"{name} ({int(value)}) must be at least the longest sequence of {table_name} ({longest})")
    return longest


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 **options) -> Varlen:
    """Every check of a varlen call that needs no library (options: window_size, softcap,
    alibi_slopes (num_heads,) or (batch, num_heads), sinks)."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_packed(name, array)
    check_same_dtype("k", k, q)
    check_same_dtype("v", v, q)
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, k_head_dim = k.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k head_dim {k_head_dim} must equal q head_dim {head_dim}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape} but for the last axis (head_dim_v)")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q (q.shape[0])")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k (k.shape[0])")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q shape {cu_q.shape} and cu_seqlens_k shape {cu_k.shape} must be equal "
                         f"(one entry per sequence, plus one)")
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    shape = Shape(len(cu_q) - 1, num_heads, num_kv_heads, total_q, total_k, head_dim, v.shape[2])
    if "attn_mask" in options:
        raise TypeError("forward_varlen and backward_varlen take no attn_mask (sequences are the mask)")
    return Varlen(shape, cu_q, cu_k, max_q, max_k, check_causal(causal),
                  resolve_softmax_scale(softmax_scale, head_dim), check_score_options(shape, q.dtype, **options))


def check_packed_like_q(name: str, array, q: np.ndarray, head_dim_v: int) -> None:
    """dout and out: q's dtype and q's shape with head_dim_v last."""
    check_packed(name, array)
    check_same_dtype(name, array, q)
    expected = q.shape[:2] + (head_dim_v,)
    if array.shape != expected:
        raise ValueError(f"{name} shape {array.shape} must be (total_q, num_heads, head_dim_v) = {expected}")


def check_varlen_lse(lse, shape: Shape) -> np.ndarray:
    """lse: float32 (num_heads, total_q) as forward_varlen returned it (any values, as backward's)."""
    # An empty total_q gives an empty lse, which check_array (every dimension >= 1) would refuse.
    probe = np.empty((1, 1), dtype=lse.dtype) if isinstance(lse, np.ndarray) and lse.size == 0 else lse
    check_array("lse", probe, dtypes=(np.dtype(np.float32),), ndim=2)
    expected = (shape.num_heads, shape.seqlen_q)
    if lse.shape != expected:
        raise ValueError(f"lse shape {lse.shape} must be (num_heads, total_q) = {expected}")
    return np.ascontiguousarray(lse)


def _tensor(array: np.ndarray, output: bool = False) -> _layout.Tensor:
    """(total, heads, dim) as the "bshd" form of a one-entry batch, with explicit strides: the ABI
    reads all-zero strides of a varlen problem as contiguous (total, heads, dim), whereas
    ``_layout`` gives them to a (batch, heads, seqlen, dim)-contiguous view, e.g. one copied."""
    view = array[np.newaxis]
    tensor = _layout.as_output(view, "bshd") if output else _layout.as_input(view, "bshd")
    if tensor.strides != _layout.CONTIGUOUS:
        return tensor
    _, heads, rows, dim = tensor.array.shape
    return _layout.Tensor(tensor.array, tensor.address, (heads * rows * dim, rows * dim, dim))


def _problem(context, checked: Varlen, dtype, tensors: dict):
    library = context._native
    problem, keep = _abi.numpy_problem(library, checked.shape, checked.causal, checked.scale, dtype, tensors,
                                       checked.options)
    _abi.set_varlen_fields(problem, library.ffi, checked.cu_seqlens_q, checked.cu_seqlens_k, checked.max_q,
                           checked.max_k)
    return problem, keep


def _pointers(ffi, tensors: dict, names) -> list:
    return [_abi.pointer(ffi, tensors[name].address) for name in names]


def forward(context, q, k, v, checked: Varlen):
    """``Context.forward_varlen`` on checked arguments."""
    shape = checked.shape
    out = np.empty(q.shape[:2] + (shape.head_dim_v,), dtype=q.dtype)
    lse = np.empty((shape.num_heads, shape.seqlen_q), dtype=np.float32)
    if shape.seqlen_q == 0 or shape.seqlen_k == 0:
        # Nothing to attend to (the ABI takes at least one row and key): out 0, lse -inf or the sink,
        # for a call the library would take.
        _abi.check_sizes(context._native, shape, checked.causal, checked.scale, q.dtype, checked.options)
        out[...] = 0
        lse[...] = -np.inf if checked.options.sinks is None else checked.options.sinks[:, None]
        return out, lse
    tensors = {"q": _tensor(q), "k": _tensor(k), "v": _tensor(v), "out": _tensor(out, output=True)}
    problem, keep = _problem(context, checked, q.dtype, tensors)
    ffi = context._native.ffi
    context._call("fa_forward", problem, *_pointers(ffi, tensors, ("q", "k", "v", "out")),
                  ffi.from_buffer("float[]", lse, require_writable=True))
    del keep  # the arrays the problem points into lived until here
    return out, lse


def backward(context, dout, q, k, v, out, lse, checked: Varlen):
    """``Context.backward_varlen`` on checked arguments (dout, out, lse checked here)."""
    shape = checked.shape
    check_packed_like_q("dout", dout, q, shape.head_dim_v)
    check_packed_like_q("out", out, q, shape.head_dim_v)
    lse = check_varlen_lse(lse, shape)
    grads = [np.empty(like.shape, dtype=like.dtype) for like in (q, k, v)]
    sinks = checked.options.sinks
    if shape.seqlen_q == 0 or shape.seqlen_k == 0:
        _abi.check_sizes(context._native, shape, checked.causal, checked.scale, q.dtype, checked.options,
                         "FA_PASS_BACKWARD")
        for grad in grads:
            grad[...] = 0
        if sinks is not None:
            # Rows without keys have out 0, so D = 0 and every sink term is 0.
            grads.append(np.zeros(shape.num_heads, dtype=np.float32))
        return tuple(grads)
    tensors = {"dout": _tensor(dout), "q": _tensor(q), "k": _tensor(k), "v": _tensor(v), "out": _tensor(out)}
    tensors.update((name, _tensor(g, output=True)) for name, g in zip(("dq", "dk", "dv"), grads))
    problem, keep = _problem(context, checked, q.dtype, tensors)
    ffi = context._native.ffi
    if sinks is not None:
        grads.append(np.empty(shape.num_heads, dtype=np.float32))
        problem.dsinks = ffi.from_buffer("float[]", grads[3], require_writable=True)
    context._call("fa_backward", problem, *_pointers(ffi, tensors, ("dout", "q", "k", "v", "out")),
                  ffi.from_buffer("float[]", lse), *_pointers(ffi, tensors, ("dq", "dk", "dv")))
    del keep
    return tuple(grads)
