"""The operators on MPS tensors: the library's exported dispatch plan encoded on PyTorch's own MPS
stream through ``torch.mps.compile_shader``, so there is no copy and no synchronisation per call.

The contract of compile_shader (PyTorch ``torch/csrc/mps/Module.cpp``, ``MetalKernelFunction`` in
``aten/src/ATen/native/mps/OperationUtils.mm``), on which the translation below rests:
- a kernel is called as ``lib.<name>(*args, threads=, group_size=)``; argument i is bound at
  ``[[buffer(i)]]``; an MPS tensor is bound as its storage's MTLBuffer at ``storage_offset() *
  element_size()`` bytes (its strides are not passed: the plan's parameter bytes carry them); a list
  of Python ints is copied with setBytes as int64 values (no ``arg_casts``), which is how the
  parameter struct's bytes travel, as little-endian int64 words;
- ``threads`` is the grid in threads (dispatchThreads), ``group_size`` the threadgroup; the plan's
  grid is whole threadgroups, so threads = threadgroups * group_size on each axis;
- the library is compiled as MSL 3.1 or later without fast math unless PYTORCH_MPS_FAST_MATH is
  set, which PyTorch reads once per process, at its first compile
  (``MetalShaderLibrary::compileLibrary``: a function-local static; ``value != "0"`` on main, a
  string comparison, where releases before it took ``std::stoi(value) != 0``); this module reads
  it once too, at its first compile from source, and then refuses any value but "0" to compile
  (the kernels rely on infinities); there are no function constants,
  so each dispatch compiles its constants prelude (``constant`` definitions of the function
  constants, from the plan) before the source (``plan.specialized_source``): one compiled library
  per prelude, cached;
- encoding goes to the current MPS stream, which commits when PyTorch decides, except between the
  plan's pieces: there recording a ``torch.mps.Event`` commits the stream's command buffer without
  waiting (PyTorch ``aten/src/ATen/mps/MPSHooks.mm``: ``recordEvent`` passes ``syncEvent`` true;
  ``aten/src/ATen/mps/MPSEvent.mm``: ``MPSEvent::recordLocked`` ends the kernel coalescing, encodes
  the signal and calls ``MPSStream::synchronize(SyncType::COMMIT)``; ``MPSStream.mm``: ``commit()``
  is ``commitAndContinue`` of its MPSCommandBuffer, or a plain commit), so that no command buffer
  of a long pass runs into the GPU watchdog, as on the Swift host. The event commits the stream
  it was acquired on, which is always the default stream (``MPSEventPool::acquireEvent`` passes no
  stream, ``m_default_stream``), and compile_shader's kernels encode on ``getCurrentMPSStream()``
  (``MetalKernelFunction::runCommandBlock``/``startEncoding``), which every PyTorch release defines
  as ``getDefaultMPSStream()`` (``MPSStream.mm``): one stream, so the commit ends the command buffer
  our kernels are in. A PyTorch whose threads may select another MPS stream (a stream pool with
  ``setCurrentMPSStream``, in development) would break that: a pass of several pieces is refused
  there while the current stream is not the default one (``torch.accelerator.current_stream``;
  ``MPSGuardImpl::getStream`` gives the default stream, id 0, in every release).
The tensor-op kernels (docs/tensor-ops.md) are compiled from source too, as a library of their
own (``plan.tensor_kernel_source()`` after the dispatch's prelude): compile_shader compiles at MSL
4.0 on macOS 26 and later (``compileLibrary`` on PyTorch main at 001d046: ``is_macos_at_least(
MACOS_26_0)`` selects ``MTLLanguageVersion4_0``; 3.2 on macOS 15, 3.1 before), which the
MetalPerformancePrimitives header needs; a PyTorch or OS that compiles older MSL fails that compile
(``compileLibrary`` raises ``c10::SyntaxError`` for a compile failure, which
``torch/csrc/Exceptions.h`` turns into Python's SyntaxError, and RuntimeError otherwise; making a
pipeline, ``getLibraryPipelineState``, raises RuntimeError), which loses only the tensor-op path:
the pass is planned again without it, and ``tensor_ops()`` says why. The library is wanted where ``plan.tensor_ops_wanted()`` says so for
the library's own Metal device: PyTorch gives Python no MTLDevice or architecture
(``torch.backends.mps`` has get_name and get_core_count), and its MPS device, the first Metal device
that is not low-power (``aten/src/ATen/mps/MPSDevice.mm``), is the Apple-silicon Mac's one GPU.
An MPS tensor's ``data_ptr()`` is never used as an address (it is an MTLBuffer handle plus an
offset). Values that need the data (NaN in an additive mask) are not checked here: the kernels
give defined output for any input without a synchronisation.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections import OrderedDict

import torch

from .. import plan as _plan
from .._native import native
from ._tensors import backward_call, forward_call

#: Work per piece of a plan, each piece ending its command buffer (``_end_command_buffer``); None
#: is the Swift host's budget against the GPU watchdog, the header's 2**FA_PLAN_PIECE_FLOPS_LOG2
#: (tests lower it).
MAX_FLOPS_PER_PIECE = None
#: Threadgroup memory of an Apple GPU threadgroup (Apple7 and later).
_MAX_THREADGROUP_MEMORY = 32768
#: A stand-in address for an optional input that is present: a plan reads only presence.
_PRESENT = 1
_PLAN_CACHE_SIZE = 256
#: The inputs the kernels copy into threadgroup memory in chunks (the header's FA_PLAN_BIND_ALIGNMENT).
_CHUNKED_ROLES = ("q", "k", "v", "out", "dout")

#: The key of ``_libraries`` that holds the PYTORCH_MPS_FAST_MATH reading (read with the first
#: library compiled from source, as PyTorch reads it with its first).
_FAST_MATH = "PYTORCH_MPS_FAST_MATH"

#: The key of ``_libraries`` that holds why the tensor-op library failed to compile (once failed,
#: every later plan keeps the simdgroup kernels), and the key of the last pass's route.
_TENSOR_FAILURE = "tensor library failure"
_ROUTE = "tensor-op route"

_lock = threading.Lock()
#: Per process: the compiled libraries by (constants prelude, tensor-op library), the fast-math
#: reading, the tensor-op library's failure and the last route.
_libraries: dict = {}
_plans: OrderedDict = OrderedDict()


class _TensorLibraryFailed(Exception):
    """compile_shader refused the tensor-op source; the message is the compiler's."""


def tensor_ops() -> str:
    """The tensor-op route of the last pass this process planned for MPS tensors and why
    (``plan.Plan.tensor_ops``: "tensor ops: ..." or "simdgroup kernels: ...", with the compiler's
    message where the tensor-op library failed to compile); "" before the first."""
    with _lock:
        return _libraries.get(_ROUTE, "")


def _target() -> _plan.Target:
    """What this process offers the plans (see the module docstring): no tensor-op library where
    the library does not want one; else "ready" (compiled per prelude on first use) until a compile
    of it failed, then "failed" with the compiler's message."""
    if not _plan.tensor_ops_wanted():
        return _plan.Target("none")
    with _lock:
        failure = _libraries.get(_TENSOR_FAILURE)
    return _plan.Target("ready") if failure is None else _plan.Target("failed", failure)


def _compile(dispatch: _plan.Dispatch):
    """The compiled library of the dispatch's specialisation, made on first use (once per process,
    prelude and library): every feature off is loaded precompiled where build.sh built it and this
    PyTorch has ``torch.mps.load_metallib``; the others, and the tensor-op kernels, are compiled
    from source. Raises _TensorLibraryFailed when compile_shader refuses the tensor-op source."""
    key = (dispatch.constants_prelude, dispatch.tensor_library)
    with _lock:
        if key in _libraries:
            return _libraries[key]
    precompiled = _plan.features_off_metallib_path() if hasattr(torch.mps, "load_metallib") else None
    if precompiled is not None and key == (_plan.features_off_prelude(), False):
        try:
            library = torch.mps.load_metallib(precompiled)
        except RuntimeError:
            # A file this Metal refuses (built for a newer OS, damaged): compile the source instead,
            # as the Swift host and the MLX extension do.
            library = None
        if library is not None:
            with _lock:
                return _libraries.setdefault(key, library)
    with _lock:
        fast_math = _libraries.setdefault(_FAST_MATH, os.environ.get(_FAST_MATH))
    if _fast_math_on(fast_math):
        raise RuntimeError(
            f"PYTORCH_MPS_FAST_MATH is set ({fast_math!r}): torch.mps.compile_shader would compile the attention "
            "kernels with fast math, which breaks the infinities they rely on (rows without keys, masked "
            "scores); unset it (or set it to 0) before the process starts (PyTorch and this module read it once)")
    try:
        library = torch.mps.compile_shader(_plan.specialized_source(dispatch))
    except (SyntaxError, RuntimeError) as error:
        if not dispatch.tensor_library:
            raise
        raise _TensorLibraryFailed(f"{type(error).__name__}: {error}") from error
    with _lock:
        return _libraries.setdefault(key, library)


def _fast_math_on(value: str | None) -> bool:
    """Whether PyTorch may compile with fast math for this PYTORCH_MPS_FAST_MATH value: set and not
    "0" (PyTorch main compares the string; ``std::stoi`` of older releases turns fewer values on,
    "00" for one, which are refused here too: the rule that is on under either)."""
    return value is not None and value != "0"


def _plan_for(p, pass_name: str, target: _plan.Target) -> _plan.Plan:
    """The plan of ``pass_name`` for fa_problem ``p`` and ``target``, cached by the problem's bytes
    (its pointer fields hold only presence markers, so equal problems have equal bytes), the target,
    and the GPU core count and tensor-op override it is planned for (FLASH_ATTENTION_GPU_CORES and
    FLASH_ATTENTION_TENSOR_OPS may change between calls)."""
    library = native()
    budget = MAX_FLOPS_PER_PIECE or 1 << library.lib.FA_PLAN_PIECE_FLOPS_LOG2
    key = (pass_name, budget, os.environ.get("FLASH_ATTENTION_GPU_CORES"), os.environ.get("FLASH_ATTENTION_TENSOR_OPS"),
           target, library.ffi.buffer(p)[:])
    with _lock:
        if key in _plans:
            _plans.move_to_end(key)
            return _plans[key]
    made = _plan.create(p, pass_name, budget, library, target)
    with _lock:
        _plans[key] = made
        while len(_plans) > _PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    return made


def _at(t: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """``t`` as compile_shader binds it, ``byte_offset`` bytes further into its storage."""
    if byte_offset == 0:
        return t
    return torch.as_strided(t, (1,), (1,), t.storage_offset() + byte_offset // t.element_size())


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where compile_shader would bind it at a byte offset that is not a multiple of 16 (a
    view such as ``x[..., 1:65]``), a copy with the same strides in storage of its own. The plan's
    parameters take the kernels' 16-byte tile copies whenever the strides and head dims are
    multiples of 16 bytes (the header's FA_PLAN_BIND_ALIGNMENT, ``scalar_copies`` in
    Shaders/flash_attention_params.h), and its bindings' offsets are multiples of the strides; the
    plan cannot see where compile_shader binds a view, so an input copied in tiles must start at a
    16-byte boundary."""
    if t.storage_offset() * t.element_size() % native().lib.FA_PLAN_BIND_ALIGNMENT == 0:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _end_command_buffer() -> None:
    """Commits what the MPS stream has encoded so far without waiting for it (see the module
    docstring): recording an event does."""
    torch.mps.Event().record()


def _current_stream_id(device: torch.device) -> int:
    """The id of the calling thread's current stream on ``device`` (0: the default stream), where
    this PyTorch can say (``torch.accelerator``, 2.6 and later); else 0."""
    accelerator = getattr(torch, "accelerator", None)
    if device.type != "mps" or not hasattr(accelerator, "current_stream"):
        return 0
    return int(accelerator.current_stream(device).stream_id)


def _check_commit_stream(made: _plan.Plan, device: torch.device) -> None:
    """A plan of several pieces commits between them through the default stream (the module
    docstring): refused unless the kernels go there too."""
    if made.piece_count > 1 and (stream := _current_stream_id(device)) != 0:
        raise RuntimeError(
            f"this {made.pass_name} pass needs {made.piece_count} command buffers (the GPU watchdog's budget, "
            f"MAX_FLOPS_PER_PIECE) and the current MPS stream is {stream}, not the default stream: PyTorch can end "
            "a command buffer from Python only on the default stream (torch.mps.Event); run the call on the "
            "default stream, or split it (fewer query rows or keys per call)")


def _words(params: bytes) -> list[int]:
    """The parameter bytes as the int64 values whose setBytes copy is those bytes."""
    return list(struct.unpack(f"<{len(params) // 8}q", params))


def _kernel(dispatch: _plan.Dispatch):
    """The dispatch's kernel (``getattr`` on the library makes its pipeline: PyTorch's
    ``getLibraryPipelineState``, which raises RuntimeError when Metal refuses it). Raises
    _TensorLibraryFailed when the tensor-op library or a pipeline of it cannot be made."""
    library = _compile(dispatch)
    try:
        return getattr(library, dispatch.kernel_name)
    except RuntimeError as error:
        if not dispatch.tensor_library:
            raise
        raise _TensorLibraryFailed(f"{dispatch.kernel_name}: {type(error).__name__}: {error}") from error


def _planned(p, pass_name: str) -> tuple[_plan.Plan, list]:
    """The plan of ``pass_name`` for ``p`` and its dispatches' kernels, every library compiled
    before anything is encoded: where the tensor-op library fails, the failure is kept (later
    plans keep the simdgroup kernels) and the pass is planned again without it."""
    made = _plan_for(p, pass_name, _target())
    try:
        kernels = [_kernel(d) for d in made.dispatches]
    except _TensorLibraryFailed as failure:
        with _lock:
            _libraries.setdefault(_TENSOR_FAILURE, str(failure))
        made = _plan_for(p, pass_name, _target())
        kernels = [_kernel(d) for d in made.dispatches]
    with _lock:
        _libraries[_ROUTE] = made.tensor_ops
    return made, kernels


def run(p, pass_name: str, tensors: dict) -> None:
    """Encodes the plan of ``pass_name`` for fa_problem ``p`` on the current MPS stream, binding
    ``tensors`` (role name -> tensor, each laid out as the problem says) and workspaces it allocates.

    Raises RuntimeError when a kernel's pipeline cannot run the plan's threadgroups (register
    pressure lowers its thread limit) or needs more threadgroup memory than a threadgroup has, when
    PYTORCH_MPS_FAST_MATH is on, or for a plan of several pieces off the default stream."""
    made, kernels = _planned(p, pass_name)
    device = next(iter(tensors.values())).device
    _check_commit_stream(made, device)
    buffers = dict(tensors)
    outputs = {b.role for b in made.buffers if b.usage == "output"}
    for role in _CHUNKED_ROLES:
        if role in buffers and role not in outputs:
            buffers[role] = _aligned(buffers[role])
    for buffer in made.buffers:
        if buffer.usage == "workspace":
            buffers[buffer.role] = torch.empty(max(buffer.byte_count, 1), dtype=torch.uint8, device=device)
    for n, dispatch in enumerate(made.dispatches):
        if n > 0 and dispatch.piece != made.dispatches[n - 1].piece:
            _end_command_buffer()
        kernel = kernels[n]
        group = list(dispatch.threads_per_threadgroup)
        if math.prod(group) > kernel.max_threads_per_threadgroup:
            raise RuntimeError(
                f"{dispatch.kernel_name} needs {math.prod(group)} threads per threadgroup; its pipeline allows "
                f"{kernel.max_threads_per_threadgroup} on this GPU")
        if kernel.static_thread_group_memory_length > _MAX_THREADGROUP_MEMORY:
            raise RuntimeError(
                f"{dispatch.kernel_name} needs {kernel.static_thread_group_memory_length} bytes of threadgroup "
                f"memory; a threadgroup has {_MAX_THREADGROUP_MEMORY}")
        arguments = [None] * (len(dispatch.bindings) + 1)
        for binding in dispatch.bindings:
            arguments[binding.index] = _at(buffers[binding.role], binding.byte_offset)
        arguments[dispatch.params_index] = _words(dispatch.params)
        kernel(*arguments, threads=list(dispatch.threads_per_grid), group_size=group)


def _present(_tensor) -> int:
    return _PRESENT


def forward(q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, dropout=None):
    """(out, lse) of the forward plan; arguments as the forward operator's (``window`` None or a pair)."""
    out, lse, call = forward_call(native(), q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd,
                                  _present, dropout)
    run(call.problem, "forward", call.tensors)
    return out, lse


def backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, dropout=None):
    """(dq, dk, dv) of the backward plan; arguments as the backward operator's."""
    grads, call = backward_call(native(), dout, q, k, v, out, lse, attn_mask, alibi_slopes, scale, causal, window,
                                softcap, bshd, _present, dropout)
    run(call.problem, "backward", call.tensors)
    return grads
