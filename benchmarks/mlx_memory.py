"""Peak memory of one MLX training step: flash_attention_metal's fused backward against MLX's own
attention, whose gradient is unfused (it keeps the seqlen x seqlen scores of every head).

The model is the tiny transformer of examples/mlx_train_tiny.py (flash_attention_metal.models.tiny_mlx) (2 layers, 4 query heads, 2 KV
heads, head_dim 16, causal; attention in float16, the rest float32), batch 1; one step is
``nn.value_and_grad`` plus an Adam update, evaluated. Each (attention, seqlen) runs in a fresh
process that first makes one warm-up step at seqlen 64 (library, kernels, optimizer state), then
measures:

- peak RSS growth: the peak resident set size during the step minus the size just before it
  (``bench --compare``'s measurement, ``flash_attention_metal.cli._peak_memory``: on Linux
  VmHWM, reset after glibc's free memory is returned; on macOS ru_maxrss). It counts everything:
  MLX's arrays, the library's own scratch memory, NumPy. This is the number that matters on Linux,
  where MLX's CPU arrays are host memory.
- MLX peak: ``mx.get_peak_memory()`` minus ``mx.get_active_memory()`` before the step, MLX's
  buffer cache emptied first (``mx.clear_cache()``). It counts MLX's allocations only, which include
  the library's outputs (MLX allocates them) but not its scratch memory. On a Mac this is the
  figure to read for GPU memory (MLX's Metal buffers).

A third row, the floor, runs the same step with a stand-in for attention that costs no memory of
its own (it returns v, repeated over the query heads): the memory of the rest of the model. On
the pure-Python fallback (no MLX extension) the library's row sits above the floor for a reason of
its own: it evaluates q, k, v in the forward and
dout in the vjp while MLX traces the step, and MLX keeps every array it evaluated during a
transformation (with its graph) until the step's graph is released, where its single lazy
evaluation would free intermediates as it goes. That overhead is linear in seqlen; MLX's own
attention gradient is quadratic.

    python benchmarks/mlx_memory.py                      # seqlens 1024 2048 4096 (library: minutes on the CPU engine)
    python benchmarks/mlx_memory.py --seqlens 4096 --backend cpu
    python benchmarks/mlx_memory.py --seqlens 4096 8192 --compile   # the step inside mx.compile (native path)

With ``--compile`` every row's step (value_and_grad and Adam's update) runs inside ``mx.compile``,
which needs the library's native path (the MLX extension; the fallback refuses mx.compile). The
measured step is the first at its seqlen, so it includes MLX's trace and compile of that shape.

Figures from the CPU engine or MLX's CPU backend are not Apple GPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from flash_attention_metal.cli._peak_memory import measured_step, method

_MIB = 1 << 20
IMPLEMENTATIONS = ("mlx", "library", "floor")


def child(implementation: str, seqlen: int, compiled: bool = False) -> dict:
    """One measured training step in this process; returns the figures."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from flash_attention_metal.models import tiny_mlx as tiny

    if implementation == "library":
        from flash_attention_metal.mlx import scaled_dot_product_attention as attention
    elif implementation == "mlx":
        attention = mx.fast.scaled_dot_product_attention
    else:
        def attention(q, k, v, *, scale, mask):
            return mx.repeat(v, q.shape[1] // v.shape[1], axis=1)
    mx.random.seed(0)
    model = tiny.TinyTransformer(attention, attention_dtype=mx.float16)
    optimizer = optim.Adam(learning_rate=1e-3)
    step = (tiny.make_compiled_step if compiled else tiny.make_step)(model, optimizer)
    step(next(tiny.batches(1, 1, 64, 16, seed=1)))  # warm-up
    tokens = next(tiny.batches(1, 1, seqlen, 16))
    mx.eval(tokens)
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    result = measured_step(step, tokens)
    result["mlx_peak"] = mx.get_peak_memory() - active
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--backend", choices=("auto", "metal", "cpu"), default=None,
                        help="the library's backend (default: $FLASH_ATTENTION_METAL_BACKEND or auto)")
    parser.add_argument("--compile", action="store_true", help="run each step inside mx.compile")
    parser.add_argument("--child", nargs=3, metavar=("IMPLEMENTATION", "SEQLEN", "COMPILED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2] == "1")))
        return 0
    env = dict(os.environ)
    if args.backend:
        env["FLASH_ATTENTION_METAL_BACKEND"] = args.backend
    import mlx.core as mx

    import flash_attention_metal as fam

    context = fam.Context(args.backend or fam.default_backend())
    print(f"one training step of the tiny transformer (2 layers, 4 heads, 2 KV heads, head_dim 16, causal, "
          f"float16 attention), batch 1{', compiled step' if args.compile else ''}; MLX {mx.__version__} on {mx.default_device()}, library on "
          f"{context.backend} ({context.device}); {method()}")
    print(f"{'seqlen':>6} {'attention':<34} {'peak RSS growth':>16} {'MLX peak':>12} {'step s':>8} {'loss':>8}")
    for seqlen in args.seqlens:
        scores = 2 * 4 * seqlen * seqlen * 4  # layers x heads x L^2 float32
        rows = {}
        for implementation in IMPLEMENTATIONS:
            run = subprocess.run([sys.executable, __file__, "--child", implementation, str(seqlen), str(int(args.compile))],
                                 capture_output=True, text=True, env=env)
            if run.returncode != 0:
                print(run.stderr, file=sys.stderr)
                return 1
            rows[implementation] = json.loads(run.stdout.strip().splitlines()[-1])
        for implementation, label in (("mlx", "MLX mx.fast sdpa (unfused backward)"),
                                      ("library", "flash_attention_metal.mlx (fused)"),
                                      ("floor", "floor: stand-in, no attention")):
            r = rows[implementation]
            print(f"{seqlen:6d} {label:<34} {r['rss_growth'] / _MIB:12.1f} MiB {r['mlx_peak'] / _MIB:8.1f} MiB "
                  f"{r['seconds']:8.2f} {r['loss']:8.4f}")
        ratio = rows["mlx"]["rss_growth"] / max(rows["library"]["rss_growth"], 1)
        print(f"{'':6} MLX / library peak RSS growth: {ratio:.1f}x; the float32 scores of all layers and heads "
              f"would take {scores / _MIB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
