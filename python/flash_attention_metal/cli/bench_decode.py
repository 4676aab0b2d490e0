"""``bench --decode``: forward time of decode shapes (a few query rows against a long KV cache,
GQA), with the threadgroups and kernels the call dispatched (read from its profile).

Decode is bound by reading the KV cache, so next to the time the table gives the cache's bytes
(k and v, float16) and the rate at which the call got through them (cache bytes / time).
"""

from __future__ import annotations

import argparse
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from . import _types
from ._measure import best_ms, random_inputs
from .progress import track

_CPU_KEYS = (1024, 4096)
_GPU_KEYS = (4096, 16384, 32768, 131072)
QUERY_ROWS = (1, 4)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # a Llama-3-8B layer


@dataclass(frozen=True)
class DecodeResult:
    """One timed decode shape: the best of ``repeats`` forward calls, and what the last one ran."""

    seqlen_q: int
    seqlen_k: int
    forward_ms: float
    cache_bytes: int
    threadgroups: int        # of the call's first kernel, the one that reads the cache
    kernels: tuple           # names of the dispatched kernels, in order

    @property
    def cache_gb_per_s(self) -> float:
        return self.cache_bytes / (self.forward_ms * 1e-3) / 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench --decode`` (``--seqlens`` then gives the cached keys)."""
    parser.add_argument("--decode", action="store_true",
                        help=f"time decode shapes: --query-rows queries against --seqlens cached keys "
                             f"(default {' '.join(map(str, _CPU_KEYS))} on the CPU engine, "
                             f"{' '.join(map(str, _GPU_KEYS))} on Metal), causal, GQA; default "
                             f"--heads {HEADS} --kv-heads {KV_HEADS} --head-dim {HEAD_DIM}")
    parser.add_argument("--query-rows", type=_types.positive_int, nargs="+", default=None,
                        help=f"seqlen_q of the --decode shapes (default: {' '.join(map(str, QUERY_ROWS))})")
    parser.add_argument("--kv-heads", type=_types.positive_int, default=None,
                        help=f"KV heads of the --decode shapes, dividing --heads (default: {KV_HEADS} when it "
                             f"divides --heads, else --heads)")


def check_options(args: argparse.Namespace) -> None:
    """Usage errors for options that need --decode or do not go with it (--heads resolved)."""
    if not args.decode:
        for option, value in (("--query-rows", args.query_rows), ("--kv-heads", args.kv_heads)):
            if value is not None:
                args.usage_error(f"argument {option}: needs --decode")
        return
    for option, value in (("--compare", args.compare), ("--plot", args.plot), ("--json", args.json)):
        if value is not None:
            args.usage_error(f"argument {option}: not allowed with --decode")
    if args.kv_heads is not None and args.heads % args.kv_heads != 0:
        args.usage_error(f"argument --kv-heads: must divide --heads ({args.heads}), got {args.kv_heads}")


def cache_keys(args: argparse.Namespace, backend: str) -> tuple:
    """The seqlen_k values to time."""
    return tuple(args.seqlens) if args.seqlens else (_CPU_KEYS if backend == "cpu" else _GPU_KEYS)


def measure(context, seqlen_q: int, seqlen_k: int, args: argparse.Namespace) -> DecodeResult:
    """Times the causal forward of one decode shape and reads the profile of its last run."""

    shapes = [(args.batch, args.heads, seqlen_q, args.head_dim)]
    shapes += [(args.batch, args.kv_heads, seqlen_k, args.head_dim)] * 2
    q, k, v = random_inputs(shapes, seqlen_q * 1_000_003 + seqlen_k, f"{seqlen_q} queries over {seqlen_k} keys")
    forward_ms = best_ms(lambda: context.forward(q, k, v, causal=True), args.repeats)
    profile = context.last_profile
    dispatches = profile.dispatches if profile is not None else []
    threadgroups = int(np.prod(dispatches[0].threadgroups)) if dispatches else 0
    return DecodeResult(seqlen_q, seqlen_k, forward_ms, k.nbytes + v.nbytes, threadgroups,
                        tuple(d.kernel for d in dispatches))


def run(args: argparse.Namespace, context) -> list:
    """Prints one row per (seqlen_q, seqlen_k) and returns the results (--heads resolved)."""
    args.head_dim = args.head_dim or HEAD_DIM
    if args.kv_heads is None:
        args.kv_heads = KV_HEADS if args.heads % KV_HEADS == 0 else args.heads
    query_rows = args.query_rows or QUERY_ROWS
    configs = [(rows, keys) for keys in cache_keys(args, context.backend) for rows in query_rows]
    print(f"{context.backend} ({context.device}): decode, B={args.batch} H={args.heads} H_kv={args.kv_heads} "
          f"D={args.head_dim}, causal")
    with closing(track(configs, len(configs), "bench --decode")) as progress:
        results = [measure(context, rows, keys, args) for rows, keys in progress]
    rate = "cache GB/s" if context.backend == "metal" else "cache GB/s (CPU)"
    print(f"{'seqlen_q':>8} {'seqlen_k':>8} {'fwd ms':>10} {'cache MB':>9} {rate:>16} {'threadgroups':>12}  kernels")
    for r in results:
        print(f"{r.seqlen_q:>8} {r.seqlen_k:>8} {r.forward_ms:>10.3f} {r.cache_bytes / 1e6:>9.2f} "
              f"{r.cache_gb_per_s:>16.3f} {r.threadgroups:>12}  {' + '.join(r.kernels)}")
    return results
