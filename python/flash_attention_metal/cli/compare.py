"""``bench --compare mlx,torch,numpy``: the library side by side with its peers, in one run.

For each sequence length and head_dim the cases are prefill (Nq = Nk, every head its own KV head,
non-causal and causal), prefill with GQA (a quarter as many KV heads, causal) and decode (one query
against Nk keys, GQA). Each implementation (``peers.py``) runs forward and forward+backward on the
same float16 inputs; the table shows per run the best time of ``--repeats`` after a warm-up call
(``_measure.best_ms``), the throughput (FlashAttention's FLOP count), the peak memory of one call
(``_peak_memory``) and, for the peers, the ratios peer/library of time and memory. The library's
device time comes from its profile of one more run (``Context.last_profile``): GPU time on Metal,
the engine's wall time on the CPU. Peers that are not installed are
named and skipped; a peer that fails on a case shows the error for that case.

``--json FILE`` writes every figure with the machine, chip, OS and versions: the record a Mac user
sends back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from . import _peak_memory, _types
from ._measure import best_ms, pyplot, throughput_unit
from .peers import OPERATIONS, PEERS, Case, Library, Unavailable, load_peer
from .progress import track

CPU_SEQLENS = (256,)
GPU_SEQLENS = (1024, 4096)
HEAD_DIMS = (64, 128)
SCHEMA = "flash_attention_metal/bench-compare/1"


def peer_list(text: str) -> list[str]:
    """argparse type of --compare: comma-separated peer names, each once."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of {', '.join(PEERS)}, got {text!r}")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench --compare``."""
    parser.add_argument("--compare", type=peer_list, default=None, metavar="PEERS",
                        help=f"compare the library with peers ({','.join(PEERS)}) on prefill and decode "
                             "shapes instead of the sequence-length sweep")
    parser.add_argument("--json", type=_types.output_file, default=None, metavar="FILE.json",
                        help="with --compare: write every figure, the machine and the versions to this file")


def cases(args: argparse.Namespace, backend: str) -> list[Case]:
    """The measured shapes: for each sequence length and head_dim, prefill (in the --causal modes),
    prefill with GQA (causal unless --causal off) and decode with GQA."""
    seqlens = args.seqlens or (CPU_SEQLENS if backend == "cpu" else GPU_SEQLENS)
    head_dims = (args.head_dim,) if args.head_dim is not None else HEAD_DIMS
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    heads = args.heads
    kv_heads = heads // 4 if heads % 4 == 0 else 1
    result = []
    for n in seqlens:
        for d in head_dims:
            result += [Case("prefill", args.batch, heads, heads, n, n, d, causal) for causal in modes]
            result.append(Case("prefill GQA", args.batch, heads, kv_heads, n, n, d, args.causal != "off"))
            result.append(Case("decode GQA", args.batch, heads, kv_heads, 1, n, d, False))
    return result


def _measure(implementation, case: Case, arrays, repeats: int, backend: str) -> dict:
    """Every figure of one implementation on one case: per operation ms, tflops, peak memory bytes
    (None where the measurement failed), and for the library its device ms."""
    figures = {}
    for operation, function in implementation.operations(case, *arrays).items():
        ms = best_ms(function, repeats)
        entry = {"ms": ms, "tflops": case.flops(operation) / (ms * 1e-3) / 1e12}
        if isinstance(implementation, Library):
            entry["device_ms"] = implementation.device_ms(case, *arrays, operation)
        try:
            entry["peak_memory_bytes"] = _peak_memory.measure(implementation.name, case, operation, backend)
        except RuntimeError as error:
            entry["peak_memory_bytes"], entry["memory_error"] = None, str(error)
        figures[operation] = entry
    return figures


def _machine() -> dict:
    """Machine, chip and OS of this run."""
    return {
        "os": platform.platform(),
        "system": platform.system(),
        "release": platform.release(),
        "macos": platform.mac_ver()[0] or None,
        "architecture": platform.machine(),
        "chip": _chip(),
        "logical_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def _chip() -> str | None:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  check=True).stdout.strip() or None
        except (OSError, subprocess.CalledProcessError):
            return None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _implementations(context, names: list[str]) -> tuple[list, dict]:
    """The library and every requested peer that can run here, and a description of each
    (version and device, or why it was skipped)."""
    from .._native import native

    library = Library(context)
    loaded = native()
    described = {"library": {"available": True, "version": library.version,
                             "library_version": loaded.ffi.string(loaded.lib.fa_version()).decode(),
                             "device": library.device, "path": str(loaded.path)}}
    running = [library]
    for name in names:
        try:
            peer = load_peer(name)
        except Unavailable as reason:
            described[name] = {"available": False, "reason": str(reason)}
            continue
        running.append(peer)
        described[name] = {"available": True, "version": peer.version,
                           "device": peer.device + getattr(peer, "settings", "")}
    return running, described


def _cell(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def print_table(results: list[dict], names: list[str], resolution: int) -> None:
    """One row per case, operation and implementation; peers carry their ratios to the library."""
    rates = [entry["tflops"] for r in results for entry in _entries(r) if "tflops" in entry]
    factor, unit = throughput_unit(rates)
    print(f"{'case':<40} {'operation':<9} {'impl':<8} {'ms':>10} {unit:>9} {'device ms':>10} "
          f"{'peak MiB':>9} {'ms/lib':>8} {'MiB/lib':>8}")
    for r in results:
        for operation in OPERATIONS:
            library = r["implementations"]["library"][operation]
            for name in ["library"] + names:
                figures = r["implementations"].get(name)
                if figures is None:
                    continue
                head = f"{r['label'] if name == 'library' and operation == OPERATIONS[0] else '':<40} " \
                       f"{operation if name == 'library' else '':<9} {name:<8}"
                if "error" in figures:
                    print(f"{head} error: {figures['error']}")
                    continue
                entry = figures[operation]
                memory = entry["peak_memory_bytes"]
                mib = None if memory is None else memory / 2**20
                time_ratio = memory_ratio = None
                if name != "library":
                    time_ratio = entry["ms"] / library["ms"]
                    if memory is not None and library["peak_memory_bytes"] is not None:
                        memory_ratio = _peak_memory.memory_ratio(memory, library["peak_memory_bytes"], resolution)
                print(f"{head} {entry['ms']:10.3f} {entry['tflops'] * factor:9.3g} "
                      f"{_cell(entry.get('device_ms'), '.3f', 10)} {_cell(mib, '.2f', 9)} "
                      f"{_cell(time_ratio, '.3g', 8)} {memory_ratio or '-':>8}")
    for line in LEGEND:
        print(line)


#: What the columns of the table mean, printed under it.
LEGEND = (
    "ms: best wall time of one call as Python sees it (validation, dispatch, waiting for the result);",
    "device ms: the library only, its own time of one more run from the call's profile (Metal: GPU time",
    "of its command buffers; CPU engine: the engine's wall time); a single run, so on a busy machine it",
    "can exceed ms. peak MiB: memory one call adds at its peak; ms/lib, MiB/lib: peer over library.",
)


def _entries(result: dict):
    for figures in result["implementations"].values():
        if "error" not in figures:
            yield from figures.values()


def plot(results: list[dict], names: list[str], path: Path, title: str) -> None:
    """Grouped bars per case of each implementation's throughput, forward and forward+backward, on a
    logarithmic axis (the peers span orders of magnitude: on a linear one the CPU engine's bars
    beside MLX's are invisible), GFLOP/s when below 1 TFLOP/s, the legend below the panels; a
    missing figure (a peer's error) leaves a gap."""
    plt = pyplot()
    factor, unit = throughput_unit([e["tflops"] for r in results for e in _entries(r)])
    implementations = ["library"] + names
    figure, panels = plt.subplots(1, len(OPERATIONS), figsize=(6 + 0.9 * len(results), 5.5), sharey=False)
    width = 0.8 / len(implementations)
    for axes, operation in zip(panels, OPERATIONS):
        for index, name in enumerate(implementations):
            heights = []
            for r in results:
                figures = r["implementations"].get(name, {})
                heights.append(figures[operation]["tflops"] * factor if operation in figures else float("nan"))
            axes.bar([i + (index - (len(implementations) - 1) / 2) * width for i in range(len(results))],
                     heights, width, label=name if operation == OPERATIONS[0] else None)
        axes.set_xticks(range(len(results)), [r["label"] for r in results], rotation=35, ha="right", fontsize=8)
        axes.set_yscale("log")
        axes.set_ylabel(f"{unit} (log scale)")
        axes.set_title(operation)
        axes.grid(True, axis="y", alpha=0.3)
    figure.suptitle(title)
    figure.legend(loc="lower center", ncol=len(implementations), frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace, context, plot_file: Path | None) -> int:
    """Measures every case on the library and the available peers, prints the table, writes the
    JSON record and the plot when asked; returns 0."""
    running, described = _implementations(context, args.compare)
    names = [impl.name for impl in running[1:]]
    print(f"library: flash_attention_metal {described['library']['version']} on {described['library']['device']}")
    for name in args.compare:
        info = described[name]
        print(f"{name}: " + (f"{info['version']} on {info['device']}" if info["available"]
                             else f"{info['reason']}; skipped"))
    print(f"time: best of {args.repeats} after a warm-up call; memory: {_peak_memory.method()}")
    selected = cases(args, context.backend)
    results = []
    with closing(track(selected, len(selected), "compare")) as progress:
        for case in progress:
            arrays = case.inputs()
            figures = {}
            for implementation in running:
                try:
                    figures[implementation.name] = _measure(implementation, case, arrays, args.repeats,
                                                            context.backend)
                except Exception as error:  # a peer's failure on one case is a result, not the end
                    if implementation.name == "library":
                        raise
                    figures[implementation.name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
            results.append({"label": case.label, "case": case.to_dict(),
                            "flops": {op: case.flops(op) for op in OPERATIONS}, "implementations": figures})
    resolution = _peak_memory.resolution_bytes()
    print_table(results, names, resolution)
    if args.json is not None:
        record = {
            "schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m flash_attention_metal"] + sys.argv[1:]),
            "machine": _machine(),
            "implementations": described,
            "method": {"time": f"best of {args.repeats} wall-clock runs after one warm-up call, milliseconds",
                       "tflops": "FlashAttention's count: 4*B*H*Nq*Nk*D forward, halved when causal; "
                                 "forward+backward 3.5x the forward",
                       "memory": _peak_memory.method(), "memory_resolution_bytes": resolution,
                       "device_ms": "the library's profile: GPU time on Metal, engine wall time on the CPU"},
            "results": results,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"record written to {args.json}")
    if plot_file is not None:
        plot(results, names, plot_file, f"library ({context.backend} backend) and peers; "
                                        f"{context.device}")
        print(f"plot saved to {plot_file}")
    return 0
