"""tests/static/check_address_spaces.py: the kernels compile with MSL's address spaces enforced (clang, C++
for OpenCL 2021), and a planted address-space error, which the CPU engine cannot see, fails it."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHECK = ROOT / "tests" / "static" / "check_address_spaces.py"

# A function parameter `thread T *name` or `thread T &name`.
THREAD_PARAMETER = re.compile(r"[(,]\s*(thread)\s+(?:const\s+)?[\w:<>]+(?:\s+const)?\s*[*&]\s*\w+\s*[,)]")

# A kernel that hands a thread array to a helper, as the attention kernels do.
FIXTURE = """#include <metal_stdlib>
using namespace metal;

inline void scale(thread float *row, float factor) {
    for (uint d = 0; d < 4; ++d) {
        row[d] *= factor;
    }
}

kernel void fixture_kernel(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    float row[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    scale(row, 2.0f);
    out[tid] = row[tid % 4];
}
"""


def run_check(*sources: pathlib.Path) -> subprocess.CompletedProcess:
    """The check's result; skips the test when no clang here compiles C++ for OpenCL (exit 2), as
    ./build.sh test does, loudly."""
    result = subprocess.run([sys.executable, str(CHECK), *map(str, sources)], capture_output=True, text=True)
    if result.returncode == 2:
        pytest.skip(result.stderr.strip())
    return result


def plant(text: str) -> str:
    """The source with its first `thread` pointer or reference parameter made `device`."""
    match = THREAD_PARAMETER.search(text)
    assert match, "no thread pointer or reference parameter to plant the error into"
    return text[: match.start(1)] + "device" + text[match.end(1) :]


def test_shaders_compile_with_address_spaces_enforced():
    """Every .metal file at MSL 3.0, 3.1, 3.2, 4.0 and 4.1 (the versions the front ends compile at):
    3.0 without the bfloat16 kernels, the later ones with them; the tensor-op library
    (flash_attention_tensor.metal, Metal 4) at 4.0 and 4.1 only, every kernel at both."""
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    for source in sorted((ROOT / "Shaders").glob("*.metal")):
        tensor_ops = source.name == "flash_attention_tensor.metal"
        counts = {}
        for version in ("3.0", "3.1", "3.2", "4.0", "4.1"):
            found = re.search(rf"{re.escape(source.name)} \(MSL {re.escape(version)}\): ([1-9]\d*) kernels compiled",
                              result.stdout)
            assert (found is None) == (tensor_ops and version < "4.0"), (version, result.stdout)
            if found:
                counts[version] = int(found.group(1))
        if tensor_ops:
            # 4 buckets (64, 96, 128, 256) x 2 dtypes of each tensor_bucket kernel of the catalogue.
            kinds = len(re.findall(r"X\(\w+, tensor_bucket,", (ROOT / "Shaders" / "flash_attention_catalogue.h").read_text()))
            assert kinds >= 1 and counts["4.0"] == counts["4.1"] == 8 * kinds, (counts, kinds)
        else:
            assert counts["3.0"] < counts["3.1"] == counts["3.2"] == counts["4.0"] == counts["4.1"], counts


def test_fixture_compiles_and_fails_once_planted(tmp_path):
    good = tmp_path / "good.metal"
    good.write_text(FIXTURE)
    result = run_check(good)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("1 kernels compiled") == 5, result.stdout

    bad = tmp_path / "bad.metal"
    bad.write_text(plant(FIXTURE))
    assert "inline void scale(device float *row" in bad.read_text()
    result = run_check(bad)
    assert result.returncode == 1
    assert "address space" in result.stderr, result.stderr


def test_planted_error_in_the_attention_kernels_fails(tmp_path):
    """The same kind of error planted into the real kernels (their first thread pointer or
    reference parameter made device) fails the check, naming the address spaces."""
    shaders = tmp_path / "Shaders"
    shutil.copytree(ROOT / "Shaders", shaders)
    header = shaders / "flash_attention_products.h"
    header.write_text(plant(header.read_text()))
    result = run_check(shaders / "flash_attention.metal")
    assert result.returncode == 1, result.stdout
    assert "address space" in result.stderr, result.stderr


def test_a_kernel_that_is_never_emitted_fails(tmp_path):
    """A kernel template that nothing instantiates compiles without error, but the check requires
    code for every kernel the source defines."""
    source = tmp_path / "template.metal"
    source.write_text(FIXTURE + "template <typename T>\nkernel void never_instantiated(device T *x) { x[0] = T(1); }\n")
    result = run_check(source)
    assert result.returncode == 1
    assert "never_instantiated" in result.stderr
