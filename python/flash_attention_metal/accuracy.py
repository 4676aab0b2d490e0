"""The accuracy rule (the FlashAttention test-suite pattern) and its per-dtype baseline.

``ref`` is float64 math on the same inputs (``reference``), whatever their dtype. ``base`` is the
same math as a framework does it in the inputs' dtype (float16, bfloat16 or float32): every matrix
product accumulated in float32 and rounded to the dtype (S, P, O; dP, dS, dQ, dK, dV), softmax in
float32, D = rowsum(dout * out) in float32, GQA gradients summed in float32 and rounded once. For
float32 the roundings are to float32 itself, so base is the plain float32 computation. A result
passes when

    max|ours - ref| <= 2 * max|base - ref| + slack   for out,
    max|ours - ref| <= 3 * max|base - ref| + slack   for dq, dk, dv,
    |lse_ours - lse_ref| <= 1e-4 * max(1, |lse_ref|) elementwise (and -inf exactly where ref is),

with slack 1e-5 for float16 and bfloat16 (1/100 of float16's epsilon, as FlashAttention's tests) and
1e-7 for float32 (about one float32 epsilon at the O(1) outputs of N(0, 1) inputs). The 16-bit
roundings of base dominate its error, so there slack matters only where base happens to be exact;
in float32 the kernel's own float32 roundings are of the size of base's, and a textbook
FlashAttention-2 in float32 (online softmax, P recomputed from the float32 lse) lands up to about
3x base + 1e-8 on random shapes: the slack keeps that honest algorithm inside the rule while any
rounding to a 16-bit type (errors >= 1e-4) fails. Any NaN or infinity in ``ours`` where ``ref`` is
finite fails. Inputs are in the (B, H, N, D) order, v, out and dout with head_dim_v last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
#: The rule's additive slack per dtype name.
ABS_SLACK = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-7}
LSE_RELATIVE = 1e-4

_F32 = np.float32


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


def _softmax_f32(scores: np.ndarray, visible: np.ndarray):
    scores = np.where(visible, scores.astype(_F32), _F32(-np.inf))
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, _F32(0))
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    has_keys = total > 0
    with np.errstate(divide="ignore"):
        lse = np.where(has_keys, row_max + np.log(np.where(has_keys, total, _F32(1))), _F32(-np.inf))
    return (weights / np.where(has_keys, total, _F32(1))).astype(_F32), lse[..., 0].astype(_F32)


def _matmul(a, b, dtype) -> np.ndarray:
    # float32 accumulation (NumPy's float32 matmul), then one rounding to the dtype.
    return (a.astype(_F32) @ b.astype(_F32)).astype(dtype)


def _base_probabilities(q, k, causal, scale):
    k_full = reference.expand_kv(k, q.shape[1])
    scores = ((q.astype(_F32) @ np.swapaxes(k_full, -1, -2).astype(_F32)) * _F32(scale)).astype(q.dtype)
    probabilities, lse = _softmax_f32(scores, reference.visible_keys(q.shape[2], k.shape[2], causal))
    return probabilities.astype(q.dtype), lse


def _reduce_kv(x: np.ndarray, num_kv_heads: int) -> np.ndarray:
    # A framework's backward of repeat-over-heads sums the grads in float32 and rounds once.
    return reference.reduce_kv(x.astype(_F32), num_kv_heads).astype(x.dtype)


def base_forward(q, k, v, *, causal=False, softmax_scale=None):
    """The baseline forward in q's dtype: (out in that dtype, lse float32)."""
    scale = reference.default_scale(q.shape[3], softmax_scale)
    probabilities, lse = _base_probabilities(q, k, causal, scale)
    return _matmul(probabilities, reference.expand_kv(v, q.shape[1]), q.dtype), lse


def base_backward(dout, q, k, v, *, causal=False, softmax_scale=None):
    """The baseline backward in q's dtype: (dq, dk, dv), D = rowsum(dout * out) in float32."""
    dtype = q.dtype
    scale = reference.default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads)
    probabilities, _ = _base_probabilities(q, k, causal, scale)
    out = _matmul(probabilities, v_full, dtype)
    dprobabilities = _matmul(dout, np.swapaxes(v_full, -1, -2), dtype)
    delta = np.sum(dout.astype(_F32) * out.astype(_F32), axis=-1, keepdims=True)
    dscores = (probabilities.astype(_F32) * (dprobabilities.astype(_F32) - delta)).astype(dtype)
    dq = ((dscores.astype(_F32) @ k_full.astype(_F32)) * _F32(scale)).astype(dtype)
    dk = ((np.swapaxes(dscores, -1, -2).astype(_F32) @ q.astype(_F32)) * _F32(scale)).astype(dtype)
    dv = _matmul(np.swapaxes(probabilities, -1, -2), dout, dtype)
    return dq, _reduce_kv(dk, num_kv_heads), _reduce_kv(dv, num_kv_heads)


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


def slack(dtype) -> float:
    """The rule's additive slack for a dtype (``ABS_SLACK``)."""
    return ABS_SLACK[np.dtype(dtype).name]


def _metric(name: str, ours, base, ref, factor: float) -> Metric:
    base_error = max_abs_error(base, ref)
    return Metric(name, max_abs_error(ours, ref), base_error, factor * base_error + slack(base.dtype))


def evaluate_forward(q, k, v, out, lse, *, causal=False, softmax_scale=None) -> list[Metric]:
    """Judges a forward result (out, lse) for q, k, v of one dtype: metrics for out and lse."""
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    base_out, _ = base_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return [_metric("out", out, base_out, ref_out, OUT_FACTOR), lse_metric(lse, ref_lse)]


def evaluate_backward(dout, q, k, v, dq, dk, dv, *, causal=False, softmax_scale=None) -> list[Metric]:
    """Judges a backward result (dq, dk, dv) for dout, q, k, v of one dtype: one metric per
    gradient."""
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
