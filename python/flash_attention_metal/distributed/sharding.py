"""Splitting a global tensor into the ranks' shards along the sequence, and gathering it back.

The sequence is axis 2 of q, k, v, out, dq, dk, dv (batch, heads, seqlen, head_dim) and of lse
(batch, heads, seqlen). Shards follow ``layout.SequenceLayout``: contiguous chunks, zigzag when causal.
"""

from __future__ import annotations

import zlib

import numpy as np

from .layout import SequenceLayout
from .transport import DEFAULT_TIMEOUT_S, allgather_bytes, allgather_ints, check_comm, check_timeout

_SEQUENCE_AXIS = 2


def _check_tensor(name: str, x, min_rows: int) -> None:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.ndim not in (3, 4):
        raise ValueError(
            f"{name} must be 3-D (batch, heads, seqlen) or 4-D (batch, heads, seqlen, head_dim), got shape {x.shape}"
        )
    if x.shape[_SEQUENCE_AXIS] < min_rows:
        raise ValueError(
            f"{name} has {x.shape[_SEQUENCE_AXIS]} rows along the sequence (axis 2); at least {min_rows} "
            "are needed so that every rank holds at least one row"
        )


def shard_sequence(x, *, comm, causal=False):
    """This rank's shard of a global tensor that every rank holds.

    Args:
        x: NumPy array (batch, heads, seqlen, head_dim) or (batch, heads, seqlen), any dtype, with
            seqlen >= the number of ranks.
        comm: mpi4py intracommunicator (only its rank and size are used; nothing is sent).
        causal: False: rank r of P gets chunk r of P contiguous chunks; True: chunks r and 2P-1-r of
            2P (zigzag, balancing the causal mask's work). Chunks differ by at most one row.

    Returns:
        A new C-contiguous array with this rank's rows along axis 2, in the order ring_attention
        expects.
    """
    check_comm(comm)
    _check_tensor("x", x, comm.Get_size())
    layout = SequenceLayout(x.shape[_SEQUENCE_AXIS], comm.Get_size(), bool(causal))
    parts = [x[:, :, chunk.start:chunk.start + chunk.length] for chunk in layout.chunks(comm.Get_rank())]
    return np.ascontiguousarray(np.concatenate(parts, axis=_SEQUENCE_AXIS))


def unshard_sequence(x_local, *, comm, causal=False, timeout=DEFAULT_TIMEOUT_S):
    """The global tensor, gathered on every rank from each rank's shard (the inverse of
    ``shard_sequence``).

    Args:
        x_local: this rank's shard, (batch, heads, local seqlen[, head_dim]); the same dtype and
            other dimensions on every rank.
        comm: mpi4py intracommunicator; every rank calls.
        causal: the layout the shards follow (as given to ``shard_sequence``).
        timeout: seconds to wait for the other ranks before raising RingTimeoutError.

    Returns:
        A new array (batch, heads, seqlen[, head_dim]) with every rank's rows in global order.

    Raises:
        TypeError, ValueError: bad arguments on any rank, or shards that disagree (every rank raises).
        RingTimeoutError: another rank did not take part in time.
    """
    check_comm(comm)
    timeout = check_timeout(timeout)
    size = comm.Get_size()
    try:
        _check_tensor("x_local", x_local, 1)
        shape = list(x_local.shape) + [0] * (4 - x_local.ndim)
        fields = [1, x_local.ndim, *shape, zlib.crc32(x_local.dtype.str.encode() + x_local.dtype.name.encode())]
        local_error = None
    except (TypeError, ValueError) as error:
        fields, local_error = [0] * 7, error
    table = allgather_ints(comm, fields, timeout=timeout, what="unshard_sequence: agreeing on the shapes")
    if local_error is not None:
        raise local_error
    if np.any(table[:, 0] == 0):
        rejected = np.flatnonzero(table[:, 0] == 0).tolist()
        raise ValueError(f"unshard_sequence: the shards of rank(s) {rejected} were rejected (see their error)")
    lengths = table[:, 2 + _SEQUENCE_AXIS]
    others = np.delete(table, 2 + _SEQUENCE_AXIS, axis=1)
    if np.any(others != others[0]):
        raise ValueError(
            "unshard_sequence: x_local must have the same dtype and dimensions other than axis 2 on every rank, "
            f"got shapes {[tuple(row[2:2 + row[1]]) for row in table.tolist()]}"
        )
    layout = SequenceLayout(int(lengths.sum()), size, bool(causal))
    expected = [layout.shard_length(r) for r in range(size)]
    if lengths.tolist() != expected:
        raise ValueError(
            f"unshard_sequence: the shards have {lengths.tolist()} rows; the {'zigzag' if causal else 'contiguous'} "
            f"layout of {layout.seqlen} rows over {size} ranks has {expected}"
        )
    local = np.ascontiguousarray(x_local)
    gathered = allgather_bytes(comm, local, [n * local[:, :, :1].nbytes for n in expected],
                               timeout=timeout, what="unshard_sequence: gathering the shards")
    result = np.empty(local.shape[:2] + (layout.seqlen,) + local.shape[3:], dtype=local.dtype)
    offset = 0
    for rank, rows in enumerate(expected):
        shard_shape = local.shape[:2] + (rows,) + local.shape[3:]
        count = int(np.prod(shard_shape)) * local.itemsize
        shard = gathered[offset:offset + count].view(local.dtype).reshape(shard_shape)
        for chunk in layout.chunks(rank):
            result[:, :, chunk.start:chunk.start + chunk.length] = shard[:, :, chunk.local_rows]
        offset += count
    return result
