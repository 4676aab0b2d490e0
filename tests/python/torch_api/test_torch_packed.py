"""FlashAttention's packed entry points (flash_attention_metal.torch: flash_attn_qkvpacked_func,
flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func) on CPU
tensors: out, lse and the packed gradient bit for bit those of the unpacked calls on contiguous
copies (dropout included, the same torch.manual_seed), within the library's rule against the
float64 reference, and their shape errors naming the packed argument. A few seconds."""

from __future__ import annotations

import numpy as np
import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)

from flash_attention_metal import torch as fat  # noqa: E402
from torch_oracles import assert_rule  # noqa: E402

LENGTHS = [7, 0, 19, 1, 12]
# name: options common to the packed and unpacked calls
OPTIONS = {
    "causal, alibi, return_attn_probs": dict(causal=True, alibi_slopes="heads", return_attn_probs=True),
    "window, softcap, scale": dict(window_size=(5, 3), softcap=3.0, softmax_scale=0.2),
    "dropout": dict(dropout_p=0.25, causal=True),
}


def _options(name: str, heads: int) -> dict:
    options = dict(OPTIONS[name])
    if options.get("alibi_slopes") == "heads":
        options["alibi_slopes"] = torch.rand(heads, generator=torch.Generator().manual_seed(9))
    return options


def _run(function, packed: dict, rest: tuple, options: dict, dout, seed: int = 0):
    """(outputs, gradients of the leaves in ``packed`` in order): one call under torch.manual_seed."""
    torch.manual_seed(seed)
    result = function(*packed.values(), *rest, **options)
    out = result[0] if isinstance(result, tuple) else result
    grads = torch.autograd.grad((out.float() * dout).sum(), list(packed.values()))
    return (result if isinstance(result, tuple) else (result,)), grads


def _assert_identical(packed_run, unpacked_run):
    for ours, theirs in zip(packed_run[0], unpacked_run[0]):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    for ours, theirs in zip(packed_run[1], unpacked_run[1]):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_dense_packed_equal_unpacked_and_meet_the_rule(case, dtype):
    batch, seqlen_q, seqlen_k, heads, kv_heads, dim = 2, 29, 37, 4, 2, 32
    g = torch.Generator().manual_seed(len(case))
    qkv = torch.randn(batch, seqlen_q, 3, heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, seqlen_q, heads, dim, generator=g).to(dtype)
    kv = torch.randn(batch, seqlen_k, 2, kv_heads, dim, generator=g).to(dtype)
    dout = torch.randn(batch, seqlen_q, heads, dim, generator=g)
    options = _options(case, heads)

    # qkvpacked: the gradient of qkv is the stack of dq, dk and dv of the unpacked call.
    packed = _run(fat.flash_attn_qkvpacked_func, {"qkv": _leaf(qkv)}, (), options, dout)
    assert packed[1][0].shape == qkv.shape
    unpacked = _run(fat.flash_attn_func, {n: _leaf(t.contiguous()) for n, t in zip("qkv", qkv.unbind(2))}, (),
                    options, dout)
    _assert_identical((packed[0], packed[1][0].unbind(2)), unpacked)
    if case != "dropout":  # the dropout tests judge dropout against the reference with its mask
        _assert_rule(packed[0][0], packed[1][0].unbind(2), qkv.unbind(2), dout, options)

    # kvpacked (GQA): gradients of q and of kv.
    packed = _run(fat.flash_attn_kvpacked_func, {"q": _leaf(q), "kv": _leaf(kv)}, (), options, dout)
    assert packed[1][1].shape == kv.shape
    unpacked = _run(fat.flash_attn_func, {n: _leaf(t.contiguous()) for n, t in zip("qkv", (q, *kv.unbind(2)))}, (),
                    options, dout)
    _assert_identical((packed[0], (packed[1][0], *packed[1][1].unbind(2))), unpacked)
    if case != "dropout":
        _assert_rule(packed[0][0], (packed[1][0], *packed[1][1].unbind(2)), (q, *kv.unbind(2)), dout, options)


def _assert_rule(out, grads, inputs, dout, options):
    bhsd = lambda t: t.detach().transpose(1, 2)  # noqa: E731
    slopes = options.get("alibi_slopes")
    assert_rule({"out": bhsd(out), **{name: bhsd(g) for name, g in zip(("dq", "dk", "dv"), grads)}},
                *(bhsd(t) for t in inputs), bhsd(dout.to(out.dtype)), causal=options.get("causal", False),
                window_size=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
                softmax_scale=options.get("softmax_scale"), alibi_slopes=None if slopes is None else slopes.numpy())


@pytest.mark.parametrize("case", ["window, softcap, scale", "dropout"])
def test_varlen_packed_equal_unpacked_and_meet_the_rule(case):
    dtype, heads, kv_heads, dim = torch.float16, 4, 2, 32
    total = sum(LENGTHS)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(total, 3, heads, dim, generator=g).to(dtype)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    kv = torch.randn(total, 2, kv_heads, dim, generator=g).to(dtype)
    dout = torch.randn(total, heads, dim, generator=g)
    options = _options(case, heads)
    sizes = (cu, cu, max(LENGTHS), max(LENGTHS))

    packed = _run(fat.flash_attn_varlen_qkvpacked_func, {"qkv": _leaf(qkv)}, (cu, max(LENGTHS)), options, dout)
    assert packed[1][0].shape == qkv.shape
    unpacked = _run(fat.flash_attn_varlen_func, {n: _leaf(t.contiguous()) for n, t in zip("qkv", qkv.unbind(1))},
                    sizes, options, dout)
    _assert_identical((packed[0], packed[1][0].unbind(1)), unpacked)

    packed_kv = _run(fat.flash_attn_varlen_kvpacked_func, {"q": _leaf(q), "kv": _leaf(kv)}, sizes, options, dout)
    assert packed_kv[1][1].shape == kv.shape
    unpacked = _run(fat.flash_attn_varlen_func,
                    {n: _leaf(t.contiguous()) for n, t in zip("qkv", (q, *kv.unbind(1)))}, sizes, options, dout)
    _assert_identical((packed_kv[0], (packed_kv[1][0], *packed_kv[1][1].unbind(1))), unpacked)
    if case == "dropout":
        return
    for out, grads, inputs in ((packed[0][0], packed[1][0].unbind(1), qkv.unbind(1)),
                               (packed_kv[0][0], (packed_kv[1][0], *packed_kv[1][1].unbind(1)), (q, *kv.unbind(1)))):
        for b, n in enumerate(LENGTHS):
            if n:
                rows = slice(int(cu[b]), int(cu[b + 1]))
                _assert_rule(out[rows][None], [t[rows][None] for t in grads], [t[rows][None] for t in inputs],
                             dout[rows][None], options)


def test_shape_errors_name_the_packed_argument():
    half = dict(dtype=torch.float16)
    q = torch.zeros(2, 8, 4, 16, **half)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cases = [
        (ValueError, r"qkv must have shape \(batch_size, seqlen, 3, nheads, headdim\)",
         lambda: fat.flash_attn_qkvpacked_func(torch.zeros(2, 8, 2, 4, 16, **half))),
        (ValueError, r"qkv must have shape", lambda: fat.flash_attn_qkvpacked_func(q)),
        (ValueError, r"qkv has an empty dimension", lambda: fat.flash_attn_qkvpacked_func(torch.zeros(2, 0, 3, 4, 16,
                                                                                                        **half))),
        (TypeError, r"qkv must have dtype",
         lambda: fat.flash_attn_qkvpacked_func(torch.zeros(2, 8, 3, 4, 16, dtype=torch.float64))),
        (TypeError, r"qkv must be a torch.Tensor", lambda: fat.flash_attn_qkvpacked_func(np.zeros((2, 8, 3, 4, 16)))),
        (ValueError, r"kv must have shape \(batch_size, seqlen_k, 2, nheads_k, headdim\)",
         lambda: fat.flash_attn_kvpacked_func(q, torch.zeros(2, 8, 3, 2, 16, **half))),
        (ValueError, r"kv's batch_size 3 must be q's 2",
         lambda: fat.flash_attn_kvpacked_func(q, torch.zeros(3, 8, 2, 2, 16, **half))),
        (ValueError, r"kv's headdim 32 must be q's 16",
         lambda: fat.flash_attn_kvpacked_func(q, torch.zeros(2, 8, 2, 2, 32, **half))),
        (ValueError, r"qkv must have shape \(total, 3, nheads, headdim\)",
         lambda: fat.flash_attn_varlen_qkvpacked_func(q, cu, 8)),
        (TypeError, r"cu_seqlens must be an int32 tensor",
         lambda: fat.flash_attn_varlen_qkvpacked_func(torch.zeros(8, 3, 4, 16, **half), cu.long(), 8)),
        (ValueError, r"kv must have shape \(total_k, 2, nheads_k, headdim\)",
         lambda: fat.flash_attn_varlen_kvpacked_func(q[0], torch.zeros(8, 2, 16, **half), cu, cu, 8, 8)),
        (ValueError, r"kv's headdim 8 must be q's 16",
         lambda: fat.flash_attn_varlen_kvpacked_func(q[0], torch.zeros(8, 2, 4, 8, **half), cu, cu, 8, 8)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
