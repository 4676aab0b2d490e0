"""Attention dropout's test outputs: FlashAttention's ``S_dmask`` and the reference's mask of a call.

The kernels draw each element's keep bit from Philox-4x32-10 (``philox``; the mapping of
(seed, offset, batch, head, row, key) to a counter is specified in Shaders/flash_attention_philox.h),
so everything here is computed on the host from the call's inputs and its (dropout_p, seed,
offset), bit for bit the mask the kernels apply.
"""

from __future__ import annotations

import numpy as np

from . import philox, reference


def keep_mask(dropout, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """bool (batch, num_heads, seqlen_q, seqlen_k): True where a dense call with ``dropout``
    (dropout_p, seed, offset) keeps the probability."""
    p, seed, offset = dropout
    return philox.dropout_keep(p, seed, offset, batch, num_heads, seqlen_q, seqlen_k)


def reference_mask(dropout, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The ``dropout_mask`` of ``reference.forward`` for a dense call with ``dropout``."""
    return philox.dropout_multiplier(dropout[0], keep_mask(dropout, batch, num_heads, seqlen_q, seqlen_k))


def s_dmask(q, k, dropout, *, causal=False, softmax_scale=None, window_size=reference.NO_WINDOW, softcap=0.0,
            alibi_slopes=None, attn_mask=None) -> np.ndarray:
    """FlashAttention's S_dmask (its ``return_attn_probs`` output, for testing), float64
    (B, H, Nq, Nk) for q (B, H, Nq, D) and k (B, H_kv, Nk, D): exp(s - m) per element, s the score
    (``reference``'s order: scaled, softcapped, ALiBi, additive mask) and m the row's max over
    its visible keys, negated where ``dropout`` (dropout_p, seed, offset) drops the element, 0
    where the key is hidden (and on rows without visible keys)."""
    scale = reference.default_scale(np.shape(q)[3], softmax_scale)
    q64, k64 = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    scaled = scale * (q64 @ np.swapaxes(reference.expand_kv(k64, q64.shape[1]), -1, -2))
    scores, _, keys = reference.modify_scores(scaled, causal=causal, window_size=window_size, softcap=softcap,
                                              alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    keys = np.broadcast_to(keys, scores.shape)
    with np.errstate(invalid="ignore"):
        row_max = np.where(keys.any(axis=-1, keepdims=True), scores.max(axis=-1, keepdims=True), 0.0)
        weights = np.where(keys, np.exp(scores - row_max), 0.0)
    dropped = keys & ~keep_mask(dropout, *scores.shape)
    return np.where(dropped, -weights, weights)
