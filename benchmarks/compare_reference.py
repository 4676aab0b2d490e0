#!/usr/bin/env python3
"""The library against the NumPy float64 reference, side by side: time and peak memory.

The reference materializes the (B, H, Nq, Nk) attention matrix (and a few temporaries of that
size); the library's kernels keep it in threadgroup-sized tiles. For each sequence length this
prints the best-of-N time of forward and forward+backward for both, and the peak memory each call
adds, measured in a fresh child process per call as the growth of the peak resident set size over
the resident size just before the call (after a small warm-up call, so one-time set-up such as the
engine's worker stacks is not counted). On Linux the peak is VmHWM of /proc/self/status, reset
through /proc/self/clear_refs just before the call (ru_maxrss would carry the parent's peak across
fork and exec); elsewhere it is ru_maxrss. Ratios are reference / library; a library growth below
the measurement resolution shows the memory ratio as a lower bound ("> N").

Usage: python benchmarks/compare_reference.py [--backend cpu] [--seqlens 256 512 1024]
       [--batch 1] [--heads 8] [--head-dim 64] [--repeats 3] [--causal]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import flash_attention_metal as fam
from flash_attention_metal import reference
from flash_attention_metal.cli.bench import best_ms

_KIB = 1024


def _inputs(args, seqlen: int):
    rng = np.random.default_rng(seqlen)
    shape = (args.batch, args.heads, seqlen, args.head_dim)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(4)]


def _operations(context, args, seqlen: int):
    """name -> zero-argument callable for the four measured operations at this seqlen."""
    q, k, v, dout = _inputs(args, seqlen)
    causal = args.causal

    def library_both():
        out, lse = context.forward(q, k, v, causal=causal)
        context.backward(dout, q, k, v, out, lse, causal=causal)

    def reference_both():
        reference.forward(q, k, v, causal=causal)
        reference.backward(dout, q, k, v, causal=causal)

    return {
        "library forward": lambda: context.forward(q, k, v, causal=causal),
        "reference forward": lambda: reference.forward(q, k, v, causal=causal),
        "library fwd+bwd": library_both,
        "reference fwd+bwd": reference_both,
    }


_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * _KIB
    raise RuntimeError(f"{field} missing from {_STATUS}")


def _measure_peak_growth(operation) -> int:
    """Bytes by which the peak resident set size during operation() exceeds the size before it."""
    if _STATUS.is_file():
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        before = _status_bytes("VmRSS")
        operation()
        return max(0, _status_bytes("VmHWM") - before)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    operation()
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)  # bytes on macOS


def _child(args) -> None:
    """Runs one operation once in this fresh process and prints its peak memory growth as JSON."""
    context = fam.Context(args.backend)
    _operations(context, args, 16)[args.child_operation]()
    operation = _operations(context, args, args.child_seqlen)[args.child_operation]
    print(json.dumps({"peak_growth_bytes": _measure_peak_growth(operation)}))


def _peak_growth(args, operation: str, seqlen: int) -> int:
    command = [sys.executable, __file__, "--child-operation", operation, "--child-seqlen", str(seqlen),
               "--backend", args.backend, "--batch", str(args.batch), "--heads", str(args.heads),
               "--head-dim", str(args.head_dim)] + (["--causal"] if args.causal else [])
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_growth_bytes"]


def resolution_bytes() -> int:
    """Smallest nonzero growth _measure_peak_growth can report: 1 KiB on Linux (/proc counts in
    kB), a page elsewhere (ru_maxrss grows page by page)."""
    return _KIB if _STATUS.is_file() else resource.getpagesize()


def memory_ratio(ref_bytes: int, lib_bytes: int, resolution: int) -> str:
    """ref/lib as an 8-wide column. A library growth below the measurement resolution (reported
    as 0) bounds the ratio only from below: "> N" with N = ref / resolution, or "n/a" when the
    reference grew by nothing measurable either."""
    if lib_bytes >= resolution:
        return f"{ref_bytes / lib_bytes:8.1f}"
    if ref_bytes >= resolution:
        return f"{'> ' + format(ref_bytes / resolution, '.0f'):>8}"
    return f"{'n/a':>8}"


def _mib(n: float) -> str:
    return f"{n / _KIB / _KIB:9.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=fam.BACKENDS, default="auto")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--child-operation", help=argparse.SUPPRESS)
    parser.add_argument("--child-seqlen", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_operation:
        _child(args)
        return 0

    context = fam.Context(args.backend)
    print(f"backend {context.backend} ({context.device}); B={args.batch} H={args.heads} D={args.head_dim} "
          f"causal={args.causal}; time: best of {args.repeats}; memory: peak RSS growth of one call")
    print(f"{'seqlen':>6} {'operation':<9} {'lib ms':>9} {'ref ms':>9} {'ref/lib':>8}   "
          f"{'lib MiB':>9} {'ref MiB':>9} {'ref/lib':>8}   {'P matrix MiB':>12}")
    for seqlen in args.seqlens:
        operations = _operations(context, args, seqlen)
        matrix_bytes = args.batch * args.heads * seqlen * seqlen * 8  # one float64 (B, H, N, N)
        for label in ("forward", "fwd+bwd"):
            lib_ms = best_ms(operations[f"library {label}"], args.repeats)
            ref_ms = best_ms(operations[f"reference {label}"], args.repeats)
            lib_mem = _peak_growth(args, f"library {label}", seqlen)
            ref_mem = _peak_growth(args, f"reference {label}", seqlen)
            ratio = memory_ratio(ref_mem, lib_mem, resolution_bytes())
            print(f"{seqlen:>6} {label:<9} {lib_ms:9.2f} {ref_ms:9.2f} {ref_ms / lib_ms:8.2f}   "
                  f"{_mib(lib_mem)} {_mib(ref_mem)} {ratio}   {_mib(matrix_bytes):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
