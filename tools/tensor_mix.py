#!/usr/bin/env python3
"""Static instruction mix of Metal kernels that use Metal 4 tensor ops (issue 37).

The shared ir_mix.py (../shared/tools/ir_mix.py beside the repository; read its docstring) with
tensor-op counting added: it compiles the .metal file the same way (clang C++ for OpenCL to LLVM
IR, with tools/clcpp as <metal_stdlib>, whose <MetalPerformancePrimitives/...> declares the tensor
ops without defining them, so they stay calls) and adds these counts to every function, loop and
total it reports:

  tensor_op     mpp::tensor_ops::matmul2d::run calls: one SIMD-group tensor op each;
  tensor_flop   2 m n k per run, from the descriptor code in the instantiation's mangled name
                (m, n, k in bits 0-47, as tools/clcpp and the engine encode it): one SIMD-group's
                FLOPs; tensor_op_MxNxK counts the runs per shape;
  tensor_elem   cooperative-tensor element accesses (operator[], get_multidimensional_index,
                is_valid_element): the register moves between a kernel's own fragments and the
                op's operands, calls here as thread_elements() is for simdgroup_matrix;
  tensor_ldst   cooperative-tensor load/store from or to a tensor;
  tensor_setup  get_*_cooperative_tensor, tensor and dextents construction, slice.

The key loop of a kernel is the loop whose iteration does the most matrix FLOPs: tensor_flop plus
1024 per simdgroup MMA (an 8x8x8 multiply-accumulate, 2 x 512 FLOPs per SIMD-group). --compare
prints the key loops of --json reports side by side per iteration, per tensor op and per 1024
FLOPs, the last comparable between simdgroup_matrix and tensor-op kernels.

Usage:
  tensor_mix.py FILE.metal --kernel NAME [--kernel NAME ...] [ir_mix.py's options] [--json OUT]
  tensor_mix.py --compare A.json [B.json ...] [--labels L1,L2,...]
ir_mix.py: --ir-mix PATH, else $IR_MIX, else ../shared/tools/ir_mix.py beside the repository.
--stdlib defaults to this repository's tools/clcpp.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import re
import sys

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
CLCPP = REPOSITORY / "tools" / "clcpp"

# Call classes, tried before ir_mix's own (the first match names a call). Each pattern matches
# the demangled name or, where the demangler gives up (llvm-cxxfilt leaves the address-space
# qualifiers of clcpp's member functions, U3AS4, undemangled), the mangled one.
TENSOR_CLASSES = [
    ("tensor_op", re.compile(r"matmul2d<.*>::run(<|$)|8matmul2dI.*E3runI")),
    ("tensor_elem", re.compile(
        r"cooperative_tensor<.*>::(operator\[\]|get_multidimensional_index|is_valid_element)(<|$)"
        r"|18cooperative_tensorI.*E(ix|26get_multidimensional_index|16is_valid_element)E")),
    ("tensor_ldst", re.compile(r"cooperative_tensor<.*>::(load|store)(<|$)|18cooperative_tensorI.*E(4load|5store)I")),
    ("tensor_setup", re.compile(
        r"matmul2d<.*>::get_\w+_cooperative_tensor|metal::tensor<.*>::(tensor|slice|get_extent|get_stride)(<|$)"
        r"|metal::dextents<.*>::(dextents|extent)(<|$)|8matmul2dI.*E\d+get_\w+_cooperative_tensorI"
        r"|6tensorI.*E(C[12]|5slice|10get_extent|10get_stride)|8dextentsI.*E(C[12]|6extent)")),
]
TENSOR_COLUMNS = [
    ("tensor_op", "matmul2d::run calls (SIMD-group tensor ops)"),
    ("tensor_flop", "tensor-op FLOPs of one SIMD-group (2 m n k per run)"),
    ("tensor_elem", "cooperative-tensor element accesses (calls)"),
    ("tensor_ldst", "cooperative-tensor loads and stores from tensors"),
    ("tensor_setup", "tensor-op setup calls (operands, tensors, extents)"),
]
MMA_FLOPS = 1024  # one 8x8x8 simdgroup multiply-accumulate: 2 x 512 FLOPs
_CODE = re.compile(r"8matmul2dILy(\d+)E")


def find_ir_mix(explicit: str | None) -> pathlib.Path:
    """ir_mix.py: `explicit`, else $IR_MIX, else ../shared/tools/ir_mix.py beside the repository."""
    for candidate in (explicit, os.environ.get("IR_MIX"),
                      REPOSITORY.parent / "shared" / "tools" / "ir_mix.py"):
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    sys.exit("tensor_mix: ir_mix.py not found (pass --ir-mix PATH or set IR_MIX; it lives in "
             "../shared/tools beside the repository)")


def load_ir_mix(path: pathlib.Path):
    """ir_mix.py as a module, with the tensor-op call classes, columns and key loop added."""
    spec = importlib.util.spec_from_file_location("ir_mix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ignore = [entry for entry in module.CALL_CLASSES if entry[0] == "ignore"]
    rest = [entry for entry in module.CALL_CLASSES if entry[0] != "ignore"]
    module.CALL_CLASSES[:] = ignore + TENSOR_CLASSES + rest
    module.COLUMNS[:0] = TENSOR_COLUMNS
    module.key_loop = key_loop
    module.Analyzer = _tensor_analyzer(module)
    return module


def descriptor(code: int) -> tuple[int, int, int]:
    """(m, n, k) of a matmul2d descriptor code."""
    return code & 0xFFFF, (code >> 16) & 0xFFFF, (code >> 32) & 0xFFFF


def _tensor_analyzer(module):
    class TensorAnalyzer(module.Analyzer):
        """ir_mix's Analyzer that also counts each run's FLOPs and shape."""

        def count_instr(self, ins, c, callees):
            super().count_instr(ins, c, callees)
            if ins.op != "call":
                return
            callee = module.CALLEE.search(ins.rest)
            match = _CODE.search(ins.rest)
            if callee and match and self.callclass(callee.group(1).strip('"')) == "tensor_op":
                m, n, k = descriptor(int(match.group(1)))
                c["tensor_flop"] += 2 * m * n * k
                c[f"tensor_op_{m}x{n}x{k}"] += 1

    return TensorAnalyzer


def matrix_flops(counts: dict) -> int:
    """A loop iteration's matrix FLOPs: tensor ops' plus 1024 per simdgroup MMA."""
    return counts.get("tensor_flop", 0) + MMA_FLOPS * counts.get("mma", 0)


def key_loop(report: dict):
    """The loop whose iteration does the most matrix FLOPs (outermost on ties): (function, loop),
    or (None, None) when no loop does any."""
    best = None
    for f in report["functions"]:
        for loop in f["loops"]:
            score = (matrix_flops(loop["per_iteration"]), -loop["depth"], loop["blocks"])
            if best is None or score > best[0]:
                best = (score, f, loop)
    return (best[1], best[2]) if best and best[0][0] > 0 else (None, None)


COMPARE_ROWS = [
    ("tensor_op", "tensor ops (matmul2d::run)"), ("mma", "simdgroup MMAs"),
    ("tensor_flop", "tensor-op FLOPs (one SIMD-group)"),
    ("tensor_elem", "cooperative-tensor element accesses"), ("tensor_ldst", "cooperative-tensor loads/stores"),
    ("dev_ld", "device loads"), ("dev_ld_B", "device bytes loaded"),
    ("tg_ld", "threadgroup loads"), ("tg_ld_B", "threadgroup bytes loaded"),
    ("tg_st", "threadgroup stores"), ("tg_st_B", "threadgroup bytes stored"),
    ("cbr", "conditional branches"), ("sel", "selects"),
    ("tg_barrier", "threadgroup barriers"), ("sg_barrier", "simdgroup barriers"),
    ("exp2", "exp2 calls"), ("shuffle", "SIMD shuffles"),
    ("insts", "IR instructions"),
    ("insts_net", "IR instructions without fragment artefacts (private/generic loads and stores, "
                  "thread_elements(), cooperative-tensor element calls)"),
]


def compare(paths: list[str], labels: list[str]) -> int:
    """Markdown: the key loop of each report per iteration (core path), per tensor op and per 1024
    matrix FLOPs; then the loop's source and tensor-op shapes."""
    reports = []
    for path in paths:
        reports.extend(json.loads(pathlib.Path(path).read_text()))
    labels = labels or [r["kernel"] for r in reports]
    picked = [key_loop(r) for r in reports]
    loops = [dict(loop["per_iteration_core"]) if loop else {} for _, loop in picked]
    for c in loops:
        c["insts_net"] = (c.get("insts", 0) - c.get("pg_ldst", 0) - c.get("frag_access", 0)
                          - c.get("tensor_elem", 0))
    n = len(labels)
    print("| per key-loop iteration (core path) | " + " | ".join(labels) + " | "
          + " | ".join(f"{l} per tensor op" for l in labels) + " | "
          + " | ".join(f"{l} per 1024 FLOPs" for l in labels) + " |")
    print("|---" * (1 + 3 * n) + "|")
    for key, text in COMPARE_ROWS:
        values = [c.get(key, 0) for c in loops]
        per_op = [f"{v / c['tensor_op']:.2f}" if c.get("tensor_op") else "-" for v, c in zip(values, loops)]
        per_flop = [f"{MMA_FLOPS * v / matrix_flops(c):.2f}" if matrix_flops(c) else "-"
                    for v, c in zip(values, loops)]
        print(f"| {text} | " + " | ".join(str(v) for v in values) + " | " + " | ".join(per_op)
              + " | " + " | ".join(per_flop) + " |")
    print()
    print("| key loop | " + " | ".join(labels) + " |")
    print("|---" * (1 + n) + "|")
    print("| source | " + " | ".join(f"{loop['source']} ({f['short'].split('<')[0]})" if loop else "-"
                                     for f, loop in picked) + " |")
    print("| tensor-op shapes (m x n x k: runs) | " + " | ".join(
        ", ".join(f"{k[len('tensor_op_'):]}: {v}" for k, v in sorted(c.items())
                  if k.startswith("tensor_op_")) or "-" for c in loops) + " |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--ir-mix", help="path of ir_mix.py (default: $IR_MIX, else ../shared/tools)")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="markdown tables of these --json reports")
    parser.add_argument("--labels", help="comma-separated column labels for --compare")
    args, rest = parser.parse_known_args()
    if args.compare:
        return compare(args.compare, args.labels.split(",") if args.labels else [])
    ir_mix = load_ir_mix(find_ir_mix(args.ir_mix))
    if "--stdlib" not in rest and not any(a.startswith("--stdlib=") for a in rest):
        rest += ["--stdlib", str(CLCPP)]
    sys.argv = [sys.argv[0]] + rest
    return ir_mix.main()


if __name__ == "__main__":
    sys.exit(main())
