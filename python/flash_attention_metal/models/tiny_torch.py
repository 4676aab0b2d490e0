"""The tiny causal transformer of examples/torch_train_tiny.py in PyTorch, and its training loop.

The model: token embedding, pre-norm blocks (LayerNorm, grouped-query causal self-attention whose q,
k and v are read in place from strided views of the projections, a GELU MLP), a final LayerNorm and
a linear head, all float32. The data: arithmetic sequences modulo the vocabulary (random start,
step 1 to 3), so the next token follows from earlier ones and attention has something to learn.
The attention function is the caller's, so one model trains with the library and with PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)); ``attention`` has PyTorch's sdpa signature."""

    def __init__(self, attention, dim=64, heads=4, kv_heads=2, head_dim=16):
        super().__init__()
        self.attention, self.heads, self.kv_heads, self.head_dim = attention, heads, kv_heads, head_dim
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * head_dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, seqlen, _ = x.shape
        h = self.norm1(x)
        # (B, L, H, D) projections viewed as (B, H, L, D): strided views, read in place.
        q = self.q(h).view(batch, seqlen, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(batch, seqlen, 2, self.kv_heads, self.head_dim).unbind(2)
        a = self.attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(batch, seqlen, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and a linear head over ``vocab`` tokens."""

    def __init__(self, attention, vocab=97, dim=64, layers=2, **block):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(attention, dim, **block) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(model, tokens):
    """Cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def sequences(generator, batch=4, length=33, vocab=97):
    """Arithmetic sequences modulo ``vocab``: random start, step 1 to 3."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start + step * torch.arange(length)) % vocab


def train(attention, *, steps=20, seqlen=32, batch=4, lr=1e-2, device="cpu", seed=1):
    """The losses of ``steps`` AdamW steps of a TinyLM with ``attention``, from the weights of
    ``seed`` and batches of data seed 2."""
    torch.manual_seed(seed)
    model = TinyLM(attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        loss = next_token_loss(model, sequences(data, batch, seqlen + 1).to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
