"""The exported dispatch plan (``fa_plan_*`` in flash_attention_metal.h), read into Python values.

A framework that encodes Metal work on its own stream (PyTorch's ``torch.mps.compile_shader``, see
``flash_attention_metal.torch``) runs a pass of the library by compiling ``kernel_source()`` and
encoding each ``Dispatch`` of the pass's ``Plan`` in order: its kernel, specialised by its
constants; at each ``Binding.index`` the buffer of ``Binding.role`` offset by ``byte_offset``; the
parameter bytes at ``params_index`` (unless ``params_from_buffer``: then a binding is there, the
sequence table of a variable-length pass); ``threadgroups_per_grid`` threadgroups of
``threads_per_threadgroup`` threads. Workspaces (``Buffer.usage == "workspace"``) are allocated by
the host for the pass, uninitialised. Role names are the C enumerators' (``FA_BUFFER_ROLE_Q`` is
``"q"``, ``FA_BUFFER_ROLE_LSE_RESIDUAL`` is ``"lse_residual"``).

The Metal 4 tensor-op kernels (docs/tensor-ops.md) are a library of their own,
``tensor_kernel_source()``, compiled at MSL 4.0: a host compiles it where ``tensor_ops_wanted()``
says so and passes ``Target`` (what it has) to ``create``; the plan then names tensor-op kernels
(``Dispatch.tensor_library``) where the route allows, and ``Plan.tensor_ops`` says which way and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._native import NativeLibrary, native

_TYPE_NAMES = {"FA_SPECIALIZATION_BOOL": "bool", "FA_SPECIALIZATION_UINT32": "uint"}
_USAGE_NAMES = {"FA_BUFFER_INPUT": "input", "FA_BUFFER_OUTPUT": "output", "FA_BUFFER_WORKSPACE": "workspace",
                "FA_BUFFER_READ_WRITE": "read_write"}
_PASS_NAMES = {"forward": "FA_PASS_FORWARD", "backward": "FA_PASS_BACKWARD"}


@dataclass(frozen=True)
class Buffer:
    """One buffer of a plan: ``role``; ``usage`` "input", "output", "workspace" or "read_write" (a
    KV cache, bound in place: see ``FA_BUFFER_READ_WRITE``); bytes per element; ``byte_count``, the
    bytes the kernels may touch from its start."""

    role: str
    usage: str
    element_size: int
    byte_count: int


@dataclass(frozen=True)
class Binding:
    """The buffer of ``role`` at ``[[buffer(index)]]``, ``byte_offset`` bytes from its start;
    the dispatch touches at most ``byte_length`` bytes from there."""

    index: int
    role: str
    byte_offset: int
    byte_length: int


@dataclass(frozen=True)
class Specialization:
    """A function constant: ``name`` in the kernel source, its ``index``, ``type`` ("bool" or
    "uint", MSL's names) and ``value`` (0 or 1 for a bool)."""

    name: str
    index: int
    type: str
    value: int


@dataclass(frozen=True)
class Dispatch:
    """One kernel dispatch, in encoding order (see the module docstring). ``params`` holds the
    parameter struct's bytes (a multiple of 8), to bind at ``params_index`` unless
    ``params_from_buffer`` (a binding at ``params_index`` holds the struct: a variable-length pass's
    ``sequence_table``); ``piece`` says which piece of the plan it is in;
    ``specialization`` the values of the function constants its kernel reads, and
    ``constants_prelude`` the text that stands for them before the kernel source where a compiler
    cannot set function constants (``specialized_source``)."""

    kernel_name: str
    piece: int
    threadgroups_per_grid: tuple[int, int, int]
    threads_per_threadgroup: tuple[int, int, int]
    bindings: tuple[Binding, ...]
    specialization: tuple[Specialization, ...]
    params_index: int
    params: bytes
    constants_prelude: str
    params_from_buffer: bool = False

    @property
    def tensor_library(self) -> bool:
        """Whether the kernel is a tensor-op kernel, compiled from ``tensor_kernel_source()``."""
        return "_tensor_" in self.kernel_name

    @property
    def threads_per_grid(self) -> tuple[int, int, int]:
        """The grid in threads, for hosts that dispatch threads (dispatchThreads)."""
        return tuple(g * t for g, t in zip(self.threadgroups_per_grid, self.threads_per_threadgroup))


@dataclass(frozen=True)
class Plan:
    """A pass as dispatches and buffers; ``tensor_ops`` the tensor-op route and why
    (fa_plan_tensor_ops: "tensor ops: ..." or "simdgroup kernels: ...")."""

    pass_name: str
    piece_count: int
    buffers: tuple[Buffer, ...]
    dispatches: tuple[Dispatch, ...]
    tensor_ops: str = ""

    def buffer(self, role: str) -> Buffer:
        """The buffer of ``role``; KeyError when the plan does not use it."""
        for buffer in self.buffers:
            if buffer.role == role:
                return buffer
        raise KeyError(f"the {self.pass_name} plan has no {role} buffer")


def _names(lib, prefix: str) -> dict[int, str]:
    # cffi exposes the header's enumerators as ints on lib.
    return {getattr(lib, name): name for name in dir(lib) if name.startswith(prefix)}


def _role_names(lib) -> dict[int, str]:
    prefix = "FA_BUFFER_ROLE_"
    return {code: name[len(prefix):].lower() for code, name in _names(lib, prefix).items()
            if name != "FA_BUFFER_ROLE_COUNT"}


def _record(library: NativeLibrary, struct: str, getter, *indices):
    """One record through its fa_plan_get_* function, struct_size set (raises on failure)."""
    record = library.ffi.new(f"{struct} *")
    record.struct_size = library.ffi.sizeof(struct)
    library.raise_for_status(getter(*indices, record))
    return record


def read(handle, library: NativeLibrary | None = None) -> Plan:
    """The ``Plan`` of an ``fa_plan *`` (which stays the caller's)."""
    library = library or native()
    ffi, lib = library.ffi, library.lib
    roles = _role_names(lib)
    usages = {getattr(lib, name): usage for name, usage in _USAGE_NAMES.items()}
    types = {getattr(lib, name): type_name for name, type_name in _TYPE_NAMES.items()}
    info = _record(library, "fa_plan_info", lib.fa_plan_get_info, handle)
    passes = {code: name[len("FA_PASS_"):].lower() for code, name in _names(lib, "FA_PASS_").items()}
    buffers = []
    for i in range(info.buffer_count):
        b = _record(library, "fa_plan_buffer", lib.fa_plan_get_buffer, handle, i)
        buffers.append(Buffer(roles[b.role], usages[b.usage], b.element_size, b.byte_count))
    dispatches = []
    for n in range(info.dispatch_count):
        d = _record(library, "fa_plan_dispatch", lib.fa_plan_get_dispatch, handle, n)
        bindings = tuple(
            Binding(b.index, roles[b.role], b.byte_offset, b.byte_length)
            for b in (_record(library, "fa_plan_binding", lib.fa_plan_get_binding, handle, n, i)
                      for i in range(d.binding_count)))
        constants = tuple(
            Specialization(ffi.string(s.name).decode(), s.index, types[s.type], s.value)
            for s in (_record(library, "fa_plan_specialization", lib.fa_plan_get_specialization, handle, n, i)
                      for i in range(d.specialization_count)))
        dispatches.append(Dispatch(
            ffi.string(d.kernel_name).decode(), d.piece, tuple(d.threadgroups_per_grid),
            tuple(d.threads_per_threadgroup), bindings, constants, d.params_index,
            ffi.buffer(d.params, d.params_size)[:], ffi.string(d.constants_prelude).decode(),
            bool(d.params_from_buffer)))
    route = lib.fa_plan_tensor_ops(handle)
    # "pass" is a Python keyword, hence getattr.
    return Plan(passes[getattr(info, "pass")], info.piece_count, tuple(buffers), tuple(dispatches),
                ffi.string(route).decode())


_TENSOR_LIBRARIES = {"none": "FA_TENSOR_LIBRARY_NONE", "ready": "FA_TENSOR_LIBRARY_READY",
                     "failed": "FA_TENSOR_LIBRARY_FAILED"}


@dataclass(frozen=True)
class Target:
    """What the host encoding a plan offers (fa_plan_target): ``tensor_library`` "none" (not
    compiled), "ready" (``tensor_kernel_source()`` compiled) or "failed" (``error``: the
    compiler's message); ``architecture`` the GPU's MTLDevice.architecture.name, None for the
    library's Metal device (the GPU PyTorch's MPS device is on an Apple-silicon Mac)."""

    tensor_library: str = "none"
    error: str | None = None
    architecture: str | None = None


def create(problem, pass_name: str, max_flops_per_piece: int = 0, library: NativeLibrary | None = None,
           target: Target | None = None) -> Plan:
    """The plan of ``pass_name`` ("forward" or "backward") for ``problem``, a cffi ``fa_problem *``
    whose pointer fields only mark which optional inputs exist (fa_plan_create; cu_seqlens_q and
    cu_seqlens_k make a variable-length plan, kv_block_table a paged KV cache's); pieces of at most
    ``max_flops_per_piece`` operations (0: one piece); for a host offering ``target`` (None: no
    tensor-op library; fa_plan_create_for).

    Raises FlashAttentionError with the library's message for a problem it refuses (or a
    FLASH_ATTENTION_TENSOR_OPS value it does not know), ValueError for an unknown pass name or
    tensor library."""
    if pass_name not in _PASS_NAMES:
        raise ValueError(f"pass_name must be one of {', '.join(map(repr, _PASS_NAMES))}, got {pass_name!r}")
    if target is not None and target.tensor_library not in _TENSOR_LIBRARIES:
        raise ValueError(f"target.tensor_library must be one of {', '.join(map(repr, _TENSOR_LIBRARIES))}, "
                         f"got {target.tensor_library!r}")
    library = library or native()
    ffi, lib = library.ffi, library.lib
    holder = ffi.new("fa_plan **")
    c_target, keep = ffi.NULL, []
    if target is not None:
        c_target = ffi.new("fa_plan_target *")
        c_target.struct_size = ffi.sizeof("fa_plan_target")
        c_target.tensor_library = getattr(lib, _TENSOR_LIBRARIES[target.tensor_library])
        for field in ("architecture", "error"):
            text = getattr(target, field)
            if text is not None:
                keep.append(ffi.new("char[]", text.encode("utf-8", "replace")))
                setattr(c_target, "tensor_library_error" if field == "error" else field, keep[-1])
    library.raise_for_status(lib.fa_plan_create_for(problem, getattr(lib, _PASS_NAMES[pass_name]),
                                                    max_flops_per_piece, c_target, holder))
    try:
        return read(holder[0], library)
    finally:
        lib.fa_plan_destroy(holder[0])


GPU_CORES_SOURCES = {"FA_GPU_CORES_NOMINAL": "nominal", "FA_GPU_CORES_DEVICE": "device",
                     "FA_GPU_CORES_OVERRIDE": "FLASH_ATTENTION_GPU_CORES"}


def gpu_cores(context_handle=None, library: NativeLibrary | None = None) -> tuple[int, str]:
    """The GPU core count the split-KV chunks are planned for now (fa_gpu_cores): for calls on the
    ``fa_context *`` ``context_handle``, or for ``create``'s plans when it is None (the Metal device
    the library runs on); and where it comes from: "FLASH_ATTENTION_GPU_CORES" (the environment
    variable), "device" (the Metal device's count) or "nominal" (the CPU engine's nominal GPU).

    Raises FlashAttentionError when FLASH_ATTENTION_GPU_CORES is set to anything but a whole number
    from 1 to 4096."""
    library = library or native()
    ffi, lib = library.ffi, library.lib
    cores, source = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    handle = ffi.NULL if context_handle is None else context_handle
    library.raise_for_status(lib.fa_gpu_cores(handle, cores, source))
    names = {int(getattr(lib, name)): text for name, text in GPU_CORES_SOURCES.items()}
    return int(cores[0]), names[int(source[0])]


def kernel_source(library: NativeLibrary | None = None) -> str:
    """The self-contained MSL source of every kernel a plan names (fa_plan_kernel_source)."""
    library = library or native()
    return library.ffi.string(library.lib.fa_plan_kernel_source()).decode("utf-8")


def tensor_kernel_source(library: NativeLibrary | None = None) -> str:
    """The self-contained MSL source of the tensor-op kernels (fa_plan_tensor_kernel_source): a
    library of its own, compiled at MSL 4.0 or later (MetalPerformancePrimitives)."""
    library = library or native()
    return library.ffi.string(library.lib.fa_plan_tensor_kernel_source()).decode("utf-8")


def tensor_ops_wanted(architecture: str | None = None, library: NativeLibrary | None = None) -> bool:
    """Whether a host encoding on a GPU of ``architecture`` (None: the library's Metal device)
    should compile ``tensor_kernel_source()`` (fa_tensor_ops_wanted): the GPU has matrix units or
    FLASH_ATTENTION_TENSOR_OPS is 1 (on macOS/iOS 26.2 or later), and it is not 0. Read again at
    every call."""
    library = library or native()
    ffi = library.ffi
    wanted = ffi.new("uint32_t *")
    name = ffi.NULL if architecture is None else ffi.new("char[]", architecture.encode())
    library.raise_for_status(library.lib.fa_tensor_ops_wanted(name, wanted))
    return bool(wanted[0])


def specialized_source(dispatch: Dispatch, library: NativeLibrary | None = None) -> str:
    """What a host without function constants compiles for ``dispatch``: its constants prelude,
    then ``kernel_source()``, or ``tensor_kernel_source()`` for a tensor-op kernel
    (``Dispatch.tensor_library``). Dispatches with one prelude and library share the compiled one."""
    source = tensor_kernel_source(library) if dispatch.tensor_library else kernel_source(library)
    return dispatch.constants_prelude + source


def metallib_path(library: NativeLibrary | None = None) -> str | None:
    """The precompiled kernels next to the library (fa_plan_metallib_path), or None."""
    library = library or native()
    path = library.lib.fa_plan_metallib_path()
    return None if path == library.ffi.NULL else library.ffi.string(path).decode()


def features_off_prelude(library: NativeLibrary | None = None) -> str:
    """The constants prelude of a dispatch with every feature compiled off (no mask, softcap, ALiBi
    or sinks): every function constant false or 0, as the plan of such a problem records it. The
    specialisation a precompiled library for hosts without function constants holds
    (``features_off_metallib_path``)."""
    from ._abi import new_problem
    from ._validation import Shape

    library = library or native()
    problem = new_problem(library.ffi, library.lib, Shape(1, 1, 1, 1, 1, 8), False, 1.0, "float16", {})
    return create(problem, "forward", 0, library).dispatches[0].constants_prelude


def features_off_metallib_path(library: NativeLibrary | None = None) -> str | None:
    """``flash_attention-<source hash>-features-off.metallib`` next to the precompiled kernels
    (``metallib_path``): ``features_off_prelude()`` and ``kernel_source()`` compiled as MSL 3.1 by
    build.sh on a Mac, for ``torch.mps.load_metallib``, which takes no function constants; None
    when there is none."""
    import os

    path = metallib_path(library)
    if path is None:
        return None
    folder, name = os.path.split(path)
    candidate = os.path.join(folder, name.split("-msl")[0] + "-features-off.metallib")
    return candidate if os.path.exists(candidate) else None


__all__ = ["Binding", "Buffer", "Dispatch", "Plan", "Specialization", "Target", "create", "features_off_metallib_path",
           "features_off_prelude", "gpu_cores", "kernel_source", "metallib_path", "read", "specialized_source",
           "tensor_kernel_source", "tensor_ops_wanted"]
