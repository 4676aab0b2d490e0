"""Peak memory of one PyTorch training step: flash_attention_metal's fused backward against
PyTorch's math backward, ``sdpa_kernel(SDPBackend.MATH)``, which is what PyTorch runs for
``scaled_dot_product_attention`` on MPS (it keeps the seqlen x seqlen attention weights of every
head for the backward), side by side in one run on the CPU.

The model is the tiny transformer of examples/torch_train_tiny.py (flash_attention_metal.models.tiny_torch) (2 layers, 4 query heads, 2 KV
heads, head_dim 16, causal, float32), batch 1; one step is the next-token loss, its backward and an
AdamW update. Each (attention, seqlen) runs in a fresh process that first makes one warm-up step at
seqlen 64 (the library, PyTorch's kernels, the optimizer state), then measures the peak RSS growth
of the step: the peak resident set size during it minus the size just before it
(``flash_attention_metal.cli._peak_memory``: Linux VmHWM reset after glibc's free memory is
returned; ru_maxrss on macOS). It counts everything: PyTorch's tensors and the library's scratch
memory. Rows:

- math: PyTorch's math backend (the MPS path's backward), the reference of this comparison;
- library: ``flash_attention_metal.torch.scaled_dot_product_attention`` on the CPU engine;
- default: PyTorch's default CPU choice, its own fused CPU flash kernel (there is none on MPS);
- floor: a stand-in for attention that costs no memory of its own (v repeated over the query
  heads): the memory of the rest of the model.

    python benchmarks/torch_memory.py                    # seqlen 4096 (the library: minutes on the CPU engine)
    python benchmarks/torch_memory.py --seqlens 1024 4096

The children run with OMP_WAIT_POLICY=PASSIVE, so that PyTorch's idle OpenMP threads do not spin
against the CPU engine's workers. Figures from the CPU are not Apple GPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from flash_attention_metal.cli._peak_memory import measured_step, method


_MIB = 1 << 20
ROWS = (("math", "PyTorch math backward (SDPBackend.MATH, as on MPS)"),
        ("library", "flash_attention_metal.torch (fused)"),
        ("default", "PyTorch default CPU sdpa (fused CPU kernel)"),
        ("floor", "floor: stand-in, no attention"))


def child(implementation: str, seqlen: int) -> dict:
    """One measured training step in this process; returns the figures."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_attention_metal.models import tiny_torch as tiny

    backend = contextlib.nullcontext
    if implementation == "library":
        from flash_attention_metal.torch import scaled_dot_product_attention as attention
    elif implementation in ("math", "default"):
        attention = F.scaled_dot_product_attention
        if implementation == "math":
            backend = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
    else:
        def attention(q, k, v, is_causal, enable_gqa):
            return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    torch.manual_seed(0)
    model = tiny.TinyLM(attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)

    def step(tokens):
        with backend():
            loss = tiny.next_token_loss(model, tokens)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        return loss.item()

    step(tiny.sequences(data, 1, 65))  # warm-up
    tokens = tiny.sequences(data, 1, seqlen + 1)
    return measured_step(step, tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    parser.add_argument("--child", nargs=2, metavar=("IMPLEMENTATION", "SEQLEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return 0
    import torch

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    print(f"one training step of the tiny transformer (2 layers, 4 heads, 2 KV heads, head_dim 16, causal, "
          f"float32), batch 1; PyTorch {torch.__version__} on the CPU, the library on its CPU engine; {method()}")
    print(f"{'seqlen':>6} {'attention':<52} {'peak RSS growth':>16} {'step s':>8} {'loss':>8}")
    for seqlen in args.seqlens:
        weights = 2 * 4 * seqlen * seqlen * 4  # layers x heads x L^2 float32
        rows = {}
        for implementation, label in ROWS:
            run = subprocess.run([sys.executable, __file__, "--child", implementation, str(seqlen)],
                                 capture_output=True, text=True, env=env)
            if run.returncode != 0:
                print(run.stderr, file=sys.stderr)
                return 1
            r = rows[implementation] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{seqlen:6d} {label:<52} {r['rss_growth'] / _MIB:12.1f} MiB {r['seconds']:8.2f} {r['loss']:8.4f}",
                  flush=True)
        ratio = rows["math"]["rss_growth"] / max(rows["library"]["rss_growth"], 1)
        print(f"{'':6} math / library peak RSS growth: {ratio:.1f}x; the float32 attention weights of all layers "
              f"and heads take {weights / _MIB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
