"""The tiny transformer of examples/mlx_train_tiny.py in MLX, its data and its training steps.

The model: token embedding, 2 pre-norm blocks (RMSNorm, attention with RoPE and grouped-query heads,
a SiLU MLP), a final RMSNorm and an output projection; parameters and every operation in float32
except attention, which gets q, k, v in the dtype asked for. The data: fresh batches from a fixed
random Markov chain over 16 tokens (a "bigram language"). The attention function is the caller's.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; ``attention`` has MLX's sdpa signature."""

    def __init__(self, attention, dims: int, heads: int, kv_heads: int, attention_dtype=mx.float16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dims // heads
        self.attention, self.attention_dtype = attention, attention_dtype
        self.q_proj = nn.Linear(dims, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dims, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dims, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dims, bias=False)
        self.rope = nn.RoPE(self.head_dim)

    def __call__(self, x: mx.array) -> mx.array:
        batch, seqlen, _ = x.shape

        def split(projection, heads):  # (B, L, heads * D) -> (B, heads, L, D)
            return projection(x).reshape(batch, seqlen, heads, self.head_dim).transpose(0, 2, 1, 3)

        q = self.rope(split(self.q_proj, self.heads))
        k = self.rope(split(self.k_proj, self.kv_heads))
        v = split(self.v_proj, self.kv_heads)
        dtype = self.attention_dtype
        out = self.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), scale=self.head_dim ** -0.5,
                             mask="causal").astype(x.dtype)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, seqlen, -1))


class Block(nn.Module):
    def __init__(self, attention, dims: int, heads: int, kv_heads: int, attention_dtype):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dims)
        self.attention = Attention(attention, dims, heads, kv_heads, attention_dtype)
        self.mlp_norm = nn.RMSNorm(dims)
        self.up = nn.Linear(dims, 4 * dims, bias=False)
        self.down = nn.Linear(4 * dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attention(self.attention_norm(x))
        return x + self.down(nn.silu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """A decoder-only transformer: ``layers`` blocks, ``heads`` query and ``kv_heads`` KV heads."""

    def __init__(self, attention, vocab: int = 16, dims: int = 64, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2, attention_dtype=mx.float16):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dims)
        self.blocks = [Block(attention, dims, heads, kv_heads, attention_dtype) for _ in range(layers)]
        self.norm = nn.RMSNorm(dims)
        self.output = nn.Linear(dims, vocab, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    return tree_flatten(model.parameters())


def loss_fn(model: nn.Module, tokens: mx.array) -> mx.array:
    """Mean next-token cross-entropy."""
    return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], reduction="mean")


def make_step(model: nn.Module, optimizer: optim.Optimizer):
    """One training step (``nn.value_and_grad``, the optimizer's update, evaluated): tokens -> loss."""
    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step(tokens: mx.array) -> float:
        loss, grads = value_and_grad(model, tokens)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        return loss.item()

    return step


def make_compiled_step(model: nn.Module, optimizer: optim.Optimizer):
    """make_step's step with value_and_grad and the update inside ``mx.compile`` (model and optimizer
    state as the compiled function's implicit inputs and outputs). The attention must be traceable:
    MLX's, or flash_attention_metal.mlx's native path."""
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def update(tokens):
        loss, grads = value_and_grad(model, tokens)
        optimizer.update(model, grads)
        return loss

    def step(tokens: mx.array) -> float:
        loss = update(tokens)
        mx.eval(state, loss)
        return loss.item()

    return step


def batches(steps: int, batch: int, seqlen: int, vocab: int, seed: int = 0):
    """``steps`` batches of (batch, seqlen + 1) tokens from one random Markov chain (transition rows
    drawn from a Dirichlet(0.2) distribution: a few likely successors per token)."""
    rng = np.random.default_rng(seed)
    cumulative = np.cumsum(rng.dirichlet(np.full(vocab, 0.2), size=vocab), axis=1)
    for _ in range(steps):
        tokens = np.empty((batch, seqlen + 1), dtype=np.int32)
        tokens[:, 0] = rng.integers(0, vocab, size=batch)
        for i in range(1, seqlen + 1):
            draws = rng.random(batch)[:, None]
            tokens[:, i] = np.minimum((cumulative[tokens[:, i - 1]] < draws).sum(axis=1), vocab - 1)
        yield mx.array(tokens)


def train(attention, *, attention_dtype=mx.float16, steps: int = 50, seqlen: int = 32, batch: int = 8,
          vocab: int = 16, dims: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
          learning_rate: float = 3e-3, seed: int = 0) -> list[float]:
    """The loss after each of ``steps`` Adam steps, from weights and batches fixed by ``seed``."""
    mx.random.seed(seed)
    model = TinyTransformer(attention, vocab, dims, heads, kv_heads, layers, attention_dtype)
    mx.eval(model.parameters())
    step = make_step(model, optim.Adam(learning_rate=learning_rate))
    return [step(tokens) for tokens in batches(steps, batch, seqlen, vocab, seed)]
