#!/usr/bin/env python3
"""The structure of the kernels' tile copies, checked in the LLVM IR that clang makes of them.

Compiles the kernels as tests/static/check_address_spaces.py does (C++ for OpenCL 2021, SPIR target, the
<metal_stdlib> of tools/clcpp), at -O2 with line tables, and attributes every instruction to the
innermost source function it came from (the debug scopes survive inlining). Then it requires of the
code of the 16-byte tile copies in Shaders/flash_attention_loader.h, in every kernel: `copy_chunks`
and `copy_paired` (the paired layout), `strided_chunks` (where a thread's chunks lie) and
`TileChunks::load` (the chunk's one device load); their checked scalar path, `load_rows`, and the
chunk sources of the KV-cache kernels (a quantized cache's dequantizing `load`) are exempt:
  - no 64-bit integer multiply and no integer division or remainder (the thread's row and chunk
    are computed once per kernel in `tile_stream`; a tile moves its pointer by additions),
  - every device load 16 bytes wide and at least one such load (the copies move whole chunks),
and of the products and the forward's per-tile step (`product_transposed_over`,
`accumulate_product_over`, `forward_tile`): no 64-bit multiply and no integer division. And of the
fragment path (issue 21, item 7):
  - the per-tile steps (`forward_tile` and the products) are inlined into the key loops: no function
    of theirs is left in the module (FA_ALWAYS_INLINE), so what does not change from tile to tile
    is computed before the loop,
  - the products of two tiles (`product_transposed_over` and all that is inlined into it) widen no
    half element to float (half tiles give half operands, TileFragment), and the module has a
    multiply-accumulate of half operands into float.

Structure, not exact counts: any clang from 14 on gives the same verdict. Exit status: 0 the
structure holds, 1 it does not (each finding printed), 2 no usable clang.

Usage: tests/static/check_tile_copies.py [--clang PATH] [FILE.metal]   (default: Shaders/flash_attention.metal)
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_address_spaces  # noqa: E402  (the compile command and the clang it finds)

ROOT = check_address_spaces.ROOT
CHUNK_LOAD = "TileChunks::load"
COPIES = ("copy_chunks", "copy_paired", "strided_chunks", CHUNK_LOAD)
SCALAR_PATH = "load_rows"
PER_TILE = ("product_transposed_over", "accumulate_product_over", "forward_tile")
INLINED = ("forward_tile", "product_transposed", "product_transposed_over", "accumulate_product",
           "accumulate_product_over")
TILE_PRODUCT = "product_transposed_over"

METADATA = re.compile(r"^!(\d+) = (?:distinct )?!(\w+)\((.*)\)$")
SCOPE = re.compile(r"\bscope: !(\d+)")
INLINED_AT = re.compile(r"\binlinedAt: !(\d+)")
DEFINE = re.compile(r'^define [^@]*@"?([^"(]+)')
HALF_WIDENING = re.compile(r"=\s*fpext (?:half|<\d+ x half>) ")
HALF_INTO_FLOAT = re.compile(r"call [^@]*@\S*simdgroup_multiply_accumulateIfDhDhf")
NAME = re.compile(r'\bname: "([^"]*)"')
FILE = re.compile(r'\bfile: !(\d+)')
FILENAME = re.compile(r'\bfilename: "([^"]*)"')
LOADER = "flash_attention_loader.h"
DEBUG = re.compile(r", !dbg !(\d+)")
MUL64 = re.compile(r"=\s*mul(?: nuw| nsw)* i64 ")
DIVISION = re.compile(r"=\s*[us](?:div|rem) ")
DEVICE_LOAD = re.compile(r"=\s*load (?:volatile )?(.+?), ptr addrspace\(1\)")
DEVICE_COPY = re.compile(r"call void @llvm\.mem(?:cpy|move)\.[^(]*\(ptr addrspace\(\d+\)[^,]*, ptr addrspace\(1\)")
WIDTHS = {"<4 x i32>": 16, "<4 x float>": 16, "<8 x half>": 16, "<2 x i64>": 16, "i128": 16}


def source_functions(ir: str) -> dict[str, str]:
    """For every DILocation id, the name of the innermost source function it lies in."""
    kind, scope_of, name_of, file_of, filename = {}, {}, {}, {}, {}
    for line in ir.splitlines():
        match = METADATA.match(line)
        if not match:
            continue
        node, what, body = match.groups()
        kind[node] = what
        scope = SCOPE.search(body)
        if scope:
            scope_of[node] = scope.group(1)
        name = NAME.search(body)
        if what == "DIFile" and FILENAME.search(body):
            filename[node] = FILENAME.search(body).group(1)
        if what == "DISubprogram" and name:
            name_of[node] = name.group(1).split("<")[0]  # without template arguments
            file = FILE.search(body)
            if file:
                file_of[node] = file.group(1)
    # Every chunk source names its chunk's read `load` (line tables keep no class name): the
    # loader's is the tile's own.
    for node, name in name_of.items():
        if name == "load" and filename.get(file_of.get(node), "").endswith(LOADER):
            name_of[node] = CHUNK_LOAD

    def function(node: str) -> str:
        seen = 0
        while node in scope_of and kind.get(node) != "DISubprogram" and seen < 1000:
            node, seen = scope_of[node], seen + 1
        return name_of.get(node, "?")

    return {node: function(scope_of[node]) for node, what in kind.items()
            if what == "DILocation" and node in scope_of}


def inlined_through(ir: str) -> dict[str, set[str]]:
    """For every DILocation id, the source functions its code lies in: its innermost function and
    those its inlinedAt chain passes through."""
    where = source_functions(ir)
    inlined_at = {}
    for line in ir.splitlines():
        match = METADATA.match(line)
        if match and match.group(2) == "DILocation":
            at = INLINED_AT.search(match.group(3))
            if at:
                inlined_at[match.group(1)] = at.group(1)
    chains = {}
    for start in where:
        names, node, seen = set(), start, 0
        while node is not None and seen < 1000:
            names.add(where.get(node, "?"))
            node, seen = inlined_at.get(node), seen + 1
        chains[start] = names
    return chains


def mangled(name: str) -> str:
    """The start of the Itanium-mangled name of the free function template `name`."""
    return f"_Z{len(name)}{name}I"


def findings(ir: str) -> list[str]:
    """What the IR breaks of the rules in the module docstring (empty: it keeps them)."""
    where = source_functions(ir)
    problems: list[str] = []
    counts = collections.Counter()
    for line in ir.splitlines():
        debug = DEBUG.search(line)
        if not debug:
            continue
        function = where.get(debug.group(1), "?")
        if function in COPIES:
            load = DEVICE_LOAD.search(line)
            if load:
                width = WIDTHS.get(load.group(1).strip())
                if width is None:
                    problems.append(f"{function}: a device load narrower than 16 bytes: {line.strip()}")
                else:
                    counts["wide"] += 1
            if DEVICE_COPY.search(line):
                counts["wide"] += 1
        if function in COPIES or function in PER_TILE:
            if MUL64.search(line):
                problems.append(f"{function}: a 64-bit multiply: {line.strip()}")
            if DIVISION.search(line):
                problems.append(f"{function}: an integer division: {line.strip()}")
    if counts["wide"] == 0:
        problems.append(f"{CHUNK_LOAD}: no 16-byte device load (is the chunk read still in {CHUNK_LOAD}?)")
    return problems + fragment_findings(ir)


def fragment_findings(ir: str) -> list[str]:
    """What the IR breaks of the fragment path's rules (module docstring)."""
    chains = inlined_through(ir)
    # Each rule's first example and how often it is broken (instances repeat one template).
    first: dict[str, str] = {}
    count = collections.Counter()
    mixed = 0
    for line in ir.splitlines():
        define = DEFINE.match(line)
        if define:
            for name in INLINED:
                if define.group(1).startswith(mangled(name)):
                    rule = f"{name}: not inlined into its caller"
                    first.setdefault(rule, define.group(1))
                    count[rule] += 1
            continue
        if HALF_INTO_FLOAT.search(line):
            mixed += 1
        debug = DEBUG.search(line)
        if debug and HALF_WIDENING.search(line) and TILE_PRODUCT in chains.get(debug.group(1), ()):
            rule = f"{TILE_PRODUCT}: a half element widened to float"
            first.setdefault(rule, line.strip())
            count[rule] += 1
    problems = [f"{rule} ({count[rule]} times; first: {example})" for rule, example in first.items()]
    if mixed == 0:
        problems.append(f"{TILE_PRODUCT}: no multiply-accumulate of half operands into float")
    return problems


def compile_ir(clang: str, source: pathlib.Path) -> str:
    """The module's IR (-O2, line tables); raises RuntimeError with clang's errors."""
    command = check_address_spaces.clang_command(clang, source, "-O2", "-gline-tables-only", "-S",
                                                 "-emit-llvm", "-o", "-")
    compiled = subprocess.run(command, capture_output=True, text=True)
    if compiled.returncode != 0:
        raise RuntimeError(compiled.stderr)
    return compiled.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clang", help="the clang to use (default: $CLANG, clang on PATH, or next to swift)")
    parser.add_argument("source", nargs="?", type=pathlib.Path, default=ROOT / "Shaders" / "flash_attention.metal")
    args = parser.parse_args()
    clang = check_address_spaces.find_clang(args.clang)
    reason = "no clang found" if clang is None else check_address_spaces.usable(clang)
    if reason is not None:
        print(f"check_tile_copies: no clang that compiles C++ for OpenCL 2021 to SPIR: {reason}", file=sys.stderr)
        return 2
    try:
        ir = compile_ir(clang, args.source)
    except RuntimeError as error:
        sys.stderr.write(str(error))
        print(f"check_tile_copies: {args.source} does not compile", file=sys.stderr)
        return 1
    problems = findings(ir)
    for problem in problems:
        print(f"check_tile_copies: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_tile_copies: {args.source.name}: tile copies move 16-byte chunks without 64-bit "
              "multiplies or divisions; products and forward tiles have none either; the per-tile "
              "steps are inlined and the products of two half tiles widen no element")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
