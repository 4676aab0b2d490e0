"""``bench --profile``: the profile of the last run of each measured call, as a table.

A ``ProfileRecorder`` stands in for the bench's Context: it passes every call through and keeps the
context's ``last_profile`` after each forward and backward, so when the bench is done it holds the
last run of every (pass, seqlen, causal) it measured.
"""

from __future__ import annotations

import argparse

from ..profile import DispatchProfile, Profile

_HEADER = ("call", "kernel", "grid", "threads", "tg memory B", "MMAs", "barriers", "seconds")


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--profile`` option of ``bench``."""
    parser.add_argument(
        "--profile", action="store_true",
        help="print the profile of the last run of each measured call: per kernel its grid, threads, "
             "threadgroup memory and (CPU engine) 8x8x8 SIMD-group multiply-accumulates and barriers; "
             "seconds are GPU time on Metal, wall time on the CPU engine")


class ProfileRecorder:
    """A Context whose forward and backward calls also keep the calling thread's last profile."""

    def __init__(self, context) -> None:
        self._context = context
        self.profiles: dict[str, Profile] = {}

    def __getattr__(self, name):
        return getattr(self._context, name)

    def forward(self, q, k, v, **options):
        result = self._context.forward(q, k, v, **options)
        self._keep("forward", q, k, options)
        return result

    def backward(self, dout, q, k, v, out, lse, **options):
        result = self._context.backward(dout, q, k, v, out, lse, **options)
        self._keep("backward", q, k, options)
        return result

    def _keep(self, name: str, q, k, options) -> None:
        seqlens = f"{q.shape[2]}" if q.shape[2] == k.shape[2] else f"{q.shape[2]}x{k.shape[2]}"
        label = f"{name} {seqlens}{' causal' if options.get('causal') else ''}"
        profile = self._context.last_profile
        if profile is not None:
            self.profiles[label] = profile


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6f}"


def _row(call: str, d: DispatchProfile) -> tuple[str, ...]:
    return (call, d.kernel, "x".join(map(str, d.threadgroups)), "x".join(map(str, d.threads_per_threadgroup)),
            str(d.threadgroup_memory), _count(d.simdgroup_multiply_accumulates), _count(d.threadgroup_barriers),
            _seconds(d.seconds))


def format_profiles(profiles: dict[str, Profile]) -> str:
    """One row per dispatched kernel and a total row per call (with the command buffers it ran in),
    in columns."""
    rows = [_HEADER]
    for call, profile in profiles.items():
        rows.extend(_row(call if i == 0 else "", d) for i, d in enumerate(profile.dispatches))
        buffers = f"{profile.command_buffers} command buffer{'s' if profile.command_buffers != 1 else ''}"
        rows.append(("", "(call total)", buffers, "", "", "", "", _seconds(profile.seconds)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    left = {0, 1}  # text columns; numbers align right
    return "\n".join(
        "  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        .rstrip()
        for row in rows)


def print_profiles(recorder: ProfileRecorder) -> None:
    """Prints the table of the recorder's profiles, with what its seconds measure."""
    clock = "GPU time of the command buffers" if recorder.backend == "metal" else "CPU engine wall time"
    print(f"profile of the last run of each measured call (seconds: {clock}; "
          "MMAs: 8x8x8 simdgroup multiply-accumulates)")
    print(format_profiles(recorder.profiles))
