"""``check``: forward and backward on real attention inputs, judged by the accuracy rule.

The built-in input is ``data/minilm_attention.npz``: attention inputs captured from
all-MiniLM-L6-v2 (key ``cases``, the case names; per case ``<name>_q``, ``<name>_k``, ``<name>_v``,
``<name>_dout``, float16 (1, 12, L, 32)). Without it, seeded N(0, 1) input of the same shape is used
and the output says so.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import accuracy
from ._context import context_for

BUILTIN_INPUT = Path(__file__).resolve().parent.parent / "data" / "minilm_attention.npz"
_RANDOM_LENGTHS = (9, 64, 100, 250)
_RANDOM_SEED = 20240601


@dataclass(frozen=True)
class Case:
    """One attention input: float16 q (1, H, L, D), k, v like q, and the incoming gradient dout."""

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``check``."""
    parser.add_argument("--input", type=Path, default=BUILTIN_INPUT,
                        help="an .npz of cases in the built-in input's format (default: the built-in input)")


def load_cases(path: Path) -> tuple[list[Case], str]:
    """The cases of the .npz at ``path`` and a description of the source; seeded random input of
    the same shapes when the file does not exist."""
    if not path.is_file():
        rng = np.random.default_rng(_RANDOM_SEED)
        cases = [
            Case(f"random_L{length}", *(rng.standard_normal((1, 12, length, 32)).astype(np.float16) for _ in range(4)))
            for length in _RANDOM_LENGTHS
        ]
        return cases, f"{path} not found: using seeded random N(0,1) input (seed {_RANDOM_SEED}) instead"
    with np.load(path) as data:
        cases = [
            Case(str(name), *(data[f"{name}_{part}"] for part in ("q", "k", "v", "dout")))
            for name in data["cases"]
        ]
    return cases, f"real attention inputs from {path}"


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, (time.perf_counter() - start) * 1e3


def run_cases(context, cases: list[Case]) -> bool:
    """Runs forward and backward on every case, non-causal and causal, and prints one line per run
    with the time and each tensor's error against its bound. Returns whether all passed."""
    names = ("out", "lse", "dq", "dk", "dv")
    print(f"{'case':<24} {'causal':<6} {'shape (B,H,L,D)':<17} {'fwd ms':>8} {'bwd ms':>8}  "
          + "  ".join(f"{name + ' err/bound':>21}" for name in names) + "  result")
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
            print(f"{case.name:<24} {str(causal):<6} {shape:<17} {forward_ms:8.2f} {backward_ms:8.2f}  "
                  + "  ".join(f"{m.error:10.2e}/{m.bound:<10.2e}" for m in metrics)
                  + f"  {'ok' if passed else 'FAIL'}")
    runs = 2 * len(cases)
    print(f"{runs - failures} of {runs} runs within the accuracy rule "
          f"(out <= {accuracy.OUT_FACTOR:g}x base error, gradients <= {accuracy.GRAD_FACTOR:g}x, "
          f"lse relative <= {accuracy.LSE_RELATIVE:g})")
    return failures == 0


def run(args: argparse.Namespace) -> int:
    """Prints the source, the backend and the per-run table; returns 1 if any run failed."""
    context = context_for(args.backend)
    cases, source = load_cases(args.input)
    print(f"input: {source}")
    print(f"backend: {context.backend} ({context.device})")
    return 0 if run_cases(context, cases) else 1
