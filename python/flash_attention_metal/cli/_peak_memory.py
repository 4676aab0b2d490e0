"""Peak memory of one call, for ``bench --compare``: measured in a fresh process per call.

What is measured: the growth of the peak resident set size during the call over the resident size
just before it, in a child process that has already made one small warm-up call of the same kind
(so one-time set-up such as the engine's worker stacks, Metal pipelines or a peer's kernel cache is
not counted) and has its inputs in place (they are not counted; the outputs and every temporary
are). A fresh process is needed because allocators keep freed memory: in the benchmarking process
a repeated call reuses what the timing runs left behind and would show no growth. For the same
reason glibc's free memory is handed back to the system (malloc_trim) and MLX's buffer cache and
PyTorch's MPS cache are emptied just before the call.

On Linux the peak is VmHWM of /proc/self/status, reset to the current size through
/proc/self/clear_refs just before the call (ru_maxrss would carry the peak of the warm-up); on
macOS it is ru_maxrss, which counts host memory the process touches. Whether an Apple GPU's
allocations appear in it is not verified here; a Mac user's JSON record says which was measured.

Run as ``python -m flash_attention_metal.cli._peak_memory SPEC`` (the child; SPEC is JSON).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

_KIB = 1024
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def method() -> str:
    """What ``peak_growth`` measures on this system, for reports."""
    if _STATUS.is_file():
        return "peak RSS growth of one call in a fresh process (Linux VmHWM, reset before the call)"
    return "peak RSS growth of one call in a fresh process (ru_maxrss)"


def resolution_bytes() -> int:
    """Smallest nonzero growth ``peak_growth`` can report: 1 KiB on Linux (/proc counts in kB), a
    page elsewhere (ru_maxrss grows page by page)."""
    return _KIB if _STATUS.is_file() else resource.getpagesize()


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * _KIB
    raise RuntimeError(f"{field} missing from {_STATUS}")


def _release_free_memory() -> None:
    """glibc keeps freed heap memory resident, and a call that reuses it shows no growth: return it
    to the system first (malloc_trim(0)). Other C libraries have no such call; macOS's allocator
    returns large blocks when they are freed."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


def peak_growth(operation) -> int:
    """Bytes by which the peak resident set size during ``operation()`` exceeds the size before it."""
    _release_free_memory()
    if _STATUS.is_file():
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current VmRSS
        before = _status_bytes("VmRSS")
        operation()
        return max(0, _status_bytes("VmHWM") - before)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    operation()
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)  # bytes on macOS


def measured_step(step, *arguments) -> dict:
    """One training step ``step(*arguments)``, which returns its loss, measured: {"loss": that loss,
    "seconds": its wall time, "rss_growth": its ``peak_growth`` in bytes}."""
    result = {}

    def run():
        start = time.perf_counter()
        result["loss"] = step(*arguments)
        result["seconds"] = time.perf_counter() - start

    result["rss_growth"] = peak_growth(run)
    return result


def memory_ratio(peer_bytes: int, library_bytes: int, resolution: int) -> str:
    """peer/library as text. A library growth below the measurement resolution (reported as 0)
    bounds the ratio only from below: ``> N`` with N = peer / resolution, or ``n/a`` when the peer
    grew by nothing measurable either."""
    if library_bytes >= resolution:
        return f"{peer_bytes / library_bytes:.1f}"
    if peer_bytes >= resolution:
        return f"> {peer_bytes / resolution:.0f}"
    return "n/a"


def measure(implementation: str, case, operation: str, backend: str) -> int:
    """The peak memory growth of one ``operation`` of ``implementation`` on ``case``, measured in a
    fresh child process (the library on ``backend``). Raises RuntimeError with the child's last
    error line when it fails."""
    spec = {"implementation": implementation, "case": case.to_dict(), "operation": operation, "backend": backend}
    result = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], capture_output=True, text=True,
                            env=dict(os.environ))
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"the memory child exited with status {result.returncode}")
    return int(json.loads(result.stdout.strip().splitlines()[-1])["peak_growth_bytes"])


def _child(spec: dict) -> None:
    from ..context import Context
    from .peers import Case, Library, load_peer

    name, operation = spec["implementation"], spec["operation"]
    implementation = Library(Context(spec["backend"])) if name == "library" else load_peer(name)
    case = Case(**spec["case"])
    small = case.small()
    implementation.operations(small, *small.inputs())[operation]()
    run = implementation.operations(case, *case.inputs())[operation]
    implementation.release_caches()
    print(json.dumps({"peak_growth_bytes": peak_growth(run)}))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
