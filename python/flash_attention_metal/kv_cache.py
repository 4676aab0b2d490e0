"""Attention over KV caches as inference engines keep them: FlashAttention's
``flash_attn_with_kvcache`` (forward only) on NumPy arrays.

A cache is contiguous per sequence (batch_cache, seqlen_cache, num_kv_heads, head_dim) or paged
(num_blocks, page_block_size, num_kv_heads, head_dim) with a block table (``layout="bshd"``, the
default, FlashAttention's; ``"bhsd"`` swaps the two middle axes of q, k, v, out and the caches, as
mlx-lm keeps them). Position t of batch element b lives at
  contiguous: cache[cache_batch_idx[b], t]      (cache_batch_idx defaults to b)
  paged:      cache[block_table[b, t // page_block_size], t % page_block_size]
so the pages of one sequence may lie anywhere, in any order. A cache may also be the triple
(packed, scales, biases) of ``mx.quantize`` (``quantized``), K and V each with ``bits`` and
``group_size``.

New keys and values (k, v) are written into the caches in place at positions cache_seqlens[b] ...
cache_seqlens[b] + seqlen_new - 1 before attending; a quantized cache gets them quantized by MLX's
rule (``quantized.quantize``, bit for bit ``mx.quantize``). Batch element b then attends to its
seqlen_k = cache_seqlens[b] + seqlen_new keys with the library's semantics (bottom-right causal
and window alignment, so the new rows see themselves and the cache before them).

FlashAttention's rotary embeddings (rotary_cos, rotary_sin; ``_rotary``) rotate q and the new k
before the append. ``cache_leftpad[b]`` (contiguous caches) is the first cache row of batch
element b: it attends to rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), a sequence of
its own for causal, window and ALiBi alignment, as in FlashAttention (whose tests' reference
re-indexes the keys from the left padding).

Every table and length is checked in host memory before anything is written: a wrong value is a
ValueError naming the argument, the element and the rule (a length beyond the cache's capacity is
``errors.CapacityError``, both a ValueError and FlashAttention's RuntimeError).
"""

from __future__ import annotations

import mmap
import numbers
from dataclasses import dataclass

import numpy as np

from . import _abi, _default, _layout, _rotary, _validation, plan, quantized
from .errors import CapacityError
#: Alignment of ``empty_cache``'s arrays: the VM page, 16 KiB on Apple silicon (vm_page_size; at
#: least that everywhere), which MTLDevice.makeBuffer(bytesNoCopy:length:options:deallocator:)
#: requires of a buffer's address and length (``AttentionKVCache.pageBytes`` in Swift).
PAGE_BYTES = max(16384, mmap.PAGESIZE)


def empty_cache(shape, dtype, alignment: int = PAGE_BYTES) -> np.ndarray:
    """A zero-filled C-contiguous array of ``shape`` and ``dtype`` in an anonymous memory mapping,
    whose data starts at a multiple of ``alignment`` bytes (a power of two) and whose mapping spans
    whole multiples of it past that start: a cache that the Metal backend wraps in place rather
    than copying it on every call (Apple: makeBuffer(bytesNoCopy:length:) needs a page-aligned
    address and length, in memory from mmap or vm_allocate, not malloc; the backend rounds a
    cache's length up to the page, which this mapping holds). Use it for k_cache and v_cache (and
    the three arrays of a quantized cache) that live across many calls; the mapping is freed with
    the last array that views it.

    Raises ValueError when ``alignment`` is not a positive power of two."""
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    padded = max(-(-(count * dtype.itemsize) // alignment), 1) * alignment
    raw = np.frombuffer(mmap.mmap(-1, padded + alignment), dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


@dataclass(frozen=True)
class Cache:
    """One checked cache (K or V): ``arrays`` its array, or (packed, scales, biases), each as a
    (slots, num_kv_heads, rows, last) view; ``head_dim`` the width of its rows once dequantized."""

    name: str
    arrays: tuple
    head_dim: int
    bits: int | None
    group_size: int

    @property
    def quantized(self) -> bool:
        return self.bits is not None


def check_num_splits(num_splits) -> None:
    """num_splits must be an int: FlashAttention's hint (0 its heuristic, 1 no split, n splits),
    accepted and ignored (the library chooses its own key splits)."""
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (a hint; the library chooses its own key splits), "
                        f"got {type(num_splits).__name__}")


def _check_cache(name: str, cache, q: np.ndarray, layout: str, bits, group_size) -> Cache:
    if isinstance(cache, (tuple, list)):
        if bits is None:
            raise ValueError(f"{name} is a (packed, scales, biases) triple, which needs bits (4 or 8) and group_size")
        if len(cache) != 3:
            raise ValueError(f"{name} must be an array or mx.quantize's (packed, scales, biases), got {len(cache)} items")
        packed, scales, biases = cache
        _validation.check_array(f"{name}[0] (packed)", packed, (np.dtype(np.uint32),))
        for part, array in (("[1] (scales)", scales), ("[2] (biases)", biases)):
            _validation.check_array(name + part, array)
            _validation.check_same_dtype(name + part, array, q)
        head_dim = packed.shape[3] * 32 // bits
        # The library's rule too, needed here first: the scales' shape below divides by group_size.
        if head_dim % group_size:
            raise ValueError(f"{name}'s head_dim {head_dim} must be a multiple of group_size {group_size}")
        for part, array, last in (("[1] (scales)", scales, head_dim // group_size),
                                  ("[2] (biases)", biases, head_dim // group_size)):
            if array.shape != packed.shape[:3] + (last,):
                raise ValueError(f"{name}{part} must have shape {packed.shape[:3] + (last,)} (packed's leading axes, "
                                 f"head_dim / group_size), got {array.shape}")
        arrays = tuple(_validation.to_bhsd(a, layout) for a in (packed, scales, biases))
        return Cache(name, arrays, head_dim, bits, group_size)
    if bits is not None:
        raise ValueError(f"bits={bits} is given but {name} is a plain array; a quantized cache is "
                         f"mx.quantize's (packed, scales, biases)")
    _validation.check_array(name, cache)
    _validation.check_same_dtype(name, cache, q)
    return Cache(name, (_validation.to_bhsd(cache, layout),), cache.shape[3], None, group_size)


def _check_int32(name: str, value, shape) -> np.ndarray:
    _validation.check_int32_array(name, value)
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {value.shape}")
    return value


def _bad(name: str, values: np.ndarray, bad: np.ndarray, rule: str, error=ValueError):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    return error(f"{name}[{', '.join(map(str, index))}] = {int(values[index])}: {rule}")


@dataclass(frozen=True)
class Problem:
    """A checked call: the caches, each batch element's key count and where its rows live."""

    k_cache: Cache
    v_cache: Cache
    seqlens_k: np.ndarray        # int64 (batch,): the keys attended, cache_seqlens + seqlen_new - leftpad
    cache_seqlens: np.ndarray    # int64 (batch,)
    leftpad: np.ndarray          # int64 (batch,): the first cache row attended (cache_leftpad, else 0)
    block_table: np.ndarray | None
    slots: np.ndarray | None     # contiguous caches: the slot of each batch element
    page_block_size: int

    def positions(self, b: int, first: int, end: int):
        """(slots, rows) of positions [first, end) of batch element b."""
        t = np.arange(first, end)
        if self.block_table is None:
            return np.full(t.shape, self.slots[b]), t
        return self.block_table[b, t // self.page_block_size].astype(np.int64), t % self.page_block_size


    @property
    def ends(self) -> np.ndarray:
        """int64 (batch,): one past each sequence's last row, cache_seqlens + seqlen_new."""
        return self.leftpad + self.seqlens_k


def check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, layout, bits, group_size,
          cache_leftpad=None) -> Problem:
    """Every check of the cache arguments that only Python can make (shapes, dtypes, table values
    in host memory); the library's own rules (head_dim, num_heads a multiple of num_kv_heads, ...)
    are asked of it before the append (``_prepare``)."""
    layout = _validation.check_layout(layout)
    _validation.check_array("q", q)
    if bits is not None:
        # Here, not only in the library: bits and group_size say how to read the triple's shapes.
        quantized.check_format(group_size, bits)
    kc = _check_cache("k_cache", k_cache, q, layout, bits, group_size)
    vc = _check_cache("v_cache", v_cache, q, layout, bits, group_size)
    qb = _validation.to_bhsd(q, layout)
    batch, num_heads, seqlen_q, head_dim = qb.shape
    slots_total, num_kv_heads, rows = kc.arrays[0].shape[:3]
    if vc.arrays[0].shape[:3] != (slots_total, num_kv_heads, rows):
        raise ValueError("v_cache must have k_cache's leading axes (slots or blocks, rows, num_kv_heads in "
                         f"{layout}), got {vc.arrays[0].shape[:3]} and {kc.arrays[0].shape[:3]} (bhsd order)")
    if kc.head_dim != head_dim:
        raise ValueError(f"k_cache's head_dim ({kc.head_dim}) must equal q's ({head_dim})")
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if k is not None:
        for name, new, width in (("k", k, head_dim), ("v", v, vc.head_dim)):
            _validation.check_array(name, new)
            _validation.check_same_dtype(name, new, q)
            nb = _validation.to_bhsd(new, layout)
            if nb.shape[0] != batch or nb.shape[1] != num_kv_heads or nb.shape[3] != width:
                raise ValueError(f"{name} must be (batch {batch}, seqlen_new, num_kv_heads {num_kv_heads}, {width}) in "
                                 f"{layout} order (bhsd shape {(batch, num_kv_heads, '*', width)}), got bhsd {nb.shape}")
        seqlen_new = _validation.to_bhsd(k, layout).shape[2]
        if _validation.to_bhsd(v, layout).shape[2] != seqlen_new:
            raise ValueError("k and v must have the same seqlen_new")
        for cache in (kc, vc):
            for array in cache.arrays:
                if not array.flags.writeable:
                    raise ValueError(f"{cache.name} is read-only, but k and v are appended to it in place")
                # The dense API's overlap rule: the append writes the cache while q, k, v are read.
                for name, given in (("q", q), ("k", k), ("v", v)):
                    if np.may_share_memory(given, array):
                        raise ValueError(f"{cache.name} must not overlap {name} (k and v are appended to it while "
                                         f"{name} is read)")

    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens = np.full(batch, int(cache_seqlens), dtype=np.int64)
        given = np.full(batch, int(cache_seqlens), dtype=np.int64)
    else:
        given = _check_int32("cache_seqlens", cache_seqlens, (batch,))
        seqlens = given.astype(np.int64)
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache is addressed "
                             "through block_table alone), as in FlashAttention")
        table = _check_int32("block_table", block_table, (batch, block_table.shape[1] if
                                                          isinstance(block_table, np.ndarray) and block_table.ndim == 2
                                                          else -1))
        capacity = table.shape[1] * rows
        slots = None
    else:
        table = None
        capacity = rows
        if cache_batch_idx is None:
            if slots_total < batch:
                raise ValueError(f"k_cache holds {slots_total} sequences but q has batch {batch}; pass cache_batch_idx")
            slots = np.arange(batch)
        else:
            idx = _check_int32("cache_batch_idx", cache_batch_idx, (batch,))
            bad = (idx < 0) | (idx >= slots_total)
            if bad.any():
                raise _bad("cache_batch_idx", idx, bad, f"must lie in [0, {slots_total}) (k_cache's sequences)")
            if k is not None and len(np.unique(idx)) != batch:
                raise ValueError("cache_batch_idx repeats a sequence while k and v are appended: two batch elements "
                                 "would write the same cache rows")
            slots = idx.astype(np.int64)
    rule = (f"must lie in [0, capacity - seqlen_new] = [0, {capacity - seqlen_new}] (capacity {capacity} rows per "
            f"sequence{' = max_blocks x page_block_size of block_table' if table is not None else ''}, "
            f"seqlen_new {seqlen_new})")
    if (seqlens < 0).any():
        raise _bad("cache_seqlens", given, seqlens < 0, rule)
    if (seqlens + seqlen_new > capacity).any():
        raise _bad("cache_seqlens", given, seqlens + seqlen_new > capacity, rule, CapacityError)
    leftpad = np.zeros(batch, dtype=np.int64)
    if cache_leftpad is not None:
        if table is not None:
            raise ValueError("cache_leftpad cannot be combined with block_table (a paged cache), as in FlashAttention")
        pad = _check_int32("cache_leftpad", cache_leftpad, (batch,))
        bad = (pad < 0) | (pad > seqlens)
        if bad.any():
            raise _bad("cache_leftpad", pad, bad, "must lie in [0, cache_seqlens] (the first cached row attended)")
        leftpad = pad.astype(np.int64)
    seqlens_k = seqlens + seqlen_new - leftpad
    if (seqlens_k == 0).any():
        raise _bad("cache_seqlens", given, seqlens_k == 0,
                   "a sequence without keys (none cached past cache_leftpad, none appended)")
    if table is not None:
        used = np.arange(table.shape[1])[None, :] * rows < seqlens_k[:, None]
        bad = used & ((table < 0) | (table >= slots_total))
        if bad.any():
            raise _bad("block_table", table, bad, f"must lie in [0, {slots_total}) (the caches' blocks) for every block "
                       "that holds one of the sequence's cache_seqlens + seqlen_new rows")
        if k is not None:
            pages = [table[b, int(s) // rows:-(-(int(s) + seqlen_new) // rows)] for b, s in enumerate(seqlens)]
            written = np.concatenate(pages)
            if len(np.unique(written)) != len(written):
                raise ValueError("block_table gives two appending sequences (or one twice) the same block: the "
                                 "appended rows would overwrite each other")
    return Problem(kc, vc, seqlens_k, seqlens, leftpad, table, slots, rows)


def append(problem: Problem, k, v, layout: str) -> None:
    """Writes k and v into the caches at cache_seqlens (quantized by MLX's rule where the cache is)."""
    for cache, new in ((problem.k_cache, k), (problem.v_cache, v)):
        nb = _validation.to_bhsd(new, layout)
        for b in range(nb.shape[0]):
            slots, rows = problem.positions(b, int(problem.cache_seqlens[b]), int(problem.ends[b]))
            rows_new = nb[b].transpose(1, 0, 2)  # (seqlen_new, num_kv_heads, width)
            parts = quantized.quantize(rows_new, cache.group_size, cache.bits) if cache.quantized else (rows_new,)
            for array, part in zip(cache.arrays, parts):
                array[slots, :, rows] = part


def _cache_tensor(cache: Cache) -> list:
    # The ABI form of a cache: (address, element strides) of its data, scales and biases, each
    # addressed in place (a cache is never copied: appends write it).
    forms = []
    for array in cache.arrays:
        strides = _layout.element_strides(array)
        if strides is None:
            raise ValueError(f"{cache.name} must be addressable in place (last axis contiguous, other strides "
                             f"positive, aligned), got strides {array.strides}; allocate it with empty_cache")
        forms.append((array.ctypes.data, strides))
    if cache.quantized:
        packed, scales = cache.arrays[0], cache.arrays[1]
        words, groups = packed.shape[3], scales.shape[3]
        if not all(p_ == s_ == 0 or p_ // words * groups == s_ for p_, s_ in zip(forms[0][1], forms[1][1])) \
                or forms[1][1] != forms[2][1]:
            raise ValueError(f"{cache.name}'s scales and biases must be laid out like its packed words (e.g. all "
                             "three C-contiguous, as mx.quantize returns them)")
    return forms


def _shifted(cache: Cache, first: int) -> Cache:
    # The cache from row `first` of every sequence on (cache_leftpad): views that start there.
    return Cache(cache.name, tuple(a[:, :, first:] for a in cache.arrays), cache.head_dim, cache.bits,
                 cache.group_size)


def _prepare(context, problem: Problem, qb, out, lse, batches, causal, scale, options):
    # One fa_forward over the batch elements `batches` (all of one seqlen_k and leftpad): the
    # caches are read in place through the ABI's kv_* fields, contiguous (from the leftpad row on)
    # or through a block table. The library
    # validates the call now (fa_plan_create: every rule it would refuse the call by, e.g. a
    # head_dim the dtype's kernels lack), so that nothing is appended to a cache for a call that
    # then fails; returns the call, to make after the append. q is copied here, before the append.
    native = context._native
    ffi = native.ffi
    n = len(batches)
    seqlen_k = int(problem.seqlens_k[batches[0]])
    first = int(problem.leftpad[batches[0]])
    kc, vc = problem.k_cache, problem.v_cache
    if first:
        kc, vc = _shifted(kc, first), _shifted(vc, first)
    shape = _validation.Shape(n, qb.shape[1], kc.arrays[0].shape[1], qb.shape[2], seqlen_k, qb.shape[3], vc.head_dim)
    q_part = _layout.as_input(np.ascontiguousarray(qb[batches]), "bhsd")
    out_part = np.empty((n,) + out.shape[1:], dtype=out.dtype)
    lse_part = np.empty((n,) + lse.shape[1:], dtype=np.float32)
    k_forms, v_forms = _cache_tensor(kc), _cache_tensor(vc)
    tensors = {"q": q_part, "out": _layout.as_output(out_part, "bhsd"),
               "k": _layout.Tensor(kc.arrays[0], *k_forms[0]), "v": _layout.Tensor(vc.arrays[0], *v_forms[0])}
    c_problem, keep = _abi.numpy_problem(native, shape, causal, scale, qb.dtype, tensors, options)
    slots = kc.arrays[0].shape[0]
    c_problem.kv_cache_rows = problem.page_block_size - first
    if problem.block_table is not None:
        table = np.ascontiguousarray(problem.block_table[batches])
    elif n == len(problem.slots) and np.array_equal(problem.slots, np.arange(n)):
        table = None
    else:
        # cache_batch_idx: each sequence is one block of seqlen_cache - first rows.
        table = np.ascontiguousarray(problem.slots[batches, None].astype(np.int32))
    if table is not None:
        c_problem.kv_block_table = ffi.cast("const int32_t *", table.ctypes.data)
        c_problem.kv_max_blocks = table.shape[1]
        c_problem.kv_num_blocks = slots
    if kc.quantized:
        c_problem.kv_bits = kc.bits
        c_problem.kv_group_size = kc.group_size
        for name, form in (("k_scales", k_forms[1]), ("k_biases", k_forms[2]), ("v_scales", v_forms[1]),
                           ("v_biases", v_forms[2])):
            setattr(c_problem, name, ffi.cast("const void *", form[0]))
    plan.create(c_problem, "forward", library=native)

    def call() -> None:
        context._call("fa_forward", c_problem,
                      *(_abi.pointer(ffi, tensors[name].address) for name in ("q", "k", "v", "out")),
                      ffi.from_buffer("float[]", lse_part, require_writable=True))
        out[batches] = out_part
        lse[batches] = lse_part

    call.keep = (keep, table, q_part)  # what c_problem points into lives as long as the call
    return call


def _rotate(rotary: _rotary.Rotary, problem: Problem, qb, kb, causal, window_size):
    # (q, k) rotated at FlashAttention's positions (bhsd), every position checked first.
    capacity = problem.page_block_size * (1 if problem.block_table is None else problem.block_table.shape[1])
    start = problem.cache_seqlens[:, None]
    rows_q = np.arange(qb.shape[2])[None, :]
    if not _rotary.is_local(bool(causal), _validation.check_window_size(window_size), capacity):
        rows_q = np.zeros_like(rows_q)
    positions_q, positions_k = start + rows_q, start + np.arange(kb.shape[2])[None, :]
    _rotary.check_positions(rotary, np.maximum(positions_q.max(axis=1), positions_k.max(axis=1)))
    return _rotary.apply(rotary, qb, positions_q), _rotary.apply(rotary, kb, positions_k)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                            cache_batch_idx=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, sinks=None, return_softmax_lse=False, group_size=64,
                            bits=None, layout="bshd", context=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=True, cache_leftpad=None, num_splits=0):
    """FlashAttention's ``flash_attn_with_kvcache`` (forward only): rotates q and k (with
    rotary_cos, rotary_sin), appends k, v to the caches in place at cache_seqlens, then attends q
    to each sequence's keys from cache_leftpad to cache_seqlens + seqlen_new.

    Args:
        q: (batch, seqlen_q, num_heads, head_dim) (``layout="bshd"``) or (batch, num_heads,
            seqlen_q, head_dim) (``"bhsd"``); float16, bfloat16 or float32.
        k_cache, v_cache: contiguous (batch_cache, seqlen_cache, num_kv_heads, head_dim[_v]) or,
            with block_table, paged (num_blocks, page_block_size, num_kv_heads, head_dim[_v]) in
            q's dtype (middle axes swapped for "bhsd"); or each mx.quantize's (packed uint32
            (..., head_dim * bits / 32), scales, biases (..., head_dim / group_size) in q's dtype)
            with ``bits`` 4 or 8 and ``group_size`` 32, 64 or 128. Every page_block_size >= 1 is
            supported. Written in place when k, v are given (so they must be writable).
        k, v: None, or the new rows (batch, seqlen_new, num_kv_heads, head_dim[_v]) in q's dtype.
        cache_seqlens: int or int32 (batch,): rows already in each sequence's cache;
            cache_seqlens + seqlen_new must not exceed the capacity (seqlen_cache, or max_blocks x
            page_block_size) and must be >= 1.
        block_table: None or int32 (batch, max_blocks): the blocks of each sequence in order; the
            entries that hold one of its rows must lie in [0, num_blocks) (the others are unread).
        cache_batch_idx: None or int32 (batch,): the cache slot of each batch element (contiguous
            caches only; distinct when appending).
        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks: as ``Context.forward``,
            with seqlen_k = cache_seqlens[b] + seqlen_new - cache_leftpad[b] per batch element
            (bottom-right aligned).
        return_softmax_lse: also return lse, float32 (batch, num_heads, seqlen_q).
        layout: "bshd" (default) or "bhsd"; context: the Context to run on (default: the module's).
        rotary_cos, rotary_sin: None, or both (seqlen_ro, rotary_dim / 2) in q's dtype, rotary_dim
            <= head_dim (any even value; FlashAttention needs a multiple of 16): the new key row j
            is rotated at position cache_seqlens[b] + j before the append, and query row i at
            cache_seqlens[b] + i when causal or local (a window side in [0, capacity)), else at
            cache_seqlens[b]; every position used must be < seqlen_ro. Needs k and v.
        rotary_interleaved: bool: True pairs elements 2i and 2i + 1 (GPT-J), False i and i +
            rotary_dim / 2 (GPT-NeoX); without tables a hint that changes nothing.
        cache_leftpad: None or int32 (batch,) in [0, cache_seqlens[b]]: the first cache row
            batch element b attends (contiguous caches only, as in FlashAttention).
        num_splits: an int, FlashAttention's split hint, accepted and ignored.

    Returns:
        out like q with head_dim_v last, or (out, lse) with return_softmax_lse.

    Raises:
        TypeError, ValueError: invalid arguments, before anything is written;
        errors.CapacityError (a ValueError and a RuntimeError): cache_seqlens + seqlen_new beyond
        the capacity (naming block_table with a paged cache).
        FlashAttentionError: the library refused a launch (asked before the append writes).
    """
    check_num_splits(num_splits)
    problem = check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, layout, bits, group_size,
                    cache_leftpad)
    qb = _validation.to_bhsd(q, layout)
    batch, num_heads, seqlen_q, _ = qb.shape
    options = dict(window_size=window_size, softcap=softcap, sinks=sinks)
    # Every check of the per-sequence calls, before the first write.
    _validation.check_causal(causal)
    _validation.resolve_softmax_scale(softmax_scale, qb.shape[3])
    _validation.check_score_options(_validation.Shape(batch, num_heads, num_heads, seqlen_q, 1, qb.shape[3]),
                                    q.dtype, alibi_slopes=alibi_slopes, **options)
    rotary = _rotary.check(rotary_cos, rotary_sin, rotary_interleaved, q, qb.shape[3], k is not None)
    layout_new = layout
    if rotary is not None:
        qb, k = _rotate(rotary, problem, qb, _validation.to_bhsd(k, layout), causal, window_size)
        v, layout_new = _validation.to_bhsd(v, layout), "bhsd"
    context = context if context is not None else _default.default_context()
    scale = _validation.resolve_softmax_scale(softmax_scale, qb.shape[3])
    out = np.empty(qb.shape[:3] + (problem.v_cache.head_dim,), dtype=q.dtype)
    lse = np.empty((batch, num_heads, seqlen_q), dtype=np.float32)
    # One call per distinct (seqlen_k, leftpad) (the kernels take one key count per call), each
    # validated by the library before the append writes the caches.
    calls = []
    for seqlen_k, first in sorted(set(zip(problem.seqlens_k.tolist(), problem.leftpad.tolist()))):
        batches = np.flatnonzero((problem.seqlens_k == seqlen_k) & (problem.leftpad == first))
        slopes = None if alibi_slopes is None or alibi_slopes.ndim == 1 else alibi_slopes[batches]
        shape = _validation.Shape(len(batches), num_heads, num_heads, seqlen_q, int(seqlen_k), qb.shape[3])
        checked = _validation.check_score_options(shape, q.dtype, alibi_slopes=alibi_slopes if slopes is None
                                                  else slopes, **options)
        calls.append(_prepare(context, problem, qb, out, lse, batches, causal, scale, checked))
    if k is not None:
        append(problem, k, v, layout_new)
    for call in calls:
        call()
    out = out if layout == "bhsd" else np.ascontiguousarray(out.transpose(0, 2, 1, 3))
    return (out, lse) if return_softmax_lse else out
