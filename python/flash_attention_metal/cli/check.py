"""``check``: forward and backward on real attention inputs, judged by the accuracy rule.

The built-in input is ``data/minilm_attention.npz``: attention inputs captured from
all-MiniLM-L6-v2 (key ``cases``, the case names; per case ``<name>_q``, ``<name>_k``, ``<name>_v``,
``<name>_dout``, float16 (1, 12, L, 32)). Without it (and without --input), seeded N(0, 1) input of
the same shape is used and the output says so; a file named with --input must exist and hold cases
in that format, in float16, bfloat16 or float32 (one dtype per case; NumPy saves ml_dtypes'
bfloat16 as the 2-byte void dtype 'V2', which is read back as bfloat16).
"""

from __future__ import annotations

import argparse
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import accuracy
from . import _types
from ._context import context_for

BUILTIN_INPUT = Path(__file__).resolve().parent.parent / "data" / "minilm_attention.npz"
_RANDOM_LENGTHS = (9, 64, 100, 250)
_RANDOM_SEED = 20240601
_PARTS = ("q", "k", "v", "dout")
_FORMAT = ("an array 'cases' of case names and, per case, arrays <name>_q, <name>_k, <name>_v, <name>_dout "
           "of one dtype (float16, bfloat16 or float32) and shape (batch, heads, seqlen, head_dim)")
_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


@dataclass(frozen=True)
class Case:
    """One attention input: q (B, H, Lq, D), k and v (B, Hkv, Lk, D), the incoming gradient dout
    like q, all of one dtype (float16, bfloat16 or float32)."""

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``check``."""
    parser.add_argument("--input", type=_types.input_file, default=None, metavar="FILE.npz",
                        help="an .npz of cases in the built-in input's format: " + _FORMAT
                             + " (default: the built-in input)")


def load_cases(path: Path | None, builtin: Path = BUILTIN_INPUT) -> tuple[list[Case], str]:
    """The cases of the .npz at ``path`` and a description of the source. Without a path: the
    built-in input, or seeded random input of its shapes when that file is missing (the description
    says so).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not an .npz of cases in the built-in format; one line saying what it
            lacks.
    """
    if path is None:
        if builtin.is_file():
            return read_cases(builtin), f"real attention inputs from {builtin}"
        rng = np.random.default_rng(_RANDOM_SEED)
        cases = [
            Case(f"random_L{length}", *(rng.standard_normal((1, 12, length, 32)).astype(np.float16) for _ in range(4)))
            for length in _RANDOM_LENGTHS
        ]
        return cases, f"{builtin} not found: using seeded random N(0,1) input (seed {_RANDOM_SEED}) instead"
    if not path.is_file():
        raise FileNotFoundError(f"--input: no such file: {str(path)!r}")
    return read_cases(path), f"attention inputs from {path}"


def read_cases(path: Path) -> list[Case]:
    """The cases of an .npz in the built-in input's format (see ``load_cases`` for the errors)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise ValueError(f"{path} is not an .npz archive (check needs {_FORMAT})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} holds a single array, not an .npz archive (check needs {_FORMAT})")
    with data:
        if "cases" not in data.files:
            raise ValueError(f"{path} lacks the array 'cases' (check needs {_FORMAT})")
        try:
            names = [str(name) for name in np.atleast_1d(data["cases"])]
        except ValueError:
            raise ValueError(f"{path}: 'cases' must be an array of strings (check needs {_FORMAT})") from None
        if not names:
            raise ValueError(f"{path}: 'cases' is empty")
        keys = [f"{name}_{part}" for name in names for part in _PARTS]
        missing = [key for key in keys if key not in data.files]
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ValueError(f"{path} lacks {shown} (check needs {_FORMAT})")
        arrays = {key: _as_attention_dtype(data[key]) for key in keys}
    for name in names:
        first = arrays[f"{name}_q"].dtype
        for part in _PARTS:
            key = f"{name}_{part}"
            array = arrays[key]
            if array.dtype not in _DTYPES or array.dtype != first or array.ndim != 4:
                raise ValueError(f"{path}: {key} is {array.dtype} of shape {array.shape}; check needs float16, "
                                 f"bfloat16 or float32 (batch, heads, seqlen, head_dim), the dtype of {name}_q")
    return [Case(name, *(arrays[f"{name}_{part}"] for part in _PARTS)) for name in names]


def _as_attention_dtype(array: np.ndarray) -> np.ndarray:
    """``array``, with the 2-byte void dtype that np.save gives ml_dtypes' bfloat16 read as bfloat16."""
    return array.view(ml_dtypes.bfloat16) if array.dtype == np.dtype("V2") else array


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, (time.perf_counter() - start) * 1e3


def warm_up(context, case: Case) -> None:
    """One forward and backward on ``case``, untimed, so the first timed row does not include
    one-time set-up (Metal pipelines, the engine's worker stacks)."""
    out, lse = context.forward(case.q, case.k, case.v, causal=False)
    context.backward(case.dout, case.q, case.k, case.v, out, lse, causal=False)


def run_cases(context, cases: list[Case]) -> bool:
    """Runs forward and backward on every case, non-causal and causal, after a warm-up, and prints
    one line per run with the times and each tensor's error as a fraction of its bound (the run
    passes when none exceeds 1). Returns whether all passed."""
    warm_up(context, cases[0])
    names = ("out", "lse", "dq", "dk", "dv")
    print(f"{'case':<20} {'causal':<6} {'dtype':<8} {'shape (B,H,L,D)':<16} {'fwd ms':>8} {'bwd ms':>8} "
          + " ".join(f"{name:>7}" for name in names) + "  result")
    failures = 0
    for case in cases:
        for causal in (False, True):
            (out, lse), forward_ms = _timed(context.forward, case.q, case.k, case.v, causal=causal)
            grads, backward_ms = _timed(context.backward, case.dout, case.q, case.k, case.v, out, lse, causal=causal)
            metrics = accuracy.evaluate_forward(case.q, case.k, case.v, out, lse, causal=causal)
            metrics += accuracy.evaluate_backward(case.dout, case.q, case.k, case.v, *grads, causal=causal)
            passed = all(metric.passed for metric in metrics)
            failures += not passed
            shape = ",".join(str(n) for n in case.q.shape)
            print(f"{case.name:<20} {str(causal):<6} {case.q.dtype.name:<8} {shape:<16} {forward_ms:8.2f} "
                  f"{backward_ms:8.2f} " + " ".join(f"{_fraction(m):>7.3g}" for m in metrics)
                  + f"  {'ok' if passed else 'FAIL'}")
    runs = 2 * len(cases)
    print(f"{runs - failures} of {runs} runs within the accuracy rule (out ... dv: each tensor's largest error / "
          f"its bound,\nthe bound being {accuracy.OUT_FACTOR:g}x the baseline's error for out, "
          f"{accuracy.GRAD_FACTOR:g}x for the gradients, plus twice the reference's float32 rounding; "
          f"{accuracy.LSE_RELATIVE:g} relative for lse)")
    return failures == 0


def _fraction(metric) -> float:
    return metric.error / metric.bound if metric.bound > 0 else float("inf") if metric.error > 0 else 0.0


def run(args: argparse.Namespace) -> int:
    """Prints the source, the backend and the per-run table; returns 1 if any run failed."""
    context = context_for(args.backend)
    cases, source = load_cases(args.input)
    print(f"input: {source}")
    print(f"backend: {context.backend} ({context.device})")
    return 0 if run_cases(context, cases) else 1
