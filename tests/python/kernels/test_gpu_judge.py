"""tests/cuda/judge.py, which judges the CUDA check's dumps (tests/cuda/dump.h) with the package's
reference and accuracy rule, run here on dumps of the CPU engine's results written in the same
format: correct results pass, and so must every case fail when the kernels' softmax takes exp
where they take exp2 (the planted fault of tests/cuda/gpu_check.sh: the scores scaled by ln 2), or when
a row that sees no key holds one non-zero dq element too small for the accuracy rule to see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import reference

ROOT = Path(__file__).resolve().parents[3]
JUDGE = ROOT / "tests" / "cuda" / "judge.py"
DTYPE_NAMES = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.float32): "f32"}
MASK_KINDS = {"none": 0, "boolean": 1, "additive": 2, "additive_f32": 3}

# (name, dtype, (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v), causal, options):
# GQA with empty causal rows and a split-KV result; sinks, a window leaving rows empty and a boolean
# mask hiding a whole row; softcap, ALiBi per batch and a float32 additive mask.
CASES = [
    ("f16_d40_b1_h4x2_q9_k5_causal", np.float16, (1, 4, 2, 9, 5, 40, 40), True, {}),
    ("bf16_d32v16_b2_h2x1_q12_k20_full_w3.2_mbool.b1_sinks", ml_dtypes.bfloat16, (2, 2, 1, 12, 20, 32, 16), False,
     {"window_size": (3, 2), "mask": "boolean", "sinks": True}),
    ("f32_d64_b2_h2x2_q17_k17_causal_cap5_alibib_maddf32.bh", np.float32, (2, 2, 2, 17, 17, 64, 64), True,
     {"softcap": 5.0, "alibi": True, "mask": "additive_f32"}),
]


def _inputs(dtype, shape, options, rng):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v = shape
    q, k, v, dout = (rng.standard_normal(s).astype(dtype) for s in (
        (batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
        (batch, kv_heads, seqlen_k, head_dim_v), (batch, heads, seqlen_q, head_dim_v)))
    extra, files = {}, {}
    if "window_size" in options:
        extra["window_size"] = options["window_size"]
    if "softcap" in options:
        extra["softcap"] = options["softcap"]
    if options.get("mask") == "boolean":
        mask = rng.random((batch, 1, seqlen_q, seqlen_k)) < 0.75
        mask[:, :, 1] = False  # a row hidden entirely
        extra["attn_mask"], files["mask"] = mask, mask.astype(np.float32)
    elif options.get("mask") == "additive_f32":
        mask = rng.standard_normal((batch, heads, seqlen_q, seqlen_k)).astype(np.float32)
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        extra["attn_mask"], files["mask"] = mask, mask
    if options.get("alibi"):
        slopes = np.exp2(-8.0 * (np.arange(heads) + 1) / heads) * (1 + np.arange(batch)[:, None] / 4)
        extra["alibi_slopes"] = files["alibi"] = slopes.astype(np.float32)
    if options.get("sinks"):
        extra["sinks"] = files["sinks"] = (rng.standard_normal(heads) + 1).astype(np.float32)
    return (q, k, v, dout), extra, files


def _write_case(folder: Path, name, dtype, shape, causal, options, scale_factor=1.0, empty_dq_bit=False):
    """The case's inputs and the CPU engine's results (softmax_scale times ``scale_factor``) in
    dump.h's format; returns whether the case has a row that sees no key."""
    (q, k, v, dout), extra, files = _inputs(dtype, shape, options, np.random.default_rng(len(name)))
    scale = np.float32(1 / np.sqrt(shape[5]))
    ctx = fam.Context("cpu")
    out, lse = ctx.forward(q, k, v, causal=causal, softmax_scale=float(scale * np.float32(scale_factor)), **extra)
    grads = ctx.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=float(scale * np.float32(scale_factor)),
                         **extra)
    outputs = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if "sinks" in extra:
        outputs["dsinks"] = grads[3]
    if shape[3] <= 16:
        outputs["split_out"], outputs["split_lse"] = out, lse
    keys = reference.key_mask(shape[3], shape[4], causal, extra.get("window_size", (-1, -1)),
                                  extra.get("attn_mask"))
    empty = np.broadcast_to(~keys.any(axis=-1), lse.shape)
    if empty_dq_bit and empty.any():
        dq = outputs["dq"].astype(np.float32)
        dq[empty] = 0
        dq[np.argwhere(empty)[0].tolist() + [0]] = np.float32(np.finfo(np.float16).smallest_subnormal)
        outputs["dq"] = dq
    for tensor, values in [("q", q), ("k", k), ("v", v), ("dout", dout), *files.items(), *outputs.items()]:
        np.asarray(values, dtype=np.float32).tofile(folder / f"{name}.{tensor}")
    left, right = extra.get("window_size", (-1, -1))
    fields = [name, DTYPE_NAMES[np.dtype(dtype)], *shape, int(causal), f"{scale:.9g}", left, right,
              f"{extra.get('softcap', 0.0):.9g}", MASK_KINDS[options.get("mask", "none")],
              int(options.get("mask") == "boolean" or options.get("mask") == "additive_f32"),
              int(options.get("mask") == "additive_f32"), int(bool(options.get("alibi"))),
              int(bool(options.get("alibi"))), int(bool(options.get("sinks"))), ",".join(outputs)]
    with open(folder / "cases.txt", "a") as listing:
        listing.write(" ".join(map(str, fields)) + "\n")
    return bool(empty.any())


def _judge(folder: Path) -> subprocess.CompletedProcess:
    # A plain interpreter path, as on the GPU machine: judge.py loads the two modules by path.
    return subprocess.run([sys.executable, str(JUDGE), str(folder)], capture_output=True, text=True, timeout=300)


def test_correct_results_pass(tmp_path):
    for case in CASES:
        _write_case(tmp_path, *case)
    result = _judge(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cuda-accuracy: {len(CASES)} cases, 0 mismatches" in result.stdout
    assert "(split)" in result.stdout and "dsinks" in result.stdout


def test_exp_for_exp2_fails_every_case(tmp_path):
    for case in CASES:
        _write_case(tmp_path, *case, scale_factor=np.log(2))
    result = _judge(tmp_path)
    assert result.returncode == 1
    assert f"cuda-accuracy: {len(CASES)} cases, {len(CASES)} mismatches" in result.stdout, result.stdout


@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_a_nonzero_gradient_in_an_empty_row_fails(tmp_path, case):
    assert _write_case(tmp_path, *case, empty_dq_bit=True)
    result = _judge(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "empty" in result.stdout and "(FAIL)" in result.stdout.split("empty", 1)[1], result.stdout


def test_quantized_cache_judged_against_exact_rows(tmp_path):
    """A KV-cache case of the replay (grid.kv_cache_cases): a 4-bit cache's rows come as float64
    (NAME.k_exact, NAME.v_exact) and the judge attends to them; the CPU engine's decode result
    passes, and fails when the dump's exact rows are not the cache's (keys and values swapped)."""
    from flash_attention_metal import quantized
    rng = np.random.default_rng(4)
    batch, heads, kv_heads, keys, dim = 1, 4, 2, 70, 64
    q = rng.standard_normal((batch, 1, heads, dim)).astype(np.float16)
    caches = [quantized.quantize(rng.standard_normal((batch, keys, kv_heads, dim)).astype(np.float16), 32, 4)
              for _ in range(2)]
    out, lse = fam.flash_attn_with_kvcache(q, *caches, cache_seqlens=keys, bits=4, group_size=32, causal=True,
                                           return_softmax_lse=True, context=fam.Context("cpu"))
    (k, v), = reference.kvcache_sequences(*caches, np.int32([keys]), bits=4, group_size=32)
    for name, exact in (("kvcache_q4_decode", {"k": k, "v": v}), ("kvcache_q4_decode_swapped", {"k": v, "v": k})):
        for tensor, values in exact.items():
            np.ascontiguousarray(values, dtype=np.float64).tofile(tmp_path / f"{name}.{tensor}_exact")
        for tensor, values in [("q", q.transpose(0, 2, 1, 3)), ("dout", np.zeros((batch, heads, 1, dim))),
                               ("out", out.transpose(0, 2, 1, 3)), ("lse", lse)]:
            np.asarray(values, dtype=np.float32).tofile(tmp_path / f"{name}.{tensor}")
        fields = [name, "f16", batch, heads, kv_heads, 1, keys, dim, dim, 1, f"{np.float32(1 / np.sqrt(dim)):.9g}",
                  -1, -1, 0, 0, 0, 0, 0, 0, 0, "out,lse"]
        with open(tmp_path / "cases.txt", "a") as listing:
            listing.write(" ".join(map(str, fields)) + "\n")
    result = _judge(tmp_path)
    assert "cuda-accuracy: 2 cases, 1 mismatches" in result.stdout, result.stdout + result.stderr
    assert "ok   kvcache_q4_decode " in result.stdout and "FAIL kvcache_q4_decode_swapped" in result.stdout


def _write_nonfinite_or_dropout(folder: Path, name: str, dtype, shape, *, plant=(), dropout=None, edit=None):
    """A non-causal case of the CPU engine's forward and backward in dump.h's format: ``plant``
    (tensor, batch, head, row, column, value) entries written into the inputs first; ``dropout``
    (p, seed, offset) appended to the line as cases.py does; ``edit(outputs)`` alters the results
    before they are written (a planted fault)."""
    rng = np.random.default_rng(len(name))
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v = shape
    q, k, v, dout = (rng.standard_normal(s).astype(dtype) for s in (
        (batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
        (batch, kv_heads, seqlen_k, head_dim_v), (batch, heads, seqlen_q, head_dim_v)))
    for tensor, b, h, row, column, value in plant:
        {"q": q, "k": k, "v": v}[tensor][b, h, row, column] = value
    scale = np.float32(1 / np.sqrt(head_dim))
    extra = {} if dropout is None else dict(zip(("dropout_p", "dropout_seed", "dropout_offset"), dropout))
    ctx = fam.Context("cpu")
    out, lse = ctx.forward(q, k, v, softmax_scale=float(scale), **extra)
    dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, softmax_scale=float(scale), **extra)[:3]
    outputs = {"out": out.astype(np.float32), "lse": lse.astype(np.float32), "dq": dq.astype(np.float32),
               "dk": dk.astype(np.float32), "dv": dv.astype(np.float32)}
    if edit is not None:
        edit(outputs)
    for tensor, values in [("q", q), ("k", k), ("v", v), ("dout", dout), *outputs.items()]:
        np.asarray(values, dtype=np.float32).tofile(folder / f"{name}.{tensor}")
    fields = [name, DTYPE_NAMES[np.dtype(dtype)], *shape, 0, f"{scale:.9g}", -1, -1, "0", 0, 0, 0, 0, 0, 0,
              ",".join(outputs)]
    if dropout is not None:
        fields += [f"{dropout[0]:.9g}", dropout[1], dropout[2]]
    with open(folder / "cases.txt", "a") as listing:
        listing.write(" ".join(map(str, fields)) + "\n")


# grid.NONFINITE_PLACEMENTS' kinds: NaN and infinities in k (decode-sized), v, and a q row (backward).
NONFINITE = [
    ("nan_k", np.float32, (2, 4, 1, 2, 160, 64, 64), (("k", 0, 0, 64, 3, np.nan), ("k", 0, 0, 79, 5, np.inf),
                                                     ("k", 0, 0, 95, 0, -np.inf))),
    ("nan_v", np.float16, (2, 4, 2, 9, 130, 32, 32), (("v", 0, 0, 64, 3, np.nan), ("v", 0, 1, 79, 5, np.inf))),
    ("nan_q", np.float16, (2, 4, 2, 9, 70, 32, 32), (("q", 0, 0, 0, 3, np.nan), ("q", 0, 1, 8, 0, -np.inf))),
]


def test_nonfinite_placement_passes(tmp_path):
    for name, dtype, shape, plant in NONFINITE:
        _write_nonfinite_or_dropout(tmp_path, name, dtype, shape, plant=plant)
    result = _judge(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cuda-accuracy: {len(NONFINITE)} cases, 0 mismatches" in result.stdout
    assert result.stdout.count("non-finite") == len(NONFINITE)


def _hide_nan(outputs):
    """A kernel that drops a NaN key's chunk (issue 36): the NaN rows' out made finite."""
    out = outputs["out"]
    out[np.isnan(out)] = 0.5


def _nan_where_finite(outputs):
    outputs["out"][1, 0, 0, 0] = np.nan  # batch 1 has no non-finite input


def _finite_lse_for_nan(outputs):
    lse = outputs["lse"]
    lse[np.isnan(lse)] = 1.0


def _finite_dq_for_nan(outputs):
    dq = outputs["dq"]
    dq[np.isnan(dq)] = 0.0


@pytest.mark.parametrize("edit", [_hide_nan, _nan_where_finite, _finite_lse_for_nan, _finite_dq_for_nan],
                         ids=lambda e: e.__name__)
def test_nonfinite_misplacement_fails(tmp_path, edit):
    name, dtype, shape, plant = NONFINITE[2]
    _write_nonfinite_or_dropout(tmp_path, name, dtype, shape, plant=plant, edit=edit)
    result = _judge(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "cuda-accuracy: 1 cases, 1 mismatches" in result.stdout, result.stdout


# grid.dropout_cases' kinds: float16 and float32, GQA, a seed and offset near 2^64 (the counter wraps).
DROPOUT = [("drop_f16", np.float16, (2, 4, 2, 70, 90, 64, 64), (0.17, 1234, 5678)),
           ("drop_f32_wrap", np.float32, (1, 8, 2, 33, 77, 128, 128), (0.17, 2**64 - 3, 2**64 - 5))]


def test_dropout_with_its_mask_passes(tmp_path):
    for name, dtype, shape, call in DROPOUT:
        _write_nonfinite_or_dropout(tmp_path, name, dtype, shape, dropout=call)
    result = _judge(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cuda-accuracy: {len(DROPOUT)} cases, 0 mismatches" in result.stdout


@pytest.mark.parametrize("case", DROPOUT, ids=[c[0] for c in DROPOUT])
def test_dropout_with_another_mask_fails(tmp_path, case):
    """The results of one seed judged as another's: the judge's mask is not the kernels'."""
    name, dtype, shape, (p, seed, offset) = case
    _write_nonfinite_or_dropout(tmp_path, name, dtype, shape, dropout=(p, seed, offset))
    listing = tmp_path / "cases.txt"
    fields = listing.read_text().split()
    fields[-2] = str((seed + 1) % 2**64)
    listing.write_text(" ".join(fields) + "\n")
    result = _judge(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "cuda-accuracy: 1 cases, 1 mismatches" in result.stdout, result.stdout
