"""The kernels' features as function constants (Shaders/flash_attention_features.h,
docs/specialisation.md): every kernel references exactly the constants the plan gives its
dispatches (Metal refuses a pipeline whose kernel references one without a value, whether or not it
runs that code); the source accepts the prelude that hosts without function constants put before it
(PyTorch's compile_shader); and a kernel compiled with a feature off holds none of its code.
Checked in clang's LLVM IR of the C++ for OpenCL compile of tests/static/check_address_spaces.py."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import quantized

from conftest import make_inputs

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHECK = ROOT / "tests" / "static" / "check_address_spaces.py"

_spec = importlib.util.spec_from_file_location("check_address_spaces", CHECK)
check_address_spaces = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_address_spaces)


def prelude(mask_type: int = 0, softcap: bool = False, alibi: bool = False, sinks: bool = False,
            dropout: bool = False) -> str:
    """The text functionConstantPrelude (Specialization.swift) writes; SpecializationTests pins it."""
    def flag(on: bool) -> str:
        return "true" if on else "false"
    return ("#define FA_FUNCTION_CONSTANTS_PREDEFINED 1\n"
            f"constant uint fa_mask_type = {mask_type};\n"
            f"constant bool fa_has_softcap = {flag(softcap)};\n"
            f"constant bool fa_has_alibi = {flag(alibi)};\n"
            f"constant bool fa_has_sinks = {flag(sinks)};\n"
            f"constant bool fa_has_dropout = {flag(dropout)};\n")


# The float16 kernels of one head_dim bucket: enough to show that a check can fail.
ONE_BUCKET = '#include <metal_stdlib>\nusing namespace metal;\n#include "flash_attention_kernels.h"\n' \
    "FA_DEFINE_BUCKET_KERNELS(half, f16, 64)\n"


def specialised_source(tmp_path: pathlib.Path, text: str, kernels: str = '#include "flash_attention.metal"\n') \
        -> pathlib.Path:
    """A copy of Shaders/ with specialised.metal: <metal_stdlib> (where Metal has `uint` and
    `constant` built in, this compile has them from its header), the prelude, the kernels (every
    one of flash_attention.metal unless ``kernels`` says which)."""
    shaders = tmp_path / "Shaders"
    shutil.copytree(ROOT / "Shaders", shaders)
    source = shaders / "specialised.metal"
    source.write_text('#include <metal_stdlib>\n' + text + kernels)
    return source


@pytest.fixture(scope="module")
def clang() -> str:
    found = check_address_spaces.find_clang(None)
    reason = "no clang" if found is None else check_address_spaces.usable(found)
    if reason is not None:
        pytest.skip(f"no clang that compiles C++ for OpenCL 2021: {reason}")
    return found


def ir(clang: str, source: pathlib.Path, *flags: str) -> str:
    # Through the IR cache: the every-kernel compile at -O0 is the address-space check's at MSL 4.1.
    result = check_address_spaces.emit_ir(clang, source, *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


def optimised_ir(clang: str, source: pathlib.Path) -> str:
    """-O1: constant propagation and dead-code elimination fold a feature that is off as they do at
    -O2 (a feature that -O1 leaves code of would fail here, never pass), at two thirds of the CPU time
    of the every-kernel compile (38 s against 58 s)."""
    return ir(clang, source, "-O1")


FUNCTION = re.compile(r"^define [^@]*@\"?([\w.$]+)\"?\(.*?^}", re.MULTILINE | re.DOTALL)
CONSTANT = re.compile(r"@(fa_mask_type|fa_has_softcap|fa_has_alibi|fa_has_sinks|fa_has_dropout)\b")
CALL = re.compile(r"\bcall [^@\n]*@\"?([\w.$]+)\"?\(")
SUFFIX = re.compile(r"_(f16|bf16|f32)(_d\d+)?$")


def referenced_constants(module: str) -> dict[str, set[str]]:
    """For each kernel of the IR, the function constants it or any function it calls references."""
    bodies = {match.group(1): match.group(0) for match in FUNCTION.finditer(module)}
    direct = {name: set(CONSTANT.findall(body)) for name, body in bodies.items()}
    calls = {name: set(CALL.findall(body)) & bodies.keys() for name, body in bodies.items()}
    closure = {}
    for kernel, body in bodies.items():
        if "spir_kernel" not in body.split("\n", 1)[0]:
            continue
        seen, todo = set(), [kernel]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(calls[name])
        closure[kernel] = set().union(*(direct[name] for name in seen))
    return closure


def planned_constants(ctx) -> dict[str, set[str]]:
    """Per kernel family (a name without dtype and bucket), the constants the plan gives it: read
    from the profiles of a forward, a backward with every feature, a decode forward, a merge and a
    variable-length forward."""
    rng = np.random.default_rng(5)
    planned = {}

    def record():
        for d in ctx.last_profile.dispatches:
            planned.setdefault(SUFFIX.sub("", d.kernel), set()).update(d.specialization)

    q, k, v, dout = make_inputs(50, 1, 2, 1, 24, 40, 16)
    options = dict(softcap=20.0, alibi_slopes=np.array([0.5, 0.25], np.float32),
                   sinks=np.array([0.0, 1.0], np.float32), attn_mask=rng.random((1, 1, 24, 40)) > 0.3)
    out, lse = ctx.forward(q, k, v, **options)
    record()
    ctx.backward(dout, q, k, v, out, lse, **options)
    record()
    # The GQA backward above cuts its group of 2 over threadgroups (the split dK/dV and its
    # reduction: GroupSplit.swift); one KV head per query head runs the unsplit dK/dV.
    q, k, v, dout = make_inputs(53, 1, 2, 2, 24, 40, 16)
    out, lse = ctx.forward(q, k, v, **options)
    ctx.backward(dout, q, k, v, out, lse, **options)
    record()
    q, k, v, _ = make_inputs(51, 1, 2, 1, 1, 600, 16)
    ctx.forward(q, k, v)
    record()
    # 16 rows over a long cache: the tiled split kernel (2 dense threadgroups leave cores idle).
    q, k, v, _ = make_inputs(52, 1, 2, 1, 16, 600, 16)
    ctx.forward(q, k, v)
    record()
    # 8 rows x 2 heads: 16 packed rows, the spec kernel.
    q, k, v, _ = make_inputs(53, 1, 2, 1, 8, 600, 16)
    ctx.forward(q, k, v)
    record()
    ctx.merge_attention(out, lse, out, lse)
    record()
    # A variable-length forward: its first dispatch writes the sequence table (no constants).
    packed = rng.standard_normal((3, 2, 16)).astype(np.float16)
    table = np.array([0, 1, 3], np.int32)
    ctx.forward_varlen(packed, packed, packed, table, table, 2, 2)
    record()
    # A KV cache (bshd), prefill chunk, speculative and decode steps: the cache-reading dense,
    # tiled split, spec and decode kernels.
    cache = rng.standard_normal((1, 600, 1, 16)).astype(np.float16)
    for rows in (80, 16, 8, 1):
        query = rng.standard_normal((1, rows, 2, 16)).astype(np.float16)
        fam.flash_attn_with_kvcache(query, cache, cache, cache_seqlens=600, context=ctx)
        record()
    # A decode step over an 8-bit cache of head_dim 32: the MMA decode.
    packed_cache = quantized.quantize(rng.standard_normal((1, 600, 1, 32)).astype(np.float16), 32, 8)
    query = rng.standard_normal((1, 1, 2, 32)).astype(np.float16)
    fam.flash_attn_with_kvcache(query, packed_cache, packed_cache, cache_seqlens=600, bits=8, group_size=32,
                                context=ctx)
    record()
    return planned


def test_each_kernel_references_exactly_the_constants_its_dispatches_get(clang, ctx):
    planned = planned_constants(ctx)
    assert {"flash_attention_forward_split", "flash_attention_forward_decode", "flash_attention_forward_combine", "flash_attention_backward_dsinks",
            "flash_attention_merge"} <= planned.keys(), sorted(planned)
    referenced = referenced_constants(ir(clang, ROOT / "Shaders" / "flash_attention.metal"))
    families = {SUFFIX.sub("", kernel) for kernel in referenced}
    assert families == planned.keys(), "every kernel family is planned and exists"
    for kernel, constants in sorted(referenced.items()):
        assert constants == planned[SUFFIX.sub("", kernel)], kernel


def test_metal_dispatches_get_the_constants_the_cpu_ones_get(ctx):
    """On Context("metal") (the stand-in's run of tests/python/kernels/test_metal_standin.py, or a
    Mac): every kernel family gets the constants the CPU backend gives it, which the test above
    holds against the kernels' IR. The stand-in's run leaves that test to the CPU run: its IR is
    the same, and a 40 s compile."""
    if ctx.backend != "metal":
        pytest.skip("the CPU backend's dispatches are held against the IR above")
    assert planned_constants(ctx) == planned_constants(fam.Context("cpu"))


def test_every_kernel_compiles_after_the_prelude(tmp_path):
    """The check emits every kernel the preprocessed source defines, or fails."""
    source = specialised_source(tmp_path, prelude(mask_type=1, softcap=True, alibi=True, sinks=True))
    # The prelude's one user, PyTorch's compile_shader, compiles at MSL 3.1 and later (docs/pytorch.md).
    result = subprocess.run([sys.executable, str(CHECK), "--min-msl", "3.1", str(source)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"specialised\.metal \(MSL [\d.]+\): [1-9]\d* kernels compiled", result.stdout), result.stdout


def test_a_feature_compiled_off_leaves_no_code(clang, tmp_path):
    """softcap's tanh and every read of a function constant fold away with the features off in
    every kernel; with softcap on, its tanh is there (so the check can fail: shown on one bucket's
    kernels, a tenth of the compile)."""
    off = optimised_ir(clang, specialised_source(tmp_path / "off", prelude()))
    assert "tanh" not in off
    assert not re.search(r"load [^\n]*@fa_(mask_type|has_\w+)", off), "a function constant is still read"
    on = optimised_ir(clang, specialised_source(tmp_path / "on", prelude(softcap=True), ONE_BUCKET))
    assert re.search(r"call [^\n]*tanh", on)
