"""The accuracy rule (the FlashAttention test-suite pattern) and its per-dtype baseline.

``ref`` is float64 math on the same inputs (``reference``), whatever their dtype. ``base`` is the
same math as a framework does it in the inputs' dtype: for float16 and bfloat16 every matrix product
accumulated in float32 and rounded to the dtype (S, P, O; dP, dS, dQ, dK, dV), softmax in float32,
D = rowsum(dout * out) in float32, GQA gradients summed in float32 and rounded once. A result passes
when, for out and each of dq, dk, dv,

    max|ours - ref| <= factor * max|base - ref| + atol(ref),
    factor = 2 (4 with a softcap),   atol(ref) = 2 * max|(ref + 0.3 - 0.3) - ref| in float32,

and |lse_ours - lse_ref| <= 1e-4 * max(1, |ref|) elementwise (and -inf exactly where ref is). Any
NaN or infinity in ``ours`` where ``ref`` is finite fails.

The factor 2 and atol are FlashAttention's (Dao-AILab/flash-attention, hopper/test_flash_attn.py and
tests/cute/test_flash_attn.py: ``rtol = 2``, ``fwd_atol = 2 * (out_ref + 0.3 - 0.3 - out_ref)
.abs().max()``, the same per gradient). Two differences, both stricter or stated: FlashAttention
evaluates atol on its reference cast to the input dtype (``attention_ref`` returns
``output.to(dtype_og)``), so its atol is a 16-bit rounding; here ``ref`` is taken to float32, so atol
is twice the reference's own float32 rounding at its magnitude (about 2.4e-7 * (max|ref| + 0.3)),
which only matters where base happens to be exact (tiny problems). With a softcap FlashAttention
uses 3x plus 3e-4 on the gradients; the factor here is 4 with no 3e-4, the larger factor paying for
the 1 - tanh^2 product that the baseline rounds once and a kernel per tile.

float32: NumPy's blocked float32 BLAS sums more accurately than a streaming kernel (at 2048 keys a
correct kernel's dk was 2.2x that base), so float32 has a second base in the kernels' order: every
reduction (S over head_dim, O over keys, dP over head_dim_v, dQ over keys, dK and dV over the rows
of all query heads of a GQA group) in float32, one term at a time in order, the online softmax's
running max, sum and rescale of O once per ``STREAM_WIDTH`` = 8 keys (the narrowest key tile), the
backward's P recomputed from the streamed forward's float32 lse, as FlashAttention-2's backward
does. A sequential sum is the least accurate order a tiled kernel can take (a hardware 8 x 8
multiply-accumulate that adds its products in a tree only does better). ``base`` error is the
larger of the two bases' errors: on near one-hot rows (huge scores) the error is the rounding of
one or two dominant scores, and which order happens to round them luckier is chance (measured at
softmax_scale 60: dq 8.7e-3 streamed, 3.6e-2 blocked, ours 3.6e-2). The same factor and atol then
apply; at float32's small errors atol is a real part of the bound.

Metal 4 tensor-op kernels (``tensor_ops=True``; docs/tensor-ops.md): their matmul2d runs with
relaxed_precision, under which an M5 truncates float32 operands (P in P V, dS in the backward)
toward zero to 10 mantissa bits (2^-10.4 relative measured; the CPU engine's emulation does the
same), where the base rounds them to the dtype (2^-11 for float16, 2^-8 for bfloat16, to nearest).
Truncation biases every weight of a row the same way, so its errors add up where rounding's cancel:
the factor becomes TENSOR_OPS_FACTOR = 4 (twice 2; the softcap's 4 stays 4) with the same atol. lse
is unaffected (Q K^T takes the dtype's operands, exact products into float32).

Dropout (``dropout_mask``, the multipliers Z of ``reference.forward``): base multiplies P by Z in
float32 before rounding it to the dtype for P V (the float32 base: each streamed weight before its
product with v), and dP by Z in float32 in the backward, as a framework's dropout on P does.

Score options (attn_mask, window_size, softcap, alibi_slopes, sinks; keyword arguments as in
``reference``): base computes S = q k^T accumulated in float32 and rounds the scaled S to the dtype,
as above, then applies the softcap, the ALiBi bias and the additive mask in float32
(``reference.modify_scores``) and takes the float32 softmax with the sinks in its denominator; its
backward multiplies dS = P (dP - D) by the softcap's 1 - tanh^2 in float32 and rounds once.

dsinks[h] = -sum_{b,i} exp(sinks[h] - lse) D is one float32 sum per head of row terms
(D = rowsum(dout * out) from the forward's out, rounded to the dtype; lse with the forward's error).
Its error is a sum of the rows' errors, which are independent of each other, so its size is that of
their root sum of squares, not their maximum: the base error is

    max_h sqrt(sum_{b,i} (base_term - ref_term)^2),   term = exp(sinks[h] - lse) * D
                                                      (base: float32 from the base's out and lse),

and dsinks passes when max|ours - ref| <= DSINKS_FACTOR * that + atol(ref). The base's own signed
sum is no yardstick (it cancels by chance: ours/that reached 50x on correct kernels), and the sum of
the rows' absolute errors grows with the rows where the error grows with their square root (it let
a 3 % error pass in bfloat16 at 256 rows). A sum of independent errors of root sum of squares s
exceeds 4 s with probability 6e-5 (normal tail), so DSINKS_FACTOR = 4 plays the role of the others'
2x-the-maximum-error (the maximum of thousands of such errors is itself about 4 s). Measured on the
CPU engine over random problems with sinks (up to 300 rows): ours/s at most 2.04 in float16 and
bfloat16 (60 problems each) and 2.31 in float32 (40).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference

OUT_FACTOR = 2.0
GRAD_FACTOR = 2.0
#: The factor of out and the gradients when a softcap is given.
SOFTCAP_FACTOR = 4.0
#: dsinks' factor on its root-sum-square base error (see the module docstring).
DSINKS_FACTOR = 4.0
#: The least factor of out and the gradients of the Metal 4 tensor-op kernels (``tensor_ops=True``;
#: see the module docstring): relaxed precision truncates their float32 operands (P, dS) to 10
#: mantissa bits.
TENSOR_OPS_FACTOR = 4.0
LSE_RELATIVE = 1e-4
#: The float32 baseline's key tile: its online softmax updates the running max once per this many
#: keys (the narrowest tile of the kernels).
STREAM_WIDTH = 8
#: From this |lse| on (its ulp 2^-15) the float32 lse may have lost part of log(sum) beside the row
#: max: the float32 baseline's backward then corrects P by the lost residual, as the kernels do.
LSE_RESIDUAL_MIN = 256.0

_F16, _F32 = np.float16, np.float32


@dataclass(frozen=True)
class Metric:
    """One tensor's result under the rule: ``error`` is compared with ``bound``.

    For out and the gradients, error = max|ours - ref| and base_error = max|base - ref| (for dsinks
    the root sum of squares of the base's row errors, see the module docstring); for lse,
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


def absolute_term(ref) -> float:
    """FlashAttention's atol, 2 * max|(ref + 0.3 - 0.3) - ref|, each step rounded to float32: twice
    the reference's own float32 rounding at its magnitude (0 for an empty ``ref``; NaN or infinite
    entries of ``ref`` are left out: the error of ``ours`` there is judged by ``max_abs_error``)."""
    ref32 = np.asarray(ref, dtype=np.float64).astype(_F32)
    ref32 = ref32[np.isfinite(ref32)]
    if ref32.size == 0:
        return 0.0
    return float(2 * np.max(np.abs((ref32 + _F32(0.3) - _F32(0.3)) - ref32)))


def factor(name: str, softcap: float = 0.0, tensor_ops: bool = False) -> float:
    """The rule's factor on max|base - ref| for ``name`` (out, dq, dk, dv or dsinks); at least
    TENSOR_OPS_FACTOR for the tensor-op kernels (``tensor_ops``)."""
    if name == "dsinks":
        return DSINKS_FACTOR
    base = SOFTCAP_FACTOR if softcap else (OUT_FACTOR if name == "out" else GRAD_FACTOR)
    return max(base, TENSOR_OPS_FACTOR) if tensor_ops else base


def bound(name: str, base_error: float, ref, softcap: float = 0.0, tensor_ops: bool = False) -> float:
    """The rule's bound on max|ours - ref| for tensor ``name`` whose base error is ``base_error``:
    ``factor(name, softcap, tensor_ops) * base_error + absolute_term(ref)``."""
    return factor(name, softcap, tensor_ops) * base_error + absolute_term(ref)


def _matmul(a, b, dtype) -> np.ndarray:
    # float32 accumulation (NumPy's float32 matmul), then one rounding to the dtype.
    return (a.astype(_F32) @ b.astype(_F32)).astype(dtype)


def _streamed_matmul(a, b) -> np.ndarray:
    """a @ b in float32, the inner dimension added one term at a time in its order (the float32
    baseline's order, module docstring)."""
    a, b = np.asarray(a, dtype=_F32), np.asarray(b, dtype=_F32)
    total = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), _F32)
    for j in range(a.shape[-1]):
        total += a[..., j:j + 1] * b[..., j:j + 1, :]
    return total


def _without_dropout(options):
    """(options without dropout_mask, its multipliers as float32 or None)."""
    options = dict(options)
    mask = options.pop("dropout_mask", None)
    return options, None if mask is None else np.asarray(mask).astype(_F32)


def _streamed_forward(q, k, v, scale, sinks, options):
    """The float32 baseline's forward: (out, lse, residual, scores, tanh, keys), scores and out accumulated
    one term at a time, the online softmax's running max, sum and rescale of out once per tile of
    ``STREAM_WIDTH`` keys, the sink added to the denominator at the end."""
    options, dropout = _without_dropout(options)
    num_heads = q.shape[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads).astype(_F32)
    scaled = _streamed_matmul(q, np.swapaxes(k_full, -1, -2)) * _F32(scale)
    scores, tanh, keys = reference.modify_scores(scaled, **options)
    rows = scores.shape[:-1]
    running_max = np.full(rows, -np.inf, _F32)
    total = np.zeros(rows, _F32)
    out = np.zeros(rows + (v.shape[-1],), _F32)
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, scores.shape[-1], STREAM_WIDTH):
            tile = scores[..., start:start + STREAM_WIDTH]
            new_max = np.maximum(running_max, tile.max(axis=-1))
            shift = np.where(np.isneginf(new_max), _F32(0), new_max)
            rescale = np.exp(running_max - shift)
            weights = np.exp(tile - shift[..., None])
            total = total * rescale + weights.sum(axis=-1)  # undropped: lse is of the scores
            out = out * rescale[..., None]
            if dropout is not None:
                weights = weights * np.broadcast_to(dropout, scores.shape)[..., start:start + STREAM_WIDTH]
            for j in range(tile.shape[-1]):
                out += weights[..., j, None] * v_full[..., start + j, None, :]
            running_max = new_max
        if sinks is not None:
            sink = np.broadcast_to(np.asarray(sinks, _F32)[None, :, None], rows)
            new_max = np.maximum(running_max, sink)
            rescale = np.exp(running_max - new_max)
            total = total * rescale + np.exp(sink - new_max)
            out = out * rescale[..., None]
            running_max = new_max
        nonempty = total > 0
        out = np.where(nonempty[..., None], out / np.where(nonempty, total, _F32(1))[..., None], _F32(0))
        log_total = np.log(np.where(nonempty, total, _F32(1)))
        lse = np.where(nonempty, running_max + log_total, _F32(-np.inf))
        # Where |lse| is so large that float32 lost part of log(total) beside the max, the backward
        # takes back the difference (as the kernels' lse residual pass does).
        residual = np.where(nonempty & (np.abs(lse) >= LSE_RESIDUAL_MIN), (running_max - lse) + log_total, _F32(0))
    return out.astype(_F32), lse.astype(_F32), residual.astype(_F32), scores, tanh, keys


def _streamed_backward(dout, q, k, v, scale, sinks, options):
    """The float32 baseline's backward: ((dq, dk, dv), out, lse), P recomputed from the streamed
    forward's lse, every product streamed (``_streamed_matmul``)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    out, lse, residual, scores, tanh, keys = _streamed_forward(q, k, v, scale, sinks, options)
    dropout = _without_dropout(options)[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads)
    row_lse = np.where(np.isneginf(lse), _F32(0), lse)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        probabilities = np.where(keys, np.exp((scores - row_lse) - residual[..., None]), _F32(0)).astype(_F32)
    dprobabilities = _streamed_matmul(dout, np.swapaxes(v_full, -1, -2))
    kept = probabilities
    if dropout is not None:
        kept, dprobabilities = probabilities * dropout, dprobabilities * dropout
    delta = np.sum(dout.astype(_F32) * out, axis=-1, keepdims=True)
    dscores = probabilities * (dprobabilities - delta)
    if tanh is not None:
        dscores = dscores * (_F32(1) - tanh * tanh)
    dscores = np.where(keys, dscores, _F32(0))
    dq = _streamed_matmul(dscores, k_full) * _F32(scale)
    # dK and dV sum over the query heads of a GQA group and their rows in one running sum.
    dk = _streamed_matmul(_group_rows(dscores, num_kv_heads, transpose=True), _group_rows(q, num_kv_heads))
    dv = _streamed_matmul(_group_rows(np.broadcast_to(kept, probabilities.shape), num_kv_heads, transpose=True),
                          _group_rows(dout, num_kv_heads))
    return (dq, dk * _F32(scale), dv), out, lse


def _group_rows(x, num_kv_heads: int, transpose: bool = False) -> np.ndarray:
    """(B, H, N, X) as (B, num_kv_heads, G * N, X), the rows of a GQA group's G query heads one
    after the other (swapped to (..., X, G * N) with ``transpose``)."""
    batch, num_heads, rows, cols = x.shape
    grouped = x.reshape(batch, num_kv_heads, (num_heads // num_kv_heads) * rows, cols)
    return np.swapaxes(grouped, -1, -2) if transpose else grouped


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
                 softcap=0.0, alibi_slopes=None, sinks=None, dropout_mask=None):
    """The baseline forward in q's dtype: (out in that dtype, lse float32); for float32 the streamed
    order of the kernels (module docstring). Keyword arguments as ``reference.forward``."""
    scale = reference.default_scale(q.shape[3], softmax_scale)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask, dropout_mask=dropout_mask)
    if q.dtype == _F32:
        return _streamed_forward(q, k, v, scale, sinks, options)[:2]
    return _framework_forward(q, k, v, scale, sinks, options)


def _framework_forward(q, k, v, scale, sinks, options):
    """(out, lse) as a framework computes them in q's dtype (``base_forward``)."""
    options, dropout = _without_dropout(options)
    probabilities, lse, _, _ = _base_probabilities(q, k, scale, sinks, options)
    return _matmul(_base_dropped(probabilities, dropout), reference.expand_kv(v, q.shape[1]), q.dtype), lse


def _base_dropped(probabilities, dropout):
    """P * Z in float32 rounded to P's dtype, as a framework's dropout on P (P without Z)."""
    if dropout is None:
        return probabilities
    return (probabilities.astype(_F32) * dropout).astype(probabilities.dtype)


def base_backward(dout, q, k, v, *, causal=False, softmax_scale=None, attn_mask=None,
                  window_size=reference.NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None, dropout_mask=None):
    """The baseline backward in q's dtype: (dq, dk, dv), and dsinks (float32) after them when sinks
    are given. D = rowsum(dout * out) in float32; dS = P (dP - D) in float32, through the softcap's
    1 - tanh^2 in float32, rounded once; dsinks = -sum exp(sinks - lse) D in float32. For float32
    every product is streamed in the kernels' order and P recomputed from the forward's lse."""
    return _base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, attn_mask=attn_mask,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          dropout_mask=dropout_mask)[0]


def _base_backward(dout, q, k, v, *, causal=False, softmax_scale=None, attn_mask=None,
                   window_size=reference.NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None, dropout_mask=None,
                   blocked=False):
    """(``base_backward``'s result, out, lse): out and lse are the ``base_forward`` it recomputes
    on the way, bit for bit. ``blocked``: float32 in NumPy's blocked order instead of streamed."""
    dtype = q.dtype
    scale = reference.default_scale(q.shape[3], softmax_scale)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask, dropout_mask=dropout_mask)
    if dtype == _F32 and not blocked:
        grads, out, lse = _streamed_backward(dout, q, k, v, scale, sinks, options)
    else:
        grads, out, lse = _framework_backward(dout, q, k, v, scale, sinks, options)
    if sinks is not None:
        grads = (*grads, -reference.sink_terms(dout, out.astype(_F32), lse, sinks).sum(axis=(0, 2)))
    return grads, out, lse


def _framework_backward(dout, q, k, v, scale, sinks, options):
    """((dq, dk, dv), out, lse) as a framework computes them in q's dtype (``base_backward``)."""
    dtype = q.dtype
    options, dropout = _without_dropout(options)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = reference.expand_kv(k, num_heads), reference.expand_kv(v, num_heads)
    probabilities, lse, tanh, keys = _base_probabilities(q, k, scale, sinks, options)
    kept = _base_dropped(probabilities, dropout)
    out = _matmul(kept, v_full, dtype)
    dprobabilities = _base_dropped(_matmul(dout, np.swapaxes(v_full, -1, -2), dtype), dropout)
    delta = np.sum(dout.astype(_F32) * out.astype(_F32), axis=-1, keepdims=True)
    dscores = probabilities.astype(_F32) * (dprobabilities.astype(_F32) - delta)
    if tanh is not None:
        dscores = dscores * (_F32(1) - tanh * tanh)
    dscores = np.where(keys, dscores, _F32(0)).astype(dtype)
    dq = ((dscores.astype(_F32) @ k_full.astype(_F32)) * _F32(scale)).astype(dtype)
    dk = ((np.swapaxes(dscores, -1, -2).astype(_F32) @ q.astype(_F32)) * _F32(scale)).astype(dtype)
    dv = _matmul(np.swapaxes(kept, -1, -2), dout, dtype)
    return (dq, _reduce_kv(dk, num_kv_heads), _reduce_kv(dv, num_kv_heads)), out, lse


def max_abs_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| in float64; infinity when any difference is NaN or infinite."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - ref)
    return float(diff.max()) if np.all(np.isfinite(diff)) else float("inf")


def _lse_error(ours: np.ndarray, ref: np.ndarray) -> float:
    ours = np.asarray(ours, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isneginf(ours), ~finite) or not np.all(np.isfinite(ours[finite])):
        return float("inf")
    relative = np.abs(ours[finite] - ref[finite]) / np.maximum(1.0, np.abs(ref[finite]))
    return float(relative.max()) if relative.size else 0.0


def lse_metric(ours: np.ndarray, ref: np.ndarray, base=None) -> Metric:
    """The lse part of the rule: relative error where ref is finite, exact -inf where it is not,
    within LSE_RELATIVE; with a ``base`` lse (inputs the kernels can only hold rounded, see
    ``evaluate_forward``'s ``exact_kv``), within OUT_FACTOR times the base's relative error if
    that is larger."""
    base_error = float("nan") if base is None else _lse_error(base, ref)
    bound = LSE_RELATIVE if base is None else max(LSE_RELATIVE, OUT_FACTOR * base_error)
    return Metric("lse", _lse_error(ours, ref), base_error, bound)


def _metric(name: str, ours, bases, ref, softcap: float, tensor_ops: bool = False) -> Metric:
    # float32 has two baselines (module docstring): the larger error counts.
    base_error = max(max_abs_error(base, ref) for base in bases)
    return Metric(name, max_abs_error(ours, ref), base_error, bound(name, base_error, ref, softcap, tensor_ops))


def evaluate_forward(q, k, v, out, lse, *, causal=False, softmax_scale=None, base_out=None, exact_kv=None,
                     tensor_ops=False, **options) -> list[Metric]:
    """Judges a forward result (out, lse) for q, k, v of one dtype: metrics for out and lse (out
    alone when ``lse`` is None, for callers that have no lse). ``options``: attn_mask, window_size,
    softcap, alibi_slopes, sinks as for ``reference.forward``. ``tensor_ops``: the result of a
    tensor-op kernel, held to at least TENSOR_OPS_FACTOR.

    ``base_out`` replaces ``base_forward``'s out when the result comes from a composite
    computation whose framework counterpart rounds more often: attention over key parts merged with
    ``merge_attention`` carries the float16 rounding of every part's out, and so does
    ``base_merge_attention`` of the parts' ``base_forward``.

    ``exact_kv`` (float64 keys, values) replaces k, v in the reference when k, v are their rounding
    to q's dtype, as the kernels see a quantized KV cache: dequantized exactly in float64 for the
    reference, rounded to the dtype for the base (as a dtype implementation reading that cache,
    e.g. MLX's ``mx.dequantize`` followed by attention, holds it); lse is then judged against the
    lse of those rounded inputs computed exactly (``lse_metric``'s base), the error the rounding
    alone makes.
    """
    ref_k, ref_v = (k, v) if exact_kv is None else exact_kv
    ref_out, ref_lse = reference.forward(q, ref_k, ref_v, causal=causal, softmax_scale=softmax_scale, **options)
    base_lse = None
    if base_out is None:
        base_outs = [base_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)[0]]
        if exact_kv is not None:
            base_lse = reference.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)[1]
        if q.dtype == _F32:
            scale = reference.default_scale(q.shape[3], softmax_scale)
            score_options = {name: value for name, value in options.items() if name != "sinks"}
            base_outs.append(_framework_forward(q, k, v, scale, options.get("sinks"),
                                                dict(score_options, causal=causal))[0])
    else:
        base_outs = [base_out]
    metrics = [_metric("out", out, base_outs, ref_out, options.get("softcap", 0.0), tensor_ops)]
    return metrics if lse is None else metrics + [lse_metric(lse, ref_lse, base_lse)]


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
                      tensor_ops=False, **options) -> list[Metric]:
    """Judges a backward result (dq, dk, dv, and dsinks when ``options`` has sinks) for dout, q, k, v
    of one dtype: one metric per gradient (dsinks: see the module docstring). ``options``:
    attn_mask, window_size, softcap, alibi_slopes, sinks as for ``reference.backward``.
    ``tensor_ops``: the result of tensor-op kernels, dq, dk, dv held to at least TENSOR_OPS_FACTOR."""
    refs, ref_out, ref_lse = reference._backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    bases, base_out, base_lse = _base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, **options)
    candidates = [bases]
    if q.dtype == _F32:
        candidates.append(_base_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, blocked=True,
                                         **options)[0])
    metrics = [
        _metric(name, ours, [c[i] for c in candidates], ref, options.get("softcap", 0.0), tensor_ops)
        for i, (name, ours, ref) in enumerate(zip(("dq", "dk", "dv"), (dq, dk, dv), refs))
    ]
    if options.get("sinks") is None:
        return metrics
    if dsinks is None:
        raise ValueError("dsinks must be given when sinks are (the backward returns it fourth)")
    return metrics + [_dsinks_metric(dsinks, refs[3], dout, (ref_out, ref_lse), (base_out, base_lse),
                                     options["sinks"])]


def _dsinks_metric(dsinks, ref, dout, ref_result, base_result, sinks) -> Metric:
    # The root sum of squares of the base's row errors: the size of a sum of independent errors.
    (ref_out, ref_lse), (base_out, base_lse) = ref_result, base_result
    ref_terms = reference.sink_terms(np.asarray(dout, dtype=np.float64), ref_out, ref_lse, sinks)
    base_terms = reference.sink_terms(dout, base_out.astype(_F32), base_lse, sinks)
    squares = np.square(base_terms.astype(np.float64) - ref_terms)
    base_error = float(np.sqrt(np.max(np.sum(squares, axis=(0, 2)))))
    return Metric("dsinks", max_abs_error(dsinks, ref), base_error, bound("dsinks", base_error, ref))


def describe(metrics: list[Metric]) -> str:
    """One line per metric, e.g. ``out: 1.2e-04 <= 3.1e-04 (base 1.5e-04) ok``."""
    return "\n".join(
        f"{m.name}: {m.error:.3e} {'<=' if m.passed else '>'} {m.bound:.3e}"
        f" (base {m.base_error:.3e}) {'ok' if m.passed else 'FAIL'}"
        for m in metrics
    )
