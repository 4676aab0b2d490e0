"""Checks that the CUDA harness judges by the same rule as the Python package.

Builds tools/gpu/reference_dump.cpp with the host C++ compiler (no CUDA needed), and compares, for
a few harness cases, its float64 reference and float16 baseline with
python/flash_attention_metal/reference.py and accuracy.py on the same float16 inputs and the
same float32 softmax_scale:
  - reference: max |C++ - NumPy| <= 1e-9 * max(1, max|ref|) for out, lse, dq, dk, dv;
  - baseline: max|base - ref| agrees within 10% (float32 sums run in another order), and at least
    90% of the float16 values are identical.
Usage: python3 tools/gpu/check_reference.py  (needs numpy and a C++17 compiler: $CXX or c++).
Prints one line per case and "reference-check: N cases, M disagreements"; exit status 1 on any.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
import tempfile
import types

import numpy as np

GPU_DIR = pathlib.Path(__file__).resolve().parent


def _load_rule_modules():
    """reference and accuracy from python/flash_attention_metal, without the package __init__
    (which loads the native library through cffi: neither is needed, nor present on a GPU box)."""
    package = types.ModuleType("flash_attention_metal")
    package.__path__ = [str(GPU_DIR.parent.parent / "python" / "flash_attention_metal")]
    sys.modules.setdefault("flash_attention_metal", package)
    return (importlib.import_module("flash_attention_metal.reference"),
            importlib.import_module("flash_attention_metal.accuracy"))


reference, accuracy = _load_rule_modules()


def _build(folder: pathlib.Path) -> pathlib.Path:
    exe = folder / "reference_dump"
    sources = [GPU_DIR / name for name in ("reference_dump.cpp", "cases.cpp", "reference.cpp")]
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{GPU_DIR}", *map(str, sources), "-o", str(exe)],
                   check=True)
    return exe


def _check_case(folder: pathlib.Path, line: str) -> list[str]:
    """Problems found for one case line of reference_dump (empty when the two agree)."""
    name, *numbers = line.split()
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal = map(int, numbers[:7])
    scale = float(np.float32(numbers[7]))
    q_shape, kv_shape = (batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim)

    def load(tensor: str, dtype, shape):
        return np.fromfile(folder / f"{name}.{tensor}", dtype=dtype).reshape(shape)

    q, dout = load("q", np.float16, q_shape), load("dout", np.float16, q_shape)
    k, v = load("k", np.float16, kv_shape), load("v", np.float16, kv_shape)
    options = {"causal": bool(causal), "softmax_scale": scale}
    ref_out, ref_lse = reference.forward(q, k, v, **options)
    refs = dict(zip(("out", "dq", "dk", "dv"), (ref_out, *reference.backward(dout, q, k, v, **options))))
    base_out, _ = accuracy.base_forward(q, k, v, **options)
    bases = dict(zip(("out", "dq", "dk", "dv"), (base_out, *accuracy.base_backward(dout, q, k, v, **options))))

    problems = []
    ours_lse = load("ref_lse", np.float64, ref_lse.shape)
    finite = np.isfinite(ref_lse)
    if not np.array_equal(np.isfinite(ours_lse), finite) or np.abs(ours_lse[finite] - ref_lse[finite]).max(
            initial=0.0) > 1e-9 * max(1.0, np.abs(ref_lse[finite]).max(initial=0.0)):
        problems.append("lse")
    for tensor, ref in refs.items():
        ours = load(f"ref_{tensor}", np.float64, ref.shape)
        if np.abs(ours - ref).max() > 1e-9 * max(1.0, np.abs(ref).max()):
            problems.append(f"ref {tensor}")
        base_ours = load(f"base_{tensor}", np.float32, ref.shape)
        base_numpy = bases[tensor].astype(np.float32)
        error_ours = np.abs(base_ours - ref).max()
        error_numpy = np.abs(base_numpy.astype(np.float64) - ref).max()
        same = np.mean(base_ours == base_numpy)
        if abs(error_ours - error_numpy) > 0.1 * error_numpy + 1e-7 or same < 0.9:
            problems.append(f"base {tensor} (error {error_ours:.3e} vs {error_numpy:.3e}, {same:.1%} identical)")
    print(f"{'ok' if not problems else 'FAIL':4} {name:36} {', '.join(problems)}")
    return problems


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fa-reference-check.") as temp:
        folder = pathlib.Path(temp)
        listing = subprocess.run([str(_build(folder)), str(folder)], check=True, capture_output=True,
                                 text=True).stdout.splitlines()
        failures = sum(1 for line in listing if _check_case(folder, line))
    print(f"reference-check: {len(listing)} cases, {failures} disagreements")
    return 0 if listing and failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
