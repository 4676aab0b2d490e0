"""Dropout through flash_attention_metal.mlx (explicit seed): the native extension and the fallback
give the library's mask (forward and mx.grad against the float64 reference with it), reproducibly;
errors name the argument."""

from __future__ import annotations

import numpy as np
import pytest

from flash_attention_metal import accuracy, dropout

from conftest import assert_within_rule, make_inputs

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e 'python[mlx]'; needs Python 3.10+)")

from flash_attention_metal import mlx as fam_mlx  # noqa: E402

DROP = (0.25, 77, 5)


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_forward_and_grad_apply_the_librarys_mask(ctx, path):
    if path == "native" and not fam_mlx.NATIVE:
        pytest.skip(fam_mlx.PATH_NOTE)
    q, k, v, dout = make_inputs(4, 1, 4, 2, 21, 30, 32, dtype=np.float32)
    context = ctx if path == "fallback" else None
    options = dict(scale=32 ** -0.5, mask="causal", context=context, dropout_p=DROP[0], dropout_seed=DROP[1],
                   dropout_offset=DROP[2])
    arrays = [mx.array(a) for a in (q, k, v)]
    out = fam_mlx.scaled_dot_product_attention(*arrays, **options)
    mask = dropout.reference_mask(DROP, 1, 4, 21, 30)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, np.array(out), None, causal=True, dropout_mask=mask),
                       f"{path} forward")
    assert np.array_equal(np.array(fam_mlx.scaled_dot_product_attention(*arrays, **options)), np.array(out))

    def loss(q_, k_, v_):
        return (fam_mlx.scaled_dot_product_attention(q_, k_, v_, **options) * mx.array(dout)).sum()

    grads = [np.array(g) for g in mx.grad(loss, argnums=(0, 1, 2))(*arrays)]
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, causal=True, dropout_mask=mask),
                       f"{path} backward")


def test_errors_name_the_argument():
    q = mx.zeros((1, 1, 4, 16))
    with pytest.raises(ValueError, match="dropout_p"):
        fam_mlx.scaled_dot_product_attention(q, q, q, scale=0.25, dropout_p=1.0, dropout_seed=0)
    with pytest.raises(ValueError, match="dropout_seed"):
        fam_mlx.scaled_dot_product_attention(q, q, q, scale=0.25, dropout_p=0.5)
