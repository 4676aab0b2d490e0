"""The native path of ``flash_attention_metal.mlx`` (the MLX extension, mlx_extension/): array masks
and sinks under the accuracy rule, and MLX's transformations (mx.compile of a training step, a
shapeless compile, mx.vmap, grad of a compiled function). Skipped with the reason when the extension
is not built; the fallback path keeps its tests in test_mlx.py. About 10 s on 2 cores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy

from conftest import make_inputs

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e 'python[mlx]'; needs Python 3.10+)")
optim = pytest.importorskip("mlx.optimizers")

from flash_attention_metal import mlx as fam_mlx  # noqa: E402

if not fam_mlx.NATIVE:
    pytest.skip(fam_mlx.PATH_NOTE, allow_module_level=True)

from flash_attention_metal.models import tiny_mlx  # noqa: E402
from test_mlx import DTYPES, to_mlx, to_numpy  # noqa: E402

ours = fam_mlx.scaled_dot_product_attention
theirs = mx.fast.scaled_dot_product_attention


def _masks(rng, batch, heads, seqlen_q, seqlen_k):
    """A boolean (batch, 1, Lq, Lk) mask with every row keeping its first key (MLX gives NaN for
    an empty row, the library 0), and an additive (Lq, Lk) one."""
    boolean = rng.random((batch, 1, seqlen_q, seqlen_k)) > 0.4
    boolean[..., 0] = True
    additive = rng.standard_normal((seqlen_q, seqlen_k)).astype(np.float32)
    return {"bool": boolean, "additive": additive}


def _rule(name, mine, base, ref):
    base_error = accuracy.max_abs_error(base, ref)
    return accuracy.Metric(name, accuracy.max_abs_error(mine, ref), base_error, accuracy.bound(name, base_error, ref))


def _vjp(attention, arrays, dout, scale, mask, sinks):
    """out, dq, dk, dv[, dsinks] of ``attention`` through mx.vjp."""
    primals = list(arrays) + ([] if sinks is None else [sinks])

    def f(*p):
        return attention(p[0], p[1], p[2], scale=scale, mask=mask, sinks=None if sinks is None else p[3])

    (out,), grads = mx.vjp(f, primals, [dout])
    mx.eval(out, grads)
    return [out, *grads]


@pytest.mark.parametrize("mask_kind, with_sinks", [("bool", False), ("additive", False), (None, True),
                                                   ("bool", True)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_masks_and_sinks_match_the_reference_and_mlx(dtype, mask_kind, with_sinks):
    np_dtype, mx_dtype = DTYPES[dtype]
    shape = (2, 4, 2, 24, 40, 32)
    q, k, v, dout = make_inputs(11, *shape, dtype=np_dtype)
    rng = np.random.default_rng(3)
    # Additive masks and sinks in the dtype (MLX requires that they promote to it): every side
    # computes with the same rounded values.
    mask = None if mask_kind is None else _masks(rng, 2, 4, 24, 40)[mask_kind]
    if mask_kind == "additive":
        mask = mask.astype(np_dtype)
    sinks = rng.standard_normal(4).astype(np_dtype) if with_sinks else None
    scale = 0.8 * shape[-1] ** -0.5
    arrays = [to_mlx(a) for a in (q, k, v)]
    mx_mask = None if mask is None else (mx.array(mask) if mask_kind == "bool" else to_mlx(mask))
    mx_sinks = None if sinks is None else to_mlx(sinks)
    mine = [to_numpy(a) for a in _vjp(ours, arrays, to_mlx(dout), scale, mx_mask, mx_sinks)]
    names = ("out", "dq", "dk", "dv", "dsinks")[:len(mine)]

    # The library's rule: float64 reference, NumPy baseline in the dtype.
    ref_out, _ = fam.reference.forward(q, k, v, softmax_scale=scale, attn_mask=mask, sinks=sinks)
    base_out, _ = accuracy.base_forward(q, k, v, softmax_scale=scale, attn_mask=mask, sinks=sinks)
    metrics = [_rule("out", mine[0], base_out, ref_out)]
    metrics += accuracy.evaluate_backward(to_numpy(to_mlx(dout)).astype(np_dtype), q, k, v, *mine[1:],
                                          softmax_scale=scale, attn_mask=mask, sinks=sinks)
    assert all(m.passed for m in metrics), accuracy.describe(metrics)

    # MLX as the external oracle: its sdpa in float64 as ref, in the dtype as base.
    exact = [to_numpy(a) for a in _vjp(theirs, [a.astype(mx.float64) for a in arrays], to_mlx(dout).astype(mx.float64),
                                        scale, None if mx_mask is None else (mx_mask if mask_kind == "bool" else mx_mask.astype(mx.float64)),
                                        None if mx_sinks is None else mx_sinks.astype(mx.float64))]
    base = [to_numpy(a) for a in _vjp(theirs, arrays, to_mlx(dout), scale, mx_mask, mx_sinks)]
    metrics = [_rule(n, a, b, c) for n, a, b, c in zip(names, mine, base, exact)]
    assert all(m.passed for m in metrics), accuracy.describe(metrics)


def _tiny_curve(attention, dtype, steps=12):
    """Losses of a compiled training step (value_and_grad and Adam's update inside mx.compile)."""
    mx.random.seed(0)
    model = tiny_mlx.TinyTransformer(attention, 16, 32, 4, 2, 1, dtype)
    mx.eval(model.parameters())
    step = tiny_mlx.make_compiled_step(model, optim.Adam(learning_rate=3e-3))
    return np.array([step(tokens) for tokens in tiny_mlx.batches(steps, 8, 32, 16, 0)])


def test_a_compiled_training_step_follows_mlx():
    # The accuracy rule on the loss curve, as test_mlx.py's uncompiled training test.
    ref = _tiny_curve(theirs, mx.float32)
    base = _tiny_curve(theirs, mx.float16)
    mine = _tiny_curve(ours, mx.float16)
    assert ref[-1] < ref[0]
    assert np.abs(mine - ref).max() <= accuracy.bound("out", np.abs(base - ref).max(), ref)


def _small(seed=5, seqlen=16, dtype=np.float32):
    return [to_mlx(a) for a in make_inputs(seed, 2, 4, 2, seqlen, seqlen, 16, dtype=dtype)]


def test_grad_of_a_compiled_function_equals_the_plain_grad():
    q, k, v, _ = _small()
    mask = mx.array(np.tril(np.ones((16, 16), dtype=bool)))

    def loss(q, k, v):
        return (ours(q, k, v, scale=0.5, mask=mask) ** 2).sum()

    plain = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    compiled = mx.grad(mx.compile(loss), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(plain, compiled):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_a_shapeless_compile_infers_output_shapes_for_new_lengths():
    f = mx.compile(lambda q, k, v: ours(q, k, v, scale=0.5, mask="causal"), shapeless=True)
    for seqlen in (16, 24):
        q, k, v, _ = _small(seqlen=seqlen)
        out = f(q, k, v)
        assert out.shape == (2, 4, seqlen, 16)
        np.testing.assert_array_equal(np.array(out), np.array(ours(q, k, v, scale=0.5, mask="causal")))


def test_vmap_equals_a_loop_forward_and_backward():
    qs = mx.stack([_small(seed)[0] for seed in range(3)])
    _, k, v, _ = _small(9)
    mask = mx.array(np.random.default_rng(1).random((3, 16, 16)) > 0.3)  # mapped with q, per-entry masks

    def f(q, m):
        return ours(q, k, v, scale=0.5, mask=m)

    def g(q, m):
        return mx.grad(lambda q: (f(q, m) ** 2).sum())(q)

    for fn in (f, g):
        mapped = mx.vmap(fn)(qs, mask)
        loop = mx.stack([fn(qs[i], mask[i]) for i in range(3)])
        np.testing.assert_array_equal(np.array(mapped), np.array(loop))
    # A mapped axis other than the first, k and v unmapped.
    mapped = mx.vmap(lambda q: ours(q, k, v, scale=0.5), in_axes=2)(mx.moveaxis(qs, 0, 2))
    np.testing.assert_array_equal(np.array(mapped), np.array(mx.stack([ours(qs[i], k, v, scale=0.5) for i in range(3)])))


def test_what_is_not_supported_raises_naming_it():
    q, k, v, _ = _small()
    additive = mx.zeros((16, 16))
    with pytest.raises(ValueError, match="^mask: .* no gradient with respect to the mask"):
        mx.grad(lambda m: ours(q, k, v, scale=0.5, mask=m).sum())(additive)
    with pytest.raises(ValueError, match="no jvp"):
        mx.jvp(lambda q: ours(q, k, v, scale=0.5), [q], [q])
    with pytest.raises(ValueError, match="no second derivatives"):
        mx.grad(lambda q: mx.grad(lambda q: ours(q, k, v, scale=0.5).sum())(q).sum())(q)
    with pytest.raises(ValueError, match=r"^mask must broadcast to \(batch, num_heads, seqlen_q, seqlen_k\)"):
        ours(q, k, v, scale=0.5, mask=mx.zeros((3, 16)))
    with pytest.raises(ValueError, match=r"^sinks must have shape \(num_heads,\) = \(4,\)"):
        ours(q, k, v, scale=0.5, sinks=mx.zeros((2,)))
    with pytest.raises(ValueError, match="^sinks: mx.vmap over the sinks"):
        mx.vmap(lambda s: ours(q, k, v, scale=0.5, sinks=s))(mx.zeros((3, 4)))
    with pytest.raises(TypeError, match="^mask must be a bool or float16/bfloat16/float32 array"):
        ours(q, k, v, scale=0.5, mask=mx.zeros((16, 16), dtype=mx.int32))


def test_the_metal_branch_of_eval_gpu_type_checks_against_mlx_headers():
    # eval_gpu's Metal code cannot be built here (the wheel lacks <Metal/Metal.hpp>); with a stub of
    # the metal-cpp names it uses, it is compiled against MLX's real device.h (-fsyntax-only).
    import shutil
    import subprocess
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    root = Path(__file__).resolve().parents[3]
    include = Path(mx.__file__).resolve().parent / "include"  # mlx/core*.so -> mlx/include
    result = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-D_METAL_",
                             "-I", str(root / "tests" / "mlx_metal_stub"), "-isystem", str(include),
                             "-I", str(root / "Sources" / "CFlashAttentionMetal" / "include"),
                             str(root / "mlx_extension" / "eval_gpu.cpp")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_pass_longer_than_one_command_buffer_is_refused_on_the_gpu():
    """eval_gpu cannot end MLX's command buffer between pieces, so it refuses a pass the library
    would cut (2^35 FLOP per command buffer, as the Swift host): the message names the limit and
    the ways around it. Computed from shapes alone (the arrays are never evaluated); the refusal in
    eval_gpu itself is only compiled here (test_the_metal_branch_of_eval_gpu_type_checks_against_mlx_headers)."""
    from flash_attention_metal import _mlx_ext
    short = mx.zeros((1, 2, 1024, 64), dtype=mx.float16)
    assert _mlx_ext.long_pass_refusal(short, short, short, True, False) == ""
    assert _mlx_ext.long_pass_refusal(short, short, short, True, True) == ""
    # 4 * 32768^2 * 128 = 2^39 FLOP forward: one head is cut into ranges of query blocks.
    long = mx.zeros((1, 1, 32768, 128), dtype=mx.float16)
    for backward in (False, True):
        why = _mlx_ext.long_pass_refusal(long, long, long, True, backward)
        assert why.startswith(f"flash_attention_metal.mlx: this {'backward' if backward else 'forward'} pass needs ")
        assert "2^35 FLOP" in why and "watchdog" in why and "mx.eval each part" in why and "CPU stream" in why, why
    count = lambda backward: int(_mlx_ext.long_pass_refusal(long, long, long, True, backward).split()[5])
    assert 1 < count(False) < count(True)


def test_the_tensor_op_route_is_reported_after_a_gpu_pass():
    """``tensor_ops()`` is the extension's last GPU route (eval_gpu sets it, docs/tensor-ops.md):
    without Metal (here) only CPU-stream passes run, which plan nothing, so it stays ""; after a GPU
    pass (on a Mac) it names the way."""
    q, k, v, _ = _small()
    if not mx.metal.is_available():
        mx.eval(ours(q, k, v, scale=0.5, stream=mx.cpu))
        assert fam_mlx.tensor_ops() == ""
    else:
        mx.eval(ours(q, k, v, scale=0.5, stream=mx.gpu))
        assert fam_mlx.tensor_ops().startswith(("tensor ops: ", "simdgroup kernels: "))
