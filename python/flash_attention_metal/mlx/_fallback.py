"""The pure-Python path of ``flash_attention_metal.mlx``: an ``mx.custom_function`` whose forward
and vjp hand evaluated MLX arrays to a library ``Context`` as NumPy views (no copies). Used when
the MLX extension (mlx_extension/, ``_mlx_ext``) is not built, or a ``context`` is given. Each call
evaluates its inputs, so it cannot run inside ``mx.compile`` or ``mx.vmap`` (NotImplementedError);
no array masks or sinks.
"""

from __future__ import annotations

import mlx.core as mx

from .. import _validation
from ._arrays import evaluate, new_output, numpy_view


@mx.custom_function
def _attention(q, k, v, scale, causal, context, dropout=(0.0, None, 0)):
    """(out, lse) of the library's forward, as new MLX arrays the library wrote; ``dropout``
    (dropout_p, dropout_seed, dropout_offset)."""
    evaluate(q, k, v)
    views = [numpy_view(a) for a in (q, k, v)]
    # Checked before the outputs are allocated, which a wrong shape could make huge.
    checked = _validation.check_forward(*views, causal, scale, dropout_p=dropout[0], dropout_seed=dropout[1],
                                        dropout_offset=dropout[2])
    shape = checked[0]
    out, out_view = new_output((shape.batch, shape.num_heads, shape.seqlen_q, shape.head_dim_v), q.dtype)
    lse, lse_view = new_output((shape.batch, shape.num_heads, shape.seqlen_q), mx.float32)
    context.forward(*views, causal=causal, softmax_scale=scale, dropout_p=dropout[0], dropout_seed=dropout[1],
                    dropout_offset=dropout[2], out=out_view, lse=lse_view)
    return out, lse


@_attention.vjp
def _attention_vjp(primals, cotangents, outputs):
    # lse is internal to scaled_dot_product_attention, so its cotangent is zero and is not used.
    q, k, v, scale, causal, context, dropout = primals
    out, lse = outputs
    dq, dk, dv = _attention_backward(cotangents[0], q, k, v, out, lse, scale, causal, context, dropout)
    return dq, dk, dv, None, None, None, None


@_attention.jvp
def _attention_jvp(primals, tangents):
    raise NotImplementedError(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no jvp (forward-mode differentiation); "
        "use mx.vjp/mx.grad, or mx.fast.scaled_dot_product_attention"
    )


@mx.custom_function
def _attention_backward(dout, q, k, v, out, lse, scale, causal, context, dropout=(0.0, None, 0)):
    """(dq, dk, dv) of the library's backward, as new MLX arrays the library wrote."""
    evaluate(dout, q, k, v, out, lse)
    views = [numpy_view(a) for a in (dout, q, k, v, out, lse)]
    grads = [new_output(a.shape, q.dtype) for a in (q, k, v)]
    context.backward(*views, causal=causal, softmax_scale=scale, dropout_p=dropout[0], dropout_seed=dropout[1],
                     dropout_offset=dropout[2], dq=grads[0][1], dk=grads[1][1], dv=grads[2][1])
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
