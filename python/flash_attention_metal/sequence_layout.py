"""Deprecated alias of ``flash_attention_metal.distributed.layout``, where the ring layout moved
beside the implementations that use it; kept for one release."""

from .distributed.layout import Call, Chunk, SequenceLayout, block_calls, rank_work, segments

__all__ = ["Call", "Chunk", "SequenceLayout", "block_calls", "rank_work", "segments"]
