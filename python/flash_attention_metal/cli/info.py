"""``info``: what library, backend and device this installation uses."""

from __future__ import annotations

import argparse

from .. import plan
from ..errors import FlashAttentionError
from .._native import native
from ._context import context_for

_CORES_SOURCES = {
    "FLASH_ATTENTION_GPU_CORES": "from FLASH_ATTENTION_GPU_CORES",
    "device": "the Metal device's gpu-core-count",
    "nominal": "the nominal GPU; set FLASH_ATTENTION_GPU_CORES to plan for another",
}


def _cores(cores: int, source: str) -> str:
    return f"{cores} ({_CORES_SOURCES[source]})"


def _exported_tensor_ops() -> str:
    """The tensor-op route of an exported plan (a float16 head_dim 64 forward that the tensor-op
    kernel serves) as the PyTorch MPS and MLX GPU paths make it on the library's Metal device, with
    their tensor-op library compiled where they compile it (docs/tensor-ops.md, "The front ends")."""
    from .._abi import new_problem
    from .._validation import Shape

    loaded = native()
    problem = new_problem(loaded.ffi, loaded.lib, Shape(1, 1, 1, 128, 128, 64), False, 0.125, "float16", {})
    target = plan.Target("ready" if plan.tensor_ops_wanted() else "none")
    try:
        route = plan.create(problem, "forward", target=target).tensor_ops
    except FlashAttentionError as error:  # a FLASH_ATTENTION_TENSOR_OPS value the library refuses
        route = str(error)
    return route + " (exported plans: PyTorch MPS, MLX GPU)"


def run(args: argparse.Namespace) -> int:
    """Prints the version (and the loaded library's where it differs), backend, device, the backend's note (where the Metal kernels came from, or
    why auto runs on the CPU engine), the GPU cores the decode chunks are planned for (the
    context's, then the exported plans' of the PyTorch MPS and MLX GPU paths where they differ) and
    where each count comes from, the exported plans' tensor-op route, library and header paths,
    largest head_dim; returns 0."""
    loaded = native()
    context = context_for(args.backend)
    library_version = loaded.ffi.string(loaded.lib.fa_version()).decode()
    from .. import __version__

    version = __version__
    if library_version != __version__:
        version += f" (the loaded library is {library_version}: rebuild it with ./build.sh)"
    cores, exported = context.gpu_cores, plan.gpu_cores()
    rows = [
        ("version", version),
        ("backend", context.backend),
        ("device", context.device),
        ("note", context.note or "-"),
        ("gpu cores", _cores(*cores) + ("" if exported == cores else
                                         f"; exported plans (PyTorch MPS, MLX GPU): {_cores(*exported)}")),
        ("tensor ops", _exported_tensor_ops()),
        ("library", str(loaded.path)),
        ("header", str(loaded.header_path)),
        ("max head_dim", str(context.max_head_dim)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
