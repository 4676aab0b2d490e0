"""Ring attention over MPI: per-step compute and communication time, bytes sent, work per rank.

Run under MPI, one process per rank:

    mpiexec -n 4 python -m flash_attention_metal.distributed.bench [--seqlen 4096] [--batch 1]
        [--heads 8] [--kv-heads 2] [--head-dim 64] [--causal] [--repeats 3] [--backend cpu]

Rank 0 prints, for forward and backward, each step's time per rank (of the repeat with the least
wall time): compute (attention calls and merges), wait (blocked on transfers after computing: the
communication the compute did not hide), in flight (posting to completion of the step's transfers)
and the bytes each rank sent. Then the work per rank: visible (query, key) pairs per (batch, head),
with the zigzag layout when causal. Times are of whatever runs the ranks: label them with the
machine (on one machine the ranks share its cores and memory bandwidth).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from .. import context as _context
from ..cli import _types
from . import layout, ring, sharding


def _arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flash_attention_metal.distributed.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=_types.positive_int, default=4096, help="global sequence length (default 4096)")
    parser.add_argument("--batch", type=_types.positive_int, default=1)
    parser.add_argument("--heads", type=_types.positive_int, default=8)
    parser.add_argument("--kv-heads", type=_types.positive_int, default=2)
    parser.add_argument("--head-dim", type=_types.positive_int, default=64)
    parser.add_argument("--causal", action="store_true", help="causal mask (zigzag layout)")
    parser.add_argument("--repeats", type=_types.positive_int, default=3)
    parser.add_argument("--backend", type=_types.backend, default="auto", help="auto, metal or cpu (default auto)")
    return parser.parse_args(argv)


def _one_pass(comm, context, tensors, causal):
    """Forward and backward once; returns (forward profile, backward profile, wall seconds)."""
    q, k, v, dout = tensors
    forward_profile, backward_profile = [], []
    comm.Barrier()
    start = time.perf_counter()
    out, lse = ring.ring_attention(q, k, v, comm=comm, causal=causal, context=context, profile=forward_profile)
    middle = time.perf_counter()
    ring.ring_attention_backward(dout, q, k, v, out, lse, comm=comm, causal=causal, context=context,
                                 profile=backward_profile)
    end = time.perf_counter()
    return forward_profile, backward_profile, (middle - start, end - middle)


def _print_table(title: str, profiles, wall_s: float) -> None:
    """profiles: per rank, a list of StepProfile."""
    ranks = len(profiles)
    print(f"\n{title}: {wall_s * 1e3:.1f} ms (slowest rank, from a barrier)")
    header = "  step " + "".join(f"| rank {r}: compute   wait  flight  sent KiB " for r in range(ranks))
    print(header)
    for step in range(len(profiles[0])):
        cells = "".join(
            f"|        {p.compute_s * 1e3:7.1f} {p.wait_s * 1e3:6.1f} {p.transfer_s * 1e3:7.1f}"
            f" {p.bytes_sent / 1024:9.0f} "
            for p in (profiles[r][step] for r in range(ranks))
        )
        print(f"  {step:4d} {cells}")
    totals = "".join(
        f"|        {sum(p.compute_s for p in steps) * 1e3:7.1f} {sum(p.wait_s for p in steps) * 1e3:6.1f}"
        f" {'':7} {sum(p.bytes_sent for p in steps) / 1024:9.0f} "
        for steps in profiles
    )
    print(f"   sum {totals}")
    steps = [p for per_rank in profiles for p in per_rank]
    compute = np.array([p.compute_s for p in steps]) * 1e3
    flight = np.array([p.transfer_s for p in steps if p.bytes_sent]) * 1e3
    print(f"  per step over ranks: compute median {np.median(compute):.1f} ms ({compute.min():.1f}-"
          f"{compute.max():.1f}), wait max {max(p.wait_s for p in steps) * 1e3:.1f} ms, in flight median "
          f"{np.median(flight) if flight.size else 0.0:.1f} ms")


def _print_single_call(context, tensors, causal: bool, repeats: int) -> None:
    """For comparison with one rank: the library's forward and backward on the whole sequence."""
    q, k, v, dout = tensors
    forward_s, backward_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out, lse = context.forward(q, k, v, causal=causal)
        middle = time.perf_counter()
        context.backward(dout, q, k, v, out, lse, causal=causal)
        forward_s.append(middle - start)
        backward_s.append(time.perf_counter() - middle)
    print(f"\none library call on the whole sequence (best of {repeats}): forward {min(forward_s) * 1e3:.1f} ms, "
          f"backward {min(backward_s) * 1e3:.1f} ms")


def main(argv=None) -> None:
    """Runs the benchmark on every rank of MPI.COMM_WORLD; rank 0 prints."""
    args = _arguments(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    context = _context.Context(args.backend)
    rng = np.random.default_rng(0)
    q_shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seqlen, args.head_dim)
    tensors = [rng.standard_normal(shape).astype(np.float16) for shape in (q_shape, kv_shape, kv_shape, q_shape)]
    local = [sharding.shard_sequence(x, comm=comm, causal=args.causal) for x in tensors]
    del tensors
    _one_pass(comm, context, local, args.causal)  # warm-up
    runs = [_one_pass(comm, context, local, args.causal) for _ in range(args.repeats)]
    gathered = comm.gather(runs)
    if rank != 0:
        return
    sequence = layout.SequenceLayout(args.seqlen, size, args.causal)
    print(f"ring attention over {size} rank(s) ({MPI.Get_library_version().splitlines()[0].strip()}), "
          f"{'causal (zigzag)' if args.causal else 'not causal (contiguous)'}, B={args.batch} H={args.heads} "
          f"H_kv={args.kv_heads} seqlen={args.seqlen} head_dim={args.head_dim}, backend {context.backend}: "
          f"{context.device}")
    for phase, name in ((0, "forward"), (1, "backward")):
        walls = [max(gathered[r][i][2][phase] for r in range(size)) for i in range(args.repeats)]
        best = int(np.argmin(walls))
        _print_table(f"{name} (best of {args.repeats})", [gathered[r][best][phase] for r in range(size)], walls[best])
    if size == 1:
        _print_single_call(context, local, args.causal, args.repeats)
    work = [layout.rank_work(sequence, sequence, r) for r in range(size)]
    shares = ", ".join(f"rank {r} {100 * w / sum(work):.1f} %" for r, w in enumerate(work))
    print(f"\nwork per rank (visible query-key pairs per batch and head): {shares}; "
          f"max / mean = {max(work) / np.mean(work):.3f}")


if __name__ == "__main__":
    main()
