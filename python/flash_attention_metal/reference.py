"""Float64 NumPy reference attention, the ground truth of the accuracy rule.

Same semantics as the library: q (B, H, Nq, D); k (B, H_kv, Nk, D); v (B, H_kv, Nk, Dv), where the
value head dim Dv (head_dim_v) may differ from D (DeepSeek's MLA: D 192, Dv 128); out and dout
(B, H, Nq, Dv). GQA: query head h reads KV head h // (H // H_kv) and dk, dv sum over the group. The
default softmax_scale is 1/sqrt(D).

Scores, in this order (FlashAttention's and PyTorch's definitions):

    s = softcap * tanh(softmax_scale * q.k / softcap)        (softcap > 0; else softmax_scale * q.k)
        - slope[b, h] * |i + Nk - Nq - j|                      (ALiBi)
        + attn_mask[b, h, i, j]                                (additive mask)

Query i sees key j iff it lies in the sliding window, i + Nk - Nq - left <= j <= i + Nk - Nq + right
(bottom-right aligned; -1 leaves a side unbounded; ``causal`` is right = 0), a boolean attn_mask
allows it (True = may attend) and an additive attn_mask entry is not -inf. A sink is one virtual key
per head with logit sinks[h] and no value: it joins the softmax denominator, so
lse = log(exp(sinks[h]) + sum_j exp(s_j)) and dsinks[h] = -sum_{b,i} exp(sinks[h] - lse) * D with
D = rowsum(dout * out). A row that sees no key gives out 0, zero gradients and lse -inf, or lse
sinks[h] with a sink.

Dropout (FlashAttention's): ``dropout_mask`` Z (B, H, Nq, Nk), 0 where an element is dropped and
1 / (1 - p) where kept (``philox.dropout_multiplier``), multiplies P after the softmax:
out = (P * Z) V, while lse stays that of the undropped scores. Backward: dV = (P * Z)^T dout,
dP = (dout V^T) * Z, and D = rowsum(dout * out) with the dropped out, since
rowsum(P * dP) = sum_j P_ij Z_ij dout_i . v_j = dout_i . out_i; dS = P (dP - D).

Inputs of any real dtype (float16, ml_dtypes.bfloat16, float32, float64) are converted exactly to
float64 and computed in float64, whatever the dtype the library ran in. Arrays are in the (B, H, N, D)
order; pass a (B, N, H, D) array as ``x.transpose(0, 2, 1, 3)``; attn_mask is broadcastable to
(B, H, Nq, Nk) in every layout. Materializes the (B, H, Nq, Nk) attention matrix: for checking, not
for speed.
"""

from __future__ import annotations

import math

import numpy as np

from . import quantized

#: The window_size that bounds neither side (FlashAttention's default).
NO_WINDOW = (-1, -1)


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window_size=NO_WINDOW) -> np.ndarray:
    """Boolean (seqlen_q, seqlen_k) mask of the keys each query sees through the bottom-right
    aligned causal mask and sliding window: j - (i + seqlen_k - seqlen_q) lies in [-left, right],
    right = 0 when causal, -1 leaving a side unbounded."""
    left, right = window_size
    if causal:
        right = 0
    offset = np.arange(seqlen_k)[None, :] - (np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


def key_mask(seqlen_q: int, seqlen_k: int, causal: bool, window_size=NO_WINDOW, attn_mask=None) -> np.ndarray:
    """The keys each row may weigh: ``visible_keys`` and, with an attn_mask, its True entries
    (boolean) or its entries other than -inf (additive). Shape (Nq, Nk), or (B|1, H|1, Nq, Nk) with a
    mask, broadcastable to (B, H, Nq, Nk)."""
    visible = visible_keys(seqlen_q, seqlen_k, causal, window_size)
    if attn_mask is None:
        return visible
    mask = np.asarray(attn_mask)
    allowed = mask if mask.dtype == bool else ~np.isneginf(mask.astype(np.float64))
    return visible & allowed.reshape((1,) * (4 - allowed.ndim) + allowed.shape)


def alibi_bias(alibi_slopes, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """ALiBi's -slope * |i + seqlen_k - seqlen_q - j| in float64, (1|B, H, Nq, Nk), for slopes of
    shape (H,) or (B, H) (FlashAttention's definition)."""
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape)
    distance = np.abs(np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q - np.arange(seqlen_k)[None, :])
    return -slopes[:, :, None, None] * distance


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
    """sum over k with mask[..., m, k] of a[..., m, k] * b[..., k, n], for a (..., M, K), a boolean
    mask broadcastable to a, and b (..., K, N).

    A plain ``a @ b`` with a zeroed at masked entries would still turn a NaN or infinity of b at a
    masked k into NaN (0 * inf). The reference keeps to the math (a masked k weighs exactly 0, so
    its b is not read): rows that meet a non-finite b at an unmasked k are recomputed over their
    unmasked k alone. The library may read a masked key's value where the key shares a tile or chunk
    with keys the row sees, and 0 * NaN then reaches that row (docs/semantics.md, "Non-finite
    values"); tests compare such rows only where both are finite.
    """
    a = np.where(mask, a, 0.0)
    finite = np.isfinite(b)
    result = a @ np.where(finite, b, 0.0)
    if finite.all():
        return result
    mask = np.broadcast_to(mask, a.shape)
    hits = (mask.astype(np.float64) @ (~finite).astype(np.float64)).any(axis=-1)
    for index in zip(*np.nonzero(hits)):
        keep = mask[index]
        with np.errstate(invalid="ignore"):
            result[index] = a[index][keep] @ b[index[:-1]][keep]
    return result


def modify_scores(scaled, *, causal: bool = False, window_size=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None,
                  attn_mask=None):
    """(scores, tanh, keys) from the scaled products softmax_scale * q.k (B, H, Nq, Nk), computed in
    their dtype (float64 here; the accuracy baseline passes float32): the scores in the module's
    order, -inf where hidden; the softcap's tanh(scaled / softcap) (None without softcap); the
    ``key_mask``."""
    seqlen_q, seqlen_k = scaled.shape[2], scaled.shape[3]
    dtype = scaled.dtype.type
    scores, tanh = scaled, None
    if softcap > 0:
        tanh = np.tanh(scaled / dtype(softcap))
        scores = dtype(softcap) * tanh
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seqlen_q, seqlen_k).astype(dtype)
    keys = key_mask(seqlen_q, seqlen_k, causal, window_size, attn_mask)
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        with np.errstate(invalid="ignore"):
            scores = scores + np.asarray(attn_mask).astype(dtype)
    return np.where(keys, scores, dtype(-np.inf)), tanh, keys


def softmax(scores, keys, sinks=None):
    """Probabilities P (B, H, Nq, Nk) and lse (B, H, Nq) in the dtype of ``scores``, with each
    head's sink (a logit of no value) in the denominator.

    Non-finite scores (docs/semantics.md, "Non-finite values"): -inf (hidden keys, whose scores
    ``modify_scores`` sets to -inf, or an overflow) weighs 0, and a row whose scores and sink are
    all -inf gets P 0 and lse -inf, whatever its inputs hold; a NaN score makes its row's P and lse
    NaN; a +inf score makes lse +inf and P NaN at that key (0 elsewhere), so out is NaN.
    """
    dtype = scores.dtype.type
    sink = None if sinks is None else np.asarray(sinks).astype(dtype)[None, :, None, None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        row_max = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            row_max = np.maximum(row_max, sink)
        # 0 for an infinite max: -inf keeps every weight 0, +inf makes the total +inf (lse +inf).
        shift = np.where(np.isinf(row_max), dtype(0), row_max)
        weights = np.exp(scores - shift)
        total = weights.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - shift)
        empty = total == 0
        total = np.where(empty, dtype(1), total)
        lse = np.where(empty, dtype(-np.inf), shift + np.log(total))
        return weights / total, lse[..., 0]


def forward(q, k, v, *, causal: bool = False, softmax_scale=None, attn_mask=None, window_size=NO_WINDOW,
            softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_mask=None):
    """Attention forward in float64.

    Args:
        q: (B, H, Nq, D); k: (B, H_kv, Nk, D); v: (B, H_kv, Nk, Dv); any real dtype, computed in
            float64.
        causal: bottom-right aligned mask (window right = 0).
        softmax_scale: None means 1/sqrt(D).
        attn_mask: None, boolean (True = may attend) or additive (any real dtype; -inf hides a key),
            broadcastable to (B, H, Nq, Nk).
        window_size: (left, right), -1 = unbounded.
        softcap: > 0 caps the scaled scores at softcap * tanh(x / softcap); 0 is off.
        alibi_slopes: None, (H,) or (B, H).
        sinks: None or (H,) logits.
        dropout_mask: None, or the dropout multipliers Z broadcastable to (B, H, Nq, Nk) (module
            docstring).

    Returns:
        (out, lse): float64 (B, H, Nq, Dv) and (B, H, Nq); lse is the natural log of the softmax
        denominator (sinks included); rows left without keys get out 0 and lse -inf (sinks[h] with
        sinks); a NaN score makes its row's out and lse NaN, a +inf score out NaN and lse +inf
        (``softmax``).
    """
    _check_shapes(q, k, v)
    scale = default_scale(q.shape[3], softmax_scale)
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask)
    scores, _, keys = modify_scores(scale * (q64 @ np.swapaxes(expand_kv(k64, q.shape[1]), -1, -2)), **options)
    probabilities, lse = softmax(scores, keys, sinks)
    return masked_matmul(dropped(probabilities, dropout_mask), keys, expand_kv(v64, q.shape[1])), lse


def dropped(probabilities, dropout_mask):
    """P * Z in P's dtype (P itself without a mask)."""
    if dropout_mask is None:
        return probabilities
    return probabilities * np.asarray(dropout_mask).astype(probabilities.dtype)


def backward(dout, q, k, v, *, causal: bool = False, softmax_scale=None, attn_mask=None, window_size=NO_WINDOW,
             softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_mask=None):
    """Attention backward in float64 (gradients of sum(dout * out) with respect to q, k, v and the
    sinks).

    Recomputes out in float64 from q, k, v (the exact value the library's out approximates) and
    uses D = rowsum(dout * out), as FlashAttention-2 Algorithm 2; dS goes through the softcap as
    dS * (1 - tanh^2). No gradient flows to attn_mask or alibi_slopes.

    Args:
        dout: like out, (B, H, Nq, Dv); the rest as for ``forward``.

    Returns:
        (dq, dk, dv), float64, shaped like q, k, v, and dsinks (H,) after them when sinks are given;
        dk and dv sum over each GQA group; rows the mask leaves without keys contribute zero (even
        when the inputs hold NaN); NaN or +inf scores of a row make its gradients NaN.
    """
    return _backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, attn_mask=attn_mask,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                     dropout_mask=dropout_mask)[0]


def _backward(dout, q, k, v, *, causal: bool = False, softmax_scale=None, attn_mask=None, window_size=NO_WINDOW,
              softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_mask=None):
    """(``backward``'s result, out, lse): out and lse are the ``forward`` it recomputes on the way,
    bit for bit what ``forward`` returns (``accuracy`` reuses them)."""
    _check_shapes(q, k, v)
    if np.shape(dout) != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout shape {np.shape(dout)} must be (B, H, Nq, Dv) = {q.shape[:3] + v.shape[3:]}")
    scale = default_scale(q.shape[3], softmax_scale)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    dout64, q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    k_full, v_full = expand_kv(k64, num_heads), expand_kv(v64, num_heads)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   attn_mask=attn_mask)
    scores, tanh, keys = modify_scores(scale * (q64 @ np.swapaxes(k_full, -1, -2)), **options)
    probabilities, lse = softmax(scores, keys, sinks)
    kept = dropped(probabilities, dropout_mask)
    out = masked_matmul(kept, keys, v_full)
    dprobabilities = dropped(dout64 @ np.swapaxes(v_full, -1, -2), dropout_mask)
    # Hidden entries are exactly zero even where dP (or tanh) holds a NaN from a key the row never sees.
    with np.errstate(invalid="ignore"):
        delta = np.sum(dout64 * out, axis=-1, keepdims=True)
        dscores = probabilities * (dprobabilities - delta)
        if tanh is not None:
            dscores = dscores * (1.0 - tanh * tanh)
        dscores = np.where(keys, dscores, 0.0)
    keys_t = np.swapaxes(keys, -1, -2)
    dq = scale * masked_matmul(dscores, keys, k_full)
    dk = scale * masked_matmul(np.swapaxes(dscores, -1, -2), keys_t, q64)
    dv = masked_matmul(np.swapaxes(kept, -1, -2), keys_t, dout64)
    grads = (dq, reduce_kv(dk, num_kv_heads), reduce_kv(dv, num_kv_heads))
    if sinks is not None:
        grads = (*grads, -sink_terms(dout64, out, lse, sinks).sum(axis=(0, 2)))
    return grads, out, lse


def sink_terms(dout, out, lse, sinks) -> np.ndarray:
    """The rows' parts of dsinks, exp(sinks[h] - lse) * D with D = rowsum(dout * out), (B, H, Nq) in
    the dtype of ``out`` (dsinks[h] = -their sum over b and i): a sink's dS = P (dP - D) with dP = 0,
    as it has no value."""
    dtype = out.dtype.type
    sink = np.asarray(sinks).astype(dtype)[None, :, None]
    with np.errstate(invalid="ignore"):
        delta = np.sum(dout.astype(dtype) * out, axis=-1)
    return np.exp(sink - lse.astype(dtype)) * delta


def merge_attention(out_a, lse_a, out_b, lse_b):
    """The merge of two attention results over disjoint key sets, in float64 (what
    ``flash_attention_metal.merge_attention`` computes).

    Args:
        out_a, out_b: (..., D); lse_a, lse_b: (...); any real dtype, computed in float64.

    Returns:
        (out, lse): float64; per row lse = log(exp(lse_a) + exp(lse_b)) and
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b. A part with lse -inf contributes
        nothing (its out is not read, even if NaN); rows with both -inf get out 0 and lse -inf; a
        NaN lse makes out and lse NaN, a +inf lse out NaN and lse +inf.
    """
    lse_a, lse_b = np.asarray(lse_a, dtype=np.float64), np.asarray(lse_b, dtype=np.float64)
    out_a, out_b = np.asarray(out_a, dtype=np.float64), np.asarray(out_b, dtype=np.float64)
    empty_a, empty_b = np.isneginf(lse_a), np.isneginf(lse_b)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.where(empty_a, lse_b, np.where(empty_b, lse_a, np.logaddexp(lse_a, lse_b)))
        weight_a = np.where(empty_a, 0.0, np.exp(np.where(empty_a, 0.0, lse_a) - lse))
        weight_b = np.where(empty_b, 0.0, np.exp(np.where(empty_b, 0.0, lse_b) - lse))
        out = (np.where(weight_a[..., None] != 0, weight_a[..., None] * out_a, 0.0)
               + np.where(weight_b[..., None] != 0, weight_b[..., None] * out_b, 0.0))
    return out, lse


def _cache_rows(cache, positions, group_size: int, bits) -> np.ndarray:
    # The rows (n, H_kv, D) of a (slots, rows, H_kv, last) cache at (slot, row) positions, in
    # float64: dequantized exactly for an mx.quantize triple.
    slots, rows = positions
    if bits is None:
        return np.asarray(cache[slots, rows], dtype=np.float64)
    packed, scales, biases = (a[slots, rows] for a in cache)
    return quantized.dequantize(packed, scales, biases, group_size, bits)


def kvcache_sequences(k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, cache_batch_idx=None,
                      group_size: int = 64, bits=None) -> list:
    """The keys and values each batch element of ``flash_attn_with_kvcache`` attends to, without
    touching the caches: per batch element b, (keys, values) float64 (1, H_kv, cache_seqlens[b] +
    N_new, D) and (..., Dv), the cache's first cache_seqlens[b] rows followed by k[b], v[b]
    (quantized by MLX's rule and dequantized where the cache is quantized, since that is what the
    cache then holds), dequantized exactly (scale * q + bias in float64).

    Arrays in FlashAttention's order: caches contiguous (B_cache, S, H_kv, D) or, with block_table
    (B, max_blocks), paged (num_blocks, page_block_size, H_kv, D), row t of sequence b at block
    block_table[b, t // page_block_size], row t % page_block_size; contiguous sequence b at slot
    cache_batch_idx[b] (default b). A quantized cache is the triple (packed, scales, biases) of
    ``quantized.quantize`` with ``bits`` and ``group_size``. k, v (B, N_new, H_kv, D) or None.
    """
    batch = len(np.atleast_1d(cache_seqlens)) if np.ndim(cache_seqlens) else (
        len(block_table) if block_table is not None else len(cache_batch_idx) if cache_batch_idx is not None
        else (k_cache[0] if bits is not None else k_cache).shape[0])
    if k is not None:
        batch = len(k)
    seqlens = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,))
    pages = (k_cache[0] if bits is not None else k_cache).shape[1]
    sequences = []
    for b in range(batch):
        t = np.arange(int(seqlens[b]))
        if block_table is None:
            slot = b if cache_batch_idx is None else int(cache_batch_idx[b])
            positions = (np.full(t.shape, slot), t)
        else:
            positions = (np.asarray(block_table)[b, t // pages], t % pages)
        pair = []
        for cache, new in ((k_cache, k), (v_cache, v)):
            rows = _cache_rows(cache, positions, group_size, bits)
            if new is not None:
                added = np.asarray(new[b])
                if bits is not None:
                    added = quantized.dequantize(*quantized.quantize(added, group_size, bits), group_size, bits)
                rows = np.concatenate([rows, np.asarray(added, dtype=np.float64)])
            pair.append(rows.transpose(1, 0, 2)[None])
        sequences.append(tuple(pair))
    return sequences


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, cache_batch_idx=None,
                    group_size: int = 64, bits=None, causal: bool = False, softmax_scale=None, window_size=NO_WINDOW,
                    softcap: float = 0.0, alibi_slopes=None, sinks=None):
    """``flash_attn_with_kvcache`` in float64 (``kvcache_sequences``, then ``forward`` per batch
    element); q (B, Nq, H, D) in FlashAttention's order. Returns (out, lse): float64 (B, H, Nq, Dv)
    and (B, H, Nq), as ``forward`` (bhsd order)."""
    q64 = np.asarray(q, dtype=np.float64).transpose(0, 2, 1, 3)
    sequences = kvcache_sequences(k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                                  cache_batch_idx=cache_batch_idx, group_size=group_size, bits=bits)
    outs, lses = [], []
    for b, (keys, values) in enumerate(sequences):
        slopes = alibi_slopes if alibi_slopes is None or np.ndim(alibi_slopes) == 1 else np.asarray(alibi_slopes)[b:b + 1]
        out, lse = forward(q64[b:b + 1], keys, values, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=slopes)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(b, query rows slice, key slice) of each sequence of a variable-length batch."""
    cu_q, cu_k = (np.asarray(c, dtype=np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    return [(b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(len(cu_q) - 1)]


def sequence_view(x, rows: slice) -> np.ndarray:
    """Rows ``rows`` of a packed (total, heads, dim) tensor as a one-entry (1, heads, len, dim) batch."""
    return np.swapaxes(np.asarray(x)[rows], 0, 1)[None]


def _sequence_alibi(alibi_slopes, b: int):
    if alibi_slopes is None or np.ndim(alibi_slopes) == 1:
        return alibi_slopes
    return np.asarray(alibi_slopes)[b]


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False, softmax_scale=None,
                   window_size=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_masks=None):
    """``forward`` of a variable-length batch (FlashAttention's varlen semantics), sequence by
    sequence: q (total_q, H, D), k (total_k, H_kv, D), v (total_k, H_kv, Dv); sequence b is query
    rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) over keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]),
    causal and window bottom-right per sequence; alibi_slopes (H,) or (batch, H); dropout_masks
    None or one ``dropout_mask`` (1, H, rows, keys) per sequence.

    Returns:
        (out, lse): float64 (total_q, H, Dv) and (H, total_q); a sequence without keys gives its
        rows out 0 and lse -inf (sinks[h] with sinks).
    """
    scale = default_scale(np.shape(q)[2], softmax_scale)
    out = np.zeros(np.shape(q)[:2] + np.shape(v)[2:], dtype=np.float64)
    lse = np.full((np.shape(q)[1], np.shape(q)[0]), -np.inf)
    for b, rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            if sinks is not None:
                lse[:, rows] = np.asarray(sinks, dtype=np.float64)[:, None]
            continue
        o, l = forward(sequence_view(q, rows), sequence_view(k, keys), sequence_view(v, keys), causal=causal,
                       softmax_scale=scale, window_size=window_size, softcap=softcap,
                       alibi_slopes=_sequence_alibi(alibi_slopes, b), sinks=sinks,
                       dropout_mask=None if dropout_masks is None else dropout_masks[b])
        out[rows] = np.swapaxes(o[0], 0, 1)
        lse[:, rows] = l[0]
    return out, lse


def backward_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False, softmax_scale=None,
                    window_size=NO_WINDOW, softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_masks=None):
    """``backward`` of a variable-length batch, sequence by sequence (see ``forward_varlen``):
    returns float64 (dq, dk, dv) shaped like q, k, v, and dsinks (H,) summed over the sequences
    after them when sinks are given. Rows of a sequence without keys (or queries) get zero
    gradients."""
    scale = default_scale(np.shape(q)[2], softmax_scale)
    grads = [np.zeros(np.shape(x), dtype=np.float64) for x in (q, k, v)]
    if sinks is not None:
        grads.append(np.zeros(np.shape(sinks), dtype=np.float64))
    for b, rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        result = backward(sequence_view(dout, rows), sequence_view(q, rows), sequence_view(k, keys),
                          sequence_view(v, keys), causal=causal, softmax_scale=scale, window_size=window_size,
                          softcap=softcap, alibi_slopes=_sequence_alibi(alibi_slopes, b), sinks=sinks,
                          dropout_mask=None if dropout_masks is None else dropout_masks[b])
        for grad, part, span in zip(grads, result, (rows, keys, keys)):
            grad[span] = np.swapaxes(part[0], 0, 1)
        if sinks is not None:
            grads[3] += result[3]
    return tuple(grads)
