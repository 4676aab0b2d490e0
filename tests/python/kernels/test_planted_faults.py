"""Planted kernel faults that the accuracy tests must catch.

Each fault is one textual edit of a copy of Shaders/ (a regular expression and its replacement).
The copy is compiled into a shared object of the CPU engine's float16 kernels of the head_dim
bucket the catcher runs (the engine's float16 translation unit, flash_attention_kernels_f16.cpp,
cut into one translation unit per part, the per-dtype kernels and each bucket's, with the
package's flags: 7 to 11 s of one core per bucket), which the library loads in place of its
built-in kernels through the test-only hook MSL_ENGINE_KERNELS_OVERRIDE
(Sources/MSLEngine/engine/msl_registry.cpp). A child pytest then runs the test named as the
fault's catcher against it, and it must fail by an assertion. The unedited copy, built the same
way with the buckets of every fault's catcher, must pass every fault's catcher: a failure is the
fault's, not the build's. A pattern that no longer matches the kernels (they are being
restructured) fails the check itself, naming the fault and the pattern.
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

# The accuracy tests the faults' catchers are cases of.
CATCHERS = [
    "tests/python/core/test_accuracy.py::test_forward_and_backward_within_rule",
    "tests/python/core/test_long_sequences.py::test_long_forward_of_few_rows_within_rule",
]

# A build has only the head_dim buckets (FA_HEAD_DIM_BUCKETS, Shaders/flash_attention_params.h) its
# catchers run (Fault.bucket; the unedited build every fault's): every bucket is one instance of the
# same templates, and compiling all eight for each of the seven builds took 4 minutes of CPU. Every
# build also loads the bucket of FA_MAX_HEAD_DIM, whose forward kernel the CPU backend looks up to
# tell that the engine has its kernels (CPUBackend.swift): unedited, compiled once into a shared
# object of its own that every build links (its hidden symbols cannot mix with a build's edited
# ones), since no catcher runs it.
MAX_HEAD_DIM = int(re.search(r"^#define FA_MAX_HEAD_DIM (\d+)$",
                             (ROOT / "Shaders" / "flash_attention_params.h").read_text(), re.M).group(1))

# What the engine says when a dispatch names a kernel the table lacks (msl_dispatch.cpp).
MISSING_KERNEL = "no kernel of that name is registered"

# The table of a part (the per-dtype kernels, or one bucket's) is flash_attention_kernels_part_<name>,
# exported: the shared object of FA_MAX_HEAD_DIM's bucket serves its table to the builds that link it.
def part_table(part: str) -> str:
    return f"flash_attention_kernels_part_{part}"


def part_source(part: str) -> str:
    """A translation unit of flash_attention_kernels_f16.cpp: the per-dtype float16 kernels
    (``part`` "dtype") or those of one bucket (``part`` "d<bucket>"), and their table."""
    define, entries = (("FA_DEFINE_DTYPE_KERNELS(half, f16)", "FA_ENGINE_DTYPE_ENTRIES(half, f16)") if part == "dtype"
                       else (f"FA_DEFINE_F16({part[1:]})", f"FA_ENGINE_F16_ENTRIES({part[1:]})"))
    return ('#include "flash_attention_kernels.hpp"\n\n'
            f"namespace msl_engine {{ __attribute__((visibility(\"default\"))) const kernel_entry *{part_table(part)}"
            "(size_t *count); }\n\n"
            f"FA_ENGINE_TARGET_BEGIN\n{define}\nFA_ENGINE_TARGET_END\n\nFA_ENGINE_TABLE(part_{part}, {entries})\n")


def entry_source(parts: list[str]) -> str:
    """The hook's entry point (exported): the tables of ``parts`` (and FA_MAX_HEAD_DIM's) joined."""
    parts = [*parts, f"d{MAX_HEAD_DIM}"]
    declarations = "".join(f'__attribute__((visibility("default"))) const kernel_entry *{part_table(part)}'
                           "(size_t *count);\n" for part in parts)
    return ('#include "msl_kernel_registry.hpp"\n#include <vector>\n\n'
            f"namespace msl_engine {{\n{declarations}}}\n\n"
            'extern "C" __attribute__((visibility("default"))) const msl_engine::kernel_entry *\n'
            "msl_engine_kernels_override(size_t *count) {\n"
            "    static const std::vector<msl_engine::kernel_entry> table = [] {\n"
            "        std::vector<msl_engine::kernel_entry> all;\n"
            f"        for (auto part : {{{', '.join(f'msl_engine::{part_table(part)}' for part in parts)}}}) {{\n"
            "            size_t n = 0;\n"
            "            const msl_engine::kernel_entry *entries = part(&n);\n"
            "            all.insert(all.end(), entries, entries + n);\n"
            "        }\n"
            "        return all;\n"
            "    }();\n"
            "    *count = table.size();\n"
            "    return table.data();\n"
            "}\n")


@dataclass(frozen=True)
class Fault:
    name: str
    file: str  # under Shaders/
    pattern: str  # a regular expression (re.S), matched `count` times
    replacement: str
    catcher: str  # the test id (under tests/python/) expected among the failures
    bucket: int  # the head_dim bucket the catcher runs (one of FA_HEAD_DIM_BUCKETS)
    count: int = 1


ROUND_O_TO_HALF = (r"\1\n        for (uint d_ = 0; d_ < ND; ++d_) {\n"
                   r"            for (uint e_ = 0; e_ < 2; ++e_) {\n"
                   r"                r.o.f[d_].thread_elements()[e_] = float(half(r.o.f[d_].thread_elements()[e_]));\n"
                   r"            }\n        }")

FAULTS = [
    # The forward's O rounded to float16 after every key tile's P V.
    Fault("O accumulated in float16", "flash_attention_forward.h",
          r"(accumulate_product<T>\(r\.o,[^;]*\);)", ROUND_O_TO_HALF,
          "core/test_long_sequences.py::test_long_forward_of_few_rows_within_rule", 64),
    # O not multiplied by exp(m - m') on the second key tile (the running sum still is).
    Fault("rescale of O dropped on one tile", "flash_attention_forward.h",
          r"(r\.o\.f\[d\]\.thread_elements\(\)\[[01]\]\s*\*=\s*)correction;", r"\1(kv0 / BK == 1 ? 1.0f : correction);",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]", 128,
          count=2),
    # The element mask of a tile that the causal edge (or window) crosses lets key end through
    # (the window test of the decode kernel and dK/dV; TileWindow is the forward's and dQ's).
    Fault("off-by-one on the causal edge tile", "flash_attention_scores.h",
          r"key < keys\.end\b", "key <= keys.end",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B2-H3-Hkv3-Nq7-Nk7-D8-causal]", 32),
    # The forward's key loop stops before a last tile that is not full.
    Fault("last key tile skipped", "flash_attention_forward.h",
          r"kv0 < key_end;(\s*kv0 \+= BK\)\s*\{\s*forward_tile<DP, BQ, BK[^>]*>\(r, tg,)", r"kv0 + BK <= key_end;\1",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]", 128),
    # dK/dV sum the group's first query head twice and never its last.
    Fault("dK/dV sum the wrong query head of a GQA group", "flash_attention_backward.h",
          r"(const uint h = kv_head \* group \+ )g;", r"\1(g + 1 < group ? g : 0);",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H4-Hkv2-Nq32-Nk32-D32-full]", 32),
    # dQ takes the lse of the next row (the last row its own).
    Fault("dQ reads the lse of the neighbouring row", "flash_attention_backward.h",
          r"(const float row_lse = row < p\.seqlen_q \? backward_row_lse\(lse\[at_row)\]\)",
          r"\1 + (row + 1 < p.seqlen_q ? 1 : 0)])",
          "core/test_accuracy.py::test_forward_and_backward_within_rule[B1-H2-Hkv2-Nq257-Nk257-D128-full]", 128),
]


# What the unedited build has and must pass: every fault's bucket and catcher.
UNEDITED_BUCKETS = sorted({fault.bucket for fault in FAULTS})
UNEDITED_CATCHERS = sorted({f"tests/python/{fault.catcher}" for fault in FAULTS})


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


def _compile(arguments: list[str], what: str) -> None:
    """The package's flags (the engine's headers, C++17, -O2, hidden symbols) and ``arguments``."""
    result = subprocess.run([_compiler(), "-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden",
                             f"-I{ENGINE / 'include'}", f"-I{ENGINE / 'msl'}", f"-I{ENGINE / 'engine'}", *arguments],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"building {what} failed:\n" + result.stderr[-3000:]


def _link(arguments: list[str], what: str) -> None:
    """A shared object of ``arguments`` linked to the library (the engine's run time)."""
    library = Path(_native.native().path).resolve()
    _compile(["-shared", *arguments, str(library), f"-Wl,-rpath,{library.parent}"], what)


def build_parts(folder: Path, fault: Fault | None, parts: list[str]) -> Path:
    """A copy of Shaders/ with ``fault`` planted (None: unedited) and beside it, in the engine's
    folder of the copy (returned), one translation unit per part of ``parts`` (part_source)."""
    shutil.copytree(ROOT / "Shaders", folder / "Shaders")
    engine = folder / "Sources" / "MSLEngine"  # the header includes ../../Shaders/
    engine.mkdir(parents=True)
    shutil.copy(ENGINE / "flash_attention_kernels.hpp", engine)
    if fault is not None:
        target = folder / "Shaders" / fault.file
        target.write_text(plant(target.read_text(), fault))
    for part in parts:
        (engine / f"part_{part}.cpp").write_text(part_source(part))
    return engine


def compile_part(engine: Path, part: str, what: str) -> Path:
    """The object of one part of a build's copy (build_parts)."""
    output = engine / f"part_{part}.o"
    _compile(["-c", str(engine / f"part_{part}.cpp"), "-o", str(output)], f"{what} ({part})")
    return output


def build_kernels(folder: Path, objects: list[Path], max_bucket: Path, what: str) -> Path:
    """folder/kernels.so: the hook's entry point over the tables of ``objects`` and of
    ``max_bucket`` (FA_MAX_HEAD_DIM's shared object, linked)."""
    parts = [object_.stem.removeprefix("part_") for object_ in objects]
    entry = folder / "entry.cpp"
    entry.write_text(entry_source(parts))
    output = folder / "kernels.so"
    _link([str(entry), *map(str, objects), str(max_bucket), f"-Wl,-rpath,{max_bucket.parent}", "-o", str(output)],
          what)
    return output


def run_catchers(kernels: Path, tests: list[str]) -> subprocess.CompletedProcess:
    """``tests`` (ids under the repository root) in a child pytest whose CPU engine runs ``kernels``."""
    env = dict(os.environ, **{OVERRIDE_VARIABLE: str(kernels), "FLASH_ATTENTION_METAL_BACKEND": "cpu"})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def failed_tests(run: subprocess.CompletedProcess) -> list[str]:
    """The ids of the child run's failed tests (its ``-rf`` summary)."""
    return re.findall(r"^FAILED tests/python/(\S+)", run.stdout, flags=re.M)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{fault name or None: kernels.so}: every part of every build compiled two at a time (the
    unedited copy's dtype part, its buckets and FA_MAX_HEAD_DIM's; each fault's dtype part and
    bucket), then each build linked."""
    cases = {None: (None, ["dtype", *(f"d{bucket}" for bucket in UNEDITED_BUCKETS if bucket != MAX_HEAD_DIM)])}
    cases.update({fault.name: (fault, ["dtype", f"d{fault.bucket}"]) for fault in FAULTS})
    folders = {name: tmp_path_factory.mktemp("kernels") for name in cases}
    engines = {name: build_parts(folders[name], fault, parts) for name, (fault, parts) in cases.items()}
    (engines[None] / "part_max.cpp").write_text(part_source(f"d{MAX_HEAD_DIM}"))
    jobs = [(name, part) for name, (_, parts) in cases.items() for part in parts] + [(None, "max")]
    jobs.sort(key=lambda job: job[1] == "dtype")  # the buckets (7 to 11 s each) first, the dtype parts (1 s) last
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        objects = {job: pool.submit(compile_part, engines[job[0]], job[1], job[0] or "the unedited kernels")
                   for job in jobs}
        objects = {job: future.result() for job, future in objects.items()}
    max_object = objects.pop((None, "max"))
    max_bucket = folders[None] / f"kernels_d{MAX_HEAD_DIM}.so"
    _link([str(max_object), "-o", str(max_bucket)], f"the bucket of FA_MAX_HEAD_DIM ({MAX_HEAD_DIM})")
    return {name: build_kernels(folders[name], [objects[name, part] for part in parts], max_bucket,
                                name or "the unedited kernels")
            for name, (_, parts) in cases.items()}


def test_every_pattern_matches_the_kernels():
    for fault in FAULTS:
        plant((ROOT / "Shaders" / fault.file).read_text(), fault)


def test_a_pattern_that_no_longer_matches_fails_naming_it():
    fault = FAULTS[0]
    with pytest.raises(PatternMismatch, match=re.escape(repr(fault.pattern))):
        plant("kernel void restructured() {}", fault)


def test_the_unedited_kernels_built_so_pass(builds):
    run = run_catchers(builds[None], UNEDITED_CATCHERS)
    assert MISSING_KERNEL not in run.stdout, f"a catcher runs a bucket outside its fault's\n{run.stdout[-3000:]}"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_planted_fault_is_caught(builds, fault):
    # The catcher alone (the others' verdicts on this fault are asserted nowhere); the unedited build
    # passes it (UNEDITED_CATCHERS).
    catcher = f"tests/python/{fault.catcher}"
    assert any(catcher.startswith(test) for test in CATCHERS), f"{fault.catcher} is not among CATCHERS"
    run = run_catchers(builds[fault.name], [catcher])
    failed = failed_tests(run)
    assert MISSING_KERNEL not in run.stdout, f"{fault.name}: its catcher runs a bucket other than {fault.bucket}\n" \
        + run.stdout[-3000:]
    assert run.returncode == 1 and failed, f"{fault.name}: not caught\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    assert "AssertionError" in run.stdout, f"{fault.name}: the tests failed by something else\n{run.stdout[-3000:]}"
    assert any(test.startswith(fault.catcher) for test in failed), \
        f"{fault.name}: caught by {failed}, not by {fault.catcher}"
