"""Ring attention (Liu, Zaharia & Abbeel 2023) over MPI: forward and backward with the library's
kernels on each rank.

Each of P ranks holds a shard of q, k and v along the sequence (``layout``). Forward: P steps; at
step s a rank computes its queries against the K/V shard of rank (rank - s) mod P while sending that
shard on to the next rank and receiving the following one; partial results merge by log-sum-exp
(``running``). Backward (FlashAttention-2, Algorithm 2): with the global out and lse of each query
row, the library's backward on one block gives that block's exact share of dq, dk and dv; dq stays
on the rank, the float32 dK/dV of a block travel with it around the ring, each rank adding its
share, and arrive back at their owner after P hops. No rank ever holds more than two K/V shards.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .. import _abi, _validation
from .._default import default_context
from ..context import Context
from .layout import Call, SequenceLayout, block_calls
from .running import RunningAttention
from .transport import DEFAULT_TIMEOUT_S, allgather_ints, check_comm, check_timeout, shift

# Message tags on the caller's communicator (one per kind of message, so that they never match).
_TAG_KV = 0x4641
_TAG_DKV = 0x4642

_F32 = np.float32


@dataclass(frozen=True)
class StepProfile:
    """One ring step on one rank.

    compute_s: seconds in attention calls and merges; wait_s: seconds blocked on transfers after
    computing (communication not hidden by the compute); transfer_s: seconds from posting the
    step's transfers to their completion (hidden or not); bytes_sent: bytes this rank sent.
    """

    step: int
    compute_s: float
    wait_s: float
    transfer_s: float
    bytes_sent: int


class _Pair:
    """Two arrays of one dtype (K and V, or dK and dV) in one contiguous buffer: one message.

    ``first`` and ``second`` are views of ``buffer`` (uint8, what travels) with ``shapes``; K and V
    may differ in their last axis (head_dim and head_dim_v)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype, fill=None) -> None:
        dtype = np.dtype(dtype)
        counts = [int(np.prod(shape)) for shape in shapes]
        self.values = np.empty(sum(counts), dtype=dtype) if fill is None else np.full(sum(counts), fill, dtype=dtype)
        self.buffer = self.values.view(np.uint8)
        self.first = self.values[:counts[0]].reshape(shapes[0])
        self.second = self.values[counts[0]:].reshape(shapes[1])

    @classmethod
    def of(cls, first: np.ndarray, second: np.ndarray) -> "_Pair":
        pair = cls((first.shape, second.shape), first.dtype)
        pair.first[...], pair.second[...] = first, second
        return pair


@dataclass(frozen=True)
class _Plan:
    """What every rank agreed on before the ring starts."""

    rank: int
    size: int
    query_layout: SequenceLayout
    key_layout: SequenceLayout
    causal: bool
    softmax_scale: float
    context: Context
    timeout: float

    def kv_shapes(self, source: int, shape: _validation.Shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of rank ``source``'s K shard (batch, num_kv_heads, rows, head_dim) and V shard
        (... head_dim_v)."""
        rows = self.key_layout.shard_length(source)
        return ((shape.batch, shape.num_kv_heads, rows, shape.head_dim),
                (shape.batch, shape.num_kv_heads, rows, shape.head_dim_v))

    def block_calls(self, source: int) -> list[Call]:
        """The library calls of this rank's queries against ``source``'s keys (``layout.block_calls``)."""
        return block_calls(self.query_layout, self.key_layout, self.rank, source)


_AGREED_FIELDS = ("batch", "num_heads", "num_kv_heads", "head_dim", "head_dim_v", "dtype", "causal", "softmax_scale")


def _agree(comm, name: str, check: Callable[[], tuple], context, timeout,
           profile) -> tuple[_Plan, _validation.Shape]:
    """Checks the local arguments (``check`` the tensors: returns shape, causal, softmax_scale and
    the dtype; then context, timeout and profile), then agrees with every rank on shapes, dtype,
    causal and softmax_scale.

    Every rank learns whether every other rank's arguments passed, so a rank with bad arguments
    raises its own error and the others raise ValueError naming it, instead of waiting for it.
    """
    check_comm(comm)
    timeout = check_timeout(timeout)
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        shape, causal, scale, dtype = check()
        context = default_context() if context is None else context
        if not isinstance(context, Context):
            raise TypeError(f"context must be a flash_attention_metal.Context or None, got {type(context).__name__}")
        # The library's rules (head_dim, heads), asked now: a rank refused mid-ring would stall the others.
        _abi.check_sizes(context._native, shape, causal, scale, dtype)
        if profile is not None and not isinstance(profile, list):
            raise TypeError(f"profile must be a list or None, got {type(profile).__name__}")
        local_error = None
    except Exception as error:  # shared with the other ranks below, then re-raised
        local_error = error
    if local_error is None:
        fields = [1, shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v,
                  zlib.crc32(np.dtype(dtype).name.encode()), int(causal), int(np.float64(scale).view(np.int64)),
                  shape.seqlen_q, shape.seqlen_k]
    else:
        fields = [0] * 11
    table = allgather_ints(comm, fields, timeout=timeout, what=f"{name}: agreeing on the arguments")
    if local_error is not None:
        raise local_error
    failed = [r for r in range(size) if table[r, 0] == 0]
    if failed:
        raise ValueError(f"{name}: the arguments of rank(s) {failed} were rejected (see the error on those ranks)")
    for column, field in enumerate(_AGREED_FIELDS, start=1):
        if np.any(table[:, column] != table[0, column]):
            if field == "dtype":  # only checksums of the names travel
                raise ValueError(f"{name}: q, k, v must have the same dtype on every rank")
            values = table[:, column].view(np.float64) if field == "softmax_scale" else table[:, column]
            raise ValueError(
                f"{name}: {field} must be the same on every rank, got {values.tolist()} on ranks 0..{size - 1}"
            )
    query_layout = _layout(name, "q", table[:, 9], size, causal)
    key_layout = _layout(name, "k", table[:, 10], size, causal)
    plan = _Plan(rank, size, query_layout, key_layout, causal, scale, context, timeout)
    return plan, shape


def _layout(name: str, argument: str, lengths: np.ndarray, size: int, causal: bool) -> SequenceLayout:
    layout = SequenceLayout(int(lengths.sum()), size, causal)
    expected = [layout.shard_length(r) for r in range(size)]
    if lengths.tolist() != expected:
        kind = "zigzag (causal)" if causal else "contiguous"
        raise ValueError(
            f"{name}: the {argument} shards of ranks 0..{size - 1} have {lengths.tolist()} rows; the "
            f"{kind} layout of a {layout.seqlen}-row sequence over {size} ranks has {expected} "
            f"(shard the global tensor with shard_sequence(x, comm=comm, causal={causal}))"
        )
    return layout


def _rows(x: np.ndarray, rows: slice) -> np.ndarray:
    return x[:, :, rows]


def ring_attention(q, k, v, *, comm, causal=False, softmax_scale=None, context=None,
                   timeout=DEFAULT_TIMEOUT_S, profile=None):
    """Attention over a sequence sharded across the ranks of ``comm``: this rank's (out, lse).

    Args:
        q: (batch, num_heads, local seqlen_q, head_dim), numpy.float16, ml_dtypes.bfloat16 or
            numpy.float32: this rank's query shard as ``shard_sequence(q_global, comm=comm,
            causal=causal)`` gives it.
        k: (batch, num_kv_heads, local seqlen_k, head_dim), v: (... head_dim_v), q's dtype,
            sharded the same way.
        comm: mpi4py intracommunicator; every rank of it calls with its shard.
        causal: bool, bottom-right over the global sequences (query i sees key j iff
            j <= i + seqlen_k - seqlen_q, global positions); selects the zigzag layout.
        softmax_scale: finite number or None (1 / sqrt(head_dim)); the same on every rank.
        context: the ``Context`` computing each block (None: the default context).
        timeout: seconds a rank waits for a transfer, after its own work of a step, before raising.
        profile: None, or a list to which one ``StepProfile`` per step is appended.

    Returns:
        (out, lse) of this rank's query rows: out in q's dtype (batch, num_heads, local seqlen_q,
        head_dim_v), lse float32 (batch, num_heads, local seqlen_q), equal to the rows of ``forward``
        on the gathered sequences. The partial results merge in float32; out is rounded once.

    Raises:
        TypeError, ValueError: invalid arguments on this rank, arguments that differ between
            ranks, or shards that do not follow the layout (every rank raises).
        RingTimeoutError: another rank failed or stopped mid-ring.
        FlashAttentionError: the library reported an error.
    """
    plan, shape = _agree(comm, "ring_attention",
                         lambda: (*_validation.check_forward(q, k, v, causal, softmax_scale)[:3], q.dtype),
                         context, timeout, profile)
    running = RunningAttention(shape.batch, shape.num_heads, shape.seqlen_q, shape.head_dim_v)
    kv = _Pair.of(k, v)
    for step in range(plan.size):
        source = (plan.rank - step) % plan.size
        transfer, incoming = None, None
        if step < plan.size - 1:
            following = (source - 1) % plan.size
            incoming = _Pair(plan.kv_shapes(following, shape), q.dtype)
            transfer = shift(comm, kv.buffer, incoming.buffer, _TAG_KV,
                             f"ring_attention step {step + 1} of {plan.size}: K/V block of rank {following}")
        start = time.perf_counter()
        for call in plan.block_calls(source):
            out, lse = plan.context.forward(_rows(q, call.rows), _rows(kv.first, call.keys),
                                            _rows(kv.second, call.keys), causal=call.causal,
                                            softmax_scale=plan.softmax_scale)
            running.merge(call.rows, out, lse)
        compute = time.perf_counter() - start
        wait = transfer.wait(plan.timeout) if transfer else 0.0
        if profile is not None:
            profile.append(StepProfile(step, compute, wait, transfer.seconds_in_flight if transfer else 0.0,
                                       kv.buffer.nbytes if transfer else 0))
        if incoming is not None:
            kv = incoming
    return running.out.astype(q.dtype), running.lse


def ring_attention_backward(dout, q, k, v, out, lse, *, comm, causal=False, softmax_scale=None, context=None,
                            timeout=DEFAULT_TIMEOUT_S, profile=None):
    """Backward of ``ring_attention``: this rank's (dq, dk, dv).

    Args:
        dout: like out (q's dtype, head_dim_v last), this rank's rows of the gradient of the loss with respect to out.
        q, k, v: this rank's shards, as given to ``ring_attention``.
        out, lse: this rank's rows as ``ring_attention`` returned them (the global attention's out
            and lse; D_i = rowsum(dout * out) as in FlashAttention-2).
        comm, causal, softmax_scale, context, timeout, profile: as for ``ring_attention``.

    Returns:
        (dq, dk, dv) like q, k, v: the rows of this rank's shards of the gradients of the gathered
        attention. Each block's share comes from the float32 kernels (inputs of 16 bits are widened),
        is summed in float32 over the blocks and ranks and rounded once.

    Raises:
        as ``ring_attention``.
    """
    plan, shape = _agree(
        comm, "ring_attention_backward",
        lambda: (*_validation.check_backward(dout, q, k, v, out, lse, causal, softmax_scale)[:3], q.dtype),
        context, timeout, profile)
    dq = np.zeros(q.shape, dtype=_F32)
    # float32 kernels: a block's share is summed with others before the one rounding to q's dtype;
    # the 16-bit kernels would round each share first, and where one share carries almost the whole
    # gradient the two roundings break the accuracy rule. The rows of each call are views of these.
    dout32, q32, out32 = (a.astype(_F32, copy=False) for a in (dout, q, out))
    kv = _Pair.of(k, v)
    outgoing = None  # the float32 dK/dV of the previous block, on its way to the next rank
    steps = []
    for step in range(plan.size):
        source = (plan.rank - step) % plan.size
        transfers, incoming_kv, arriving = [], None, None
        if step < plan.size - 1:
            following = (source - 1) % plan.size
            incoming_kv = _Pair(plan.kv_shapes(following, shape), q.dtype)
            transfers.append(shift(comm, kv.buffer, incoming_kv.buffer, _TAG_KV,
                                   f"ring_attention_backward step {step + 1} of {plan.size}: "
                                   f"K/V block of rank {following}"))
        if step > 0:
            arriving = _Pair(plan.kv_shapes(source, shape), _F32)
            transfers.append(shift(comm, None, arriving.buffer, _TAG_DKV,
                                   f"ring_attention_backward step {step + 1} of {plan.size}: "
                                   f"dK/dV of rank {source}'s block"))
        start = time.perf_counter()
        grads = _Pair(plan.kv_shapes(source, shape), _F32, fill=0)
        k32, v32 = (a.astype(_F32, copy=False) for a in (kv.first, kv.second))
        for call in plan.block_calls(source):
            rows, keys = call.rows, call.keys
            dq_block, dk_block, dv_block = plan.context.backward(
                _rows(dout32, rows), _rows(q32, rows), _rows(k32, keys), _rows(v32, keys), _rows(out32, rows),
                lse[:, :, rows], causal=call.causal, softmax_scale=plan.softmax_scale)
            dq[:, :, rows] += dq_block
            grads.first[:, :, keys] += dk_block
            grads.second[:, :, keys] += dv_block
        compute = time.perf_counter() - start
        wait = sum(transfer.wait(plan.timeout) for transfer in transfers)
        if outgoing is not None:
            wait += outgoing.wait(plan.timeout)
        if arriving is not None:
            grads.values += arriving.values
        sent = kv.buffer.nbytes if incoming_kv is not None else 0
        if plan.size > 1:
            outgoing = shift(comm, grads.buffer, None, _TAG_DKV,
                             f"ring_attention_backward step {step + 1} of {plan.size}: dK/dV of rank {source}'s block")
            sent += grads.buffer.nbytes
        steps.append([step, compute, wait, max((t.seconds_in_flight for t in transfers), default=0.0), sent])
        if incoming_kv is not None:
            kv = incoming_kv
    if plan.size > 1:
        own = _Pair(plan.kv_shapes(plan.rank, shape), _F32)
        returning = shift(comm, None, own.buffer, _TAG_DKV, "ring_attention_backward: dK/dV of this rank's block")
        steps[-1][2] += returning.wait(plan.timeout) + outgoing.wait(plan.timeout)
        grads = own
    if profile is not None:
        profile.extend(StepProfile(*fields) for fields in steps)
    return dq.astype(q.dtype), grads.first.astype(k.dtype), grads.second.astype(v.dtype)
