"""tests/cuda/cases.py, the plan-fed CUDA check's case writer: every dispatch it writes is the
library's (plan.create's kernel, grid, function constants, parameter bytes and bindings), every
binding and output lies inside its buffer, the inputs sit in the device images where the strides
say, and short queries get the split-KV forward; issue 36's non-finite and issue 40's dropout cases
are in both grids, their NaN and infinities planted where grid.py says and their dropout in the
plans' parameters. The variable-length, KV-cache and merge cases (fed by fa_plan_create's varlen
and cache plans and fa_plan_create_merge's) are replayed here on the CPU engine: fa_plan_execute on
the case files' buffers, the outputs read through the case's output views as replay.cu reads
them, and judge.py's verdict on that dump must pass. The Metal 4 tensor-op cases (issue 37) come
from fa_plan_create_for with the tensor-op library ready under FLASH_ATTENTION_TENSOR_OPS=1, name
tensor-op kernels in both passes (without the library or the override they would not), carry tensor_ops=forward,backward for judge.py's tensor-op term,
and two of them are replayed on the CPU engine in both cooperative-tensor layouts, bit for bit
alike. The GPU replay itself (replay.cu) runs only in tests/cuda/gpu_check.sh.

Cost: about 12 s (six dense cases planned and written; a varlen, three KV-cache and two merge
cases replayed; every tensor-op case planned, two replayed twice).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fam
from flash_attention_metal import plan

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "cuda"))
_spec = importlib.util.spec_from_file_location("cuda_cases", ROOT / "tests" / "cuda" / "cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
import grid  # noqa: E402  (tests/cuda, on the path cases.py puts it on)

CASES = {c.name: c for c in grid.small_grid()}
PICKED = ["f16_d1_b2_h2x2_q37_k37_full",                    # dense, bhsd
          "bf16_d128_b1_h8x2_q65_k65_causal_qkv",           # packed q, k, v slices
          "f16_d96_b2_h4x1_q70_k70_full_madd.1h_gapped",    # gapped rows, additive mask
          "f16_d64_b2_h8x2_q4_k100_causal_w40.n_mbool.1h_alibi_sinks",  # split-KV, every modifier
          "f32_d64_b2_h4x1_q2_k160_full_nonfinite.k",        # decode, NaN and infinities in k (issue 36)
          "f16_d128_b2_h8x2_q65_k90_full_w20.n_drop0.17.wrap"]  # dropout, Philox counter wrapping (issue 40)


def _read_case(path: Path) -> dict:
    data = path.read_bytes()
    at = len(cases.MAGIC)
    assert data[:at] == cases.MAGIC

    def take(fmt):
        nonlocal at
        values = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return values

    def text():
        nonlocal at
        (length,) = take("I")
        at += length
        return data[at - length:at].decode()

    buffers, names = [], []
    for _ in range(take("I")[0]):
        names.append(text())
        size, kind = take("QI")
        image = None
        if kind == 0:
            image = data[at:at + size]
            at += size
        buffers.append((size, kind, image))
    dispatches = []
    for _ in range(take("I")[0]):
        name = text()
        groups, threads = take("3I"), take("3I")
        constants = [take("3I") for _ in range(take("I")[0])]
        index = take("I")[0]
        (length,) = take("I")
        params = data[at:at + length]
        at += length
        bindings = [take("IIQ") for _ in range(take("I")[0])]
        dispatches.append((name, groups, threads, constants, index, params, bindings))
    outputs = []
    for _ in range(take("I")[0]):
        outputs.append((text(), *take("IQI4I4Q")))
    assert at == len(data), "trailing bytes"
    return {"buffers": buffers, "names": names, "dispatches": dispatches, "outputs": outputs}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from flash_attention_metal import _native
    library = _native.native()
    folder = tmp_path_factory.mktemp("cases")
    entries = [cases.plan_case(CASES[name], library, cases._split_rows(library)) for name in PICKED]
    for entry in entries:
        cases.write_case(entry, folder)
    return folder, {e["case"]["name"]: e for e in entries}


@pytest.mark.parametrize("name", PICKED)
def test_dispatches_are_the_librarys(written, name):
    folder, entries = written
    c = CASES[name]
    read = _read_case(folder / f"{name}.case")
    problem = cases._problem(c, cases._place(c), __import__("flash_attention_metal")._native.native())
    expected = [*plan.create(problem, "forward").dispatches, *plan.create(problem, "backward").dispatches]
    got = read["dispatches"]
    assert [d[0] for d in got[:len(expected)]] == [d.kernel_name for d in expected]
    for (kernel, groups, threads, constants, index, params, bindings), d in zip(got, expected):
        assert (groups, threads, index, params) == (d.threadgroups_per_grid, d.threads_per_threadgroup,
                                                   d.params_index, d.params), kernel
        assert constants == [(x.index, cases.CONSTANT_TYPES[x.type], x.value) for x in d.specialization], kernel
        assert [b[0] for b in bindings] == [b.index for b in d.bindings]
    split = got[len(expected):]
    # The extra forward of short queries, planned for a large GPU where that plan differs: its
    # chunks and combine, into split_out and split_lse.
    assert bool(split) == ("split_out" in entries[name]["outputs"])
    if c.seqlen_q <= cases._split_rows(None):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FLASH_ATTENTION_GPU_CORES", str(cases.SPLIT_CORES))
            large = plan.create(problem, "forward").dispatches
        forward = plan.create(problem, "forward").dispatches
        differs = len(large) == 2 and large != forward
        assert [d[0] for d in split] == ([d.kernel_name for d in large] if differs else [])
        if split:
            assert [d[0].split("_")[3] for d in split] in (["split", "combine"], ["decode", "combine"])
    else:
        assert split == []
    sizes = [b[0] for b in read["buffers"]]
    assert read["names"] == list(entries[name]["buffers"])
    for kernel, *_, bindings in got:
        for index, buffer, offset in bindings:
            assert offset <= sizes[buffer], (kernel, index)
    for out_name, buffer, offset, dtype, *dims_strides in read["outputs"]:
        dims, strides = dims_strides[:4], dims_strides[4:]
        last = offset + sum((d - 1) * s for d, s in zip(dims, strides))
        assert (last + 1) * (4 if dtype == 2 else 2) <= sizes[buffer], out_name


@pytest.mark.parametrize("name", PICKED)
def test_inputs_sit_where_the_strides_say(written, name):
    folder, entries = written
    entry = entries[name]
    read = _read_case(folder / f"{name}.case")
    names = list(entry["buffers"])
    for role, file_name in (("q", "q"), ("k", "k"), ("v", "v"), ("dout", "dout")):
        t = entry["tensors"][role]
        dtype = np.dtype(cases._numpy_dtype(t["dtype"]))
        image = np.frombuffer(read["buffers"][names.index(t["buffer"])][2], dtype=dtype)
        view = np.lib.stride_tricks.as_strided(image[t["offset"]:], shape=t["dims"],
                                               strides=[s * dtype.itemsize for s in t["strides"]])
        logical = np.fromfile(folder / f"{name}.{file_name}", np.float32).reshape(t["dims"])
        np.testing.assert_array_equal(view.astype(np.float32), logical)
    # Outside the views the input images hold 0xff (NaN in every dtype), and a gapped layout has gaps.
    covered = {n: np.zeros(read["buffers"][names.index(n)][0], bool) for n in names
               if read["buffers"][names.index(n)][1] == 0}
    for t in entry["tensors"].values():
        if t["buffer"] in covered:
            size = np.dtype(cases._numpy_dtype(t["dtype"])).itemsize
            index = t["offset"] + sum(np.arange(d).reshape([-1 if a == i else 1 for a in range(4)]) * s
                                      for i, (d, s) in enumerate(zip(t["dims"], t["strides"])))
            for byte in range(size):
                covered[t["buffer"]][index.ravel() * size + byte] = True
    gaps = 0
    for n, mask in covered.items():
        image = np.frombuffer(read["buffers"][names.index(n)][2], np.uint8)
        assert (image[~mask] == 0xff).all(), n
        gaps += int((~mask).sum())
    assert (gaps > 0) == (entry["case"]["layout"] == "gapped")
    line = (folder / f"{name}.line").read_text().split()
    assert line[0] == name and line[20] == ",".join(entry["outputs"])
    c = CASES[name]
    assert line[21:] == ([f"{c.dropout_p:.9g}", str(c.dropout_seed), str(c.dropout_offset)] if c.dropout_p else [])


def test_new_case_kinds_are_in_both_grids():
    """Issue 36's non-finite and issue 40's dropout cases, in the sanitizer grid and the full one."""
    new = {c.name for c in grid.nonfinite_cases() + grid.dropout_cases()}
    assert len(new) == 15
    for cases_of in (grid.small_grid(), grid.full_grid()):
        names = [c.name for c in cases_of]
        assert new <= set(names) and len(names) == len(set(names))


def test_nonfinite_values_are_planted_after_the_draw():
    """The planted NaN and infinities sit where grid.NONFINITE_PLACEMENTS says, every other input is
    the seeded draw of the case, and batch 1 stays finite."""
    for c in grid.nonfinite_cases():
        planted, clean = cases.inputs(c), cases.inputs(dataclasses.replace(c, nonfinite=""))
        spots = {t: np.zeros(planted[t].shape, bool) for t in ("q", "k", "v")}
        for tensor, b, h, row, column, value in grid.NONFINITE_PLACEMENTS[c.nonfinite]:
            if row < planted[tensor].shape[2]:
                spots[tensor][b, h, row, column] = True
                np.testing.assert_array_equal(planted[tensor][b, h, row, column], np.float32(value))
        assert sum(int(m.sum()) for m in spots.values()) >= 1, c.name
        for t, m in spots.items():
            np.testing.assert_array_equal(planted[t][~m], clean[t][~m])
            if c.batch > 1:
                assert np.isfinite(planted[t][1]).all(), c.name
        assert np.isfinite(planted["dout"]).all()


def test_dropout_reaches_the_plans_parameters():
    """A dropout case's forward and backward parameters differ from the same case without dropout:
    fa_problem's dropout_p, seed and offset reach every kernel's FlashAttentionParams."""
    from flash_attention_metal import _native
    library = _native.native()
    for c in grid.dropout_cases():
        plain = dataclasses.replace(c, dropout_p=0.0, dropout_seed=0, dropout_offset=0)
        for pass_name in ("forward", "backward"):
            ours, theirs = (plan.create(cases._problem(x, cases._place(x), library), pass_name, library=library)
                            for x in (c, plain))
            assert [d.kernel_name for d in ours.dispatches] == [d.kernel_name for d in theirs.dispatches]
            assert all(a.params != b.params for a, b in zip(ours.dispatches, theirs.dispatches)
                       if a.kernel_name.startswith(("flash_attention_forward_f", "flash_attention_backward_d"))), c.name


# Two variable-length batches (GQA, a sequence whose causal rows partly see no key; softcap with
# ALiBi slopes per sequence) and three KV caches
# (paged 4-bit decode through the split-KV decode kernel, contiguous 8-bit through the dense one,
# a paged 4-bit one whose block table holds entries out of range, which the kernels clamp).
# And the merge cases: two forwards over parts of the keys, then the merge kernel's plan.
REPLAYED = [grid.varlen_cases()[0], grid.varlen_cases()[3], *grid.kv_cache_cases()[:3], *grid.merge_cases()]
# Tensor-op cases replayed on the CPU engine: a dense one with a mask, ALiBi and sinks, and the varlen batch.
TENSOR_REPLAYED = [grid.tensor_cases(small=True)[2], grid.tensor_cases(small=True)[4]]


def _itemsize(dtype: str) -> int:
    return np.dtype(cases._numpy_dtype(dtype)).itemsize


def _plans(entry: dict, library) -> list:
    """(fa_plan ** holding the plan, roles renamed to the case's tensors) of each pass of the case,
    made as cases.py made them."""
    ffi, lib = library.ffi, library.lib
    case = next(x for x in REPLAYED + TENSOR_REPLAYED if x.name == entry["name"])
    tensor_ops = getattr(case, "tensor_ops", False)

    def create(problem, cores=None, pass_name="FA_PASS_FORWARD"):
        holder = ffi.new("fa_plan **")
        with pytest.MonkeyPatch.context() as env:
            if cores:
                env.setenv("FLASH_ATTENTION_GPU_CORES", str(cores))
            target = ffi.NULL
            if tensor_ops:  # as cases.py plans a tensor-op case
                env.setenv(cases.TENSOR_OPS_VARIABLE, "1")
                target = ffi.new("fa_plan_target *")
                target.struct_size = ffi.sizeof("fa_plan_target")
                target.tensor_library = getattr(lib, "FA_TENSOR_LIBRARY_" + cases.TENSOR_TARGET["tensor_library"].upper())
            library.raise_for_status(lib.fa_plan_create_for(problem, getattr(lib, pass_name), 0, target, holder))
        return holder

    if entry.get("kind") == "dense":
        problem = cases._problem(case, cases._place(case), library)
        return [(create(problem), {}), (create(problem, pass_name="FA_PASS_BACKWARD"), {})]
    if entry["kind"] == "varlen":
        problem, held = cases.varlen_problem(case, library)  # noqa: F841  (held: alive while planning)
        return [(create(problem), {}), (create(problem, pass_name="FA_PASS_BACKWARD"), {})]
    if entry["kind"] == "merge":
        first, second = cases.merge_problems(case, library)
        merge = ffi.new("fa_plan **")
        c = case.case
        library.raise_for_status(lib.fa_plan_create_merge(c.batch * c.num_heads * c.seqlen_q, c.head_dim_v, merge))
        return [(create(first), {"out": "out_a", "lse": "lse_a"}),
                (create(second), {"k": "k_b", "v": "v_b", "out": "out_b", "lse": "lse_b"}), (merge, {})]
    strides = {role: tuple(entry["tensors"][role]["strides"][:3]) for role in ("k", "v")}
    problem, table = cases.kv_cache_problem(case, entry["geometry"], strides, library)  # noqa: F841
    plans = [(create(problem), {})]
    if "split_out" in entry["outputs"]:
        plans.append((create(problem, cases.SPLIT_CORES), {"out": "split_out", "lse": "split_lse"}))
    return plans


def _replay_on_cpu(entry: dict, folder: Path, ctx) -> list[str]:
    """replay.cu's run of one case, on the CPU engine: the case file's buffers (inputs as written,
    the others poisoned with 0xff), each pass's plan (made as cases.py made it) run by
    fa_plan_execute with every role at its case buffer and offset, the outputs read back through
    the case's output views into the dump (NAME.<output>, cases.txt). Returns the case's lines."""
    library = ctx._native
    ffi, lib = library.ffi, library.lib
    name = entry["name"]
    read = _read_case(folder / f"{name}.case")
    memory = {buffer: np.frombuffer(bytearray(image), np.uint8) if kind == 0 else np.full(size, 0xff, np.uint8)
              for buffer, (size, kind, image) in zip(entry["buffers"], read["buffers"])}
    for holder, renamed in _plans(entry, library):
        try:
            pointers = ffi.new("void *[]", lib.FA_BUFFER_ROLE_COUNT)
            for b in plan.read(holder[0], library).buffers:
                if b.usage != "workspace":
                    t = entry["tensors"][renamed.get(b.role, b.role)]
                    address = memory[t["buffer"]].ctypes.data + t["offset"] * _itemsize(t["dtype"])
                    pointers[getattr(lib, "FA_BUFFER_ROLE_" + b.role.upper())] = ffi.cast("void *", address)
            library.raise_for_status(lib.fa_plan_execute(ctx._handle, holder[0], pointers, lib.FA_BUFFER_ROLE_COUNT))
        finally:
            lib.fa_plan_destroy(holder[0])
    for output in entry["outputs"]:
        t = entry["tensors"][output]
        size = _itemsize(t["dtype"])
        flat = memory[t["buffer"]].view(cases._numpy_dtype(t["dtype"]))
        view = np.lib.stride_tricks.as_strided(flat[t["offset"]:], shape=t["dims"],
                                               strides=[stride * size for stride in t["strides"]])
        view.astype(np.float32).tofile(folder / f"{name}.{output}")
    return (folder / f"{name}.line").read_text().splitlines()


@pytest.mark.parametrize("case", REPLAYED, ids=lambda c: c.name)
def test_varlen_kv_cache_and_merge_cases_replay_and_judge(tmp_path, case):
    """A varlen, KV-cache or merge case planned and written by cases.py, replayed on the CPU engine
    through its case file's buffers, passes judge.py (every sequence of a varlen case as its dense
    case, a merge as the dense case over all keys); the varlen plans bind the sequence table at the
    params index (no parameter bytes written)."""
    ctx = fam.Context("cpu")
    library = ctx._native
    if isinstance(case, grid.MergeCase):
        entry = cases.plan_merge(case, library)
        assert [d["kernel"].split("_")[2] for d in entry["dispatches"]][-1] == "merge"
    elif isinstance(case, grid.VarlenCase):
        entry = cases.plan_varlen(case, library)
        table = [d for d in entry["dispatches"] if d["kernel"] != "flash_attention_varlen_sequences"]
        assert table and all(d["params"] == "" and d["params_index"] in [b[0] for b in d["bindings"]] for d in table)
    else:
        entry = cases.plan_kv_cache(case, library, cases._split_rows(library))
        assert all("kvcache" in d["kernel"] or "combine" in d["kernel"] for d in entry["dispatches"])
    cases.write_case(entry, tmp_path)
    lines = _replay_on_cpu(entry, tmp_path, ctx)
    assert len(lines) == (len(case.seqlens_q) if isinstance(case, grid.VarlenCase) else 1)
    spec = importlib.util.spec_from_file_location("cuda_judge", ROOT / "tests" / "cuda" / "judge.py")
    judge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(judge)
    for line in lines:
        name, passed, detail, _ = judge.judge_case(tmp_path, line)
        assert passed, f"{name}: {detail}"


def _judge():
    spec = importlib.util.spec_from_file_location("cuda_judge", ROOT / "tests" / "cuda" / "judge.py")
    judge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(judge)
    return judge


def test_tensor_cases_plan_tensor_kernels_in_both_passes():
    """Every tensor-op case of both grids: its forward and backward plans (fa_plan_create_for with
    the tensor-op library ready, under FLASH_ATTENTION_TENSOR_OPS=1) name a tensor-op kernel for the
    forward, dQ and dK/dV, which the plans of the same problem without the library (forced) or
    with it but FLASH_ATTENTION_TENSOR_OPS=0 do not; the head-dim buckets and both 2-byte dtypes
    are there."""
    from flash_attention_metal import _native
    library = _native.native()
    small, full = grid.tensor_cases(small=True), grid.tensor_cases()
    assert set(small) <= set(full) and len(small) == 5 and len(full) == 19
    assert {c.head_dim for c in full} >= {64, 80, 96, 128, 256} and {c.dtype for c in full} == {"f16", "bf16"}
    for cases_of, varlen in ((grid.small_grid(), grid.varlen_cases(True)), (grid.full_grid(), grid.varlen_cases())):
        assert {c.name for c in small} <= {c.name for c in [*cases_of, *varlen]}
    split_rows = cases._split_rows(library)
    for c in full:
        entry = (cases.plan_varlen(c, library) if isinstance(c, grid.VarlenCase)
                 else cases.plan_case(c, library, split_rows))
        assert entry["tensor_passes"] == ["forward", "backward"], c.name
        kernels = [d["kernel"] for d in entry["dispatches"]]
        for kind in ("forward_tensor", "backward_dq_tensor", "backward_dkv_tensor"):
            assert any(f"flash_attention_{kind}_" in k for k in kernels), (c.name, kind)
    c = small[0]
    problem = cases._problem(c, cases._place(c), library)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(cases.TENSOR_OPS_VARIABLE, "1")
        forced = plan.create(problem, "backward", library=library)
        env.setenv(cases.TENSOR_OPS_VARIABLE, "0")
        unforced = plan.create(problem, "backward", library=library, target=plan.Target(**cases.TENSOR_TARGET))
    for made in (forced, unforced):
        assert not any("tensor" in d.kernel_name for d in made.dispatches)
    assert forced.dispatches == unforced.dispatches


@pytest.mark.parametrize("case", TENSOR_REPLAYED, ids=lambda c: c.name)
def test_tensor_cases_replay_and_judge_in_both_layouts(tmp_path, monkeypatch, case):
    """A tensor-op case written by cases.py and replayed on the CPU engine (the tensor-op kernels
    through its matmul2d emulation) passes judge.py under the rule's tensor-op term, which its line
    asks for (tensor_ops=forward,backward: looser bounds than without); in the permuted
    cooperative-tensor layout every output keeps its bits (same_bits.py, gpu_check.sh's
    cuda-tensor-layouts)."""
    ctx = fam.Context("cpu")
    library = ctx._native
    if isinstance(case, grid.VarlenCase):
        entry = cases.plan_varlen(case, library)
    else:
        entry = dict(cases.plan_case(case, library, cases._split_rows(library)), kind="dense")
    judge = _judge()
    dumps = {}
    for layout in ("m5", "permuted"):
        monkeypatch.setenv("FLASH_ATTENTION_TENSOR_LAYOUT", layout)
        folder = tmp_path / layout
        folder.mkdir()
        cases.write_case(entry, folder)
        dumps[layout] = folder
        lines = _replay_on_cpu(entry, folder, ctx)
        (folder / "cases.txt").write_text("".join(line + "\n" for line in lines))
        for line in lines:
            assert line.split()[-1] == "tensor_ops=forward,backward"
            name, passed, detail, metrics = judge.judge_case(folder, line)
            assert passed, f"{name} ({layout}): {detail}"
            plain = judge.judge_case(folder, line.rsplit(" ", 1)[0])[3]
            for m, p in zip(metrics, plain):
                assert m.name == p.name and (m.bound > p.bound if m.name in ("out", "dq", "dk", "dv") else True)
    spec = importlib.util.spec_from_file_location("cuda_same_bits", ROOT / "tests" / "cuda" / "same_bits.py")
    same_bits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(same_bits)
    assert same_bits.main([str(dumps["m5"]), str(dumps["permuted"])]) == 0


def test_varlen_and_kv_cache_cases_are_in_both_grids():
    """The small (sanitizer) grid holds a varlen and four KV-cache cases (a wrong block table and a
    paged speculative-decoding width among them), the full one more, with contiguous, paged and 4-
    and 8-bit quantized caches and every dtype."""
    small, full = grid.kv_cache_cases(small=True), grid.kv_cache_cases()
    plain_varlen = [v for v in grid.varlen_cases(small=True) if not v.tensor_ops]  # and one tensor-op batch
    assert len(plain_varlen) == 1 and len(small) == 4 and set(small) <= set(full)
    assert any(k.wrong_table for k in small)
    packed_rows = lambda k: k.case.seqlen_q * (k.case.num_heads // k.case.num_kv_heads)  # noqa: E731
    assert any(k.page and 2 <= packed_rows(k) <= 16 for k in small)
    assert {(bool(k.page), k.bits) for k in full} == {(True, 0), (True, 4), (True, 8), (False, 0), (False, 8)}
    assert {v.dtype for v in grid.varlen_cases()} == {k.case.dtype for k in full} == {"f16", "bf16", "f32"}


def test_large_offsets_case_is_the_librarys_plan(tmp_path):
    """large_offsets.cu's case file: the library's forward and backward plans of the 2^32-element
    problem, q, k, v and dout left for the program to fill on the device (no bytes written), and
    the contiguous float16 views it samples rows of (large_offsets.cu checks them too)."""
    from flash_attention_metal import _native
    library = _native.native()
    entry = cases.plan_large(library)
    cases.write_case(entry, tmp_path)
    read = _read_case(tmp_path / "large_offsets_f16_d128_k16.case")
    assert (tmp_path / "large_offsets_f16_d128_k16.case").stat().st_size < 10_000
    kinds = dict(zip(read["names"], (b[1] for b in read["buffers"])))
    assert [n for n, k in kinds.items() if k == cases.KINDS["device"]] == ["q", "k", "v", "dout"]
    c = grid.large_offsets_case()
    problem = cases._problem(c, cases._place(c), library)
    expected = [*plan.create(problem, "forward").dispatches, *plan.create(problem, "backward").dispatches]
    assert [(d[0], d[1], d[5]) for d in read["dispatches"]] == [
        (d.kernel_name, d.threadgroups_per_grid, d.params) for d in expected]
    assert read["dispatches"][-1][0].startswith("flash_attention_backward_dkv_")  # the one it skips
    views = {o[0]: o[1:] for o in read["outputs"]}
    rows = 2**25 + 5
    assert sum(1 for o in read["outputs"]) == 7 and c.seqlen_q == rows and c.head_dim == 128
    for name in ("q", "dout", "out", "dq"):
        buffer, offset, dtype, *dims_strides = views[name]
        assert (offset, dtype, dims_strides[:4], dims_strides[6:]) == (0, 0, [1, 1, rows, 128], [128, 1])
        assert read["buffers"][buffer][0] == rows * 128 * 2 and rows * 128 > 2**32


def test_wrong_table_reaches_the_device_out_of_range(tmp_path):
    """The wrong-table case's block table buffer holds entries outside [0, num_blocks) (the
    first and last blocks' stand-ins and the spare entries), its cache rows the true table's."""
    from flash_attention_metal import _native
    library = _native.native()
    kc = next(k for k in grid.kv_cache_cases(small=True) if k.wrong_table)
    entry = cases.plan_kv_cache(kc, library, cases._split_rows(library))
    cases.write_case(entry, tmp_path)
    read = _read_case(tmp_path / f"{kc.name}.case")
    written = np.frombuffer(read["buffers"][read["names"].index("block_table")][2], np.int32)
    slots = entry["geometry"]["slots"]
    assert ((written < 0) | (written >= slots)).sum() == 4
    table = np.asarray(entry["geometry"]["table"])
    used = np.arange(table.size) % entry["geometry"]["max_blocks"] < -(-kc.case.seqlen_k // kc.page)
    assert np.array_equal(np.clip(written, 0, slots - 1)[used], table[used])
    assert not np.array_equal(written[used], table[used])
