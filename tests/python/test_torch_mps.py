"""The MPS path's translation of the exported plan into ``torch.mps.compile_shader`` calls, run here
without a GPU: ``torch._C._mps_compileShader`` (what ``torch.mps.compile_shader`` calls after
embedding headers) is replaced by a stand-in whose kernels run each dispatch on the CPU engine by
kernel name, and check every argument against compile_shader's contract (PyTorch
``torch/csrc/mps/Module.cpp``, ``OperationUtils.mm``):

- the source is a dispatch's constants prelude (the function constants' values, which the stand-in
  hands the engine as the dispatch's constants) and ``fa_plan_kernel_source()``, left unchanged by
  compile_shader's embedding of PyTorch's headers;
- argument i is ``[[buffer(i)]]``, every index up to the kernel's last bound; a tensor argument binds
  its storage at ``storage_offset() * element_size()`` (here: its CPU data_ptr()), never a 0-D
  CPU tensor (that would be setBytes); a list of Python ints is setBytes of int64 values; no
  ``arg_casts``, no floats;
- ``threads`` is the grid in threads and ``group_size`` the threadgroup, 3 axes each, whole
  threadgroups, at most the pipeline's max_threads_per_threadgroup.
The results must be bit for bit those of the CPU path (the same kernels on the same engine, through
fa_forward and fa_backward), for plans in one piece and in many (bindings at offsets).
"""

from __future__ import annotations

import math
import re
import struct

import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)

from flash_attention_metal import _native, plan  # noqa: E402
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
        self.sources = []
        self.dispatches = []

    def __call__(self, source: str):
        self.sources.append(source)
        return StandInLibrary(self, source)


_CONSTANT = re.compile(r"^constant (bool|uint) (\w+) = (true|false|\d+);$")


class StandInLibrary:
    """The source must be a constants prelude (the define, then one line per function constant in
    index order) and the kernel source; the prelude's values become the engine's function constants,
    as Metal would compile them in."""

    def __init__(self, compiler: StandInCompiler, source: str):
        lines = source.split("\n")
        assert lines[0] == "#define FA_FUNCTION_CONSTANTS_PREDEFINED 1", "no constants prelude"
        count = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith("constant "))
        self.constants = []
        for index, line in enumerate(lines[1:count]):
            kind, _name, value = _CONSTANT.match(line).groups()
            bits = {"true": 1, "false": 0}[value] if kind == "bool" else int(value)
            self.constants.append((index, 0 if kind == "bool" else 1, bits))
        # compile_shader's header embedding ends the text with one more newline; nothing else changes.
        assert "\n".join(lines[count:]).rstrip("\n") == plan.kernel_source().rstrip("\n"), \
            "compile_shader got other text than the kernel source"
        self.compiler = compiler

    def __getattr__(self, name: str):
        info = self.compiler.ffi.new("msl_engine_kernel_info *")
        assert self.compiler.engine.msl_engine_describe_kernel(name.encode(), info), f"no kernel {name}"
        return StandInKernel(self, name, info)


class StandInKernel:
    def __init__(self, library: StandInLibrary, name: str, info):
        self.library, self.name, self.info = library, name, info
        self.max_threads_per_threadgroup = library.compiler.max_threads
        self.static_thread_group_memory_length = info.threadgroup_memory_length

    def _bind(self, ffi, argument, keep):
        if isinstance(argument, torch.Tensor):
            assert argument.dim() >= 1, "a 0-D CPU tensor would be sent with setBytes, not bound"
            assert argument.device.type == "cpu"
            # Metal binds the storage at storage_offset() * element_size(): a CPU tensor's data_ptr().
            end = argument.untyped_storage().data_ptr() + argument.untyped_storage().nbytes()
            return argument.data_ptr(), end - argument.data_ptr()
        assert isinstance(argument, list) and argument and all(type(x) is int for x in argument), \
            f"{self.name}: argument {argument!r} is neither a tensor nor a list of ints"
        data = ffi.new("char[]", struct.pack(f"<{len(argument)}q", *argument))
        keep.append(data)
        return ffi.cast("uintptr_t", data), len(argument) * 8

    def __call__(self, *arguments, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
        assert arg_casts is None and error_buf_idx is None
        assert isinstance(threads, list) and isinstance(group_size, list) and len(threads) == len(group_size) == 3
        assert math.prod(group_size) <= self.max_threads_per_threadgroup
        assert all(t % g == 0 for t, g in zip(threads, group_size)), "partial threadgroups"
        assert len(arguments) >= self.info.buffer_count, "a buffer the kernel reads is unbound"
        assert all(a is not None for a in arguments), "an index is left unbound"
        compiler = self.library.compiler
        ffi, keep = compiler.ffi, []
        constants = ffi.new("msl_engine_function_constant[]", self.library.constants)
        buffers = ffi.new("msl_engine_buffer[]", len(arguments))
        for i, argument in enumerate(arguments):
            address, length = self._bind(ffi, argument, keep)
            buffers[i].contents, buffers[i].length = ffi.cast("void *", address), length
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
def test_translation_gives_the_cpu_paths_bits(compiler, case):
    sizes, options = CASES[case]
    expected = _run(_host, sizes, options)
    got = _run(_mps, sizes, options)
    for name, mine, theirs in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert torch.equal(mine, theirs), name
    # One library per constants prelude of the two plans, each compiled once; every dispatch ran.
    preludes = {d.constants_prelude for made in _mps._plans.values() for d in made.dispatches}
    assert len(compiler.sources) == len(set(compiler.sources)) == len(preludes)
    names = [name for name, _ in compiler.dispatches]
    assert names[0].startswith("flash_attention_forward_") and names[-1].startswith("flash_attention_backward_dkv_")
    if "decode" in case:
        assert names[:2] == ["flash_attention_forward_split_f32_d128", "flash_attention_forward_combine_f32"]


def test_pieces_bind_at_offsets(compiler, monkeypatch):
    """A plan cut into pieces: each piece's dispatches bind the buffers at the piece's offsets
    (views of the tensors further into their storage) and still give the whole plan's bits."""
    sizes, options = CASES["float16, causal GQA"]
    expected = _run(_mps, sizes, options)
    whole = len(compiler.dispatches)
    monkeypatch.setattr(_mps, "MAX_FLOPS_PER_PIECE", 1)
    got = _run(_mps, sizes, options)
    assert len(compiler.dispatches) - whole > 2 * whole  # 4 pieces (2 batch entries x 2 KV heads) per pass
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)


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


def test_features_reach_the_engine_as_function_constants(compiler):
    """The bfloat16 case's mask, ALiBi and softcap: the kernels read them as function constants,
    here from the prelude of the source compile_shader got (a kernel that read one the prelude did
    not set would fail its dispatch on the engine)."""
    sizes, options = CASES["bfloat16, mask, ALiBi, window, softcap, bshd"]
    _run(_mps, sizes, options)
    forward = next(source for source in compiler.sources if "fa_has_softcap = true" in source)
    assert "constant uint fa_mask_type = 1;" in forward and "constant bool fa_has_alibi = true;" in forward
