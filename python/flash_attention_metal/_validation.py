"""Argument checks that run before any native call: what only Python can check.

One rule per check; each error names the argument and the rule. Types and dtypes raise TypeError
(never a silent cast), shapes and values raise ValueError. Checked here: Python types and dtypes,
how the arrays' shapes agree (the library sees one set of sizes, not each array), conversions to
the ABI's C types (a dimension beyond uint32, a scale beyond float32), and host data (NaN in a
mask, non-finite slopes, table values). A rule of the sizes the library enforces itself (the largest
head_dim per dtype, num_heads a multiple of num_kv_heads, dropout_p in [0, 1)) has no copy here:
its message reaches the caller as ``errors.ArgumentError``, a ValueError, before anything is written.

Shapes are given in the call's ``layout``: ``"bhsd"`` (batch, heads, seqlen, head_dim), PyTorch's
and MLX's order, or ``"bshd"`` (batch, seqlen, heads, head_dim), FlashAttention's. v, out and dout
have head_dim_v as their last axis, which may differ from head_dim (DeepSeek's MLA: 192 and 128).
attn_mask is indexed (batch, num_heads, seqlen_q, seqlen_k) in both layouts.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .reference import NO_WINDOW

_UINT32_MAX = 2**32 - 1

#: The dtypes of q, k, v, dout and the outputs (one per call); lse is always float32.
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
#: The axis orders a call accepts, by name.
LAYOUTS = {
    "bhsd": ("batch", "num_heads", "seqlen", "head_dim"),
    "bshd": ("batch", "seqlen", "num_heads", "head_dim"),
}


@dataclass(frozen=True)
class Shape:
    """The dimensions of one attention problem, as the C ABI's fa_problem takes them.

    head_dim_v (the last axis of v, out, dout, dv) is head_dim when left at None.
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)


def check_layout(layout) -> str:
    """``layout`` must be ``"bhsd"`` or ``"bshd"``; returns it."""
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str ('bhsd' or 'bshd'), got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be 'bhsd' (batch, num_heads, seqlen, head_dim) or 'bshd' "
            f"(batch, seqlen, num_heads, head_dim), got {layout!r}"
        )
    return layout


def to_bhsd(array: np.ndarray, layout: str) -> np.ndarray:
    """The (batch, heads, seqlen, head_dim) view of a 4-D array given in ``layout`` (no copy)."""
    return array if layout == "bhsd" else array.transpose(0, 2, 1, 3)


def _dtype_names(dtypes) -> str:
    names = [d.name for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_array(name: str, array, dtypes=DTYPES, ndim: int | None = 4) -> None:
    """Checks that ``array`` is a NumPy array of one of ``dtypes`` with ``ndim`` dimensions (any
    number for None), none empty or beyond uint32."""
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy masked array; masked arrays are not supported (the mask would be "
            f"ignored): pass {name}.filled(value) or {name}.data"
        )
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    native = array.dtype.newbyteorder("=")
    if array.dtype not in dtypes and native in dtypes:
        order = {">": "big-endian", "<": "little-endian"}.get(array.dtype.byteorder, array.dtype.byteorder)
        raise TypeError(
            f"{name} must be native-byte-order {native.name}, got {order} "
            f"{array.dtype.name} ({array.dtype.str!r}); convert it explicitly, "
            f"e.g. {name}.astype(numpy.{native.name})"
        )
    if array.dtype not in dtypes:
        raise TypeError(
            f"{name} must have dtype {_dtype_names(dtypes)}, got {array.dtype.name} "
            f"(convert it explicitly, e.g. {name}.astype(numpy.{dtypes[0].name}))"
        )
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {array.ndim}-D with shape {array.shape}")
    # Sizes of 0 and beyond uint32 are the library's rules too, checked here first: the default scale
    # divides by sqrt(head_dim), and a size beyond uint32 does not fit the ABI's fields.
    if 0 in array.shape:
        raise ValueError(f"{name} has a zero-sized dimension (shape {array.shape}); every dimension must be >= 1")
    if max(array.shape, default=0) > _UINT32_MAX:
        raise ValueError(f"{name} has a dimension above 2**32 - 1 (shape {array.shape})")


_INT32 = np.dtype(np.int32)


def check_int32_array(name: str, value) -> np.ndarray:
    """``value`` itself when it is a NumPy array (not a masked one) of native-order int32, the
    dtype of the tables the kernels read (cu_seqlens, block tables, cache lengths); else TypeError
    naming ``name``."""
    if not isinstance(value, np.ndarray) or isinstance(value, np.ma.MaskedArray):
        raise TypeError(f"{name} must be a numpy.ndarray of int32, got {type(value).__name__}")
    if value.dtype != _INT32:
        raise TypeError(f"{name} must have dtype int32 (native byte order), got {value.dtype.name} "
                        f"({value.dtype.str!r}); convert it explicitly, e.g. {name}.astype(numpy.int32)")
    return value


def check_causal(causal) -> bool:
    """``causal`` must be a bool (Python or NumPy); returns it as a Python bool."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return bool(causal)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def resolve_softmax_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """The scale to use: 1/sqrt(head_dim) for None, else a real number (not a bool; a 0-d NumPy
    array of one is taken as its value) that is finite
    and representable as a float32 (the ABI's type). Errors call the value ``name`` (MLX's
    signature calls it ``scale``)."""
    # Checked here, not left to the library (which refuses a non-finite scale): it sees only the float32
    # the value rounds to (1e39 would reach it as inf), and MLX's front end calls it scale.
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, np.ndarray) and softmax_scale.ndim == 0 and softmax_scale.dtype.kind in "iuf":
        softmax_scale = softmax_scale.item()  # np.array(0.1), as NumPy users pass a scalar
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(softmax_scale).__name__}")
    try:
        value = float(softmax_scale)
    except OverflowError:
        raise ValueError(f"{_scale_rule(name)}, got {_short_repr(softmax_scale)}") from None
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{_scale_rule(name)}, got {value}")
    return value


# The rules' texts are made only for an error: torch.compile traces the checks of
# flash_attention_metal.torch, and it cannot trace a format specification.
def _scale_rule(name: str) -> str:
    return f"{name} must be finite and representable as float32 (|{name}| <= {_FLOAT32_MAX:.7g})"


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_same_dtype(name: str, array: np.ndarray, q: np.ndarray) -> None:
    """``array`` (k, v, dout, out) must have q's dtype: one dtype per call."""
    if array.dtype != q.dtype:
        raise TypeError(
            f"{name} must have q's dtype {q.dtype.name}, got {array.dtype.name} (q, k, v, dout and "
            f"out share one dtype; convert explicitly, e.g. {name}.astype(q.dtype))"
        )


def check_qkv(q, k, v, layout: str = "bhsd") -> Shape:
    """Checks q (B, H, Nq, D), k (B, H_kv, Nk, D) and v (B, H_kv, Nk, Dv), axes in ``layout``
    order, all of one dtype of ``DTYPES``, and returns the shape. The rules of the shape itself (head_dim
    at most the dtype's largest, H a multiple of H_kv) are the library's.
    """
    layout = check_layout(layout)
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_array(name, array)
    check_same_dtype("k", k, q)
    check_same_dtype("v", v, q)
    batch, num_heads, seqlen_q, head_dim = to_bhsd(q, layout).shape
    k_batch, num_kv_heads, seqlen_k, k_head_dim = to_bhsd(k, layout).shape
    if k_batch != batch:
        raise ValueError(f"k batch size {k_batch} must equal q batch size {batch}")
    if k_head_dim != head_dim:
        raise ValueError(f"k head_dim {k_head_dim} must equal q head_dim {head_dim}")
    if v.shape[:3] != k.shape[:3]:
        axes = ", ".join(LAYOUTS[layout][:3])
        raise ValueError(
            f"v shape {v.shape} must equal k shape {k.shape} but for the last axis (head_dim_v): "
            f"({axes}) in layout {layout!r}"
        )
    return Shape(batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim, v.shape[3])


def check_forward(q, k, v, causal, softmax_scale, layout="bhsd",
                  **options) -> tuple[Shape, bool, float, ScoreOptions]:
    """Every forward check of this module: returns (shape, causal, softmax_scale, the score
    options); ``options`` are attn_mask, window_size, softcap, alibi_slopes and sinks."""
    shape = check_qkv(q, k, v, layout)
    causal = check_causal(causal)
    scale = resolve_softmax_scale(softmax_scale, shape.head_dim)
    return shape, causal, scale, check_score_options(shape, q.dtype, **options)


def check_backward(dout, q, k, v, out, lse, causal, softmax_scale, layout="bhsd",
                   **options) -> tuple[Shape, bool, float, ScoreOptions]:
    """Every backward check of this module, as ``check_forward``."""
    shape = check_qkv(q, k, v, layout)
    check_like_q("dout", dout, q, shape.head_dim_v)
    check_like_q("out", out, q, shape.head_dim_v)
    check_lse(lse, shape)
    causal = check_causal(causal)
    scale = resolve_softmax_scale(softmax_scale, shape.head_dim)
    return shape, causal, scale, check_score_options(shape, q.dtype, **options)


def check_like_q(name: str, array, q: np.ndarray, head_dim_v: int) -> None:
    """Checks a tensor that must have q's dtype and q's shape with head_dim_v last (dout, out)."""
    check_array(name, array)
    check_same_dtype(name, array, q)
    expected = q.shape[:3] + (head_dim_v,)
    if array.shape != expected:
        raise ValueError(
            f"{name} shape {array.shape} must equal q shape {q.shape} with head_dim_v {head_dim_v} "
            f"as the last axis: {expected}"
        )


def check_lse(lse, shape: Shape) -> None:
    """Checks lse: float32 of shape (batch, num_heads, seqlen_q), as forward returned it. Its
    values are not checked: NaN or +inf (a row with a NaN or +inf score) give that row NaN
    gradients, -inf (a row without visible keys) zero gradients."""
    check_array("lse", lse, dtypes=(np.dtype(np.float32),), ndim=3)
    expected = (shape.batch, shape.num_heads, shape.seqlen_q)
    if lse.shape != expected:
        raise ValueError(f"lse shape {lse.shape} must be (batch, num_heads, seqlen_q) = {expected}")


def check_merge(out_a, lse_a, out_b, lse_b) -> tuple[int, int]:
    """Checks the two parts of ``merge_attention``: out_a, out_b of one dtype (float16, bfloat16
    or float32) and shape (..., head_dim); lse_a, lse_b float32 of shape (...), the same leading
    shape. Returns (rows, head_dim), rows being the product of the leading dimensions (at most
    2**32 - 1; head_dim at most the library's largest is its rule)."""
    check_array("out_a", out_a, ndim=None)
    if out_a.ndim < 1:
        raise ValueError("out_a must have at least 1 dimension (..., head_dim), got a 0-D array")
    check_array("out_b", out_b, dtypes=(out_a.dtype,), ndim=None)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b shape {out_b.shape} must equal out_a shape {out_a.shape}")
    leading = out_a.shape[:-1]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_array(name, lse, dtypes=(np.dtype(np.float32),), ndim=None)
        if lse.shape != leading:
            raise ValueError(f"{name} shape {lse.shape} must be out_a's shape without head_dim, {leading}")
    rows = math.prod(leading)
    # The library's rule too, checked here first: the call copies broadcast views of this many rows.
    if rows > _UINT32_MAX:
        raise ValueError(f"out_a has {rows} rows (the product of its leading dimensions {leading}); "
                         f"at most 2**32 - 1 are supported")
    return rows, out_a.shape[-1]


# ---- score options: attn_mask, window_size, softcap, alibi_slopes, sinks -------------------------
# Names and meanings follow FlashAttention (window_size, softcap, alibi_slopes) and PyTorch
# (attn_mask: True = may attend, or additive); the math is in ``reference``.

_INT32_MAX = 2**31 - 1
_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class ScoreOptions:
    """The checked score options of one call; the defaults leave every one of them off.

    window: (left, right), or None for (-1, -1); softcap: 0.0 is off; attn_mask: None or the mask
    as a 4-D view indexed (batch, num_heads, seqlen_q, seqlen_k) whose axes are each 1 or the
    problem's size (an axis NumPy broadcast with stride 0 cut to one slice: never expanded);
    alibi_slopes: C-contiguous float32 (num_heads,) or (batch, num_heads), or None; sinks:
    C-contiguous float32 (num_heads,), or None; dropout: (dropout_p, dropout_seed, dropout_offset)
    with dropout_p other than 0, or None.
    """

    window: tuple[int, int] | None = None
    softcap: float = 0.0
    attn_mask: np.ndarray | None = None
    alibi_slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None
    dropout: tuple[float, int, int] | None = None


def check_dropout_p(dropout_p) -> float:
    """dropout_p must be a real number (not a bool); returns it as a float. Its range, [0, 1), is
    the library's rule (``ArgumentError`` naming dropout_p)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    return float(dropout_p)


def check_dropout(dropout_p, dropout_seed, dropout_offset) -> tuple[float, int, int] | None:
    """dropout_p must be a real number (``check_dropout_p``); with dropout_p other than 0,
    dropout_seed an int in [0, 2**64) and dropout_offset one in [0, 2**64) (the ABI's uint64
    fields). Returns (dropout_p, dropout_seed, dropout_offset), or None for dropout_p 0 (the seed
    is then not needed)."""
    check_dropout_p(dropout_p)
    for name, value in (("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset)):
        if value is None and name == "dropout_seed":
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= int(value) < 2**64:
            raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    if float(dropout_p) == 0.0:
        return None
    if dropout_seed is None:
        raise ValueError(f"dropout_seed must be given with dropout_p other than 0 (got dropout_p={dropout_p}): the backward "
                         "regenerates the forward's mask from it")
    return float(dropout_p), int(dropout_seed), int(dropout_offset)


def check_window_size(window_size) -> tuple[int, int] | None:
    """window_size must be a (left, right) tuple or list of ints, or a 1-D array or tensor of two
    integers (FlashAttention's tests pass ``torch.randint(0, n, (2,))``), each -1 (unbounded) or
    0 ... 2**31 - 1; returns it as Python ints, or None for (-1, -1)."""
    # Checked here, not left to the library: it sees the ABI's int32 fields window_left and
    # window_right, which a Python int may not fit, not the window_size the caller passed.
    def rule() -> str:
        return (f"window_size must be a (left, right) pair, each -1 (unbounded) or a number of keys from 0 to "
                f"{_INT32_MAX}, got {_short_repr(window_size)}")

    if getattr(window_size, "ndim", None) == 1 and hasattr(window_size, "tolist"):
        # A NumPy array, torch tensor or MLX array: its elements as Python numbers (integer
        # dtypes give ints; a float or bool dtype fails the element check below).
        window_size = window_size.tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(rule())
    for side in window_size:
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise TypeError(f"{rule()} (a {type(side).__name__} in it)")
        if not -1 <= int(side) <= _INT32_MAX:
            raise ValueError(rule())
    left, right = (int(side) for side in window_size)
    return None if (left, right) == NO_WINDOW else (left, right)


def check_softcap(softcap) -> float:
    """softcap must be a real number (not a bool), finite and >= 0 (0 is off), within float32's
    range and not rounding to 0 in float32 when positive; returns it as a float."""
    # Checked on the Python value (as softmax_scale): the library sees only its float32 rounding.
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0.0 is off), got {type(softcap).__name__}")
    def rule() -> str:
        return f"softcap must be finite and >= 0 (0 is off; at most {_FLOAT32_MAX:.7g}, a float32)"

    try:
        value = float(softcap)
    except OverflowError:
        raise ValueError(f"{rule()}, got {_short_repr(softcap)}") from None
    if not math.isfinite(value) or value < 0 or value > _FLOAT32_MAX:
        raise ValueError(f"{rule()}, got {value}")
    # At most half float32's smallest subnormal (2**-149), a value rounds to 0 in float32.
    if 0 < value <= 2.0**-150:
        raise ValueError(f"softcap {value} rounds to 0 in float32, which turns it off; pass 0.0 or a larger value")
    return value


def _first_index(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def check_float32_vector(name: str, array, shapes: dict) -> np.ndarray:
    """``array`` must be a float32 NumPy array of one of ``shapes`` (label -> shape, e.g.
    "(num_heads,)" -> (12,)) holding finite values; returns it C-contiguous (copied only when it is
    not)."""
    if isinstance(array, np.ma.MaskedArray) or not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(array).__name__}")
    if array.dtype != _FLOAT32:
        raise TypeError(
            f"{name} must have dtype float32 (native byte order), got {array.dtype.name} ({array.dtype.str!r}); "
            f"convert it explicitly, e.g. {name}.astype(numpy.float32)"
        )
    if array.shape not in shapes.values():
        wanted = " or ".join(f"{label} = {shape}" for label, shape in shapes.items())
        raise ValueError(f"{name} shape {array.shape} must be {wanted}")
    bad = ~np.isfinite(array)
    if bad.any():
        index = _first_index(bad)
        raise ValueError(f"{name} must be finite, got {array[index]} at index {index}")
    return np.ascontiguousarray(array)


def check_attn_mask(attn_mask, shape: Shape, dtype) -> np.ndarray:
    """attn_mask must be a bool array (True = may attend) or an additive one of the call's dtype or
    float32 (-inf hides a key; NaN and +inf are errors), 1-D to 4-D and broadcastable to (batch,
    num_heads, seqlen_q, seqlen_k) by NumPy's rules, whatever the layout of q, k, v. Returns the
    4-D view of ``ScoreOptions.attn_mask``."""
    target = (shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k)
    dtype = np.dtype(dtype)
    allowed = (np.dtype(bool), dtype) + (() if dtype == _FLOAT32 else (_FLOAT32,))
    if isinstance(attn_mask, np.ndarray) and not 1 <= attn_mask.ndim <= 4:
        raise ValueError(
            f"attn_mask must be 1-D to 4-D, broadcastable to (batch, num_heads, seqlen_q, seqlen_k) = {target}, "
            f"got {attn_mask.ndim}-D with shape {attn_mask.shape}"
        )
    check_array("attn_mask", attn_mask, dtypes=allowed, ndim=getattr(attn_mask, "ndim", 4))
    mask = attn_mask[(np.newaxis,) * (4 - attn_mask.ndim)]
    if any(size not in (1, want) for size, want in zip(mask.shape, target)):
        raise ValueError(
            f"attn_mask shape {attn_mask.shape} is not broadcastable to (batch, num_heads, seqlen_q, seqlen_k) = "
            f"{target} (each axis, counted from the last, must be 1 or the problem's size)"
        )
    # An axis that NumPy already broadcasts (stride 0) is one slice repeated: keep that slice.
    mask = mask[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in mask.strides)]
    if mask.dtype != bool:
        for test, what in ((np.isnan, "NaN"), (np.isposinf, "+inf")):
            bad = test(mask)
            if bad.any():
                raise ValueError(
                    f"attn_mask holds {what} (first at index {_first_index(bad)} of its 4-D form): an additive "
                    f"mask must not hold NaN or +inf (its rows would be NaN); use -inf to hide a key"
                )
    return mask


def check_score_options(shape: Shape, dtype, *, attn_mask=None, window_size=NO_WINDOW, softcap=0.0,
                        alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                        dropout_offset=0) -> ScoreOptions:
    """Every check of the score options of a call whose q has ``dtype``."""
    heads = {"(num_heads,)": (shape.num_heads,)}
    return ScoreOptions(
        window=check_window_size(window_size),
        softcap=check_softcap(softcap),
        attn_mask=None if attn_mask is None else check_attn_mask(attn_mask, shape, dtype),
        alibi_slopes=None if alibi_slopes is None else check_float32_vector(
            "alibi_slopes", alibi_slopes, {**heads, "(batch, num_heads)": (shape.batch, shape.num_heads)}),
        sinks=None if sinks is None else check_float32_vector("sinks", sinks, heads),
        dropout=check_dropout(dropout_p, dropout_seed, dropout_offset),
    )
