"""Argument checks that run before any native call.

One rule per check; each error names the argument and the rule. Types and dtypes raise TypeError
(never a silent cast), shapes and values raise ValueError. The C ABI repeats the checks so that C and
Swift callers get them too.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Shape:
    """The dimensions of one attention problem, as the C ABI's fa_problem takes them."""

    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


def check_array(name: str, array, dtype=np.float16, ndim: int | None = 4) -> None:
    """Checks that ``array`` is a NumPy array of ``dtype`` with ``ndim`` dimensions (any number for
    None), none empty or beyond uint32."""
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy masked array; masked arrays are not supported (the mask would be "
            f"ignored): pass {name}.filled(value) or {name}.data"
        )
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    if array.dtype != dtype and array.dtype.newbyteorder("=") == dtype:
        order = {">": "big-endian", "<": "little-endian"}.get(array.dtype.byteorder, array.dtype.byteorder)
        raise TypeError(
            f"{name} must be native-byte-order {np.dtype(dtype).name}, got {order} "
            f"{array.dtype.name} ({array.dtype.str!r}); convert it explicitly, "
            f"e.g. {name}.astype(numpy.{np.dtype(dtype).name})"
        )
    if array.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {np.dtype(dtype).name}, got {array.dtype.name} "
            f"(convert it explicitly, e.g. {name}.astype(numpy.{np.dtype(dtype).name}))"
        )
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {array.ndim}-D with shape {array.shape}")
    if 0 in array.shape:
        raise ValueError(f"{name} has a zero-sized dimension (shape {array.shape}); every dimension must be >= 1")
    if max(array.shape, default=0) > _UINT32_MAX:
        raise ValueError(f"{name} has a dimension above 2**32 - 1 (shape {array.shape})")


def check_causal(causal) -> bool:
    """``causal`` must be a bool (Python or NumPy); returns it as a Python bool."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return bool(causal)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale to use: 1/sqrt(head_dim) for None, else a real number (not a bool) that is finite
    and representable as a float32 (the ABI's type)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    rule = f"softmax_scale must be finite and representable as float32 (|softmax_scale| <= {_FLOAT32_MAX:.7g})"
    try:
        value = float(softmax_scale)
    except OverflowError:
        raise ValueError(f"{rule}, got {_short_repr(softmax_scale)}") from None
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{rule}, got {value}")
    return value


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_qkv(q, k, v) -> Shape:
    """Checks q (B, H, Nq, D), k and v (B, H_kv, Nk, D), all float16, and returns the shape.

    Needs no library; the upper bound of head_dim does (``check_head_dim``).
    """
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_array(name, array)
    batch, num_heads, seqlen_q, head_dim = q.shape
    _, num_kv_heads, seqlen_k, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k batch size {k.shape[0]} must equal q batch size {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim {k.shape[3]} must equal q head_dim {head_dim}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape} (batch, num_kv_heads, seqlen_k, head_dim)")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_heads {num_heads} must be divisible by k/v num_kv_heads {num_kv_heads} (GQA/MQA)"
        )
    return Shape(batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim)


def check_head_dim(shape: Shape, max_head_dim: int) -> None:
    """head_dim must be within 1..max_head_dim, the library's ``fa_max_head_dim()``."""
    if not 1 <= shape.head_dim <= max_head_dim:
        raise ValueError(f"head_dim {shape.head_dim} is outside the supported range 1..{max_head_dim}")


def check_forward(q, k, v, causal, softmax_scale) -> tuple[Shape, bool, float]:
    """Every forward check that needs no library: returns (shape, causal, softmax_scale)."""
    shape = check_qkv(q, k, v)
    return shape, check_causal(causal), resolve_softmax_scale(softmax_scale, shape.head_dim)


def check_backward(dout, q, k, v, out, lse, causal, softmax_scale) -> tuple[Shape, bool, float]:
    """Every backward check that needs no library: returns (shape, causal, softmax_scale)."""
    shape = check_qkv(q, k, v)
    check_like_q("dout", dout, q.shape)
    check_like_q("out", out, q.shape)
    check_lse(lse, shape)
    return shape, check_causal(causal), resolve_softmax_scale(softmax_scale, shape.head_dim)


def check_like_q(name: str, array, q_shape: tuple) -> None:
    """Checks a float16 tensor that must have q's shape (dout, out)."""
    check_array(name, array)
    if array.shape != q_shape:
        raise ValueError(f"{name} shape {array.shape} must equal q shape {q_shape}")


def check_lse(lse, shape: Shape) -> None:
    """Checks lse: float32 of shape (batch, num_heads, seqlen_q), as forward returned it."""
    check_array("lse", lse, dtype=np.float32, ndim=3)
    expected = (shape.batch, shape.num_heads, shape.seqlen_q)
    if lse.shape != expected:
        raise ValueError(f"lse shape {lse.shape} must be (batch, num_heads, seqlen_q) = {expected}")


def check_merge(out_a, lse_a, out_b, lse_b) -> tuple[int, int]:
    """Checks the two parts of ``merge_attention``: out_a, out_b float16 of one shape
    (..., head_dim); lse_a, lse_b float32 of shape (...), the same leading shape. Returns
    (rows, head_dim), rows being the product of the leading dimensions (at most 2**32 - 1)."""
    check_array("out_a", out_a, ndim=None)
    if out_a.ndim < 1:
        raise ValueError("out_a must have at least 1 dimension (..., head_dim), got a 0-D array")
    check_array("out_b", out_b, ndim=None)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b shape {out_b.shape} must equal out_a shape {out_a.shape}")
    leading = out_a.shape[:-1]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_array(name, lse, dtype=np.float32, ndim=None)
        if lse.shape != leading:
            raise ValueError(f"{name} shape {lse.shape} must be out_a's shape without head_dim, {leading}")
    rows = math.prod(leading)
    if rows > _UINT32_MAX:
        raise ValueError(f"out_a has {rows} rows (the product of its leading dimensions {leading}); "
                         f"at most 2**32 - 1 are supported")
    return rows, out_a.shape[-1]
