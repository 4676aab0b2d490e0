"""What the kernels execute, counted by the CPU engine (issue 10's structure targets): the
simdgroup_matrix products per FLOP of attention, the work the causal mask saves, the backward's
share, the split-KV decode grid, and the padding of head dims that are not a multiple of 8.

1024 x (8x8x8 products) / (4 B H Nq Nk D) is 1 when no product is wasted (an 8x8x8 product is 1024
FLOPs; attention's forward is 4 B H Nq Nk D)."""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam

from conftest import make_inputs


def _mma_ratio(profile, b, h, nq, nk, d) -> float:
    total = sum(dispatch.simdgroup_multiply_accumulates for dispatch in profile.dispatches)
    return 1024 * total / (4 * b * h * nq * nk * d)


@pytest.fixture(scope="module")
def cpu() -> fam.Context:
    return fam.Context("cpu")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_products_per_flop(cpu, head_dim):
    n = 256
    q, k, v, dout = make_inputs(40, 1, 2, 2, n, n, head_dim)
    out, lse = cpu.forward(q, k, v)
    dense = _mma_ratio(cpu.last_profile, 1, 2, n, n, head_dim)
    assert 0.95 <= dense <= 1.35
    cpu.backward(dout, q, k, v, out, lse)
    assert _mma_ratio(cpu.last_profile, 1, 2, n, n, head_dim) <= 3.75 * dense
    out, lse = cpu.forward(q, k, v, causal=True)
    assert _mma_ratio(cpu.last_profile, 1, 2, n, n, head_dim) <= 0.6 * dense
    cpu.backward(dout, q, k, v, out, lse, causal=True)
    assert _mma_ratio(cpu.last_profile, 1, 2, n, n, head_dim) <= 0.6 * 3.75 * dense


@pytest.mark.parametrize("head_dim, padded", [(40, 40), (100, 104), (3, 8)])
def test_head_dim_padding_is_only_to_a_multiple_of_8(cpu, head_dim, padded):
    q, k, v, _ = make_inputs(41, 1, 1, 1, 64, 64, head_dim)
    cpu.forward(q, k, v)
    assert _mma_ratio(cpu.last_profile, 1, 1, 64, 64, head_dim) == pytest.approx(padded / head_dim)


def test_decode_grid_packs_the_gqa_group_and_splits_the_keys(cpu):
    q, k, v, _ = make_inputs(42, 1, 8, 2, 1, 4096, 64)
    cpu.forward(q, k, v)
    decode, combine = cpu.last_profile.dispatches
    assert decode.kernel == "flash_attention_forward_decode_f16_d64"
    chunks, kv_heads, batch = decode.threadgroups
    # Two waves of 7 threadgroups per core on the nominal 10 cores want 70 chunks per KV head
    # pair; 4096 keys allow 64 of at least 64 keys.
    assert (kv_heads, batch) == (2, 1) and chunks == 64
    assert combine.threadgroups == (1, 8, 1)
    # No matrix products, one barrier per threadgroup (the merge after the key loop).
    assert decode.simdgroup_multiply_accumulates == 0 and decode.threadgroup_barriers == chunks * kv_heads


def test_simdgroups_without_rows_multiply_nothing(cpu):
    # 16 rows, 2 query heads per KV head: 32 packed rows, one tiled split block per chunk; each
    # SIMD-group's 8 rows hold rows, so the products are exactly those of the rows.
    q, k, v, _ = make_inputs(43, 1, 4, 2, 16, 4096, 64)
    cpu.forward(q, k, v)
    assert cpu.last_profile.dispatches[0].kernel == "flash_attention_forward_split_f16_d64"
    assert _mma_ratio(cpu.last_profile, 1, 4, 16, 4096, 64) == pytest.approx(1.0)
    # A dense block of 33 rows: the second threadgroup's SIMD-groups 1-3 hold no row.
    q, k, v, _ = make_inputs(44, 1, 1, 1, 33, 64, 64)
    cpu.forward(q, k, v)
    assert _mma_ratio(cpu.last_profile, 1, 1, 40, 64, 64) == pytest.approx(1.0)


def test_a_sliding_window_multiplies_only_the_tiles_it_shows(cpu):
    # Mistral's layout: 4096 tokens, causal, each query sees itself and the 512 keys before it. The
    # keys seen are (513 * 4096 - 512 * 513 / 2) / 4096^2 = 0.1237 of the dense matrix; tiles the
    # window hides entirely are neither loaded nor multiplied, so the products stay near that share
    # (the band's edge tiles add a little) in the forward and in the backward.
    n, head_dim = 4096, 64
    q, k, v, dout = make_inputs(45, 1, 1, 1, n, n, head_dim)
    out, lse = cpu.forward(q, k, v, causal=True, window_size=(512, 0))
    assert 0.12 <= _mma_ratio(cpu.last_profile, 1, 1, n, n, head_dim) <= 0.135
    cpu.backward(dout, q, k, v, out, lse, causal=True, window_size=(512, 0))
    assert _mma_ratio(cpu.last_profile, 1, 1, n, n, head_dim) <= 0.135 * 3.75


def test_the_lse_residual_pass_recomputes_only_blocks_with_a_huge_lse(cpu):
    # Rows 70 and 71 (in the third 32-row block of head 1) are masked with float32's minimum: only
    # that block redoes Q K^T (no V), once over the 96 keys; every other block reads its lse only.
    n, d = 96, 64
    q, k, v, dout = make_inputs(43, 1, 2, 2, n, n, d)
    mask = np.zeros((1, 2, n, n), np.float32)
    mask[0, 1, 70:72] = np.finfo(np.float32).min
    out, lse = cpu.forward(q, k, v)
    cpu.backward(dout, q, k, v, out, lse)
    residual = [x for x in cpu.last_profile.dispatches if x.kernel.startswith("flash_attention_backward_lse_residual")]
    assert len(residual) == 1 and residual[0].simdgroup_multiply_accumulates == 0
    out, lse = cpu.forward(q, k, v, attn_mask=mask)
    cpu.backward(dout, q, k, v, out, lse, attn_mask=mask)
    residual = [x for x in cpu.last_profile.dispatches if x.kernel.startswith("flash_attention_backward_lse_residual")]
    assert residual[0].simdgroup_multiply_accumulates * 512 == 32 * n * d
