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
1e-6 for float32. The 16-bit roundings of base dominate its error, so there slack matters only
where base happens to be exact. In float32, FlashAttention-2's backward recomputes every P from the
float32 lse that the forward returned, which carries up to half an ulp of |lse| (1.2e-7 relative at
|lse| in [2, 4)) that base, normalising its softmax directly, does not have; every probability of the
row inherits it, so O(1) gradients carry a few 1e-7 beyond base (measured: up to 4x base at base
errors near 3e-7). 1e-6 covers that floor while any rounding to a 16-bit type (errors >= 1e-4) fails. Any NaN or infinity in ``ours`` where ``ref`` is
finite fails. Inputs are in the (B, H, N, D) order, v, out and dout with head_dim_v last.

Score options (attn_mask, window_size, softcap, alibi_slopes, sinks; keyword arguments as in
``reference``): base computes S = q k^T accumulated in float32 and rounds the scaled S to the dtype,
as above, then applies the softcap, the ALiBi bias and the additive mask in float32
(``reference.modify_scores``) and takes the float32 softmax with the sinks in its denominator; its
backward multiplies dS = P (dP - D) by the softcap's 1 - tanh^2 in float32 and rounds once.

dsinks[h] = -sum_{b,i} exp(sinks[h] - lse) D is a float32 reduction whose error comes from its rows'
terms: D = rowsum(dout * out) is computed from the forward's out, rounded to the dtype, and lse
carries the forward's error. Judging it by max|base - ref| like the gradients does not work: that
signed sum over rows can cancel by chance, and with one value per head there is no maximum over
many elements to even it out (measured on the CPU engine: ours/base up to 50x over 150 random
problems, while ours matched the float64 reduction of its own out and lse to float32 rounding). So
its base error is the base's row errors summed in absolute value,

    max_h sum_{b,i} |base_term - ref_term|,   term = exp(sinks[h] - lse) * D (base: float32 from the
                                              base's out and lse; ref: float64),

and dsinks passes when max|ours - ref| <= 3 * that + slack: what a computation whose rows are as
accurate as the baseline's can reach whatever their signs (ours/that stayed below 1.6 for float16
and bfloat16 and 2.9 for float32 over 450 random problems, the slack covering float32), while a
dsinks taken with the lse of a softmax without the sink, or 3 % off, fails (test_reference_options).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
#: The rule's additive slack per dtype name.
ABS_SLACK = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-6}
LSE_RELATIVE = 1e-4

_F16, _F32 = np.float16, np.float32


@dataclass(frozen=True)
class Metric:
    """One tensor's result under the rule: ``error`` is compared with ``bound``.

    For out and the gradients, error = max|ours - ref| and base_error = max|base - ref| (for dsinks
    the base's row errors summed in absolute value, see the module docstring); for lse,
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


def _matmul(a, b, dtype) -> np.ndarray:
    # float32 accumulation (NumPy's float32 matmul), then one rounding to the dtype.
    return (a.astype(_F32) @ b.astype(_F32)).astype(dtype)


def _base_probabilities(q, k, scale, sinks, options):
    """P in q's dtype, lse and the softcap's tanh (float32) and the key mask, as a framework
    computes them: S = q k^T accumulated in float32, scaled and rounded to the dtype; softcap,
    ALiBi and the additive mask applied in float32; softmax in float32; P rounded to the dtype."""
    k_full = reference.expand_kv(k, q.shape[1])
    scaled = ((q.astype(_F32) @ np.swapaxes(k_full, -1, -2).astype(_F32)) * _F32(scale)).astype(q.dtype)
    scores, tanh, keys = reference.modify_scores(scaled.astype(_F32), **options)
    probabilities, lse = reference.softmax(scores, keys, sinks)
    return probabilities.astype(q.dtype), lse, tanh, keys


def _reduce_kv(x: np.ndarray, num_kv_heads: int) -> np.ndarray:
    # A framework's backward of repeat-over-heads sums the grads in float32 and rounds once.
    return reference.reduce_kv(x.astype(_F32), num_kv_heads).astype(x.dtype)


def base_forward(q, k, v, *, causal=False, softmax_scale=None, attn_mask=None, window_size=reference.NO_WINDOW,
                 softcap=0.0, alibi_slopes=None, sinks=None):
    """The baseline forward in q's dtype: (out in that dtype, lse float32). Keyword arguments as
    ``reference.forward``."""
    scale = reference.default_scale(q.shape[3], softmax_scale)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask)
    probabilities, lse, _, _ = _base_probabilities(q, k, scale, sinks, options)
    return _matmul(probabilities, reference.expand_kv(v, q.shape[1]), q.dtype), lse


def base_backward(dout, q, k, v, *, causal=False, softmax_scale=None, attn_mask=None,
                  window_size=reference.NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """The baseline backward in q's dtype: (dq, dk, dv), and dsinks (float32) after them when sinks
    are given. D = rowsum(dout * out) in float32; dS = P (dP - D) in float32, through the softcap's
    1 - tanh^2 in float32, rounded once; dsinks = -sum exp(sinks - lse) D in float32."""
    return _base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, attn_mask=attn_mask,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)[0]


def _base_backward(dout, q, k, v, *, causal=False, softmax_scale=None, attn_mask=None,
                   window_size=reference.NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """(``base_backward``'s result, out, lse): out and lse are the ``base_forward`` it recomputes
    on the way, bit for bit."""
    dtype = q.dtype
    scale = reference.default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask)
    probabilities, lse, tanh, keys = _base_probabilities(q, k, scale, sinks, options)
    out = _matmul(probabilities, v_full, dtype)
    dprobabilities = _matmul(dout, np.swapaxes(v_full, -1, -2), dtype)
    delta = np.sum(dout.astype(_F32) * out.astype(_F32), axis=-1, keepdims=True)
    dscores = probabilities.astype(_F32) * (dprobabilities.astype(_F32) - delta)
    if tanh is not None:
        dscores = dscores * (_F32(1) - tanh * tanh)
    dscores = np.where(keys, dscores, _F32(0)).astype(dtype)
    dq = ((dscores.astype(_F32) @ k_full.astype(_F32)) * _F32(scale)).astype(dtype)
    dk = ((np.swapaxes(dscores, -1, -2).astype(_F32) @ q.astype(_F32)) * _F32(scale)).astype(dtype)
    dv = _matmul(np.swapaxes(probabilities, -1, -2), dout, dtype)
    grads = (dq, _reduce_kv(dk, num_kv_heads), _reduce_kv(dv, num_kv_heads))
    if sinks is not None:
        grads = (*grads, -reference.sink_terms(dout, out.astype(_F32), lse, sinks).sum(axis=(0, 2)))
    return grads, out, lse


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


def evaluate_forward(q, k, v, out, lse, *, causal=False, softmax_scale=None, base_out=None,
                     **options) -> list[Metric]:
    """Judges a forward result (out, lse) for q, k, v of one dtype: metrics for out and lse.
    ``options``: attn_mask, window_size, softcap, alibi_slopes, sinks as for ``reference.forward``.

    ``base_out`` replaces ``base_forward``'s out when the result comes from a composite
    computation whose framework counterpart rounds more often: attention over key parts merged with
    ``merge_attention`` carries the float16 rounding of every part's out, and so does
    ``base_merge_attention`` of the parts' ``base_forward``.
    """
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    if base_out is None:
        base_out, _ = base_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
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




def evaluate_backward(dout, q, k, v, dq, dk, dv, dsinks=None, *, causal=False, softmax_scale=None,
                      **options) -> list[Metric]:
    """Judges a backward result (dq, dk, dv, and dsinks when ``options`` has sinks) for dout, q, k, v
    of one dtype: one metric per gradient (dsinks: see the module docstring). ``options``:
    attn_mask, window_size, softcap, alibi_slopes, sinks as for ``reference.backward``."""
    refs, ref_out, ref_lse = reference._backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    bases, base_out, base_lse = _base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    metrics = [
        _metric(name, ours, base, ref, GRAD_FACTOR)
        for name, ours, base, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), bases, refs)
    ]
    if options.get("sinks") is None:
        return metrics
    if dsinks is None:
        raise ValueError("dsinks must be given when sinks are (the backward returns it fourth)")
    return metrics + [_dsinks_metric(dsinks, refs[3], dout, q.dtype, (ref_out, ref_lse), (base_out, base_lse),
                                     options["sinks"])]


def _dsinks_metric(dsinks, ref, dout, dtype, ref_result, base_result, sinks) -> Metric:
    # The base's error summed row by row, without the cancellation of its signed sum.
    (ref_out, ref_lse), (base_out, base_lse) = ref_result, base_result
    ref_terms = reference.sink_terms(np.asarray(dout, dtype=np.float64), ref_out, ref_lse, sinks)
    base_terms = reference.sink_terms(dout, base_out.astype(_F32), base_lse, sinks)
    base_error = float(np.max(np.sum(np.abs(base_terms - ref_terms), axis=(0, 2))))
    return Metric("dsinks", max_abs_error(dsinks, ref), base_error, GRAD_FACTOR * base_error + slack(dtype))


def describe(metrics: list[Metric]) -> str:
    """One line per metric, e.g. ``out: 1.2e-04 <= 3.1e-04 (base 1.5e-04) ok``."""
    return "\n".join(
        f"{m.name}: {m.error:.3e} {'<=' if m.passed else '>'} {m.bound:.3e}"
        f" (base {m.base_error:.3e}) {'ok' if m.passed else 'FAIL'}"
        for m in metrics
    )
