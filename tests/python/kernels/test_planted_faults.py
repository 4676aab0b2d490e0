"""Planted kernel faults that the accuracy tests must catch.

Each fault is one textual edit of a copy of Shaders/ (a regular expression and its replacement).
The copy is compiled into a shared object of the CPU engine's float16 kernels alone
(Sources/MSLEngine/flash_attention_kernels.cpp, the way the package compiles it: about 5 s of one
core), which the library loads in place of its built-in kernels through the test-only hook
MSL_ENGINE_KERNELS_OVERRIDE (Sources/MSLEngine/engine/msl_registry.cpp). A child pytest then runs
the test named as the fault's catcher against it, and it must fail by an assertion. The unedited
copy, built the same way, must pass every one of ``CATCHERS``: a failure is the fault's, not the
build's. A pattern that no longer matches the kernels (they are being restructured) fails
the check itself, naming the fault and the pattern.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from flash_attention_metal import _native

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "Sources" / "MSLEngine"
OVERRIDE_VARIABLE = "MSL_ENGINE_KERNELS_OVERRIDE"

# The accuracy tests each planted kernel runs (about 20 s in all on the CPU engine).
CATCHERS = [
    "tests/python/core/test_accuracy.py::test_forward_and_backward_within_rule",
    "tests/python/core/test_long_sequences.py::test_long_forward_of_few_rows_within_rule",
]

# Exported by the shared object: the hook's entry point, returning the edited kernels' table.
# The catchers run float16 alone, so every planted build compiles the engine's float16 translation
# unit only (flash_attention_kernels_f16.cpp) and serves its table.
ENTRY_SOURCE = """#include "msl_kernel_registry.hpp"
namespace msl_engine { const kernel_entry *flash_attention_kernels_f16(size_t *count); }
extern "C" __attribute__((visibility("default"))) const msl_engine::kernel_entry *
msl_engine_kernels_override(size_t *count) { return msl_engine::flash_attention_kernels_f16(count); }
"""


@dataclass(frozen=True)
class Fault:
    name: str
    file: str  # under Shaders/
    pattern: str  # a regular expression (re.S), matched `count` times
    replacement: str
    catcher: str  # the test id (under tests/python/) expected among the failures
    count: int = 1


ROUND_O_TO_HALF = (r"\1\n        for (uint d_ = 0; d_ < ND; ++d_) {\n"
                   r"            for (uint e_ = 0; e_ < 2; ++e_) {\n"
                   r"                r.o.f[d_].thread_elements()[e_] = float(half(r.o.f[d_].thread_elements()[e_]));\n"
                   r"            }\n        }")

FAULTS = [
    # The forward's O rounded to float16 after every key tile's P V.
    Fault("O accumulated in float16", "flash_attention_forward.h",
          r"(accumulate_product<T>\(r\.o,[^;]*\);)", ROUND_O_TO_HALF,
          "core/test_long_sequences.py::test_long_forward_of_few_rows_within_rule"),
    # O not multiplied by exp(m - m') on the second key tile (the running sum still is).
    Fault("rescale of O dropped on one tile", "flash_attention_forward.h",
          r"(r\.o\.f\[d\]\.thread_elements\(\)\[[01]\]\s*\*=\s*)correction;", r"\1(kv0 / BK == 1 ? 1.0f : correction);",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]", count=2),
    # The element mask of a tile that the causal edge (or window) crosses lets key end through
    # (the window test of the decode kernel and dK/dV; TileWindow is the forward's and dQ's).
    Fault("off-by-one on the causal edge tile", "flash_attention_scores.h",
          r"key < keys\.end\b", "key <= keys.end",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B2-H3-Hkv3-Nq7-Nk7-D8-causal]"),
    # The forward's key loop stops before a last tile that is not full.
    Fault("last key tile skipped", "flash_attention_forward.h",
          r"kv0 < key_end;(\s*kv0 \+= BK\)\s*\{\s*forward_tile<DP, BQ, BK[^>]*>\(r, tg,)", r"kv0 + BK <= key_end;\1",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]"),
    # dK/dV sum the group's first query head twice and never its last.
    Fault("dK/dV sum the wrong query head of a GQA group", "flash_attention_backward.h",
          r"(const uint h = kv_head \* group \+ )g;", r"\1(g + 1 < group ? g : 0);",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H4-Hkv2-Nq32-Nk32-D32-full]"),
    # dQ takes the lse of the next row (the last row its own).
    Fault("dQ reads the lse of the neighbouring row", "flash_attention_backward.h",
          r"(const float row_lse = row < p\.seqlen_q \? backward_row_lse\(lse\[at_row)\]\)",
          r"\1 + (row + 1 < p.seqlen_q ? 1 : 0)])",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]"),
]


class PatternMismatch(AssertionError):
    pass


def _substitute(pattern: str, replacement: str, source: str, count: int, flags: int, what: str, file: str) -> str:
    edited, found = re.subn(pattern, replacement, source, flags=flags)
    if found != count:
        raise PatternMismatch(f"{what}: the pattern {pattern!r} matches {found} times in {file}, not {count}: "
                              f"update the pattern to the restructured kernels")
    return edited


def plant(source: str, fault: Fault) -> str:
    """``source`` with the fault's edit; PatternMismatch naming the fault and its pattern when the
    pattern does not match exactly ``fault.count`` times."""
    return _substitute(fault.pattern, fault.replacement, source, fault.count, re.S, f"planted fault {fault.name!r}",
                       f"Shaders/{fault.file}")


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "clang++", "c++"):
        if name and shutil.which(name):
            return name
    pytest.fail("no C++ compiler (clang++ or c++, or $CXX) to build the planted kernels")


def build_kernels(folder: Path, fault: Fault | None) -> Path:
    """The CPU engine's float16 kernels compiled from a copy of Shaders/ with ``fault`` planted
    (None: as they are) into folder/kernels.so."""
    shutil.copytree(ROOT / "Shaders", folder / "Shaders")
    (folder / "Sources" / "MSLEngine").mkdir(parents=True)
    for file in ("flash_attention_kernels.hpp", "flash_attention_kernels_f16.cpp"):
        shutil.copy(ENGINE / file, folder / "Sources" / "MSLEngine")
    if fault is not None:
        target = folder / "Shaders" / fault.file
        target.write_text(plant(target.read_text(), fault))
    (folder / "entry.cpp").write_text(ENTRY_SOURCE)
    library = Path(_native.native().path).resolve()
    output = folder / "kernels.so"
    command = [_compiler(), "-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
               f"-I{ENGINE / 'include'}", f"-I{ENGINE / 'msl'}", f"-I{ENGINE / 'engine'}",
               str(folder / "Sources" / "MSLEngine" / "flash_attention_kernels_f16.cpp"), str(folder / "entry.cpp"),
               str(library), f"-Wl,-rpath,{library.parent}", "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"building {fault.name if fault else 'the unedited kernels'} failed:\n" \
        + result.stderr[-3000:]
    return output


def run_catchers(kernels: Path, tests: list[str] = CATCHERS) -> subprocess.CompletedProcess:
    """``tests`` (ids under the repository root) in a child pytest whose CPU engine runs ``kernels``."""
    env = dict(os.environ, **{OVERRIDE_VARIABLE: str(kernels), "FLASH_ATTENTION_METAL_BACKEND": "cpu"})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def failed_tests(run: subprocess.CompletedProcess) -> list[str]:
    """The ids of the child run's failed tests (its ``-rf`` summary)."""
    return re.findall(r"^FAILED tests/python/(\S+)", run.stdout, flags=re.M)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{fault name or None: kernels.so}, built two at a time."""
    cases = [None] + FAULTS
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {None if c is None else c.name: pool.submit(
            build_kernels, tmp_path_factory.mktemp("kernels"), c) for c in cases}
        return {name: future.result() for name, future in futures.items()}


def test_every_pattern_matches_the_kernels():
    for fault in FAULTS:
        plant((ROOT / "Shaders" / fault.file).read_text(), fault)


def test_a_pattern_that_no_longer_matches_fails_naming_it():
    fault = FAULTS[0]
    with pytest.raises(PatternMismatch, match=re.escape(repr(fault.pattern))):
        plant("kernel void restructured() {}", fault)


def test_the_unedited_kernels_built_so_pass(builds):
    run = run_catchers(builds[None])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_planted_fault_is_caught(builds, fault):
    # The catcher alone (the others' verdicts on this fault are asserted nowhere); it is one of the
    # CATCHERS, so the unedited build passes it.
    catcher = f"tests/python/{fault.catcher}"
    assert any(catcher.startswith(test) for test in CATCHERS), f"{fault.catcher} is not among CATCHERS"
    run = run_catchers(builds[fault.name], [catcher])
    failed = failed_tests(run)
    assert run.returncode == 1 and failed, f"{fault.name}: not caught\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    assert "AssertionError" in run.stdout, f"{fault.name}: the tests failed by something else\n{run.stdout[-3000:]}"
    assert any(test.startswith(fault.catcher) for test in failed), \
        f"{fault.name}: caught by {failed}, not by {fault.catcher}"
