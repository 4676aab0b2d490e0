"""The profile of the last call: what ``fa_context_last_profile`` reports, as dataclasses.

Per context and per thread: ``Context.last_profile`` reads the profile of the calling thread's last
successful forward, backward or merge on that context. Times are measured: on Metal the GPU time
of the call's command buffers (gpuEndTime - gpuStartTime), on the CPU engine the engine's wall
time (not an Apple GPU figure). SIMD-group matrix products, barriers and device bytes read are counted
by the CPU engine only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_UNAVAILABLE = 2**64 - 1  # UINT64_MAX: a counter the backend cannot measure (Metal)


@dataclass(frozen=True)
class DispatchProfile:
    """One dispatched kernel.

    Attributes:
        kernel: the kernel function's name, e.g. ``flash_attention_forward_f16_d64``.
        threadgroups: threadgroups per grid (x, y, z).
        threads_per_threadgroup: (x, y, z).
        threadgroup_memory: bytes of static threadgroup memory (Metal: the pipeline's
            staticThreadgroupMemoryLength; CPU engine: the kernel's threadgroup storage).
        simdgroup_multiply_accumulates: 8x8x8 SIMD-group matrix products executed, one per
            SIMD-group call; None on Metal.
        threadgroup_barriers: threadgroup barriers executed, one per threadgroup and barrier;
            None on Metal.
        seconds: wall time of this dispatch on the CPU engine; None on Metal.
        device_bytes_read: bytes read from each bound buffer, indexed by its ``[[buffer(i)]]``
            index (16 slots), by the kernels' tile copies and decode slice loads (q, k, v, out,
            dout), counted by the CPU engine when ``FLASH_ATTENTION_COUNT_DEVICE_READS=1`` is in
            the environment at the call; None otherwise and on Metal. For the forward kernels k is slot 1 and v slot 2.
        specialization: the function constants the kernel was compiled with, name to value (a
            bool as 0 or 1), e.g. ``{"fa_mask_type": 0, "fa_has_softcap": 1}``; empty for a kernel
            without (docs/specialisation.md).
    """

    kernel: str
    threadgroups: tuple[int, int, int]
    threads_per_threadgroup: tuple[int, int, int]
    threadgroup_memory: int
    simdgroup_multiply_accumulates: int | None
    threadgroup_barriers: int | None
    seconds: float | None
    specialization: dict[str, int] = field(default_factory=dict)
    device_bytes_read: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Profile:
    """The last call: ``seconds`` (Metal: GPU time of its command buffers; CPU engine: wall time
    of its dispatches, summed), ``dispatches``, one ``DispatchProfile`` per kernel of the pass in
    order (for the whole problem, summed over its pieces), and ``command_buffers``, the pieces the
    pass ran in (Metal: one command buffer each, of at most 2**35 FLOP, against the GPU watchdog;
    CPU engine: 1), and ``gpu_cores``, the GPU core count the split-KV chunks were planned for
    (``FLASH_ATTENTION_GPU_CORES`` when set, else the device's on Metal, else the nominal 10;
    docs/decode.md)."""

    seconds: float
    dispatches: list[DispatchProfile]
    command_buffers: int = 1
    gpu_cores: int | None = None


def last_profile(native, handle) -> Profile | None:
    """The calling thread's last profile on the context ``handle``; None before its first
    successful call. Raises FlashAttentionError if the library reports an error."""
    ffi, lib = native.ffi, native.lib
    summary = ffi.new("fa_profile *")
    summary.struct_size = ffi.sizeof("fa_profile")
    native.raise_for_status(lib.fa_context_last_profile(handle, summary))
    if summary.dispatch_count == 0:
        return None
    record = ffi.new("fa_dispatch_profile *")
    dispatches = []
    for index in range(summary.dispatch_count):
        record.struct_size = ffi.sizeof("fa_dispatch_profile")
        native.raise_for_status(lib.fa_context_last_profile_dispatch(handle, index, record))
        dispatches.append(DispatchProfile(
            kernel=ffi.string(record.kernel_name).decode("utf-8", "replace"),
            threadgroups=tuple(record.threadgroups_per_grid),
            threads_per_threadgroup=tuple(record.threads_per_threadgroup),
            threadgroup_memory=int(record.threadgroup_memory_length),
            simdgroup_multiply_accumulates=_counter(record.simdgroup_multiply_accumulates),
            threadgroup_barriers=_counter(record.threadgroup_barriers),
            seconds=None if math.isnan(record.seconds) else float(record.seconds),
            specialization=_specialization(ffi.string(record.specialization).decode("utf-8", "replace")),
            device_bytes_read=_counters(record.device_bytes_read),
        ))
    return Profile(seconds=float(summary.seconds), dispatches=dispatches,
                   command_buffers=int(summary.command_buffers), gpu_cores=int(summary.gpu_cores))


def _specialization(text: str) -> dict[str, int]:
    """``name=value`` pairs separated by spaces, as fa_dispatch_profile.specialization holds them."""
    pairs = (item.partition("=") for item in text.split())
    return {name: int(value) for name, _, value in pairs}


def _counter(value: int) -> int | None:
    return None if value == _UNAVAILABLE else int(value)


def _counters(values) -> tuple[int, ...] | None:
    counts = tuple(int(value) for value in values)
    return None if all(value == _UNAVAILABLE for value in counts) else counts


__all__ = ["DispatchProfile", "Profile", "last_profile"]
