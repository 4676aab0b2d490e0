"""Judges the CUDA check programs' results with the Python package's float64 reference and accuracy
rule (python/flash_attention_metal/reference.py and accuracy.py, the one definition of the rule).

Reads a dump folder that tests/cuda/replay.cu (--dump) or large_offsets.cu wrote (its layout:
tests/cuda/dump.h) and judges each case: out and lse with ``accuracy.evaluate_forward``; dq, dk,
dv (and dsinks with sinks) with ``accuracy.evaluate_backward`` (only the gradients the case
dumped: large_offsets runs no dK/dV); a quantized KV cache's out and lse against its float64
dequantized keys and values (NAME.k_exact, NAME.v_exact: ``evaluate_forward``'s ``exact_kv``); the split-KV forward's out and lse, when dumped, with
``evaluate_forward`` again; and rows that see no key must hold out 0, dq 0 and lse -inf (sinks[h]
with sinks) exactly. A case with dropout (dropout_p, seed, offset after its outputs) is judged
against the reference with the same Philox mask (``dropout.reference_mask``); a case whose line ends
with tensor_ops=forward,backward (cases.py: its plans ran Metal 4 tensor-op kernels) has those
passes' outputs held to the rule's tensor-op term (``tensor_ops=True``, as the Python tests hold the
kernels); a case whose inputs
hold NaN or infinities by docs/semantics.md's "Non-finite values" (``_nonfinite_metrics``).

Usage: python3 tests/cuda/judge.py DUMP_FOLDER [--name NAME]
Prints one line per case, the worst ratios to base per dtype and "NAME: N cases, M mismatches"
(NAME defaults to cuda-accuracy); exit status 1 on any mismatch or an empty folder. Needs numpy, and
ml_dtypes for bfloat16; neither the compiled library nor cffi (the modules are loaded by path).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import pathlib
import sys
import types

import numpy as np

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "flash_attention_metal"


def _load_rule_modules():
    """reference and accuracy from python/flash_attention_metal, without the package __init__
    (which loads the native library through cffi: neither is needed, nor present on a GPU box)."""
    package = types.ModuleType("flash_attention_metal")
    package.__path__ = [str(PACKAGE)]
    sys.modules.setdefault("flash_attention_metal", package)  # dropout: the Philox mask, numpy only
    return (importlib.import_module("flash_attention_metal.reference"),
            importlib.import_module("flash_attention_metal.accuracy"),
            importlib.import_module("flash_attention_metal.dropout"))


reference, accuracy, dropout = _load_rule_modules()


def _dtypes() -> dict:
    dtypes = {"f16": np.float16, "f32": np.float32}
    try:
        import ml_dtypes
        dtypes["bf16"] = ml_dtypes.bfloat16
    except ImportError:  # a bfloat16 case then fails, naming the module
        pass
    return dtypes


DTYPES = _dtypes()
MASKS = ("none", "boolean", "additive", "additive_f32")  # problem.h's MaskKind


def judge_case(folder: pathlib.Path, line: str) -> tuple[str, bool, str, list]:
    """(name, passed, detail, metrics) of one cases.txt line (dump.h)."""
    name, dtype_name, *fields = line.split()
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, causal = map(int, fields[:8])
    scale, softcap = float(np.float32(fields[8])), float(np.float32(fields[11]))
    left, right = int(fields[9]), int(fields[10])
    mask_kind, mask_per_batch, mask_per_head, alibi, alibi_per_batch, sinks = map(int, fields[12:18])
    outputs = fields[18].split(",")
    # cases.py's tensor-op cases end with tensor_ops=<passes>: the passes whose plans ran tensor-op
    # kernels, held to the rule's tensor-op term (accuracy.TENSOR_OPS_FACTOR).
    tensor_passes = set(fields.pop()[len("tensor_ops="):].split(",")) if fields[-1].startswith("tensor_ops=") else set()
    # Dropout cases add dropout_p, seed and offset after the outputs.
    dropout_call = (float(fields[19]), int(fields[20]), int(fields[21])) if len(fields) > 19 else None
    if dtype_name not in DTYPES:
        return name, False, f"cannot judge {dtype_name}: install ml_dtypes", []
    dtype = DTYPES[dtype_name]
    shapes = {"q": (batch, heads, seqlen_q, head_dim), "k": (batch, kv_heads, seqlen_k, head_dim),
              "v": (batch, kv_heads, seqlen_k, head_dim_v), "dout": (batch, heads, seqlen_q, head_dim_v),
              "out": (batch, heads, seqlen_q, head_dim_v), "lse": (batch, heads, seqlen_q),
              "dq": (batch, heads, seqlen_q, head_dim), "dk": (batch, kv_heads, seqlen_k, head_dim),
              "dv": (batch, kv_heads, seqlen_k, head_dim_v), "dsinks": (heads,),
              "mask": (batch if mask_per_batch else 1, heads if mask_per_head else 1, seqlen_q, seqlen_k),
              "alibi": (batch, heads) if alibi_per_batch else (heads,), "sinks": (heads,)}
    shapes["split_out"], shapes["split_lse"] = shapes["out"], shapes["lse"]

    def load(tensor: str) -> np.ndarray:
        # float32 values of the dtype (outputs too): casting them to the dtype is exact.
        return np.fromfile(folder / f"{name}.{tensor}", dtype=np.float32).reshape(shapes[tensor])

    # A quantized KV cache's keys and values come dequantized exactly in float64 (k_exact, v_exact):
    # the reference attends to those, the kernels' inputs are their rounding to the dtype.
    exact = [folder / f"{name}.{t}_exact" for t in ("k", "v")]
    exact_kv = (tuple(np.fromfile(f, dtype=np.float64).reshape(shapes[t]) for f, t in zip(exact, "kv"))
                if all(f.exists() for f in exact) else None)
    q, dout = (load(t).astype(dtype) for t in ("q", "dout"))
    k, v = (load(t).astype(dtype) for t in ("k", "v")) if exact_kv is None else (x.astype(dtype) for x in exact_kv)
    ours = {t: load(t) if t in ("lse", "split_lse", "dsinks") else load(t).astype(dtype) for t in outputs}
    options = {"causal": bool(causal), "softmax_scale": scale}
    if left >= 0 or right >= 0:
        options["window_size"] = (left, right)
    if softcap > 0:
        options["softcap"] = softcap
    if MASKS[mask_kind] != "none":
        mask = load("mask")
        with np.errstate(over="ignore"):  # float32's lowest hides a key as -inf in float16, as on the GPU
            in_dtype = mask.astype(dtype)
        options["attn_mask"] = {"boolean": mask != 0, "additive": in_dtype, "additive_f32": mask}[MASKS[mask_kind]]
    if alibi:
        options["alibi_slopes"] = load("alibi")
    if sinks:
        options["sinks"] = load("sinks")
    if dropout_call is not None:
        options["dropout_mask"] = dropout.reference_mask(dropout_call, batch, heads, seqlen_q, seqlen_k)
    if not all(np.all(np.isfinite(x.astype(np.float32))) for x in (q, k, v, dout)):
        metrics = _nonfinite_metrics(q, k, v, dout, ours, options)
        detail = " ".join(f"{m.name} {m.error:.2e}/{m.bound:.2e}{'' if m.passed else '(FAIL)'}" for m in metrics)
        return name, all(m.passed for m in metrics), detail + " non-finite", metrics

    metrics = accuracy.evaluate_forward(q, k, v, ours["out"], ours["lse"], exact_kv=exact_kv,
                                        tensor_ops="forward" in tensor_passes, **options)
    gradients = [t for t in ("dq", "dk", "dv") if t in ours]
    if gradients:
        # A gradient not dumped (large_offsets has no dK/dV) is judged as zeros and left out.
        dumped = [ours.get(t, np.zeros(shapes[t], dtype)) for t in ("dq", "dk", "dv")]
        backward = accuracy.evaluate_backward(dout, q, k, v, *dumped, ours.get("dsinks"),
                                              tensor_ops="backward" in tensor_passes, **options)
        metrics += [m for m in backward if m.name in gradients or m.name == "dsinks"]
    if "split_out" in ours:
        split = accuracy.evaluate_forward(q, k, v, ours["split_out"], ours["split_lse"], **options)
        metrics += [accuracy.Metric(m.name + "(split)", m.error, m.base_error, m.bound) for m in split]
    empty_ok, empty_rows = _empty_rows_exact(ours, options, shapes["lse"], seqlen_q, seqlen_k)
    passed = empty_ok and all(m.passed for m in metrics)
    detail = " ".join(
        f"{m.name} {m.error:.1e}{'' if m.passed else '(FAIL)'}" if m.name.startswith("lse") else
        f"{m.name} {m.error:.2e}/{m.base_error:.2e}={_ratio(m):.2f}{'' if m.passed else '(FAIL)'}"
        for m in metrics)
    return name, passed, f"{detail} empty {empty_rows}{'' if empty_ok else '(FAIL)'}", metrics


def _nonfinite_metrics(q, k, v, dout, ours: dict, options: dict) -> list:
    """Issue 36's rule (docs/semantics.md, "Non-finite values") for inputs holding NaN or
    infinities: every output entry the float64 reference gives NaN (or +-inf) must be that, the lse
    NaN, +inf or -inf exactly where the reference's is; the entries the reference gives finite
    must be finite and within the accuracy rule (its base error taken over those entries). The
    cases hide no key from any row (grid.nonfinite_cases), so no exception of the rule applies."""
    softcap = options.get("softcap", 0.0)
    with np.errstate(all="ignore"):
        ref_out, ref_lse = reference.forward(q, k, v, **options)
        base_outs = [accuracy.base_forward(q, k, v, **options)[0]]
        if q.dtype == np.float32:  # float32's second baseline, as evaluate_forward takes it
            score_options = {n: x for n, x in options.items() if n not in ("sinks", "softmax_scale")}
            scale = reference.default_scale(q.shape[3], options.get("softmax_scale"))
            base_outs.append(accuracy._framework_forward(q, k, v, scale, options.get("sinks"), score_options)[0])
        metrics = []
        for out, lse, suffix in (("out", "lse", ""), ("split_out", "split_lse", "(split)")):
            if out in ours:
                metrics += [_finite_metric("out" + suffix, ours[out], base_outs, ref_out, softcap),
                            _lse_class_metric("lse" + suffix, ours[lse], ref_lse)]
        gradients = [t for t in ("dq", "dk", "dv") if t in ours]
        if gradients:
            refs = reference.backward(dout, q, k, v, **options)
            candidates = [accuracy.base_backward(dout, q, k, v, **options)]
            if q.dtype == np.float32:  # float32's second baseline, as evaluate_backward takes it
                candidates.append(accuracy._base_backward(dout, q, k, v, blocked=True, **options)[0])
            for i, t in enumerate(("dq", "dk", "dv")):
                if t in ours:
                    metrics.append(_finite_metric(t, ours[t], [c[i] for c in candidates], refs[i], softcap))
    return metrics


def _same_classes(ours, ref) -> bool:
    """Whether ours is NaN, +inf and -inf exactly where ref is."""
    ours = np.asarray(ours, dtype=np.float64)
    return all(np.array_equal(test(ours), test(ref)) for test in (np.isnan, np.isposinf, np.isneginf))


def _finite_metric(name: str, ours, bases, ref, softcap: float):
    """The accuracy rule on ref's finite entries (a base's non-finite entry there counts as no
    error), infinite error when ours is not NaN or +-inf exactly where ref is."""
    finite = np.isfinite(ref)
    bases = [np.where(np.isfinite(b.astype(np.float64)), b.astype(np.float64), ref)[finite] for b in bases]
    metric = accuracy._metric(name, np.asarray(ours, dtype=np.float64)[finite], bases, ref[finite], softcap)
    if not _same_classes(ours, ref):
        return accuracy.Metric(name, float("inf"), metric.base_error, metric.bound)
    return metric


def _lse_class_metric(name: str, ours, ref):
    """lse within the rule where ref is finite, and NaN, +inf, -inf exactly where ref is."""
    finite = np.isfinite(ref)
    metric = accuracy.lse_metric(np.asarray(ours)[finite], ref[finite])
    error = metric.error if _same_classes(ours, ref) else float("inf")
    return accuracy.Metric(name, error, metric.base_error, metric.bound)


def _ratio(metric) -> float:
    return metric.error / metric.base_error if metric.base_error > 0 else 0.0


def _empty_rows_exact(ours: dict, options: dict, lse_shape, seqlen_q: int, seqlen_k: int) -> tuple[bool, int]:
    """Whether rows that see no key hold out 0, dq 0 and lse -inf (sinks[h] with sinks) exactly, in
    every dumped output; and how many such rows there are."""
    keys = reference.key_mask(seqlen_q, seqlen_k, options["causal"], options.get("window_size", reference.NO_WINDOW),
                              options.get("attn_mask"))
    empty = np.broadcast_to(~keys.any(axis=-1), lse_shape)
    sinks = options.get("sinks")
    want_lse = (np.full(int(empty.sum()), -np.inf, np.float32) if sinks is None
                else np.broadcast_to(sinks[None, :, None], lse_shape)[empty])
    ok = True
    for out, lse in (("out", "lse"), ("split_out", "split_lse")):
        if out in ours:
            ok = ok and not np.any(ours[out][empty].astype(np.float32)) and np.array_equal(ours[lse][empty], want_lse)
    if "dq" in ours:
        ok = ok and not np.any(ours["dq"][empty].astype(np.float32))
    return bool(ok), int(empty.sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--name", default="cuda-accuracy", help="the summary line's name")
    args = parser.parse_args()
    listing = args.folder / "cases.txt"
    lines = listing.read_text().splitlines() if listing.exists() else []
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        results = list(pool.map(judge_case, [args.folder] * len(lines), lines, chunksize=1))
    worst: dict[str, dict[str, tuple[float, str]]] = {}
    for (name, passed, detail, metrics), line in zip(results, lines):
        print(f"{'ok' if passed else 'FAIL':4} {name:44} {detail}", flush=True)
        for m in metrics:
            kinds = worst.setdefault(line.split()[1], {})
            kind = next((k for k in ("lse", "out", "dsinks") if m.name.startswith(k)), "gradients")
            value = m.error if kind == "lse" else _ratio(m)
            if value > kinds.get(kind, (-1.0, ""))[0]:
                kinds[kind] = (value, name)
    for dtype_name, kinds in worst.items():
        parts = [f"{kind} {value:.2f} ({case})" for kind, (value, case) in kinds.items() if kind != "lse"]
        value, case = kinds.get("lse", (0.0, "-"))
        # Ratios without the absolute term: a tiny base error (dsinks near 1e-18) can give a large
        # ratio that the term still admits.
        print(f"{dtype_name} worst ratio to base: {', '.join(parts)} (bounds: 2x, 4x with softcap or from "
              f"tensor-op kernels, dsinks 4x, plus the absolute term); worst lse relative error {value:.1e} ({case}; bound "
              f"{accuracy.LSE_RELATIVE:g}, or {accuracy.OUT_FACTOR:g}x the base's for a quantized cache)")
    mismatches = sum(1 for _, passed, _, _ in results if not passed)
    print(f"{args.name}: {len(results)} cases, {mismatches} mismatches")
    return 0 if results and mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
