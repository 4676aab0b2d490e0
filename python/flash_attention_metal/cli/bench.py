"""``bench``: time and TFLOP/s of forward and backward over a range of sequence lengths.

FLOPs are counted as FlashAttention's benchmark counts them: 4 * B * H * Nq * Nk * D for the
forward pass (the two matrix products), halved when causal, and 2.5 times that for the backward.
"""

from __future__ import annotations

import argparse
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _types, bench_profile
from ._context import context_for
from .progress import track

_CPU_SEQLENS = (64, 128, 256, 512)
_GPU_SEQLENS = (512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Result:
    """One timed configuration: the best of ``repeats`` runs, in milliseconds."""

    seqlen: int
    causal: bool
    forward_ms: float
    backward_ms: float
    forward_flops: float

    @property
    def forward_tflops(self) -> float:
        return self.forward_flops / (self.forward_ms * 1e-3) / 1e12

    @property
    def backward_tflops(self) -> float:
        return 2.5 * self.forward_flops / (self.backward_ms * 1e-3) / 1e12


def forward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """FlashAttention's forward FLOP count: 4 B H Nq Nk D, halved for causal (backward: 2.5x)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``."""
    parser.add_argument("--seqlens", type=_types.positive_int, nargs="+", default=None,
                        help=f"sequence lengths (default: {' '.join(map(str, _CPU_SEQLENS))} on the CPU "
                             f"engine, {' '.join(map(str, _GPU_SEQLENS))} on Metal)")
    parser.add_argument("--batch", type=_types.positive_int, default=1)
    parser.add_argument("--heads", type=_types.positive_int, default=8)
    parser.add_argument("--head-dim", type=_types.positive_int, default=64,
                        help="1..the library's largest head_dim (see `info`)")
    parser.add_argument("--repeats", type=_types.positive_int, default=3,
                        help="timed runs per configuration; the best counts")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("--plot", type=_types.output_file, default=None, metavar="FILE.png",
                        help="save a TFLOP/s plot (needs matplotlib: pip install 'flash_attention_metal[bench]')")
    bench_profile.add_argument(parser)


def best_ms(function, repeats: int) -> float:
    """Best wall time of `repeats` calls of `function` after one warm-up call, in milliseconds."""
    function()  # warm-up: pipelines, caches, first-touch of the outputs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _inputs(seqlen: int, args: argparse.Namespace) -> list[np.ndarray]:
    """Seeded N(0, 1) float16 q, k, v, dout; MemoryError with the sizes when they do not fit."""
    shape = (args.batch, args.heads, seqlen, args.head_dim)
    rng = np.random.default_rng(seqlen)
    try:
        return [rng.standard_normal(shape).astype(np.float16) for _ in range(4)]
    except (MemoryError, ValueError) as error:
        gib = 4 * 2 * float(np.prod(shape, dtype=np.float64)) / 2**30
        raise MemoryError(
            f"cannot allocate the inputs of seqlen {seqlen} (q, k, v, dout of shape {shape}: "
            f"{gib:.3g} GiB in float16, plus float64 scratch while generating them); "
            f"use smaller --seqlens, --batch, --heads or --head-dim"
        ) from error


def measure(context, seqlen: int, causal: bool, args: argparse.Namespace) -> Result:
    """Times forward and backward for one sequence length (Nq = Nk = seqlen)."""
    q, k, v, dout = _inputs(seqlen, args)
    out, lse = context.forward(q, k, v, causal=causal)
    forward_ms = best_ms(lambda: context.forward(q, k, v, causal=causal), args.repeats)
    backward_ms = best_ms(lambda: context.backward(dout, q, k, v, out, lse, causal=causal), args.repeats)
    flops = forward_flops(args.batch, args.heads, seqlen, seqlen, args.head_dim, causal)
    return Result(seqlen, causal, forward_ms, backward_ms, flops)


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError as error:
        raise OSError("--plot needs matplotlib: pip install 'flash_attention_metal[bench]'") from error
    return matplotlib


def plot(results: list[Result], path: Path, title: str) -> None:
    """Saves TFLOP/s against sequence length, forward and backward, causal and not, to ``path``."""
    matplotlib = _require_matplotlib()
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for causal in sorted({r.causal for r in results}):
        rows = [r for r in results if r.causal == causal]
        label = "causal" if causal else "non-causal"
        axes.plot([r.seqlen for r in rows], [r.forward_tflops for r in rows], "o-", label=f"forward, {label}")
        axes.plot([r.seqlen for r in rows], [r.backward_tflops for r in rows], "s--", label=f"backward, {label}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("sequence length (Nq = Nk)")
    axes.set_ylabel("TFLOP/s")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def run(args: argparse.Namespace) -> int:
    """Prints one row per configuration (ms and TFLOP/s) and optionally saves the plot; returns 0."""
    context = context_for(args.backend)
    if args.profile:
        context = bench_profile.ProfileRecorder(context)
    if args.head_dim > context.max_head_dim:
        raise ValueError(f"--head-dim must be in 1..{context.max_head_dim} (the library's largest head_dim), "
                         f"got {args.head_dim}")
    if args.plot is not None:
        _require_matplotlib()
    seqlens = args.seqlens or (_CPU_SEQLENS if context.backend == "cpu" else _GPU_SEQLENS)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    configs = [(seqlen, causal) for seqlen in seqlens for causal in modes]
    title = (f"{context.backend} ({context.device}): B={args.batch} H={args.heads} D={args.head_dim}")
    print(title)
    # closing() clears the progress line before an error propagates, so the message gets its own line.
    with closing(track(configs, len(configs), "bench")) as progress:
        results = [measure(context, seqlen, causal, args) for seqlen, causal in progress]
    print(f"{'seqlen':>7} {'causal':>6} {'fwd ms':>10} {'fwd TFLOP/s':>12} {'bwd ms':>10} {'bwd TFLOP/s':>12}")
    for r in results:
        print(f"{r.seqlen:>7} {str(r.causal):>6} {r.forward_ms:>10.3f} {r.forward_tflops:>12.4g} "
              f"{r.backward_ms:>10.3f} {r.backward_tflops:>12.4g}")
    if args.profile:
        bench_profile.print_profiles(context)
    if args.plot is not None:
        plot(results, args.plot, title)
        print(f"plot saved to {args.plot}")
    return 0
