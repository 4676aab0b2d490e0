"""Train a tiny causal transformer in MLX with flash_attention_metal's fused attention, next to MLX's
own ``mx.fast.scaled_dot_product_attention``, and compare the loss curves.

The model: token embedding, 2 pre-norm blocks (RMSNorm, attention with RoPE and grouped-query heads,
a SiLU MLP), a final RMSNorm and an output projection; parameters and every operation in float32
except attention, which gets q, k, v in ``--dtype`` (float16 by default: mixed precision as in
training). The data: fresh batches from a fixed random Markov chain over 16 tokens (a "bigram
language"); the loss, the mean next-token cross-entropy, falls from about ln 16 towards the chain's
entropy.

Three runs from the same initial weights and batches: MLX's attention in float32 (the reference
curve), MLX's attention in ``--dtype`` (the baseline), the library's in ``--dtype``. As in the
library's accuracy rule, the library's curve passes when its largest distance to the reference is
at most twice the baseline's plus 1e-5; the exit status is 1 otherwise. The 16-bit runs differ
from the reference mostly through the rounding of q, k and v, which both share; the task is chosen
to train smoothly: on a task the model memorises (sharp attention, Adam amplifying rounding noise in
near-zero gradients), single trajectories fork at random, MLX's own float16 run included.

    pip install -e "python[mlx]"          # MLX: mlx[cpu] on Linux, mlx on Apple silicon
    python examples/mlx_train_tiny.py     # --steps 50 --seqlen 32 --dtype float16 --backend cpu|metal

The library runs on ``FLASH_ATTENTION_METAL_BACKEND`` (or ``--backend``): Metal on a Mac, the CPU
engine elsewhere. The model is ``flash_attention_metal.models.tiny_mlx``, which ``benchmarks/mlx_memory.py`` uses for
its memory measurement.
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx
import numpy as np

from flash_attention_metal.models.tiny_mlx import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seqlen", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                        help="dtype of q, k, v in attention (everything else is float32)")
    parser.add_argument("--backend", choices=("auto", "metal", "cpu"), default=None,
                        help="the library's backend (default: $FLASH_ATTENTION_METAL_BACKEND or auto)")
    args = parser.parse_args(argv)
    if args.backend:
        os.environ["FLASH_ATTENTION_METAL_BACKEND"] = args.backend

    import flash_attention_metal as fam
    from flash_attention_metal import accuracy
    from flash_attention_metal.mlx import scaled_dot_product_attention

    dtype = getattr(mx, args.dtype)
    context = fam.default_context()
    print(f"tiny transformer: 2 layers, 4 query heads, 2 KV heads, head_dim 16, seqlen {args.seqlen}, "
          f"batch {args.batch}; attention in {args.dtype}; library on {context.backend} ({context.device}); "
          f"MLX {mx.__version__} on {mx.default_device()}")
    runs = {"MLX float32": (mx.fast.scaled_dot_product_attention, mx.float32),
            f"MLX {args.dtype}": (mx.fast.scaled_dot_product_attention, dtype),
            f"library {args.dtype}": (scaled_dot_product_attention, dtype)}
    curves = {name: np.array(train(attention, attention_dtype=run_dtype, steps=args.steps, seqlen=args.seqlen,
                                   batch=args.batch))
              for name, (attention, run_dtype) in runs.items()}
    names = list(curves)
    print("step " + "".join(f"{name:>18}" for name in names))
    for t in range(args.steps):
        if t < 5 or t % 10 == 9 or t == args.steps - 1:
            print(f"{t + 1:4d} " + "".join(f"{curves[name][t]:18.6f}" for name in names))
    ref, base, ours = (curves[name] for name in names)
    error, base_error = float(np.abs(ours - ref).max()), float(np.abs(base - ref).max())
    bound = accuracy.bound("out", base_error, ref)
    passed = error <= bound
    print(f"max |library - MLX float32| = {error:.2e}; max |MLX {args.dtype} - MLX float32| = {base_error:.2e}; "
          f"bound 2 * {base_error:.2e} + atol = {bound:.2e}: {'pass' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
