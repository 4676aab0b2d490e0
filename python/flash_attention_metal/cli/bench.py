"""``bench``: time and throughput of forward and backward over a range of sequence lengths, with
``--compare`` the library side by side with its peers (``compare.py``), or with ``--decode`` the
forward time of decode shapes (``bench_decode.py``). The command on top: it imports those and
``_measure`` (FLOP count, timing, units), never the other way round.
"""

from __future__ import annotations

import argparse
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _types, bench_decode, bench_profile, compare
from ._context import context_for
from ._measure import MATPLOTLIB_HINT, best_ms, forward_flops, plot_path, pyplot, random_inputs, throughput_unit
from .progress import track

_CPU_SEQLENS = (64, 128, 256, 512)
_GPU_SEQLENS = (512, 1024, 2048, 4096, 8192)
_HEAD_DIM = 64
_HEADS = 8


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``."""
    parser.add_argument("--seqlens", type=_types.positive_int, nargs="+", default=None,
                        help=f"sequence lengths (default: {' '.join(map(str, _CPU_SEQLENS))} on the CPU "
                             f"engine, {' '.join(map(str, _GPU_SEQLENS))} on Metal; with --compare: "
                             f"{' '.join(map(str, compare.CPU_SEQLENS))} on the CPU engine, "
                             f"{' '.join(map(str, compare.GPU_SEQLENS))} on Metal)")
    parser.add_argument("--batch", type=_types.positive_int, default=1, help="batch size (default: %(default)s)")
    parser.add_argument("--heads", type=_types.positive_int, default=None,
                        help=f"query heads (default: {_HEADS}, with --decode {bench_decode.HEADS}; --compare's GQA "
                             f"cases use a quarter as KV heads)")
    parser.add_argument("--head-dim", type=_types.head_dim, default=None,
                        help=f"1..the library's largest head_dim, see `info` (default: {_HEAD_DIM}; with "
                             f"--compare: {' and '.join(map(str, compare.HEAD_DIMS))}; with --decode: "
                             f"{bench_decode.HEAD_DIM})")
    parser.add_argument("--repeats", type=_types.positive_int, default=3,
                        help="timed runs per configuration after one warm-up run; the best counts "
                             "(default: %(default)s)")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both",
                        help="causal masking of the measured runs (default: %(default)s)")
    parser.add_argument("--plot", type=_types.output_file, default=None, metavar="FILE.png",
                        help=f"save a plot; .png is added to a name without a suffix (needs matplotlib: "
                             f"{MATPLOTLIB_HINT})")
    compare.add_arguments(parser)
    bench_decode.add_arguments(parser)
    bench_profile.add_argument(parser)


def _inputs(seqlen: int, args: argparse.Namespace) -> list[np.ndarray]:
    """Seeded N(0, 1) float16 q, k, v, dout; MemoryError with the sizes when they do not fit."""
    return random_inputs([(args.batch, args.heads, seqlen, args.head_dim)] * 4, seqlen, f"seqlen {seqlen}")


def measure(context, seqlen: int, causal: bool, args: argparse.Namespace) -> Result:
    """Times forward and backward for one sequence length (Nq = Nk = seqlen)."""
    q, k, v, dout = _inputs(seqlen, args)
    out, lse = context.forward(q, k, v, causal=causal)
    forward_ms = best_ms(lambda: context.forward(q, k, v, causal=causal), args.repeats)
    backward_ms = best_ms(lambda: context.backward(dout, q, k, v, out, lse, causal=causal), args.repeats)
    flops = forward_flops(args.batch, args.heads, seqlen, seqlen, args.head_dim, causal)
    return Result(seqlen, causal, forward_ms, backward_ms, flops)


def plot(results: list[Result], path: Path, title: str) -> None:
    """Saves throughput and milliseconds against sequence length, forward and backward, causal and
    not, to ``path``: throughput from zero (GFLOP/s when below 1 TFLOP/s), milliseconds on a log
    scale, the measured lengths as ticks, the legend below the panels."""
    plt = pyplot()
    scale, unit = throughput_unit([r.forward_tflops for r in results] + [r.backward_tflops for r in results])
    seqlens = sorted({r.seqlen for r in results})
    figure, (rate, time) = plt.subplots(1, 2, figsize=(11, 4.8))
    for causal in sorted({r.causal for r in results}):
        rows = [r for r in results if r.causal == causal]
        label = "causal" if causal else "non-causal"
        x = [r.seqlen for r in rows]
        rate.plot(x, [r.forward_tflops * scale for r in rows], "o-", label=f"forward, {label}")
        rate.plot(x, [r.backward_tflops * scale for r in rows], "s--", label=f"backward, {label}")
        time.plot(x, [r.forward_ms for r in rows], "o-")
        time.plot(x, [r.backward_ms for r in rows], "s--")
    for axes in (rate, time):
        axes.set_xscale("log", base=2)
        axes.set_xticks(seqlens, [str(n) for n in seqlens])
        axes.minorticks_off()
        axes.set_xlabel("sequence length, Nq = Nk")
        axes.grid(True, alpha=0.3)
    rate.set_ylim(bottom=0)
    rate.set_ylabel(unit)
    time.set_yscale("log")
    time.set_ylabel("milliseconds, log scale")
    figure.suptitle(title)
    figure.legend(loc="lower center", ncol=4, frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def check_head_dim(args: argparse.Namespace, context) -> None:
    """A usage error (exit status 2 and the usage line, as for the other option ranges) when
    --head-dim exceeds the library's largest head_dim, which only the loaded library knows."""
    if args.head_dim is not None and args.head_dim > context.max_head_dim:
        args.usage_error(f"argument --head-dim: must be in {_types.head_dim_range(context.max_head_dim)}, "
                         f"got {args.head_dim}")


def run(args: argparse.Namespace) -> int:
    """Prints one row per configuration (ms and TFLOP/s, or GFLOP/s when all are below 1) and optionally saves the plot; returns 0.
    With --compare, runs ``compare.run`` instead."""
    if args.json is not None and args.compare is None:
        args.usage_error("argument --json: needs --compare (the sweep prints its table only)")
    args.heads = args.heads or (bench_decode.HEADS if args.decode else _HEADS)
    bench_decode.check_options(args)
    context = context_for(args.backend)
    check_head_dim(args, context)
    if args.profile:
        context = bench_profile.ProfileRecorder(context)
    plot_file = None
    if args.plot is not None:
        try:
            plot_file = plot_path(args.plot)
        except ValueError as error:
            args.usage_error(f"argument --plot: {error}")
    if args.compare is not None:
        status = compare.run(args, context, plot_file)
        if args.profile:
            bench_profile.print_profiles(context)
        return status
    if args.decode:
        bench_decode.run(args, context)
        if args.profile:
            bench_profile.print_profiles(context)
        return 0
    args.head_dim = args.head_dim or _HEAD_DIM
    seqlens = args.seqlens or (_CPU_SEQLENS if context.backend == "cpu" else _GPU_SEQLENS)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    configs = [(seqlen, causal) for seqlen in seqlens for causal in modes]
    title = f"{context.backend} backend, {context.device}; B={args.batch} H={args.heads} D={args.head_dim}"
    print(title)
    # closing() clears the progress line before an error propagates, so the message gets its own line.
    with closing(track(configs, len(configs), "bench")) as progress:
        results = [measure(context, seqlen, causal, args) for seqlen, causal in progress]
    # The plot's unit: GFLOP/s where every figure is below 1 TFLOP/s (the CPU engine).
    scale, unit = throughput_unit([r.forward_tflops for r in results] + [r.backward_tflops for r in results])
    print(f"{'seqlen':>7} {'causal':>6} {'fwd ms':>10} {'fwd ' + unit:>12} {'bwd ms':>10} {'bwd ' + unit:>12}")
    for r in results:
        print(f"{r.seqlen:>7} {str(r.causal):>6} {r.forward_ms:>10.3f} {r.forward_tflops * scale:>12.4g} "
              f"{r.backward_ms:>10.3f} {r.backward_tflops * scale:>12.4g}")
    if args.profile:
        bench_profile.print_profiles(context)
    if plot_file is not None:
        plot(results, plot_file, title)
        print(f"plot saved to {plot_file}")
    return 0
