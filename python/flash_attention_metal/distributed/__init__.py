"""Sequence parallelism across processes: ring attention over MPI (mpi4py), forward and backward.

Every rank of an MPI communicator holds a shard of q, k and v along the sequence; K/V shards travel
around the ring while each rank merges partial results by log-sum-exp (Ring Attention, Liu et al.
2023), with the zigzag layout for causal masks. Same semantics as ``flash_attention_metal.forward``
on the gathered sequences. Needs the extra ``distributed`` (mpi4py and an MPI library).

    from mpi4py import MPI
    from flash_attention_metal import distributed as dist
    comm = MPI.COMM_WORLD
    q_local = dist.shard_sequence(q, comm=comm, causal=True)      # likewise k, v
    out, lse = dist.ring_attention(q_local, k_local, v_local, comm=comm, causal=True)
    dq, dk, dv = dist.ring_attention_backward(dout_local, q_local, k_local, v_local, out, lse,
                                              comm=comm, causal=True)
    out_global = dist.unshard_sequence(out, comm=comm, causal=True)

Launch with ``mpiexec -n P python -m mpi4py your_script.py`` (``-m mpi4py`` aborts the whole job when
a rank raises). ``layout`` (where each rank's rows sit, which block calls a step makes) is the one
layout of both ring implementations, this one and ``flash_attention_metal.mlx.ring_attention``.
"""

import importlib

from .layout import SequenceLayout, rank_work

# The MPI parts load on first use (raising ImportError naming the extra without mpi4py): the
# layout, which the MLX ring shares, needs no MPI.
_MPI_PARTS = {"DEFAULT_TIMEOUT_S": "transport", "RingTimeoutError": "transport", "StepProfile": "ring",
              "ring_attention": "ring", "ring_attention_backward": "ring", "shard_sequence": "sharding",
              "unshard_sequence": "sharding"}


def __getattr__(name: str):
    if name not in _MPI_PARTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MPI_PARTS[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RingTimeoutError",
    "SequenceLayout",
    "StepProfile",
    "rank_work",
    "ring_attention",
    "ring_attention_backward",
    "shard_sequence",
    "unshard_sequence",
]
