"""``flash_attention_metal.torch`` on CPU tensors: ``scaled_dot_product_attention`` (PyTorch's
semantics: top-left ``is_causal``, bool and additive masks, GQA, broadcasting, 3-D inputs) and
``flash_attn_func`` (FlashAttention's: bottom-right causal, window, softcap, ALiBi), every dtype,
outputs and gradients judged twice (``torch_oracles``: the float64 reference under the accuracy
rule, and PyTorch's own attention as an external oracle); real MiniLM and SmolLM2 attention inputs;
inputs read in place; the custom operators through ``torch.library.opcheck``; the errors.

Cost: about 10 s of ./build.sh test's pytest (measured on 2 shared cores; importing PyTorch is not counted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)
import torch.nn.functional as F  # noqa: E402

from flash_attention_metal import torch as fat  # noqa: E402
from flash_attention_metal.torch import _host, _ops, _tensors  # noqa: E402
from torch_oracles import assert_like_pytorch, assert_rule, to_numpy  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
_DATA = Path(fat.__file__).resolve().parents[1] / "data"


def _normal(generator, shape, dtype, bshd=False):
    """N(0, 1) values; with ``bshd`` a (B, H, S, D) view of (B, S, H, D) memory."""
    if bshd:
        b, h, s, d = shape
        return torch.randn((b, s, h, d), generator=generator).to(dtype).transpose(1, 2)
    return torch.randn(shape, generator=generator).to(dtype)


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def _gradients(out, dout, inputs: dict) -> dict:
    grads = torch.autograd.grad((out * dout).sum(), list(inputs.values()))
    return {"out": out, **dict(zip(inputs, grads))}


# name: batch, query heads, kv heads, seqlen_q, seqlen_k, head_dim, head_dim_v, is_causal, mask, enable_gqa
SDPA_CASES = {
    "gqa": (2, 4, 2, 33, 47, 32, 32, False, None, True),
    "causal square": (2, 4, 2, 40, 40, 32, 32, True, None, True),
    "causal more keys (top-left)": (1, 4, 4, 17, 45, 64, 64, True, None, False),
    "causal more queries, one kv head broadcast": (2, 2, 1, 45, 17, 32, 32, True, None, False),
    "bool padding mask": (2, 4, 2, 30, 41, 32, 32, False, "padding", True),
    "additive mask, head_dim_v 16": (2, 4, 4, 29, 37, 32, 16, False, "additive", False),
    "bool mask and is_causal": (1, 2, 2, 23, 31, 32, 32, True, "random", False),
}


def _sdpa_mask(kind, generator, batch, seqlen_q, seqlen_k):
    """The attn_mask of a case (PyTorch's conventions) and its (B, 1, S, S) bool or additive form."""
    if kind == "padding":
        lengths = torch.tensor([seqlen_k, seqlen_k // 3])[:batch]
        return (torch.arange(seqlen_k) < lengths[:, None])[:, None, None, :]
    if kind == "additive":
        # Multiples of 1/4 and -inf: exact in every dtype, so no oracle rounds the mask.
        values = torch.randint(-16, 1, (seqlen_q, seqlen_k), generator=generator).float() / 4
        return values.masked_fill(torch.rand((seqlen_q, seqlen_k), generator=generator) < 0.2, float("-inf"))
    if kind == "random":
        return torch.rand((seqlen_q, seqlen_k), generator=generator) < 0.7
    return None


def _reference_mask(mask, is_causal, seqlen_q, seqlen_k):
    """The same visibility as one NumPy attn_mask for the float64 reference (bool, or additive
    float32), with PyTorch's top-left causal mask folded in."""
    tril = np.tril(np.ones((seqlen_q, seqlen_k), dtype=bool))
    if mask is None:
        return tril if is_causal else None
    array = to_numpy(mask)
    if array.dtype == bool:
        return array & tril if is_causal else array
    return np.where(tril, array, -np.inf).astype(np.float32) if is_causal else array.astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_sdpa_against_the_reference_and_pytorch(case, dtype):
    batch, hq, hk, seqlen_q, seqlen_k, head_dim, head_dim_v, is_causal, kind, gqa = SDPA_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = _normal(g, (batch, hq, seqlen_q, head_dim), dtype, bshd=True)
    k = _normal(g, (batch, hk, seqlen_k, head_dim), dtype, bshd=True)
    v = _normal(g, (batch, hk, seqlen_k, head_dim_v), dtype)
    dout = _normal(g, (batch, hq, seqlen_q, head_dim_v), dtype)
    mask = _sdpa_mask(kind, g, batch, seqlen_q, seqlen_k)
    q, k, v = _leaves(q, k, v)
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
    ours = _gradients(out, dout, {"query": q, "key": k, "value": v})
    assert out.dtype == dtype and out.shape == (batch, hq, seqlen_q, head_dim_v)
    assert_rule({"out": out, "dq": ours["query"], "dk": ours["key"], "dv": ours["value"]}, q.detach(), k.detach(),
                v.detach(), dout, attn_mask=_reference_mask(mask, is_causal, seqlen_q, seqlen_k))
    inputs = {"query": q, "key": k, "value": v}
    assert_like_pytorch(ours, lambda **t: F.scaled_dot_product_attention(
        **t, attn_mask=mask if mask is None or mask.dtype == torch.bool else mask.to(t["query"].dtype),
        is_causal=is_causal, enable_gqa=gqa), inputs, dout, dtype)


def test_sdpa_three_dimensional_inputs_and_broadcast_batch():
    """(N, L, E) inputs, and a query of batch 1 against keys of batch 3 (PyTorch broadcasts it)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (_normal(g, shape, torch.float32) for shape in ((3, 11, 16), (3, 13, 16), (3, 13, 8)))
    mask = torch.rand((11, 13), generator=g) < 0.8
    ours = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.shape == (3, 11, 8)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=2e-6)
    q1 = _normal(g, (1, 2, 11, 16), torch.float32)
    k3, v3 = (_normal(g, (3, 2, 13, 16), torch.float32) for _ in range(2))
    ours = fat.scaled_dot_product_attention(q1, k3, v3, is_causal=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q1, k3, v3, is_causal=True), rtol=0, atol=2e-6)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    """As PyTorch (its math backend's safe softmax): a row whose mask is all False gives 0."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _leaves(*(_normal(g, (1, 2, 6, 16), torch.float16) for _ in range(3)))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dq, = torch.autograd.grad(out.float().sum(), [q])
    assert not out[:, :, 2].any() and not dq[:, :, 2].any()
    assert out[:, :, 1].any() and dq[:, :, 1].any()
    assert not F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, 2].any()


# name: batch, heads, kv heads, seqlen_q, seqlen_k, head_dim, causal, window, softcap, alibi
FLASH_CASES = {
    "causal, more keys (bottom-right)": (2, 4, 2, 19, 45, 64, True, (-1, -1), 0.0, None),
    "causal, more queries": (1, 4, 1, 45, 19, 32, True, (-1, -1), 0.0, None),
    "window": (2, 2, 2, 40, 40, 32, False, (7, 3), 0.0, None),
    "softcap": (2, 4, 2, 33, 37, 32, True, (-1, -1), 5.0, None),
    "alibi per head": (2, 4, 4, 30, 30, 32, True, (-1, -1), 0.0, "heads"),
    "alibi per batch, window": (2, 4, 2, 25, 41, 32, False, (9, 0), 0.0, "batch"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FLASH_CASES, ids=str)
def test_flash_attn_func_against_the_reference(case, dtype):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window, softcap, alibi = FLASH_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    # FlashAttention's layout: (batch, seqlen, heads, head_dim).
    q, k, v = _leaves(*(torch.randn(shape, generator=g).to(dtype) for shape in
                        ((batch, seqlen_q, heads, head_dim), (batch, seqlen_k, kv_heads, head_dim),
                         (batch, seqlen_k, kv_heads, head_dim))))
    dout = torch.randn((batch, seqlen_q, heads, head_dim), generator=g).to(dtype)
    slopes = None if alibi is None else torch.rand((heads,) if alibi == "heads" else (batch, heads), generator=g)
    out = fat.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert out.shape == (batch, seqlen_q, heads, head_dim) and out.is_contiguous()
    grads = _gradients(out, dout, {"dq": q, "dk": k, "dv": v})
    bhsd = {name: t.transpose(1, 2) for name, t in grads.items()}
    assert_rule(bhsd, *(t.detach().transpose(1, 2) for t in (q, k, v)), dout.transpose(1, 2), causal=causal,
                window_size=window, softcap=softcap, alibi_slopes=None if slopes is None else slopes.numpy())
    if window == (-1, -1) and softcap == 0 and slopes is None:
        # PyTorch has no bottom-right causal flag in sdpa: the same mask, explicit.
        lower_right = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
        assert_like_pytorch(
            {"out": out.transpose(1, 2), **{name: bhsd["d" + name[0]] for name in ("query", "key", "value")}},
            lambda **t: F.scaled_dot_product_attention(**t, attn_mask=lower_right, enable_gqa=True),
            {name: x.detach().transpose(1, 2).requires_grad_()
             for name, x in zip(("query", "key", "value"), (q, k, v))},
            dout.transpose(1, 2), dtype)


def _fixture(name: str, case: str):
    data = np.load(_DATA / f"{name}_attention.npz")
    return [torch.from_numpy(data[f"{case}_{part}"]) for part in ("q", "k", "v")]


@pytest.mark.parametrize("name, case, causal", [("minilm", "layer2_len65", False),
                                                ("smollm2", "prefill_layer14_len40", True)])
def test_real_attention_inputs(name, case, causal):
    """MiniLM's encoder attention (12 heads, head_dim 32) and SmolLM2's causal GQA prefill (9 query
    heads over 3 KV heads, head_dim 64), float16, through the SDPA drop-in."""
    q, k, v = _leaves(*_fixture(name, case))
    dout = torch.randn(q.shape[:3] + (v.shape[3],), generator=torch.Generator().manual_seed(5)).half()
    out = fat.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ours = _gradients(out, dout, {"query": q, "key": k, "value": v})
    assert_rule({"out": out, "dq": ours["query"], "dk": ours["key"], "dv": ours["value"]}, q.detach(), k.detach(),
                v.detach(), dout, causal=causal)
    assert_like_pytorch(ours, lambda **t: F.scaled_dot_product_attention(**t, is_causal=causal, enable_gqa=True),
                        {"query": q, "key": k, "value": v}, dout, torch.float16)


def test_inputs_are_read_in_place_and_others_copied_once():
    """Views whose last axis is contiguous (slices of a packed QKV projection) reach the library as
    they are; a strided last axis or an expanded (stride 0) tensor is copied."""
    qkv = torch.randn(2, 7, 3, 4, 16, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    _, _, call = _tensors.forward_call(_host.context()._native, q, k, v, None, None, 0.25, False, None, 0.0, True,
                                       torch.Tensor.data_ptr)
    assert [call.tensors[name].data_ptr() for name in "qkv"] == [t.data_ptr() for t in (q, k, v)]
    strided = torch.randn(2, 4, 7, 32, dtype=torch.bfloat16)[..., ::2]
    expanded = torch.randn(2, 1, 7, 16, dtype=torch.bfloat16).expand(2, 4, 7, 16)
    _, _, call = _tensors.forward_call(_host.context()._native, strided, expanded, v, None, None, 0.25, False, None,
                                       0.0, True, torch.Tensor.data_ptr)
    assert call.tensors["q"].is_contiguous() and call.tensors["q"].data_ptr() != strided.data_ptr()
    assert call.tensors["k"].data_ptr() != expanded.data_ptr()


def test_no_numpy_round_trip(monkeypatch):
    """bfloat16 has no NumPy dtype: the CPU path hands data_ptr() to the library, never .numpy()."""
    def refuse(*_):
        raise AssertionError("Tensor.numpy() was called")

    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    out = fat.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def _op_samples():
    g = torch.Generator().manual_seed(6)
    q = _normal(g, (2, 4, 9, 16), torch.float16)
    k, v = (_normal(g, (2, 2, 13, 16), torch.float16) for _ in range(2))
    mask = (torch.rand(9, 13, generator=g) < 0.8).expand(2, 4, 9, 13)
    slopes = torch.rand(4, generator=g)
    qb, kb, vb = (_normal(g, t.shape, torch.bfloat16, bshd=True) for t in (q, k, v))
    qf = _normal(g, (1, 2, 5, 40), torch.float32)
    kf, vf = _normal(g, (1, 2, 70, 40), torch.float32), _normal(g, (1, 2, 70, 24), torch.float32)
    return [(q, k, v, None, None, 0.25, True, -1, -1, 0.0, False, 0.0, 0, 0),
            (qb, kb, vb, mask, slopes, 0.3, False, 5, 2, 4.0, True, 0.0, 0, 0),
            (qf, kf, vf, torch.rand(5, 70, generator=g).expand(1, 2, 5, 70), None, 0.2, True, -1, -1, 0.0, False,
             0.25, 2**62 + 5, 17)]


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(sample):
    """The operators' schemas, fake implementations (FakeTensor strides equal the real ones),
    autograd registration and AOT dispatch (static and dynamic shapes): torch.library.opcheck."""
    args = _op_samples()[sample]
    args = tuple(t.requires_grad_() if i < 3 else t for i, t in enumerate(args))
    torch.library.opcheck(_ops.forward, args)
    out, lse = _ops.forward(*args)
    dout = torch.randn_like(out)
    torch.library.opcheck(_ops.backward, (dout, *(t.detach() for t in args[:3]), out.detach(), lse, *args[3:]))


def _small():
    return [torch.randn(1, 2, 5, 8, dtype=torch.float16) for _ in range(3)]


@pytest.mark.parametrize("call, error, rule", [
    (lambda q, k, v: fat.flash_attn_func(q, k, v, dropout_p=1.0), ValueError,
     r"dropout_p \(1\.0\) must be at least 0 and below 1"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, return_attn_probs=1), TypeError, "return_attn_probs must be a bool"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, deterministic=None), TypeError, "deterministic must be a bool"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, dropout_p=-0.5), ValueError, "dropout_p"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k.float(), v), TypeError, "key must have query's dtype"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q.double(), k, v), TypeError, "query must have dtype float16"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k.to("meta"), v), ValueError, "key is on meta"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k[..., :4], v), ValueError, "embedding size"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q.expand(1, 2, 5, 8).repeat(1, 2, 1, 1), k, v),
     ValueError, "enable_gqa=True"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q.repeat(1, 3, 1, 1), k.repeat(1, 2, 1, 1),
                                                      v.repeat(1, 2, 1, 1), enable_gqa=True),
     ValueError, r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.bool)),
     ValueError, "not broadcastable"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.int32)),
     TypeError, "attn_mask must be a bool tensor"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(5, 5, requires_grad=True)),
     NotImplementedError, "attn_mask requires grad"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((5, 5), float("nan"))),
     ValueError, "attn_mask holds NaN"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, scale=float("inf")), ValueError, "scale must be finite"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, is_causal=1), TypeError, "causal must be a bool"),
    (lambda q, k, v: fat.flash_attn_func(q[:, :0], k, v), ValueError, "empty dimension"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, window_size=(-2, 0)), ValueError, "window_size"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes shape"),
    (lambda q, k, v: fat.flash_attn_func(q, k, v, alibi_slopes=torch.ones(1, 2).half()), TypeError, "float32"),
    (lambda q, k, v: fat.flash_attn_func(q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1)),
     ValueError, r"num_heads \(5\) must be a multiple of num_kv_heads \(3\)"),
    (lambda q, k, v: fat.scaled_dot_product_attention(*(torch.zeros(1, 1, 2, 600, dtype=torch.float16),) * 3),
     ValueError, r"head_dim \(600\) must be at most fa_max_head_dim\(\) \(576\)"),
])
def test_errors_name_the_argument_and_the_rule(call, error, rule):
    with pytest.raises(error, match=rule):
        call(*_small())
