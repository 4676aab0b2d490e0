"""What the benchmark commands share (``bench``, ``bench --decode``, ``bench --compare`` and the
peers it times): FlashAttention's FLOP count, best-of-n timing, seeded inputs, the throughput unit
and matplotlib. Imports nothing of the other command modules: they import it.

FLOPs are counted as FlashAttention's benchmark counts them: 4 * B * H * Nq * Nk * D for the
forward pass (the two matrix products), halved when causal, and 2.5 times that for the backward.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

# One wording wherever matplotlib is missing (docs/python.md says the same).
MATPLOTLIB_HINT = 'pip install matplotlib (or, in the repository: pip install -e "python[bench]")'


def forward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """FlashAttention's forward FLOP count: 4 B H Nq Nk D, halved for causal (backward: 2.5x)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


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
