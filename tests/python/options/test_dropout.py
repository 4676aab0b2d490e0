"""Attention dropout (FlashAttention's semantics) on the CPU engine: the Philox-4x32-10 generator
against Random123's known answers, in NumPy and in the C header the kernels include; the mask's
statistics; the kernels' mask bits equal to the NumPy twin's across head-dim buckets, dtypes, row
blocks and passes; forward and backward against the float64 reference that applies the same mask
(the accuracy rule); determinism; the PyTorch front end's seed handling and return_attn_probs; the
errors naming dropout_p.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import accuracy, dropout, philox, reference

from conftest import assert_within_rule, make_inputs

REPO = Path(__file__).resolve().parents[3]

# Random123 (D. E. Shaw Research), tests/kat_vectors, the "philox4x32 10" lines: counter (4 words),
# key (2 words), expected output (4 words).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]

# The overall false-alarm probability of the statistical tests: each splits it over its bounds.
FALSE_ALARM = 1e-6


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox.philox4x32_10(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
    assert [int(x) for x in out] == list(expected)


def test_c_header_matches_the_numpy_twin(tmp_path):
    """Shaders/flash_attention_philox.h compiled as C: the known answers and a block of dropout words
    of the mapping, equal to philox.py's."""
    compiler = shutil.which("clang") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "philox.c"
    kat_lines = "\n".join(
        f"    {{FaPhiloxBlock c = {{{', '.join(f'{x}u' for x in counter)}}};"
        f" FaPhiloxBlock o = fa_philox4x32_10(c, {key[0]}u, {key[1]}u);"
        ' printf("%u %u %u %u\\n", o.x0, o.x1, o.x2, o.x3);}'
        for counter, key, _ in KAT)
    source.write_text(f"""#include <stdio.h>
#include "flash_attention_params.h"
#include "flash_attention_philox.h"
int main(void) {{
{kat_lines}
    for (unsigned row = 0; row < 3; ++row)
        for (unsigned key = 0; key < 9; ++key) {{
            FaPhiloxBlock w = fa_dropout_words(0xfedcba9876543210ull, 0xfffffffffffffffeull, 7u, row, key / 4);
            printf("%u\\n", fa_philox_word(w, key % 4));
        }}
    return 0;
}}
""")
    binary = tmp_path / "philox"
    subprocess.run([compiler, "-std=c99", "-Dinline=static inline", f"-I{REPO / 'Shaders'}", str(source), "-o",
                    str(binary)], check=True)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")
    for line, (_, _, expected) in zip(lines, KAT):
        assert [int(x) for x in line.split()] == list(expected)
    words = philox.dropout_words(0xfedcba9876543210, 0xfffffffffffffffe, 7, np.arange(3)[:, None],
                                 np.arange(9)[None, :])
    assert [int(x) for x in lines[len(KAT):len(KAT) + 27]] == [int(x) for x in words.ravel()]


def test_threshold_and_scale():
    assert philox.dropout_threshold(0.0) == 0
    assert philox.dropout_threshold(0.5) == 2**31
    assert philox.dropout_threshold(np.nextafter(np.float32(1), np.float32(0))) == 2**32 - 2**8
    assert philox.dropout_scale(0.5) == np.float32(2.0)


def _hoeffding(n: int, bounds: int) -> float:
    """t with P(|Binomial(n, .) - mean| >= t) <= FALSE_ALARM / bounds (Hoeffding: 2 exp(-2 t^2 / n))."""
    return math.sqrt(n / 2 * math.log(2 * bounds / FALSE_ALARM))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(p):
    """Per row (2048 keys) and over all rows, the kept count lies within Hoeffding bounds of
    n (1 - threshold / 2^32), with overall false-alarm probability FALSE_ALARM (rows and total share
    it); a mask off by 1 % of p overall, or one row off by 10 %, fails."""
    batch, heads, rows, keys = 2, 4, 64, 2048
    keep = philox.dropout_keep(p, seed=1234, offset=99, batch=batch, num_heads=heads, seqlen_q=rows, seqlen_k=keys)
    rate = 1 - philox.dropout_threshold(p) / 2**32
    bounds = batch * heads * rows + 1
    per_row = keep.sum(axis=-1)
    assert np.abs(per_row - keys * rate).max() <= _hoeffding(keys, bounds)
    assert abs(keep.sum() - keep.size * rate) <= _hoeffding(keep.size, bounds)


def _one_hot_forward(ctx, p, seed, offset, *, batch=2, heads=3, seqlen_q=40, seqlen_k=24, head_dim_v=None,
                     dtype=np.float32, causal=False, window_size=(-1, -1)):
    """The kernels' keep bits of a forward: q = 0 (uniform P over the visible keys) and v the
    identity over keys (head_dim_v >= seqlen_k, zero columns after), so out[i, j] = P_ij Z_ij."""
    head_dim_v = seqlen_k if head_dim_v is None else head_dim_v
    q = np.zeros((batch, heads, seqlen_q, 16), dtype=dtype)
    k = np.zeros((batch, heads, seqlen_k, 16), dtype=dtype)
    v = np.zeros((batch, heads, seqlen_k, head_dim_v), dtype=dtype)
    v[:, :, np.arange(seqlen_k), np.arange(seqlen_k)] = 1
    out, _ = ctx.forward(q, k, v, causal=causal, window_size=window_size, dropout_p=p, dropout_seed=seed,
                         dropout_offset=offset)
    return out[..., :seqlen_k].astype(np.float64) != 0


@pytest.mark.parametrize("head_dim_v, dtype", [(24, np.float32), (64, np.float16), (200, np.float16),
                                               (128, np.float32)])
def test_forward_mask_bits_equal_the_twin_in_every_bucket(ctx, head_dim_v, dtype):
    """Head-dim buckets 32 ... 256 (other tiles, key-tile widths 32, 16, 8) and dtypes draw the same
    bits, the NumPy twin's."""
    p, seed, offset = 0.3, 2**64 - 5, 2**40 + 3
    bits = _one_hot_forward(ctx, p, seed, offset, head_dim_v=head_dim_v, dtype=dtype)
    assert np.array_equal(bits, philox.dropout_keep(p, seed, offset, 2, 3, 40, 24))


def test_forward_mask_bits_independent_of_row_blocks_and_causal_tiles(ctx):
    """The first 8 rows of 40 (one row block of 32 and a partial one) are the same bits as a call of
    8 rows; causal masks only hide keys (bottom-right aligned)."""
    full = _one_hot_forward(ctx, 0.5, 7, 0, seqlen_q=40)
    assert np.array_equal(_one_hot_forward(ctx, 0.5, 7, 0, seqlen_q=8), full[:, :, :8])
    causal = _one_hot_forward(ctx, 0.5, 7, 0, seqlen_q=24, causal=True)
    visible = reference.visible_keys(24, 24, True)
    assert np.array_equal(causal, full[:, :, :24] & visible)
    # A window whose tiles start at odd keys (a lane's key pair then straddles two Philox calls).
    windowed = _one_hot_forward(ctx, 0.5, 7, 0, seqlen_q=40, window_size=(13, 2))
    assert np.array_equal(windowed, full & reference.visible_keys(40, 24, False, (13, 2)))


def test_backward_mask_bits_equal_the_twin(ctx):
    """dK/dV's bits: with q = 0 and dout the identity over query rows, dv[j, i] = P_ij Z_ij."""
    batch, heads, seqlen_q, seqlen_k = 1, 2, 24, 40
    p, seed, offset = 0.25, 11, 5
    q = np.zeros((batch, heads, seqlen_q, 16), dtype=np.float32)
    k = np.zeros((batch, heads, seqlen_k, 16), dtype=np.float32)
    v = np.ones((batch, heads, seqlen_k, 32), dtype=np.float32)
    dout = np.zeros((batch, heads, seqlen_q, 32), dtype=np.float32)
    dout[:, :, np.arange(seqlen_q), np.arange(seqlen_q)] = 1
    options = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    out, lse = ctx.forward(q, k, v, **options)
    _, _, dv = ctx.backward(dout, q, k, v, out, lse, **options)
    bits = np.swapaxes(dv[..., :seqlen_q], -1, -2) != 0
    assert np.array_equal(bits, philox.dropout_keep(p, seed, offset, batch, heads, seqlen_q, seqlen_k))


def test_deterministic_and_seed_dependent(ctx):
    q, k, v, dout = make_inputs(3, 1, 2, 2, 33, 47, 64)
    options = dict(dropout_p=0.2, dropout_seed=42, dropout_offset=0)
    first = ctx.forward(q, k, v, **options)
    second = ctx.forward(q, k, v, **options)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    grads = [ctx.backward(dout, q, k, v, *first, **options) for _ in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(*grads))
    for other in (dict(options, dropout_seed=43), dict(options, dropout_offset=1)):
        assert not np.array_equal(ctx.forward(q, k, v, **other)[0], first[0])
    # lse is of the undropped scores: the same with and without dropout.
    assert np.array_equal(first[1], ctx.forward(q, k, v)[1])


CASES = [
    # (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options)
    (np.float16, 2, 4, 2, 37, 53, 64, dict(causal=True)),
    (np.float32, 1, 2, 2, 20, 70, 96, dict(window_size=(15, 3))),  # tiles from key 35 (odd)
    ("bfloat16", 1, 2, 1, 45, 45, 128, dict(softcap=30.0)),
]


@pytest.mark.parametrize("case", CASES, ids=["f16-causal-gqa", "f32-window", "bf16-softcap-mqa"])
def test_forward_backward_within_the_rule(ctx, case):
    """Forward and backward against the float64 reference with the same mask (accuracy rule)."""
    dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options = case
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    q, k, v, dout = make_inputs(5, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype=dtype)
    drop = (0.3, 2024, 17)
    call = dict(options, dropout_p=drop[0], dropout_seed=drop[1], dropout_offset=drop[2])
    out, lse = ctx.forward(q, k, v, **call)
    mask = dropout.reference_mask(drop, batch, heads, seqlen_q, seqlen_k)
    assert_within_rule(accuracy.evaluate_forward(q, k, v, out, lse, dropout_mask=mask, **options), "forward")
    grads = ctx.backward(dout, q, k, v, out, lse, **call)
    assert_within_rule(accuracy.evaluate_backward(dout, q, k, v, *grads, dropout_mask=mask, **options), "backward")
    # The rule can fail: the undropped reference is far off.
    assert not all(m.passed for m in accuracy.evaluate_forward(q, k, v, out, None, **options))


def test_varlen_masks_per_sequence(ctx):
    """Sequence b's mask is batch entry b's, rows and keys counted from the sequence's start."""
    lengths_q, lengths_k = [5, 0, 17, 9], [12, 4, 21, 9]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    heads, head_dim = 2, 32
    rng = np.random.default_rng(0)
    q = rng.standard_normal((cu_q[-1], heads, head_dim)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], heads, head_dim)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], heads, head_dim)).astype(np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    drop = dict(dropout_p=0.4, dropout_seed=9, dropout_offset=3)
    out, lse = ctx.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, **drop)
    masks = [philox.dropout_multiplier(0.4, philox.dropout_keep(0.4, 9, 3, 1, heads, nq, nk, batch_index=[b]))
             for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k))]
    ref_out, _ = reference.forward_varlen(q, k, v, cu_q, cu_k, causal=True, dropout_masks=masks)
    undropped, _ = reference.forward_varlen(q, k, v, cu_q, cu_k, causal=True)
    error = np.abs(out.astype(np.float64) - ref_out).max()
    assert error < 1e-2 < np.abs(out.astype(np.float64) - undropped).max()
    dq, dk, dv = ctx.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                     causal=True, **drop)
    refs = reference.backward_varlen(dout, q, k, v, cu_q, cu_k, causal=True, dropout_masks=masks)
    for ours, ref in zip((dq, dk, dv), refs):
        assert np.abs(ours.astype(np.float64) - ref).max() < 2e-2 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("bad, error", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                        (True, TypeError), ("0.1", TypeError)])
def test_dropout_p_errors_name_it(ctx, bad, error):
    q, k, v, _ = make_inputs(0, 1, 1, 1, 4, 4, 16)
    with pytest.raises(error, match="dropout_p"):
        ctx.forward(q, k, v, dropout_p=bad, dropout_seed=0)


def test_seed_required_and_checked(ctx):
    q, k, v, _ = make_inputs(0, 1, 1, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="dropout_seed"):
        ctx.forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_offset"):
        ctx.forward(q, k, v, dropout_p=0.1, dropout_seed=1, dropout_offset=2**64)
    # dropout_p 0 needs no seed and equals no dropout bit for bit.
    assert np.array_equal(ctx.forward(q, k, v, dropout_p=0.0)[0], ctx.forward(q, k, v)[0])


def test_c_abi_refuses_dropout_with_a_kv_cache_and_bad_p(ctx):
    native = ctx._native
    ffi, lib = native.ffi, native.lib
    problem = ffi.new("fa_problem *")
    problem.struct_size = ffi.sizeof("fa_problem")
    problem.batch = problem.num_heads = problem.num_kv_heads = 1
    problem.seqlen_q = problem.seqlen_k = problem.head_dim = 16
    problem.softmax_scale = 0.25
    problem.dropout_p = 1.5
    buffers = [ffi.new("uint16_t[]", 256) for _ in range(4)]
    lse = ffi.new("float[]", 16)
    status = lib.fa_forward(ctx._handle, problem, *buffers, lse)
    assert ffi.string(lib.fa_status_name(status)) == b"FA_STATUS_INVALID_ARGUMENT"
    assert b"dropout_p" in ffi.string(lib.fa_last_error_message())
