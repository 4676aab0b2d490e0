"""The Metal 4 tensor-op forward (issue 37, docs/tensor-ops.md) on the CPU engine's matmul2d emulation:
FLASH_ATTENTION_TENSOR_OPS=1 forces it; every head dim it serves (64, 96, 128, 256), both dtypes and
every option against the float64 reference under the rule's tensor-op term (accuracy.py:
TENSOR_OPS_FACTOR), each run under the M5 fragment layout and under the permuted one
(FLASH_ATTENTION_TENSOR_LAYOUT); a real model's inputs; the routing (forced, forbidden, unset, bad
values, problems it does not serve); and a planted M5-layout assumption that the permuted run catches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _native, accuracy, dropout, plan
from flash_attention_metal._validation import Shape

from conftest import assert_within_rule, make_inputs

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "Sources" / "MSLEngine"
LAYOUTS = ["m5", "permuted"]
HEADS = 4

# (dtype, head_dim, kv_heads, seqlen_q, seqlen_k, options): every served bucket in both dtypes
# (head_dim 80 and 112 pad inside the 96 and 128 buckets), each option at least twice. More than
# FA_SPLIT_TILED_MAX_QUERY_ROWS (64) query rows, so that the dense forward serves them (split-KV
# stays with its own kernels): two threadgroups of 64 rows, partly filled SIMD-groups; key counts
# that are not multiples of 32.
CASES = [
    ("float16", 64, 2, 70, 45, dict(causal=True)),
    ("bfloat16", 64, 1, 65, 70, dict(window_size=(11, 6), sinks="sinks")),
    ("float16", 80, 4, 77, 53, dict(softcap=1.5, alibi_slopes="per head")),
    ("bfloat16", 96, 2, 70, 37, dict(attn_mask="bool", causal=True)),
    ("float16", 128, 4, 66, 66, dict(attn_mask="additive", sinks="sinks")),
    ("bfloat16", 112, 2, 80, 40, dict(alibi_slopes="per batch", window_size=(-1, 4))),
    ("float16", 256, 1, 69, 35, dict(softcap=30.0, causal=True)),
    ("bfloat16", 256, 2, 72, 24, dict(attn_mask="additive", window_size=(7, -1))),
]
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _label(case) -> str:
    dtype, head_dim, kv_heads, seqlen_q, seqlen_k, options = case
    return f"{dtype}-d{head_dim}-kv{kv_heads}-{seqlen_q}x{seqlen_k}-" + "-".join(options)


def _options(options: dict, rng, batch: int, seqlen_q: int, seqlen_k: int, dtype) -> dict:
    """The library's (and the reference's) keyword arguments of a case's option names."""
    made = dict(options)
    if options.get("sinks") == "sinks":
        made["sinks"] = (2 * rng.standard_normal(HEADS)).astype(np.float32)
    if options.get("alibi_slopes") == "per head":
        made["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, HEADS + 1, dtype=np.float32) / HEADS)
    elif options.get("alibi_slopes") == "per batch":
        made["alibi_slopes"] = rng.uniform(0.0, 0.5, (batch, HEADS)).astype(np.float32)
    if options.get("attn_mask") == "bool":
        made["attn_mask"] = rng.random((batch, HEADS, seqlen_q, seqlen_k)) < 0.8
    elif options.get("attn_mask") == "additive":
        additive = 2 * rng.standard_normal((batch, HEADS, seqlen_q, seqlen_k))
        additive[rng.random(additive.shape) < 0.15] = -np.inf
        made["attn_mask"] = additive.astype(dtype)
    return made


@pytest.fixture()
def tensor_ops(monkeypatch):
    """Forces the tensor-op path; returns a function that selects the emulation's layout."""
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    return lambda layout: monkeypatch.setenv("FLASH_ATTENTION_TENSOR_LAYOUT", layout)


def _kernels(ctx) -> list[str]:
    return [d.kernel for d in ctx.last_profile.dispatches]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=[_label(c) for c in CASES])
def test_forward_within_the_tensor_op_rule(ctx, tensor_ops, case, layout):
    tensor_ops(layout)
    name, head_dim, kv_heads, seqlen_q, seqlen_k, options = case
    dtype = DTYPES[name]
    batch = 2
    q, k, v, _ = make_inputs(31 + head_dim, batch, HEADS, kv_heads, seqlen_q, seqlen_k, head_dim, dtype=dtype)
    made = _options(options, np.random.default_rng(head_dim), batch, seqlen_q, seqlen_k, dtype)
    assert seqlen_q > 64
    out, lse = ctx.forward(q, k, v, **made)
    bucket = 96 if head_dim == 80 else 128 if head_dim == 112 else head_dim
    assert _kernels(ctx) == [f"flash_attention_forward_tensor_{'bf16' if name == 'bfloat16' else 'f16'}_d{bucket}"]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, tensor_ops=True, **made), _label(case))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_within_the_tensor_op_rule(ctx, tensor_ops, layout):
    """The dense forward's Philox mask on P (the same bits as the simdgroup kernel's)."""
    tensor_ops(layout)
    q, k, v, _ = make_inputs(5, 2, HEADS, 2, 37, 53, 64)
    drop = (0.3, 2024, 17)
    out, lse = ctx.forward(q, k, v, causal=True, dropout_p=drop[0], dropout_seed=drop[1], dropout_offset=drop[2])
    assert _kernels(ctx) == ["flash_attention_forward_tensor_f16_d64"]
    mask = dropout.reference_mask(drop, 2, HEADS, 37, 53)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True, dropout_mask=mask, tensor_ops=True),
                       "dropout")
    # The rule can fail: the undropped reference is far off.
    assert not all(m.passed for m in accuracy.evaluate_forward(q, k, v, out, None, causal=True, tensor_ops=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_sequences_within_the_tensor_op_rule(ctx, tensor_ops, layout):
    """A packed batch: each sequence against its own reference."""
    tensor_ops(layout)
    lengths_q, lengths_k = [5, 70, 1], [9, 66, 30]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((cu_q[-1], HEADS, 128)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((cu_k[-1], 2, 128)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((cu_k[-1], 2, 128)).astype(ml_dtypes.bfloat16)
    out, lse = ctx.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert "flash_attention_forward_tensor_bf16_d128" in _kernels(ctx)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], out[rows])]
        assert_within_rule(accuracy.evaluate_forward(*seq, lse[:, rows][None], causal=True, tensor_ops=True),
                           f"sequence {b}")


def test_real_model_inputs_within_the_tensor_op_rule(ctx, tensor_ops):
    """SmolLM2-135M's causal GQA prefill (the shipped fixture) with the path forced."""
    tensor_ops("permuted")
    fixture = Path(fam.__file__).resolve().parent / "data" / "smollm2_attention.npz"
    with np.load(fixture) as data:
        name = next(str(n) for n in data["cases"] if str(n).startswith("prefill_"))
        q, k, v = (data[f"{name}_{part}"] for part in ("q", "k", "v"))
    out, lse = ctx.forward(q, k, v, causal=True)
    assert _kernels(ctx) == ["flash_attention_forward_tensor_f16_d64"]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True, tensor_ops=True), name)


def test_long_forward_within_the_tensor_op_rule(ctx, tensor_ops):
    """65 rows over 4100 keys (the length at which float16 accumulation of O fails the rule): every
    row's O sums 4100 products of truncated P, in 129 tiles."""
    tensor_ops("permuted")
    q, k, v, _ = make_inputs(3, 1, 2, 2, 65, 4100, 64)
    out, lse = ctx.forward(q, k, v)
    assert _kernels(ctx) == ["flash_attention_forward_tensor_f16_d64"]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, tensor_ops=True), "forward 65 x 4100")


# head_dim 256 splits head_dim over SIMD-group pairs (32 rows a threadgroup: a 69-row problem ends
# with a threadgroup whose second pair has no rows). Every option in both dtypes; head_dim 200 and
# head_dim_v != head_dim leave the second member of a pair part or none of a matrix's columns.
PAIR_CASES = [
    (256, 256, 2, 69, 70, dict(causal=True)),
    (256, 256, 4, 40, 45, dict(window_size=(11, 6), sinks="sinks")),
    (256, 256, 1, 33, 64, dict(softcap=1.5, alibi_slopes="per head")),
    (256, 256, 2, 35, 37, dict(attn_mask="bool", causal=True)),
    (256, 256, 4, 34, 33, dict(attn_mask="additive", alibi_slopes="per batch")),
    (200, 200, 2, 37, 50, dict(window_size=(-1, 4))),
    (256, 128, 2, 36, 40, dict(causal=True)),
    (160, 256, 1, 33, 29, dict(sinks="sinks")),
]


def _pair_label(case) -> str:
    head_dim, head_dim_v, kv_heads, seqlen_q, seqlen_k, options = case
    return f"d{head_dim}-dv{head_dim_v}-kv{kv_heads}-{seqlen_q}x{seqlen_k}-" + "-".join(options)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("case", PAIR_CASES, ids=[_pair_label(c) for c in PAIR_CASES])
def test_head_dim_256_pairs_within_the_tensor_op_rule(ctx, tensor_ops, case, name, layout):
    tensor_ops(layout)
    head_dim, head_dim_v, kv_heads, seqlen_q, seqlen_k, options = case
    dtype = DTYPES[name]
    batch = 2
    q, k, v, _ = make_inputs(7 + seqlen_q, batch, HEADS, kv_heads, seqlen_q, seqlen_k, head_dim,
                             head_dim_v=head_dim_v, dtype=dtype)
    made = _options(options, np.random.default_rng(seqlen_k), batch, seqlen_q, seqlen_k, dtype)
    out, lse = ctx.forward(q, k, v, **made)
    (dispatch,) = ctx.last_profile.dispatches
    assert dispatch.kernel == f"flash_attention_forward_tensor_{'bf16' if name == 'bfloat16' else 'f16'}_d256"
    # One threadgroup per 32 query rows (FA_TENSOR_PAIR_BLOCK_Q).
    assert dispatch.threadgroups[0] == -(-seqlen_q // 32)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, tensor_ops=True, **made),
                       f"{_pair_label(case)} {name} {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_dim_256_pairs_dropout_and_varlen(ctx, tensor_ops, layout):
    """The pair forward's dropout (each member applies the same Philox factors to its rows' P) and
    a packed batch whose sequences end inside a pair."""
    tensor_ops(layout)
    q, k, v, _ = make_inputs(6, 1, 2, 1, 37, 41, 256)
    drop = (0.25, 77, 3)
    out, lse = ctx.forward(q, k, v, causal=True, dropout_p=drop[0], dropout_seed=drop[1], dropout_offset=drop[2])
    assert _kernels(ctx) == ["flash_attention_forward_tensor_f16_d256"]
    mask = dropout.reference_mask(drop, 1, 2, 37, 41)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True, dropout_mask=mask, tensor_ops=True),
                       "d256 dropout")
    lengths_q, lengths_k = [5, 40, 17], [9, 35, 30]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((cu_q[-1], 2, 256)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((cu_k[-1], 1, 256)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((cu_k[-1], 1, 256)).astype(ml_dtypes.bfloat16)
    out, lse = ctx.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert "flash_attention_forward_tensor_bf16_d256" in _kernels(ctx)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], out[rows])]
        assert_within_rule(accuracy.evaluate_forward(*seq, lse[:, rows][None], causal=True, tensor_ops=True),
                           f"d256 sequence {b}")


def test_head_dim_256_pairs_rerun_and_layouts_give_the_same_bits(ctx, tensor_ops):
    """Deterministic: reruns and both layouts give the same bits (both members of a pair sum the
    partial scores in one order)."""
    q, k, v, _ = make_inputs(12, 1, 2, 2, 40, 70, 256)
    results = []
    for layout in LAYOUTS + ["m5"]:
        tensor_ops(layout)
        results.append(ctx.forward(q, k, v, causal=True))
    assert all(np.array_equal(a, b) for first, other in zip(results, results[1:]) for a, b in zip(first, other))


def test_layouts_give_the_same_bits(ctx, tensor_ops):
    """The kernel assumes no layout: both runs sum in the emulation's one order."""
    q, k, v, _ = make_inputs(9, 1, HEADS, 2, 70, 45, 64)
    results = []
    for layout in LAYOUTS:
        tensor_ops(layout)
        results.append(ctx.forward(q, k, v, causal=True))
    assert all(np.array_equal(a, b) for a, b in zip(*results))


def test_routing_on_the_cpu_engine(ctx, monkeypatch):
    """Unset and 0: the simdgroup kernels (the CPU engine has no matrix units); 1: the tensor-op kernel
    where one serves the problem, the simdgroup kernels elsewhere (float32, head_dim 192, split-KV
    decode); anything else is refused naming the variable."""
    q, k, v, _ = make_inputs(2, 1, 2, 2, 20, 30, 64)
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("FLASH_ATTENTION_TENSOR_OPS", raising=False)
        else:
            monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", value)
        ctx.forward(q, k, v)
        assert _kernels(ctx) == ["flash_attention_forward_f16_d64"]
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    ctx.forward(q, k, v)
    assert _kernels(ctx) == ["flash_attention_forward_tensor_f16_d64"]
    for args, kernel in [((q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)), "forward_f32_d64"),
                         (make_inputs(2, 1, 2, 2, 20, 30, 192)[:3], "forward_f16_d192")]:
        ctx.forward(*args)
        assert _kernels(ctx) == [f"flash_attention_{kernel}"]
    decode = make_inputs(2, 1, 8, 2, 1, 600, 64)[:3]
    ctx.forward(*decode)
    assert not any("tensor" in name for name in _kernels(ctx))
    # Exported plans (PyTorch's, MLX's hosts) compile the simdgroup kernels' source: never tensor ops yet.
    exported = plan.create(_abi.new_problem(_native.native().ffi, _native.native().lib,
                                            Shape(1, 2, 2, 100, 30, 64), False, 0.125, "float16", {}),
                           "forward")
    assert [d.kernel_name for d in exported.dispatches] == ["flash_attention_forward_f16_d64"]
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "yes")
    with pytest.raises(fam.FlashAttentionError, match="FLASH_ATTENTION_TENSOR_OPS \\(yes\\) must be 1"):
        ctx.forward(q, k, v)


# ---- a planted layout assumption --------------------------------------------------------------

# The tensor-op kernel finds the row of each of O's slots with get_multidimensional_index. The plant
# computes it from MLX's M5 fragment map instead (row fm + 8 (j / 4) of lane l's slot j,
# fm = (l >> 2 & 4) | (l >> 1 & 3); O has one row of 16x16 fragments): right under the M5 layout,
# wrong under any other. The helpers that place O's rows (scale_rows, store_rows) take no lane, so
# the plant asks the engine for it (the planted build is the CPU engine's).
LANE = "msl_engine::runtime::simd_lane()"
M5_ROW = f"row_scale[((({LANE} >> 2) & 4) | (({LANE} >> 1) & 3)) + 8 * ((i % 8) / 4)]"
# The per-tile rescale and the final 1 / l (each once in the header, shared by every bucket).
PLANTS = (("row_scale[o.get_multidimensional_index(i)[1]]", M5_ROW), ("row_scale[o_row]", M5_ROW))
# The d64 float16 instance, served through the engine's test-only table override
# (MSL_ENGINE_KERNELS_OVERRIDE, test_planted_faults.py), with the dense float16 forward of the largest
# bucket, which the CPU backend looks up when it starts.
PROBE = "forward, bucket, FA_FORWARD_BUFFERS, FA_READS_FORWARD, forward_storage, FA_BUILTINS_SIMDGROUP, half, f16"
PLANTED_SOURCE = f"""#include "flash_attention_kernels.hpp"
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "../../Shaders/flash_attention_tensor.h"
FA_DEFINE_TENSOR_F16(64)
FA_DEFINE_KERNEL({PROBE}, FA_MAX_HEAD_DIM)
namespace {{ const msl_engine::kernel_entry kTable[] = {{FA_KERNELS(FA_AT_TENSOR, FA_ENGINE_ENTRY, half, f16, 64)
    FA_ENGINE_ENTRY({PROBE}, FA_MAX_HEAD_DIM)}}; }}
extern "C" __attribute__((visibility("default"))) const msl_engine::kernel_entry *
msl_engine_kernels_override(size_t *count) {{ *count = sizeof kTable / sizeof kTable[0]; return kTable; }}
"""
CATCHER = "test_forward_within_the_tensor_op_rule"


def _build_planted(folder: Path) -> Path:
    shaders = folder / "Shaders"
    shaders.mkdir()
    for header in (ROOT / "Shaders").glob("*.h"):
        text = header.read_text()
        if header.name == "flash_attention_tensor.h":
            for found, planted in PLANTS:
                assert text.count(found) == 1, "the plant no longer matches flash_attention_tensor.h"
                text = text.replace(found, planted)
        (shaders / header.name).write_text(text)
    engine = folder / "Sources" / "MSLEngine"
    engine.mkdir(parents=True)
    (engine / "flash_attention_kernels.hpp").write_text((ENGINE / "flash_attention_kernels.hpp").read_text())
    (engine / "planted.cpp").write_text(PLANTED_SOURCE)
    library = Path(_native.native().path).resolve()
    output = folder / "planted.so"
    compiler = os.environ.get("CXX") or "clang++"
    command = [compiler, "-O1", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", f"-I{ENGINE / 'include'}",
               f"-I{ENGINE / 'msl'}", f"-I{ENGINE / 'engine'}", str(engine / "planted.cpp"), str(library),
               f"-Wl,-rpath,{library.parent}", "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def test_planted_layout_assumption_is_caught_by_the_permuted_run(tmp_path):
    planted = _build_planted(tmp_path)
    case = f"tests/python/kernels/{Path(__file__).name}::{CATCHER}[{_label(CASES[0])}-"
    env = dict(os.environ, MSL_ENGINE_KERNELS_OVERRIDE=str(planted), FLASH_ATTENTION_METAL_BACKEND="cpu")
    runs = {}
    for layout in LAYOUTS:
        runs[layout] = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       f"{case}{layout}]"], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=300)
    assert runs["m5"].returncode == 0, runs["m5"].stdout[-3000:] + runs["m5"].stderr[-2000:]
    assert runs["permuted"].returncode == 1, runs["permuted"].stdout[-3000:]
    assert "AssertionError" in runs["permuted"].stdout, runs["permuted"].stdout[-3000:]
