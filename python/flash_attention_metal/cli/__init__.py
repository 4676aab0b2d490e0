"""The command line: ``python -m flash_attention_metal {info,check,bench,m5-check}``.

- ``info``: version, backend, device, library path, largest head_dim.
- ``check [--backend B]``: forward and backward on the built-in real input (attention inputs
  captured from all-MiniLM-L6-v2), causal and not, judged by the accuracy rule; exit status 1 on
  any failure.
- ``bench [--backend B] [--plot FILE.png]``: time and TFLOP/s of forward and backward over a range
  of sequence lengths; ``bench --compare mlx,torch,numpy [--json FILE]``: the library side by side
  with its peers on prefill and decode shapes (time, TFLOP/s, peak memory, peer/library ratios).
- ``m5-check [--backend B]``: per head_dim, the path forward and backward take (tensor-op or
  simdgroup_matrix kernels) and why, timed against the simdgroup path and MLX's sdpa (issue 37).
"""

from __future__ import annotations

import argparse
import sys

from ..context import BACKENDS
from ..errors import FlashAttentionError
from . import _types


def _add_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", type=_types.backend, choices=BACKENDS, default=None,
        help="backend to use (default: $FLASH_ATTENTION_METAL_BACKEND, else auto)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of all subcommands."""
    from . import bench, check, m5_check

    parser = argparse.ArgumentParser(
        prog="python -m flash_attention_metal",
        description="FlashAttention-2 on Apple GPUs (Metal) or on the CPU engine running the same kernels.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench,m5-check}")
    info_parser = commands.add_parser("info", help="version, backend, device and library path")
    _add_backend(info_parser)
    check_parser = commands.add_parser(
        "check", help="forward and backward on real attention inputs against the float64 reference")
    _add_backend(check_parser)
    check.add_arguments(check_parser)
    bench_parser = commands.add_parser(
        "bench", help="time and TFLOP/s of forward and backward; --compare: side by side with MLX, PyTorch, NumPy")
    _add_backend(bench_parser)
    bench.add_arguments(bench_parser)
    # Limits that only the loaded library knows are checked after parsing, with the same exit status
    # (2) and usage line as the parser's own checks.
    bench_parser.set_defaults(usage_error=bench_parser.error)
    m5_parser = commands.add_parser(
        "m5-check", help="tensor-op or simdgroup path per head_dim, timed against the simdgroup path and MLX's sdpa")
    _add_backend(m5_parser)
    m5_check.add_arguments(m5_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 a failed check or an error)."""
    from . import bench, check, info, m5_check

    args = build_parser().parse_args(argv)
    try:
        command = {"info": info.run, "check": check.run, "bench": bench.run, "m5-check": m5_check.run}[args.command]
        return command(args)
    except (FlashAttentionError, OSError, ValueError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
