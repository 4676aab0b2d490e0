"""tests/static/check_tile_copies.py: the kernels' tile copies move 16-byte chunks with no 64-bit multiply
or division (issue 21, item 1), the per-tile steps are inlined and the products of two half tiles
widen no element (item 7), read in clang's LLVM IR; and copies of the kernels with a planted
per-element multiply, a narrow load, float operands or an out-of-line tile step fail it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHECK = ROOT / "tests" / "static" / "check_tile_copies.py"
LOADER = "flash_attention_loader.h"
# The planted copy compiles the float16 kernels of one head_dim bucket, not every kernel of
# flash_attention.metal (a tenth of the CPU time): every planted fault lies in code that each
# bucket's forward runs, and test_kernels_copy_tiles_in_chunks checks every kernel unedited.
PLANTED_KERNELS = """#include <metal_stdlib>

using namespace metal;

#include "flash_attention_kernels.h"

FA_DEFINE_BUCKET_KERNELS(half, f16, 64)
"""

# (text of a chunk copy in the loader, its planted replacement, the finding it must cause)
FAULTS = [
    ("    // The tile crosses the end of the rows (or the bucket's chunks leave some threads idle).\n"
     "    const uint rows_inside = s.seqlen > first ? s.seqlen - first : 0;\n",
     "    const uint rows_inside = s.seqlen > first ? uint(ulong(s.seqlen - first) * s.stride / s.stride) : 0;\n",
     "copy_chunks: a 64-bit multiply"),
    ("        return *at[k];\n",
     "        return uint4(*(device const uint *)at[k]);\n",
     "TileChunks::load: a device load narrower than 16 bytes"),
]


# (header of the kernels, text in it, its planted replacement, the finding it must cause): float
# operands for the products of two half tiles, and a per-tile step kept out of line.
KERNEL_FAULTS = [
    ("flash_attention_products.h",
     "    typedef simdgroup_matrix<typename TileFragment<T>::type, 8, 8> Operand;\n",
     "    typedef simdgroup_float8x8 Operand;\n",
     "product_transposed_over: a half element widened to float"),
    ("flash_attention_forward.h",
     "FA_ALWAYS_INLINE void forward_tile(",
     "inline __attribute__((noinline)) void forward_tile(",
     "forward_tile: not inlined into its caller"),
]


def plant(path: pathlib.Path, faults) -> None:
    text = path.read_text(encoding="utf-8")
    for original, planted, _ in faults:
        assert text.count(original) == 1, f"{path.name} no longer holds {original.strip()!r}: update the faults"
        text = text.replace(original, planted)
    path.write_text(text, encoding="utf-8")


def run_check(source: pathlib.Path) -> subprocess.CompletedProcess:
    """The check's result; skips when no clang here compiles C++ for OpenCL (exit 2)."""
    result = subprocess.run([sys.executable, str(CHECK), str(source)], capture_output=True, text=True)
    if result.returncode == 2:
        pytest.skip(result.stderr.strip())
    return result


def test_kernels_copy_tiles_in_chunks():
    result = run_check(ROOT / "Shaders" / "flash_attention.metal")
    assert result.returncode == 0, result.stderr
    assert "16-byte chunks" in result.stdout


def test_planted_faults_are_found(tmp_path):
    shaders = tmp_path / "Shaders"
    shutil.copytree(ROOT / "Shaders", shaders)
    plant(shaders / LOADER, FAULTS)
    for header, *fault in KERNEL_FAULTS:
        plant(shaders / header, [fault])
    kernels = shaders / "planted.metal"
    kernels.write_text(PLANTED_KERNELS, encoding="utf-8")
    result = run_check(kernels)
    assert result.returncode == 1, result.stdout + result.stderr
    for *_, finding in FAULTS + KERNEL_FAULTS:
        assert finding in result.stderr
