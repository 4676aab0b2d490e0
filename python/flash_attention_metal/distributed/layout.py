"""Where each rank's rows sit in the global sequence, and which (query, key) pairs a block computes:
the one layout of ring attention, shared by both of its implementations (flash_attention_metal.
distributed over MPI, flash_attention_metal.mlx.ring_attention over mx.distributed). Needs neither
transport (no mpi4py, no MLX).

A global sequence of ``seqlen`` rows is cut into chunks the way ``numpy.array_split`` cuts it (the
first ``seqlen % n`` chunks one row longer). Without a causal mask there are P chunks and rank r holds
chunk r. With one, there are 2P chunks and rank r holds chunks r and 2P-1-r (the "zigzag" layout of
ring attention for causal masks): under a causal mask early queries see few keys and late ones many,
and pairing an early chunk with a late one gives every rank nearly the same number of visible pairs.

Masks are the library's: bottom-right causal over the GLOBAL sequence, query i sees key j iff
j <= i + seqlen_k - seqlen_q.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """A run of rows: ``start`` is its first row in the global sequence, ``local_start`` its first
    row in the shard of the rank that holds it, ``length`` its row count (0 for an empty chunk)."""

    start: int
    length: int
    local_start: int

    @property
    def local_rows(self) -> slice:
        """Its rows within the holder's shard."""
        return slice(self.local_start, self.local_start + self.length)


@dataclass(frozen=True)
class SequenceLayout:
    """The split of a global sequence of ``seqlen`` rows over ``world_size`` ranks (zigzag when
    ``causal``)."""

    seqlen: int
    world_size: int
    causal: bool

    @property
    def num_chunks(self) -> int:
        return 2 * self.world_size if self.causal else self.world_size

    def chunk_indices(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices rank ``rank`` holds, in the order of its shard."""
        if self.causal:
            return (rank, self.num_chunks - 1 - rank)
        return (rank,)

    def _chunk_span(self, index: int) -> tuple[int, int]:
        base, extra = divmod(self.seqlen, self.num_chunks)
        return index * base + min(index, extra), base + (1 if index < extra else 0)

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks of rank ``rank``, with their global and local first rows."""
        result, local = [], 0
        for index in self.chunk_indices(rank):
            start, length = self._chunk_span(index)
            result.append(Chunk(start, length, local))
            local += length
        return tuple(result)

    def shard_length(self, rank: int) -> int:
        """Rows in rank ``rank``'s shard."""
        return sum(chunk.length for chunk in self.chunks(rank))


@dataclass(frozen=True)
class Call:
    """One library call: ``rows`` of queries against ``keys``, with the library's bottom-right causal
    mask or without a mask (relative to two chunks, or to two shards)."""

    rows: slice
    keys: slice
    causal: bool

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs this call computes."""
        m, n = self.rows.stop - self.rows.start, self.keys.stop - self.keys.start
        return m * (n - m) + m * (m + 1) // 2 if self.causal else m * n


def segments(query: Chunk, key: Chunk, causal: bool, diagonal_offset: int) -> tuple[Call, ...]:
    """The library calls that compute query chunk ``query`` against key chunk ``key``.

    ``diagonal_offset`` is seqlen_k - seqlen_q of the global sequences (bottom-right alignment).
    Row a of the query chunk sees key b of the key chunk iff b <= a + d, d = query.start +
    diagonal_offset - key.start. Rows with a + d < 0 see nothing (left out: they contribute lse
    -inf); rows with a + d >= n (n keys) see every key (one unmasked call); the rows between see a
    staircase, which is the library's bottom-right mask on those rows against the first a1 + d keys
    (a1 the end of the staircase rows). A block entirely hidden by the mask gives no call.
    """
    m, n = query.length, key.length
    if m == 0 or n == 0:
        return ()
    if not causal:
        return (Call(slice(0, m), slice(0, n), False),)
    d = query.start + diagonal_offset - key.start
    first = min(max(-d, 0), m)
    staircase_end = min(max(n - d, first), m)
    result = []
    if staircase_end > first:
        result.append(Call(slice(first, staircase_end), slice(0, staircase_end + d), True))
    if m > staircase_end:
        result.append(Call(slice(staircase_end, m), slice(0, n), False))
    return tuple(result)


def block_calls(query_layout: SequenceLayout, key_layout: SequenceLayout, rank: int, source: int) -> list[Call]:
    """The fewest library calls that compute rank ``rank``'s queries against rank ``source``'s keys.

    Segments of all chunk pairs, in shard coordinates, are joined where one call computes both
    (``_join``): fewer, larger calls run faster and round each gradient once per call instead of
    once per chunk pair. With the zigzag layout and seqlen_q == seqlen_k this leaves one call per
    step, and two on the rank's own shard.
    """
    offset = key_layout.seqlen - query_layout.seqlen
    calls = [
        Call(_shift(segment.rows, query.local_start), _shift(segment.keys, key.local_start), segment.causal)
        for query in query_layout.chunks(rank)
        for key in key_layout.chunks(source)
        for segment in segments(query, key, query_layout.causal, offset)
    ]
    while True:
        pair = next(((i, j) for i in range(len(calls)) for j in range(len(calls))
                     if i != j and _join(calls[i], calls[j]) is not None), None)
        if pair is None:
            return calls
        first, second = pair
        calls[first] = _join(calls[first], calls[second])
        del calls[second]


def _shift(span: slice, offset: int) -> slice:
    return slice(span.start + offset, span.stop + offset)


def _join(first: Call, second: Call) -> Call | None:
    """One call equal to ``first`` followed by ``second``, or None.

    Unmasked calls join along rows (same keys) or along keys (same rows). An unmasked call on keys
    K1 joins a causal call on the same rows R and keys K2 right after K1: the bottom-right mask of
    R against K1 + K2 shows all of K1 to every row (as |K2| >= |R| - 1, which ``segments`` ensures)
    and K2 as before.
    """
    if first.causal:
        return None
    if first.rows == second.rows and first.keys.stop == second.keys.start:
        rows, keys = second.rows.stop - second.rows.start, second.keys.stop - second.keys.start
        if second.causal and keys < rows - 1:
            return None
        return Call(first.rows, slice(first.keys.start, second.keys.stop), second.causal)
    if not second.causal and first.keys == second.keys and first.rows.stop == second.rows.start:
        return Call(slice(first.rows.start, second.rows.stop), first.keys, False)
    return None


def rank_work(query_layout: SequenceLayout, key_layout: SequenceLayout, rank: int) -> int:
    """Visible (query, key) pairs rank ``rank`` computes per (batch, head) over a whole ring pass."""
    return sum(
        call.visible_pairs
        for source in range(key_layout.world_size)
        for call in block_calls(query_layout, key_layout, rank, source)
    )


__all__ = ["Call", "Chunk", "SequenceLayout", "block_calls", "rank_work", "segments"]
