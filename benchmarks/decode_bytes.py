"""K/V bytes read per decode call against the cache size, and threadgroups per GPU core
(docs/decode.md's tables).

One forward call per (KV heads, keys, cores) on the CPU engine, planned for that many GPU cores
through ``FLASH_ATTENTION_GPU_CORES``: B=1, H=32 query heads, seqlen_q 1, head_dim 128, float16,
zero inputs (the counts do not depend on the values). The engine counts the bytes every dispatch
reads from each buffer (``device_bytes_read``, indexed by ``[[buffer(i)]]``: k is 1 and v is 2;
counted because this script sets ``FLASH_ATTENTION_COUNT_DEVICE_READS=1``); the ratio is what the chunk dispatch read of k and v over their size, 1.00 when every key and
value is read once per call. Threadgroups per core: the chunk dispatch's threadgroups over the
cores. Each call runs the kernels on the host, so the longest caches take minutes:

    python benchmarks/decode_bytes.py                                # keys 1K 4K 32K 128K, KV heads 8 and 1
    python benchmarks/decode_bytes.py --keys 1024 4096 --kv-heads 1 --cores 10 40
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import flash_attention_metal as fam

FORWARD_K, FORWARD_V = 1, 2  # FA_FORWARD_BUFFER_K, FA_FORWARD_BUFFER_V
HEADS, HEAD_DIM = 32, 128


def measure(context: fam.Context, kv_heads: int, keys: int, cores: int) -> tuple[str, float, int]:
    """The chunk kernel, K/V bytes read / cache bytes, and the chunk dispatch's threadgroups."""
    os.environ["FLASH_ATTENTION_GPU_CORES"] = str(cores)
    os.environ["FLASH_ATTENTION_COUNT_DEVICE_READS"] = "1"
    q = np.zeros((1, HEADS, 1, HEAD_DIM), np.float16)
    k = np.zeros((1, kv_heads, keys, HEAD_DIM), np.float16)
    context.forward(q, k, k)
    chunks = context.last_profile.dispatches[0]
    read = chunks.device_bytes_read
    x, y, z = chunks.threadgroups
    return chunks.kernel, (read[FORWARD_K] + read[FORWARD_V]) / (2 * k.nbytes), x * y * z


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1024, 4096, 32768, 131072])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--cores", type=int, nargs="+", default=[10, 40])
    args = parser.parse_args()
    context = fam.Context("cpu")
    print("| KV heads | keys | cores | kernel | K/V bytes read / cache | threadgroups | per core |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kv_heads in args.kv_heads:
        for keys in args.keys:
            for cores in args.cores:
                kernel, ratio, groups = measure(context, kv_heads, keys, cores)
                name = kernel.removeprefix("flash_attention_forward_")
                print(f"| {kv_heads} | {keys} | {cores} | {name} | {ratio:.2f} | {groups} | {groups / cores:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
