"""The CPU engine's speed on the suite's two typical calls, as ratios to NumPy, for one or two
builds of the library side by side (docs/cpu-engine.md, issue 35).

Workloads (float16, bhsd, random inputs from a fixed seed):
- ``train``: forward + backward, B=1, H=4, seqlen 512, head_dim 64;
- ``decode``: one SmolLM2-shaped decode step, 1 query, 9 heads on 3 KV heads, 2048 keys, head_dim 64.
Each is timed against NumPy's unfused float32 attention of the same shape on one BLAS thread
(scores, softmax, weighted sum; for ``train`` also the gradient of q, k and v), measured in the
same process, so the ratio (engine seconds / NumPy seconds) survives a busy machine better than
either time alone. Times are the minimum over ``--inner`` calls in a process and over
``--repeats`` processes; the processes of the builds alternate, so both see the same load.
``--clock cpu`` times by the process's CPU time (all its threads) instead of the wall clock: on a
shared machine the wall time of a call that outlasts a scheduler time slice grows with the load
(the engine's, tens of milliseconds, far more than NumPy's), its CPU time much less. With more
than one engine worker the CPU time sums the workers.

    python benchmarks/engine_speed.py                                      # this checkout's build
    python benchmarks/engine_speed.py --build base=/path/to/other/checkout --build new=.
    python benchmarks/engine_speed.py --build base=... --build new=. --instructions

A build is a checkout whose ``python/`` package and ``.build/release`` library are used (or
``NAME=LIBRARY_FILE:PYTHON_DIR``). ``--instructions`` also counts the instructions one call executes
under ``valgrind --tool=callgrind`` (stable under load, unlike times; slow: minutes per workload
and build): those of a process making the call once with one engine worker, in the library and
libm (the kernels' exp2f), so not Python's; the library's start-up is included and small. Each process also prints a digest of
the engine's outputs; two builds whose digests differ do not compute the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("train", "decode")
ONE_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                     "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")}


# ----- the child: runs in the build's environment -------------------------------------------------

def _inputs(np, workload: str):
    rng = np.random.default_rng(35)
    if workload == "train":
        shapes = dict(q=(1, 4, 512, 64), k=(1, 4, 512, 64), v=(1, 4, 512, 64), dout=(1, 4, 512, 64))
    else:
        shapes = dict(q=(1, 9, 1, 64), k=(1, 3, 2048, 64), v=(1, 3, 2048, 64))
    return {name: rng.standard_normal(shape).astype(np.float16) for name, shape in shapes.items()}


def _numpy_attention(np, x: dict, backward: bool):
    """Unfused float32 attention (GQA by grouping query heads), with the gradient when asked."""
    q, k, v = (x[n].astype(np.float32) for n in ("q", "k", "v"))
    b, h, s, d = q.shape
    kv = k.shape[1]
    g = h // kv
    scale = 1.0 / np.sqrt(d)
    qg = q.reshape(b, kv, g * s, d)
    scores = (qg @ k.transpose(0, 1, 3, 2)) * scale
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v
    if not backward:
        return out
    dout = x["dout"].astype(np.float32).reshape(out.shape)
    dv = p.transpose(0, 1, 3, 2) @ dout
    dp = dout @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dout * out).sum(axis=-1, keepdims=True))
    dq = (ds @ k) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ qg) * scale
    return out, dq, dk, dv


def _engine_call(context, x: dict, workload: str):
    out, lse = context.forward(x["q"], x["k"], x["v"])
    if workload == "decode":
        return (out, lse)
    return (out, lse) + tuple(context.backward(x["dout"], x["q"], x["k"], x["v"], out, lse))


def _min_seconds(function, count: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(count):
        start = clock()
        function()
        best = min(best, clock() - start)
    return best


def child(args) -> int:
    import ctypes

    import numpy as np

    import flash_attention_metal as fam

    context = fam.Context("cpu")
    if args.workers:
        ctypes.CDLL(context.library_path).msl_engine_set_worker_count(ctypes.c_uint32(args.workers))
    result = {"library": context.library_path}
    for workload in args.workloads:
        x = _inputs(np, workload)
        outputs = _engine_call(context, x, workload)
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(o).tobytes() for o in outputs)).hexdigest()
        for _ in range(args.calls - 1):
            _engine_call(context, x, workload)
        entry = {"digest": digest[:16]}
        if args.inner > 0:
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            entry["engine"] = _min_seconds(lambda: _engine_call(context, x, workload), args.inner, clock)
            entry["numpy"] = _min_seconds(lambda: _numpy_attention(np, x, workload == "train"),
                                          max(5, 4 * args.inner), clock)
        result[workload] = entry
    print("ENGINE_SPEED " + json.dumps(result), flush=True)
    return 0


# ----- the parent: alternates the builds ---------------------------------------------------------

def _build(text: str) -> tuple[str, str, str]:
    name, _, where = text.partition("=")
    if not where:
        name, where = "build", text
    if ":" in where:
        library, python = where.split(":", 1)
    else:
        root = Path(where).resolve()
        suffix = "dylib" if sys.platform == "darwin" else "so"
        library, python = str(root / ".build" / "release" / f"libFlashAttentionMetal.{suffix}"), str(root / "python")
    return name, str(Path(library).resolve()), str(Path(python).resolve())


def _run_child(build, args, workloads, calls: int, inner: int, workers: int, valgrind: str | None):
    _, library, python = build
    env = dict(os.environ, **ONE_THREAD, FLASH_ATTENTION_METAL_LIBRARY=library, PYTHONPATH=python)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--workloads", *workloads,
               "--calls", str(calls), "--inner", str(inner), "--workers", str(workers), "--clock", args.clock]
    if valgrind:
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={valgrind}", "--dump-line=no",
                   "--compress-strings=no", *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    line = next((l for l in done.stdout.splitlines() if l.startswith("ENGINE_SPEED ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"engine_speed: the child for {build[0]} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(line.removeprefix("ENGINE_SPEED "))


def instructions_in(path: str, objects: tuple[str, ...]) -> int:
    """Instructions a callgrind profile counts in the functions of the shared objects whose file
    names start with one of ``objects`` (self cost, not callees')."""
    total, counted, after_call, names = 0, False, False, {}
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith(("ob=", "cob=")):
            name = line.partition("=")[2].strip()
            if name.startswith("("):  # compressed: "(id) name" once, then "(id)"
                key, _, rest = name.partition(")")
                name = names.setdefault(key, rest.strip())
            if line.startswith("ob="):
                counted = Path(name).name.startswith(objects)
        elif line.startswith("calls="):
            after_call = True  # the next cost line is the call's inclusive cost
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if not after_call and counted and len(parts) >= 2:
                total += int(parts[-1])
            after_call = False
    return total


def _count_instructions(build, workload: str, workers: int) -> int:
    name, library, python = build
    with tempfile.TemporaryDirectory() as scratch:
        # Valgrind 3.19 gives up on the DWARF 5 of a Swift-built library: count a stripped copy.
        stripped = f"{scratch}/{Path(library).name}"
        subprocess.run(["strip", "--strip-debug", "-o", stripped, library], check=True)
        out = f"{scratch}/callgrind.out"
        _run_child((name, stripped, python), None, [workload], 1, 0, workers, out)
        return instructions_in(out, (Path(library).name, "libm."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", default=[],
                        help="NAME=CHECKOUT or NAME=LIBRARY:PYTHON_DIR (repeat to compare; default: this checkout)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3, help="processes per build (alternating)")
    parser.add_argument("--inner", type=int, default=3, help="timed engine calls per process")
    parser.add_argument("--workers", type=int, default=0, help="engine worker threads (0: one per core)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time calls by the wall clock or by the process's CPU time (all its threads)")
    parser.add_argument("--instructions", action="store_true", help="count instructions per call (valgrind)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    builds = [_build(text) for text in (args.build or [f"build={REPO}"])]
    runs = {build[0]: [] for build in builds}
    for _ in range(args.repeats):
        for build in builds:
            runs[build[0]].append(_run_child(build, args, args.workloads, 1, args.inner, args.workers, None))
    counts = {}
    if args.instructions:
        for build in builds:
            for workload in args.workloads:
                counts[build[0], workload] = _count_instructions(build, workload, 1)

    print(f"workers: {args.workers or 'one per core'}; {args.repeats} processes x {args.inner} calls per build; "
          f"{args.clock} clock")
    header = "| workload | build | engine s | NumPy s | ratio (min) | ratio (median) |"
    header += " instructions/call |" if args.instructions else ""
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for workload in args.workloads:
        for build in builds:
            entries = [run[workload] for run in runs[build[0]]]
            ratios = sorted(e["engine"] / e["numpy"] for e in entries)
            row = (f"| {workload} | {build[0]} | {min(e['engine'] for e in entries):.4f} | "
                   f"{min(e['numpy'] for e in entries):.5f} | {ratios[0]:.1f}x | {ratios[len(ratios) // 2]:.1f}x |")
            if args.instructions:
                row += f" {counts[build[0], workload]:,} |"
            print(row)
    for workload in args.workloads:
        digests = {build[0]: {run[workload]["digest"] for run in runs[build[0]]} for build in builds}
        same = len(set().union(*digests.values())) == 1
        print(f"{workload} output digests: {digests} ({'identical' if same else 'DIFFERENT'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
