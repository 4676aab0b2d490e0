"""``flash_attention_metal.plan``: the exported dispatch plan read into Python, as a framework that
encodes the kernels itself uses it (the PyTorch MPS path does): the invariants an encoder relies on,
for every kind of plan, the function constants and the prelude that stands for them; the errors;
the kernel source; the .metallib found next to the library.

Cost: about 4 s of ./build.sh test's pytest (measured on 2 shared cores).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _native, plan
from flash_attention_metal._validation import Shape
from test_specialisation import prelude

_ROOT = Path(__file__).resolve().parents[3]


def _problem(shape: Shape, causal=True, dtype="float16", **options):
    library = _native.native()
    p = _abi.new_problem(library.ffi, library.lib, shape, causal, 0.125, dtype, {})
    _abi.set_score_fields(p, library.ffi, library.lib, **options)
    return p


PROBLEMS = {
    "dense forward": ("forward", Shape(2, 6, 3, 37, 29, 40), {}),
    "split-KV forward (decode)": ("forward", Shape(1, 8, 2, 1, 3000, 64), {}),
    "split-KV forward (tiled, 16 rows)": ("forward", Shape(1, 2, 1, 16, 3000, 64), {}),
    "backward, mask, ALiBi and sinks": ("backward", Shape(2, 4, 2, 33, 45, 128),
                                        dict(mask=(1, (0, 0, 45), "FA_ATTN_MASK_BOOL"), alibi=(1, False), sinks=1)),
}


@pytest.mark.parametrize("name", PROBLEMS)
def test_plan_invariants(name):
    pass_name, shape, options = PROBLEMS[name]
    made = plan.create(_problem(shape, **options), pass_name)
    assert made.pass_name == pass_name and made.piece_count == 1
    sizes = {b.role: b.byte_count for b in made.buffers}
    assert len(sizes) == len(made.buffers), "a role listed twice"
    for dispatch in made.dispatches:
        indices = sorted([b.index for b in dispatch.bindings] + [dispatch.params_index])
        assert indices == list(range(len(dispatch.bindings) + 1)), dispatch.kernel_name
        assert len(dispatch.params) % 8 == 0
        values = {s.name: s.value for s in dispatch.specialization}
        assert dispatch.constants_prelude == prelude(values.get("fa_mask_type", 0), values.get("fa_has_softcap", 0),
                                                     values.get("fa_has_alibi", 0), values.get("fa_has_sinks", 0),
                                                     values.get("fa_has_dropout", 0))
        assert plan.specialized_source(dispatch) == dispatch.constants_prelude + plan.kernel_source()
        for binding in dispatch.bindings:
            assert binding.byte_offset + binding.byte_length <= sizes[binding.role]
        assert dispatch.threads_per_grid == tuple(g * t for g, t in zip(dispatch.threadgroups_per_grid,
                                                                         dispatch.threads_per_threadgroup))
    usage = {b.role: b.usage for b in made.buffers}
    if pass_name == "forward":
        assert usage["out"] == usage["lse"] == "output" and usage["q"] == "input"
    else:
        assert usage["dsinks"] == "output" and usage["delta"] == "workspace" and usage["attn_mask"] == "input"
        assert made.dispatches[-1].kernel_name == "flash_attention_backward_dsinks"
        dq = next(d for d in made.dispatches if d.kernel_name.startswith("flash_attention_backward_dq_"))
        expected = {"fa_mask_type": 1, "fa_has_softcap": 0, "fa_has_alibi": 1, "fa_has_dropout": 0}
        assert {s.name: s.value for s in dq.specialization} == expected
        assert any(s.name == "fa_has_sinks" and s.value == 1 for d in made.dispatches for s in d.specialization)
        assert made.buffer("attn_mask").byte_count == 33 * 45 and made.buffer("sinks").byte_count == 4 * 4
    if "split" in name:
        assert {usage["partial_out"], usage["partial_lse"]} == {"workspace"}
        kernel = "split" if "tiled" in name else "decode"
        assert [d.kernel_name for d in made.dispatches] == [f"flash_attention_forward_{kernel}_f16_d64",
                                                            "flash_attention_forward_combine_f16"]


def test_kv_cache_buffers_are_read_write():
    # A paged cache (presence of the table only: fa_plan_create never reads it): k and v are bound
    # in place, read and written (appends), never outputs or inputs.
    p = _problem(Shape(1, 4, 2, 3, 40, 64))
    p.kv_cache_rows, p.kv_max_blocks, p.kv_num_blocks = 16, 3, 3
    p.kv_block_table = _native.native().ffi.cast("const int32_t *", 4)
    usage = {b.role: b.usage for b in plan.create(p, "forward").buffers}
    assert usage["k"] == usage["v"] == "read_write" and usage["q"] == "input" and usage["block_table"] == "input"
    assert usage["out"] == usage["lse"] == "output"


def test_varlen_plans_bind_the_sequence_table():
    # 3 sequences packed (presence of the tables only): the pass starts with the sequence-table
    # dispatch, whose parameters are bytes; every later dispatch reads its sequence's struct from
    # the table, bound at its params index (params_from_buffer), and a host binds the cu_seqlens
    # tables as inputs.
    library = _native.native()
    for pass_name in ("forward", "backward"):
        p = _problem(Shape(3, 4, 2, 30, 41, 64))
        p.cu_seqlens_q = p.cu_seqlens_k = library.ffi.cast("const int32_t *", 4)
        p.max_seqlen_q, p.max_seqlen_k = 17, 20
        made = plan.create(p, pass_name)
        usage = {b.role: b.usage for b in made.buffers}
        assert usage["cu_seqlens_q"] == usage["cu_seqlens_k"] == "input"
        assert usage["sequence_table"] == "workspace"
        assert made.buffer("cu_seqlens_q").byte_count == 4 * 4
        first, *rest = made.dispatches
        assert first.kernel_name == "flash_attention_varlen_sequences" and not first.params_from_buffer
        assert rest and all(d.params_from_buffer for d in rest)
        for d in rest:
            at_params = [b for b in d.bindings if b.index == d.params_index]
            assert [b.role for b in at_params] == ["sequence_table"], d.kernel_name
            assert sorted(b.index for b in d.bindings) == list(range(len(d.bindings))), d.kernel_name
        assert rest[0].threadgroups_per_grid[2] == 3  # one z per sequence


def test_pieces():
    # One unit (batch entry, KV head with its 2 query heads): 10 FLOP x 2 x 37 x 29 x 64 (bucket).
    made = plan.create(_problem(Shape(2, 6, 3, 37, 29, 40)), "backward", max_flops_per_piece=10 * 2 * 37 * 29 * 64)
    assert made.piece_count == 6
    assert [d.piece for d in made.dispatches] == [n for n in range(6) for _ in range(4)]
    assert {b.byte_offset for d in made.dispatches[-4:] for b in d.bindings} != {0}
    # Below one unit, each kernel of a unit over ranges of its blocks, one block each here: delta 1
    # block of 128 rows, the lse residual and dQ 2 query blocks of 32, dK/dV 1 key block of 32.
    blocks = plan.create(_problem(Shape(2, 6, 3, 37, 29, 40)), "backward", max_flops_per_piece=1)
    assert blocks.piece_count == 6 * 6
    assert [d.piece for d in blocks.dispatches] == list(range(36))
    assert {d.threadgroups_per_grid[0] for d in blocks.dispatches} == {1}
    assert [d.kernel_name.split("_")[3] for d in blocks.dispatches[:6]] == ["delta", "lse", "lse", "dq", "dq", "dkv"]


def test_errors():
    with pytest.raises(fam.FlashAttentionError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        plan.create(_problem(Shape(1, 6, 4, 8, 8, 32)), "forward")
    with pytest.raises(ValueError, match="pass_name must be one of 'forward', 'backward'"):
        plan.create(_problem(Shape(1, 4, 4, 8, 8, 32)), "merge")
    with pytest.raises(KeyError, match="no dq buffer"):
        plan.create(_problem(Shape(1, 4, 4, 8, 8, 32)), "forward").buffer("dq")


def test_kernel_source_is_self_contained():
    """The .metal file with its headers spliced in: no quoted include is left, the parameter struct
    is defined in it."""
    source = plan.kernel_source()
    first_line = (_ROOT / "Shaders" / "flash_attention.metal").read_text(encoding="utf-8").split("\n")[0]
    assert source.split("\n")[0] == first_line
    assert '#include "' not in source and "} FlashAttentionParams;" in source


_PROBE = "from flash_attention_metal import plan; print(plan.metallib_path())"


def test_metallib_path_is_found_next_to_the_library(tmp_path):
    """fa_plan_metallib_path looks next to the file the library was loaded from."""
    library = tmp_path / _native.library_file_name()
    shutil.copy(_native.native().path, library)
    # The first 16 hex digits of the SHA-256 of the spliced source (Sources/EmbedShaders), whose last
    # newline the Swift string literal that embeds it drops.
    source_hash = hashlib.sha256((plan.kernel_source() + "\n").encode("utf-8")).hexdigest()[:16]
    env = dict(os.environ, **{fam.LIBRARY_ENV: str(library)})

    def probe() -> str:
        result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert probe() == "None"
    # One per MSL version; the newest the OS runs wins (on Linux every version counts as available),
    # but never 3.0 where the OS runs 3.1: it has no bfloat16 kernels (the source compile has them).
    (tmp_path / f"flash_attention-{source_hash}-msl3.0.metallib").write_bytes(b"")
    assert probe() == "None"
    with_bfloat = tmp_path / f"flash_attention-{source_hash}-msl3.1.metallib"
    with_bfloat.write_bytes(b"")
    assert probe() == str(with_bfloat)
    newest = tmp_path / f"flash_attention-{source_hash}-msl3.2.metallib"
    newest.write_bytes(b"")
    assert probe() == str(newest)
    # PyTorch's every-feature-off specialisation sits beside them.
    features_off = "from flash_attention_metal import plan; print(plan.features_off_metallib_path())"
    run = lambda: subprocess.run([sys.executable, "-c", features_off], capture_output=True, text=True, env=env,
                                 timeout=120).stdout.strip()
    assert run() == "None"
    (tmp_path / f"flash_attention-{source_hash}-features-off.metallib").write_bytes(b"")
    assert run() == str(tmp_path / f"flash_attention-{source_hash}-features-off.metallib")
