"""The decode forward (flash_attention_decode.h) and the split-KV plan by GPU core count
(docs/decode.md): every option and dtype at decode shapes, strided and unaligned caches, the K/V
bytes read, the core-count override, 9-64 query rows, and a long synthetic cache, against the
float64 reference under the accuracy rule. Shapes whose plan the Swift DispatchPlan tests pin."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _native, accuracy, plan
from flash_attention_metal._validation import Shape

from conftest import assert_within_rule, make_inputs

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
CORES = "FLASH_ATTENTION_GPU_CORES"
FORWARD_K, FORWARD_V = 1, 2  # FA_FORWARD_BUFFER_K, FA_FORWARD_BUFFER_V


def _options(name: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dtype) -> dict:
    rng = np.random.default_rng(len(name))
    if name == "bool mask":
        return dict(attn_mask=rng.random((batch, 1, seqlen_q, seqlen_k)) > 0.3)
    if name == "additive mask":
        return dict(attn_mask=rng.standard_normal((batch, heads, seqlen_q, seqlen_k)).astype(dtype))
    return {
        "none": {},
        "causal window": dict(causal=True, window_size=(90, 0)),
        "softcap": dict(softcap=3.0),
        "alibi": dict(causal=True, alibi_slopes=np.linspace(0.02, 0.2, heads, dtype=np.float32)),
        "sinks": dict(sinks=np.linspace(-1, 3, heads, dtype=np.float32)),
    }[name]


def _decode(ctx, q, k, v, **options):
    out, lse = ctx.forward(q, k, v, **options)
    kernels = [d.kernel for d in ctx.last_profile.dispatches]
    assert kernels[0].startswith("flash_attention_forward_decode_") and "combine" in kernels[1], kernels
    return out, lse


OPTIONS = ["none", "causal window", "softcap", "alibi", "sinks", "bool mask", "additive mask"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
def test_every_option_and_dtype(ctx, name, dtype):
    # 3 rows (bottom-right causal over 3 queries), GQA 2, keys not a multiple of a chunk.
    b, h, hk, nq, nk, d = 2, 4, 2, 3, 333, 64
    q, k, v, _ = make_inputs(7, b, h, hk, nq, nk, d, dtype=DTYPES[dtype])
    options = _options(name, b, h, nq, nk, DTYPES[dtype])
    out, lse = _decode(ctx, q, k, v, **options)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, **options), f"{name} {dtype}")


@pytest.mark.parametrize("head_dim", [8, 80, 160, 256])
def test_every_bucket_and_width(ctx, head_dim):
    # Widths inside the buckets 32, 96, 192 and 256 (lanes past head_dim load nothing); GQA 2 with
    # as many rows as one decode block holds (8 up to head_dim 128, 4 above).
    rows = 4 if head_dim <= 128 else 2
    q, k, v, _ = make_inputs(head_dim, 1, 4, 2, rows, 300, head_dim, dtype=np.float32)
    out, lse = _decode(ctx, q, k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), f"d{head_dim}")


# (head_dim, query heads per KV head, seqlen_q): packed rows 1, 2, 3, 4, 5 and 8 per KV head, each
# taking the instance of 1, 2, 4 or FA_DECODE_ROWS rows that holds them (4 keys per iteration up to
# 4 x E = 32 floats of rows, else 2; head_dim 64 with 8 rows reduce-scatters 32 values, all five
# steps halving), rows of several heads and several query rows.
LIVE_ROWS = [(128, 1, 1), (128, 2, 1), (128, 3, 1), (128, 1, 4), (128, 5, 1), (128, 4, 2), (64, 8, 1),
             (256, 1, 1), (256, 2, 1), (256, 3, 1), (256, 2, 2)]


@pytest.mark.parametrize("head_dim,group,seqlen_q", LIVE_ROWS, ids=[f"d{d}-g{g}x{n}" for d, g, n in LIVE_ROWS])
def test_every_live_row_instance(ctx, head_dim, group, seqlen_q):
    # Bottom-right causal with a window and ALiBi slopes per head (every row sees its own keys and
    # modifiers), 333 keys (the last iteration's slots past the chunk's keys load nothing).
    heads = 2 * group
    q, k, v, _ = make_inputs(group * 10 + seqlen_q, 1, heads, 2, seqlen_q, 333, head_dim)
    options = dict(causal=True, window_size=(200, 0), alibi_slopes=np.linspace(0.01, 0.3, heads, dtype=np.float32))
    out, lse = _decode(ctx, q, k, v, **options)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, **options), f"d{head_dim} {group}x{seqlen_q}")
    again = ctx.forward(q, k, v, **options)
    assert np.array_equal(out, again[0]) and np.array_equal(lse, again[1])


def test_strided_and_unaligned_caches(ctx):
    # A preallocated cache read up to its fill (strided rows of the batch and head axes), and a
    # view one element into the head axis (rows off 16-byte boundaries: the element-load path).
    q, k_all, v_all, _ = make_inputs(9, 1, 4, 2, 2, 512, 72)
    k, v = k_all[:, :, :300, :64], v_all[:, :, :300, :64]
    out, lse = _decode(ctx, q[..., :64], k, v, causal=True)
    assert_within_rule(accuracy.evaluate_forward(q[..., :64], k, v, out, lse, causal=True), "strided")
    k, v = k_all[:, :, :300, 1:65], v_all[:, :, :300, 1:65]
    out, lse = _decode(ctx, q[..., 1:65], k, v)
    assert_within_rule(accuracy.evaluate_forward(q[..., 1:65], k, v, out, lse), "unaligned")


def test_reads_the_cache_once_per_call(ctx, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_COUNT_DEVICE_READS", "1")
    # B=1, H=32, head_dim 128, 256 keys: with 8 KV heads a GQA group's 4 rows fill one decode block;
    # with 1 KV head the 32 rows (4 decode blocks, each reading the cache) take the tiled split
    # kernel, whose one block of 32 rows reads K and V once. Deterministic: a rerun is bit-identical.
    for kv_heads, kernel in [(8, "decode"), (1, "split")]:
        q, k, v, _ = make_inputs(11, 1, 32, kv_heads, 1, 256, 128)
        out, lse = ctx.forward(q, k, v)
        chunks = ctx.last_profile.dispatches[0]
        assert chunks.kernel == f"flash_attention_forward_{kernel}_f16_d128", chunks.kernel
        assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse), f"{kv_heads} KV heads")
        again = ctx.forward(q, k, v)
        assert np.array_equal(out, again[0]) and np.array_equal(lse, again[1])
        if chunks.device_bytes_read is None:
            continue  # the backend counts no device reads (Metal)
        read = chunks.device_bytes_read[FORWARD_K] + chunks.device_bytes_read[FORWARD_V]
        assert 1.0 <= read / (k.nbytes + v.nbytes) <= 1.1, (kv_heads, read / (k.nbytes + v.nbytes))


def _exported_chunks(shape: Shape) -> tuple[int, int, int]:
    """The chunk dispatch's grid of the exported forward plan (fa_plan_create) of ``shape``."""
    library = _native.native()
    problem = _abi.new_problem(library.ffi, library.lib, shape, False, 0.1, "float16", {})
    return plan.create(problem, "forward").dispatches[0].threadgroups_per_grid


def test_core_count_override_plans_for_another_gpu(ctx, monkeypatch):
    # The context's calls and the exported plan (PyTorch MPS, MLX GPU) plan for the same count.
    q, k, v, _ = make_inputs(12, 1, 32, 8, 1, 1024, 128)
    shape = Shape(1, 32, 8, 1, 1024, 128)
    monkeypatch.setenv(CORES, "10")  # a Metal device's own count would apply without it
    out, lse = _decode(ctx, q, k, v)
    assert ctx.last_profile.dispatches[0].threadgroups == (8, 8, 1) == _exported_chunks(shape)  # 2 x 10 x 3
    assert ctx.last_profile.gpu_cores == 10
    assert ctx.gpu_cores == plan.gpu_cores() == (10, CORES)
    monkeypatch.setenv(CORES, "40")
    again, again_lse = _decode(ctx, q, k, v)
    # 16 chunks of 64 keys: the most
    assert ctx.last_profile.dispatches[0].threadgroups == (16, 8, 1) == _exported_chunks(shape)
    assert ctx.last_profile.gpu_cores == 40
    monkeypatch.delenv(CORES)
    if ctx.backend == "cpu":
        assert ctx.gpu_cores == (10, "nominal")
    assert_within_rule(accuracy.evaluate_forward(q, k, v, again, again_lse), "40 cores")
    monkeypatch.setenv(CORES, "many")
    with pytest.raises(fam.FlashAttentionError, match=CORES):
        ctx.forward(q, k, v)
    with pytest.raises(fam.FlashAttentionError, match=CORES):
        plan.gpu_cores()


def test_speculative_rows_take_the_split_kernel_when_cores_would_idle(ctx, monkeypatch):
    # 16 rows x 32 heads: 32 dense threadgroups fill the nominal 10 cores (30 at once) but not 40,
    # where the tiled split kernel serves them over 512 keys (8 chunks of 64).
    q, k, v, _ = make_inputs(13, 1, 32, 8, 16, 512, 64)
    ctx.forward(q, k, v, causal=True)
    assert ctx.last_profile.dispatches[0].kernel == "flash_attention_forward_f16_d64"
    monkeypatch.setenv(CORES, "40")
    out, lse = ctx.forward(q, k, v, causal=True)
    assert [d.kernel for d in ctx.last_profile.dispatches] == ["flash_attention_forward_split_f16_d64",
                                                               "flash_attention_forward_combine_f16"]
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, causal=True), "16 rows at 40 cores")


def test_a_long_cache(ctx):
    # 131072 keys (128K), one head of width 64: 8 chunks of 16384 keys on the nominal GPU.
    q, k, v, _ = make_inputs(14, 1, 1, 1, 1, 131072, 64)
    out, lse = _decode(ctx, q, k, v)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse), "128K keys")
