"""The kernels' features as function constants compiled in (Shaders/flash_attention_features.h,
docs/specialisation.md): the source accepts the prelude that hosts without function constants put
before it (PyTorch's compile_shader), and a kernel compiled with a feature off holds none of its
code. Checked with clang's C++ for OpenCL compile of tools/check_address_spaces.py, the compiler
next to Apple's that this machine has."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_address_spaces.py"

_spec = importlib.util.spec_from_file_location("check_address_spaces", CHECK)
check_address_spaces = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_address_spaces)


def prelude(mask_type: int = 0, softcap: bool = False, alibi: bool = False, sinks: bool = False) -> str:
    """The text functionConstantPrelude (Specialization.swift) writes; SpecializationTests pins it."""
    def flag(on: bool) -> str:
        return "true" if on else "false"
    return ("#define FA_FUNCTION_CONSTANTS_PREDEFINED 1\n"
            f"constant uint fa_mask_type = {mask_type};\n"
            f"constant bool fa_has_softcap = {flag(softcap)};\n"
            f"constant bool fa_has_alibi = {flag(alibi)};\n"
            f"constant bool fa_has_sinks = {flag(sinks)};\n")


def specialised_source(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    """A copy of Shaders/ with specialised.metal: <metal_stdlib> (where Metal has `uint` and
    `constant` built in, this compile has them from its header), the prelude, the kernels."""
    shaders = tmp_path / "Shaders"
    shutil.copytree(ROOT / "Shaders", shaders)
    source = shaders / "specialised.metal"
    source.write_text('#include <metal_stdlib>\n' + text + '#include "flash_attention.metal"\n')
    return source


@pytest.fixture(scope="module")
def clang() -> str:
    found = check_address_spaces.find_clang(None)
    reason = "no clang" if found is None else check_address_spaces.usable(found)
    if reason is not None:
        pytest.skip(f"no clang that compiles C++ for OpenCL 2021: {reason}")
    return found


def optimised_ir(clang: str, source: pathlib.Path) -> str:
    command = check_address_spaces.clang_command(clang, source, "-O2", "-S", "-emit-llvm", "-o", "-")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_kernel_compiles_after_the_prelude(tmp_path):
    """The check emits every kernel the preprocessed source defines, or fails."""
    source = specialised_source(tmp_path, prelude(mask_type=1, softcap=True, alibi=True, sinks=True))
    result = subprocess.run([sys.executable, str(CHECK), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"specialised\.metal: [1-9]\d* kernels compiled", result.stdout), result.stdout


def test_a_feature_compiled_off_leaves_no_code(clang, tmp_path):
    """softcap's tanh and every read of a function constant fold away with the features off; with
    softcap on, its tanh is there (so the check can fail)."""
    off = optimised_ir(clang, specialised_source(tmp_path / "off", prelude()))
    assert "tanh" not in off
    assert not re.search(r"load [^\n]*@fa_(mask_type|has_\w+)", off), "a function constant is still read"
    on = optimised_ir(clang, specialised_source(tmp_path / "on", prelude(softcap=True)))
    assert re.search(r"call [^\n]*tanh", on)
