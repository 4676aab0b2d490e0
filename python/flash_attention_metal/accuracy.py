"""The accuracy rule (the FlashAttention test-suite pattern) and its float16 baseline.

``ref`` is float64 math on the same float16 inputs (``reference``). ``base`` is the same math as a
float16 framework does it: every matrix product accumulated in float32 and rounded to float16
(S, P, O; dP, dS, dQ, dK, dV), softmax in float32. A result passes when

    max|ours - ref| <= 2 * max|base - ref| + 1e-5   for out,
    max|ours - ref| <= 3 * max|base - ref| + 1e-5   for dq, dk, dv,
    |lse_ours - lse_ref| <= 1e-4 * max(1, |lse_ref|) elementwise (and -inf exactly where ref is).

Any NaN or infinity in ``ours`` where ``ref`` is finite fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
ABS_SLACK = 1e-5
LSE_RELATIVE = 1e-4

_F16, _F32 = np.float16, np.float32


@dataclass(frozen=True)
class Metric:
    """One tensor's result under the rule: ``error`` is compared with ``bound``.

    For out and the gradients, error = max|ours - ref| and base_error = max|base - ref|; for lse,
    error = max |ours - ref| / max(1, |ref|) and base_error is NaN (lse has a fixed tolerance).
    """

    name: str
    error: float
    base_error: float
    bound: float

    @property
    def passed(self) -> bool:
        """Whether error <= bound (False for a NaN or infinite error)."""
        return bool(np.isfinite(self.error) and self.error <= self.bound)


def _softmax_f32(scores16: np.ndarray, visible: np.ndarray):
    scores = np.where(visible, scores16.astype(_F32), _F32(-np.inf))
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, _F32(0))
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    has_keys = total > 0
    with np.errstate(divide="ignore"):
        lse = np.where(has_keys, row_max + np.log(np.where(has_keys, total, _F32(1))), _F32(-np.inf))
    return (weights / np.where(has_keys, total, _F32(1))).astype(_F32), lse[..., 0].astype(_F32)


def _matmul16(a, b) -> np.ndarray:
    # float32 accumulation (NumPy's float32 matmul), then one rounding to float16.
    return (a.astype(_F32) @ b.astype(_F32)).astype(_F16)


def _base_probabilities(q, k, causal, scale):
    k_full = reference.expand_kv(k, q.shape[1])
    scores16 = ((q.astype(_F32) @ np.swapaxes(k_full, -1, -2).astype(_F32)) * _F32(scale)).astype(_F16)
    probabilities, lse = _softmax_f32(scores16, reference.visible_keys(q.shape[2], k.shape[2], causal))
    return probabilities.astype(_F16), lse


def _reduce_kv16(x16: np.ndarray, num_kv_heads: int) -> np.ndarray:
    # A framework's backward of repeat-over-heads sums float16 grads in float32 and rounds once.
    return reference.reduce_kv(x16.astype(_F32), num_kv_heads).astype(_F16)


def base_forward(q, k, v, *, causal=False, softmax_scale=None):
    """The float16 baseline forward: (out float16, lse float32) on float16 q, k, v."""
    scale = reference.default_scale(q.shape[3], softmax_scale)
    probabilities16, lse = _base_probabilities(q, k, causal, scale)
    return _matmul16(probabilities16, reference.expand_kv(v, q.shape[1])), lse


def base_backward(dout, q, k, v, *, causal=False, softmax_scale=None):
    """The float16 baseline backward: (dq, dk, dv) float16, D = rowsum(dout * out) in float32."""
    scale = reference.default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads)
    probabilities16, _ = _base_probabilities(q, k, causal, scale)
    out16 = _matmul16(probabilities16, v_full)
    dprobabilities16 = _matmul16(dout, np.swapaxes(v_full, -1, -2))
    delta = np.sum(dout.astype(_F32) * out16.astype(_F32), axis=-1, keepdims=True)
    dscores16 = (probabilities16.astype(_F32) * (dprobabilities16.astype(_F32) - delta)).astype(_F16)
    dq = ((dscores16.astype(_F32) @ k_full.astype(_F32)) * _F32(scale)).astype(_F16)
    dk = ((np.swapaxes(dscores16, -1, -2).astype(_F32) @ q.astype(_F32)) * _F32(scale)).astype(_F16)
    dv = _matmul16(np.swapaxes(probabilities16, -1, -2), dout)
    return dq, _reduce_kv16(dk, num_kv_heads), _reduce_kv16(dv, num_kv_heads)


def max_abs_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| in float64; infinity when any difference is NaN or infinite."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - ref)
    return float(diff.max()) if np.all(np.isfinite(diff)) else float("inf")


def lse_metric(ours: np.ndarray, ref: np.ndarray) -> Metric:
    """The lse part of the rule: relative error where ref is finite, exact -inf where it is not."""
    ours = np.asarray(ours, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isneginf(ours), ~finite) or not np.all(np.isfinite(ours[finite])):
        error = float("inf")
    else:
        relative = np.abs(ours[finite] - ref[finite]) / np.maximum(1.0, np.abs(ref[finite]))
        error = float(relative.max()) if relative.size else 0.0
    return Metric("lse", error, float("nan"), LSE_RELATIVE)


def _metric(name: str, ours, base, ref, factor: float) -> Metric:
    base_error = max_abs_error(base, ref)
    return Metric(name, max_abs_error(ours, ref), base_error, factor * base_error + ABS_SLACK)


def evaluate_forward(q, k, v, out, lse, *, causal=False, softmax_scale=None, base_out=None) -> list[Metric]:
    """Judges a forward result (out, lse) for float16 q, k, v: metrics for out and lse.

    ``base_out`` replaces ``base_forward``'s out when the result comes from a composite
    computation whose float16 framework counterpart rounds more often: attention over key parts
    merged with ``merge_attention`` carries the float16 rounding of every part's out, and so does
    ``base_merge_attention`` of the parts' ``base_forward``.
    """
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    if base_out is None:
        base_out, _ = base_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return [_metric("out", out, base_out, ref_out, OUT_FACTOR), lse_metric(lse, ref_lse)]


def base_merge_attention(out_a, lse_a, out_b, lse_b):
    """The float16 baseline of ``merge_attention``: the merge in float32 arithmetic, out rounded
    to float16 (lse float32)."""
    lse_a, lse_b = np.asarray(lse_a, dtype=_F32), np.asarray(lse_b, dtype=_F32)
    empty_a, empty_b = np.isneginf(lse_a), np.isneginf(lse_b)
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.maximum(lse_a, lse_b)
        weight_a = np.where(empty_a, _F32(0), np.exp(lse_a - top))
        weight_b = np.where(empty_b, _F32(0), np.exp(lse_b - top))
        total = weight_a + weight_b
        has_keys = total > 0
        scale = np.where(has_keys, _F32(1) / np.where(has_keys, total, _F32(1)), _F32(0))[..., None]
        out = (np.where(weight_a[..., None] != 0, weight_a[..., None] * out_a.astype(_F32), _F32(0))
               + np.where(weight_b[..., None] != 0, weight_b[..., None] * out_b.astype(_F32), _F32(0))) * scale
        lse = np.where(has_keys, top + np.log(np.where(has_keys, total, _F32(1))), _F32(-np.inf))
    return out.astype(_F16), lse.astype(_F32)


def evaluate_backward(dout, q, k, v, dq, dk, dv, *, causal=False, softmax_scale=None) -> list[Metric]:
    """Judges a backward result (dq, dk, dv) for float16 dout, q, k, v: one metric per gradient."""
    refs = reference.backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale)
    bases = base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale)
    return [
        _metric(name, ours, base, ref, GRAD_FACTOR)
        for name, ours, base, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), bases, refs)
    ]


def describe(metrics: list[Metric]) -> str:
    """One line per metric, e.g. ``out: 1.2e-04 <= 3.1e-04 (base 1.5e-04) ok``."""
    return "\n".join(
        f"{m.name}: {m.error:.3e} {'<=' if m.passed else '>'} {m.bound:.3e}"
        f" (base {m.base_error:.3e}) {'ok' if m.passed else 'FAIL'}"
        for m in metrics
    )
