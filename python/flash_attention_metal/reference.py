"""Float64 NumPy reference attention, the ground truth of the accuracy rule.

Same semantics as the library: q (B, H, Nq, D); k, v (B, H_kv, Nk, D); causal aligned bottom-right
(query i sees key j iff j <= i + Nk - Nq); a row with no visible key gives out 0, lse -inf and zero
gradients; GQA: query head h reads KV head h // (H // H_kv) and dk, dv sum over the group.
Materializes the (B, H, Nq, Nk) attention matrix: for checking, not for speed.
"""

from __future__ import annotations

import math

import numpy as np


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool) -> np.ndarray:
    """Boolean (seqlen_q, seqlen_k) mask of the keys each query sees (bottom-right causal)."""
    if not causal:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def expand_kv(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Repeats KV heads so that head h of the result is KV head h // (num_heads // H_kv) of x."""
    num_kv_heads = x.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be divisible by num_kv_heads {num_kv_heads}")
    return np.repeat(x, num_heads // num_kv_heads, axis=1)


def reduce_kv(x: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Sums per-query-head gradients (B, H, Nk, D) over each GQA group into (B, H_kv, Nk, D)."""
    batch, num_heads, seqlen, head_dim = x.shape
    return x.reshape(batch, num_kv_heads, num_heads // num_kv_heads, seqlen, head_dim).sum(axis=2)


def default_scale(head_dim: int, softmax_scale) -> float:
    """softmax_scale, or 1/sqrt(head_dim) when it is None."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, H, Nq, D) and k, v (B, H_kv, Nk, D), got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")


def _probabilities(q64, k64, causal: bool, scale: float):
    """Softmax probabilities P (B, H, Nq, Nk) and lse (B, H, Nq), float64, empty rows -> 0 / -inf."""
    scores = scale * (q64 @ np.swapaxes(expand_kv(k64, q64.shape[1]), -1, -2))
    visible = visible_keys(q64.shape[2], k64.shape[2], causal)
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    has_keys = total > 0
    with np.errstate(divide="ignore"):
        lse = np.where(has_keys, row_max + np.log(np.where(has_keys, total, 1.0)), -np.inf)
    return weights / np.where(has_keys, total, 1.0), lse[..., 0]


def forward(q, k, v, *, causal: bool = False, softmax_scale=None):
    """Attention forward in float64.

    Args:
        q: (B, H, Nq, D); k, v: (B, H_kv, Nk, D); any real dtype, computed in float64.
        causal: bottom-right aligned mask.
        softmax_scale: None means 1/sqrt(D).

    Returns:
        (out, lse): float64 (B, H, Nq, D) and (B, H, Nq); lse is the natural log of the softmax
        denominator, -inf for rows that see no key (whose out is 0).
    """
    _check_shapes(q, k, v)
    scale = default_scale(q.shape[3], softmax_scale)
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    probabilities, lse = _probabilities(q64, k64, causal, scale)
    return probabilities @ expand_kv(v64, q.shape[1]), lse


def backward(dout, q, k, v, *, causal: bool = False, softmax_scale=None):
    """Attention backward in float64 (gradients of sum(dout * out) with respect to q, k, v).

    Recomputes out in float64 from q, k, v (the exact value the library's out approximates) and
    uses D = rowsum(dout * out), as FlashAttention-2 Algorithm 2.

    Args:
        dout: like q; q, k, v, causal, softmax_scale: as for ``forward``.

    Returns:
        (dq, dk, dv), float64, shaped like q, k, v; dk and dv sum over each GQA group; rows with no
        visible key contribute zero.
    """
    _check_shapes(q, k, v)
    if np.shape(dout) != q.shape:
        raise ValueError(f"dout shape {np.shape(dout)} must equal q shape {q.shape}")
    scale = default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    dout64, q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    k_full, v_full = expand_kv(k64, num_heads), expand_kv(v64, num_heads)
    probabilities, _ = _probabilities(q64, k64, causal, scale)
    out = probabilities @ v_full
    dprobabilities = dout64 @ np.swapaxes(v_full, -1, -2)
    delta = np.sum(dout64 * out, axis=-1, keepdims=True)
    dscores = probabilities * (dprobabilities - delta)
    dq = scale * (dscores @ k_full)
    dk = scale * (np.swapaxes(dscores, -1, -2) @ q64)
    dv = np.swapaxes(probabilities, -1, -2) @ dout64
    return dq, reduce_kv(dk, num_kv_heads), reduce_kv(dv, num_kv_heads)
