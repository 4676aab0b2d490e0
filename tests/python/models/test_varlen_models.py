"""Variable-length batches on a real model: a packed batch of MiniLM sentences embeds exactly as the
sentences one by one (skips without the model files). The packed SmolLM2 prefill is in
test_smollm2_model.py, which loads that model once."""

from __future__ import annotations


import numpy as np
import pytest



def pack(parts):
    """(heads, rows, dim) arrays -> the packed (total, heads, dim) float16 tensor and its table."""
    table = np.concatenate([[0], np.cumsum([p.shape[1] for p in parts])]).astype(np.int32)
    packed = np.concatenate([p.transpose(1, 0, 2) for p in parts]).astype(np.float16)
    return packed, table


def test_packed_minilm_sentences_embed_as_one_by_one(context):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from flash_attention_metal.models import minilm as minilm_model

    try:
        model = minilm_model.MiniLM.load(minilm_model.find_model_dir())
    except FileNotFoundError as error:
        pytest.skip(f"model files not installed: {error}")
    # More than 8 tokens each: a dense call of at most 8 query rows takes the split-KV forward,
    # which sums in another order (test_varlen.py).
    sentences = ["The weather is lovely today, and the park is full of people.", "It's so sunny outside!",
                 "He drove to the stadium to watch the match with his friends."]
    ids = [model.tokenize(s) for s in sentences]
    assert min(len(i) for i in ids) > 8

    def dense(q, k, v):
        return context.attention(*(x.astype(np.float16) for x in (q, k, v))).astype(np.float32)

    def packed(q, k, v, mask):
        lengths = mask[:, 0, 0, :].sum(axis=1)
        parts = [[x[b, :, :n] for b, n in enumerate(lengths)] for x in (q, k, v)]
        (pq, table), (pk, _), (pv, _) = (pack(p) for p in parts)
        out, _ = context.forward_varlen(pq, pk, pv, table, table, int(lengths.max()), int(lengths.max()))
        result = np.zeros(q.shape, dtype=np.float32)  # padding rows: never read
        for b, n in enumerate(lengths):
            result[b, :, :n] = out[table[b]:table[b + 1]].transpose(1, 0, 2)
        return result

    one_by_one = np.stack([model.embed(i, dense) for i in ids])
    np.testing.assert_array_equal(model.embed_padded(ids, packed), one_by_one)
