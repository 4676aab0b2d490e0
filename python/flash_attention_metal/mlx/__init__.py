"""The library's attention as a drop-in for MLX's ``mx.fast.scaled_dot_product_attention``, with a
fused backward: ``flash_attention_metal.mlx.scaled_dot_product_attention``.

MLX's fast attention has no fused backward: under ``mx.grad`` it falls back to unfused operations
that keep the (seqlen_q x seqlen_k) score matrix of every head. Here the forward (FlashAttention-2,
Algorithm 1) and the backward (Algorithm 2, from the ``out`` and ``lse`` the forward saved) are
MLX primitives, so training holds O(seqlen) memory per head instead of O(seqlen^2).

Two paths (``NATIVE`` says which one this process has, ``PATH_NOTE`` why; ``tensor_ops()`` which
kernels the last pass on MLX's GPU stream took, the Metal 4 tensor-op ones or not, and why):
- native (the MLX extension ``flash_attention_metal._mlx_ext``, built from mlx_extension/ by ./build.sh when MLX is
  installed): graph nodes ``FlashAttentionForward``/``FlashAttentionBackward`` evaluated on MLX's
  stream (on the CPU stream through the library's CPU engine). ``mx.grad``, ``mx.value_and_grad``,
  ``mx.vjp``, ``mx.compile`` (also of a training step), ``mx.vmap`` over any axis, array masks
  (boolean: True = may attend; additive) and sinks; output shapes are known without evaluation.
- pure-Python fallback (``mlx._fallback``: an ``mx.custom_function`` on NumPy views of evaluated
  arrays; used when the extension is absent or a ``context`` is passed): ``mx.grad`` and the like
  only; ``mx.compile``/``mx.vmap``, array masks and sinks raise NotImplementedError.
Neither path has ``mx.jvp`` or second derivatives (they raise instead of giving zeros), nor a
gradient with respect to an array mask (stop it with ``mx.stop_gradient``).

Semantics are MLX's where the two agree: q (B, num_heads, seqlen_q, head_dim), k (B, num_kv_heads,
seqlen_k, head_dim), v (B, num_kv_heads, seqlen_k, head_dim_v); GQA/MQA from the head counts (k and
v not repeated); ``mask="causal"`` aligned bottom-right (the last query sees the last key); the
softmax in float32; float16, bfloat16 and float32. One difference: a query row that sees no key
(``mask="causal"`` with seqlen_q > seqlen_k, or a boolean mask row of False) gets 0 here and a zero
gradient (FlashAttention's convention), while MLX returns the mean of v (or NaN) for it. The other
deliberate differences are in one table in docs/integrations.md; among them, Ctrl-C during an
``mx.eval`` of a native-path node is honoured only when the evaluation returns (pass ``context=``
for calls that Ctrl-C cancels at once).

Copies: the fallback copies no row-contiguous input (``mlx._arrays``); the native path makes
inputs row-contiguous in the graph (MLX's ``contiguous``: free when they already are) and reads a
mask's size-1 axes as broadcasts. MLX itself needs Python 3.10 or later.
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

from .. import _validation
from .._default import default_context
from ..context import Context
from . import _fallback
from ._arrays import DTYPES

try:
    from .. import _mlx_ext
except ImportError as _error:  # not built (./build.sh builds it where MLX is installed)
    _mlx_ext = None
    PATH_NOTE = (f"pure-Python fallback (no mx.compile/mx.vmap, array masks or sinks): the MLX extension "
                 f"flash_attention_metal._mlx_ext did not load ({_error}); ./build.sh builds it")
else:
    PATH_NOTE = "native: the MLX extension flash_attention_metal._mlx_ext (MLX primitives)"
NATIVE = _mlx_ext is not None


def tensor_ops() -> str:
    """The tensor-op route of the last pass on MLX's GPU stream and why (docs/tensor-ops.md):
    "tensor ops: ..." or "simdgroup kernels: ...", with the compiler's message where the tensor-op
    library failed to compile; "" before the first such pass, without the extension, or with an
    MLX without Metal."""
    return _mlx_ext.tensor_ops() if _mlx_ext is not None else ""


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, force_fused=False, stream=None,
                                 context: Context | None = None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """Attention ``softmax(scale * q @ k^T) @ v`` with the library's fused forward and backward.

    Args:
        q: mx.array (batch, num_heads, seqlen_q, head_dim); float16, bfloat16 or float32.
        k: mx.array (batch, num_kv_heads, seqlen_k, head_dim), q's dtype; num_heads % num_kv_heads
            == 0 (GQA/MQA: do not repeat k and v).
        v: mx.array (batch, num_kv_heads, seqlen_k, head_dim_v), q's dtype.
        scale: the softmax scale, a finite real number (required, as in MLX; usually
            ``q.shape[-1] ** -0.5``).
        mask: None (every query sees every key), ``"causal"`` (query i sees key j iff
            j <= i + seqlen_k - seqlen_q: bottom-right, as MLX), or (native path) an mx.array
            broadcastable to (batch, num_heads, seqlen_q, seqlen_k): bool (True = may attend) or
            float16/bfloat16/float32 added to the scaled scores (applied in float32).
        sinks: None, or (native path) an mx.array (num_heads,) of float logits: one virtual key
            per head that takes part in the softmax and contributes no value (MLX's sinks).
        force_fused: accepted for MLX's signature; the computation is always fused.
        stream: the MLX stream or device of the native path's nodes (None: MLX's default); not
            used by the fallback, which runs on ``context``'s backend.
        context: None: the native path when the extension is built, else the fallback on the
            default context (``$FLASH_ATTENTION_METAL_BACKEND``); a ``flash_attention_metal.Context``:
            the fallback on that context.
        dropout_p: attention dropout in [0, 1) (an extension beyond MLX's signature, FlashAttention's
            semantics: each probability dropped after the softmax, the kept ones scaled by
            1 / (1 - dropout_p)); 0.0 is off. The gradient regenerates the same mask.
        dropout_seed, dropout_offset: ints in [0, 2**64), the mask's Philox key and counter base
            (``flash_attention_metal.philox.dropout_keep`` gives the mask); the seed is required with
            dropout_p > 0 (MLX has no global generator state to draw it from: pass e.g. a fresh
            seed per step).

    Returns:
        mx.array (batch, num_heads, seqlen_q, head_dim_v) in q's dtype: each row rounded once from
        float32 accumulation. Rows that see no key are 0 (MLX: the mean of v).

    Raises:
        TypeError: q, k or v not an mx.array, or not all of one dtype of float16, bfloat16 and
            float32; scale missing or not a real number; mask neither None, a str nor an mx.array,
            or an array mask or sinks of another dtype.
        ValueError: dropout_p outside [0, 1), dropout_seed missing with dropout_p > 0; shapes (named
            by argument, from the library's checks), head_dim or head_dim_v above the library's
            maximum, a non-finite scale, a mask string other than "causal", sinks whose dtype would
            promote q's (MLX's rule); on the CPU stream, when evaluated, an additive mask holding NaN
            or +inf and sinks that are not finite; on
            the native path also a gradient asked of the mask, mx.jvp, second derivatives, mx.vmap
            over the sinks.
        NotImplementedError: on the fallback: an array mask, sinks, mx.compile/mx.vmap, mx.jvp,
            second derivatives.
        FlashAttentionError: the library reported an error (fallback).
    """
    causal = _check_mask(mask)
    _check_arrays(q, k, v)
    drop = _validation.check_dropout(dropout_p, dropout_seed, dropout_offset) or (0.0, 0, 0)
    if scale is None:
        raise TypeError("scale is required (as in MLX), e.g. scale=q.shape[-1] ** -0.5")
    scale = _validation.resolve_softmax_scale(scale, q.shape[-1], "scale")
    array_mask = None if causal or mask is None else mask
    if sinks is not None:
        if not isinstance(sinks, mx.array) or not mx.issubdtype(sinks.dtype, mx.floating):
            raise TypeError(f"sinks must be None or a floating mx.array (num_heads,), got {_describe(sinks)}")
        # MLX's rule: the sinks' type must promote to the output's (float32 sinks with float16 q
        # would make a float32 result), a ValueError as mx.fast's.
        if sinks.dtype != q.dtype and q.dtype != mx.float32:
            raise ValueError(f"sinks of dtype {sinks.dtype} would promote the {q.dtype} call (MLX's rule: the "
                             f"type of sinks must promote to the output type); pass sinks.astype({q.dtype})")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        # Nothing to compute: MLX's own result (an empty array, or zeros without keys).
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    if context is None and NATIVE:
        return _mlx_ext.attention(q, k, v, scale, causal, array_mask, sinks, *drop, stream=stream)
    if array_mask is not None:
        raise NotImplementedError(
            "mask: array masks (boolean or additive) need the MLX extension (" + PATH_NOTE + "); only "
            "mask=None and mask='causal' here. Use mx.fast.scaled_dot_product_attention for array masks"
        )
    if sinks is not None:
        raise NotImplementedError(
            "sinks: attention sinks need the MLX extension (" + PATH_NOTE + "); pass sinks=None or use "
            "mx.fast.scaled_dot_product_attention"
        )
    return _fallback._attention(q, k, v, scale, causal, default_context() if context is None else context,
                                    drop)[0]


def ring_attention(q, k, v, *, scale, causal=False, group=None):
    """Attention over a sequence sharded across the ranks of an ``mx.distributed`` group (context
    parallelism): this rank's rows of out. Differentiable with ``mx.grad``/``mx.vjp`` (the ring
    backward); not inside ``mx.compile`` (each step evaluates what it sends). Needs the extension.

    Args:
        q: mx.array (batch, num_heads, local seqlen_q, head_dim): this rank's shard, as
            ``shard_sequence(q_global, causal=causal, group=group)`` gives it.
        k, v: mx.array (batch, num_kv_heads, local seqlen_k, head_dim / head_dim_v), sharded alike;
            q's dtype (float16, bfloat16 or float32).
        scale: the softmax scale, a finite number; the same on every rank.
        causal: bool; bottom-right over the GLOBAL sequences; selects the zigzag layout.
        group: the mx.distributed group (None: ``mx.distributed.init()``).

    Returns:
        mx.array (batch, num_heads, local seqlen_q, head_dim_v) in q's dtype: this rank's rows of
        the attention of the gathered sequences (merged in float32, rounded once).

    Raises:
        TypeError, ValueError: as scaled_dot_product_attention; shards of unequal length; shapes,
            dtype, scale or causal differing between ranks (every rank raises).
        RuntimeError: the extension is not built (PATH_NOTE says why).
    """
    ring = _ring_module()
    _check_arrays(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is None:
        raise TypeError("scale is required (as in MLX), e.g. scale=q.shape[-1] ** -0.5")
    scale = _validation.resolve_softmax_scale(scale, q.shape[-1], "scale")
    group = mx.distributed.init() if group is None else group
    ring.agree(group, q, k, v, scale, causal)
    return ring.ring_attention(q, k, v, scale, causal, group)[0]


def shard_sequence(x, *, causal=False, group=None):
    """This rank's shard of the global ``x`` (batch, heads, seqlen, dim) for ``ring_attention``:
    contiguous, or zigzag (chunks r and 2P-1-r) when ``causal``; seqlen must be a multiple of P
    (2P when causal) so that every shard has the same length. Raises ValueError otherwise."""
    return _ring_module().shard_sequence(x, causal, mx.distributed.init() if group is None else group)


def unshard_sequence(x_local, *, causal=False, group=None):
    """The global sequence from every rank's shard (an all_gather over ``group``): the inverse of
    ``shard_sequence``, e.g. for ``ring_attention``'s out or the gradients of the shards."""
    return _ring_module().unshard_sequence(x_local, causal, mx.distributed.init() if group is None else group)


def _ring_module():
    if not NATIVE:
        raise RuntimeError(f"ring_attention needs the MLX extension: {PATH_NOTE}")
    from . import _ring
    return _ring


def _describe(value) -> str:
    return f"an array of dtype {value.dtype}" if isinstance(value, mx.array) else type(value).__name__


def _check_mask(mask) -> bool:
    """Whether ``mask`` asks for the causal mask; raises for what is never accepted."""
    if mask is None:
        return False
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
        return True
    if isinstance(mask, mx.array):
        if mask.dtype != mx.bool_ and mask.dtype not in DTYPES:
            raise TypeError(f"mask must be a bool or float16/bfloat16/float32 array, got {mask.dtype}")
        return False
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


__all__ = ["scaled_dot_product_attention", "ring_attention", "shard_sequence", "unshard_sequence", "tensor_ops",
           "NATIVE", "PATH_NOTE"]
