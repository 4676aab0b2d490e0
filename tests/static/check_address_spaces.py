#!/usr/bin/env python3
"""A second compiler for the kernels, one that enforces MSL's address spaces.

Compiles each .metal file unmodified with clang as C++ for OpenCL 2021 (-x clcpp
-cl-std=clc++2021), with tools/clcpp/metal_stdlib mapping device, threadgroup, constant and thread
to __global, __local, __constant and __private and declaring the rest of MSL the kernels use. clang
emits LLVM IR for the SPIR target, which instantiates every template a kernel uses; the check then
requires one emitted kernel for every kernel the preprocessed source defines. Warnings are errors,
as for `xcrun metal -Werror` in build.sh. Each file is checked at every language version a front end
compiles the kernels at (MSL_VERSIONS: the Swift host 3.0 or 3.1, PyTorch's compile_shader 3.1 and
later, MLX the newest its SDK has, up to 4.1), with __HAVE_BFLOAT__ from 3.1 as Apple's compiler
defines it, so that every preprocessor path of the kernels is compiled; a file that includes
<MetalPerformancePrimitives/...> (the tensor-op library, compiled at MSL 4.0) from 4.0 only.

Usage: tests/static/check_address_spaces.py [--clang PATH] [--min-msl X.Y] [FILE.metal ...]
                                            (default: Shaders/*.metal; --min-msl: only versions from X.Y,
                                            for a source only a newer front end compiles)
       tests/static/check_address_spaces.py [--clang PATH] --probe   (only look for a usable clang)
Exit status: 0 all compiled (--probe: a usable clang found), 1 a compile error or a kernel not
emitted, 2 no usable clang.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER_DIR = ROOT / "tools" / "clcpp"
KERNEL_DEFINITION = re.compile(r"\b(?:__)?kernel\s+void\s+(\w+)\s*\(")
TENSOR_OPS_INCLUDE = re.compile(r"^\s*#\s*include\s*<MetalPerformancePrimitives/", re.MULTILINE)
EMITTED_KERNEL = re.compile(r"^define\b[^@]*\bspir_kernel\b[^@]*@\"?([\w.$]+)\"?\(", re.MULTILINE)


#: (__METAL_VERSION__, whether the compiler has bfloat) of every MSL version a front end uses.
MSL_VERSIONS = ((300, False), (310, True), (320, True), (400, True), (410, True))


def version_name(version: int) -> str:
    """300 -> "3.0"."""
    return f"{version // 100}.{version // 10 % 10}"


def find_clang(explicit: str | None) -> str | None:
    """--clang, $CLANG, clang on PATH, or the clang next to swift (Swift toolchains ship one)."""
    for candidate in (explicit, os.environ.get("CLANG"), shutil.which("clang")):
        if candidate:
            return candidate
    swift = shutil.which("swift")
    if swift:
        beside = pathlib.Path(swift).resolve().parent / "clang"
        if beside.is_file():
            return str(beside)
    return None


def clang_command(clang: str, source: pathlib.Path, *extra: str, version: tuple[int, bool] = MSL_VERSIONS[-1]) -> list[str]:
    number, bfloat = version
    return [
        clang, "-x", "clcpp", "-cl-std=clc++2021", "-target", "spir64",
        # Only our <metal_stdlib>: neither OpenCL's default header nor the host's headers.
        "-cl-no-stdinc", "-nostdinc", "-I", str(HEADER_DIR), "-I", str(source.parent),
        f"-D__METAL_VERSION__={number}", *(["-D__HAVE_BFLOAT__"] if bfloat else []), "-Werror", *extra, str(source),
    ]


#: A folder where identical compiles to LLVM IR are shared (emit_ir): tests/python/conftest.py sets it
#: for one pytest run and its workers, so that the IR tests compile each input once.
IR_CACHE_ENV = "FA_IR_CACHE"


def emit_ir(clang: str, source: pathlib.Path, *extra: str,
            version: tuple[int, bool] = MSL_VERSIONS[-1]) -> subprocess.CompletedProcess:
    """clang's LLVM IR of ``source`` (-S -emit-llvm to stdout) with ``extra`` flags. With
    $FA_IR_CACHE naming a folder, a successful compile is kept there under a hash of the clang, the
    flags and the preprocessed source (line markers included), so that another one of the same input
    (another version whose preprocessed source is the same, another test, another process) reads it
    instead of compiling again; one process compiles while the others wait on its lock."""
    command = clang_command(clang, source, *extra, "-S", "-emit-llvm", "-o", "-", version=version)
    folder = os.environ.get(IR_CACHE_ENV)
    if not folder:
        return subprocess.run(command, capture_output=True, text=True)
    preprocessed = subprocess.run(clang_command(clang, source, "-E", version=version), capture_output=True, text=True)
    if preprocessed.returncode != 0:
        return subprocess.run(command, capture_output=True, text=True)
    key = hashlib.sha256("\0".join([clang, *extra, preprocessed.stdout]).encode()).hexdigest()
    cached = pathlib.Path(folder) / f"{key}.ll"
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    with open(cached.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            return subprocess.CompletedProcess(command, 0, cached.read_text(), "")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode == 0:
            partial = cached.with_suffix(".partial")
            partial.write_text(result.stdout)
            partial.replace(cached)
        return result


def usable(clang: str) -> str | None:
    """None when clang compiles C++ for OpenCL 2021 to SPIR IR, else why not."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = pathlib.Path(tmp) / "probe.metal"
        probe.write_text("kernel void probe(__global float *x) { x[0] = 1.0f; }\n", encoding="utf-8")
        try:
            run = subprocess.run(clang_command(clang, probe, "-S", "-emit-llvm", "-o", os.devnull),
                                 capture_output=True, text=True)
        except OSError as error:
            return str(error)
        return None if run.returncode == 0 else (run.stderr.strip() or f"exit status {run.returncode}")


def check(clang: str, source: pathlib.Path, min_version: int = 0) -> bool:
    """Compiles one file at every version of MSL_VERSIONS, stopping at the first failure; prints
    what it found; True when every defined kernel was emitted at every version (from min_version,
    e.g. 310). A version whose
    preprocessed source equals one already compiled is not compiled again (the same input gives
    the same result)."""
    compiled: dict[str, int] = {}
    # Metal 4's tensor ops exist from MSL 4.0: the host compiles their library at 4.0 only.
    tensor_ops = TENSOR_OPS_INCLUDE.search(source.read_text(encoding="utf-8")) is not None
    for version in MSL_VERSIONS:
        if (tensor_ops and version[0] < 400) or version[0] < min_version:
            continue
        where = f"{source} (MSL {version_name(version[0])})"
        preprocessed = subprocess.run(clang_command(clang, source, "-E", "-P", version=version),
                                      capture_output=True, text=True)
        if preprocessed.returncode != 0:
            sys.stderr.write(preprocessed.stderr)
            print(f"check_address_spaces: {where}: the preprocessor failed", file=sys.stderr)
            return False
        count = compiled.get(preprocessed.stdout)
        if count is None:
            count = compile_kernels(clang, source, version, set(KERNEL_DEFINITION.findall(preprocessed.stdout)))
            if count is None:
                return False
            compiled[preprocessed.stdout] = count
        print(f"check_address_spaces: {source.name} (MSL {version_name(version[0])}): {count} kernels compiled "
              "with MSL address spaces enforced")
    return True


def compile_kernels(clang: str, source: pathlib.Path, version: tuple[int, bool], defined: set[str]) -> int | None:
    """Compiles one file at one (__METAL_VERSION__, bfloat); the number of kernels emitted, or None
    (after printing why) when it does not compile or a kernel of `defined` is not emitted."""
    where = f"{source} (MSL {version_name(version[0])})"
    compiled = emit_ir(clang, source, version=version)
    if compiled.returncode != 0:
        sys.stderr.write(compiled.stderr)
        print(f"check_address_spaces: {where}: does not compile as C++ for OpenCL 2021 (address spaces "
              "enforced); see the errors above", file=sys.stderr)
        return None
    emitted = set(EMITTED_KERNEL.findall(compiled.stdout))
    missing = sorted(defined - emitted)
    if not defined or missing:
        print(f"check_address_spaces: {where}: kernels defined but not emitted: {missing or 'none defined'}",
              file=sys.stderr)
        return None
    return len(emitted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clang", help="the clang to use (default: $CLANG, clang on PATH, or next to swift)")
    parser.add_argument("--probe", action="store_true", help="only look for a usable clang: exit 0 or 2")
    parser.add_argument("--min-msl", default="3.0", help="the oldest MSL version to compile at (default: 3.0)")
    parser.add_argument("sources", nargs="*", type=pathlib.Path)
    args = parser.parse_args()
    sources = args.sources or sorted((ROOT / "Shaders").glob("*.metal"))
    clang = find_clang(args.clang)
    if clang is None:
        print("check_address_spaces: no clang found (install clang 14 or later, or set CLANG)", file=sys.stderr)
        return 2
    reason = usable(clang)
    if reason is not None:
        print(f"check_address_spaces: {clang} cannot compile C++ for OpenCL 2021 to SPIR (clang 14 or later "
              f"is needed): {reason}", file=sys.stderr)
        return 2
    if args.probe:
        print(f"check_address_spaces: {clang} compiles C++ for OpenCL 2021")
        return 0
    major, _, minor = args.min_msl.partition(".")
    min_version = int(major) * 100 + int(minor or 0) * 10
    if min_version not in {version for version, _ in MSL_VERSIONS}:
        print(f"check_address_spaces: --min-msl {args.min_msl} is none of the versions a front end uses "
              f"({', '.join(version_name(v) for v, _ in MSL_VERSIONS)})", file=sys.stderr)
        return 2
    results = [check(clang, source, min_version) for source in sources]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
