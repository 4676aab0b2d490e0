"""MLX arrays in and out of the library without copies, for ``flash_attention_metal.mlx``.

Inputs: an evaluated MLX array exports its buffer through the Python buffer protocol, and
``numpy.asarray`` wraps it without a copy, keeping MLX's strides and offset (a transpose of the
first three axes or a slice stays a view the library reads in place; a broadcast, with its zero
strides, is copied once by the library's Python layer like any such NumPy array). NumPy has no
bfloat16 buffer format, so a bfloat16 array is viewed as uint16 (``array.view``, which shares the
buffer) and that NumPy view re-typed as ``ml_dtypes.bfloat16``.

Outputs: MLX cannot wrap NumPy memory without a copy on the CPU (``mx.asarray(a, copy=False)``
raises "Cannot import a CPU array without a copy", MLX 0.32), so every output is an array MLX
allocates (``mx.zeros``, evaluated: one fill of the buffer, no copy) and the library writes the
result into its NumPy view; MLX documents that writes through such a view are seen by the array.
The output is new and unseen by any other computation while it is written.

Evaluating is what MLX forbids inside ``mx.compile`` and ``mx.vmap`` (tracing without data):
``evaluate`` turns that error into ``NotImplementedError`` saying so.
"""

from __future__ import annotations

import ml_dtypes
import mlx.core as mx
import numpy as np

#: The MLX dtypes the library computes in, and their NumPy dtypes.
DTYPES = {mx.float16: np.dtype(np.float16), mx.bfloat16: np.dtype(ml_dtypes.bfloat16), mx.float32: np.dtype(np.float32)}

_TRACING = "function transformations"  # in MLX's error for an eval inside compile or vmap


def evaluate(*arrays: mx.array) -> None:
    """``mx.eval(*arrays)``; inside ``mx.compile`` or ``mx.vmap``, where MLX cannot evaluate,
    raises NotImplementedError naming the limitation (MLX's error chained)."""
    try:
        mx.eval(*arrays)
    except ValueError as error:
        if _TRACING not in str(error):
            raise
        raise NotImplementedError(
            "flash_attention_metal.mlx cannot run inside mx.compile or mx.vmap: the library computes on "
            "evaluated arrays and MLX does not evaluate while it traces a function; call the attention "
            "outside the compiled (or vmapped) function, e.g. compile the layers around it"
        ) from error


def numpy_view(array: mx.array) -> np.ndarray:
    """A NumPy view (no copy) of an evaluated MLX array of a ``DTYPES`` dtype; the view keeps the
    MLX array alive."""
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.asarray(array)


def new_output(shape: tuple[int, ...], dtype: mx.Dtype) -> tuple[mx.array, np.ndarray]:
    """A new evaluated, C-contiguous MLX array (zero-filled) and its writable NumPy view."""
    array = mx.zeros(shape, dtype=dtype)
    evaluate(array)
    return array, numpy_view(array)
