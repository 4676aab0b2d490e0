"""From a call's checked arguments to the C ABI's ``fa_problem``: the one module every front end
builds its calls through. The NumPy API (``Context``, varlen, the KV cache, and through them the
MLX fallback and PyTorch's varlen and KV-cache operators) uses ``numpy_problem``; PyTorch's dense
operators (CPU and MPS, ``torch/_tensors.py``) use ``new_problem`` and ``set_score_fields`` with
the same address rules (``abi_strides``, ``mask_kind``, ``mask_strides``). The arguments reach here
checked (``_validation``, ``_varlen``); the library checks again what it enforces.

The ABI (``fa_strides`` in flash_attention_metal.h) addresses a [batch][heads][seqlen][head_dim]
tensor whose last axis is contiguous through three element strides, all zero meaning the
contiguous layout; attn_mask through the strides of its batch, head and query-row axes, 0
broadcasting an axis.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ._validation import ScoreOptions, Shape

#: fa_dtype enumerators by dtype name (NumPy's and PyTorch's names agree).
DTYPE_CODES = {"float16": "FA_DTYPE_FLOAT16", "bfloat16": "FA_DTYPE_BFLOAT16", "float32": "FA_DTYPE_FLOAT32"}

#: The ``fa_strides`` value of the contiguous layout.
CONTIGUOUS = (0, 0, 0)


def abi_strides(sizes, strides) -> tuple[int, int, int] | None:
    """The ``fa_strides`` (batch, head, seq) of a (B, H, S, D) tensor with element ``strides``, or
    None when the ABI cannot address it in place (its last axis strided, or an axis longer than 1
    with a stride that is not positive).

    An axis of length 1 is never stepped along, so its stride is free: it gets the span of the
    tensor plus one, which keeps it positive and clear of every element (a non-overlap check on
    written tensors then sees no overlap that is not there).
    """
    if sizes[3] > 1 and strides[3] != 1:
        return None
    if any(size > 1 and stride <= 0 for size, stride in zip(sizes[:3], strides[:3])):
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides) if size > 1)
    return tuple(span if size == 1 else stride for size, stride in zip(sizes[:3], strides[:3]))


def mask_kind(dtype_name: str) -> str:
    """The fa_attn_mask_type enumerator of an attn_mask of dtype ``dtype_name``: bool, float32, or
    the call's dtype (additive)."""
    if dtype_name == "bool":
        return "FA_ATTN_MASK_BOOL"
    return "FA_ATTN_MASK_ADDITIVE_FLOAT32" if dtype_name == "float32" else "FA_ATTN_MASK_ADDITIVE"


def mask_strides(sizes, strides) -> tuple[int, int, int]:
    """The (batch, head, query row) element strides of a 4-D mask, 0 for an axis of size 1
    (broadcast: never expanded in memory)."""
    return tuple(0 if size == 1 else stride for size, stride in zip(sizes[:3], strides[:3]))


def new_problem(ffi, lib, shape: Shape, causal: bool, scale: float, dtype_name: str, strides: dict):
    """A new ``fa_problem`` with the sizes, flags and dtype of a call and score options off
    (``set_score_fields`` sets them). ``strides`` maps fa_problem's stride fields (q, k, v, out,
    dout, dq, dk, dv) to (batch, head, seq) element strides; absent ones stay contiguous."""
    problem = ffi.new("fa_problem *")
    problem.struct_size = ffi.sizeof("fa_problem")
    problem.batch = shape.batch
    problem.num_heads = shape.num_heads
    problem.num_kv_heads = shape.num_kv_heads
    problem.seqlen_q = shape.seqlen_q
    problem.seqlen_k = shape.seqlen_k
    problem.head_dim = shape.head_dim
    problem.causal = int(causal)
    problem.softmax_scale = scale
    problem.dtype = getattr(lib, DTYPE_CODES[dtype_name])
    problem.head_dim_v = shape.head_dim_v
    for name, (batch, head, seq) in strides.items():
        field = getattr(problem, name)
        field.batch, field.head, field.seq = batch, head, seq
    return problem


def set_score_fields(problem, ffi, lib, *, window=None, softcap=0.0, mask=None, alibi=None, sinks=None,
                     dropout=None) -> None:
    """Writes the score options into ``problem``: ``window`` (left, right) or None; ``softcap``;
    ``mask`` (address of element [0, 0, 0, 0], (batch, head, row) element strides, fa_attn_mask_type
    enumerator name) or None; ``alibi`` (address, per_batch) or None; ``sinks`` an address or None;
    ``dropout`` (dropout_p, seed, offset) or None. The caller keeps the memory alive until the call
    returns."""
    if window is not None:
        problem.use_window = 1
        problem.window_left, problem.window_right = window
    problem.softcap = softcap
    if mask is not None:
        address, (batch, head, seq), kind = mask
        problem.attn_mask_type = getattr(lib, kind)
        problem.attn_mask = ffi.cast("const void *", address)
        strides = problem.attn_mask_strides
        strides.batch, strides.head, strides.seq = batch, head, seq
    if alibi is not None:
        address, per_batch = alibi
        problem.alibi_slopes = ffi.cast("const float *", address)
        problem.alibi_per_batch = int(per_batch)
    if sinks is not None:
        problem.sinks = ffi.cast("const float *", sinks)
    if dropout is not None:
        problem.dropout_p, problem.dropout_seed, problem.dropout_offset = dropout


# ---- NumPy arrays ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One NumPy tensor as the ABI takes it: ``array`` is its (B, H, S, D) view (kept alive for the
    call), ``address`` the address of element [0, 0, 0, 0], ``strides`` (batch, head, seq) in
    elements."""

    array: np.ndarray
    address: int
    strides: tuple[int, int, int]


def element_strides(view: np.ndarray) -> tuple[int, int, int] | None:
    """The ``fa_strides`` of a (B, H, S, D) NumPy view: ``CONTIGUOUS`` for a C-contiguous one,
    ``abi_strides`` of its element strides otherwise, None when the ABI cannot address it in place
    (misaligned data, a byte stride that is no whole number of elements)."""
    if not view.flags.aligned:
        return None
    if view.flags.c_contiguous:
        return CONTIGUOUS
    itemsize = view.itemsize
    if any(size > 1 and stride % itemsize for size, stride in zip(view.shape, view.strides)):
        return None
    return abi_strides(view.shape, [stride // itemsize for stride in view.strides])


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
    contiguous, else one copy of it with the key axis expanded to seqlen_k (its other axes kept as
    small as given)."""
    if mask.shape[3] != seqlen_k:
        mask = np.broadcast_to(mask, mask.shape[:3] + (seqlen_k,))
    itemsize = mask.itemsize
    if (not mask.flags.aligned or mask.strides[3] != itemsize
            or any(stride < 0 or stride % itemsize for stride in mask.strides[:3])):
        mask = np.ascontiguousarray(mask)
    strides = mask_strides(mask.shape, [stride // itemsize for stride in mask.strides])
    return Mask(mask, strides, mask_kind(mask.dtype.name))


def set_problem_fields(problem, options: ScoreOptions, seqlen_k: int, ffi, lib) -> tuple:
    """Writes checked score options into an fa_problem (fields left zero leave an option off).
    Returns the arrays its pointers point into: keep the tuple alive until the call returns."""
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


def numpy_problem(library, shape: Shape, causal: bool, scale: float, dtype, tensors: dict,
                  options: ScoreOptions) -> tuple:
    """(fa_problem, keep) of a NumPy call: sizes, flags and dtype, the strides of ``tensors``
    (fa_problem's stride field name -> ``Tensor``; absent ones contiguous) and the score options.
    ``library`` is the loaded library (``Context._native``); keep ``keep`` alive for the call."""
    strides = {name: tensor.strides for name, tensor in tensors.items()}
    problem = new_problem(library.ffi, library.lib, shape, causal, scale, np.dtype(dtype).name, strides)
    return problem, set_problem_fields(problem, options, shape.seqlen_k, library.ffi, library.lib)


def check_sizes(library, shape: Shape, causal: bool, scale: float, dtype, options: ScoreOptions = ScoreOptions(),
                pass_enum: str = "FA_PASS_FORWARD") -> None:
    """Asks the library whether it takes a pass (``pass_enum``, an fa_pass enumerator's name) of
    ``shape`` and these options (``fa_plan_create`` validates, nothing runs) and raises its ``ArgumentError`` if not. For a caller that must know
    before it makes no call (an empty varlen batch) or before it communicates (ring attention):
    every other caller learns it from the call itself, before anything is written. Sizes of 0 (an
    empty batch's rows or keys) are asked about as 1."""
    shape = replace(shape, seqlen_q=max(shape.seqlen_q, 1), seqlen_k=max(shape.seqlen_k, 1))
    problem, keep = numpy_problem(library, shape, causal, scale, dtype, {}, options)
    holder = library.ffi.new("fa_plan **")
    library.raise_for_status(library.lib.fa_plan_create(problem, getattr(library.lib, pass_enum), 0, holder))
    library.lib.fa_plan_destroy(holder[0])
    del keep  # the arrays the problem points into lived until here


def set_varlen_fields(problem, ffi, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, max_seqlen_q: int,
                      max_seqlen_k: int) -> None:
    """The varlen fields of ``problem``: the checked C-contiguous int32 tables (kept alive by the
    caller) and the longest sequences."""
    problem.cu_seqlens_q = ffi.cast("const int32_t *", cu_seqlens_q.ctypes.data)
    problem.cu_seqlens_k = ffi.cast("const int32_t *", cu_seqlens_k.ctypes.data)
    problem.max_seqlen_q = max_seqlen_q
    problem.max_seqlen_k = max_seqlen_k


def pointer(ffi, address: int):
    """``address`` as the ``void *`` the ABI takes tensors as (elements of the problem's dtype)."""
    return ffi.cast("void *", address)
