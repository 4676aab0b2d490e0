"""The CUDA check's tensor-op emulation (tests/cuda/metal_tensor_ops.h) run on the host, on a
simulated warp (tests/cuda/host_warp: 32 fibers, every warp intrinsic a rendezvous), without nvcc
or a GPU: its outputs of tests/kernels/tensor_ops.metal's cross-check runs must be the CPU engine's
bit for bit (tests/cuda/tensor_ops_engine.txt, held to the engine by TensorOpsEngineOutputTests),
and a planted change of the accumulation order must break that (docs/tensor-ops.md)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CUDA = ROOT / "tests" / "cuda"


def _clang() -> str | None:
    found = shutil.which("clang++")
    if found:
        return found
    swift = shutil.which("swift")
    beside = pathlib.Path(swift).resolve().parent / "clang++" if swift else None
    return str(beside) if beside and beside.is_file() else None


CLANG = _clang()
# Built and checked on Linux (ucontext fibers, clang's _Float16 and __bf16); macOS deprecates ucontext.
pytestmark = [pytest.mark.skipif(CLANG is None, reason="no clang++ (it builds the simulated warp)"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the simulated warp is Linux-only")]


def _run(tmp_path: pathlib.Path, headers: pathlib.Path) -> subprocess.CompletedProcess:
    """Builds tensor_ops_host.cpp with the CUDA headers of `headers`, runs it and compares its
    outputs with the engine's."""
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    source = (ROOT / "tests" / "kernels" / "tensor_ops.metal").read_text()
    (kernels / "tensor_ops.metal").write_text(re.sub(r"\bdevice\b", "fa_device", source))
    program, output = tmp_path / "tensor_ops_host", tmp_path / "host.txt"
    subprocess.run([CLANG, "-std=c++17", "-O1", "-DFA_HOST_WARP", "-Wno-unknown-attributes",
                    "-Wno-deprecated-declarations",
                    f"-I{CUDA / 'host_warp'}", f"-I{CUDA / 'include'}", f"-I{headers}", f"-I{kernels}",
                    str(CUDA / "host_warp" / "tensor_ops_host.cpp"), "-o", str(program)],
                   check=True, capture_output=True, text=True)
    subprocess.run([str(program), str(output)], check=True, capture_output=True, text=True, timeout=120)
    return subprocess.run([sys.executable, str(CUDA / "tensor_ops_compare.py"), str(CUDA / "tensor_ops_engine.txt"),
                           str(output)], capture_output=True, text=True)


def test_the_cuda_emulation_gives_the_engines_bits(tmp_path):
    result = _run(tmp_path, CUDA)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "cuda-tensor-identity: 9 outputs, 0 mismatches"


def test_a_reversed_accumulation_order_is_caught(tmp_path):
    headers = tmp_path / "headers"
    shutil.copytree(CUDA, headers, ignore=shutil.ignore_patterns("host_warp", "include", "*.cu", "*.py", "*.txt"))
    ops = headers / "metal_tensor_ops.h"
    text = ops.read_text()
    forward = "for (uint32_t k = 0; k < K; ++k) acc = fmaf(a[row * K + k], b[k * N + column], acc);"
    assert forward in text
    ops.write_text(text.replace(forward, "for (uint32_t k = K; k-- > 0;) acc = fmaf(a[row * K + k], "
                                         "b[k * N + column], acc);"))
    result = _run(tmp_path, headers)
    assert result.returncode == 1
    assert re.search(r"cuda-tensor-identity: 9 outputs, [1-9]\d* mismatches$", result.stdout), result.stdout
