"""The rules the library enforces and Python does not repeat (head_dim at most the dtype's largest,
num_heads a multiple of num_kv_heads, dropout_p in [0, 1)): through the NumPy front ends (dense,
varlen, KV cache, merge; PyTorch's and MLX's are in their folders) the library's message reaches the
caller as ``errors.ArgumentError``, a ValueError and a FlashAttentionError, naming the argument and
the rule, and nothing is written: not the outputs given, not a KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import _abi, _validation
from flash_attention_metal.errors import ArgumentError

from conftest import make_inputs

_SENTINEL = 7.0

# name -> (make_inputs' sizes after the seed, its keyword arguments, the call's options, the
# library's message). Shapes are tiny: the library refuses them before any kernel runs.
RULES = {
    "head_dim": ((1, 1, 1, 2, 3, 577), {}, {}, r"head_dim \(577\) must be at most fa_max_head_dim\(\) \(576\)"),
    "head_dim_v": ((1, 1, 1, 2, 3, 8), dict(head_dim_v=577), {},
                   r"head_dim_v \(577\) must be at most fa_max_head_dim\(\) \(576\)"),
    "float32 head_dim": ((1, 1, 1, 2, 3, 264), dict(dtype=np.float32), {},
                         r"head_dim \(264\) and head_dim_v \(264\) with dtype float32 must be at most 256"),
    "heads": ((1, 3, 2, 2, 3, 8), {}, {}, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    "dropout_p": ((1, 2, 1, 2, 3, 8), {}, dict(dropout_p=1.0, dropout_seed=1),
                  r"dropout_p \(1\.0\) must be at least 0 and below 1"),
}


def _refused(call, rule: str) -> ArgumentError:
    with pytest.raises(ArgumentError, match=rule) as caught:
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, fam.FlashAttentionError)
    assert caught.value.status_name in ("FA_STATUS_INVALID_ARGUMENT", "FA_STATUS_UNSUPPORTED")
    return caught.value


@pytest.mark.parametrize("rule", RULES)
def test_dense_calls_are_refused_and_leave_given_outputs_unwritten(ctx, rule):
    sizes, kwargs, options, message = RULES[rule]
    q, k, v, dout = make_inputs(0, *sizes, **kwargs)
    out, lse = np.full(dout.shape, _SENTINEL, dout.dtype), np.full(q.shape[:3], _SENTINEL, np.float32)
    grads = [np.full(a.shape, _SENTINEL, a.dtype) for a in (q, k, v)]
    _refused(lambda: ctx.forward(q, k, v, out=out, lse=lse, **options), message)
    _refused(lambda: fam.forward(q, k, v, **options), message)
    _refused(lambda: ctx.backward(dout, q, k, v, dout, lse, dq=grads[0], dk=grads[1], dv=grads[2], **options),
             message)
    for array in (out, lse, *grads):
        assert np.all(array == _SENTINEL), "a refused call wrote into a given output"


def test_the_heads_are_read_in_the_layouts_order(ctx):
    # (B, L, H, D): 4 query heads over 3 KV heads in "bshd"; the same arrays read as "bhsd" have 5
    # query heads over 6 KV heads.
    q, k, v, _ = make_inputs(0, 2, 4, 2, 5, 6, 8, layout="bshd")
    k3, v3 = k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2)
    _refused(lambda: ctx.forward(q, k3, v3, layout="bshd"), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)")
    _refused(lambda: ctx.forward(q, k, v), r"num_heads \(5\) must be a multiple of num_kv_heads \(6\)")


@pytest.mark.parametrize("rows", [5, 0], ids=["sequences", "every sequence empty"])
@pytest.mark.parametrize("rule", ["head_dim", "heads", "dropout_p"])
def test_varlen_calls_are_refused(ctx, rule, rows):
    # An empty batch makes no kernel call, and is refused as a full one is (_abi.check_sizes).
    (_, heads, kv_heads, _, _, head_dim), _, options, message = RULES[rule]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((rows, heads, head_dim)).astype(np.float16)
    k = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float16)
    cu, longest = np.array([0, rows], dtype=np.int32), max(rows, 1)
    _refused(lambda: ctx.forward_varlen(q, k, k, cu, cu, longest, longest, **options), message)
    _refused(lambda: fam.forward_varlen(q, k, k, cu, cu, longest, longest, **options), message)
    out, lse = np.zeros_like(q), np.zeros((heads, rows), np.float32)
    _refused(lambda: ctx.backward_varlen(q, q, k, k, out, lse, cu, cu, longest, longest, **options), message)


@pytest.mark.parametrize("rule", ["head_dim", "heads"])
def test_kv_cache_calls_are_refused_before_the_append(ctx, rule):
    (_, heads, kv_heads, _, _, head_dim), _, _, message = RULES[rule]
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, heads, head_dim)).astype(np.float16)
    k_cache = rng.standard_normal((2, 6, kv_heads, head_dim)).astype(np.float16)
    v_cache = k_cache.copy()
    new = np.full((2, 1, kv_heads, head_dim), _SENTINEL, np.float16)
    before = k_cache.copy(), v_cache.copy()
    _refused(lambda: fam.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3, context=ctx),
             message)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1]), "a refused call appended"


def test_merge_is_refused(ctx):
    out = np.zeros((2, 577), dtype=np.float16)
    lse = np.zeros(2, dtype=np.float32)
    _refused(lambda: ctx.merge_attention(out, lse, out, lse), RULES["head_dim"][3])
    _refused(lambda: fam.merge_attention(out, lse, out, lse), RULES["head_dim"][3])


def test_check_sizes_asks_the_library(ctx):
    # What ring attention asks before its first exchange, and an empty varlen batch before it returns.
    shape = _validation.Shape(1, 3, 2, 0, 0, 8)
    _refused(lambda: _abi.check_sizes(ctx._native, shape, False, 0.5, np.float16), RULES["heads"][3])
    _abi.check_sizes(ctx._native, _validation.Shape(1, 4, 2, 0, 0, 8), True, 0.5, np.float16)
