"""``flash_attention_metal.mlx``: the library as MLX's scaled_dot_product_attention, with MLX's CPU
backend (``mlx[cpu]`` on Linux, installed by build.sh through the test extra).

Accuracy, two ways on every grid case, forward and the gradients of ``mx.vjp``:
- the library's rule (``accuracy``): against the float64 reference, bound by the NumPy baseline of
  the dtype;
- MLX in both roles: ``ref`` is MLX's own sdpa in float64 (exact conversions of the inputs; MLX's
  CPU backend computes in float64), ``base`` MLX's sdpa in the inputs' dtype, and the same bound:
  max|ours - ref| <= 2 * max|base - ref| + atol(ref) (``accuracy.bound``).
A query row that sees no key (causal, seqlen_q > seqlen_k) gets 0 from the library and the mean of
v from MLX: such rows are left out of the MLX out comparison, and their dout rows are zero, so
neither implementation's gradient sees them.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy

from conftest import make_inputs, run_example

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e 'python[mlx]'; needs Python 3.10+)")
nn = pytest.importorskip("mlx.nn")
optim = pytest.importorskip("mlx.optimizers")

from flash_attention_metal import mlx as fam_mlx  # noqa: E402

from flash_attention_metal.models import tiny_mlx  # noqa: E402

DTYPES = {"float16": (np.float16, mx.float16), "bfloat16": (ml_dtypes.bfloat16, mx.bfloat16),
          "float32": (np.float32, mx.float32)}

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, causal): MHA, GQA, MQA,
# seqlen_q < and > seqlen_k (the latter with rows that see no key), decode, head_dim 16 to 256,
# head_dim_v != head_dim.
GRID = [
    (1, 4, 4, 64, 64, 32, 32, False),
    (2, 4, 2, 48, 80, 64, 64, True),
    (1, 6, 1, 70, 33, 64, 64, True),
    (1, 4, 2, 1, 100, 128, 128, True),
    (1, 2, 1, 40, 40, 96, 48, False),
    (1, 2, 2, 33, 20, 256, 256, False),
    (2, 2, 1, 17, 29, 16, 16, True),
]


def _label(case):
    b, h, hk, nq, nk, d, dv, causal = case
    return f"B{b}-H{h}-Hkv{hk}-Nq{nq}-Nk{nk}-D{d}-Dv{dv}-{'causal' if causal else 'full'}"


def to_mlx(array: np.ndarray) -> mx.array:
    if array.dtype == ml_dtypes.bfloat16:
        return mx.array(array.view(np.uint16)).view(mx.bfloat16)
    return mx.array(array)


def to_numpy(array: mx.array) -> np.ndarray:
    """float64 values of an MLX array."""
    return np.array(array.astype(mx.float64) if array.dtype != mx.bfloat16 else array.astype(mx.float32),
                    dtype=np.float64)


def _vjp(attention, q, k, v, dout, causal: bool, scale: float):
    """out, dq, dk, dv of ``attention`` (MLX's signature) through mx.vjp, on MLX's CPU device."""
    def f(q, k, v):
        return attention(q, k, v, scale=scale, mask="causal" if causal else None)

    with mx.stream(mx.cpu):
        (out,), grads = mx.vjp(f, [q, k, v], [dout])
        mx.eval(out, grads)
    return [out, *grads]


@pytest.mark.parametrize("case", GRID, ids=_label)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_and_gradients_match_the_reference_and_mlx(dtype, case):
    np_dtype, mx_dtype = DTYPES[dtype]
    *shape, head_dim_v, causal = case
    q, k, v, dout = make_inputs(sum(shape) + head_dim_v, *shape, head_dim_v=head_dim_v, dtype=np_dtype)
    seen = fam.reference.visible_keys(q.shape[2], k.shape[2], causal).any(axis=1)
    dout[:, :, ~seen] = 0
    scale = 0.8 * q.shape[-1] ** -0.5  # not the default: a scale that is not passed on fails
    arrays = [to_mlx(a) for a in (q, k, v, dout)]
    ours = _vjp(fam_mlx.scaled_dot_product_attention, *arrays, causal, scale)
    assert all(a.dtype == mx_dtype for a in ours)
    assert ours[0].shape == dout.shape
    ours = [to_numpy(a) for a in ours]
    label = f"{dtype} {_label(case)}"

    # The library's rule: float64 reference, NumPy baseline in the dtype.
    metrics = accuracy.evaluate_forward(q, k, v, ours[0], None, causal=causal, softmax_scale=scale)
    metrics += accuracy.evaluate_backward(dout, q, k, v, *ours[1:], causal=causal, softmax_scale=scale)
    assert all(m.passed for m in metrics), f"{label} (library rule)\n{accuracy.describe(metrics)}"

    # MLX in both roles: its float64 sdpa as ref, its sdpa in the dtype as base.
    mlx_ref = [to_numpy(a) for a in _vjp(mx.fast.scaled_dot_product_attention,
                                         *[a.astype(mx.float64) for a in arrays], causal, scale)]
    mlx_base = [to_numpy(a) for a in _vjp(mx.fast.scaled_dot_product_attention, *arrays, causal, scale)]
    visible = [(slice(None), slice(None), seen)] + [...] * 3  # out: the rows that see a key
    metrics = [_metric(name, mine[rows], framework[rows], exact[rows])
               for name, mine, framework, exact, rows in zip(("out", "dq", "dk", "dv"), ours, mlx_base, mlx_ref,
                                                             visible)]
    assert all(m.passed for m in metrics), f"{label} (MLX float64 as ref, MLX {dtype} as base)\n" \
        + accuracy.describe(metrics)


def _metric(name: str, ours: np.ndarray, base: np.ndarray, ref: np.ndarray) -> accuracy.Metric:
    """The accuracy rule for one tensor: max|ours - ref| <= accuracy.bound(name, max|base - ref|, ref)."""
    base_error = accuracy.max_abs_error(base, ref)
    return accuracy.Metric(name, accuracy.max_abs_error(ours, ref), base_error,
                           accuracy.bound(name, base_error, ref))


def test_rows_that_see_no_key_are_zero_where_mlx_gives_the_mean_of_v():
    q, k, v, _ = make_inputs(3, 1, 2, 1, 6, 4, 8)
    arrays = [to_mlx(a) for a in (q, k, v)]
    ours = np.array(fam_mlx.scaled_dot_product_attention(*arrays, scale=0.3, mask="causal"))
    theirs = np.array(mx.fast.scaled_dot_product_attention(*arrays, scale=0.3, mask="causal"))
    assert not ours[:, :, :2].any()
    np.testing.assert_allclose(theirs[:, :, :2], np.broadcast_to(v.astype(np.float32).mean(axis=2, keepdims=True),
                                                                 (1, 2, 2, 8)), atol=2e-3)


# Arrays cross without copies: the library reads MLX's buffers and writes buffers MLX allocated.


def _address(array: mx.array) -> int:
    """The address of an evaluated MLX array's element [0, 0, 0, 0] (its buffer plus offset)."""
    return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array).ctypes.data


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_library_reads_and_writes_mlx_buffers(spied, dtype):
    context, spy = spied
    q, k, v, dout = (to_mlx(a) for a in make_inputs(4, 2, 4, 2, 24, 24, 16, dtype=DTYPES[dtype][0]))
    # q as a view of a (B, L, H, D) array: read in place through its strides.
    q = q.transpose(0, 2, 1, 3).astype(q.dtype)
    q = mx.contiguous(q).transpose(0, 2, 1, 3)
    mx.eval(q, k, v, dout)

    def f(q, k, v):
        return fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", context=context)

    (out,), grads = mx.vjp(f, [q, k, v], [dout])
    mx.eval(out, grads)
    forward, backward = spy.addresses["fa_forward"], spy.addresses["fa_backward"]
    assert forward[:3] == [_address(a) for a in (q, k, v)]
    assert forward[3] == _address(out)
    assert backward[:5] == [_address(a) for a in (dout, q, k, v, out)]
    assert backward[6:9] == [_address(g) for g in grads]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_copies_no_tensor(dtype):
    # MLX's allocations during a forward+vjp are exactly its outputs (out, lse, dq, dk, dv; plus
    # the scalars mx.zeros fills from), and NumPy allocates less than the smallest tensor, lse
    # (tracemalloc sees NumPy's data allocations and Python's few KiB of objects): no input or
    # output is copied.
    q, k, v, dout = (to_mlx(a) for a in make_inputs(5, 4, 4, 2, 256, 256, 16, dtype=DTYPES[dtype][0]))
    mx.eval(q, k, v, dout)

    def f(q, k, v):
        return fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")

    mx.eval(mx.vjp(f, [q, k, v], [dout]))  # warm-up: the library, kernels and MLX's buffer cache
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    tracemalloc.start()
    try:
        (out,), grads = mx.vjp(f, [q, k, v], [dout])
        mx.eval(out, grads)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    lse_bytes = 4 * out.size // out.shape[-1]
    outputs = out.nbytes + lse_bytes + sum(g.nbytes for g in grads)
    assert 0 <= mx.get_peak_memory() - before - outputs <= 64, (mx.get_peak_memory() - before, outputs)
    assert numpy_peak < lse_bytes, (numpy_peak, lse_bytes)


# MLX transformations: what works, and clear errors for what does not.

def _small(dtype=mx.float16):
    q, k, v, dout = make_inputs(6, 1, 4, 2, 16, 16, 8)
    return [to_mlx(a).astype(dtype) for a in (q, k, v, dout)]


def _loss(attention):
    def loss(q, k, v):
        return (attention(q, k, v, scale=0.5, mask="causal").astype(mx.float32) ** 2).sum()
    return loss


def test_grad_and_value_and_grad_equal_vjp():
    q, k, v, _ = _small()
    loss = _loss(fam_mlx.scaled_dot_product_attention)
    value, grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    plain = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    out = fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    _, by_vjp = mx.vjp(lambda q, k, v: fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal"),
                       [q, k, v], [2 * out])
    assert value.item() == pytest.approx(float((np.array(out, dtype=np.float64) ** 2).sum()), rel=1e-6)
    for a, b, c in zip(grads, plain, by_vjp):
        np.testing.assert_array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(np.array(a), np.array(c))


def test_nn_module_training_step_updates_the_parameters():
    model = tiny_mlx.TinyTransformer(fam_mlx.scaled_dot_product_attention, vocab=16, dims=16,
                                           heads=2, kv_heads=1, layers=1)
    tokens = mx.array(np.random.default_rng(7).integers(0, 16, size=(2, 9)))
    before = [np.array(p) for _, p in tiny_mlx.flat_parameters(model)]
    step = tiny_mlx.make_step(model, optim.SGD(learning_rate=0.1))
    loss = step(tokens)
    assert np.isfinite(loss)
    after = [np.array(p) for _, p in tiny_mlx.flat_parameters(model)]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))


# The pure-Python fallback (a context given, or no extension): its limits raise. The native path's
# transformations are tested in test_mlx_native.py.

@pytest.mark.parametrize("transform", ["compile", "vmap"])
def test_compile_and_vmap_raise_not_implemented_on_the_fallback(transform):
    q, k, v, _ = _small()

    def f(q, k, v):
        return fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, context=fam.default_context())

    with pytest.raises(NotImplementedError, match="cannot run inside mx.compile or mx.vmap"):
        if transform == "compile":
            mx.compile(f)(q, k, v)
        else:
            mx.vmap(f)(q[None], k[None], v[None])


def test_jvp_and_second_derivatives_raise_instead_of_returning_zeros_on_the_fallback():
    q, k, v, _ = _small(mx.float32)

    def f(q):
        return fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, context=fam.default_context())

    with pytest.raises(NotImplementedError, match="no jvp"):
        mx.jvp(f, [q], [q])
    with pytest.raises(NotImplementedError, match="no second derivatives"):
        mx.grad(lambda q: mx.grad(lambda q: f(q).sum())(q).sum())(q)


# Arguments: MLX's signature, with clear errors for what is not supported.

def test_array_masks_and_sinks_need_the_extension():
    q, k, v, _ = _small()
    context = fam.default_context()
    with pytest.raises(NotImplementedError, match=r"^mask: array masks .* need the MLX extension"):
        fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mx.ones((16, 16), dtype=mx.bool_),
                                             context=context)
    with pytest.raises(NotImplementedError, match=r"^sinks: attention sinks need the MLX extension"):
        fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, sinks=mx.zeros((4,), dtype=q.dtype),
                                             context=context)


@pytest.mark.parametrize("mask, error", [("full", ValueError), ("CAUSAL", ValueError), (1, TypeError)])
def test_mask_must_be_none_causal_or_an_array(mask, error):
    q, k, v, _ = _small()
    with pytest.raises(error, match=r"^mask must be None, 'causal'"):
        fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)


def test_dtypes_are_checked_without_silent_casts():
    q, k, v, _ = _small()
    with pytest.raises(TypeError, match=r"^k must have q's dtype mlx.core.float16, got mlx.core.float32"):
        fam_mlx.scaled_dot_product_attention(q, k.astype(mx.float32), v, scale=0.5)
    with pytest.raises(TypeError, match=r"^q must have dtype float16, bfloat16 or float32"):
        fam_mlx.scaled_dot_product_attention(q.astype(mx.int32), k, v, scale=0.5)
    with pytest.raises(TypeError, match=r"^v must be an mlx.core.array, got ndarray"):
        fam_mlx.scaled_dot_product_attention(q, k, np.array(v), scale=0.5)


@pytest.mark.parametrize("scale, error, text", [(None, TypeError, "scale is required"),
                                                (float("inf"), ValueError, "scale must be finite"),
                                                ("0.5", TypeError, "scale must be a real number")])
def test_scale_is_required_and_finite(scale, error, text):
    q, k, v, _ = _small()
    with pytest.raises(error, match=rf"^{text}"):
        fam_mlx.scaled_dot_product_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_shape_errors_name_the_argument(native):
    if native and not fam_mlx.NATIVE:
        pytest.skip(fam_mlx.PATH_NOTE)
    context = None if native else fam.default_context()
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match=r"^q must be 4-D"):
        fam_mlx.scaled_dot_product_attention(q[0], k, v, scale=0.5, context=context)
    # The library's own message on both paths (the rule has no Python copy).
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        fam_mlx.scaled_dot_product_attention(q, mx.concatenate([k, k[:, :1]], axis=1),
                                             mx.concatenate([v, v[:, :1]], axis=1), scale=0.5, context=context)
    wide = mx.zeros((1, 1, 2, 577), dtype=mx.float16)
    with pytest.raises(ValueError, match=r"head_dim \(577\) must be at most fa_max_head_dim\(\) \(576\)"):
        fam_mlx.scaled_dot_product_attention(wide, wide, wide, scale=0.5, context=context)
    with pytest.raises(ValueError, match=r"dropout_p \(1\.0\) must be at least 0 and below 1"):
        fam_mlx.scaled_dot_product_attention(q, k, v, scale=0.5, dropout_p=1.0, dropout_seed=0, context=context)


# Training: the tiny transformer of examples/mlx_train_tiny.py (models.tiny_mlx), 50 steps.

def test_training_follows_mlx_within_float16_tolerance():
    # The accuracy rule on a loss curve: ref is the run whose attention is MLX's in float32, base
    # the run with MLX's attention in float16, ours the run with the library's in float16 (every
    # other operation float32 and identical; same weights and batches). The curve passes when
    # max_t |ours_t - ref_t| <= 2 * max_t |base_t - ref_t| + atol(ref) (accuracy.bound). (Seeds 0-3 give ratios
    # max|ours - ref| / max|base - ref| of 0.89 to 1.13 on this smooth task.)
    curves = {name: tiny_mlx.train(attention, attention_dtype=dtype, steps=50)
              for name, attention, dtype in (("ref", mx.fast.scaled_dot_product_attention, mx.float32),
                                             ("base", mx.fast.scaled_dot_product_attention, mx.float16),
                                             ("ours", fam_mlx.scaled_dot_product_attention, mx.float16))}
    ref, base, ours = (np.array(curves[name]) for name in ("ref", "base", "ours"))
    assert ref[-1] < 0.7 * ref[0], f"the model did not learn: {ref[0]:.3f} -> {ref[-1]:.3f}"
    error, base_error = np.abs(ours - ref).max(), np.abs(base - ref).max()
    assert error <= accuracy.bound("out", base_error, ref), (
        f"max|ours - ref| {error:.3e}, max|base - ref| {base_error:.3e}\n"
        + "\n".join(f"{t:2d} {r:.6f} {b:.6f} {o:.6f}" for t, (r, b, o) in enumerate(zip(ref, base, ours))))


def test_the_example_runs_and_passes():
    run = run_example("mlx_train_tiny.py", "--steps", "5")
    printed = run.stdout
    assert run.returncode == 0, printed + run.stderr
    assert "MLX float32       MLX float16   library float16" in printed and printed.rstrip().endswith("pass")


@pytest.mark.parametrize("options", [[], ["--compile"]], ids=["eager", "compiled"])
def test_the_memory_benchmark_runs(options):
    if options and not fam_mlx.NATIVE:
        pytest.skip(fam_mlx.PATH_NOTE)
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "mlx_memory.py"
    result = subprocess.run([sys.executable, str(script), "--seqlens", "64", *options], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.lstrip().startswith("64 ")]
    assert len(rows) == 3 and all("MiB" in row for row in rows), result.stdout
