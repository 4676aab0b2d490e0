"""Train a tiny causal transformer in PyTorch with flash_attention_metal's fused attention, next to
PyTorch's own ``scaled_dot_product_attention``, and compare the losses.

The model: token embedding, pre-norm blocks (LayerNorm, grouped-query causal self-attention whose q,
k and v are read in place from strided views of the projections, a GELU MLP), a final LayerNorm and
a linear head, all float32. The data: arithmetic sequences modulo the vocabulary (random start,
step 1 to 3), so the next token follows from earlier ones and attention has something to learn.
Both runs start from the same weights and see the same batches; the script prints both loss curves
and their largest relative distance.

    pip install -e "python[torch]"
    python examples/torch_train_tiny.py          # --steps 30 --seqlen 64

CPU tensors run on the library's CPU engine; on a Mac pass ``--device mps`` for the GPU.
The model is ``flash_attention_metal.models.tiny_torch``, which ``benchmarks/torch_memory.py`` and
the tests use too.
"""

from __future__ import annotations

import argparse
import sys

import torch.nn.functional as F

from flash_attention_metal.models.tiny_torch import train
from flash_attention_metal.torch import scaled_dot_product_attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=("cpu", "mps"))
    args = parser.parse_args(argv)
    ours = train(scaled_dot_product_attention, steps=args.steps, seqlen=args.seqlen, device=args.device)
    theirs = train(F.scaled_dot_product_attention, steps=args.steps, seqlen=args.seqlen, device=args.device)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        print(f"step {step:3d}  flash_attention_metal {a:.6f}  pytorch {b:.6f}")
    distance = max(abs(a - b) / b for a, b in zip(ours, theirs))
    print(f"largest relative distance between the curves: {distance:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
