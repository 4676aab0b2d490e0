"""The MiniLM fixture: real attention inputs of all-MiniLM-L6-v2 (``capture``) and where the package
keeps them (``DEFAULT_OUTPUT``); examples/make_minilm_fixture.py writes them."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from .minilm import MiniLM, numpy_attention
from .minilm_texts import SAMPLE_TEXTS

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "data" / "minilm_attention.npz"

# (index into SAMPLE_TEXTS, tokens, layers). Layer 0 has the widest score range (logits from about
# -50 to 70 at 250 tokens: the case that overflows a naive float16 softmax); layer 5 the flattest
# attention; layer 4 the sharpest rows in the middle of the stack. Lengths are odd or straddle
# block boundaries (65 = 64 + 1) on purpose. The mix keeps the file near 1 MB.
CAPTURES = (
    (1, 9, (0, 5)),
    (2, 37, (4,)),
    (4, 65, (2,)),
    (5, 250, (0,)),
)

DOUT_NOTE = (
    "dout is not the model's gradient (the encoder runs without autograd): for case NAME it is "
    "numpy.random.default_rng(zlib.crc32(NAME.encode())).standard_normal(q.shape) rounded to "
    "float16, i.e. a seeded N(0, 1) draw that is reproducible from the case name alone."
)

SOURCE_NOTE = (
    "q, k, v are the per-head query, key and value projections (1, 12, L, 32), rounded to float16, "
    "that sentence-transformers/all-MiniLM-L6-v2 computes in layer N of its BERT encoder for one "
    "unpadded English text truncated to L tokens (case name layerN_lenL); the model uses "
    "softmax_scale = 1/sqrt(32), no mask. Made by examples/make_minilm_fixture.py."
)


def case_dout(name: str, shape: tuple) -> np.ndarray:
    """The seeded N(0, 1) output gradient for case ``name``, float16 (see DOUT_NOTE)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.standard_normal(shape).astype(np.float16)


def capture(model: MiniLM) -> dict:
    """Arrays for the npz: ``cases`` and, per case, ``<name>_q/_k/_v/_dout`` in float16."""
    arrays: dict = {}
    names = []
    for text_index, tokens, layers in CAPTURES:
        ids = model.tokenize(SAMPLE_TEXTS[text_index], max_tokens=tokens)
        if ids.size != tokens:
            raise ValueError(f"sample text {text_index} has {ids.size} tokens, fewer than {tokens}")
        captured = {}

        def observe(layer, q, k, v, out, captured=captured):
            captured[layer] = (q, k, v)

        model.embed(ids, numpy_attention, observe)
        for layer in layers:
            name = f"layer{layer}_len{tokens}"
            q, k, v = (a.astype(np.float16) for a in captured[layer])
            if not all(np.isfinite(a).all() for a in (q, k, v)):
                raise ValueError(f"{name}: float16 rounding overflowed")
            arrays[f"{name}_q"], arrays[f"{name}_k"], arrays[f"{name}_v"] = q, k, v
            arrays[f"{name}_dout"] = case_dout(name, q.shape)
            names.append(name)
    arrays["cases"] = np.array(names)
    arrays["dout_note"] = np.array(DOUT_NOTE)
    arrays["source_note"] = np.array(SOURCE_NOTE)
    return arrays
