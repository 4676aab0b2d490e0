"""Exported plans and the Metal 4 tensor-op kernels (issue 37 item 5, docs/tensor-ops.md): a host
that encodes plans itself (PyTorch's MPS path, MLX's eval_gpu) asks ``plan.tensor_ops_wanted``
whether to compile the tensor-op library and names what it has in a ``plan.Target``; the plan routes
as a Metal context does (the same gate: architecture generation and OS, FLASH_ATTENTION_TENSOR_OPS)
and says why (``Plan.tensor_ops``). Planning only: no kernel runs here.

Cost: well under a second (planning only).
"""

from __future__ import annotations

import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _native, plan
from flash_attention_metal._validation import Shape

# More than 64 query rows: the dense forward (the split-KV kernels stay simdgroup ones).
SHAPE = Shape(1, 2, 1, 70, 40, 64)
M5 = "applegpu_g17s"


def _problem(dtype="float16"):
    library = _native.native()
    return _abi.new_problem(library.ffi, library.lib, SHAPE, True, 0.125, dtype, {})


def _kernels(made: plan.Plan) -> list[str]:
    return [d.kernel_name for d in made.dispatches]


@pytest.fixture()
def tensor_ops(monkeypatch):
    """Sets FLASH_ATTENTION_TENSOR_OPS (None: unset)."""
    def select(value):
        if value is None:
            monkeypatch.delenv("FLASH_ATTENTION_TENSOR_OPS", raising=False)
        else:
            monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", value)
    select(None)
    return select


def test_an_m5_with_the_library_takes_the_tensor_op_kernels(tensor_ops):
    ready = plan.Target("ready", architecture=M5)
    forward = plan.create(_problem(), "forward", target=ready)
    assert _kernels(forward) == ["flash_attention_forward_tensor_f16_d64"]
    assert forward.dispatches[0].tensor_library
    assert forward.tensor_ops == "tensor ops: applegpu_g17s has matrix units"
    backward = _kernels(plan.create(_problem("bfloat16"), "backward", target=ready))
    assert "flash_attention_backward_dq_tensor_bf16_d64" in backward
    assert "flash_attention_backward_dkv_tensor_bf16_d64" in backward
    # The dispatch's source is the tensor-op library's, after the same prelude.
    source = plan.specialized_source(forward.dispatches[0])
    assert source == forward.dispatches[0].constants_prelude + plan.tensor_kernel_source()
    assert "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>" in source
    assert "flash_attention_forward_tensor_" not in plan.kernel_source()


@pytest.mark.parametrize("architecture, why", [
    ("applegpu_g16s", "applegpu_g16s has no matrix units (architecture generation 17 and later have)"),
    ("applegpu_g17p", "applegpu_g17p has no matrix units"),  # a phone needs generation 18 (MLX)
    (None, "no Metal device, and the host named no architecture"),  # Linux: the library has no Metal device
])
def test_without_matrix_units_the_simdgroup_kernels(tensor_ops, architecture, why):
    made = plan.create(_problem(), "forward", target=plan.Target("ready", architecture=architecture))
    assert not any("_tensor_" in name for name in _kernels(made))
    assert made.tensor_ops.startswith("simdgroup kernels: " + why)
    assert not plan.tensor_ops_wanted(architecture)
    assert plan.tensor_ops_wanted("applegpu_g18p") and plan.tensor_ops_wanted("applegpu_g17d")


def test_the_override_forces_or_forbids(tensor_ops):
    tensor_ops("1")
    assert plan.tensor_ops_wanted(None) and plan.tensor_ops_wanted("applegpu_g13s")
    forced = plan.create(_problem(), "forward", target=plan.Target("ready"))
    assert _kernels(forced) == ["flash_attention_forward_tensor_f16_d64"]
    assert forced.tensor_ops.startswith("tensor ops: FLASH_ATTENTION_TENSOR_OPS=1 (")
    # Forced, but the host has no library: the simdgroup kernels, saying so.
    without = plan.create(_problem(), "forward", target=plan.Target("none"))
    assert without.tensor_ops.endswith("; the host compiled no tensor-op library")
    assert not without.dispatches[0].tensor_library
    assert not plan.create(_problem(), "forward").dispatches[0].tensor_library  # fa_plan_create: no target
    tensor_ops("0")
    assert not plan.tensor_ops_wanted(M5)
    forbidden = plan.create(_problem(), "forward", target=plan.Target("ready", architecture=M5))
    assert forbidden.tensor_ops == "simdgroup kernels: FLASH_ATTENTION_TENSOR_OPS=0"
    assert not forbidden.dispatches[0].tensor_library
    tensor_ops("yes")
    with pytest.raises(fam.FlashAttentionError, match=r"FLASH_ATTENTION_TENSOR_OPS \(yes\) must be 1 .* or 0"):
        plan.create(_problem(), "forward", target=plan.Target("ready", architecture=M5))


def test_a_failed_library_keeps_the_simdgroup_kernels_and_says_why(tensor_ops):
    message = "program_source:7:10: fatal error: 'MetalPerformancePrimitives/MetalPerformancePrimitives.h' file not found"
    for value in (None, "1"):
        tensor_ops(value)
        made = plan.create(_problem(), "forward", target=plan.Target("failed", message, M5))
        assert not made.dispatches[0].tensor_library
        assert made.tensor_ops.startswith("simdgroup kernels: ")
        assert made.tensor_ops.endswith("the host's tensor-op library failed: " + message)


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match=r"target.tensor_library must be one of 'none', 'ready', 'failed', got 'yes'"):
        plan.create(_problem(), "forward", target=plan.Target("yes"))
    library = _native.native()
    ffi, lib = library.ffi, library.lib
    target = ffi.new("fa_plan_target *")
    holder = ffi.new("fa_plan **")
    target.struct_size = ffi.sizeof("fa_plan_target")
    target.tensor_library = 7
    assert lib.fa_plan_create_for(_problem(), lib.FA_PASS_FORWARD, 0, target, holder) == lib.FA_STATUS_INVALID_ARGUMENT
    assert "target->tensor_library (7) must be" in ffi.string(lib.fa_last_error_message()).decode()
    assert holder[0] == ffi.NULL
    target.tensor_library, target.struct_size = lib.FA_TENSOR_LIBRARY_READY, 8
    assert lib.fa_plan_create_for(_problem(), lib.FA_PASS_FORWARD, 0, target, holder) == lib.FA_STATUS_INVALID_ARGUMENT
    assert "target->struct_size (8) must be at least sizeof(fa_plan_target)" in \
        ffi.string(lib.fa_last_error_message()).decode()
    assert lib.fa_tensor_ops_wanted(ffi.NULL, ffi.NULL) == lib.FA_STATUS_INVALID_ARGUMENT
    assert lib.fa_plan_tensor_ops(ffi.NULL) == ffi.NULL
