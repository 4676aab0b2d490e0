"""The running forward result of a rank's query rows, merged block by block in float32.

Merging attention over disjoint key sets (Milakov & Gimelshein 2018; FlashAttention's split-KV
combine): with lse_x = log sum_j exp(s_j) over each set, lse = log(exp(lse_a) + exp(lse_b)) and
out = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b); a part with lse -inf contributes nothing.

The running result stays float32 and is rounded once at the end: a float16 running result would be
rounded at every one of the 2P-1 (causal) or P-1 merges of a row (docs/distributed.md, "Accuracy",
has the measurement).
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


class RunningAttention:
    """out (batch, num_heads, rows, head_dim) and lse (batch, num_heads, rows), float32; rows that
    no merged part has reached hold out 0 and lse -inf."""

    def __init__(self, batch: int, num_heads: int, rows: int, head_dim: int) -> None:
        self.out = np.zeros((batch, num_heads, rows, head_dim), dtype=_F32)
        self.lse = np.full((batch, num_heads, rows), -np.inf, dtype=_F32)

    def merge(self, rows: slice, out: np.ndarray, lse: np.ndarray) -> None:
        """Merges attention over further keys (out float16 or float32, lse float32) into ``rows``."""
        lse_a = self.lse[:, :, rows]
        top = np.maximum(lse_a, lse)
        shift = np.where(top == -np.inf, _F32(0), top)  # both parts empty: weights 0, lse stays -inf
        weight_a, weight_b = np.exp(lse_a - shift), np.exp(lse - shift)
        total = weight_a + weight_b
        with np.errstate(divide="ignore"):
            self.lse[:, :, rows] = shift + np.log(total)
        nonzero = total != 0  # NaN compares unequal: NaN inputs propagate
        share_a = np.divide(weight_a, total, out=np.zeros_like(total), where=nonzero)[..., None]
        share_b = np.divide(weight_b, total, out=np.zeros_like(total), where=nonzero)[..., None]
        self.out[:, :, rows] = share_a * self.out[:, :, rows] + share_b * out.astype(_F32)
