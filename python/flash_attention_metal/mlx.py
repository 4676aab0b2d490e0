"""The library's attention as a drop-in for MLX's ``mx.fast.scaled_dot_product_attention``, with a
fused backward: ``flash_attention_metal.mlx.scaled_dot_product_attention``.

MLX's fast attention has no fused backward: under ``mx.grad`` it falls back to unfused operations
that keep the (seqlen_q x seqlen_k) score matrix of every head. This function is an
``mx.custom_function`` whose forward runs the library's forward (FlashAttention-2, Algorithm 1)
and whose vjp runs the library's backward (Algorithm 2) with the ``out`` and ``lse`` the forward
saved, so training holds O(seqlen) memory per head instead of O(seqlen^2).

Which MLX transformations work (tested in tests/python/test_mlx.py):
- ``mx.grad``, ``mx.value_and_grad``, ``mx.vjp``, ``nn.value_and_grad`` (``nn.Module`` training
  with ``mlx.optimizers``): yes.
- ``mx.compile``, ``mx.vmap``: no. The library computes on evaluated arrays (MLX arrays handed to it
  as NumPy views), and MLX does not evaluate while it traces; the call raises NotImplementedError
  saying so. Compile the layers around the attention instead.
- ``mx.jvp`` and second derivatives (grad of grad): not implemented (NotImplementedError); without
  that error they would silently give zeros, as the library's results carry no MLX graph.

Semantics are MLX's where the two agree: q (B, num_heads, seqlen_q, head_dim), k (B, num_kv_heads,
seqlen_k, head_dim), v (B, num_kv_heads, seqlen_k, head_dim_v); GQA/MQA from the head counts (k and
v not repeated); ``mask="causal"`` aligned bottom-right (the last query sees the last key); the
softmax in float32; float16, bfloat16 and float32. One difference: a query row that sees no key
(``mask="causal"`` with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows) gets 0 here and a
zero gradient (FlashAttention's convention), while MLX returns the mean of v for it.

Not supported yet: array masks (boolean or additive) and attention sinks raise NotImplementedError.

Copies: none for inputs that are row-contiguous MLX arrays or views of them whose last axis is
contiguous, none for outputs (MLX allocates them and the library writes into them; see
``_mlx_arrays``). MLX itself needs Python 3.10 or later.
"""

from __future__ import annotations

try:
    import mlx.core as mx
except ImportError as error:  # the message names the extra that installs MLX
    raise ImportError(
        "flash_attention_metal.mlx needs MLX (Python 3.10 or later): install the package's 'mlx' extra, "
        "e.g. pip install -e 'python[mlx]' in the repository, or MLX itself: pip install 'mlx[cpu]' on "
        "Linux, pip install mlx on Apple silicon"
    ) from error

from . import _validation
from ._default import default_context
from ._mlx_arrays import DTYPES, evaluate, new_output, numpy_view
from .context import Context


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, force_fused=False, stream=None,
                                 context: Context | None = None):
    """Attention ``softmax(scale * q @ k^T) @ v`` with the library's fused forward and backward.

    Args:
        q: mx.array (batch, num_heads, seqlen_q, head_dim); float16, bfloat16 or float32.
        k: mx.array (batch, num_kv_heads, seqlen_k, head_dim), q's dtype; num_heads % num_kv_heads
            == 0 (GQA/MQA: do not repeat k and v).
        v: mx.array (batch, num_kv_heads, seqlen_k, head_dim_v), q's dtype.
        scale: the softmax scale, a finite real number (required, as in MLX; usually
            ``q.shape[-1] ** -0.5``).
        mask: None (every query sees every key) or ``"causal"`` (query i sees key j iff
            j <= i + seqlen_k - seqlen_q: bottom-right, as MLX).
        sinks: must be None (attention sinks are not supported yet).
        force_fused: accepted for MLX's signature; the computation is always fused.
        stream: accepted for MLX's signature and not used: the attention runs on ``context``'s
            backend (Metal or the CPU engine), not on an MLX stream.
        context: the ``flash_attention_metal.Context`` to run on; None: the default context
            (``$FLASH_ATTENTION_METAL_BACKEND``).

    Returns:
        mx.array (batch, num_heads, seqlen_q, head_dim_v) in q's dtype: each row rounded once from
        float32 accumulation. Rows that see no key are 0 (MLX: the mean of v).

    Raises:
        TypeError: q, k or v not an mx.array, or not all of one dtype of float16, bfloat16 and
            float32; scale missing or not a real number; mask neither None, a str nor an array.
        ValueError: shapes (named by argument, from the library's checks), head_dim or head_dim_v
            above ``context.max_head_dim``, a non-finite scale, a mask string other than "causal".
        NotImplementedError: an array mask, sinks, or a call inside ``mx.compile``/``mx.vmap``.
        FlashAttentionError: the library reported an error.
    """
    causal = _check_mask(mask)
    if sinks is not None:
        raise NotImplementedError(
            "sinks: attention sinks are not supported by flash_attention_metal yet; pass sinks=None or use "
            "mx.fast.scaled_dot_product_attention"
        )
    _check_arrays(q, k, v)
    if scale is None:
        raise TypeError("scale is required (as in MLX), e.g. scale=q.shape[-1] ** -0.5")
    scale = _validation.resolve_softmax_scale(scale, q.shape[-1], "scale")
    return _attention(q, k, v, scale, causal, default_context() if context is None else context)[0]


def _check_mask(mask) -> bool:
    """Whether ``mask`` asks for the causal mask; raises for what is not supported."""
    if mask is None:
        return False
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array (array masks are not supported yet), got {mask!r}")
        return True
    if isinstance(mask, mx.array):
        raise NotImplementedError(
            "mask: array masks (boolean or additive) are not supported by flash_attention_metal yet; only "
            "mask=None and mask='causal'. Use mx.fast.scaled_dot_product_attention for array masks"
        )
    raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")


def _check_arrays(q, k, v) -> None:
    """q, k, v must be MLX arrays of one dtype the library computes in (no silent casts)."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not isinstance(array, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(array).__name__}")
        if array.dtype not in DTYPES:
            raise TypeError(
                f"{name} must have dtype float16, bfloat16 or float32, got {array.dtype} "
                f"(convert it explicitly, e.g. {name}.astype(mx.float16))"
            )
    for name, array in (("k", k), ("v", v)):
        if array.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {array.dtype} (convert explicitly)")


@mx.custom_function
def _attention(q, k, v, scale, causal, context):
    """(out, lse) of the library's forward, as new MLX arrays the library wrote."""
    evaluate(q, k, v)
    views = [numpy_view(a) for a in (q, k, v)]
    # Checked before the outputs are allocated, which a wrong shape could make huge.
    checked = _validation.check_forward(*views, causal, scale)
    shape = checked[0]
    out, out_view = new_output((shape.batch, shape.num_heads, shape.seqlen_q, shape.head_dim_v), q.dtype)
    lse, lse_view = new_output((shape.batch, shape.num_heads, shape.seqlen_q), mx.float32)
    context._forward(*views, checked, "bhsd", out_view, lse_view)
    return out, lse


@_attention.vjp
def _attention_vjp(primals, cotangents, outputs):
    # lse is internal to scaled_dot_product_attention, so its cotangent is zero and is not used.
    q, k, v, scale, causal, context = primals
    out, lse = outputs
    dq, dk, dv = _attention_backward(cotangents[0], q, k, v, out, lse, scale, causal, context)
    return dq, dk, dv, None, None, None


@_attention.jvp
def _attention_jvp(primals, tangents):
    raise NotImplementedError(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no jvp (forward-mode differentiation); "
        "use mx.vjp/mx.grad, or mx.fast.scaled_dot_product_attention"
    )


@mx.custom_function
def _attention_backward(dout, q, k, v, out, lse, scale, causal, context):
    """(dq, dk, dv) of the library's backward, as new MLX arrays the library wrote."""
    evaluate(dout, q, k, v, out, lse)
    views = [numpy_view(a) for a in (dout, q, k, v, out, lse)]
    grads = [new_output(a.shape, q.dtype) for a in (q, k, v)]
    context.backward(*views, causal=causal, softmax_scale=scale,
                     dq=grads[0][1], dk=grads[1][1], dv=grads[2][1])
    return tuple(array for array, _ in grads)


@_attention_backward.vjp
def _attention_backward_vjp(primals, cotangents, outputs):
    raise NotImplementedError(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no second derivatives (grad of grad); "
        "use mx.fast.scaled_dot_product_attention for those"
    )


@_attention_backward.jvp
def _attention_backward_jvp(primals, tangents):
    raise NotImplementedError(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no second derivatives (jvp of its vjp)"
    )


__all__ = ["scaled_dot_product_attention"]
