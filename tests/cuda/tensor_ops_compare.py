#!/usr/bin/env python3
"""Bit-for-bit comparison of the tensor-op emulation's outputs in the CPU engine and the CUDA build.

tests/cuda/tensor_ops_engine.txt holds the CPU engine's outputs of the cross-check runs of
tests/kernels/tensor_ops.metal (TensorOpsEngineOutputTests holds the engine to it); the CUDA
check's tensor_ops_check --write FILE writes the CUDA build's in the same format: per output,
lines of "name first" and float32 bit patterns in hex, '#' comments. Every output of the engine's
file must be in the CUDA file with the same bits.

Usage: tensor_ops_compare.py ENGINE.txt CUDA.txt
Prints the first differing element of each differing output and "cuda-tensor-identity: N
outputs, M mismatches"; exits 1 on a mismatch or a missing output.
"""
from __future__ import annotations

import pathlib
import struct
import sys


def read(path: str) -> dict[str, list[int]]:
    """Output name -> its float32 bit patterns, in element order."""
    outputs: dict[str, dict[int, list[int]]] = {}
    if not pathlib.Path(path).is_file():
        sys.exit(f"tensor_ops_compare: no file {path} (did tensor_ops_check --write run?)")
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, first, *words = line.split()
        try:
            outputs.setdefault(name, {})[int(first)] = [int(w, 16) for w in words]
        except ValueError:
            sys.exit(f"tensor_ops_compare: {path}:{number}: not 'name first hex...'")
    result = {}
    for name, parts in outputs.items():
        values: list[int] = []
        for first in sorted(parts):
            if first != len(values):
                sys.exit(f"tensor_ops_compare: {path}: {name} has a gap before element {first}")
            values.extend(parts[first])
        result[name] = values
    return result


def as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def compare(engine: dict[str, list[int]], cuda: dict[str, list[int]]) -> int:
    """Prints one line per output; returns the number of outputs that differ or are missing."""
    mismatches = 0
    for name, want in engine.items():
        got = cuda.get(name)
        if got is None:
            print(f"FAIL {name}: not in the CUDA output")
            mismatches += 1
            continue
        if len(got) != len(want):
            print(f"FAIL {name}: {len(got)} elements, the engine has {len(want)}")
            mismatches += 1
            continue
        differ = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if differ:
            i = differ[0]
            print(f"FAIL {name}: {len(differ)} of {len(want)} elements differ; element {i}: "
                  f"CUDA {got[i]:08x} ({as_float(got[i]):.9g}), engine {want[i]:08x} "
                  f"({as_float(want[i]):.9g})")
            mismatches += 1
        else:
            print(f"ok   {name}: {len(want)} elements bit-identical")
    return mismatches


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    engine, cuda = read(argv[1]), read(argv[2])
    if not engine:
        sys.exit(f"tensor_ops_compare: {argv[1]} holds no outputs")
    mismatches = compare(engine, cuda)
    print(f"cuda-tensor-identity: {len(engine)} outputs, {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
