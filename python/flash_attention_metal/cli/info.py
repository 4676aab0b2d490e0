"""``info``: what library, backend and device this installation uses."""

from __future__ import annotations

import argparse

from .._native import native
from ._context import context_for


def run(args: argparse.Namespace) -> int:
    """Prints the version (and the loaded library's where it differs), backend, device, the backend's note (where the Metal kernels came from, or
    why auto runs on the CPU engine), library and header paths, largest head_dim; returns 0."""
    loaded = native()
    context = context_for(args.backend)
    library_version = loaded.ffi.string(loaded.lib.fa_version()).decode()
    from .. import __version__

    version = __version__
    if library_version != __version__:
        version += f" (the loaded library is {library_version}: rebuild it with ./build.sh)"
    rows = [
        ("version", version),
        ("backend", context.backend),
        ("device", context.device),
        ("note", context.note or "-"),
        ("library", str(loaded.path)),
        ("header", str(loaded.header_path)),
        ("max head_dim", str(context.max_head_dim)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
