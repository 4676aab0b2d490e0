"""The Metal backend executed on Linux: the stand-in build (tests/metal_standin/build.sh, which
./build.sh test runs first) compiles Sources/FlashAttentionMetal with `canImport(Metal)` true
against a stand-in Metal module that runs the kernels on the CPU engine (docs/metal.md).

Here, in child processes on that build: the Swift tests of the Metal backend; the bit-for-bit
comparison with the CPU backend that reaches every kernel and the error paths
(metal_standin_cases.py); a named subset of tests/python's tests on ``Context("metal")``; and
copies of the backend with a planted defect, which must make the comparison fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flash_attention_metal as fam

ROOT = Path(__file__).resolve().parents[3]
STANDIN = ROOT / "build" / "metal-standin"
LIBRARY = STANDIN / "libFlashAttentionMetal.so"
# The tests that run again on Context("metal") through the stand-in: every dtype, layout, head_dim
# bucket, score option, split-KV decode, merges, backward's lse handling, given outputs, errors,
# profiles, specialisation, cancellation and threads (207 tests, 70 s on 2 cores). The rest
# of tests/python tests the Python layer, the reference, the CLI or the models, which no backend
# changes.
METAL_SUBSET = [
    "core/test_dtypes_layouts.py", "options/test_score_options.py", "core/test_split_kv.py", "core/test_merge.py",
    "core/test_backward_lse.py", "core/test_given_outputs.py", "core/test_errors.py", "core/test_profile.py",
    "core/test_semantics.py", "kernels/test_specialisation.py", "core/test_layout.py", "core/test_cancellation.py",
    "core/test_threads.py",
]
# Tests of the subset that the parallel run has run already and whose work Context("metal") does
# not change: two compile the kernel source with clang and call no backend; the third holds the
# CPU backend's dispatches against the kernels' LLVM IR (a 40 s compile), and on Context("metal")
# test_metal_dispatches_get_the_constants_the_cpu_ones_get holds Metal's to the CPU backend's.
RUN_ON_THE_CPU_ALONE = [
    "kernels/test_specialisation.py::test_every_kernel_compiles_after_the_prelude",
    "kernels/test_specialisation.py::test_a_feature_compiled_off_leaves_no_code",
    "kernels/test_specialisation.py::test_each_kernel_references_exactly_the_constants_its_dispatches_get",
]

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="macOS has the real Metal module")


def _library() -> Path:
    if not LIBRARY.exists():
        pytest.fail(f"{LIBRARY} is missing: run tests/metal_standin/build.sh (./build.sh test does)")
    return LIBRARY


def _pytest(library: Path, *args: str, backend: str = "auto", timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{fam.LIBRARY_ENV: str(library), fam.BACKEND_ENV: backend})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *args],
                          cwd=ROOT / "tests" / "python", env=env, capture_output=True, text=True, timeout=timeout)


def _passed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def test_swift_tests_of_the_metal_backend():
    _library()
    result = subprocess.run([str(STANDIN / "metal-backend-tests")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "with 0 failures" in result.stdout + result.stderr


def test_metal_backend_equals_the_cpu_backend_bit_for_bit():
    _passed(_pytest(_library(), "kernels/metal_standin_cases.py"))


def test_named_subset_on_context_metal():
    deselect = [option for test in RUN_ON_THE_CPU_ALONE for option in ("--deselect", test)]
    _passed(_pytest(_library(), *METAL_SUBSET, *deselect, "-m", "not serial", backend="metal", timeout=600))


@pytest.mark.serial  # the subset's serial tests (conftest.py: Ctrl-C's exit bound), alone as here
def test_serial_part_of_the_named_subset_on_context_metal():
    _passed(_pytest(_library(), *METAL_SUBSET, "-m", "serial", backend="metal"))


# A forward plan as the PyTorch MPS path makes it (no architecture given: the library's Metal device),
# its tensor-op library compiled where wanted: prints whether it was wanted, then the route.
_EXPORTED_ROUTE = """
from flash_attention_metal import _abi, _native, plan
from flash_attention_metal._validation import Shape
library = _native.native()
problem = _abi.new_problem(library.ffi, library.lib, Shape(1, 2, 1, 70, 40, 64), True, 0.125, "float16", {})
wanted = plan.tensor_ops_wanted()
made = plan.create(problem, "forward", target=plan.Target("ready" if wanted else "none"))
print(wanted)
print(made.tensor_ops)
print(made.dispatches[0].kernel_name)
"""


@pytest.mark.parametrize("architecture, expected", [
    ("applegpu_g17s", ["True", "tensor ops: applegpu_g17s has matrix units", "flash_attention_forward_tensor_f16_d64"]),
    (None, ["False", "simdgroup kernels: applegpu_g13s has no matrix units (architecture generation 17 and later "
            "have); the host compiled no tensor-op library", "flash_attention_forward_f16_d64"]),
])
def test_exported_plans_read_the_metal_devices_architecture(architecture, expected):
    """Exported plans without an architecture (the PyTorch MPS path's) gate on the Metal device the
    library runs on (MetalBackend.defaultDeviceArchitecture; the stand-in's is an M1's or
    FLASH_ATTENTION_METAL_STANDIN_ARCH): an M5's takes the tensor-op forward, an M1's not."""
    env = dict(os.environ, **{fam.LIBRARY_ENV: str(_library())})
    env.pop("FLASH_ATTENTION_TENSOR_OPS", None)
    env.pop("FLASH_ATTENTION_METAL_STANDIN_ARCH", None)
    if architecture is not None:
        env["FLASH_ATTENTION_METAL_STANDIN_ARCH"] = architecture
    result = subprocess.run([sys.executable, "-c", _EXPORTED_ROUTE], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == expected


def test_info_says_where_the_tensor_op_kernels_came_from(tmp_path):
    """On an M5 (the stand-in's FLASH_ATTENTION_METAL_STANDIN_ARCH), ``info``'s note says where the
    Metal context's tensor-op kernels came from: the embedded source compiled at MSL 4.0 while no
    tensor-op .metallib is beside the library, that file once it is there (a library file of the
    stand-in's own; a real .metallib needs a Mac)."""
    library = tmp_path / LIBRARY.name
    shutil.copy(_library(), library)
    env = dict(os.environ, **{fam.LIBRARY_ENV: str(library), "FLASH_ATTENTION_METAL_STANDIN_ARCH": "applegpu_g17s"})
    env.pop("FLASH_ATTENTION_TENSOR_OPS", None)

    def note() -> str:
        result = subprocess.run([sys.executable, "-m", "flash_attention_metal", "info", "--backend", "metal"],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return next(line for line in result.stdout.splitlines() if line.startswith("note"))

    compiled = note()
    found = re.search(r"tensor-op kernels compiled from the embedded source at MSL 4\.0 \(no "
                      r"(flash_attention-tensor-[0-9a-f]+-msl4\.0\.metallib) for this OS next to the library\)", compiled)
    assert found, compiled
    metallib = tmp_path / found.group(1)
    metallib.write_text("metal-standin-metallib tensor\n")
    assert f"tensor-op kernels from {metallib}" in note()


# Defects planted in a copy of MetalFlashAttention.swift: the original line, the planted one, and
# what the failure must say. Both go into one build, each active only when PLANTED_DEFECT names it,
# so one compile of the backend (about 40 s of CPU) serves every defect's run.
PLANTED_DEFECT = "FLASH_ATTENTION_METAL_PLANTED_DEFECT"
_ACTIVE = f'ProcessInfo.processInfo.environment["{PLANTED_DEFECT}"] == '
PLANTS = {
    # k and v swapped (buffers 1 and 2): same sizes, so only the results show it.
    "wrong buffer index": ("index: binding.index)",
                           f'index: {_ACTIVE}"wrong buffer index" ? ([1: 2, 2: 1][binding.index] ?? binding.index) '
                           ": binding.index)",
                           "differs between the CPU and Metal"),
    "misaligned offset": ("offset: piece.byteOffset(of: binding.role),",
                          f'offset: piece.byteOffset(of: binding.role) + ({_ACTIVE}"misaligned offset" ? 1 : 0),',
                          "is not aligned"),
}


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    """The stand-in build of a copy of the backend with every defect of PLANTS planted."""
    _library()
    tmp_path = tmp_path_factory.mktemp("planted")
    sources = tmp_path / "FlashAttentionMetal"
    shutil.copytree(ROOT / "Sources" / "FlashAttentionMetal", sources)
    encoder = sources / "Metal" / "MetalFlashAttention.swift"
    text = encoder.read_text()
    for original, planted, _ in PLANTS.values():
        assert text.count(original) == 1, f"the line to plant into is gone: {original}"
        text = text.replace(original, planted)
    encoder.write_text(text)
    out = tmp_path / "build"
    env = dict(os.environ, METAL_STANDIN_OUT=str(out), METAL_STANDIN_SWIFT_TESTS="0", METAL_STANDIN_SWIFT6="0",
               METAL_STANDIN_MODULES=str(STANDIN))
    subprocess.run([str(ROOT / "tests" / "metal_standin" / "build.sh"), str(sources)], env=env, check=True,
                   capture_output=True, timeout=600)
    return out / "libFlashAttentionMetal.so"


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_defect_fails_the_suite(planted_library, plant, monkeypatch):
    monkeypatch.setenv(PLANTED_DEFECT, plant)
    result = _pytest(planted_library, "kernels/metal_standin_cases.py", "-x", "-k", "forward_backward")
    assert result.returncode != 0
    assert PLANTS[plant][2] in result.stdout + result.stderr, (result.stdout + result.stderr)[-4000:]
