"""Ring attention over ``mx.distributed`` (MLX's communication layer: its ring, MPI, NCCL or JACCL
backends), forward and backward: the ring of ``flash_attention_metal.distributed`` (Ring Attention,
Liu et al. 2023) with MLX's send/recv as the transport instead of MPI's.

The same algorithm and layout (``distributed.layout``: contiguous shards, zigzag for causal masks, the
fewest library calls per block): at step s a rank computes its queries against the K/V shard of
rank (rank - s) mod P, then passes that shard to the next rank; partial results merge by
log-sum-exp in float32 and are rounded once. Backward (FlashAttention-2, Algorithm 2): with the
global out and lse of each row, the backward node on one block gives that block's exact share of
dq, dk and dv (the library takes the lse of the whole row as given); dq stays, the float32 dK/dV of
a block travel with it and arrive back at their owner after P hops.

Each step evaluates what it sends (MLX's send and recv block on the CPU stream; even ranks send
first, odd ranks receive first, so that no cycle of blocked sends forms), so ring_attention runs
eagerly: under ``mx.grad`` yes, inside ``mx.compile`` no. Every rank's shards must have the same
length (the global sequences a multiple of P, or 2P for causal).
"""

from __future__ import annotations

import mlx.core as mx

from .. import _mlx_ext
from ..distributed.layout import SequenceLayout, block_calls

_F32 = mx.float32


class _Ring:
    """This rank's place in ``group`` and the one transfer the ring makes: every rank sends arrays
    to the next rank and receives arrays of the same shapes and dtypes from the previous one."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def shift(self, arrays: list) -> list:
        if self.size == 1:
            return list(arrays)
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size

        def send():
            for array in arrays:  # one at a time: the receiver reads them in this order
                mx.eval(mx.distributed.send(array, right, group=self.group))

        def receive():
            received = []
            for array in arrays:
                received.append(mx.distributed.recv_like(array, left, group=self.group))
                mx.eval(received[-1])
            return received

        if self.rank % 2 == 0:
            send()
            return receive()
        received = receive()
        send()
        return received


def _layouts(ring: _Ring, q, k, causal: bool) -> tuple[SequenceLayout, SequenceLayout]:
    layouts = []
    for name, local in (("q", q.shape[2]), ("k", k.shape[2])):
        layout = SequenceLayout(local * ring.size, ring.size, causal)
        if any(layout.shard_length(r) != local for r in range(ring.size)):
            raise ValueError(
                f"{name}: every rank's shard must have the same length, so the global sequence must be a "
                f"multiple of {layout.num_chunks} ({'2P, zigzag' if causal else 'P'}) rows; got {local} rows "
                f"per rank over {ring.size} ranks"
            )
        layouts.append(layout)
    return layouts[0], layouts[1]


def agree(group, q, k, v, scale: float, causal: bool) -> None:
    """Every rank must pass the same shapes (but its own shard), dtype, scale and causal: checked
    with one all_gather before any block travels, so that a mismatch raises on every rank instead of
    hanging or exchanging garbage."""
    fields = [*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], int(causal), scale,
              ["float16", "bfloat16", "float32"].index(str(q.dtype).split(".")[-1])]
    names = ["batch", "num_heads", "num_kv_heads", "local seqlen_q", "local seqlen_k", "head_dim", "head_dim_v",
             "causal", "scale", "dtype"]
    table = mx.distributed.all_gather(mx.array([fields], dtype=_F32), group=group)
    rows = table.tolist()
    for column, name in enumerate(names):
        values = [row[column] for row in rows]
        if any(value != values[0] for value in values):
            raise ValueError(f"ring_attention: {name} must be the same on every rank, got {values} on ranks "
                             f"0..{len(rows) - 1}")


def _merge(out, lse, rows: slice, block_out, block_lse):
    """Merges attention over further keys into ``rows`` of the running float32 (out, lse)."""
    lse_a = lse[:, :, rows]
    top = mx.maximum(lse_a, block_lse)
    shift = mx.where(top == -mx.inf, 0.0, top)  # both parts empty: weights 0, lse stays -inf
    weight_a, weight_b = mx.exp(lse_a - shift), mx.exp(block_lse - shift)
    total = weight_a + weight_b
    safe = mx.where(total == 0, 1.0, total)
    out[:, :, rows] = (weight_a / safe)[..., None] * out[:, :, rows] + (weight_b / safe)[..., None] * block_out.astype(_F32)
    lse[:, :, rows] = shift + mx.log(total)
    return out, lse


@mx.custom_function
def ring_attention(q, k, v, scale, causal, group):
    """(out in q's dtype, lse float32) of this rank's query rows; arguments checked by the caller."""
    ring = _Ring(group)
    query_layout, key_layout = _layouts(ring, q, k, causal)
    out = mx.zeros((*q.shape[:3], v.shape[3]), dtype=_F32)
    lse = mx.full(q.shape[:3], -mx.inf, dtype=_F32)
    kv = [k, v]
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        for call in block_calls(query_layout, key_layout, ring.rank, source):
            block_out, block_lse = _mlx_ext.forward_with_lse(q[:, :, call.rows], kv[0][:, :, call.keys],
                                                             kv[1][:, :, call.keys], scale, call.causal)
            out, lse = _merge(out, lse, call.rows, block_out, block_lse)
        if step < ring.size - 1:
            kv = ring.shift(kv)
    return out.astype(q.dtype), lse


@ring_attention.vjp
def _ring_attention_vjp(primals, cotangents, outputs):
    # lse is internal to flash_attention_metal.mlx.ring_attention: its cotangent is not used.
    q, k, v, scale, causal, group = primals
    out, lse = outputs
    ring = _Ring(group)
    query_layout, key_layout = _layouts(ring, q, k, causal)
    # float32 kernels: a block's share is summed with the others before the one rounding.
    dout32, q32, out32 = (a.astype(_F32) for a in (cotangents[0], q, out))
    dq = mx.zeros(q.shape, dtype=_F32)
    kv, carried = [k, v], None
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        k32, v32 = (a.astype(_F32) for a in kv)
        grads = [mx.zeros(k.shape, dtype=_F32), mx.zeros(v.shape, dtype=_F32)]
        for call in block_calls(query_layout, key_layout, ring.rank, source):
            rows, keys = call.rows, call.keys
            dq_block, dk_block, dv_block = _mlx_ext.backward(
                dout32[:, :, rows], q32[:, :, rows], k32[:, :, keys], v32[:, :, keys], out32[:, :, rows],
                lse[:, :, rows], scale, call.causal)
            dq[:, :, rows] = dq[:, :, rows] + dq_block
            grads[0][:, :, keys] = grads[0][:, :, keys] + dk_block
            grads[1][:, :, keys] = grads[1][:, :, keys] + dv_block
        if carried is not None:  # the shares of the ranks this block visited before
            grads = [g + c for g, c in zip(grads, carried)]
        if step < ring.size - 1:
            *kv, dk_carried, dv_carried = ring.shift([*kv, *grads])
            carried = [dk_carried, dv_carried]
        else:
            grads = ring.shift(grads)  # back to the block's owner
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype), None, None, None


def shard_sequence(x, causal: bool, group):
    """This rank's rows of the global (batch, heads, seqlen, dim) ``x`` in the ring's layout."""
    ring = _Ring(group)
    layout = SequenceLayout(x.shape[2], ring.size, causal)
    if x.shape[2] % layout.num_chunks:
        raise ValueError(f"x: seqlen {x.shape[2]} must be a multiple of {layout.num_chunks} (equal shards over "
                         f"{ring.size} ranks{', two chunks each (causal)' if causal else ''})")
    return mx.concatenate([x[:, :, chunk.start:chunk.start + chunk.length] for chunk in layout.chunks(ring.rank)],
                          axis=2)


def unshard_sequence(x_local, causal: bool, group):
    """The global sequence from every rank's shard (an all_gather): the inverse of shard_sequence."""
    ring = _Ring(group)
    layout = SequenceLayout(x_local.shape[2] * ring.size, ring.size, causal)
    shards = mx.distributed.all_gather(x_local[None], group=group) if ring.size > 1 else x_local[None]
    pieces = sorted((chunk.start, rank, chunk.local_rows) for rank in range(ring.size) for chunk in layout.chunks(rank))
    return mx.concatenate([shards[rank][:, :, rows] for _, rank, rows in pieces], axis=2)
