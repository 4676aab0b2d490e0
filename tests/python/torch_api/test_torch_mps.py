"""The MPS path's translation of the exported plan into ``torch.mps.compile_shader`` calls, run here
without a GPU: ``torch._C._mps_compileShader`` (what ``torch.mps.compile_shader`` calls after
embedding headers) is replaced by a stand-in whose kernels run each dispatch on the CPU engine by
kernel name, and check every argument against compile_shader's contract as PyTorch's
``torch/csrc/mps/Module.cpp`` (``_mps_MetalKernel.__call__``, ``OptionalArgCaster``,
``optional_vec_from_pyobject``) and ``aten/src/ATen/native/mps/OperationUtils.mm``
(``MetalKernelFunction``, ``compileLibrary``, ``mtl_setBuffer``) define it:

- the source is ASCII (Metal gets it through NSASCIIStringEncoding) and is a dispatch's constants
  prelude (the function constants' values, which the stand-in hands the engine as the dispatch's
  constants: compile_shader has none) followed by ``fa_plan_kernel_source()`` or, a library of its
  own, the tensor-op source ``fa_plan_tensor_kernel_source()``, left unchanged by compile_shader's
  embedding of PyTorch's headers; a library holds only its own source's kernels; compileLibrary's
  MSL version (4.0 on macOS 26 on PyTorch main, 3.2 on macOS 15) decides whether the tensor-op
  source, which includes MetalPerformancePrimitives, compiles: below 4.0 it raises SyntaxError
  (``c10::SyntaxError`` for MTLLibraryErrorCompileFailure);
- argument i is ``[[buffer(i)]]``; a tensor binds its storage's buffer at ``storage_offset() *
  element_size()`` bytes (never through ``data_ptr()``); any other argument is setBytes: a Python
  int as int64, a float as float32, a non-empty list of either as a vector of that type (every
  element of the first one's type, ints within int64), through ``arg_casts`` when given, below
  4 KB (setBytes' limit); None and other types are refused;
- ``threads`` and ``group_size`` are each an int or 1 to 3 ints of one length; ``threads`` is the
  grid in threads (dispatchThreads; by default the first tensor's numel), ``group_size`` the
  threadgroup (by default the pipeline's maximum), its product at most the pipeline's
  max_threads_per_threadgroup; the kernels need whole threadgroups.
The results must be bit for bit those of the CPU path (the same kernels on the same engine, through
fa_forward and fa_backward), for plans in one piece and in many (bindings at offsets), with
``Tensor.data_ptr`` refused on the MPS path.

Cost: about 5 s of ./build.sh test's pytest (measured on 2 shared cores; importing PyTorch is not counted).
"""

from __future__ import annotations

import math
import re
import struct

import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)

from flash_attention_metal import _native, plan  # noqa: E402
from flash_attention_metal.errors import ArgumentError  # noqa: E402
from flash_attention_metal.torch import _host, _mps  # noqa: E402

_ENGINE_CDEF = """
typedef struct { void *contents; size_t length; } msl_engine_buffer;
typedef struct { uint32_t width; uint32_t height; uint32_t depth; } msl_engine_size;
typedef struct { uint32_t buffer_count; size_t threadgroup_memory_length; const char *file; unsigned line; }
    msl_engine_kernel_info;
typedef struct { uint32_t index; uint32_t type; uint32_t value; } msl_engine_function_constant;
int msl_engine_dispatch_specialized(const char *kernel_name, const msl_engine_buffer *buffers, uint32_t buffer_count,
                                    const msl_engine_function_constant *constants, uint32_t constant_count,
                                    msl_engine_size threadgroups_per_grid, msl_engine_size threads_per_threadgroup,
                                    const void *cancellation, uint64_t start_epoch, char *message,
                                    size_t message_capacity);
int msl_engine_describe_kernel(const char *kernel_name, msl_engine_kernel_info *info);
"""


class StandInCompiler:
    """Stands in for torch._C._mps_compileShader: records the libraries it compiles and the
    dispatches their kernels run (name, threadgroups per grid) on the CPU engine."""

    def __init__(self, max_threads_per_threadgroup: int = 1024):
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(_ENGINE_CDEF)
        # The engine's C entry points are exported by libFlashAttentionMetal (Sources/MSLEngine/include).
        self.engine = self.ffi.dlopen(str(_native.native().path))
        self.max_threads = max_threads_per_threadgroup
        #: compileLibrary's MSL version (MTLCompileOptions.languageVersion), as (major, minor).
        self.language_version = (4, 0)
        #: Sources refused (compile failures raised).
        self.refused = []
        self.sources = []
        self.dispatches = []
        # len(dispatches) at each commit: torch.mps.Event().record() through the stand-in events.
        self.commits = []
        self._events = 0

    def acquire_event(self, enable_timing: bool) -> int:
        """torch._C._mps_acquireEvent: an event id above 0."""
        assert enable_timing is False
        self._events += 1
        return self._events

    def record_event(self, event_id: int) -> None:
        """torch._C._mps_recordEvent, which commits the MPS stream's command buffer (MPSEvent.mm)."""
        assert 0 < event_id <= self._events
        self.commits.append(len(self.dispatches))

    def __call__(self, source: str):
        library = StandInLibrary(self, source)
        if library.tensor and self.language_version < (4, 0):
            self.refused.append(source)
            raise SyntaxError("program_source:7:10: fatal error: 'MetalPerformancePrimitives/"
                              "MetalPerformancePrimitives.h' file not found")
        self.sources.append(source)
        return library


_CONSTANT = re.compile(r"^constant (bool|uint) (\w+) = (true|false|\d+);$")


class StandInLibrary:
    """The source must be a constants prelude (the define, then one line per function constant in
    index order) and the kernel source; the prelude's values become the engine's function constants,
    as Metal would compile them in."""

    def __init__(self, compiler: StandInCompiler, source: str):
        # DynamicMetalShaderLibrary hands Metal the text as an NSString made with NSASCIIStringEncoding.
        assert source.isascii(), "compile_shader's source must be ASCII"
        lines = source.split("\n")
        assert lines[0] == "#define FA_FUNCTION_CONSTANTS_PREDEFINED 1", "no constants prelude"
        count = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith("constant "))
        self.constants = []
        for index, line in enumerate(lines[1:count]):
            kind, _name, value = _CONSTANT.match(line).groups()
            bits = {"true": 1, "false": 0}[value] if kind == "bool" else int(value)
            self.constants.append((index, 0 if kind == "bool" else 1, bits))
        # compile_shader's header embedding ends the text with one more newline; nothing else changes.
        text = "\n".join(lines[count:]).rstrip("\n")
        sources = {plan.kernel_source().rstrip("\n"): False, plan.tensor_kernel_source().rstrip("\n"): True}
        assert text in sources, "compile_shader got other text than the kernel source or the tensor-op source"
        #: Whether this is the tensor-op library, which holds the kernels named "_tensor_" and no other.
        self.tensor = sources[text]
        self.compiler = compiler

    def __getattr__(self, name: str):
        # MTLLibrary.newFunctionWithName gives nil for a kernel of the other library.
        assert ("_tensor_" in name) == self.tensor, f"no kernel {name} in this library"
        info = self.compiler.ffi.new("msl_engine_kernel_info *")
        assert self.compiler.engine.msl_engine_describe_kernel(name.encode(), info), f"no kernel {name}"
        return StandInKernel(self, name, info)


# arg_casts as Module.cpp's OptionalArgCaster applies them: struct formats of the cast types
# (bf16 is not modelled: the translation never casts).
_CASTS = {"": None, "fp16": "e", "int32": "i", "int16": "h", "int8": "b", "uint8": "B"}


def _sizes(value, name: str):
    """Module.cpp's optional_vec_from_pyobject: None, an int, or a list of 1 to 3 ints (uint64)."""
    if value is None:
        return None
    if type(value) is int:
        return [value]
    assert isinstance(value, (list, tuple)) and all(type(x) is int and 0 <= x < 2**64 for x in value), \
        f"{name}={value!r} is neither an int nor a list of non-negative ints"
    assert 0 < len(value) < 4, f"{name} has {len(value)} dimensions: 1 to 3"
    return list(value)


def _set_bytes(argument, cast: str) -> bytes:
    """The bytes ``setBytes`` gets for a non-tensor argument (Module.cpp's OptionalArgCaster: a
    Python int is an int64, a float a float32, a list of either a vector of that type; anything
    else, None included, is refused), through ``cast`` when arg_casts names one."""
    assert cast in _CASTS, f"unsupported cast {cast!r}"
    if isinstance(argument, (list, tuple)):
        assert argument, "an empty list can not be an argument to a metal kernel"
        kind = int if type(argument[0]) is int else float if type(argument[0]) is float else None
        assert kind is not None, f"a list of {type(argument[0]).__name__} is not a kernel argument"
        values = list(argument)
    else:
        kind = int if type(argument) is int else float if type(argument) is float else None
        assert kind is not None, f"a {type(argument).__name__} is not a kernel argument"
        values = [argument]
    # pybind11 casts every element to the first one's type: a float among ints fails, an int out
    # of int64's range fails.
    assert all(type(x) is kind for x in values), f"mixed element types in {argument!r}"
    if kind is int:
        assert all(-2**63 <= x < 2**63 for x in values), f"{argument!r} does not fit int64"
    code = _CASTS[cast] or ("q" if kind is int else "f")
    return struct.pack(f"<{len(values)}{code}", *values)


class StandInKernel:
    """A kernel of the stand-in library, called as Module.cpp's ``_mps_MetalKernel.__call__``:
    positional arguments bound at their position, keyword-only ``threads``, ``group_size``,
    ``arg_casts`` and ``error_buf_idx``; ``dispatchThreads(threads, group_size)``, which the stand-in
    runs as whole threadgroups on the CPU engine (the kernels are written for whole threadgroups:
    the plan's grid is)."""

    def __init__(self, library: StandInLibrary, name: str, info):
        self.library, self.name, self.info = library, name, info
        self.max_threads_per_threadgroup = library.compiler.max_threads
        self.static_thread_group_memory_length = info.threadgroup_memory_length

    def _bind(self, ffi, index, argument, casts, keep):
        """(address, length) of what Metal binds at ``[[buffer(index)]]`` for ``argument``."""
        if isinstance(argument, torch.Tensor):
            # The stand-in's tensors are on the CPU but stand for MPS tensors: Metal binds the
            # storage's buffer at storage_offset() * element_size() bytes (mtl_setBuffer), to its end.
            # A 0-D CPU tensor would be setBytes, any other CPU tensor "Passed CPU tensor to MPS op".
            assert argument.dim() >= 1, f"{self.name}: argument {index} is a 0-D tensor"
            storage = argument.untyped_storage()
            offset = argument.storage_offset() * argument.element_size()
            return storage.data_ptr() + offset, storage.nbytes() - offset
        cast = casts.get(index, casts.get(None, "")) if casts else ""
        data = _set_bytes(argument, cast)
        # MetalKernelFunction::setArg hands them to setBytes(_:length:index:), which "only works
        # for data smaller than 4 kilobytes" (Apple's documentation of the method).
        assert len(data) < 4096, f"{self.name}: setBytes of {len(data)} bytes at {index}: only below 4 KB"
        buffer = ffi.new("char[]", data)
        keep.append(buffer)
        return ffi.cast("uintptr_t", buffer), len(data)

    def __call__(self, *arguments, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
        assert error_buf_idx is None, "the translation binds no error buffer"
        casts = {None: arg_casts} if isinstance(arg_casts, str) else dict(arg_casts or {})
        threads, group_size = _sizes(threads, "threads"), _sizes(group_size, "group_size")
        compiler = self.library.compiler
        ffi, keep = compiler.ffi, []
        buffers = ffi.new("msl_engine_buffer[]", max(len(arguments), 1))
        for i, argument in enumerate(arguments):
            if threads is None and isinstance(argument, torch.Tensor):
                threads = [argument.numel()]  # compile_shader's default grid: the first tensor's numel
            address, length = self._bind(ffi, i, argument, casts, keep)
            buffers[i].contents, buffers[i].length = ffi.cast("void *", address), length
        assert threads is not None, "the number of threads is undefined"
        assert group_size is None or len(group_size) == len(threads), "size and group_size dimensions differ"
        axes = len(threads)
        if group_size is None:  # MetalKernelFunction::dispatch's defaults
            group_size = [min(threads[0], self.max_threads_per_threadgroup)] if axes == 1 else \
                [self.max_threads_per_threadgroup] + [1] * (axes - 1)
        assert math.prod(group_size) <= self.max_threads_per_threadgroup, \
            f"Threadgroup size exceeds {self.max_threads_per_threadgroup} limit"
        threads, group_size = threads + [1] * (3 - axes), group_size + [1] * (3 - axes)
        assert all(g > 0 and t % g == 0 for t, g in zip(threads, group_size)), \
            f"{self.name}: threads {threads} are not whole threadgroups of {group_size}"
        assert len(arguments) >= self.info.buffer_count, "a buffer the kernel reads is unbound"
        constants = ffi.new("msl_engine_function_constant[]", self.library.constants)
        groups = [t // g for t, g in zip(threads, group_size)]
        message = ffi.new("char[1024]")
        status = compiler.engine.msl_engine_dispatch_specialized(
            self.name.encode(), buffers, len(arguments), constants, len(self.library.constants), groups, group_size,
            ffi.NULL, 0, message, 1024)
        assert status == 0, ffi.string(message).decode()
        compiler.dispatches.append((self.name, tuple(groups)))


@pytest.fixture()
def compiler(monkeypatch):
    stand_in = StandInCompiler()
    monkeypatch.setattr(torch._C, "_mps_compileShader", stand_in, raising=False)
    monkeypatch.setattr(torch._C, "_mps_acquireEvent", stand_in.acquire_event, raising=False)
    monkeypatch.setattr(torch._C, "_mps_recordEvent", stand_in.record_event, raising=False)
    monkeypatch.setattr(torch._C, "_mps_releaseEvent", lambda _event_id: None, raising=False)
    monkeypatch.setattr(_mps, "_libraries", {})
    monkeypatch.setattr(_mps, "_plans", type(_mps._plans)())
    return stand_in


def _case(dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, mask=False, alibi=False, bshd=False):
    g = torch.Generator().manual_seed(seqlen_q * 7 + seqlen_k)
    def normal(shape):
        if bshd:
            b, h, s, d = shape
            return torch.randn((b, s, h, d), generator=g).to(dtype).transpose(1, 2)
        return torch.randn(shape, generator=g).to(dtype)
    q = normal((batch, heads, seqlen_q, head_dim))
    k, v = normal((batch, kv_heads, seqlen_k, head_dim)), normal((batch, kv_heads, seqlen_k, head_dim))
    attn_mask = (torch.rand(seqlen_q, seqlen_k, generator=g) < 0.8).expand(batch, heads, seqlen_q, seqlen_k) \
        if mask else None
    slopes = torch.rand(batch, heads, generator=g) if alibi else None
    return q, k, v, attn_mask, slopes


CASES = {
    "float16, causal GQA": ((torch.float16, 2, 4, 2, 37, 45, 64), dict(causal=True)),
    "bfloat16, mask, ALiBi, window, softcap, bshd": ((torch.bfloat16, 2, 4, 1, 29, 33, 32),
                                                     dict(mask=True, alibi=True, window=(6, 3), softcap=8.0)),
    "float32, decode (split-KV workspaces)": ((torch.float32, 1, 8, 2, 2, 700, 128), dict(causal=True)),
}


def _run(module, sizes, options, dout_seed=9):
    mask, alibi = options.get("mask", False), options.get("alibi", False)
    q, k, v, attn_mask, slopes = _case(*sizes, mask=mask, alibi=alibi, bshd=bool(options.get("window")))
    settings = (0.2, options.get("causal", False), options.get("window"), options.get("softcap", 0.0), False)
    out, lse = module.forward(q, k, v, attn_mask, slopes, *settings)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed)).to(out.dtype)
    grads = module.backward(dout, q, k, v, out, lse, attn_mask, slopes, *settings)
    return (out, lse, *grads)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_translation_gives_the_cpu_paths_bits(compiler, monkeypatch, case):
    sizes, options = CASES[case]
    expected = _run(_host, sizes, options)

    def refuse(_tensor):
        raise AssertionError("the MPS path took a tensor's data_ptr()")

    monkeypatch.setattr(torch.Tensor, "data_ptr", refuse)
    got = _run(_mps, sizes, options)
    for name, mine, theirs in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert torch.equal(mine, theirs), name
    # One library per constants prelude of the two plans, each compiled once (a second call
    # compiles nothing); every dispatch ran.
    preludes = {d.constants_prelude for made in _mps._plans.values() for d in made.dispatches}
    assert len(compiler.sources) == len(set(compiler.sources)) == len(preludes)
    compiled = len(compiler.sources)
    assert all(torch.equal(a, b) for a, b in zip(_run(_mps, sizes, options), got))
    assert len(compiler.sources) == compiled
    names = [name for name, _ in compiler.dispatches]
    assert names[0].startswith("flash_attention_forward_") and names[-1].startswith("flash_attention_backward_dkv_")
    if "decode" in case:
        assert names[:2] == ["flash_attention_forward_decode_f32_d128", "flash_attention_forward_combine_f32"]


@pytest.mark.parametrize("sizes, rule", [
    ((torch.float16, 1, 1, 1, 2, 3, 577), r"head_dim \(577\) must be at most fa_max_head_dim\(\) \(576\)"),
    ((torch.float16, 1, 3, 2, 2, 3, 8), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    ((torch.float32, 1, 1, 1, 2, 3, 264), r"with dtype float32 must be at most 256"),
], ids=["head_dim", "heads", "float32 head_dim"])
def test_the_librarys_refusals_come_before_any_dispatch(compiler, sizes, rule):
    """The rules Python leaves to the library reach the MPS path's caller from fa_plan_create, as
    a ValueError naming the argument, before anything is compiled or dispatched."""
    q, k, v, _, _ = _case(*sizes)
    with pytest.raises(ArgumentError, match=rule):
        _mps.forward(q, k, v, None, None, 0.5, False, None, 0.0, False)
    assert compiler.sources == [] and compiler.dispatches == []


def test_pieces_bind_at_offsets(compiler, monkeypatch):
    """A plan cut into pieces: each piece's dispatches bind the buffers at the piece's offsets
    (views of the tensors further into their storage), still give the whole plan's bits, and each
    piece ends its command buffer (an event recorded after it, none after the pass's last piece:
    PyTorch commits that one when it decides)."""
    sizes, options = CASES["float16, causal GQA"]
    expected = _run(_mps, sizes, options)
    whole = len(compiler.dispatches)
    assert compiler.commits == [], "the default budget holds these passes in one piece each"
    monkeypatch.setattr(_mps, "MAX_FLOPS_PER_PIECE", 1)
    got = _run(_mps, sizes, options)
    assert len(compiler.dispatches) - whole > 2 * whole  # 4 pieces (2 batch entries x 2 KV heads) per pass
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)
    plans = [made for (pass_name, budget, *_), made in _mps._plans.items() if budget == 1]
    assert [made.pass_name for made in plans] == ["forward", "backward"]
    boundaries, start = [], whole
    for made in plans:
        pieces = [d.piece for d in made.dispatches]
        boundaries += [start + n for n in range(1, len(pieces)) if pieces[n] != pieces[n - 1]]
        start += len(pieces)
    assert len(boundaries) == sum(made.piece_count - 1 for made in plans) > 0
    assert compiler.commits == boundaries



def test_a_pipeline_with_fewer_threads_is_refused(compiler):
    compiler.max_threads = 64
    sizes, options = CASES["float16, causal GQA"]
    with pytest.raises(RuntimeError, match=r"needs 128 threads per threadgroup; its pipeline allows 64"):
        _run(_mps, sizes, options)


def test_fast_math_is_refused(compiler, monkeypatch):
    monkeypatch.setenv("PYTORCH_MPS_FAST_MATH", "1")
    sizes, options = CASES["float16, causal GQA"]
    with pytest.raises(RuntimeError, match="PYTORCH_MPS_FAST_MATH is set"):
        _run(_mps, sizes, options)
    assert compiler.sources == []


def test_fast_math_is_read_once_as_pytorch_reads_it(compiler, monkeypatch):
    """PyTorch reads PYTORCH_MPS_FAST_MATH once per process (on main: set and not "0"; std::stoi of
    it != 0 before): so does the MPS path, at its first compile from source; a change later in the
    process changes nothing. Refused: any value either rule turns on."""
    sizes, options = CASES["float16, causal GQA"]
    monkeypatch.setenv("PYTORCH_MPS_FAST_MATH", "0")
    _run(_mps, sizes, options)
    monkeypatch.setenv("PYTORCH_MPS_FAST_MATH", "1")
    compiled = len(compiler.sources)
    _run(_mps, *CASES["bfloat16, mask, ALiBi, window, softcap, bshd"])  # other preludes: compiled
    assert len(compiler.sources) > compiled
    assert [_mps._fast_math_on(v) for v in (None, "0", " -0", "00", "1", " 2x", "-1", "yes")] == \
        [False, False, True, True, True, True, True, True]


def test_a_pass_in_pieces_is_refused_off_the_default_stream(compiler, monkeypatch):
    """The commit between pieces reaches the default stream only (torch.mps.Event): a pass of
    several pieces while another stream is current is refused, naming the stream and the way
    around; one piece needs no commit and runs."""
    sizes, options = CASES["float16, causal GQA"]
    monkeypatch.setattr(_mps, "_current_stream_id", lambda _device: 3)
    _run(_mps, sizes, options)
    monkeypatch.setattr(_mps, "MAX_FLOPS_PER_PIECE", 1)
    with pytest.raises(RuntimeError, match=r"needs \d+ command buffers .* current MPS stream is 3, not the default"):
        _run(_mps, sizes, options)


def test_features_reach_the_engine_as_function_constants(compiler):
    """The bfloat16 case's mask, ALiBi and softcap: the kernels read them as function constants,
    here from the prelude of the source compile_shader got (a kernel that read one the prelude did
    not set would fail its dispatch on the engine)."""
    sizes, options = CASES["bfloat16, mask, ALiBi, window, softcap, bshd"]
    _run(_mps, sizes, options)
    forward = next(source for source in compiler.sources if "fa_has_softcap = true" in source)
    assert "constant uint fa_mask_type = 1;" in forward and "constant bool fa_has_alibi = true;" in forward


def _forward_kernel(compiler):
    """The forward kernel of a small float16 problem, compiled by the stand-in, with arguments
    that satisfy the contract (tensors at their binding indices, the parameter words)."""
    sizes, options = CASES["float16, causal GQA"]
    q, k, v, _, _ = _case(*sizes)
    _, _, call = _mps.forward_call(_native.native(), q, k, v, None, None, 0.2, True, None, 0.0, False, _mps._present)
    dispatch, = _mps._plan_for(call.problem, "forward", _mps._target()).dispatches
    arguments = [None] * (len(dispatch.bindings) + 1)
    for binding in dispatch.bindings:
        arguments[binding.index] = call.tensors[binding.role]
    arguments[dispatch.params_index] = _mps._words(dispatch.params)
    kernel = getattr(torch.mps.compile_shader(plan.specialized_source(dispatch)), dispatch.kernel_name)
    return kernel, arguments, dispatch


@pytest.mark.parametrize("break_it, complaint", [
    (lambda a, d: dict(arguments=a[:-1]), "a buffer the kernel reads is unbound"),
    (lambda a, d: dict(arguments=[None if x is a[d.params_index] else x for x in a]), "a NoneType"),
    (lambda a, d: dict(arguments=[x + [0.5] if isinstance(x, list) else x for x in a]), "mixed element types"),
    (lambda a, d: dict(arguments=[[2**63] + x[1:] if isinstance(x, list) else x for x in a]),
     "does not fit int64"),
    (lambda a, d: dict(arguments=[[] if isinstance(x, list) else x for x in a]), "an empty list"),
    (lambda a, d: dict(arguments=[x + [0] * (512 - len(x)) if isinstance(x, list) else x for x in a]),
     "only below 4 KB"),
    (lambda a, d: dict(threads=[t + 1 for t in d.threads_per_grid]), "not whole threadgroups"),
    (lambda a, d: dict(threads=list(d.threads_per_grid)[:2]), "dimensions differ"),
    (lambda a, d: dict(group_size=[2048, 1, 1]), "Threadgroup size exceeds 1024"),
    (lambda a, d: dict(threads=[1, 1, 1, 1], group_size=[1, 1, 1, 1]), "1 to 3"),
])
def test_the_stand_in_refuses_what_compile_shader_refuses(compiler, break_it, complaint):
    """The stand-in is only as good as its checks: each way of breaking compile_shader's contract
    (or the kernels' whole threadgroups) fails, and the unbroken call runs."""
    kernel, arguments, dispatch = _forward_kernel(compiler)
    call = dict(arguments=arguments, threads=list(dispatch.threads_per_grid),
                group_size=list(dispatch.threads_per_threadgroup))
    kernel(*call["arguments"], threads=call["threads"], group_size=call["group_size"])
    call.update(break_it(arguments, dispatch))
    with pytest.raises(AssertionError, match=complaint):
        kernel(*call["arguments"], threads=call["threads"], group_size=call["group_size"])


def test_the_stand_in_refuses_a_non_ascii_source(compiler):
    with pytest.raises(AssertionError, match="ASCII"):
        torch.mps.compile_shader("// \u00e9\n" + plan.kernel_source())


def test_a_view_off_a_16_byte_boundary_gives_the_cpu_paths_bits(compiler):
    """q, k and v whose data start 2 bytes past a 16-byte boundary, with aligned strides: the plan's
    parameters take the 16-byte tile copies, so the MPS path binds aligned copies of them."""
    def shifted(t):
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
        flat[1:] = t.reshape(-1)
        return flat[1:].view(t.shape)

    q, k, v, _, _ = _case(torch.float16, 1, 2, 2, 20, 30, 64)
    q, k, v = shifted(q), shifted(k), shifted(v)
    assert q.storage_offset() * q.element_size() % 16 == 2
    settings = (0.2, True, None, 0.0, False)
    expected = _host.forward(q, k, v, None, None, *settings)
    got = _mps.forward(q, k, v, None, None, *settings)
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)


def test_features_off_is_loaded_precompiled(compiler, monkeypatch, tmp_path):
    """With build.sh's features-off .metallib and torch.mps.load_metallib, a pass without features
    compiles nothing (one load per process), and a pass with features compiles only its own
    prelude; the results are the source path's bits. Compiles per process for the two passes
    (forward + backward) of each case: 1 from source without the .metallib, 0 with it for the
    featureless case; 1 for the case with a mask, ALiBi, a window and softcap either way."""
    metallib = tmp_path / "flash_attention-0-features-off.metallib"
    metallib.write_bytes(b"stand-in")
    loads = []

    def load(path):
        loads.append(path)
        return StandInLibrary(compiler, plan.features_off_prelude() + plan.kernel_source())

    plain, featured = CASES["float16, causal GQA"], CASES["bfloat16, mask, ALiBi, window, softcap, bshd"]
    expected = [_run(_mps, *plain), _run(_mps, *featured)]
    assert len(compiler.sources) == 2 and compiler.sources[0].startswith(plan.features_off_prelude())
    monkeypatch.setattr(_mps, "_libraries", {})
    monkeypatch.setattr(plan, "features_off_metallib_path", lambda library=None: str(metallib))
    monkeypatch.setattr(torch._C, "_mps_loadMetallibFromPath", load, raising=False)
    compiled = len(compiler.sources)
    got = [_run(_mps, *plain), _run(_mps, *plain)]
    assert loads == [str(metallib)] and len(compiler.sources) == compiled
    got.append(_run(_mps, *featured))
    assert len(compiler.sources) == compiled + 1 and not compiler.sources[-1].startswith(plan.features_off_prelude())
    for mine, theirs in zip(got[0] + got[1] + got[2], expected[0] + expected[0] + expected[1]):
        assert torch.equal(mine, theirs)


# The tensor-op kernels (docs/tensor-ops.md): float16 at head_dim 64 with GQA, causal; more than 64
# query rows, so that the dense forward serves them (split-KV keeps its kernels).
TENSOR_SIZES = (torch.float16, 1, 2, 1, 66, 40, 64)
TENSOR_SETTINGS = (0.2, True, None, 0.0, False)


def _is_tensor_source(source: str) -> bool:
    """Whether compile_shader got the tensor-op source (after a prelude; PyTorch adds a newline)."""
    return source.rstrip("\n").endswith(plan.tensor_kernel_source().rstrip("\n"))


def _tensor_run():
    """(q, k, v, dout) and (out, lse, dq, dk, dv) of the MPS path for TENSOR_SIZES."""
    q, k, v, _, _ = _case(*TENSOR_SIZES)
    out, lse = _mps.forward(q, k, v, None, None, *TENSOR_SETTINGS)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    return (q, k, v, dout), (out, lse, *_mps.backward(dout, q, k, v, out, lse, None, None, *TENSOR_SETTINGS))


def test_forced_tensor_ops_name_tensor_kernels_within_the_rule(compiler, monkeypatch):
    """FLASH_ATTENTION_TENSOR_OPS=1: the MPS plans name the tensor-op forward, dQ and dK/dV, compiled
    from the tensor-op source as a library of its own (once per prelude; the other dispatches from
    the kernel source), and the results are within the accuracy rule's tensor-op term of the
    float64 reference; mps_tensor_ops() says which way and why."""
    from conftest import assert_within_rule
    from flash_attention_metal import accuracy
    from flash_attention_metal.torch import mps_tensor_ops

    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    (q, k, v, dout), (out, lse, dq, dk, dv) = _tensor_run()
    names = [name for name, _ in compiler.dispatches]
    for kernel in ("forward", "backward_dq", "backward_dkv"):
        assert f"flash_attention_{kernel}_tensor_f16_d64" in names, names
    tensor_sources = [s for s in compiler.sources if _is_tensor_source(s)]
    assert len(tensor_sources) == len(set(tensor_sources)) == 1  # one prelude: features off
    assert mps_tensor_ops().startswith("tensor ops: FLASH_ATTENTION_TENSOR_OPS=1 (")
    arrays = [t.numpy() for t in (q, k, v)]
    options = dict(causal=True, softmax_scale=0.2, tensor_ops=True)
    metrics = accuracy.evaluate_forward(*arrays, out.numpy(), lse.numpy(), **options)
    metrics += accuracy.evaluate_backward(dout.numpy(), *arrays, dq.numpy(), dk.numpy(), dv.numpy(), **options)
    assert_within_rule(metrics, "tensor-op kernels on the MPS path")


@pytest.mark.parametrize("value, why", [
    ("0", "simdgroup kernels: FLASH_ATTENTION_TENSOR_OPS=0"),
    (None, "simdgroup kernels: no Metal device, and the host named no architecture"),  # Linux: no matrix units
])
def test_without_the_override_or_with_0_no_tensor_kernel(compiler, monkeypatch, value, why):
    from flash_attention_metal.torch import mps_tensor_ops

    if value is None:
        monkeypatch.delenv("FLASH_ATTENTION_TENSOR_OPS", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", value)
    _tensor_run()
    assert compiler.dispatches and not any("_tensor_" in name for name, _ in compiler.dispatches)
    assert not any(_is_tensor_source(s) for s in compiler.sources + compiler.refused)
    assert mps_tensor_ops().startswith(why)


def test_a_tensor_library_compile_failure_falls_back_with_the_reason(compiler, monkeypatch):
    """compile_shader at MSL 3.2 (macOS 15, or a PyTorch that does not select 4.0) refuses the
    tensor-op source: the pass is planned again on the simdgroup kernels (nothing was encoded
    before), giving their bits; the failure is kept (the backward does not try again) and
    mps_tensor_ops() carries the compiler's message."""
    from flash_attention_metal.torch import mps_tensor_ops

    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    compiler.language_version = (3, 2)
    _, got = _tensor_run()
    assert len(compiler.refused) == 1
    assert compiler.dispatches and not any("_tensor_" in name for name, _ in compiler.dispatches)
    route = mps_tensor_ops()
    assert route.startswith("simdgroup kernels: FLASH_ATTENTION_TENSOR_OPS=1, but ")
    assert route.endswith("the host's tensor-op library failed: SyntaxError: program_source:7:10: "
                          "fatal error: 'MetalPerformancePrimitives/MetalPerformancePrimitives.h' file not found")
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "0")
    _, expected = _tensor_run()
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)


def test_tensor_op_plans_in_pieces_give_the_whole_plans_bits(compiler, monkeypatch):
    """The tensor-op kernels bound at a piece's offsets (MAX_FLOPS_PER_PIECE 1: one query or key
    block range per piece) give the bits of the plan in one piece."""
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    _, whole = _tensor_run()
    monkeypatch.setattr(_mps, "MAX_FLOPS_PER_PIECE", 1)
    start = len(compiler.dispatches)
    _, pieces = _tensor_run()
    names = [name for name, _ in compiler.dispatches[start:]]
    assert sum("_tensor_" in name for name in names) > 3 and len(compiler.commits) > 2
    for mine, theirs in zip(pieces, whole):
        assert torch.equal(mine, theirs)
