"""Rotary position embeddings as ``flash_attn_with_kvcache`` applies them (rotary_cos, rotary_sin),
on the host before the new keys are appended.

FlashAttention's semantics (Dao-AILab/flash-attention: flash_attn_interface.py's docstring of
flash_attn_with_kvcache, csrc/flash_attn/src/flash_fwd_kernel.h, tests/test_flash_attn.py's
test_flash_attn_kvcache, flash_attn/layers/rotary.py's apply_rotary_emb_torch; facts only):
- cos and sin are (seqlen_ro, rotary_dim / 2); the first rotary_dim elements of each head are
  rotated, the rest pass unchanged.
- non-interleaved (GPT-NeoX): element i pairs with i + rotary_dim / 2,
  (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos) with cos, sin at column i;
  interleaved (GPT-J): elements 2i and 2i + 1 pair, with cos, sin at column i.
- the new key row j of batch element b is rotated at position cache_seqlens[b] + j (absolute cache
  row, left padding included); query row i at cache_seqlens[b] + i when the call is causal or
  local, else every query row at cache_seqlens[b]. "Local" is FlashAttention's: a window side in
  [0, seqlen_k), seqlen_k the cache's capacity (a side at or beyond it is unbounded).

The rotation is computed in float64 and rounded once to the dtype (FlashAttention rotates in
float32 in its kernel; the correctly rounded result differs from that by at most one rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _validation


@dataclass(frozen=True)
class Rotary:
    """Checked rotary tables: cos and sin float64 (seqlen_ro, rotary_dim / 2)."""

    cos: np.ndarray
    sin: np.ndarray
    interleaved: bool

    @property
    def dim(self) -> int:
        return 2 * self.cos.shape[1]


def check(rotary_cos, rotary_sin, rotary_interleaved, q: np.ndarray, head_dim: int, appends: bool) -> Rotary | None:
    """None without tables; else the checked tables. rotary_cos and rotary_sin must come together,
    as 2-D arrays (seqlen_ro, rotary_dim / 2) of q's dtype with rotary_dim <= head_dim, and need new
    keys to rotate (k, v given); rotary_interleaved must be a bool (a hint without tables)."""
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not appends:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys: they need k and v (as in FlashAttention)")
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _validation.check_array(name, table, ndim=2)
        _validation.check_same_dtype(name, table, q)
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {rotary_cos.shape}, got {rotary_sin.shape}")
    if 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[1]} columns: rotary_dim = 2 x that = "
                         f"{2 * rotary_cos.shape[1]} must be at most head_dim ({head_dim})")
    return Rotary(np.asarray(rotary_cos, dtype=np.float64), np.asarray(rotary_sin, dtype=np.float64),
                  bool(rotary_interleaved))


def is_local(causal: bool, window, capacity: int) -> bool:
    """Whether FlashAttention rotates query rows at their own positions: causal, or a window side
    in [0, capacity) (window: (left, right) or None)."""
    if causal:
        return True
    return window is not None and any(0 <= side < capacity for side in window)


def check_positions(rotary: Rotary, last: np.ndarray) -> None:
    """ValueError unless every position read (last[b], the largest of batch element b) lies in
    the tables' seqlen_ro rows."""
    bad = last >= rotary.cos.shape[0]
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise ValueError(f"rotary_cos has {rotary.cos.shape[0]} rows (seqlen_ro) but batch element {b} is rotated "
                         f"at position {int(last[b])} (cache_seqlens + the new or, causal or local, the query rows "
                         f"- 1); give at least {int(last.max()) + 1} rows")


def apply(rotary: Rotary, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x (batch, heads, rows, head_dim) (bhsd) rotated, row r of batch element b at
    positions[b, r]; a new array of x's dtype."""
    half = rotary.dim // 2
    cos = rotary.cos[positions][:, None]  # (batch, 1, rows, half)
    sin = rotary.sin[positions][:, None]
    out = np.array(x, dtype=np.float64)
    if rotary.interleaved:
        x1, x2 = out[..., 0:rotary.dim:2].copy(), out[..., 1:rotary.dim:2].copy()
        out[..., 0:rotary.dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary.dim:2] = x1 * sin + x2 * cos
    else:
        x1, x2 = out[..., :half].copy(), out[..., half:rotary.dim].copy()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary.dim] = x1 * sin + x2 * cos
    return out.astype(x.dtype)
