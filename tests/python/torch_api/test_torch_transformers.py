"""The library registered as a Hugging Face transformers attention implementation: a small Llama
(GQA, random weights, no download) and a small Gemma 2 (softcap, sliding window) give, with
``attn_implementation=fam_transformers.NAME``, the logits and gradients of transformers' own SDPA
attention, with and without padding.

Cost: about 2 s of ./build.sh test's pytest (measured on 2 shared cores; importing PyTorch and
transformers is not counted).
"""

from __future__ import annotations

import pytest

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")

from flash_attention_metal.torch import transformers as fam_transformers  # noqa: E402


def _llama():
    return transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _gemma2():
    return transformers.Gemma2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=64, sliding_window=8, attn_logit_softcapping=0.5,
                                     query_pre_attn_scalar=16)


def _logits_and_grads(model, tokens, mask):
    """Logits and the parameters' gradients of a loss over the positions that are not padding (a
    padded query's row sees no key: ours and SDPA give it 0, eager attention an average)."""
    model.zero_grad()
    logits = model(input_ids=tokens, attention_mask=mask).logits
    weights = torch.ones(tokens.shape) if mask is None else mask.float()
    (logits.square().mean(-1) * weights).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("config, reference", [(_llama, "sdpa"), (_gemma2, "eager")], ids=["llama", "gemma2"])
def test_registered_attention_matches_transformers(config, reference):
    """Llama against transformers' SDPA; Gemma 2 (softcap, which transformers' SDPA refuses)
    against its eager attention."""
    fam_transformers.register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=fam_transformers.NAME)
    theirs = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=reference)
    theirs.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 101, (2, 21))
    padding = torch.ones(2, 21, dtype=torch.long)
    padding[1, :6] = 0  # left padding of the second sequence
    for mask in (None, padding):
        mine, my_grads = _logits_and_grads(ours, tokens, mask)
        expected, grads = _logits_and_grads(theirs, tokens, mask)
        rows = slice(None) if mask is None else mask.bool()
        torch.testing.assert_close(mine[rows], expected[rows], rtol=1e-4, atol=1e-4)
        for a, b in zip(my_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
