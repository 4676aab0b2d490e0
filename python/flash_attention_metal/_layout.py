"""How NumPy arrays reach the C ABI without copies: the copy fallback, and output allocation in
the layout of the inputs (the address rules, ``element_strides``, are ``_abi``'s).

The ABI (``fa_strides`` in flash_attention_metal.h) addresses a [batch][heads][seqlen][head_dim]
tensor whose last axis is contiguous through three element strides, all zero meaning the
contiguous layout. So any view of one of the ABI's dtypes whose last axis is contiguous (a
(B, L, H, D) array, ``qkv[:, :, 0]`` of a (B, L, 3, H, D) projection, a slice along the sequence)
is passed in place: a pointer to its element [0, 0, 0, 0] and its strides. Other arrays (last axis
strided, negative or zero strides, misaligned data) are copied once, to the contiguous layout.

Outputs are new arrays laid out like their input, or arrays the caller provides (``out=`` and
friends: e.g. the NumPy views of MLX arrays that ``flash_attention_metal.mlx`` has the library write
into); those must be addressable in place, as an output is never copied back.
"""

from __future__ import annotations

import numpy as np

from ._abi import CONTIGUOUS, Tensor, element_strides
from ._validation import check_array, to_bhsd


def as_input(array: np.ndarray, layout: str) -> Tensor:
    """The ABI form of an input given in ``layout``: in place when ``element_strides`` allows,
    else a contiguous copy."""
    view = to_bhsd(array, layout)
    strides = element_strides(view)
    if strides is None:
        view = np.ascontiguousarray(view)
        strides = CONTIGUOUS
    return Tensor(view, view.ctypes.data, strides)


def new_output(like: np.ndarray, last_dim: int) -> np.ndarray:
    """A fresh array shaped like ``like`` (in the caller's layout) with ``last_dim`` as its last
    axis, laid out in memory like ``like`` (NumPy's order "K", as ``torch.empty_like``), or
    C-contiguous when that order would not have a contiguous last axis."""
    shape = like.shape[:-1] + (last_dim,)
    result = np.empty_like(like, shape=shape)
    if element_strides(result) is None:
        result = np.empty(shape, dtype=like.dtype)
    return result


def as_output(array: np.ndarray, layout: str) -> Tensor:
    """The ABI form of an output made by ``new_output`` or checked by ``check_given_output``
    (addressable in place by construction or by check)."""
    view = to_bhsd(array, layout)
    strides = element_strides(view)
    assert strides is not None, "outputs are addressable in place"
    return Tensor(view, view.ctypes.data, strides)


def check_given_output(name: str, array, dtype: np.dtype, shape: tuple[int, ...], layout: str,
                       inputs: dict[str, np.ndarray]) -> None:
    """Checks an output the caller provides: a NumPy array of ``dtype`` and ``shape`` (in the call's
    ``layout``), writable, addressable in place (last axis contiguous, other strides positive,
    aligned: the library writes it directly, it is never copied back) and sharing no memory with
    ``inputs`` (the call's inputs and the other outputs, by name; checked by address bounds, so
    interleaved views of one buffer are refused too).

    Raises TypeError (not an array, dtype) or ValueError (shape, read-only, layout, overlap) naming
    ``name``.
    """
    check_array(name, array, dtypes=(np.dtype(dtype),), ndim=len(shape))
    if array.shape != shape:
        raise ValueError(f"{name} shape {array.shape} must be {shape}, the shape the call returns")
    if not array.flags.writeable:
        raise ValueError(f"{name} is read-only; the library writes the result into it")
    addressable = (element_strides(to_bhsd(array, layout)) is not None if array.ndim == 4
                   else array.flags.c_contiguous and array.flags.aligned)
    if not addressable:
        rule = ("its last axis contiguous, the other strides positive" if array.ndim == 4 else "C-contiguous")
        raise ValueError(
            f"{name} must be writable in place ({rule}, aligned), got strides {array.strides}; "
            f"pass a fresh array, e.g. numpy.empty({shape}, dtype={np.dtype(dtype).name})"
        )
    for other, tensor in inputs.items():
        if np.may_share_memory(array, tensor):
            raise ValueError(f"{name} shares memory with {other}: an output must not overlap another argument")
