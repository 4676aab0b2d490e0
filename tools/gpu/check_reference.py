"""Checks that the CUDA harness judges by the same rule as the Python package.

Builds tools/gpu/reference_dump.cpp with the host C++ compiler (no CUDA needed), and compares, for
a few harness cases (float16, bfloat16 and float32; head_dim_v != head_dim in each), its float64
reference and per-dtype baseline with python/flash_attention_metal/reference.py and accuracy.py on
the same inputs and the same float32 softmax_scale:
  - reference: max |C++ - NumPy| <= 1e-9 * max(1, max|ref|) for out, lse, dq, dk, dv;
  - baseline, float16 and bfloat16: max|base - ref| agrees within 10% (float32 sums run in another
    order), and at least 85% of the 16-bit values are identical;
  - baseline, float32: the C++ max|base - ref| lies within a factor of 2 of the range spanned by
    the NumPy rule's two float32 baselines (blocked and streamed; dsinks: or both errors are below
    the float32 rounding of its terms). Both baselines are float32 computations of the same formula that differ
    only in summation order (NumPy's BLAS blocking against the harness's fma in index order), so
    their errors are rounding noise of a few ulp, and the largest of it moves by tens of percent
    with the order alone (27% and 30% apart on two cases with modifiers). The accuracy rule itself
    accepts 2x a baseline's error, so it does not tell apart baselines
    within a factor of 2 of each other either; that factor is what this check can ask. It still
    fails a baseline that computes something else (an error far from NumPy's, in either
    direction). No element-wise bound: at one element two valid baselines may differ by the sum
    of their errors, which the triangle inequality allows anyway.
  - streamed baseline, float32 (accuracy.py's _streamed_forward/_streamed_backward, the kernels'
    order): bit for bit equal to accuracy.py's for out, lse, dq, dk, dv and the sink terms, NumPy's
    exp, log and tanh of float32 taken correctly rounded (through float64) as reference.cpp takes
    them: the same float32 operations in the same order give the same bits, so any difference is a
    formula or order that differs. Against accuracy.py's own streamed baseline (NumPy's SIMD exp,
    up to 2 ulp off in 39% of arguments, likewise tanh) the max errors only agree as rounding noise
    does: up to 1.79x apart measured (dq of the maddf32 case); asked within FLOAT32_FACTOR.
Cases with score modifiers (window, softcap, ALiBi, sinks, boolean and additive masks) pass them
as keyword arguments; with sinks, dsinks of the reference must agree like the other reference
tensors, and the dsinks base error (max_h sqrt(sum_{b,i} (base term - ref term)^2), accuracy.py's)
as the other base errors (within 10%, or a factor of 2 for float32).
A case the Python package cannot judge is skipped, not failed: bfloat16 without ml_dtypes, and
anything but float16 with head_dim_v = head_dim when the package predates the per-dtype rule.
Usage: python3 tools/gpu/check_reference.py  (needs numpy and a C++17 compiler: $CXX or c++).
Prints one line per case and "reference-check: N cases, M disagreements, S skipped"; exit status 1
on any disagreement.
"""

from __future__ import annotations

import contextlib
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


try:
    import ml_dtypes
except ImportError:  # bfloat16 cases are skipped
    ml_dtypes = None

# The package judges every dtype with head_dim_v (accuracy.slack, later accuracy.absolute_term, is
# the per-dtype rule's).
PER_DTYPE_RULE = hasattr(accuracy, "slack") or hasattr(accuracy, "absolute_term")
DTYPES = {"f16": np.float16, "f32": np.float32, "bf16": ml_dtypes.bfloat16 if ml_dtypes else None}


# float32 baselines' errors may be this factor apart (see the module docstring).
FLOAT32_FACTOR = 2.0


def _errors_agree(error_ours: float, error_numpy: float, dtype_name: str, error_blocked: float | None = None,
                  noise: float = 0.0) -> bool:
    """Whether the C++ and NumPy baselines' errors against the reference agree (module docstring).
    float32: ``error_blocked`` is NumPy's blocked order's error beside the streamed one's, and the C++
    error must lie within FLOAT32_FACTOR of the range they span; errors both below ``noise`` (the
    float32 rounding of the values they are errors of) agree."""
    if dtype_name == "f32":
        low, high = sorted((error_numpy, error_numpy if error_blocked is None else error_blocked))
        return max(error_ours, high) <= noise or low / FLOAT32_FACTOR <= error_ours <= FLOAT32_FACTOR * high
    return abs(error_ours - error_numpy) <= 0.1 * error_numpy + 1e-7


class _Float32Rounded(types.ModuleType):
    """numpy, but exp, log and tanh of float32 arrays correctly rounded (through float64), as
    reference.cpp computes them: NumPy's SIMD float32 exp is up to 2 ulp off (in 39% of arguments),
    so with its own the same order of operations gives other bits."""

    def __getattr__(self, name):
        return getattr(np, name)


def _through_float64(function):
    def rounded(x, *args, **kwargs):
        x = np.asarray(x)
        if x.dtype != np.float32:
            return function(x, *args, **kwargs)
        return function(x.astype(np.float64), *args, **kwargs).astype(np.float32)
    return rounded


@contextlib.contextmanager
def _float32_rounded():
    """reference.py and accuracy.py computing with _Float32Rounded for numpy while inside."""
    shim = _Float32Rounded("numpy_float32_rounded")
    shim.exp, shim.log, shim.tanh = (_through_float64(f) for f in (np.exp, np.log, np.tanh))
    saved = reference.np, accuracy.np
    reference.np = accuracy.np = shim
    try:
        yield
    finally:
        reference.np, accuracy.np = saved


def _rss(terms: np.ndarray, ref_terms: np.ndarray) -> float:
    # dsinks' base error: max_h sqrt(sum_{b,i} (term - ref term)^2) (accuracy.py's).
    return float(np.sqrt(np.square(terms.astype(np.float64) - ref_terms).sum(axis=(0, 2)).max()))


def _check_streamed(folder: pathlib.Path, name: str, args, options, refs, bases, ref_terms) -> tuple[list, str]:
    """Problems with the C++ streamed float32 baseline, and its base errors for the case's line.
    With NumPy's exp, log and tanh correctly rounded it must be bit for bit accuracy.py's streamed
    baseline; against accuracy.py's own (NumPy's exp) the errors within FLOAT32_FACTOR."""
    dout, q, k, v = args
    with _float32_rounded():
        grads, out, lse = accuracy._base_backward(dout, q, k, v, **options)
        exact = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads[:3])))
        if "sinks" in options:
            exact["sink_terms"] = reference.sink_terms(dout, out, lse, options["sinks"])
    problems, errors = [], []
    for tensor, expected in exact.items():
        ours = np.fromfile(folder / f"{name}.streamed_{tensor}", dtype=np.float32).reshape(expected.shape)
        if not np.array_equal(ours, expected):
            problems.append(f"streamed {tensor} ({np.mean(ours != expected):.2%} of values differ)")
        if tensor in refs:
            error_ours = np.abs(ours.astype(np.float64) - refs[tensor]).max()
            error_numpy = np.abs(bases[tensor].astype(np.float64) - refs[tensor]).max()
        elif tensor == "sink_terms":
            error_ours, error_numpy = _rss(ours, ref_terms), _rss(bases["sink_terms"], ref_terms)
        else:
            continue
        errors.append(f"{tensor} {error_ours:.2e}/{error_numpy:.2e}")
        if not error_numpy / FLOAT32_FACTOR <= error_ours <= FLOAT32_FACTOR * error_numpy:
            problems.append(f"streamed {tensor} error {error_ours:.3e} vs NumPy's {error_numpy:.3e}")
    return problems, "streamed base errors C++/NumPy: " + ", ".join(errors)


def _build(folder: pathlib.Path) -> pathlib.Path:
    exe = folder / "reference_dump"
    sources = [GPU_DIR / name for name in ("reference_dump.cpp", "cases.cpp", "reference.cpp")]
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{GPU_DIR}", *map(str, sources), "-o", str(exe)],
                   check=True)
    return exe


def _skip_reason(dtype: str, head_dim: int, head_dim_v: int) -> str:
    if DTYPES[dtype] is None:
        return "no ml_dtypes for bfloat16"
    if not PER_DTYPE_RULE and (dtype != "f16" or head_dim_v != head_dim):
        return "the Python package has no per-dtype rule"
    return ""


def _check_case(folder: pathlib.Path, line: str) -> list[str] | None:
    """Problems found for one case line of reference_dump (empty when the two agree; None when
    skipped)."""
    name, dtype_name, *numbers = line.split()
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, causal = map(int, numbers[:8])
    scale = float(np.float32(numbers[8]))
    left, right = int(numbers[9]), int(numbers[10])
    softcap = float(np.float32(numbers[11]))
    mask_kind, mask_per_batch, mask_per_head, alibi, alibi_per_batch, sinks = map(int, numbers[12:18])
    reason = _skip_reason(dtype_name, head_dim, head_dim_v)
    if reason:
        print(f"skip {name:40} {reason}")
        return None
    dtype = DTYPES[dtype_name]
    shapes = {"q": (batch, heads, seqlen_q, head_dim), "k": (batch, kv_heads, seqlen_k, head_dim),
              "v": (batch, kv_heads, seqlen_k, head_dim_v), "dout": (batch, heads, seqlen_q, head_dim_v)}

    def load(tensor: str, file_dtype, shape):
        return np.fromfile(folder / f"{name}.{tensor}", dtype=file_dtype).reshape(shape)

    # The inputs are float32 values of the dtype: the conversion is exact.
    q, k, v, dout = (load(t, np.float32, shapes[t]).astype(dtype) for t in ("q", "k", "v", "dout"))
    options = {"causal": bool(causal), "softmax_scale": scale}
    if left >= 0 or right >= 0:
        options["window_size"] = (left, right)
    if softcap > 0:
        options["softcap"] = softcap
    if mask_kind:
        mask_shape = (batch if mask_per_batch else 1, heads if mask_per_head else 1, seqlen_q, seqlen_k)
        mask = load("mask", np.float32, mask_shape)
        # boolean; additive in the dtype (exact: the values are the dtype's); additive float32
        options["attn_mask"] = mask != 0 if mask_kind == 1 else mask.astype(dtype) if mask_kind == 2 else mask
    if alibi:
        options["alibi_slopes"] = load("alibi", np.float32, (batch, heads) if alibi_per_batch else (heads,))
    if sinks:
        options["sinks"] = load("sinks", np.float32, (heads,))
    ref_out, ref_lse = reference.forward(q, k, v, **options)
    ref_grads = reference.backward(dout, q, k, v, **options)
    refs = dict(zip(("out", "dq", "dk", "dv"), (ref_out, *ref_grads[:3])))
    base_out, base_lse = accuracy.base_forward(q, k, v, **options)
    bases = dict(zip(("out", "dq", "dk", "dv"), (base_out, *accuracy.base_backward(dout, q, k, v, **options)[:3])))
    blocked = {}
    if dtype_name == "f32" and hasattr(accuracy, "_framework_backward"):
        # The rule's second float32 baseline, NumPy's blocked order (accuracy.py's docstring).
        grads, out, lse = accuracy._base_backward(dout, q, k, v, blocked=True, **options)
        blocked = dict(zip(("out", "dq", "dk", "dv", "lse"), (out, *grads[:3], lse)))

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
        error_blocked = np.abs(blocked[tensor].astype(np.float64) - ref).max() if tensor in blocked else None
        agree = _errors_agree(error_ours, error_numpy, dtype_name, error_blocked) and (
            dtype_name == "f32" or same >= 0.85)
        if not agree:
            problems.append(f"base {tensor} (error {error_ours:.3e} vs {error_numpy:.3e}, {same:.1%} identical)")
    if sinks:
        ref_dsinks = ref_grads[3]
        ours = load("ref_dsinks", np.float64, ref_dsinks.shape)
        if np.abs(ours - ref_dsinks).max() > 1e-9 * max(1.0, np.abs(ref_dsinks).max()):
            problems.append("ref dsinks")
        ref_terms = reference.sink_terms(dout.astype(np.float64), ref_out, ref_lse, options["sinks"])
        if np.abs(load("ref_sink_terms", np.float64, ref_terms.shape) - ref_terms).max() > 1e-9 * max(
                1.0, np.abs(ref_terms).max()):
            problems.append("ref sink terms")
        numpy_terms = reference.sink_terms(dout, base_out.astype(np.float32), base_lse, options["sinks"])
        ours_terms = load("base_sink_terms", np.float32, ref_terms.shape)
        error_numpy = np.sqrt(np.square(numpy_terms - ref_terms).sum(axis=(0, 2)).max())
        error_ours = np.sqrt(np.square(ours_terms - ref_terms).sum(axis=(0, 2)).max())
        error_blocked = None
        if blocked:
            blocked_terms = reference.sink_terms(dout, blocked["out"].astype(np.float32), blocked["lse"],
                                                 options["sinks"])
            error_blocked = np.sqrt(np.square(blocked_terms - ref_terms).sum(axis=(0, 2)).max())
        noise = float(np.finfo(np.float32).eps * np.abs(ref_terms).max())
        if not _errors_agree(error_ours, error_numpy, dtype_name, error_blocked, noise):
            problems.append(f"base dsinks (error {error_ours:.3e} vs {error_numpy:.3e})")
    detail = ""
    if dtype_name == "f32":
        ref_terms = None
        if sinks:
            ref_terms = reference.sink_terms(dout.astype(np.float64), ref_out, ref_lse, options["sinks"])
            bases["sink_terms"] = reference.sink_terms(dout, base_out.astype(np.float32), base_lse,
                                                       options["sinks"])
        streamed_problems, detail = _check_streamed(folder, name, (dout, q, k, v), options, refs, bases,
                                                    ref_terms)
        problems += streamed_problems
    print(f"{'ok' if not problems else 'FAIL':4} {name:40} {', '.join(problems)}")
    if detail:
        print(f"     {detail}")
    return problems


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fa-reference-check.") as temp:
        folder = pathlib.Path(temp)
        listing = subprocess.run([str(_build(folder)), str(folder)], check=True, capture_output=True,
                                 text=True).stdout.splitlines()
        results = [_check_case(folder, line) for line in listing]
    skipped = sum(1 for r in results if r is None)
    failures = sum(1 for r in results if r)
    print(f"reference-check: {len(listing)} cases, {failures} disagreements, {skipped} skipped")
    return 0 if listing and failures == 0 and skipped < len(listing) else 1


if __name__ == "__main__":
    sys.exit(main())
