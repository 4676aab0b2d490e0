"""The occupancy table of Shaders/flash_attention_params.h states what the kernels use: every row's
threadgroup bytes are those the CPU engine reports for the kernel (the sizeof of its storage
struct), and its threadgroups per core follow from FA_CORE_THREADGROUP_BYTES."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

import flash_attention_metal as fam

ROOT = pathlib.Path(__file__).resolve().parents[3]
PARAMS = (ROOT / "Shaders" / "flash_attention_params.h").read_text(encoding="utf-8")
ROW = re.compile(r"^//\s+d(\d+)\s+(\d+) / (\d+)\s+(\d+) / (\d+)\s+(\d+) / (\d+)\s*$", re.MULTILINE)
CORE_BYTES = int(re.search(r"#define FA_CORE_THREADGROUP_BYTES (\d+)", PARAMS).group(1))


def table() -> dict[tuple[str, int], list[tuple[int, int]]]:
    """{(dtype group, head_dim_max): [(bytes, threadgroups per core) of forward, dQ, dK/dV]}."""
    section = PARAMS[PARAMS.index("//   half, bfloat"):PARAMS.index("//   backward_delta")]
    half, single = section.split("//   float\n")
    rows = {}
    for group, text in (("half", half), ("float", single)):
        for match in ROW.finditer(text):
            numbers = list(map(int, match.groups()))
            rows[(group, numbers[0])] = [(numbers[1], numbers[2]), (numbers[3], numbers[4]), (numbers[5], numbers[6])]
    return rows


ROWS = table()


def test_the_table_covers_every_bucket():
    assert sorted(ROWS) == sorted([(group, d) for group in ("half", "float") for d in (32, 64, 96, 128, 192, 256)]
                                  + [("half", 512), ("half", 576)])


@pytest.mark.parametrize("group,head_dim", sorted(ROWS))
def test_row_matches_the_kernels(group, head_dim):
    dtype = np.float16 if group == "half" else np.float32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 16, head_dim)).astype(dtype) for _ in range(3))
    ctx = fam.Context("cpu")
    out, lse = ctx.forward(q, k, v)
    memory = {d.kernel: d.threadgroup_memory for d in ctx.last_profile.dispatches}
    ctx.backward(out, q, k, v, out, lse)
    memory.update({d.kernel: d.threadgroup_memory for d in ctx.last_profile.dispatches})
    suffix = ("f16" if group == "half" else "f32") + f"_d{head_dim}"
    kernels = [f"flash_attention_forward_{suffix}", f"flash_attention_backward_dq_{suffix}",
               f"flash_attention_backward_dkv_{suffix}"]
    for kernel, (size, per_core) in zip(kernels, ROWS[(group, head_dim)]):
        assert memory[kernel] == size, kernel
        assert per_core == CORE_BYTES // size, kernel


def buckets(name: str) -> dict[int, list[int]]:
    """{head_dim_max: [FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ]} of one X-macro table."""
    body = re.search(rf"#define {name}\(X\)(.*?)\n\n", PARAMS, re.DOTALL).group(1)
    rows = [list(map(int, row.split(","))) for row in re.findall(r"X\(([\d, ]+)\)", body)]
    return {row[0]: row[1:] for row in rows}


ACCUMULATOR_ROW = re.compile(r"^//\s+d(\d+)\s+(\d+)\s+(\d+)\s+(\d+)(?:\s+d(\d+)\s+(\d+)\s+(\d+)\s+(\d+))?\s*$",
                             re.MULTILINE)


def test_accumulator_table_follows_the_buckets_within_the_budget():
    """The table of accumulator floats per lane states FA_ACCUMULATOR_FLOATS of every bucket's
    owned rows (forward: O; dQ: dQ; dK/dV: dK and dV), all within FA_MAX_ACCUMULATOR_FLOATS."""
    section = PARAMS[PARAMS.index("//   half, bfloat   forward  dQ  dK/dV"):PARAMS.index("#define FA_ACCUMULATOR_FLOATS")]
    threads = 32 * int(re.search(r"#define FA_SIMDGROUPS (\d+)", PARAMS).group(1))
    budget = int(re.search(r"#define FA_MAX_ACCUMULATOR_FLOATS (\d+)", PARAMS).group(1))
    stated = {"half": {}, "float": {}}
    for match in ACCUMULATOR_ROW.finditer(section):
        numbers = [int(g) if g else None for g in match.groups()]
        stated["half"][numbers[0]] = numbers[1:4]
        if numbers[4] is not None:
            stated["float"][numbers[4]] = numbers[5:8]
    worst = 0
    for group, table in (("half", "FA_HEAD_DIM_BUCKETS"), ("float", "FA_HEAD_DIM_BUCKETS_F32")):
        expected = {dmax: [dmax * b[0] // threads, dmax * b[2] // threads, 2 * dmax * b[4] // threads]
                    for dmax, b in buckets(table).items()}
        assert stated[group] == expected, group
        worst = max(worst, *(max(v) for v in expected.values()))
    assert worst == budget  # the budget is what the widest kernel needs, no looser
