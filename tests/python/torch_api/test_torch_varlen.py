"""flash_attn_varlen_func (flash_attention_metal.torch) on CPU tensors: each sequence of a packed
batch against PyTorch's SDPA on that sequence alone (out and the gradients through autograd), the
library's rule against the float64 reference, opcheck of the custom operators, and the checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch_oracles import assert_like_pytorch, assert_rule  # noqa: E402

from flash_attention_metal.torch import flash_attn_varlen_func  # noqa: E402
from flash_attention_metal.torch._varlen import varlen_forward  # noqa: E402

LENGTHS = [7, 0, 19, 1, 12]


def _sdpa(q, k, v, causal):
    # (1, H, L, D) with GQA; equal query and key lengths, so top-left causal is bottom-right.
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_each_sequence_like_pytorch_sdpa(dtype):
    gen = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(LENGTHS), 4, 2, 32
    q, k, v, dout = (torch.randn(total, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu, cu, max(LENGTHS), max(LENGTHS), causal=True)
    (out * dout).sum().backward()
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        per = lambda t: t[rows].transpose(0, 1)[None]  # noqa: E731
        ours = {"out": per(out), "query": per(leaves[0].grad), "key": per(leaves[1].grad), "value": per(leaves[2].grad)}
        inputs = {"query": per(q).requires_grad_(), "key": per(k).requires_grad_(), "value": per(v).requires_grad_()}
        # One row over one key: the exact dq and dk are 0 (dP = D) and so is PyTorch's, whose bound is
        # then 0; ours, like FlashAttention's, takes D from out rounded to the dtype and leaves
        # ~1e-7. The library's rule below judges that row; PyTorch's the longer ones.
        if n > 1:
            assert_like_pytorch(ours, lambda query, key, value: _sdpa(query, key, value, True), inputs, per(dout),
                                dtype)
        assert_rule({"out": ours["out"], "dq": ours["query"], "dk": ours["key"], "dv": ours["value"]},
                    per(q), per(k), per(v), per(dout), causal=True)


def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 2, 16, generator=gen, dtype=torch.float16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args = (q, q, q, cu, cu, 5, 5, None, 0.25, True, -1, -1, 0.0, 0.5, 3, 4)
    torch.library.opcheck(varlen_forward, args)


def test_refusals():
    q = torch.zeros(4, 2, 8, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dropout_p \(1\.5\) must be at least 0 and below 1"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        flash_attn_varlen_func(torch.zeros(4, 3, 8, dtype=torch.float16), q, q, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        flash_attn_varlen_func(q, q, q, cu, torch.tensor([0, 3, 2, 4], dtype=torch.int32), 4, 4)
