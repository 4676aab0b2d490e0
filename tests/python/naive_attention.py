"""Attention written from the definitions, one query row at a time, and central finite
differences: the independent checks of the float64 reference (flash_attention_metal.reference)."""

from __future__ import annotations

import math

import numpy as np


def naive_forward(q, k, v, scale, *, causal=False, attn_mask=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, sinks=None):
    """One row at a time, straight from the definitions (FlashAttention's window and ALiBi,
    PyTorch's masks, gpt-oss's sinks); independent of reference.py."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k, group = k.shape[2], heads // k.shape[1]
    mask = None if attn_mask is None else np.broadcast_to(attn_mask, (batch, heads, seqlen_q, seqlen_k))
    slopes = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (batch, heads))
    left, right = window_size
    if causal:
        right = 0
    out = np.zeros(q.shape[:3] + v.shape[3:])
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        for h in range(heads):
            for i in range(seqlen_q):
                diagonal = i + seqlen_k - seqlen_q
                logits, values = [], []
                for j in range(seqlen_k):
                    if (left >= 0 and j < diagonal - left) or (right >= 0 and j > diagonal + right):
                        continue
                    if mask is not None and mask.dtype == bool and not mask[b, h, i, j]:
                        continue
                    x = scale * float(np.dot(q[b, h, i].astype(float), k[b, h // group, j].astype(float)))
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slopes is not None:
                        x -= float(slopes[b, h]) * abs(diagonal - j)
                    if mask is not None and mask.dtype != bool:
                        x += float(mask[b, h, i, j])
                    if x != -math.inf:
                        logits.append(x)
                        values.append(v[b, h // group, j].astype(float))
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    values.append(np.zeros(v.shape[3]))
                if not logits:
                    continue
                top = max(logits)
                weights = np.exp(np.array(logits) - top)
                lse[b, h, i] = top + math.log(weights.sum())
                out[b, h, i] = (weights / weights.sum()) @ np.array(values)
    return out, lse


def numeric_gradients(loss, tensors, step: float = 1e-6) -> list[np.ndarray]:
    """The central differences (loss(t + step) - loss(t - step)) / (2 step) of the scalar
    ``loss(*tensors)`` at every element of every tensor (float64): one array per tensor."""
    gradients = []
    for index, tensor in enumerate(tensors):
        gradient = np.zeros_like(tensor)
        for position in np.ndindex(*tensor.shape):
            plus = [t.copy() for t in tensors]
            minus = [t.copy() for t in tensors]
            plus[index][position] += step
            minus[index][position] -= step
            gradient[position] = (loss(*plus) - loss(*minus)) / (2 * step)
        gradients.append(gradient)
    return gradients
