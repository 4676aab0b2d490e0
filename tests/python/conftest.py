"""Shared fixtures of the Python tests: the context under test and input makers.

The context is the default one, so ``FLASH_ATTENTION_METAL_BACKEND`` picks the backend (auto: Metal
on an Apple GPU, else the CPU engine running the .metal kernels). The library must be built
(./build.sh); these tests fail rather than skip without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _default, _native, accuracy


# How ./build.sh test runs these tests on every core (pytest-xdist): `-n auto --dist loadfile
# --no-loadscope-reorder -m "not serial"`, then `-m serial` alone. Serial: tests that time a child
# process (Ctrl-C's exit bound) or take fixed resources (the MLX ring backend's port runs).
# loadfile keeps each module on one worker, so module fixtures that build kernels, run MPI jobs or
# load models run once. The slowest modules are scheduled first, so that no worker is left with a
# long module at the end (--no-loadscope-reorder keeps this order: by default xdist >= 3.5 reorders
# modules by test count).
SERIAL_MARKER = "serial"
SLOW_MODULES_FIRST = ["test_planted_faults.py", "test_metal_standin.py", "test_compare.py",
                      "test_distributed_smollm2.py", "test_smollm2_model.py", "test_distributed.py",
                      "test_long_sequences.py"]


# The quick tier (`./build.sh test --quick`, docs/testing.md): the tests that a kernel or API change
# most often breaks, about one per feature and front end, for the inner loop; `./build.sh test` runs
# everything. Each entry is a test's file under tests/python and its name, every parametrization.
QUICK_MARKER = "quick"
QUICK_TESTS = {
    "core/test_accuracy.py": ["test_explicit_softmax_scale", "test_rows_without_keys_give_zero_out_minus_inf_lse_and_zero_grads",
                              "test_decode_causal_equals_non_causal"],
    "core/test_decode.py": ["test_strided_and_unaligned_caches"],
    "core/test_split_kv.py": ["test_decode_within_rule_and_deterministic"],
    "core/test_merge.py": ["test_merge_of_parts_is_attention_over_all_keys", "test_shapes_are_checked"],
    "core/test_semantics.py": ["test_gqa_dk_dv_sum_over_the_group", "test_every_head_dim_bucket"],
    "core/test_dtypes_layouts.py": ["test_bshd_equals_bhsd_bit_for_bit", "test_packed_qkv_slices_are_read_in_place"],
    "core/test_backward_lse.py": ["test_nan_and_plus_infinity_give_nan_gradients_of_that_row"],
    "core/test_nonfinite.py": ["test_issue_reproducer_nan_key_is_not_hidden_by_its_chunk"],
    "core/test_validation.py": ["test_qkv_must_be_float16_bfloat16_or_float32", "test_given_outputs_must_not_overlap_inputs"],
    "core/test_library_rules.py": ["test_dense_calls_are_refused_and_leave_given_outputs_unwritten",
                                   "test_kv_cache_calls_are_refused_before_the_append"],
    "core/test_errors.py": ["test_library_rejects_head_dim_beyond_the_kernels"],
    "core/test_given_outputs.py": ["test_given_outputs_are_written_in_place_and_equal_fresh_ones"],
    "options/test_score_options.py": ["test_identities_between_options", "test_decode_shapes_within_the_rule"],
    "options/test_dropout.py": ["test_forward_mask_bits_equal_the_twin_in_every_bucket",
                                "test_forward_backward_within_the_rule"],
    "varlen/test_varlen.py": ["test_each_sequence_meets_the_rule_and_equals_the_dense_call",
                              "test_wrong_tables_through_the_abi_stay_in_bounds"],
    "kv_cache/test_kv_cache.py": ["test_split_decode_paged_quantized_bhsd", "test_errors_leave_the_cache_untouched",
                                  "test_kernels_clamp_a_wrong_table"],
    "torch_api/test_torch.py": ["test_flash_attn_func_against_the_reference", "test_errors_name_the_argument_and_the_rule"],
    "torch_api/test_torch_kv_cache.py": ["test_refusals_leave_the_cache_untouched"],
    "torch_api/test_torch_varlen.py": ["test_refusals"],
    "mlx_api/test_mlx.py": ["test_grad_and_value_and_grad_equal_vjp", "test_shape_errors_name_the_argument"],
    "mlx_api/test_mlx_native.py": ["test_what_is_not_supported_raises_naming_it"],
    "models/test_fixture.py": ["test_forward_meets_the_accuracy_rule"],
    "models/test_fixture_smollm2.py": ["test_forward_meets_the_accuracy_rule"],
    "kernels/test_dkv_group_split.py": ["test_split_with_dropout_within_the_rule"],
    "kernels/test_plan.py": ["test_plan_invariants", "test_errors"],
    "kernels/test_plan_tensor_ops.py": ["test_the_override_forces_or_forbids"],
    "kernels/test_tensor_backward.py": ["test_the_rule_can_fail_and_the_route_can_be_forbidden"],
    "kernels/test_tensor_ops.py": ["test_routing_on_the_cpu_engine", "test_dropout_within_the_tensor_op_rule"],
    "repo/test_import_graph.py": ["test_the_import_graph_has_no_cycle"],
}
_HERE = Path(__file__).resolve().parent


# The folder where the kernels' IR tests share identical clang compiles (the every-kernel -O0 compile
# of the address-space check and of test_specialisation's constants check: 46 s of CPU each), named
# by FA_IR_CACHE (tests/static/check_address_spaces.py, emit_ir). The first process of a run (the
# xdist controller, whose workers inherit its environment) makes it and removes it at the end; one
# set from outside is left alone.
IR_CACHE_ENV = "FA_IR_CACHE"
_ir_cache_made = None


def pytest_configure(config):
    global _ir_cache_made
    config.addinivalue_line("markers", f"{SERIAL_MARKER}: run alone, after the parallel run (conftest.py)")
    config.addinivalue_line("markers", f"{QUICK_MARKER}: the quick tier, ./build.sh test --quick (conftest.py)")
    if not os.environ.get(IR_CACHE_ENV):
        _ir_cache_made = tempfile.mkdtemp(prefix="fa-ir-cache-")
        os.environ[IR_CACHE_ENV] = _ir_cache_made


def pytest_unconfigure(config):
    if _ir_cache_made is not None:
        shutil.rmtree(_ir_cache_made, ignore_errors=True)
        os.environ.pop(IR_CACHE_ENV, None)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        names = QUICK_TESTS.get(item.path.resolve().relative_to(_HERE).as_posix(), ())
        if getattr(item, "originalname", item.name) in names:
            item.add_marker(QUICK_MARKER)



# Whether a Metal device may exist: on macOS, and in the stand-in build (tests/metal_standin), whose
# Metal backend runs on the CPU engine.
METAL_MAY_EXIST = sys.platform == "darwin" or Path(os.environ.get(fam.LIBRARY_ENV, "")).parent.name == "metal-standin"


REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"


def run_example(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` with this Python from the examples folder, as a user would;
    returns the finished process (text output captured)."""
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=EXAMPLES)


@pytest.fixture(scope="session")
def ctx() -> fam.Context:
    return fam.default_context()


@pytest.fixture(scope="session")
def context() -> fam.Context:
    """The default context for the tests of the shipped fixtures and examples, which skip (rather
    than fail, as ``ctx`` does) when libFlashAttentionMetal has not been built."""
    try:
        return fam.default_context()
    except fam.FlashAttentionError as error:
        if error.status_name == "LIBRARY_NOT_FOUND":
            pytest.skip(f"libFlashAttentionMetal is not built: {error.message}")
        raise


class _Spy:
    """Stands in for the loaded library and records each compute call: its name, the data
    addresses it was given (the arguments after the context and the problem) and the attn_mask
    fields of its fa_problem (address, (batch, head, seq) strides, type), read during the call
    because the cffi struct lives only that long."""

    def __init__(self, real, ffi):
        self._real, self._ffi = real, ffi
        self.calls = []
        self.addresses = {}
        self.masks = []

    def _address(self, pointer) -> int:
        return int(self._ffi.cast("uintptr_t", pointer))

    def __getattr__(self, name):
        attribute = getattr(self._real, name)
        if name not in ("fa_forward", "fa_backward"):
            return attribute

        def record(context, problem, *arrays):
            self.calls.append(name)
            self.addresses[name] = [self._address(a) for a in arrays]
            strides = problem.attn_mask_strides
            self.masks.append((self._address(problem.attn_mask), (strides.batch, strides.head, strides.seq),
                               int(problem.attn_mask_type)))
            return attribute(context, problem, *arrays)

        return record


@pytest.fixture()
def spied(monkeypatch):
    """(context, spy): a Context whose fa_forward/fa_backward calls the spy records."""
    context = fam.Context(fam.default_backend())
    spy = _Spy(context._native.lib, context._native.ffi)
    native = type(context._native)(context._native.ffi, spy, context._native.path, context._native.header_path)
    monkeypatch.setattr(context, "_native", native)
    return context, spy


@pytest.fixture()
def guarded(spied):
    """A Context whose native compute calls are recorded; the test fails if any happens."""
    context, spy = spied
    yield context
    assert spy.calls == [], "a native call ran despite invalid arguments"


@pytest.fixture()
def library_missing(monkeypatch, tmp_path):
    """No library loaded and LIBRARY_ENV naming a missing file: the first call that needs the
    library raises LIBRARY_NOT_FOUND."""
    monkeypatch.setenv(fam.LIBRARY_ENV, str(tmp_path / "missing.so"))
    monkeypatch.setattr(_native, "_native", None)
    monkeypatch.setattr(_default, "_context", None)


@pytest.fixture()
def inputs():
    """Valid float16 arguments of a forward and a backward (batch 2, num_heads 4, num_kv_heads 2,
    seqlen_q 5, seqlen_k 6, head_dim 8) by name: q, k, v, dout, out, lse."""
    q, k, v, dout = make_inputs(0, 2, 4, 2, 5, 6, 8)
    return dict(dout=dout, q=q, k=k, v=v, out=np.zeros_like(q), lse=np.zeros(q.shape[:3], np.float32))


def run_forward(context, args, **options):
    """context.forward on the q, k, v of ``args`` (an ``inputs`` dict)."""
    return context.forward(args["q"], args["k"], args["v"], **options)


def run_backward(context, args, **options):
    """context.backward on the dout, q, k, v, out, lse of ``args`` (an ``inputs`` dict)."""
    return context.backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **options)


def both_raise(context, args, error, rule, **options):
    """forward and backward on ``args`` with ``options`` both raise ``error`` matching ``rule``."""
    with pytest.raises(error, match=rule):
        run_forward(context, args, **options)
    with pytest.raises(error, match=rule):
        run_backward(context, args, **options)


def make_inputs(seed: int, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                *, head_dim_v: int | None = None, dtype=np.float16, layout: str = "bhsd"):
    """N(0, 1) q, k, v, dout of the given attention shape in ``dtype`` and ``layout``; v and dout
    have head_dim_v (default head_dim) last. The same seed gives the same values in both layouts."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rng = np.random.default_rng(seed)
    shapes = [(batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
              (batch, kv_heads, seqlen_k, head_dim_v), (batch, heads, seqlen_q, head_dim_v)]
    arrays = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    if layout == "bshd":
        arrays = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in arrays]
    return tuple(arrays)


def to_bhsd(array: np.ndarray, layout: str) -> np.ndarray:
    """The (B, H, N, D) view of an array in ``layout``, as the reference takes it."""
    return array if layout == "bhsd" else array.transpose(0, 2, 1, 3)


def assert_within_rule(metrics: list[accuracy.Metric], label: str) -> None:
    """Fails with every metric's numbers when any is outside the accuracy rule."""
    assert all(m.passed for m in metrics), f"{label}\n{accuracy.describe(metrics)}"


def judge(ctx, q, k, v, dout, options: dict, label: str, layout: str = "bhsd"):
    """Forward and backward with ``options`` in ``layout``, each output checked for dtype, shape
    and the accuracy rule; returns (out, lse, grads)."""
    out, lse = ctx.forward(q, k, v, layout=layout, **options)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[3:]
    assert lse.dtype == np.float32 and lse.shape == to_bhsd(q, layout).shape[:3]
    qb, kb, vb, doutb = (to_bhsd(a, layout) for a in (q, k, v, dout))
    assert_within_rule(accuracy.evaluate_forward(qb, kb, vb, to_bhsd(out, layout), lse, **options),
                       f"forward {label}")
    grads = ctx.backward(dout, q, k, v, out, lse, layout=layout, **options)
    assert len(grads) == (4 if options.get("sinks") is not None else 3)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    bhsd_grads = [to_bhsd(g, layout) for g in grads[:3]] + list(grads[3:])
    assert_within_rule(accuracy.evaluate_backward(doutb, qb, kb, vb, *bhsd_grads, **options), f"backward {label}")
    return out, lse, grads


def causal_parts(ctx, q, k, v, split: int, causal: bool):
    """(out, lse) of attention over keys [0, split) and over keys [split, seqlen_k), each with the
    restriction of the full mask, computed by the library.

    Non-causal: both parts are plain forwards. Causal (bottom-right, query i sees key j iff
    j <= i + Nk - Nq): the second part is causal over its Nk - split keys (the same offset). In the
    first part row i sees key j < split iff j <= i + Nk - Nq, i.e. the rows i < Nq - Nk + split
    see a bottom-right causal staircase over the split keys with Nq - Nk + split queries, and the
    later rows see every key of the part.
    """
    k_a, v_a, k_b, v_b = k[:, :, :split], v[:, :, :split], k[:, :, split:], v[:, :, split:]
    part_b = ctx.forward(q, k_b, v_b, causal=causal)
    if not causal:
        return ctx.forward(q, k_a, v_a), part_b
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    staircase = min(max(seqlen_q - seqlen_k + split, 0), seqlen_q)
    outs, lses = [], []
    if staircase > 0:
        out, lse = ctx.forward(q[:, :, :staircase], k_a, v_a, causal=True)
        outs.append(out)
        lses.append(lse)
    if staircase < seqlen_q:
        out, lse = ctx.forward(q[:, :, staircase:], k_a, v_a)
        outs.append(out)
        lses.append(lse)
    return (np.concatenate(outs, axis=2), np.concatenate(lses, axis=2)), part_b


def mpi_env() -> dict[str, str]:
    """The environment of an mpiexec job: one OpenBLAS thread per rank. The ranks, beside the other
    pytest worker, fill the cores already; each rank's BLAS threads would only contend for them
    (the SmolLM2 sharded prefill: 128 s of CPU with them, 61 s without, on 2 loaded cores)."""
    return dict(os.environ, OPENBLAS_NUM_THREADS="1")


def mpiexec() -> str:
    """The mpiexec next to this Python (the 'distributed' extra's MPICH wheel), else on PATH."""
    beside_python = Path(sys.executable).with_name("mpiexec")
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found (install the 'distributed' extra: pip install 'python[distributed]')")
    return found
