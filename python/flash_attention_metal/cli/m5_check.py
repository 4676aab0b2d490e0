"""``m5-check``: what an owner of an Apple M5 runs for the tensor-op kernels (issue 37;
docs/tensor-ops.md, "What an M5 owner should run").

Per head_dim it prints the path the library's forward and backward take, the tensor-op kernels
(Metal 4's ``matmul2d`` on the GPU's neural accelerators: a kernel with ``tensor`` in its name) or
the simdgroup_matrix kernels, and why; then the best wall time (after one warm-up) of forward and
of forward+backward of three implementations on the same float16 (or bfloat16) inputs:

- ``ours``: the library as it routes by itself;
- ``simdgroup``: the library with ``FLASH_ATTENTION_TENSOR_OPS=0`` (a context made while the
  variable is set), the existing kernels; the command fails if a tensor-op kernel still runs;
- ``mlx``: ``mx.fast.scaled_dot_product_attention``, forward+backward through ``mx.vjp``
  (``peers.MLX``; MLX picks its own NAX kernels on an M5).

Off Apple GPUs it runs as well, on the CPU engine at a small default size, and says so: the
timings then describe the engine, not an M5.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import _types
from ._context import context_for
from ._measure import best_ms, forward_flops
from .peers import MLX, Case, Library, Unavailable

TENSOR_OPS_VARIABLE = "FLASH_ATTENTION_TENSOR_OPS"
HEAD_DIMS = (64, 96, 128, 256)
_GPU_SEQLEN = 4096
_CPU_SEQLEN = 64
_HEADS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``m5-check``."""
    parser.add_argument("--head-dims", type=_types.head_dim, nargs="+", default=list(HEAD_DIMS),
                        help=f"head dims to time (default: {' '.join(map(str, HEAD_DIMS))})")
    parser.add_argument("--seqlen", type=_types.positive_int, default=None,
                        help=f"seqlen_q = seqlen_k (default: {_GPU_SEQLEN} on Metal, {_CPU_SEQLEN} on the CPU engine)")
    parser.add_argument("--batch", type=_types.positive_int, default=1, help="batch size (default: %(default)s)")
    parser.add_argument("--heads", type=_types.positive_int, default=_HEADS,
                        help="query and KV heads (default: %(default)s)")
    parser.add_argument("--causal", action="store_true", help="causal masking (default: off)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                        help="dtype of q, k, v and dout (default: %(default)s)")
    parser.add_argument("--repeats", type=_types.positive_int, default=3,
                        help="timed runs after one warm-up run; the best counts (default: %(default)s)")


@contextmanager
def tensor_ops_variable(value: str):
    """FLASH_ATTENTION_TENSOR_OPS set to ``value`` inside, restored after."""
    old = os.environ.get(TENSOR_OPS_VARIABLE)
    os.environ[TENSOR_OPS_VARIABLE] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[TENSOR_OPS_VARIABLE]
        else:
            os.environ[TENSOR_OPS_VARIABLE] = old


def _kernels(context) -> tuple[str, ...]:
    profile = context.last_profile
    return tuple(d.kernel for d in profile.dispatches) if profile else ()


def path_name(kernels: tuple[str, ...]) -> str:
    """"tensor ops" when a kernel of the pass is a tensor-op kernel, else "simdgroup"."""
    return "tensor ops" if any("tensor" in kernel for kernel in kernels) else "simdgroup"


def reason(context, tensor: bool, variable: str | None) -> str:
    """Why the library's own run took the path it did (``tensor``: a tensor-op kernel ran), from
    FLASH_ATTENTION_TENSOR_OPS (``variable``) and the context's backend, device and note."""
    engine = context.backend != "metal"
    if variable == "0":
        return f"{TENSOR_OPS_VARIABLE}=0 forbids the tensor-op kernels"
    if variable == "1" and tensor:
        return (f"{TENSOR_OPS_VARIABLE}=1 forces the tensor-op kernels" +
                (" (here through the CPU engine's emulation of matmul2d: a correctness check, not an M5 timing)"
                 if engine else ""))
    if variable == "1":
        return f"{TENSOR_OPS_VARIABLE}=1 asks for the tensor-op kernels, but none ran: this build has none for the case"
    if engine:
        return (f"not an Apple GPU ({context.device}): the CPU engine runs the simdgroup_matrix kernels; "
                f"{TENSOR_OPS_VARIABLE}=1 runs the tensor-op kernels through its emulation")
    if tensor:
        return "the plan chose them: this GPU has the tensor units and this macOS the API"
    note = f" ({context.note})" if context.note else ""
    return ("the plan kept the simdgroup_matrix kernels: this GPU or macOS lacks the tensor units or the API "
            "(MLX's gate: macOS 26.2 and GPU generation 17 or later), or no tensor-op kernel covers the case" + note)


@dataclass(frozen=True)
class Timing:
    """Best wall times in milliseconds (None: not measured)."""

    forward_ms: float | None
    both_ms: float | None


def _time(operations: dict, repeats: int) -> Timing:
    return Timing(best_ms(operations["forward"], repeats), best_ms(operations["fwd+bwd"], repeats))


def _inputs(case: Case, dtype: str) -> list:
    """The case's seeded q, k, v, dout in ``dtype`` (bfloat16: rounded from the float16 draw)."""
    inputs = case.inputs()
    return inputs if dtype == "float16" else [a.astype(np.float32).astype(ml_dtypes.bfloat16) for a in inputs]


def _mlx_timing(mlx, case: Case, inputs, dtype: str, repeats: int) -> tuple[Timing, str]:
    """MLX's times on ``inputs`` (cast to MLX's bfloat16 when ``dtype`` is), and "" or why they
    are missing (MLX refused the case)."""
    mx = mlx.mx
    if dtype == "bfloat16":
        inputs = [mx.array(a.astype(np.float32)).astype(mx.bfloat16) for a in inputs]
    try:
        return _time(mlx.operations(case, *inputs), repeats), ""
    except (RuntimeError, ValueError) as error:
        return Timing(None, None), f"mlx failed at head_dim {case.head_dim}: {error}"


def _library_paths(context, case: Case, inputs) -> tuple[str, str]:
    """(forward path, backward path) of one forward and backward on ``inputs``."""
    q, k, v, dout = inputs
    out, lse = context.forward(q, k, v, causal=case.causal)
    forward = path_name(_kernels(context))
    context.backward(dout, q, k, v, out, lse, causal=case.causal)
    return forward, path_name(_kernels(context))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    """Prints the device, then per head_dim the paths, why, and the times of ours, the simdgroup
    path and MLX's sdpa; returns 1 when FLASH_ATTENTION_TENSOR_OPS=0 still ran a tensor-op
    kernel, else 0."""
    context = context_for(args.backend)
    engine = context.backend != "metal"
    seqlen = args.seqlen or (_CPU_SEQLEN if engine else _GPU_SEQLEN)
    variable = os.environ.get(TENSOR_OPS_VARIABLE)
    print(f"device: {context.device} (backend {context.backend})" +
          (": not an Apple GPU; times below are the CPU engine's, not an M5's" if engine else ""))
    with tensor_ops_variable("0"):
        simdgroup = Library(context_for(args.backend))
    try:
        mlx = MLX()
        print(f"mlx: {mlx.version} on {mlx.device}")
    except Unavailable as missing:
        mlx = None
        print(f"mlx: unavailable ({missing})")
    print(f"shape: batch {args.batch}, {args.heads} heads, seqlen {seqlen}, {args.dtype}"
          f"{', causal' if args.causal else ''}; best of {args.repeats} after a warm-up, wall ms")
    ours = Library(context)
    header = (f"{'head_dim':>8}  {'forward path':<12}  {'backward path':<13}  {'ours fwd':>9}  {'simdgroup fwd':>13}  "
              f"{'mlx fwd':>9}  {'ours f+b':>9}  {'simdgroup f+b':>13}  {'mlx f+b':>9}  {'ours fwd TFLOP/s':>16}")
    print(header)
    reasons, notes, status = {}, [], 0
    for head_dim in args.head_dims:
        case = Case("m5-check", args.batch, args.heads, args.heads, seqlen, seqlen, head_dim, args.causal)
        inputs = _inputs(case, args.dtype)
        forward_path, backward_path = _library_paths(context, case, inputs)
        with tensor_ops_variable("0"):
            forbidden = _library_paths(simdgroup.context, case, inputs)
        if "tensor ops" in forbidden:
            print(f"error: head_dim {head_dim}: {TENSOR_OPS_VARIABLE}=0 still ran a tensor-op kernel")
            status = 1
        timings = [_time(ours.operations(case, *inputs), args.repeats)]
        with tensor_ops_variable("0"):
            timings.append(_time(simdgroup.operations(case, *inputs), args.repeats))
        mlx_timing, note = _mlx_timing(mlx, case, inputs, args.dtype, args.repeats) if mlx else (Timing(None, None), "")
        timings.append(mlx_timing)
        notes += [note] if note else []
        flops = forward_flops(args.batch, args.heads, seqlen, seqlen, head_dim, args.causal)
        tflops = flops / (timings[0].forward_ms * 1e-3) / 1e12
        print(f"{head_dim:>8}  {forward_path:<12}  {backward_path:<13}  {_ms(timings[0].forward_ms):>9}  "
              f"{_ms(timings[1].forward_ms):>13}  {_ms(timings[2].forward_ms):>9}  {_ms(timings[0].both_ms):>9}  "
              f"{_ms(timings[1].both_ms):>13}  {_ms(timings[2].both_ms):>9}  {tflops:>16.3g}")
        for path in (forward_path, backward_path):
            listed = reasons.setdefault(reason(context, path == "tensor ops", variable), [])
            if head_dim not in listed:
                listed.append(head_dim)
    for text, head_dims in reasons.items():
        print(f"why (head_dim {', '.join(map(str, head_dims))}): {text}")
    for note in notes:
        print(note)
    return status
