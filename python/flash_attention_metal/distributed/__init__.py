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
a rank raises).
"""

from ..sequence_layout import SequenceLayout, rank_work
from .ring import StepProfile, ring_attention, ring_attention_backward
from .sharding import shard_sequence, unshard_sequence
from .transport import DEFAULT_TIMEOUT_S, RingTimeoutError

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
