"""Compares two dumps of the same cases bit for bit: every output that a case line of the second
dump's cases.txt lists (dump.h's format) must have the same bytes in the first dump's folder.
gpu_check.sh's step cuda-tensor-layouts: the tensor-op cases replayed in the permuted
cooperative-tensor layout against their run in the M5 layout (the kernels assume no layout, so
the bits cannot change; docs/tensor-ops.md).

Usage: python3 tests/cuda/same_bits.py FIRST_DUMP SECOND_DUMP [--name NAME]
Prints each differing or missing output and "NAME: N cases, M differ" (NAME defaults to
same-bits); exit status 1 when any differs or the second dump lists no case. Standard library only.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

OUTPUTS_FIELD = 20  # dump.h: the comma-separated outputs after the 20 fields of the problem


def differing(first: pathlib.Path, second: pathlib.Path, line: str) -> list[str]:
    """The outputs of the case on `line` whose files differ between the dumps (or are missing)."""
    fields = line.split()
    name = fields[0]
    bad = []
    for output in fields[OUTPUTS_FIELD].split(","):
        a, b = first / f"{name}.{output}", second / f"{name}.{output}"
        if not (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()):
            bad.append(f"{name}.{output}")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=pathlib.Path)
    parser.add_argument("second", type=pathlib.Path)
    parser.add_argument("--name", default="same-bits", help="the summary line's name")
    args = parser.parse_args(argv)
    listing = args.second / "cases.txt"
    lines = [line for line in (listing.read_text().splitlines() if listing.exists() else []) if line.strip()]
    cases = 0
    for line in lines:
        bad = differing(args.first, args.second, line)
        cases += bool(bad)
        for output in bad:
            print(f"DIFF {output}")
    print(f"{args.name}: {len(lines)} cases, {cases} differ")
    return 0 if lines and cases == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
