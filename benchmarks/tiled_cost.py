"""The tiled split kernels over a KV cache by the issue-cycle cost model and the IR instruction mix:
per cache kind and block of packed rows, IR instructions per MMA of the key-tile loop, cycles per
key, bytes per cycle per core and the share of the modelled DRAM bandwidth (docs/decode.md, "Spec
kernel", and docs/kv-cache.md's instruction mix).

Static and modelled, not a timing; the tools are ``ir_mix.py`` and ``issue_cost.py`` (the project's
shared tools, ``--tools``; default ``../shared/tools`` from the repository root), features compiled
off (docs/specialisation.md's prelude), as compiled (no extra inlining). Each measured kernel is
``attention_forward_split`` (or the dense ``attention_forward``) with one K/V source, the loop that
the shipped KV-cache kernels run for that kind (``kv_cache_kind``, flash_attention_kv_cache.h):

    float16 contiguous   DeviceKV (the dense forward's copy)
    paged                PagedKV<T, 0> (16-byte chunks, a cursor per tile row shared by K and V
                         and handed to the passes by SIMD shuffles)
    8-bit, 4-bit         PagedKV<T, 8 or 4> (MLX's format, group 64; contiguous and paged in one loop)
    elements             CacheKV's element copy: unquantized paged caches off 16-byte boundaries

A threadgroup's four SIMD-groups share each key tile, one per scheduler of a core: a core spends
the cycles of one SIMD-group's iteration per tile of BK keys, so it reads BK x bytes per key /
cycles per iteration bytes per cycle, memory-bound from 7.5 (decode_cost.py counts the decode
kernel's, whose SIMD-groups take keys in turn, the same way per core). Cycles per key = cycles per
iteration / BK.

    python benchmarks/tiled_cost.py                      # head_dim 64, 128, 256
    python benchmarks/tiled_cost.py --head-dims 128 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import sys
import tempfile
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_cost import DRAM_BYTES_PER_CYCLE, ROOT, SHADERS, bytes_per_key, cache_kernel_parameters, prelude  # noqa: E402

KINDS = {
    # name: (source expression, the decode_cost kind whose bytes per key it reads)
    "float16": ("DeviceKV<half>{k, v}", "float16"),
    "paged": ("PagedKV<half, 0>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}", "paged"),
    "8-bit": ("PagedKV<half, 8>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}", "8-bit"),
    "4-bit": ("PagedKV<half, 4>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}", "4-bit"),
    "elements (paged, off 16 B)": ("FA_KV_CACHE_SOURCE(half)", "paged"),
}


def kernel_name(kernel: str, kind: str, dp: int) -> str:
    return f"tiled_cost_{kernel}_{kind.split()[0].replace('-', '_')}_d{dp}"


def kernel_source(kernel: str, kind: str, dp: int) -> str:
    source = KINDS[kind][0]
    rows = {"spec": "spec_block_q", "split": "forward_block_q", "dense": "forward_block_q"}[kernel]
    body = (f"attention_forward<{dp}, K::{rows}, K::forward_block_k>(q, ({source}), out, lse, mask, alibi, sinks, "
            "params, &tg, tgid, sgid, lane);" if kernel == "dense" else
            f"attention_forward_split<{dp}, K::{rows}, K::forward_block_k>(q, ({source}), mask, alibi, partial_out, "
            "partial_lse, params, &tg, tgid, sgid, lane);")
    return f"""
[[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]
kernel void {kernel_name(kernel, kind, dp)}({cache_kernel_parameters(outputs=True)}) {{
    typedef KernelTraits<half, {dp}> K;
    threadgroup ForwardStorage<half, {dp}, K::{rows}, K::forward_block_k> tg;
    {body}
}}
"""


def block_rows(dp: int) -> dict[str, int]:
    """forward_block_q, forward_block_k and spec_block_q of the half bucket dp (FA_HEAD_DIM_BUCKETS)."""
    import re
    params = (SHADERS / "flash_attention_params.h").read_text()
    row = re.search(rf"X\({dp}, (\d+), (\d+),", params)
    bq, bk = int(row.group(1)), int(row.group(2))
    spec = int(re.search(r"#define FA_SPEC_ROWS (\d+)", params).group(1))
    return dict(split=bq, dense=bq, spec=min(bq, spec), bk=bk)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="+", default=["spec", "split"], choices=["spec", "split", "dense"])
    parser.add_argument("--tools", default=next((str(d / "shared" / "tools") for d in ROOT.parents
                                                 if (d / "shared" / "tools" / "issue_cost.py").is_file()), None))
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    sys.path.insert(0, args.tools)
    import ir_mix  # noqa: E402  (the shared tools, found at run time)
    import issue_cost  # noqa: E402

    kernels = "".join(kernel_source(kernel, kind, dp) for dp in args.head_dims for kernel in args.kernels
                      for kind in KINDS)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "tiled_cost.metal"
        path.write_text(prelude() + '#include "flash_attention_kernels.h"\n' + kernels)
        compile_args = types.SimpleNamespace(source=str(path), stdlib=str(ROOT / "tools" / "clcpp"),
                                             include=[str(SHADERS)], define=[], clang=None, no_debug_lines=False)
        an = ir_mix.Analyzer(ir_mix.compile_ir(compile_args))
    rows = []
    print("| head_dim | kernel | packed rows per block | cache | IR instructions / MMA | cycles / key | "
          "bytes / cycle / core | % of DRAM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dp in args.head_dims:
        tiles = block_rows(dp)
        for kernel in args.kernels:
            for kind in KINDS:
                fn, loop = issue_cost.key_loop(an, ir_mix.find_kernel(an, kernel_name(kernel, kind, dp)), False)
                region = loop["body"] - an.feature_blocks(fn)[0]
                weights, _ = an.weights(fn, region, loop["header"])
                counts = issue_cost.region_counts(an, fn, region, weights, True)
                mma = counts.get("mma_h", 0) + counts.get("mma_f", 0)
                per_iteration = issue_cost.cycles(counts)
                per_key = per_iteration / tiles["bk"]
                rate = tiles["bk"] * bytes_per_key(KINDS[kind][1], dp) / per_iteration
                share = min(1.0, rate / DRAM_BYTES_PER_CYCLE)
                with contextlib.redirect_stdout(io.StringIO()):  # analyse prints its report
                    _, mix = ir_mix.key_loop(ir_mix.analyse(an, kernel_name(kernel, kind, dp), False, False))
                insts = ir_mix.net_insts(mix["per_iteration_core"])
                rows.append(dict(head_dim=dp, kernel=kernel, rows=tiles[kernel], cache=kind, mma=mma,
                                 ir_per_mma=insts / max(mma, 1), cycles_per_key=per_key, bytes_per_cycle=rate,
                                 dram_share=share, counts=dict(counts)))
                print(f"| {dp} | {kernel} | {tiles[kernel]} | {kind} | {insts / max(mma, 1):.2f} | {per_key:.1f} | "
                      f"{rate:.2f} | {100 * share:.0f} % |", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
