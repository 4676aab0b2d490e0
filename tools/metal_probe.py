"""Is there a Metal device that runs the kernels? The macOS workflow's probe: creates a Metal
context (an Apple-silicon GPU, the library compiled or loaded), builds the pipelines of one tiny
causal forward, runs it, and holds its result and the CPU engine's to the accuracy rule against the
float64 reference (docs/accuracy.md), printing the largest difference between the two.

Exit status: 0 the Metal backend works; 2 no Metal device here can run the kernels (hosted runners
are VMs of GPU family Apple5); 1 it ran and failed the rule, or another error.
"""

from __future__ import annotations

import sys

import numpy as np

import flash_attention_metal as fam
from flash_attention_metal import accuracy


def main() -> int:
    try:
        metal = fam.Context("metal")
    except fam.FlashAttentionError as error:
        if error.status_name != "FA_STATUS_BACKEND_UNAVAILABLE":
            raise
        print(f"no Metal device runs the kernels here: {error}")
        return 2
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 32)).astype(np.float16) for _ in range(3))
    results = {context.device: context.forward(q, k, v, causal=True) for context in (metal, fam.Context("cpu"))}
    passed = True
    for device, (out, lse) in results.items():
        metrics = accuracy.evaluate_forward(q, k, v, out, lse, causal=True)
        passed = passed and all(metric.passed for metric in metrics)
        print(f"{device}: {accuracy.describe(metrics)}")
    (metal_out, _), (cpu_out, _) = results.values()
    difference = np.abs(metal_out.astype(np.float32) - cpu_out.astype(np.float32)).max()
    print(f"max |Metal - CPU engine| of out: {difference:.3g}; {metal.note}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
