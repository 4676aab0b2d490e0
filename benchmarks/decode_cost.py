"""The decode kernel by the issue-cycle cost model: cycles per key, bytes per cycle per core and the
share of the modelled DRAM bandwidth, per live rows g and cache kind (docs/decode.md's table).

Static and modelled, not a timing. The model is ``issue_cost.py`` beside ``ir_mix.py`` (the
project's shared tools, ``--tools``; default ``../shared/tools`` from the repository root): cycles of
one iteration of the kernel's key loop with metal-benchmarks' costs per instruction, the feature
switches compiled off (docs/specialisation.md's prelude). A core has four schedulers, each running
one SIMD-group's key loop; DRAM gives about 7.5 bytes per cycle per core (M2 Max: 400 GB/s over 38
cores at 1.4 GHz), so the kernel reads 4 x bytes per key / cycles per key bytes per cycle per core,
memory-bound from 7.5.

Each measured kernel is the decode body with its live rows fixed (the line
``const uint live = ...;`` of flash_attention_decode.h set to g) and, for a KV cache, its layout
fixed (``FixedCacheKV``: bits and paging as constants, so the loop holds only that kind's path):

    float16 contiguous   plain k/v tensors (flash_attention_forward_decode_*)
    paged                a block table, float16 pages
    8-bit, 4-bit         MLX's affine format, group_size 64, contiguous

Bytes per key: K and V rows (head_dim elements of 2 bytes, or bits / 8 bytes plus a 2-byte scale
and bias per group of 64). Keys per iteration: the keys one iteration of the loop consumes,
``FA_DECODE_KEYS(ROWS, E)`` of the instance that serves g rows (1, 2, 4 or FA_DECODE_ROWS) when
the header defines it, else 1.

    python benchmarks/decode_cost.py                     # head_dim 64, 128, 256; g 1 2 3 4 8
    python benchmarks/decode_cost.py --head-dims 128 --live 1 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import sys
import tempfile
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHADERS = ROOT / "Shaders"
DRAM_BYTES_PER_CYCLE = 7.5
SCHEDULERS = 4
GROUP_SIZE = 64

def prelude() -> str:
    """Every function constant of FA_FUNCTION_CONSTANTS compiled off (0 / false)."""
    params = (SHADERS / "flash_attention_params.h").read_text()
    constants = re.findall(r"X\(FA_FUNCTION_CONSTANT_\w+, (uint|bool), (\w+),", params)
    lines = [f"constant {kind} {name} = {'false' if kind == 'bool' else '0'};" for kind, name in constants]
    return "\n".join(["#include <metal_stdlib>", "using namespace metal;", "#define FA_FUNCTION_CONSTANTS_PREDEFINED 1",
                      *lines, ""])

# A KV cache whose layout is a compile-time constant: CacheKV's rows with bits and paging fixed.
FIXED_CACHE = """
template <typename T, uint BITS, bool PAGED>
struct FixedCacheKV {
    CacheKV<T> kv;
};

template <typename T, uint BITS, bool PAGED>
inline CacheDecodeRows<T> decode_rows(FixedCacheKV<T, BITS, PAGED> f, constant FlashAttentionParams &p,
                                      uint b, uint kv_head, uint first, uint col0, uint step) {
    CacheDecodeRows<T> r = decode_rows(f.kv, p, b, kv_head, first, col0, step);
    r.k.bits = BITS;
    r.v.bits = BITS;
    r.k.page_rows = PAGED ? max(p.kv_page_rows, 1u) : 0u;
    r.v.page_rows = r.k.page_rows;
    return r;
}

// The MMA decode with the width fixed (flash_attention_decode_mma.h; the vector instance for
// unquantized caches).
template <uint DP, typename T, uint BITS, bool PAGED, typename Storage>
inline bool decode_rows_mma(device const T *q, FixedCacheKV<T, BITS, PAGED> f, device const uchar *mask,
                            device const float *alibi, constant FlashAttentionParams &p, PackedRows rows,
                            uint live, uint b, uint kv_head, uint key_begin, uint key_end, Storage tg,
                            uint sgid, uint lane) {
    if (BITS == 0) {
        return false;
    }
    decode_mma_block<DP, BITS == 0 ? 8 : BITS>(q, f, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end,
                                               tg, sgid, lane);
    return true;
}
"""

KINDS = {
    # name: (source expression, bits, paged)
    "float16": ("DeviceKV<half>{k, v}", 0, False),
    "paged": ("FixedCacheKV<half, 0, true>{FA_KV_CACHE_SOURCE(half)}", 0, True),
    "8-bit": ("FixedCacheKV<half, 8, false>{FA_KV_CACHE_SOURCE(half)}", 8, False),
    "4-bit": ("FixedCacheKV<half, 4, false>{FA_KV_CACHE_SOURCE(half)}", 4, False),
}


def cache_kernel_parameters(outputs: bool = False) -> str:
    """The parameter list of a measured cache kernel (float16 q, a cache's K/V, table, scales and
    biases, the split outputs, the built-ins); with ``outputs`` also out, lse and sinks (the dense
    forward's)."""
    dense = ("""
    device half *out [[buffer(FA_FORWARD_BUFFER_OUT)]],
    device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],""" if outputs else "")
    sinks = ("""
    device const float *sinks [[buffer(FA_FORWARD_BUFFER_SINKS)]],""" if outputs else "")
    return f"""
    device const half *q [[buffer(FA_FORWARD_BUFFER_Q)]],
    device const half *k [[buffer(FA_FORWARD_BUFFER_K)]],
    device const half *v [[buffer(FA_FORWARD_BUFFER_V)]],{dense}
    constant FlashAttentionParams &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
    device const uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],
    device const float *alibi [[buffer(FA_FORWARD_BUFFER_ALIBI)]],{sinks}
    device float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],
    device float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],
    device const int *kv_table [[buffer(FA_KV_CACHE_BUFFER_TABLE)]],
    device const half *k_scales [[buffer(FA_KV_CACHE_BUFFER_K_SCALES)]],
    device const half *k_biases [[buffer(FA_KV_CACHE_BUFFER_K_BIASES)]],
    device const half *v_scales [[buffer(FA_KV_CACHE_BUFFER_V_SCALES)]],
    device const half *v_biases [[buffer(FA_KV_CACHE_BUFFER_V_BIASES)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]"""


def kernel_name(kind: str, dp: int) -> str:
    return f"decode_cost_{kind.replace('-', '_')}_d{dp}"


def kernel_source(kind: str, dp: int, live: int) -> str:
    source = KINDS[kind][0]
    mma = "true" if uses_mma(kind, dp, live) else "false"
    return f"""
[[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]
kernel void {kernel_name(kind, dp)}({cache_kernel_parameters()}) {{
    threadgroup DecodeStorage<{dp}> tg;
    attention_forward_decode<{dp}, {mma}>(q, {source}, mask, alibi, partial_out, partial_lse, params, &tg,
                                   tgid, sgid, lane);
}}
"""


def bytes_per_key(kind: str, dp: int) -> float:
    bits = KINDS[kind][1]
    if bits == 0:
        return 2 * dp * 2
    return 2 * (dp * bits / 8 + 2 * 2 * dp / GROUP_SIZE)


def decode_rows_limit(dp: int) -> int:
    params = (SHADERS / "flash_attention_params.h").read_text()
    rule = re.search(r"#define FA_DECODE_ROWS\(DP\) \(\(DP\) <= (\d+) \? (\d+) : (\d+)\)", params)
    return int(rule.group(2)) if dp <= int(rule.group(1)) else int(rule.group(3))


def keys_per_iteration(dp: int, live: int) -> int:
    """FA_DECODE_KEYS(ROWS, E) of the instance serving `live` rows (half: E elements per lane)."""
    params = (SHADERS / "flash_attention_params.h").read_text()
    rule = re.search(r"#define FA_DECODE_KEYS\(ROWS, E\) \(\(ROWS\) \* \(E\) >= (\d+) \? (\d+) : (\d+)\)", params)
    if not rule:
        return 1
    rows = next(r for r in (1, 2, 4, decode_rows_limit(dp)) if live <= r)
    span = (dp + 31) // 32
    e = max(2, 1 << (span - 1).bit_length())
    return int(rule.group(2)) if rows * e >= int(rule.group(1)) else int(rule.group(3))


def uses_mma(kind: str, dp: int, live: int) -> bool:
    """Whether `live` packed rows over this cache take the MMA decode kernel (FA_DECODE_MMA_SERVES
    with head_dim and head_dim_v the bucket's)."""
    return KINDS[kind][1] != 0 and live <= decode_rows_limit(dp) and dp in (32, 64, 128)


def mma_keys_per_iteration() -> int:
    """8 keys per fragment times FA_DECODE_MMA_FRAGMENTS (flash_attention_decode_mma.h)."""
    header = (SHADERS / "flash_attention_decode_mma.h").read_text()
    return 8 * int(re.search(r"#define FA_DECODE_MMA_FRAGMENTS (\d+)", header).group(1))


def build_source(work: pathlib.Path, live: int, head_dims: list[int]) -> pathlib.Path:
    """Writes the measurement source for `live` rows into `work` (with a copy of Shaders/ whose
    decode header has the live rows fixed)."""
    shaders = work / "Shaders"
    shutil.copytree(SHADERS, shaders)
    decode = (shaders / "flash_attention_decode.h").read_text()
    fixed, n = re.subn(r"const uint live = [^;]*;", f"const uint live = {live};", decode)
    if n != 1:
        sys.exit(f"decode_cost: expected one `const uint live = ...;` in flash_attention_decode.h, found {n}")
    (shaders / "flash_attention_decode.h").write_text(fixed)
    kernels = "".join(kernel_source(kind, dp, live) for dp in head_dims for kind in KINDS)
    path = shaders / "decode_cost.metal"
    # Every function inlined, as Apple's compiler does, so a fixed layout folds inside the loads too.
    inline = "#pragma clang attribute push (__attribute__((always_inline)), apply_to = function)\n"
    path.write_text(prelude() + inline + '#include "flash_attention_kernels.h"\n' + FIXED_CACHE +
                    "#pragma clang attribute pop\n" + kernels)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--live", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--tools", default=next((str(d / "shared" / "tools") for d in ROOT.parents
                                                 if (d / "shared" / "tools" / "issue_cost.py").is_file()), None))
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    sys.path.insert(0, args.tools)
    import ir_mix  # noqa: E402  (the shared tools, found at run time)
    import issue_cost  # noqa: E402

    rows = []
    print("| head_dim | g | cache | keys / iteration | cycles / key | cycles / key-row | bytes / cycle / core | % of DRAM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for live in args.live:
        dims = [dp for dp in args.head_dims if live <= decode_rows_limit(dp)]
        if not dims:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(tmp)
            source = build_source(work, live, dims)
            compile_args = types.SimpleNamespace(
                source=str(source), stdlib=str(ROOT / "tools" / "clcpp"), include=[], define=[],
                clang=None, no_debug_lines=False)
            an = ir_mix.Analyzer(ir_mix.compile_ir(compile_args))
        for dp in dims:
            for kind in KINDS:
                name = kernel_name(kind, dp)
                mma = uses_mma(kind, dp, live)
                # The MMA decode's key loop is the one with the MMAs (issue_cost's tiled rule).
                fn, loop = issue_cost.key_loop(an, ir_mix.find_kernel(an, name), not mma)
                region = loop["body"] - an.feature_blocks(fn)[0]
                weights, _ = an.weights(fn, region, loop["header"])
                counts = issue_cost.region_counts(an, fn, region, weights, True)
                keys = mma_keys_per_iteration() if mma else keys_per_iteration(dp, live)
                per_key = issue_cost.cycles(counts) / keys
                rate = SCHEDULERS * bytes_per_key(kind, dp) / per_key
                share = min(1.0, rate / DRAM_BYTES_PER_CYCLE)
                rows.append(dict(head_dim=dp, g=live, cache=kind, keys_per_iteration=keys, cycles_per_key=per_key,
                                 bytes_per_cycle=rate, dram_share=share, counts=dict(counts)))
                print(f"| {dp} | {live} | {kind} | {keys} | {per_key:.1f} | {per_key / live:.1f} | {rate:.2f} | "
                      f"{100 * share:.0f} % |", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
