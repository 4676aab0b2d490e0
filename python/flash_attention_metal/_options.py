"""The fa_problem fields of the score options (window, softcap, attn_mask, ALiBi, sinks), from the
``_validation.ScoreOptions`` of a call.

attn_mask reaches the ABI as a pointer to its element [0, 0, 0, 0] and the element strides of its
batch, head and query-row axes, 0 broadcasting an axis: its size-1 axes are never expanded in
memory. The kernels read the key axis contiguously, so a mask whose key axis is not (strided,
broadcast from size 1, negative strides, misaligned data) is copied once, with its other axes kept
as small as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._abi import set_score_fields
from ._validation import ScoreOptions

_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Mask:
    """attn_mask as the ABI takes it: ``array`` a 4-D array whose key axis is contiguous and has
    seqlen_k elements, ``strides`` its (batch, head, query row) element strides (0 broadcasts),
    ``kind`` the name of its fa_attn_mask_type enumerator."""

    array: np.ndarray
    strides: tuple[int, int, int]
    kind: str


def abi_mask(mask: np.ndarray, seqlen_k: int) -> Mask:
    """The ABI form of a checked mask (``ScoreOptions.attn_mask``): in place when its key axis is
    contiguous, else one copy of it with the key axis expanded to seqlen_k."""
    if mask.shape[3] != seqlen_k:
        mask = np.broadcast_to(mask, mask.shape[:3] + (seqlen_k,))
    itemsize = mask.itemsize
    if (not mask.flags.aligned or mask.strides[3] != itemsize
            or any(stride < 0 or stride % itemsize for stride in mask.strides[:3])):
        mask = np.ascontiguousarray(mask)
    strides = tuple(0 if size == 1 else stride // itemsize for size, stride in zip(mask.shape[:3], mask.strides))
    if mask.dtype == bool:
        kind = "FA_ATTN_MASK_BOOL"
    elif mask.dtype == _FLOAT32:
        kind = "FA_ATTN_MASK_ADDITIVE_FLOAT32"
    else:
        kind = "FA_ATTN_MASK_ADDITIVE"
    return Mask(mask, strides, kind)


def set_problem_fields(problem, options: ScoreOptions, seqlen_k: int, ffi, lib) -> tuple:
    """Writes the options into an fa_problem (fields left zero leave an option off). Returns the
    arrays its pointers point into: keep the tuple alive until the call returns."""
    keep = []
    mask = alibi = sinks = None
    if options.attn_mask is not None:
        abi = abi_mask(options.attn_mask, seqlen_k)
        mask = (abi.array.ctypes.data, abi.strides, abi.kind)
        keep.append(abi.array)
    if options.alibi_slopes is not None:
        alibi = (options.alibi_slopes.ctypes.data, options.alibi_slopes.ndim == 2)
        keep.append(options.alibi_slopes)
    if options.sinks is not None:
        sinks = options.sinks.ctypes.data
        keep.append(options.sinks)
    set_score_fields(problem, ffi, lib, window=options.window, softcap=options.softcap, mask=mask, alibi=alibi,
                     sinks=sinks, dropout=options.dropout)
    return tuple(keep)
