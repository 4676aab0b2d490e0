"""MLX's affine quantization (``mx.quantize`` / ``mx.dequantize``, mode "affine") in NumPy: the
format of quantized KV caches (mlx-lm's ``QuantizedKVCache``), so that the library, its tests and
its reference need not import MLX.

Layout (facts from ml-explore/mlx ``mlx/ops.cpp``, ``affine_quantize`` and ``pack_and_quantize``):
a float array w (..., D) is cut into groups of ``group_size`` (32, 64 or 128) consecutive elements
along its last axis. Each group has a scale and a bias in w's dtype, and each element an unsigned
integer q of ``bits`` bits (4 or 8 here) with w ~ scale * q + bias. The integers are packed little
end first into uint32 words, 32 / bits per word: element j of a row is bits
[bits * (j % (32 / bits)), + bits) of word j // (32 / bits). So ``packed`` is uint32
(..., D * bits / 32) and ``scales``, ``biases`` are (..., D / group_size).

The rule per group (in float32): w_max, w_min over the group; scale = max((w_max - w_min) /
(2^bits - 1), 1e-7), negated unless |w_min| > |w_max|; edge = w_min if |w_min| > |w_max| else
w_max; q0 = round(edge / scale); where q0 != 0, scale = edge / q0 and bias = edge, else bias = 0;
q = clip(round((w - bias) / scale), 0, 2^bits - 1) (round half to even); scale and bias are then
rounded to w's dtype.
"""

from __future__ import annotations

import numpy as np

#: The bit widths the kernels read (MLX also has 2, 3, 5 and 6).
BITS = (4, 8)
#: The group sizes MLX's affine mode allows.
GROUP_SIZES = (32, 64, 128)

_F32 = np.float32


def check_format(group_size, bits) -> None:
    """``bits`` must be 4 or 8 and ``group_size`` 32, 64 or 128 (ValueError naming them)."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 4 or 8 (mx.quantize's affine mode), got {bits!r}")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be 32, 64 or 128 (mx.quantize's affine mode), got {group_size!r}")


def quantize(w, group_size: int = 64, bits: int = 8):
    """``mx.quantize(w, group_size, bits)`` (affine) in NumPy: returns (packed uint32, scales,
    biases) as laid out in the module docstring; scales and biases in w's dtype. w: float16,
    bfloat16, float32 or float64 (..., D) with D a multiple of group_size.

    Raises ValueError for another bits or group_size, or a last axis that is not a multiple of
    group_size.
    """
    check_format(group_size, bits)
    w = np.asarray(w)
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise ValueError(f"the last axis of w ({w.shape}) must be a multiple of group_size {group_size}")
    groups = w.reshape(w.shape[:-1] + (w.shape[-1] // group_size, group_size))
    levels = _F32((1 << bits) - 1)
    w_max = groups.max(axis=-1, keepdims=True).astype(_F32)
    w_min = groups.min(axis=-1, keepdims=True).astype(_F32)
    low_edge = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum((w_max - w_min) / levels, _F32(1e-7))
    scales = np.where(low_edge, scales, -scales)
    edge = np.where(low_edge, w_min, w_max)
    q0 = np.round(edge / scales)
    scales = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scales).astype(_F32)
    biases = np.where(q0 == 0, _F32(0), edge).astype(_F32)
    q = np.clip(np.round((groups.astype(_F32) - biases) / scales), 0, levels).astype(np.uint32)
    per_word = 32 // bits
    q = q.reshape(w.shape[:-1] + (w.shape[-1] // per_word, per_word))
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    packed = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return packed, scales[..., 0].astype(w.dtype), biases[..., 0].astype(w.dtype)


def unpack(packed, bits: int) -> np.ndarray:
    """The integers q (uint32, (..., words * 32 / bits)) of packed words."""
    packed = np.asarray(packed, dtype=np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(packed.shape[:-1] + (packed.shape[-1] * (32 // bits),))


def dequantize(packed, scales, biases, group_size: int = 64, bits: int = 8) -> np.ndarray:
    """scale * q + bias in float64 (exact: the reference's view of a quantized cache), shape
    (..., D) with D = packed.shape[-1] * 32 / bits."""
    check_format(group_size, bits)
    q = unpack(packed, bits).astype(np.float64)
    groups = q.reshape(q.shape[:-1] + (q.shape[-1] // group_size, group_size))
    s = np.asarray(scales, dtype=np.float64)[..., None]
    b = np.asarray(biases, dtype=np.float64)[..., None]
    return (s * groups + b).reshape(q.shape)
