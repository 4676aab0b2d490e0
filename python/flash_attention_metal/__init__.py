"""flash_attention_metal: exact, memory-efficient attention (FlashAttention-2) on Apple GPUs, with
a CPU engine that runs the same Metal kernels anywhere. NumPy in, NumPy out.

dtypes: numpy.float16, ml_dtypes.bfloat16 or numpy.float32 (one per call; lse is float32).
Layouts: ``layout="bhsd"`` (default; PyTorch, MLX): q (batch, num_heads, seqlen_q, head_dim), k
(batch, num_kv_heads, seqlen_k, head_dim), v like k with head_dim_v last; ``layout="bshd"``
(FlashAttention): the seqlen and heads axes swapped. Views whose last axis is contiguous are read
in place. out is like q with head_dim_v last; lse float32 (batch, num_heads, seqlen_q). Score
options (keyword arguments, FlashAttention's and PyTorch's names): attn_mask (bool or additive,
broadcastable to (batch, num_heads, seqlen_q, seqlen_k) in every layout), window_size=(left, right),
softcap, alibi_slopes, sinks; with sinks, backward returns (dq, dk, dv, dsinks). See ``Context`` for
the semantics and ``reference`` for the math.

The module functions run on a default Context created on first use; ``$FLASH_ATTENTION_METAL_BACKEND``
(auto, metal, cpu) picks its backend.
"""

from __future__ import annotations

from . import _default, _header, _paged_varlen, _validation, _varlen, accuracy, dropout, philox, quantized, reference
from ._default import BACKEND_ENV, default_backend, default_context
from ._native import LIBRARY_ENV
from .context import BACKENDS, Context
from .errors import CapacityError, FlashAttentionError
from .kv_cache import empty_cache, flash_attn_with_kvcache
from .profile import DispatchProfile, Profile

#: FA_VERSION of the C header, the project's one definition of its version (the library's too).
__version__ = _header.version()


def forward(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", attn_mask=None, window_size=(-1, -1),
            softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, out=None, lse=None):
    """``Context.forward`` on the default context: returns (out like q, lse float32), written into
    ``out`` and ``lse`` when given.

    Python's checks of the arguments (types, dtypes, how the shapes agree) run before the library
    is loaded, so such a mistake is reported as such even where the library is missing; the
    library's own rules (the largest head_dim, ...) need it.
    """
    options = dict(attn_mask=attn_mask, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    checked = _validation.check_forward(q, k, v, causal, softmax_scale, layout, **options)
    return default_context()._forward(q, k, v, checked, layout, out, lse)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, layout="bhsd", attn_mask=None,
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dq=None, dk=None,
             dv=None):
    """``Context.backward`` on the default context: returns (dq, dk, dv) like q, k, v, written into
    the arrays given, and dsinks float32 (num_heads,) after them when sinks are given (arguments
    checked before the library is loaded, as for ``forward``)."""
    options = dict(attn_mask=attn_mask, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    checked = _validation.check_backward(dout, q, k, v, out, lse, causal, softmax_scale, layout, **options)
    return default_context()._backward(dout, q, k, v, out, lse, checked, layout, dq, dk, dv)


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", attn_mask=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """``Context.attention`` on the default context: returns out, like q (arguments checked
    before the library is loaded, as for ``forward``)."""
    options = dict(attn_mask=attn_mask, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    checked = _validation.check_forward(q, k, v, causal, softmax_scale, layout, **options)
    return default_context()._forward(q, k, v, checked, layout)[0]


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                   dropout_p=0.0, dropout_seed=None, dropout_offset=0, block_table=None):
    """``Context.forward_varlen`` on the default context: attention over sequences packed along the
    rows (FlashAttention's flash_attn_varlen_func), with k and v paged caches when a block_table is
    given; returns (out (total_q, num_heads, head_dim_v), lse float32 (num_heads, total_q)).
    Arguments, the cu_seqlens tables included, are checked before the library is loaded."""
    if block_table is not None:
        if dropout_p != 0:
            raise ValueError(f"dropout_p={dropout_p} with block_table: paged K/V runs without dropout "
                             "(inference, as FlashAttention's paged calls); pass dropout_p=0")
        return _paged_varlen.forward(default_context(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, block_table, causal=causal, softmax_scale=softmax_scale,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     sinks=sinks)
    checked = _varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    return _varlen.forward(default_context(), q, k, v, checked)


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """``Context.backward_varlen`` on the default context: returns (dq, dk, dv) like q, k, v, and
    dsinks float32 (num_heads,) after them when sinks are given (arguments checked before the
    library is loaded, as for ``forward_varlen``)."""
    checked = _varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    return _varlen.backward(default_context(), dout, q, k, v, out, lse, checked)


def last_profile():
    """``Context.last_profile`` of the default context: the profile of the calling thread's last
    successful module-level ``forward``/``backward``/``attention``/``merge_attention`` call, or
    None before one."""
    context = _default.existing_default_context()
    return None if context is None else context.last_profile


def merge_attention(out_a, lse_a, out_b, lse_b):
    """``Context.merge_attention`` on the default context: merges two attention results over
    disjoint key sets into the result over their union; returns (out like out_a, lse float32)
    (arguments checked before the library is loaded, as for ``forward``)."""
    _validation.check_merge(out_a, lse_a, out_b, lse_b)
    return default_context().merge_attention(out_a, lse_a, out_b, lse_b)


__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CapacityError",
    "LIBRARY_ENV",
    "Context",
    "DispatchProfile",
    "FlashAttentionError",
    "Profile",
    "accuracy",
    "attention",
    "backward",
    "backward_varlen",
    "default_backend",
    "default_context",
    "empty_cache",
    "flash_attn_with_kvcache",
    "forward",
    "forward_varlen",
    "last_profile",
    "merge_attention",
    "quantized",
    "reference",
]
