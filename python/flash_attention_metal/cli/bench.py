"""``bench``: time and TFLOP/s of forward and backward over a range of sequence lengths, with
``--compare`` the library side by side with its peers (``compare.py``), or with ``--decode`` the
forward time of decode shapes (``bench_decode.py``).

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

from . import _types, bench_decode, bench_profile
from ._context import context_for
from .progress import track

_CPU_SEQLENS = (64, 128, 256, 512)
_GPU_SEQLENS = (512, 1024, 2048, 4096, 8192)
_HEAD_DIM = 64
_HEADS = 8
# One wording wherever matplotlib is missing (the README says the same).
MATPLOTLIB_HINT = 'pip install matplotlib (or, in the repository: pip install -e "python[bench]")'


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
    from . import compare

    parser.add_argument("--seqlens", type=_types.positive_int, nargs="+", default=None,
                        help=f"sequence lengths (default: {' '.join(map(str, _CPU_SEQLENS))} on the CPU "
                             f"engine, {' '.join(map(str, _GPU_SEQLENS))} on Metal; with --compare: "
                             f"{' '.join(map(str, compare.CPU_SEQLENS))} on the CPU engine, "
                             f"{' '.join(map(str, compare.GPU_SEQLENS))} on Metal)")
    parser.add_argument("--batch", type=_types.positive_int, default=1, help="batch size (default: %(default)s)")
    parser.add_argument("--heads", type=_types.positive_int, default=None,
                        help=f"query heads (default: {_HEADS}, with --decode {bench_decode.HEADS}; --compare's GQA "
                             f"cases use a quarter as KV heads)")
    parser.add_argument("--head-dim", type=_types.positive_int, default=None,
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


def best_ms(function, repeats: int) -> float:
    """Best wall time of `repeats` calls of `function` after one warm-up call, in milliseconds."""
    function()  # warm-up: pipelines, caches, first-touch of the outputs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def random_inputs(shapes, seed: int, what: str) -> list[np.ndarray]:
    """Seeded N(0, 1) float16 arrays of ``shapes`` (q, k, v, dout); MemoryError naming ``what``,
    the shapes and the options that shrink them when they do not fit."""
    rng = np.random.default_rng(seed)
    try:
        return [rng.standard_normal(shape).astype(np.float16) for shape in shapes]
    except (MemoryError, ValueError) as error:
        gib = 2 * sum(float(np.prod(shape, dtype=np.float64)) for shape in shapes) / 2**30
        raise MemoryError(
            f"cannot allocate the inputs of {what} (q, k, v, dout of shapes {', '.join(map(str, shapes))}: "
            f"{gib:.3g} GiB in float16, plus float64 scratch while generating them); "
            f"use smaller --seqlens, --batch, --heads or --head-dim"
        ) from error


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


def throughput_unit(tflops) -> tuple[float, str]:
    """(factor, name) to show TFLOP/s figures in: GFLOP/s when every finite one is below 1."""
    finite = [t for t in tflops if np.isfinite(t)]
    return (1.0, "TFLOP/s") if finite and max(finite) >= 1 else (1e3, "GFLOP/s")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; OSError with the install hint if missing."""
    try:
        import matplotlib
    except ImportError as error:
        raise OSError(f"--plot needs matplotlib: {MATPLOTLIB_HINT}") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def plot_path(path: Path) -> Path:
    """The file a plot is written to: ``path``, with .png added when it has no suffix. Raises
    ValueError when matplotlib cannot write the suffix's format, OSError when matplotlib is missing
    (checked before the measurements)."""
    path = path if path.suffix else path.with_name(path.name + ".png")
    plt = pyplot()
    figure = plt.figure()
    supported = figure.canvas.get_supported_filetypes()
    plt.close(figure)
    if path.suffix[1:].lower() not in supported:
        raise ValueError(f"matplotlib cannot write .{path.suffix[1:]} files "
                         f"(it writes {', '.join('.' + s for s in sorted(supported))})")
    return path


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
        args.usage_error(f"argument --head-dim: must be in 1..{context.max_head_dim} (the library's largest "
                         f"head_dim), got {args.head_dim}")


def run(args: argparse.Namespace) -> int:
    """Prints one row per configuration (ms and TFLOP/s) and optionally saves the plot; returns 0.
    With --compare, runs ``compare.run`` instead."""
    from . import compare

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
    print(f"{'seqlen':>7} {'causal':>6} {'fwd ms':>10} {'fwd TFLOP/s':>12} {'bwd ms':>10} {'bwd TFLOP/s':>12}")
    for r in results:
        print(f"{r.seqlen:>7} {str(r.causal):>6} {r.forward_ms:>10.3f} {r.forward_tflops:>12.4g} "
              f"{r.backward_ms:>10.3f} {r.backward_tflops:>12.4g}")
    if args.profile:
        bench_profile.print_profiles(context)
    if plot_file is not None:
        plot(results, plot_file, title)
        print(f"plot saved to {plot_file}")
    return 0
