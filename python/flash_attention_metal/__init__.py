"""flash_attention_metal: exact, memory-efficient attention (FlashAttention-2) on Apple GPUs, with
a CPU engine that runs the same Metal kernels anywhere. NumPy float16 in, NumPy out.

Shapes: q (batch, num_heads, seqlen_q, head_dim); k, v (batch, num_kv_heads, seqlen_k, head_dim);
out float16 like q; lse float32 (batch, num_heads, seqlen_q). See ``Context`` for the semantics.

The module functions run on a default Context created on first use; ``$FLASH_ATTENTION_METAL_BACKEND``
(auto, metal, cpu) picks its backend.
"""

from __future__ import annotations

from . import _default, _validation, accuracy, reference
from ._default import BACKEND_ENV, default_backend, default_context
from ._native import LIBRARY_ENV
from .context import BACKENDS, Context
from .errors import FlashAttentionError
from .profile import DispatchProfile, Profile

__version__ = "0.1.0"


def forward(q, k, v, *, causal=False, softmax_scale=None):
    """``Context.forward`` on the default context: returns (out float16, lse float32).

    The arguments are checked before the library is loaded, so a wrong dtype or shape is reported
    as such even where the library is missing.
    """
    _validation.check_forward(q, k, v, causal, softmax_scale)
    return default_context().forward(q, k, v, causal=causal, softmax_scale=softmax_scale)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None):
    """``Context.backward`` on the default context: returns (dq, dk, dv), float16 (arguments
    checked before the library is loaded, as for ``forward``)."""
    _validation.check_backward(dout, q, k, v, out, lse, causal, softmax_scale)
    return default_context().backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


def attention(q, k, v, *, causal=False, softmax_scale=None):
    """``Context.attention`` on the default context: returns out, float16 like q (arguments
    checked before the library is loaded, as for ``forward``)."""
    _validation.check_forward(q, k, v, causal, softmax_scale)
    return default_context().attention(q, k, v, causal=causal, softmax_scale=softmax_scale)


def last_profile():
    """``Context.last_profile`` of the default context: the profile of the calling thread's last
    successful module-level ``forward``/``backward``/``attention`` call, or None before one."""
    context = _default.existing_default_context()
    return None if context is None else context.last_profile


__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "LIBRARY_ENV",
    "Context",
    "DispatchProfile",
    "FlashAttentionError",
    "Profile",
    "accuracy",
    "attention",
    "backward",
    "default_backend",
    "default_context",
    "forward",
    "last_profile",
    "reference",
]
