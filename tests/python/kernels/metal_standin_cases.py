"""The Metal backend on the stand-in Metal module against the CPU backend, bit for bit.

Run by test_metal_standin.py in a child process whose libFlashAttentionMetal is the stand-in build
(tests/metal_standin/build.sh): there ``Context("metal")`` is the Metal backend (MetalBackend.swift:
buffer wrapping, command buffers, pipelines, encoders) over the stand-in, and ``Context("cpu")`` the
CPU backend, in one library. Every case runs on both and every output must be equal byte for byte;
together the cases dispatch every kernel the engine has through the Metal backend (checked last).
Not collected on its own (the name does not start with test_).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam

DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32}
# One head_dim per bucket (d32 ... d576), most of them below the bucket's maximum; float32 has no
# bucket above 256.
HEAD_DIMS = [24, 64, 80, 128, 160, 256, 400, 576]
CASES = [(dtype, bucket) for dtype in DTYPES for bucket in range(len(HEAD_DIMS))
         if dtype != "f32" or HEAD_DIMS[bucket] <= 256]
FAULT_ENV = "FLASH_ATTENTION_METAL_STANDIN_FAULT"

_KERNELS_RUN: set[str] = set()
GPU_CORES_ENV = "FLASH_ATTENTION_GPU_CORES"


@pytest.fixture(scope="module")
def cpu() -> fam.Context:
    return fam.Context("cpu")


@pytest.fixture(scope="module")
def metal() -> fam.Context:
    context = fam.Context("metal")
    assert context.device == "Metal stand-in (CPU engine)", context
    return context


def _bits(array) -> bytes:
    return np.ascontiguousarray(array).view(np.uint8).tobytes()


def _same(cpu_result, metal_result, what: str) -> None:
    for n, (a, b) in enumerate(zip(cpu_result, metal_result)):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (what, n)
        assert _bits(a) == _bits(b), f"{what}: output {n} differs between the CPU and Metal backends"


def _record(metal: fam.Context) -> None:
    _KERNELS_RUN.update(d.kernel for d in metal.last_profile.dispatches)


def _inputs(rng, dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v=None):
    def make(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    return (make(batch, heads, seqlen_q, head_dim), make(batch, kv_heads, seqlen_k, head_dim),
            make(batch, kv_heads, seqlen_k, head_dim_v or head_dim))


def _options(case: int, rng, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> dict:
    """A different score option per case, so that the cases reach each of them in each dtype."""
    choice = case % 6
    if choice == 1:
        return {"causal": True}
    if choice == 2:
        return {"softcap": 30.0, "window_size": (9, 3)}
    if choice == 3:
        return {"alibi_slopes": rng.uniform(0.01, 0.5, (heads,)).astype(np.float32), "causal": True}
    if choice == 4:
        mask = rng.standard_normal((batch, 1, seqlen_q, seqlen_k)).astype(np.float32)
        mask[..., ::5] = -np.inf
        return {"attn_mask": mask, "sinks": rng.standard_normal(heads).astype(np.float32)}
    if choice == 5:
        return {"attn_mask": rng.random((batch, heads, seqlen_q, seqlen_k)) > 0.3}
    return {}


@pytest.mark.parametrize("dtype,bucket", CASES)
def test_forward_backward_decode(cpu, metal, dtype, bucket, monkeypatch):
    """Forward and backward (GQA, unequal lengths, a score option), then a decode-shaped forward
    (the decode and combine kernels; above head_dim 256 the tiled split kernel), 16 rows over the
    same cache (the tiled split kernel), a few rows past a decode block (the spec kernel) and a
    paged KV cache (the cache-reading kernels)."""
    rng = np.random.default_rng(1000 * bucket + len(dtype))
    head_dim = HEAD_DIMS[bucket]
    q, k, v = _inputs(rng, DTYPES[dtype], 1, 4, 2, 19, 27, head_dim)
    options = _options(bucket + 3 * list(DTYPES).index(dtype), rng, 1, 4, 19, 27)
    forward = [c.forward(q, k, v, **options) for c in (cpu, metal)]
    _record(metal)
    _same(*forward, f"forward {dtype} d{head_dim} {sorted(options)}")
    out, lse = forward[0]
    dout = rng.standard_normal(out.shape).astype(np.float32).astype(out.dtype)
    # Planned for 40 cores, whose slots the GQA backward's few dK/dV threadgroups leave idle in
    # every bucket: its group is cut over threadgroups (the split dK/dV and its reduction,
    # GroupSplit.swift); one KV head per query head below keeps the unsplit kernel.
    monkeypatch.setenv(GPU_CORES_ENV, "40")
    backward = [c.backward(dout, q, k, v, out, lse, **options) for c in (cpu, metal)]
    monkeypatch.delenv(GPU_CORES_ENV)
    _record(metal)
    assert any("dkv_split" in d.kernel for d in metal.last_profile.dispatches)
    _same(*backward, f"backward {dtype} d{head_dim} {sorted(options)}")
    q, k, v = _inputs(rng, DTYPES[dtype], 1, 2, 2, 19, 27, head_dim)
    out, lse = cpu.forward(q, k, v)
    dout = np.ascontiguousarray(dout[:, :2])
    backward = [c.backward(dout, q, k, v, out, lse) for c in (cpu, metal)]
    _record(metal)
    _same(*backward, f"backward, no GQA, {dtype} d{head_dim}")

    q, k, v = _inputs(rng, DTYPES[dtype], 1, 2, 1, 1, 600, head_dim)
    decode = [c.forward(q, k, v) for c in (cpu, metal)]
    _record(metal)
    chunks = "decode" if head_dim <= 256 else "split"
    assert metal.last_profile.dispatches[0].kernel.startswith(f"flash_attention_forward_{chunks}_")
    _same(*decode, f"decode {dtype} d{head_dim}")
    q = _inputs(rng, DTYPES[dtype], 1, 2, 1, 16, 600, head_dim)[0]
    speculative = [c.forward(q, k, v) for c in (cpu, metal)]
    _record(metal)
    assert any("split" in d.kernel for d in metal.last_profile.dispatches)
    _same(*speculative, f"16 rows {dtype} d{head_dim}")
    # Packed rows past a decode block but within one spec block (FA_SPEC_SERVES): the spec kernel.
    spec_rows = 5 if head_dim <= 128 else 3
    if head_dim <= 256:
        q = _inputs(rng, DTYPES[dtype], 1, 2, 1, spec_rows, 600, head_dim)[0]
        spec = [c.forward(q, k, v) for c in (cpu, metal)]
        _record(metal)
        assert any("forward_spec_" in d.kernel for d in metal.last_profile.dispatches)
        _same(*spec, f"{spec_rows} rows {dtype} d{head_dim}")

    # A paged KV cache, pages shuffled: a prefill chunk (the cache-reading forward), a speculative
    # step (the cache-reading tiled split kernel) and a decode step (the cache-reading decode
    # kernel; above head_dim 256 the tiled one).
    pages = rng.permutation(40).astype(np.int32)[None]
    k_cache, v_cache = (rng.standard_normal((40, 16, 1, head_dim)).astype(np.float32).astype(DTYPES[dtype])
                        for _ in range(2))
    for rows in (80, 16, spec_rows, 1):
        query = rng.standard_normal((1, rows, 2, head_dim)).astype(np.float32).astype(DTYPES[dtype])
        cached = [fam.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=600, block_table=pages,
                                              return_softmax_lse=True, context=c) for c in (cpu, metal)]
        _record(metal)
        assert any("kvcache" in d.kernel for d in metal.last_profile.dispatches)
        _same(*cached, f"paged cache, {rows} rows, {dtype} d{head_dim}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_mma_decode_over_a_quantized_cache(cpu, metal, dtype, head_dim):
    """A decode step over an 8-bit paged cache whose head_dim is its bucket's (FA_DECODE_MMA_SERVES):
    the MMA decode, the same bits on both backends."""
    from flash_attention_metal import quantized
    rng = np.random.default_rng(head_dim + len(dtype))
    pages = rng.permutation(8).astype(np.int32)[None]
    k_cache, v_cache = (quantized.quantize(rng.standard_normal((8, 16, 1, head_dim)).astype(DTYPES[dtype]), 32, 8)
                        for _ in range(2))
    query = rng.standard_normal((1, 1, 3, head_dim)).astype(np.float32).astype(DTYPES[dtype])
    cached = [fam.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=100, block_table=pages, bits=8,
                                          group_size=32, return_softmax_lse=True, context=c) for c in (cpu, metal)]
    _record(metal)
    assert any("decode_mma_kvcache" in d.kernel for d in metal.last_profile.dispatches)
    _same(*cached, f"8-bit paged cache, MMA decode, {dtype} d{head_dim}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_merge(cpu, metal, dtype):
    rng = np.random.default_rng(7)
    out_a, out_b = (rng.standard_normal((2, 3, 5, 40)).astype(np.float32).astype(DTYPES[dtype]) for _ in "ab")
    lse_a, lse_b = (rng.standard_normal((2, 3, 5)).astype(np.float32) for _ in "ab")
    lse_b[0, 0, 0] = -np.inf
    merged = [c.merge_attention(out_a, lse_a, out_b, lse_b) for c in (cpu, metal)]
    _record(metal)
    _same(*merged, f"merge {dtype}")


def test_bshd_views_and_given_outputs(cpu, metal):
    """Strided inputs read in place and outputs written into given arrays: the Metal backend copies
    back only the addressed elements, as the CPU backend writes them."""
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 33, 3, 4, 64)).astype(np.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    results = []
    for context in (cpu, metal):
        out = np.full((2, 33, 4, 64 + 8), 7, np.float16)[..., :64]
        lse = np.full((2, 4, 33), 5, np.float32)
        context.forward(q, k, v, layout="bshd", causal=True, out=out, lse=lse)
        results.append((out.base, lse))
    _record(metal)
    _same(*results, "bshd views, given outputs")


# The stand-in IOKit's gpu-core-count of the stand-in device (tests/swift/IOKitStandIn).
DEVICE_CORES_ENV = "FLASH_ATTENTION_METAL_STANDIN_GPU_CORE_COUNT"


def test_plan_follows_the_device_core_count(cpu, monkeypatch):
    """The Metal backend plans the decode chunks for the core count the IORegistry gives its device
    (the stand-in's entry, not the other GPU's listed first), and the profile says so; without one
    it plans for the nominal GPU, and FLASH_ATTENTION_GPU_CORES wins over both. Every plan computes
    what the CPU engine computes for the same core count, bit for bit."""
    q, k, v = _inputs(np.random.default_rng(9), np.float16, 1, 32, 8, 1, 2048, 128)

    def run(context):
        result = context.forward(q, k, v)
        profile = context.last_profile
        return result, profile.gpu_cores, profile.dispatches[0].threadgroups

    monkeypatch.delenv(GPU_CORES_ENV, raising=False)
    monkeypatch.delenv(DEVICE_CORES_ENV, raising=False)
    nominal = run(fam.Context("metal"))
    assert nominal[1] == 10
    assert nominal[2] == run(cpu)[2]
    monkeypatch.setenv(DEVICE_CORES_ENV, "40")
    device = fam.Context("metal")  # reads the count once, when made
    planned = run(device)
    assert planned[1] == 40 and planned[2][0] > nominal[2][0], (planned[1:], nominal[1:])
    monkeypatch.setenv(GPU_CORES_ENV, "40")
    on_cpu = run(cpu)
    assert on_cpu[1:] == planned[1:]
    _same(on_cpu[0], planned[0], "decode planned for 40 cores")
    monkeypatch.setenv(GPU_CORES_ENV, "20")
    assert run(device)[1] == 20
    _record(device)


# Run in a fresh process: the library reads the device's count for exported plans once per process.
EXPORTED_PLAN = """
from flash_attention_metal import _abi, _native, plan
from flash_attention_metal._validation import Shape
library = _native.native()
problem = _abi.new_problem(library.ffi, library.lib, Shape(1, 32, 8, 1, 2048, 128), False, 0.1, "float16", {})
print(*plan.gpu_cores(), *plan.create(problem, "forward").dispatches[0].threadgroups_per_grid)
"""


def test_exported_plan_follows_the_device_core_count(cpu, monkeypatch):
    """fa_plan_create (the PyTorch MPS and MLX GPU paths encode its plan on the library's Metal
    device) plans for that device's core count, as a Metal context does, and says so in
    fa_gpu_cores(NULL): the CPU engine's plan for the same count."""
    monkeypatch.delenv(GPU_CORES_ENV, raising=False)
    env = dict(os.environ, **{DEVICE_CORES_ENV: "40"})
    result = subprocess.run([sys.executable, "-c", EXPORTED_PLAN], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    cores, source, *grid = result.stdout.split()
    q, k, v = _inputs(np.random.default_rng(10), np.float16, 1, 32, 8, 1, 2048, 128)
    monkeypatch.setenv(GPU_CORES_ENV, "40")
    cpu.forward(q, k, v)
    assert (int(cores), source) == (40, "device")
    assert tuple(map(int, grid)) == cpu.last_profile.dispatches[0].threadgroups


def test_varlen_through_the_metal_backend(cpu, metal):
    """A variable-length batch (the sequence table kernel, then every pass's kernels reading their
    parameters from that workspace in place of the bytes): the same bits as the CPU backend."""
    rng = np.random.default_rng(4)
    cu = np.array([0, 9, 9, 30], np.int32)
    q = rng.standard_normal((30, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((30, 2, 64)).astype(np.float16) for _ in range(2))
    sinks = rng.uniform(-1, 1, 4).astype(np.float32)
    results = []
    for context in (cpu, metal):
        out, lse = context.forward_varlen(q, k, v, cu, cu, 21, 21, causal=True, sinks=sinks)
        if context is metal:
            _record(metal)
        grads = context.backward_varlen(q, q, k, v, out, lse, cu, cu, 21, 21, causal=True, sinks=sinks)
        results.append((out, lse, *grads))
    _record(metal)
    _same(*results, "varlen")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_tensor_op_forward(cpu, monkeypatch, dtype):
    """The tensor-op forward of every bucket that has one (FLASH_ATTENTION_TENSOR_OPS=1; a Metal
    context made while it is set compiles the tensor-op library), a score option each."""
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    metal = fam.Context("metal")
    for n, head_dim in enumerate([64, 80, 128, 256]):
        rng = np.random.default_rng(77 + n)
        q, k, v = _inputs(rng, DTYPES[dtype], 1, 4, 2, 70, 45, head_dim)
        options = _options(n + 2 * len(dtype), rng, 1, 4, 70, 45)
        forward = [c.forward(q, k, v, **options) for c in (cpu, metal)]
        assert [d.kernel for d in metal.last_profile.dispatches] == [
            f"flash_attention_forward_tensor_{dtype}_d{96 if head_dim == 80 else head_dim}"]
        _record(metal)
        _same(*forward, f"tensor-op forward {dtype} d{head_dim} {sorted(options)}")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_tensor_op_backward(cpu, monkeypatch, dtype):
    """The tensor-op dQ and dK/dV of every bucket that has them (FLASH_ATTENTION_TENSOR_OPS=1), a
    score option each, bit for bit the CPU backend's."""
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    metal = fam.Context("metal")
    for n, head_dim in enumerate([64, 80, 128, 200]):
        rng = np.random.default_rng(97 + n)
        q, k, v = _inputs(rng, DTYPES[dtype], 1, 4, 2, 70, 45, head_dim)
        options = _options(n + 2 * len(dtype) + 1, rng, 1, 4, 70, 45)
        out, lse = cpu.forward(q, k, v, **options)
        dout = rng.standard_normal(out.shape).astype(np.float32).astype(out.dtype)
        backward = [c.backward(dout, q, k, v, out, lse, **options) for c in (cpu, metal)]
        assert sum("_tensor_" in d.kernel for d in metal.last_profile.dispatches) == 2
        _record(metal)
        _same(*backward, f"tensor-op backward {dtype} d{head_dim} {sorted(options)}")


def test_all_kernels_reached():
    """Every kernel the engine has went through the Metal backend in the cases above."""
    library = ctypes.CDLL(os.environ[fam.LIBRARY_ENV])
    library.msl_engine_kernel_name.restype = ctypes.c_char_p
    library.msl_engine_kernel_name.argtypes = [ctypes.c_size_t]
    names = set()
    while (name := library.msl_engine_kernel_name(len(names))) is not None:
        names.add(name.decode())
    assert len(names) > 50
    assert names - _KERNELS_RUN == set()


# Error paths: the faults a healthy device never shows, planted through the stand-in.

def _status(call) -> str:
    with pytest.raises(fam.FlashAttentionError) as raised:
        call()
    return raised.value.status_name


def _small(dtype=np.float16):
    return _inputs(np.random.default_rng(5), dtype, 1, 2, 2, 16, 16, 32)


@pytest.mark.parametrize("code, status", [
    ("timeout", "FA_STATUS_EXECUTION_FAILED"),
    ("outOfMemory", "FA_STATUS_OUT_OF_MEMORY"),
    ("internal", "FA_STATUS_EXECUTION_FAILED"),
])
def test_command_buffer_errors(metal, monkeypatch, code, status):
    """A failed command buffer is an error of that kind; the outputs given hold NaN, not results;
    the device stays usable."""
    q, k, v = _small()
    out = np.zeros_like(q)
    monkeypatch.setenv(FAULT_ENV, f"commit:{code}:1")
    assert _status(lambda: metal.forward(q, k, v, out=out)) == status
    assert np.isnan(out.astype(np.float32)).all()
    monkeypatch.delenv(FAULT_ENV)
    metal.forward(q, k, v)


def test_a_failed_command_buffer_names_the_faulted_kernel(metal, monkeypatch):
    """The error names the encoder Metal marks faulted (MTLCommandBufferEncoderInfo through the
    NSError's userInfo), not every kernel of the command buffer."""
    q, k, v = _small()
    out, lse = metal.forward(q, k, v)
    monkeypatch.setenv(FAULT_ENV, "commit:internal:1")
    with pytest.raises(fam.FlashAttentionError) as raised:
        metal.backward(q, q, k, v, out, lse)
    assert "command buffer 1 of 1 (flash_attention_backward_delta_f16):" in str(raised.value), raised.value


@pytest.mark.parametrize("code", ["accessRevoked", "notPermitted"])
def test_device_lost(monkeypatch, code):
    """Errors that take the GPU from the process make every later call of that context fail."""
    q, k, v = _small()
    context = fam.Context("metal")
    monkeypatch.setenv(FAULT_ENV, f"commit:{code}:1")
    assert _status(lambda: context.forward(q, k, v)) == "FA_STATUS_BACKEND_UNAVAILABLE"
    monkeypatch.delenv(FAULT_ENV)
    assert _status(lambda: context.forward(q, k, v)) == "FA_STATUS_BACKEND_UNAVAILABLE"


def test_msl_31_compile_failure_keeps_other_dtypes(cpu, monkeypatch):
    """When the MSL 3.1 compile fails the backend compiles at 3.0: every dtype but bfloat16."""
    monkeypatch.setenv(FAULT_ENV, "compile:3.1")
    context = fam.Context("metal")
    monkeypatch.delenv(FAULT_ENV)
    assert "without the bfloat16 kernels" in context.note and "MSL 3.1 failed" in context.note
    q, k, v = _small()
    _same(cpu.forward(q, k, v), context.forward(q, k, v), "forward after the MSL 3.0 retry")
    q, k, v = _small(ml_dtypes.bfloat16)
    assert _status(lambda: context.forward(q, k, v)) == "FA_STATUS_UNSUPPORTED"



def test_a_dtype_that_does_not_compile_loses_only_its_kernels(cpu, monkeypatch):
    """When the whole source does not compile because of one dtype's kernels (here float16), the
    backend compiles each dtype alone: float32 and bfloat16 run, float16 is refused naming why."""
    monkeypatch.setenv(FAULT_ENV, "compile:f16")
    context = fam.Context("metal")
    monkeypatch.delenv(FAULT_ENV)
    assert "each dtype was compiled alone" in context.note and "without the float16 kernels" in context.note
    assert "bfloat16" not in context.note and "float32" not in context.note, context.note
    for dtype in (np.float32, ml_dtypes.bfloat16):
        q, k, v = _small(dtype)
        _same(cpu.forward(q, k, v), context.forward(q, k, v), f"{np.dtype(dtype).name} forward without float16")
    q, k, v = _small()
    with pytest.raises(fam.FlashAttentionError) as raised:
        context.forward(q, k, v)
    assert raised.value.status_name == "FA_STATUS_UNSUPPORTED"
    assert "the float16 kernels did not compile" in str(raised.value) and "the other dtypes run" in str(raised.value)


def test_matrix_units_take_the_tensor_op_path_and_a_failed_library_loses_only_it(cpu, monkeypatch):
    """An M5's architecture (the stand-in's FLASH_ATTENTION_METAL_STANDIN_ARCH) compiles the MSL 4.0
    tensor-op library and takes the tensor-op forward unasked; when that library does not compile,
    the note says why and the simdgroup kernels run, forced or not."""
    monkeypatch.setenv("FLASH_ATTENTION_METAL_STANDIN_ARCH", "applegpu_g17s")
    q, k, v = _inputs(np.random.default_rng(8), np.float16, 1, 2, 2, 70, 40, 64)
    m5 = fam.Context("metal")
    out = m5.forward(q, k, v, causal=True)
    assert [d.kernel for d in m5.last_profile.dispatches] == ["flash_attention_forward_tensor_f16_d64"]
    monkeypatch.setenv("FLASH_ATTENTION_TENSOR_OPS", "1")
    _same(cpu.forward(q, k, v, causal=True), out, "tensor-op forward chosen by the device")
    monkeypatch.setenv(FAULT_ENV, "compile:tensor")
    lost = fam.Context("metal")
    monkeypatch.delenv(FAULT_ENV)
    assert "the tensor-op library (MSL 4.0) did not compile" in lost.note, lost.note
    for forced in ("1", None):
        if forced is None:
            monkeypatch.delenv("FLASH_ATTENTION_TENSOR_OPS")
        lost.forward(q, k, v, causal=True)
        assert [d.kernel for d in lost.last_profile.dispatches] == ["flash_attention_forward_f16_d64"]


def _page_aligned(array: np.ndarray) -> np.ndarray:
    """A copy of array at a 16 KiB boundary (Apple silicon's page), its size a multiple of 16 KiB:
    memory the Metal backend wraps without a copy."""
    page = 16 * 1024
    assert array.nbytes % page == 0
    raw = np.empty(array.nbytes + page, np.uint8)
    start = -raw.ctypes.data % page
    aligned = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    aligned[...] = array
    return aligned


def test_page_fault_on_wrapped_inputs_retries_with_copies(cpu, metal, monkeypatch):
    """A GPU page fault on inputs wrapped without a copy: the call runs again on copies and
    succeeds; without wrapped inputs a page fault is a library defect (internal error)."""
    q, k, v = _inputs(np.random.default_rng(9), np.float16, 1, 2, 2, 64, 64, 64)  # 16 KiB each
    expected = cpu.forward(q, k, v)
    aligned = [_page_aligned(x) for x in (q, k, v)]
    monkeypatch.setenv(FAULT_ENV, "commit:pageFault:1")
    _same(expected, metal.forward(*aligned), "forward retried on copies")
    assert metal.last_profile.command_buffers == 1
    monkeypatch.setenv(FAULT_ENV, "commit:pageFault:2")
    assert _status(lambda: metal.forward(*aligned)) == "FA_STATUS_INTERNAL_ERROR"
    monkeypatch.setenv(FAULT_ENV, "commit:pageFault:all")
    assert _status(lambda: metal.forward(q[:, :, 1:], k, v)) == "FA_STATUS_INTERNAL_ERROR"


def test_kv_cache_appended_and_read_in_place(cpu, metal):
    """Caches from empty_cache (page-aligned, 7 x 16 x 2 x 24 float16 = 10.5 KiB, no page multiple:
    the Metal backend binds them in place) appended to on both backends: the same out, lse and
    caches, bit for bit; a quantized pair (8 bits) likewise."""
    rng = np.random.default_rng(11)
    table = np.int32([[4, 1, 6], [0, 5, 2]])
    q = rng.standard_normal((2, 3, 4, 24)).astype(np.float16)
    k, v = (rng.standard_normal((2, 3, 2, 24)).astype(np.float16) for _ in range(2))
    rows = rng.standard_normal((7, 16, 2, 24)).astype(np.float16)
    results = []
    for context in (cpu, metal):
        caches = [fam.empty_cache(rows.shape, np.float16) for _ in range(2)]
        for cache in caches:
            cache[...] = rows
        out = fam.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=np.int32([5, 20]), block_table=table,
                                          causal=True, return_softmax_lse=True, context=context)
        results.append((*out, *caches))
    _record(metal)
    _same(*results, "appended in place")
    q, k, v = (rng.standard_normal((2, 1, h, 64)).astype(np.float16) for h in (4, 2, 2))
    rows = rng.standard_normal((2, 30, 2, 64)).astype(np.float16)
    quantized = [[fam.quantized.quantize(rows, 64, 8) for _ in range(2)] for _ in range(2)]
    outs = [fam.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=20, bits=8, context=context)
            for context, caches in zip((cpu, metal), quantized)]
    _same([outs[0], *quantized[0][0]], [outs[1], *quantized[1][0]], "8-bit cache appended")


def test_read_only_inputs_are_copied(cpu, metal):
    """Page-aligned memory the process may not write is not wrapped (the stand-in refuses it, as
    Metal may refuse memory it cannot map): the call copies it and gives the CPU backend's result."""
    q, k, v = _inputs(np.random.default_rng(10), np.float16, 1, 2, 2, 64, 64, 64)
    q_locked = _page_aligned(q)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prot_read, prot_write = 1, 2
    assert libc.mprotect(q_locked.ctypes.data, q_locked.nbytes, prot_read) == 0, ctypes.get_errno()
    try:
        _same(cpu.forward(q, k, v), metal.forward(q_locked, k, v), "read-only q")
    finally:
        libc.mprotect(q_locked.ctypes.data, q_locked.nbytes, prot_read | prot_write)
