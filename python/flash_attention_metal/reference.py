"""Float64 NumPy reference attention, the ground truth of the accuracy rule.

Same semantics as the library: q (B, H, Nq, D); k (B, H_kv, Nk, D); v (B, H_kv, Nk, Dv), where the
value head dim Dv (head_dim_v) may differ from D (DeepSeek's MLA: D 192, Dv 128); out and dout
(B, H, Nq, Dv). Causal is aligned bottom-right (query i sees key j iff j <= i + Nk - Nq); a row with
no visible key gives out 0, lse -inf and zero gradients; GQA: query head h reads KV head
h // (H // H_kv) and dk, dv sum over the group. The default softmax_scale is 1/sqrt(D).

Inputs of any real dtype (float16, ml_dtypes.bfloat16, float32, float64) are converted exactly to
float64 and computed in float64, whatever the dtype the library ran in. Arrays are in the (B, H, N, D)
order; pass a (B, N, H, D) array as ``x.transpose(0, 2, 1, 3)``. Materializes the (B, H, Nq, Nk)
attention matrix: for checking, not for speed.
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
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"expected q (B, H, Nq, D), k (B, H_kv, Nk, D) and v (B, H_kv, Nk, Dv), got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")


def masked_matmul(a: np.ndarray, mask: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum over k with mask[m, k] of a[..., m, k] * b[..., k, n], for a (..., M, K), mask (M, K) bool
    and b (..., K, N).

    A plain ``a @ b`` with a zeroed at masked entries would still turn a NaN or infinity of b at a
    masked k into NaN (0 * inf); the library never reads masked keys, so neither may the reference.
    Rows that meet a non-finite b at an unmasked k are recomputed over their unmasked k alone.
    """
    a = np.where(mask, a, 0.0)
    finite = np.isfinite(b)
    result = a @ np.where(finite, b, 0.0)
    if finite.all():
        return result
    hits = (mask.astype(np.float64) @ (~finite).astype(np.float64)).any(axis=-1)
    for index in zip(*np.nonzero(hits)):
        keep = mask[index[-1]]
        with np.errstate(invalid="ignore"):
            result[index] = a[index][keep] @ b[index[:-1]][keep]
    return result


def _probabilities(q64, k64, causal: bool, scale: float):
    """Softmax probabilities P (B, H, Nq, Nk) and lse (B, H, Nq), float64.

    Whether a row sees any key comes from the mask alone: such rows get P 0 and lse -inf, while
    a NaN or infinity in the inputs of a row that does see keys propagates (P and lse NaN) instead
    of being mistaken for an empty row.
    """
    scores = scale * (q64 @ np.swapaxes(expand_kv(k64, q64.shape[1]), -1, -2))
    visible = visible_keys(q64.shape[2], k64.shape[2], causal)
    has_keys = visible.any(axis=-1, keepdims=True)
    scores = np.where(visible, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        row_max = np.where(has_keys, scores.max(axis=-1, keepdims=True), 0.0)
        weights = np.exp(scores - row_max)
        total = weights.sum(axis=-1, keepdims=True)
        lse = np.where(has_keys, row_max + np.log(np.where(has_keys, total, 1.0)), -np.inf)
        return weights / np.where(has_keys, total, 1.0), lse[..., 0]


def forward(q, k, v, *, causal: bool = False, softmax_scale=None):
    """Attention forward in float64.

    Args:
        q: (B, H, Nq, D); k: (B, H_kv, Nk, D); v: (B, H_kv, Nk, Dv); any real dtype, computed in
            float64.
        causal: bottom-right aligned mask.
        softmax_scale: None means 1/sqrt(D).

    Returns:
        (out, lse): float64 (B, H, Nq, Dv) and (B, H, Nq); lse is the natural log of the softmax
        denominator, -inf for rows that the mask leaves without keys (whose out is 0); NaN or
        infinite inputs seen by a row make its out and lse NaN.
    """
    _check_shapes(q, k, v)
    scale = default_scale(q.shape[3], softmax_scale)
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    probabilities, lse = _probabilities(q64, k64, causal, scale)
    visible = visible_keys(q.shape[2], k.shape[2], causal)
    return masked_matmul(probabilities, visible, expand_kv(v64, q.shape[1])), lse


def backward(dout, q, k, v, *, causal: bool = False, softmax_scale=None):
    """Attention backward in float64 (gradients of sum(dout * out) with respect to q, k, v).

    Recomputes out in float64 from q, k, v (the exact value the library's out approximates) and
    uses D = rowsum(dout * out), as FlashAttention-2 Algorithm 2.

    Args:
        dout: like out, (B, H, Nq, Dv); q, k, v, causal, softmax_scale: as for ``forward``.

    Returns:
        (dq, dk, dv), float64, shaped like q, k, v; dk and dv sum over each GQA group; rows the
        mask leaves without keys contribute zero (even when the inputs hold NaN); NaN or infinite
        inputs seen by a row propagate as NaN.
    """
    _check_shapes(q, k, v)
    if np.shape(dout) != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout shape {np.shape(dout)} must be (B, H, Nq, Dv) = {q.shape[:3] + v.shape[3:]}")
    scale = default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    dout64, q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    k_full, v_full = expand_kv(k64, num_heads), expand_kv(v64, num_heads)
    probabilities, _ = _probabilities(q64, k64, causal, scale)
    visible = visible_keys(q.shape[2], k.shape[2], causal)
    out = masked_matmul(probabilities, visible, v_full)
    dprobabilities = dout64 @ np.swapaxes(v_full, -1, -2)
    # Masked entries are exactly zero even where dP holds a NaN from a key the row never sees.
    with np.errstate(invalid="ignore"):
        delta = np.sum(dout64 * out, axis=-1, keepdims=True)
        dscores = np.where(visible, probabilities * (dprobabilities - delta), 0.0)
    dq = scale * masked_matmul(dscores, visible, k_full)
    dk = scale * masked_matmul(np.swapaxes(dscores, -1, -2), visible.T, q64)
    dv = masked_matmul(np.swapaxes(probabilities, -1, -2), visible.T, dout64)
    return dq, reduce_kv(dk, num_kv_heads), reduce_kv(dv, num_kv_heads)
