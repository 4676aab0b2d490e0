"""Attention dropout's mask, bit for bit as the kernels draw it: Philox-4x32-10 (Salmon et al., SC
2011; Random123's constants) in NumPy, and the mapping of (batch, head, query row, key) to its
counter that Shaders/flash_attention_philox.h defines (that header's comment is the specification;
this module is its twin, checked against Random123's known answers in tests/python/test_dropout.py).

A kept probability is multiplied by ``dropout_scale(p)`` = 1 / (1 - p) in float32; an element is
dropped iff its 32-bit word is below ``dropout_threshold(p)``.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_ROUNDS = 10


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox-4x32-10: ``counter`` uint32 (..., 4), ``key`` uint32 (..., 2) (broadcast together);
    returns uint32 (..., 4)."""
    c = [np.asarray(counter, dtype=np.uint64)[..., i] for i in range(4)]
    key = np.asarray(key, dtype=np.uint64)
    k0, k1 = key[..., 0], key[..., 1]
    for r in range(_ROUNDS):
        if r:
            k0 = (k0 + np.uint64(_W0)) & _MASK32
            k1 = (k1 + np.uint64(_W1)) & _MASK32
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK32]
    return np.stack(np.broadcast_arrays(*c), axis=-1).astype(np.uint32)


def dropout_threshold(p: float) -> int:
    """The 32-bit threshold of dropout probability ``p`` (rounded to float32 first, as the ABI
    carries it): min(round(p * 2^32), 2^32 - 1)."""
    return min(int(np.rint(float(np.float32(p)) * 2.0**32)), 2**32 - 1)


def dropout_scale(p: float) -> np.float32:
    """What a kept probability is multiplied by: 1 / (1 - p) in float64, rounded to float32 (p
    rounded to float32 first)."""
    return np.float32(1.0 / (1.0 - float(np.float32(p))))


def dropout_words(seed: int, offset: int, stream, row, key) -> np.ndarray:
    """The uint32 word of each (stream, row, key) (broadcast together; stream = batch * num_heads
    + head): word key % 4 of Philox-4x32-10 at counter ((offset + key // 4) mod 2^64, row, stream)
    under key (seed mod 2^32, seed >> 32)."""
    stream, row, key = np.broadcast_arrays(*(np.asarray(a, dtype=np.uint64) for a in (stream, row, key)))
    position = (np.uint64(offset % 2**64) + key // np.uint64(4))  # wraps mod 2^64 like the kernels
    counter = np.stack([position & _MASK32, position >> np.uint64(32), row & _MASK32, stream & _MASK32], axis=-1)
    seed = int(seed) % 2**64
    words = philox4x32_10(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64))
    return np.take_along_axis(words, (key % np.uint64(4)).astype(np.intp)[..., None], axis=-1)[..., 0]


def dropout_keep(p: float, seed: int, offset: int, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                 batch_index=None) -> np.ndarray:
    """The keep mask, bool (batch, num_heads, seqlen_q, seqlen_k), of a dense call: True where the
    probability is kept. ``batch_index`` (optional) replaces range(batch) as the batch indices
    that enter the counter (a varlen sequence's index)."""
    b = np.arange(batch) if batch_index is None else np.asarray(batch_index)
    stream = (b[:, None] * num_heads + np.arange(num_heads)[None, :]) % 2**32
    words = dropout_words(seed, offset, stream[:, :, None, None], np.arange(seqlen_q)[None, None, :, None],
                          np.arange(seqlen_k)[None, None, None, :])
    return words >= np.uint32(dropout_threshold(p))


def dropout_multiplier(p: float, keep) -> np.ndarray:
    """The reference's dropout mask (``reference.forward``'s ``dropout_mask``): float64, 0 where
    ``keep`` is False and 1 / (1 - p) where it is True (p rounded to float32, as the ABI carries it)."""
    return np.where(keep, 1.0 / (1.0 - float(np.float32(p))), 0.0)
