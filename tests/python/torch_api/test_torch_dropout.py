"""Dropout through the PyTorch front end (CPU tensors, the CPU engine): the seed and offset drawn from
the default generator (``torch.manual_seed`` reproduces them) and saved for the backward; forward and
backward against the float64 reference with the same mask (the accuracy rule); return_attn_probs's
(out, softmax_lse, S_dmask) at dropout 0 and above; scaled_dot_product_attention and
flash_attn_varlen_func with dropout.
"""

from __future__ import annotations

import numpy as np
import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)

from flash_attention_metal import accuracy, dropout, philox, reference  # noqa: E402
from flash_attention_metal import torch as fat  # noqa: E402
from flash_attention_metal.torch._tensors import as_numpy  # noqa: E402

from conftest import assert_within_rule  # noqa: E402

P = 0.3


def _drawn(seed: int) -> tuple[int, int]:
    """The (seed, offset) the front end draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return tuple(torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64).tolist())


def _inputs(dtype=torch.float16, batch=2, seqlen_q=33, seqlen_k=41, heads=4, kv_heads=2, head_dim=64):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g).to(dtype)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, generator=g).to(dtype)
    return q, k, v, dout


def _bhsd(t: torch.Tensor) -> np.ndarray:
    return as_numpy(t.detach().transpose(1, 2).contiguous())


def test_manual_seed_reproduces_and_the_backward_uses_the_saved_seed():
    q, k, v, dout = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(123)
    out = fat.flash_attn_func(q, k, v, dropout_p=P, causal=True)
    # Draws between forward and backward do not change the mask the backward regenerates.
    torch.rand(1000)
    out.backward(dout)
    seed, offset = _drawn(123)
    mask = dropout.reference_mask((P, seed, offset), 2, 4, 33, 41)
    qb, kb, vb, doutb = (_bhsd(t) for t in (q, k, v, dout))
    assert_within_rule(accuracy.evaluate_forward(qb, kb, vb, _bhsd(out), None, causal=True, dropout_mask=mask),
                       "forward")
    grads = [_bhsd(t.grad) for t in (q, k, v)]
    assert_within_rule(accuracy.evaluate_backward(doutb, qb, kb, vb, *grads, causal=True, dropout_mask=mask),
                       "backward")
    torch.manual_seed(123)
    again = fat.flash_attn_func(q, k, v, dropout_p=P, causal=True)
    assert torch.equal(again, out)
    assert not torch.equal(fat.flash_attn_func(q, k, v, dropout_p=P, causal=True), out)


def test_return_attn_probs_without_dropout_gives_lse_and_the_placeholder():
    q, k, v, _ = _inputs(torch.float32)
    out, lse, s_dmask = fat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, fat.flash_attn_func(q, k, v, causal=True))
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32 and not lse.requires_grad
    _, ref_lse = reference.forward(_bhsd(q), _bhsd(k), _bhsd(v), causal=True)
    assert np.abs(lse.numpy() - ref_lse).max() <= 1e-4 * max(1.0, np.abs(ref_lse).max())


def test_s_dmask_definition():
    """S_dmask = exp(score - row max over visible keys), negated where dropped, 0 where masked."""
    q, k, v, _ = _inputs(torch.float32, seqlen_q=24, seqlen_k=24)
    torch.manual_seed(5)
    out, lse, s_dmask = fat.flash_attn_func(q, k, v, dropout_p=P, causal=True, return_attn_probs=True)
    seed, offset = _drawn(5)
    assert s_dmask.shape == (2, 4, 24, 24) and s_dmask.dtype == q.dtype
    keep = philox.dropout_keep(P, seed, offset, 2, 4, 24, 24)
    visible = reference.visible_keys(24, 24, True)
    values = s_dmask.numpy()
    assert np.all(values[:, :, ~visible] == 0)
    assert np.all((values < 0) == (visible & ~keep))
    scale = 64 ** -0.5
    scores = scale * (_bhsd(q).astype(np.float64) @ np.swapaxes(np.repeat(_bhsd(k), 2, axis=1), -1, -2))
    scores = np.where(visible, scores, -np.inf)
    expected = np.where(visible, np.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    assert np.abs(np.abs(values) - expected).max() < 1e-6
    # The row sums of |S_dmask| give lse back: lse = max + log(sum exp(s - max)).
    row_max = scores.max(axis=-1)
    assert np.abs(row_max + np.log(np.abs(values).sum(axis=-1)) - lse.numpy()).max() < 1e-4


def test_sdpa_dropout_is_the_drawn_mask():
    q, k, v, _ = _inputs(torch.float32)
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))
    torch.manual_seed(9)
    out = fat.scaled_dot_product_attention(query, key, value, dropout_p=P, enable_gqa=True)
    seed, offset = _drawn(9)
    mask = dropout.reference_mask((P, seed, offset), 2, 4, 33, 41)
    qb, kb, vb = (_bhsd(t) for t in (q, k, v))
    assert_within_rule(accuracy.evaluate_forward(qb, kb, vb, as_numpy(out), None, dropout_mask=mask), "sdpa")


def test_varlen_dropout_reproduces_and_matches_the_reference():
    lengths = [7, 0, 19]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(int(cu[-1]), 2, 32, generator=g, dtype=torch.float32).requires_grad_() for _ in range(3))
    torch.manual_seed(11)
    out = fat.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, dropout_p=P, causal=True)
    seed, offset = _drawn(11)
    masks = [philox.dropout_multiplier(P, philox.dropout_keep(P, seed, offset, 1, 2, n, n, batch_index=[b]))
             for b, n in enumerate(lengths)]
    qn, kn, vn = (t.detach().numpy() for t in (q, k, v))
    ref, _ = reference.forward_varlen(qn, kn, vn, cu.numpy(), cu.numpy(), causal=True, dropout_masks=masks)
    assert np.abs(out.detach().numpy() - ref).max() < 1e-5
    out.sum().backward()
    refs = reference.backward_varlen(np.ones_like(ref), qn, kn, vn, cu.numpy(), cu.numpy(), causal=True,
                                     dropout_masks=masks)
    for t, r in zip((q, k, v), refs):
        assert np.abs(t.grad.numpy() - r).max() < 1e-4
    out0, lse, placeholder = fat.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, return_attn_probs=True)
    assert lse.shape == (2, int(cu[-1])) and placeholder.shape == (0,)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        fat.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, dropout_p=P, return_attn_probs=True)


@pytest.mark.parametrize("bad, error", [(1.0, ValueError), (-0.5, ValueError), (True, TypeError)])
def test_dropout_p_errors_name_it(bad, error):
    q, k, v, _ = _inputs()
    with pytest.raises(error, match="dropout_p"):
        fat.flash_attn_func(q, k, v, dropout_p=bad)
