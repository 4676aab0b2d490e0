"""Writes the plan-fed CUDA check's cases: the library's exported plans and seeded inputs, which
tests/cuda/replay.cu replays on the GPU and tests/cuda/judge.py judges (and the plan of
tests/cuda/large_offsets.cu's 2^32-element problem).

Two steps, so that the plans come from the library and the inputs stay off the wire:
  python3 tests/cuda/cases.py plan {small,full,large} PLANS.json   (a machine with the library)
  python3 tests/cuda/cases.py write PLANS.json FOLDER        (numpy only: inputs and case files)

``plan`` places each case's tensors on the device as the case's layout says (bhsd, bshd, slices of
a packed qkv tensor, rows with gaps; grid.py), describes them to the library as an ``fa_problem``
and asks ``flash_attention_metal.plan.create`` for the forward and backward plans (the GPU core
count of ``fa_plan_create``: FLASH_ATTENTION_GPU_CORES, else the nominal 10-core GPU off Metal), and
for short queries (at most FA_SPLIT_TILED_MAX_QUERY_ROWS rows) the forward planned for a GPU of
SPLIT_CORES cores where that plan differs (split-KV, or more chunks), into outputs of its own
(split_out, split_lse); grid.varlen_cases and grid.kv_cache_cases through the library's varlen
and KV-cache plans (plan_varlen, plan_kv_cache); ``large`` the one problem of large_offsets.cu
(plan_large); grid.merge_cases, two forwards over parts of the keys and fa_plan_create_merge's
plan (plan_merge); grid.tensor_cases (dense and varlen) through fa_plan_create_for with the
tensor-op library ready (TENSOR_TARGET) under FLASH_ATTENTION_TENSOR_OPS=1, the plans a host that
runs the Metal 4 tensor-op kernels gets with the tensor-op path forced (their lines end with tensor_ops=<passes> for judge.py). Nothing here
picks a kernel, a grid or a parameter value: every dispatch is the library's.

``write`` draws the inputs (N(0, 1) rounded to the dtype, seeded by the case name; masks, ALiBi
slopes and sinks as ``inputs`` describes; then the NaN and infinities of grid.NONFINITE_PLACEMENTS for issue 36's cases), writes for each
case FOLDER/NAME.case (the binary below)
and the judge's files (dump.h's format: NAME.q, .k, .v, .dout, .mask, .alibi, .sinks as float32
in logical order, and the case's cases.txt line in NAME.line).

NAME.case, little-endian:
  "FACASE2\\n"
  u32 buffers; per buffer: u32 length + name, u64 bytes, u32 kind (0 input: its bytes follow;
      1 output; 2 workspace; 3 filled on the device by the program that runs the case: the inputs
      of large_offsets.cu, too large to write)
  u32 dispatches; per dispatch: u32 length + kernel name, u32 threadgroups[3], u32 threads[3],
      u32 constants; per constant (the plan's specialisation): u32 index, u32 type (0 bool,
      1 uint), u32 value; u32 params index, u32 length + parameter bytes (length 0 where a binding
      at the params index holds the struct), u32 bindings; per binding: u32 index, u32 buffer,
      u64 byte offset
  u32 outputs; per output: u32 length + name (dump.h's), u32 buffer, u64 element offset,
      u32 dtype (0 f16, 1 bf16, 2 f32), u32 dims[4], u64 element strides[4]
Input buffers hold 0xff (NaN in every dtype) outside the tensors' views; the replay poisons output
and workspace buffers and checks that no output byte outside the outputs' views changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import struct
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import grid  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAGIC = b"FACASE2\n"
KINDS = {"input": 0, "output": 1, "workspace": 2, "device": 3}
DTYPE_CODES = {"f16": 0, "bf16": 1, "f32": 2}
# fa_specialization_type's values, by plan.Specialization's type names.
CONSTANT_TYPES = {"bool": 0, "uint": 1}
DTYPE_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
# The GPU core count of the extra forward of short queries: split-KV, in as many chunks as the keys allow.
SPLIT_CORES = 4096
# The override that forces the tensor-op path (docs/tensor-ops.md), set while a tensor-op case is
# planned, and the host the plan is made for (plan.Target's fields): the tensor-op library compiled,
# as the CUDA build compiles it (launch_table_tensor.cu).
TENSOR_OPS_VARIABLE = "FLASH_ATTENTION_TENSOR_OPS"
TENSOR_TARGET = {"tensor_library": "ready"}
QUERY_ROLES = ("q", "out", "dout", "dq")
VALUE_ROLES = ("v", "out", "dout", "dv")
TENSOR_ROLES = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")


# ---- plan (needs the library) -------------------------------------------------------------------

def _dims(c: grid.Case, role: str) -> tuple[int, int, int]:
    """(heads, seqlen, cols) of a tensor role."""
    query = role in QUERY_ROLES
    return ((c.num_heads if query else c.num_kv_heads), (c.seqlen_q if query else c.seqlen_k),
            (c.head_dim_v if role in VALUE_ROLES else c.head_dim))


def _place(c: grid.Case) -> dict:
    """Each tensor role's (buffer name, element offset, (batch, head, seq) strides) in the case's
    layout (grid.py); the buffer names of the layout."""
    placed = {}
    for role in TENSOR_ROLES:
        heads, seqlen, cols = _dims(c, role)
        buffer, offset = role, 0
        if c.layout == "bhsd":
            strides = (heads * seqlen * cols, seqlen * cols, cols)
        elif c.layout == "bshd":
            strides = (seqlen * heads * cols, cols, heads * cols)
        elif c.layout == "gapped":
            seq = cols + 3
            head = seqlen * seq + 5
            strides = (heads * head + 7, head, seq)
        else:  # qkv: q, k, v slices of one packed projection, dq, dk, dv of one gradient
            assert c.seqlen_q == c.seqlen_k and c.head_dim_v == c.head_dim, c.name
            width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            if role in ("out", "dout"):
                strides = (seqlen * heads * cols, cols, heads * cols)
            else:
                base = role[-1]
                buffer = "dqkv" if role.startswith("d") else "qkv"
                offset = {"q": 0, "k": c.num_heads * c.head_dim,
                          "v": (c.num_heads + c.num_kv_heads) * c.head_dim}[base]
                strides = (seqlen * width, cols, width)
        placed[role] = (buffer, offset, strides)
    return placed


def _extent(c: grid.Case, role: str, offset: int, strides) -> int:
    heads, seqlen, cols = _dims(c, role)
    return offset + (c.batch - 1) * strides[0] + (heads - 1) * strides[1] + (seqlen - 1) * strides[2] + cols


def _mask_strides(c: grid.Case) -> tuple[int, int, int, int]:
    """(batch, head, seq) element strides of the mask (0 on a broadcast axis; rows with gaps in the
    gapped layout) and its element count."""
    o = c.options
    seq = c.seqlen_k + (3 if c.layout == "gapped" else 0)
    head = c.seqlen_q * seq
    heads = c.num_heads if o.mask_per_head else 1
    batch = heads * head
    batches = c.batch if o.mask_per_batch else 1
    return (batch if o.mask_per_batch else 0, head if o.mask_per_head else 0, seq, batches * batch)


def _problem(c: grid.Case, placed: dict, library):
    from flash_attention_metal import _abi
    from flash_attention_metal._validation import Shape
    ffi, lib = library.ffi, library.lib
    shape = Shape(c.batch, c.num_heads, c.num_kv_heads, c.seqlen_q, c.seqlen_k, c.head_dim, c.head_dim_v)
    strides = {role: placed[role][2] for role in TENSOR_ROLES}
    p = _abi.new_problem(ffi, lib, shape, c.causal, c.softmax_scale, DTYPE_NAMES[c.dtype], strides)
    o = c.options
    # The pointers only say which optional inputs exist (fa_plan_create reads none).
    kind = {"boolean": "FA_ATTN_MASK_BOOL", "additive": "FA_ATTN_MASK_ADDITIVE",
            "additive_f32": "FA_ATTN_MASK_ADDITIVE_FLOAT32"}.get(o.mask)
    window = (o.window_left, o.window_right) if o.window_left >= 0 or o.window_right >= 0 else None
    _abi.set_score_fields(p, ffi, lib, window=window, softcap=o.softcap,
                          mask=(16, _mask_strides(c)[:3], kind) if kind else None,
                          alibi=(16, o.alibi_per_batch) if o.alibi else None, sinks=16 if o.sinks else None,
                          dropout=(c.dropout_p, c.dropout_seed, c.dropout_offset) if c.dropout_p > 0 else None)
    return p


def _split_rows(library) -> int:
    text = (ROOT / "Shaders" / "flash_attention_params.h").read_text()
    for line in text.splitlines():
        if line.startswith("#define FA_SPLIT_TILED_MAX_QUERY_ROWS "):
            return int(line.split()[2])
    raise SystemExit("cases.py: FA_SPLIT_TILED_MAX_QUERY_ROWS not found in Shaders/flash_attention_params.h")


def _is_split(made) -> bool:
    return any(d.kernel_name.startswith("flash_attention_forward_combine_") for d in made.dispatches)


def _buffer(buffers: dict, name: str, nbytes: int, kind: str) -> str:
    """Buffer `name` of a case, at least nbytes bytes, of kind "input", "output" or "workspace"."""
    entry = buffers.setdefault(name, {"bytes": 0, "kind": kind})
    entry["bytes"] = max(entry["bytes"], nbytes)
    return name


def _create(problem, pass_name: str, library, tensor_ops: bool = False):
    """plan.create's plan of `problem`; with `tensor_ops`, for TENSOR_TARGET under
    FLASH_ATTENTION_TENSOR_OPS=1 (the tensor-op path forced; the CUDA build runs those kernels), which
    must then name a tensor-op kernel (else the case would not test them)."""
    from flash_attention_metal import plan
    if not tensor_ops:
        return plan.create(problem, pass_name, library=library)
    saved = os.environ.get(TENSOR_OPS_VARIABLE)
    os.environ[TENSOR_OPS_VARIABLE] = "1"
    try:
        made = plan.create(problem, pass_name, library=library, target=plan.Target(**TENSOR_TARGET))
    finally:
        if saved is None:
            del os.environ[TENSOR_OPS_VARIABLE]
        else:
            os.environ[TENSOR_OPS_VARIABLE] = saved
    if not any("tensor" in d.kernel_name for d in made.dispatches):
        raise SystemExit(f"cases.py: the {pass_name} plan of a tensor-op case names no tensor-op kernel: "
                         + ", ".join(d.kernel_name for d in made.dispatches))
    return made


def _tensor_passes(passes: list) -> list[str]:
    """The passes ("forward", "backward") whose plans name a tensor-op kernel: judge.py holds their
    outputs to the accuracy rule's tensor-op term."""
    return [name for name, made, _ in passes if any("tensor" in d.kernel_name for d in made.dispatches)]


def _split_forward(problem, library):
    """The forward plan of `problem` for a GPU of SPLIT_CORES cores."""
    from flash_attention_metal import plan
    saved = os.environ.get("FLASH_ATTENTION_GPU_CORES")
    os.environ["FLASH_ATTENTION_GPU_CORES"] = str(SPLIT_CORES)
    try:
        return plan.create(problem, "forward", library=library)
    finally:
        if saved is None:
            del os.environ["FLASH_ATTENTION_GPU_CORES"]
        else:
            os.environ["FLASH_ATTENTION_GPU_CORES"] = saved


def _add_split(passes: list, problem, library, seqlen_q: int, split_rows: int, tensors: dict, buffers: dict,
               outputs: list) -> None:
    """For short queries, the forward planned for a large GPU where that plan differs from the
    case's (split-KV, or more chunks): a pass into split_out and split_lse, tensors like out's and
    lse's in buffers of their own."""
    if seqlen_q > split_rows:
        return
    split = _split_forward(problem, library)
    if _is_split(split) and split.dispatches != passes[0][1].dispatches:
        for role in ("out", "lse"):
            tensors["split_" + role] = dict(tensors[role], buffer=_buffer(
                buffers, "split_" + role, buffers[tensors[role]["buffer"]]["bytes"], "output"))
        passes.append(("split", split, {"out": "split_out", "lse": "split_lse"}))
        outputs += ["split_out", "split_lse"]


def _dispatches(name: str, passes: list, tensors: dict, buffers: dict) -> list:
    """The passes' dispatches as JSON values, each binding at the case's buffer and byte offset of
    its role (a workspace per pass and role); a dispatch that reads its parameters from a buffer
    (params_from_buffer: a varlen pass's sequence table) has no parameter bytes."""
    dispatches = []
    for pass_name, made, renamed in passes:
        bases = {}
        for b in made.buffers:
            role = renamed.get(b.role, b.role)
            if b.usage == "workspace":
                bases[b.role] = (_buffer(buffers, f"{pass_name}_{b.role}", b.byte_count, "workspace"), 0)
                continue
            if role not in tensors:
                raise SystemExit(f"cases.py: {name}: the {pass_name} plan binds {b.role}, which the case lacks")
            t = tensors[role]
            base = t["offset"] * np.dtype(_numpy_dtype(t["dtype"])).itemsize
            if base + b.byte_count > buffers[t["buffer"]]["bytes"]:
                raise SystemExit(f"cases.py: {name}: {b.role} needs {b.byte_count} bytes from {base}, "
                                 f"its buffer has {buffers[t['buffer']]['bytes']}")
            bases[b.role] = (t["buffer"], base)
        for d in made.dispatches:
            dispatches.append({"kernel": d.kernel_name, "threadgroups": list(d.threadgroups_per_grid),
                               "threads": list(d.threads_per_threadgroup),
                               "constants": [[x.index, CONSTANT_TYPES[x.type], x.value] for x in d.specialization],
                               "params_index": d.params_index,
                               "params": "" if d.params_from_buffer else d.params.hex(),
                               "bindings": [[x.index, bases[x.role][0], bases[x.role][1] + x.byte_offset]
                                            for x in d.bindings]})
    return dispatches


def plan_case(c: grid.Case, library, split_rows: int) -> dict:
    """The case's device buffers, tensors, dispatches (forward, backward, and the extra split-KV
    forward where it applies), outputs and the passes planned onto tensor-op kernels, as JSON
    values."""
    size = 4 if c.dtype == "f32" else 2
    placed = _place(c)
    buffers: dict[str, dict] = {}

    def buffer(name: str, nbytes: int, kind: str) -> str:
        return _buffer(buffers, name, nbytes, kind)

    tensors = {}
    for role in TENSOR_ROLES:
        name, offset, strides = placed[role]
        kind = "output" if role in ("out", "dq", "dk", "dv") else "input"
        buffer(name, _extent(c, role, offset, strides) * size, kind)
        heads, seqlen, cols = _dims(c, role)
        tensors[role] = {"buffer": name, "offset": offset, "dtype": c.dtype,
                         "dims": [c.batch, heads, seqlen, cols], "strides": [*strides, 1]}
    lse_strides = [c.num_heads * c.seqlen_q, c.seqlen_q, 1, 0]
    for role in ("lse",):
        buffer(role, c.batch * c.num_heads * c.seqlen_q * 4, "output")
        tensors[role] = {"buffer": role, "offset": 0, "dtype": "f32",
                         "dims": [c.batch, c.num_heads, c.seqlen_q, 1], "strides": lse_strides}
    o = c.options
    if o.mask != "none":
        mb, mh, ms, count = _mask_strides(c)
        mask_size = {"boolean": 1, "additive": size, "additive_f32": 4}[o.mask]
        buffer("attn_mask", count * mask_size, "input")
        tensors["attn_mask"] = {"buffer": "attn_mask", "offset": 0,
                                "dtype": {"boolean": "u8", "additive": c.dtype, "additive_f32": "f32"}[o.mask],
                                "dims": [c.batch if o.mask_per_batch else 1, c.num_heads if o.mask_per_head else 1,
                                         c.seqlen_q, c.seqlen_k], "strides": [mb, mh, ms, 1]}
    if o.alibi:
        batches = c.batch if o.alibi_per_batch else 1
        buffer("alibi_slopes", batches * c.num_heads * 4, "input")
        tensors["alibi_slopes"] = {"buffer": "alibi_slopes", "offset": 0, "dtype": "f32",
                                   "dims": [1, 1, batches, c.num_heads], "strides": [0, 0, c.num_heads, 1]}
    if o.sinks:
        buffer("sinks", c.num_heads * 4, "input")
        buffer("dsinks", c.num_heads * 4, "output")
        for role in ("sinks", "dsinks"):
            tensors[role] = {"buffer": role, "offset": 0, "dtype": "f32", "dims": [1, 1, 1, c.num_heads],
                             "strides": [0, 0, 0, 1]}
    problem = _problem(c, placed, library)
    passes = [("forward", _create(problem, "forward", library, c.tensor_ops), {}),
              ("backward", _create(problem, "backward", library, c.tensor_ops), {})]
    tensor_passes = _tensor_passes(passes)
    outputs = ["out", "lse", "dq", "dk", "dv"] + (["dsinks"] if o.sinks else [])
    _add_split(passes, problem, library, c.seqlen_q, split_rows, tensors, buffers, outputs)
    dispatches = _dispatches(c.name, passes, tensors, buffers)
    return {"name": c.name, "case": dataclasses.asdict(c), "buffers": buffers, "tensors": tensors,
            "dispatches": dispatches, "outputs": outputs, "tensor_passes": tensor_passes}


def _contiguous(role: str, rows: int, heads: int, cols: int, dtype: str, buffers: dict, kind: str) -> dict:
    """Tensor `role` packed (rows, heads, cols) in a buffer of its own, logically (1, heads, rows,
    cols): a varlen pass's layout."""
    _buffer(buffers, role, rows * heads * cols * np.dtype(_numpy_dtype(dtype)).itemsize, kind)
    return {"buffer": role, "offset": 0, "dtype": dtype, "dims": [1, heads, rows, cols],
            "strides": [0, cols, heads * cols, 1]}


def varlen_problem(v: grid.VarlenCase, library):
    """The case's fa_problem (packed contiguous tensors, cu_seqlens_q and cu_seqlens_k) and the cffi
    tables it points to, which must stay alive while it is used."""
    from flash_attention_metal import _abi
    from flash_attention_metal._validation import Shape
    ffi, lib = library.ffi, library.lib
    tables = [ffi.new("int32_t[]", np.concatenate([[0], np.cumsum(lengths)]).tolist())
              for lengths in (v.seqlens_q, v.seqlens_k)]
    shape = Shape(len(v.seqlens_q), v.num_heads, v.num_kv_heads, sum(v.seqlens_q), sum(v.seqlens_k), v.head_dim,
                  v.head_dim_v)
    problem = _abi.new_problem(ffi, lib, shape, v.causal, v.softmax_scale, DTYPE_NAMES[v.dtype], {})
    o = v.options
    _abi.set_score_fields(problem, ffi, lib, window=(o.window_left, o.window_right)
                          if o.window_left >= 0 or o.window_right >= 0 else None, softcap=o.softcap,
                          alibi=(16, o.alibi_per_batch) if o.alibi else None)
    problem.cu_seqlens_q, problem.cu_seqlens_k = tables
    problem.max_seqlen_q, problem.max_seqlen_k = max(v.seqlens_q), max(v.seqlens_k)
    return problem, tables


def plan_varlen(v: grid.VarlenCase, library) -> dict:
    """A variable-length case: the packed tensors and the cu_seqlens tables in buffers of their own,
    the library's forward and backward varlen plans (fa_plan_create with cu_seqlens_q and
    cu_seqlens_k: the sequence-table dispatch first), and per sequence n the outputs s<n>.out,
    s<n>.lse, s<n>.dq, s<n>.dk, s<n>.dv (views of the packed outputs), which judge.py judges as the
    dense case NAME.s<n> (VarlenCase.sequence)."""
    h, kv, d, dv = v.num_heads, v.num_kv_heads, v.head_dim, v.head_dim_v
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).tolist() for lengths in (v.seqlens_q, v.seqlens_k))
    total_q, total_k = cu_q[-1], cu_k[-1]
    buffers: dict[str, dict] = {}
    tensors = {role: _contiguous(role, rows, heads, cols, v.dtype, buffers, kind)
               for role, rows, heads, cols, kind in (
                   ("q", total_q, h, d, "input"), ("k", total_k, kv, d, "input"), ("v", total_k, kv, dv, "input"),
                   ("dout", total_q, h, dv, "input"), ("out", total_q, h, dv, "output"),
                   ("dq", total_q, h, d, "output"), ("dk", total_k, kv, d, "output"),
                   ("dv", total_k, kv, dv, "output"))}
    _buffer(buffers, "lse", h * total_q * 4, "output")
    tensors["lse"] = {"buffer": "lse", "offset": 0, "dtype": "f32", "dims": [1, h, total_q, 1],
                      "strides": [0, total_q, 1, 0]}
    if v.options.alibi:
        batches = len(v.seqlens_q) if v.options.alibi_per_batch else 1
        _buffer(buffers, "alibi_slopes", batches * h * 4, "input")
        tensors["alibi_slopes"] = {"buffer": "alibi_slopes", "offset": 0, "dtype": "f32", "dims": [1, 1, batches, h],
                                   "strides": [0, 0, h, 1]}
    tables = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    for role, table in tables.items():
        _buffer(buffers, role, 4 * len(table), "input")
        tensors[role] = {"buffer": role, "offset": 0, "dtype": "i32", "dims": [1, 1, 1, len(table)],
                         "strides": [0, 0, 0, 1]}
    problem, held = varlen_problem(v, library)  # noqa: F841  (held: the tables, alive while planning)
    passes = [("forward", _create(problem, "forward", library, v.tensor_ops), {}),
              ("backward", _create(problem, "backward", library, v.tensor_ops), {})]
    outputs = []
    for n in range(len(v.seqlens_q)):
        rows_q, rows_k = v.seqlens_q[n], v.seqlens_k[n]
        for role, first, rows in (("out", cu_q[n], rows_q), ("lse", cu_q[n], rows_q), ("dq", cu_q[n], rows_q),
                                  ("dk", cu_k[n], rows_k), ("dv", cu_k[n], rows_k)):
            t = tensors[role]
            dims = [1, t["dims"][1], rows, t["dims"][3]]
            tensors[f"s{n}.{role}"] = dict(t, offset=first * t["strides"][2], dims=dims)
            outputs.append(f"s{n}.{role}")
    return {"kind": "varlen", "name": v.name, "case": dataclasses.asdict(v), "buffers": buffers,
            "tensors": tensors, "dispatches": _dispatches(v.name, passes, tensors, buffers), "outputs": outputs,
            "tables": tables, "tensor_passes": _tensor_passes(passes)}


def _cache_geometry(kc: grid.KVCacheCase) -> dict:
    """Slots (sequences, or blocks when paged), rows per slot, the block table (max_blocks per
    sequence: one spare; blocks in a seeded shuffled order, two never used; with wrong_table, the
    first and the last block among the used ones, and "written_table": what the device gets, the
    first block as -7, the last as 100 past it, the spare entries +-2^31 - 1) and the units per row
    (elements, or packed uint32 words) and scale groups of k and v."""
    c = kc.case
    geometry = {"rows": kc.page or kc.cache_rows, "max_blocks": 0, "table": []}
    if kc.page:
        max_blocks = geometry["max_blocks"] = -(-c.seqlen_k // kc.page) + 1
        slots = geometry["slots"] = c.batch * max_blocks + 2
        order = np.random.default_rng(_fnv1a(kc.name) % 2**32).permutation(slots)
        if kc.wrong_table:  # blocks 0 and slots - 1 hold rows (row 0 of sequences 0 and 1)
            order = np.concatenate([[0, slots - 1], order[(order != 0) & (order != slots - 1)]])
            order[[1, max_blocks]] = order[[max_blocks, 1]]
        geometry["table"] = order[:c.batch * max_blocks].tolist()
        if kc.wrong_table:
            used = -(-c.seqlen_k // kc.page)
            geometry["written_table"] = [
                (-7 if block == 0 else slots + 99 if block == slots - 1 else block) if i % max_blocks < used
                else (2**31 - 1 if i % 2 else -2**31) for i, block in enumerate(geometry["table"])]
    else:
        geometry["slots"] = c.batch
    for role, cols in (("k", c.head_dim), ("v", c.head_dim_v)):
        geometry[role + "_units"] = cols * kc.bits // 32 if kc.bits else cols
        geometry[role + "_groups"] = cols // kc.group_size if kc.bits else 0
    return geometry


def plan_kv_cache(kc: grid.KVCacheCase, library, split_rows: int) -> dict:
    """A KV-cache case: q, out, lse as a dense case's (bhsd), the caches (elements of the dtype, or
    packed uint32 words with their scales and biases) and the block table in buffers of their own,
    the library's forward plan (fa_plan_create with kv_cache_rows and the cache fields), and for
    short queries the forward planned for a large GPU (split_out, split_lse)."""
    from flash_attention_metal import plan
    c = kc.case
    g = _cache_geometry(kc)
    size = 4 if c.dtype == "f32" else 2
    placed = _place(c)
    buffers: dict[str, dict] = {}
    tensors = {}
    for role, kind in (("q", "input"), ("out", "output")):
        _, offset, strides = placed[role]
        _buffer(buffers, role, _extent(c, role, offset, strides) * size, kind)
        heads, seqlen, cols = _dims(c, role)
        tensors[role] = {"buffer": role, "offset": 0, "dtype": c.dtype, "dims": [c.batch, heads, seqlen, cols],
                         "strides": [*strides, 1]}
    _buffer(buffers, "lse", c.batch * c.num_heads * c.seqlen_q * 4, "output")
    tensors["lse"] = {"buffer": "lse", "offset": 0, "dtype": "f32", "dims": [c.batch, c.num_heads, c.seqlen_q, 1],
                      "strides": [c.num_heads * c.seqlen_q, c.seqlen_q, 1, 0]}
    slots, rows, kv = g["slots"], g["rows"], c.num_kv_heads
    cache_strides = {}
    for role in ("k", "v"):
        units, groups = g[role + "_units"], g[role + "_groups"]
        dtype = "u32" if kc.bits else c.dtype
        tensors[role] = _cache_tensor(role, dtype, slots, kv, rows, units, buffers)
        cache_strides[role] = tuple(tensors[role]["strides"][:3])
        if kc.bits:
            for part in ("scales", "biases"):
                tensors[f"{role}_{part}"] = _cache_tensor(f"{role}_{part}", c.dtype, slots, kv, rows, groups, buffers)
    if kc.page:
        _buffer(buffers, "block_table", 4 * len(g["table"]), "input")
        tensors["block_table"] = {"buffer": "block_table", "offset": 0, "dtype": "i32",
                                  "dims": [1, 1, c.batch, g["max_blocks"]], "strides": [0, 0, g["max_blocks"], 1]}
    problem, table = kv_cache_problem(kc, g, cache_strides, library)  # noqa: F841  (table: alive while planning)
    passes = [("forward", plan.create(problem, "forward", library=library), {})]
    outputs = ["out", "lse"]
    _add_split(passes, problem, library, c.seqlen_q, split_rows, tensors, buffers, outputs)
    return {"kind": "kv_cache", "name": kc.name, "case": dataclasses.asdict(kc), "buffers": buffers,
            "tensors": tensors, "dispatches": _dispatches(kc.name, passes, tensors, buffers), "outputs": outputs,
            "geometry": g}


def kv_cache_problem(kc: grid.KVCacheCase, g: dict, cache_strides: dict, library):
    """The case's fa_problem (q and out bhsd, the caches by `cache_strides` and the geometry `g`)
    and the cffi block table it points to, which must stay alive while it is used; the scales and
    biases are marked present only (fa_plan_create reads none of them)."""
    from flash_attention_metal import _abi
    from flash_attention_metal._validation import Shape
    ffi, lib = library.ffi, library.lib
    c = kc.case
    shape = Shape(c.batch, c.num_heads, c.num_kv_heads, c.seqlen_q, c.seqlen_k, c.head_dim, c.head_dim_v)
    problem = _abi.new_problem(ffi, lib, shape, c.causal, c.softmax_scale, DTYPE_NAMES[c.dtype], cache_strides)
    problem.kv_cache_rows = g["rows"]
    table = ffi.new("int32_t[]", g["table"] or [0])
    if kc.page:
        problem.kv_block_table, problem.kv_max_blocks, problem.kv_num_blocks = table, g["max_blocks"], g["slots"]
    if kc.bits:
        problem.kv_bits, problem.kv_group_size = kc.bits, kc.group_size
        for field_name in ("k_scales", "k_biases", "v_scales", "v_biases"):
            setattr(problem, field_name, ffi.cast("const void *", 16))
    return problem, table


def _cache_tensor(name: str, dtype: str, slots: int, heads: int, rows: int, units: int, buffers: dict) -> dict:
    """A (slots, heads, rows, units) contiguous cache tensor in buffer `name`, an input."""
    _buffer(buffers, name, slots * heads * rows * units * np.dtype(_numpy_dtype(dtype)).itemsize, "input")
    return {"buffer": name, "offset": 0, "dtype": dtype, "dims": [slots, heads, rows, units],
            "strides": [heads * rows * units, rows * units, units, 1]}


def merge_problems(m: grid.MergeCase, library) -> tuple:
    """The fa_problems of the two parts of a merge case: keys [0, split) and [split, seqlen_k) of
    the whole k and v (bhsd strides of the whole tensors)."""
    placed = _place(m.case)  # the whole tensors' strides
    return tuple(_problem(dataclasses.replace(m.case, seqlen_k=keys), placed, library)
                 for keys in (m.split, m.case.seqlen_k - m.split))


def plan_merge(m: grid.MergeCase, library) -> dict:
    """A merge case: q, k, v as the dense case's; the library's forward plans of the two parts of
    the keys (the second binding k and v at the split's offset) into out_a, lse_a and out_b, lse_b
    (workspaces here), then fa_plan_create_merge's plan into out and lse, the outputs."""
    from flash_attention_metal import plan
    ffi, lib = library.ffi, library.lib
    c = m.case
    placed = _place(c)
    buffers: dict[str, dict] = {}
    tensors = {}
    for role, kind in (("q", "input"), ("k", "input"), ("v", "input"), ("out", "output")):
        _, offset, strides = placed[role]
        _buffer(buffers, role, _extent(c, role, offset, strides) * 2, kind)
        heads, seqlen, cols = _dims(c, role)
        tensors[role] = {"buffer": role, "offset": 0, "dtype": c.dtype, "dims": [c.batch, heads, seqlen, cols],
                         "strides": [*strides, 1]}
    rows = c.batch * c.num_heads * c.seqlen_q
    _buffer(buffers, "lse", rows * 4, "output")
    tensors["lse"] = {"buffer": "lse", "offset": 0, "dtype": "f32", "dims": [c.batch, c.num_heads, c.seqlen_q, 1],
                      "strides": [c.num_heads * c.seqlen_q, c.seqlen_q, 1, 0]}
    for part in ("a", "b"):
        for role in ("out", "lse"):
            name = f"{role}_{part}"
            tensors[name] = dict(tensors[role], buffer=_buffer(buffers, name, buffers[role]["bytes"], "workspace"))
    for role in ("k", "v"):
        tensors[role + "_b"] = dict(tensors[role], offset=m.split * tensors[role]["strides"][2])
    first, second = merge_problems(m, library)
    holder = ffi.new("fa_plan **")
    library.raise_for_status(lib.fa_plan_create_merge(rows, c.head_dim_v, holder))
    try:
        merge = plan.read(holder[0], library)
    finally:
        lib.fa_plan_destroy(holder[0])
    passes = [("forward_a", plan.create(first, "forward", library=library), {"out": "out_a", "lse": "lse_a"}),
              ("forward_b", plan.create(second, "forward", library=library),
               {"k": "k_b", "v": "v_b", "out": "out_b", "lse": "lse_b"}),
              ("merge", merge, {})]
    return {"kind": "merge", "name": m.name, "case": dataclasses.asdict(m), "buffers": buffers, "tensors": tensors,
            "dispatches": _dispatches(m.name, passes, tensors, buffers), "outputs": ["out", "lse"]}


def plan_large(library) -> dict:
    """large_offsets.cu's problem (grid.large_offsets_case: q, out, dout, dq of more than 2^32
    elements) with the library's forward and backward plans. q, k, v and dout are "device" buffers
    (large_offsets.cu fills them); the outputs list the views it samples rows of (q, k, v and dout
    too). It runs every dispatch but dK/dV's (each key's gradient sums over all query rows)."""
    from flash_attention_metal import plan
    c = grid.large_offsets_case()
    placed = _place(c)
    buffers: dict[str, dict] = {}
    tensors = {}
    for role in TENSOR_ROLES:
        _, offset, strides = placed[role]
        kind = "device" if role in ("q", "k", "v", "dout") else "output"
        _buffer(buffers, role, _extent(c, role, offset, strides) * 2, kind)
        heads, seqlen, cols = _dims(c, role)
        tensors[role] = {"buffer": role, "offset": 0, "dtype": c.dtype, "dims": [c.batch, heads, seqlen, cols],
                         "strides": [*strides, 1]}
    _buffer(buffers, "lse", c.seqlen_q * 4, "output")
    tensors["lse"] = {"buffer": "lse", "offset": 0, "dtype": "f32", "dims": [1, 1, c.seqlen_q, 1],
                      "strides": [c.seqlen_q, c.seqlen_q, 1, 0]}
    problem = _problem(c, placed, library)
    passes = [("forward", plan.create(problem, "forward", library=library), {}),
              ("backward", plan.create(problem, "backward", library=library), {})]
    return {"kind": "large", "name": c.name, "case": dataclasses.asdict(c), "buffers": buffers, "tensors": tensors,
            "dispatches": _dispatches(c.name, passes, tensors, buffers),
            "outputs": ["q", "k", "v", "dout", "out", "lse", "dq"]}


def plan_grid(name: str, out: pathlib.Path) -> int:
    sys.path.insert(0, str(ROOT / "python"))
    from flash_attention_metal import _native
    library = _native.native()
    split_rows = _split_rows(library)
    if name == "large":
        planned = [plan_large(library)]
    else:
        small = name == "small"
        cases = grid.small_grid() if small else grid.full_grid()
        planned = [plan_case(c, library, split_rows) for c in cases]
        planned += [plan_varlen(v, library) for v in grid.varlen_cases(small)]
        planned += [plan_kv_cache(kc, library, split_rows) for kc in grid.kv_cache_cases(small)]
        planned += [plan_merge(m, library) for m in grid.merge_cases()]
    out.write_text(json.dumps(planned, separators=(",", ":")))
    print(f"cases.py: {len(planned)} cases of the {name} grid planned into {out}")
    return 0


# ---- write (numpy only) -------------------------------------------------------------------------

def _numpy_dtype(name: str):
    if name == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"f16": np.float16, "f32": np.float32, "u8": np.uint8, "i32": np.int32, "u32": np.uint32}[name]


def _fnv1a(text: str) -> int:
    value = 0xcbf29ce484222325
    for byte in text.encode():
        value = ((value ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return value


class SplitMix64:
    """The inputs' generator (splitmix64, uniform on (0, 1), Box-Muller normals), drawn in bulk;
    seeded by the case name, so a filtered run sees the same inputs as the full one."""

    GOLDEN = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, seed: int):
        self.seed = np.uint64(seed)
        self.drawn = 0

    def uniform(self, count: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = self.seed + np.arange(self.drawn + 1, self.drawn + 1 + count, dtype=np.uint64) * self.GOLDEN
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z ^= z >> np.uint64(31)
        self.drawn += count
        return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)

    def normal(self, count: int, dtype) -> np.ndarray:
        """`count` standard normals rounded to float32 then to `dtype`, as float32."""
        pairs = (count + 1) // 2
        u = self.uniform(2 * pairs)
        radius, angle = np.sqrt(-2.0 * np.log(u[0::2])), 6.283185307179586 * u[1::2]
        values = np.empty(2 * pairs)
        values[0::2], values[1::2] = radius * np.cos(angle), radius * np.sin(angle)
        return values[:count].astype(np.float32).astype(dtype).astype(np.float32)


def inputs(c: grid.Case) -> dict[str, np.ndarray]:
    """The case's inputs as float32 in logical order, seeded by the case's name: q, k, v and dout
    from N(0, 1) rounded to the dtype; a boolean mask allowing 3 in 4 pairs, an additive one of
    N(0, 1) values hiding 1 in 5 with the case's mask_hide (-inf, or float32's lowest), each with
    one query row hidden entirely per mask head when seqlen_q >= 4; ALiBi's standard slopes
    2^(-8 (h + 1) / H), times 1 + b / 4 per batch; sinks from N(0, 1) + 1."""
    rng = SplitMix64(_fnv1a(c.name))
    dtype = _numpy_dtype(c.dtype)
    b, h, kv, sq, sk = c.batch, c.num_heads, c.num_kv_heads, c.seqlen_q, c.seqlen_k
    x = {}
    for name, shape in (("q", (b, h, sq, c.head_dim)), ("k", (b, kv, sk, c.head_dim)),
                        ("v", (b, kv, sk, c.head_dim_v)), ("dout", (b, h, sq, c.head_dim_v))):
        x[name] = rng.normal(math.prod(shape), dtype).reshape(shape)
    o = c.options
    if o.mask != "none":
        mb, mh = (b if o.mask_per_batch else 1), (h if o.mask_per_head else 1)
        shape = (mb, mh, sq, sk)
        mask = rng.normal(math.prod(shape), dtype if o.mask == "additive" else np.float32).reshape(shape)
        draw = rng.uniform(math.prod(shape)).reshape(shape)
        empty = np.full((mb, mh, sq, 1), False)
        if sq >= 4:
            for i in range(mb):
                for j in range(mh):
                    empty[i, j, (1 + i + 2 * j) % sq] = True
        if o.mask == "boolean":
            mask = (~empty & (draw < 0.75)).astype(np.float32)
        else:
            mask = np.where(empty | (draw < 0.2), np.float32(c.mask_hide), mask)
        x["mask"] = mask
    if o.alibi:
        slopes = [[2.0 ** (-8.0 * (head + 1) / h) * (1.0 + 0.25 * batch) for head in range(h)]
                  for batch in range(b if o.alibi_per_batch else 1)]
        x["alibi"] = np.array(slopes if o.alibi_per_batch else slopes[0], np.float32)
    if o.sinks:
        x["sinks"] = rng.normal(h, np.float32) + np.float32(1)
    _plant_nonfinite(c, x)
    return x


def _plant_nonfinite(c: grid.Case, x: dict[str, np.ndarray]) -> None:
    """Writes the case's NaN and infinities (grid.NONFINITE_PLACEMENTS) into the drawn inputs,
    after every draw, so the finite values stay the seeded ones."""
    for tensor, batch, head, row, column, value in grid.NONFINITE_PLACEMENTS.get(c.nonfinite, ()):
        rows = x[tensor].shape[2]
        if row < rows:
            x[tensor][batch, head, row % rows, column] = value


def _scatter(image: bytearray, tensor: dict, values: np.ndarray) -> None:
    dtype = np.dtype(_numpy_dtype(tensor["dtype"]))
    view = np.frombuffer(image, dtype=dtype)
    dims, strides = tensor["dims"], tensor["strides"]
    target = np.lib.stride_tricks.as_strided(view[tensor["offset"]:], shape=dims,
                                             strides=[s * dtype.itemsize for s in strides], writeable=True)
    target[...] = values.reshape(dims).astype(dtype)


def _line(c: grid.Case, outputs: list[str], tensor_passes=()) -> str:
    """The case's cases.txt line (dump.h), with dropout_p, seed and offset after the outputs when
    the case has dropout, and last tensor_ops=<passes> when plans of the case ran tensor-op kernels
    (judge.py reads them)."""
    o = c.options
    return (f"{c.name} {c.dtype} {c.batch} {c.num_heads} {c.num_kv_heads} {c.seqlen_q} {c.seqlen_k} "
            f"{c.head_dim} {c.head_dim_v} {int(c.causal)} {c.softmax_scale:.9g} {o.window_left} {o.window_right} "
            f"{o.softcap:.9g} {grid.MASKS.index(o.mask)} {int(o.mask_per_batch)} {int(o.mask_per_head)} "
            f"{int(o.alibi)} {int(o.alibi_per_batch)} {int(o.sinks)} {','.join(outputs)}"
            + (f" {c.dropout_p:.9g} {c.dropout_seed} {c.dropout_offset}" if c.dropout_p > 0 else "")
            + (f" tensor_ops={','.join(tensor_passes)}" if tensor_passes else "") + "\n")


def _write_dense(entry: dict, images: dict, folder: pathlib.Path) -> str:
    """A grid.Case's inputs into the images and the judge's files; its cases.txt line."""
    fields = dict(entry["case"])
    fields["options"] = grid.Options(**fields["options"])
    c = grid.Case(**fields)
    tensor_of = {"q": "q", "k": "k", "v": "v", "dout": "dout", "mask": "attn_mask", "alibi": "alibi_slopes",
                 "sinks": "sinks"}
    for name, array in inputs(c).items():
        tensor = entry["tensors"][tensor_of[name]]
        _scatter(images[tensor["buffer"]], tensor, array)
        array.astype(np.float32).tofile(folder / f"{c.name}.{name}")
    return _line(c, entry["outputs"], entry.get("tensor_passes", ()))


def _write_tables(entry: dict, images: dict, tables: dict) -> None:
    """int32 tables (cu_seqlens, a block table) into their buffers."""
    for role, values in tables.items():
        data = np.asarray(values, np.int32).tobytes()
        images[entry["tensors"][role]["buffer"]][:len(data)] = data


def _write_varlen(entry: dict, images: dict, folder: pathlib.Path) -> str:
    """A VarlenCase's packed inputs (N(0, 1) rounded to the dtype, seeded by its name) and tables
    into the images; per sequence n the judge's files of the dense case NAME.s<n> (its rows of q,
    k, v, dout) and its cases.txt line."""
    fields = dict(entry["case"])
    fields["options"] = grid.Options(**fields["options"])
    fields["seqlens_q"], fields["seqlens_k"] = tuple(fields["seqlens_q"]), tuple(fields["seqlens_k"])
    v = grid.VarlenCase(**fields)
    rng, dtype = SplitMix64(_fnv1a(v.name)), _numpy_dtype(v.dtype)
    cu = entry["tables"]
    values = {}
    for role in ("q", "k", "v", "dout"):
        _, heads, rows, cols = entry["tensors"][role]["dims"]
        values[role] = rng.normal(rows * heads * cols, dtype).reshape(1, rows, heads, cols).transpose(0, 2, 1, 3)
        _scatter(images[role], entry["tensors"][role], values[role])
    _write_tables(entry, images, cu)
    slopes = None
    if v.options.alibi:  # the dense cases' slopes (inputs()), one row per sequence with alibi_per_batch
        batches = len(v.seqlens_q) if v.options.alibi_per_batch else 1
        slopes = np.array([[2.0 ** (-8.0 * (head + 1) / v.num_heads) * (1.0 + 0.25 * batch)
                            for head in range(v.num_heads)] for batch in range(batches)], np.float32)
        _scatter(images["alibi_slopes"], entry["tensors"]["alibi_slopes"], slopes)
    lines = []
    for n in range(len(v.seqlens_q)):
        sequence = v.sequence(n)
        for role in ("q", "k", "v", "dout"):
            table = cu["cu_seqlens_k" if role in ("k", "v") else "cu_seqlens_q"]
            values[role][:, :, table[n]:table[n + 1]].astype(np.float32).tofile(folder / f"{sequence.name}.{role}")
        if slopes is not None:
            slopes[n if v.options.alibi_per_batch else 0].tofile(folder / f"{sequence.name}.alibi")
        lines.append(_line(sequence, ["out", "lse", "dq", "dk", "dv"], entry.get("tensor_passes", ())))
    return "".join(lines)


def _quantized():
    """python/flash_attention_metal/quantized.py (numpy only), loaded by path: mx.quantize's format."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fa_quantized", ROOT / "python" / "flash_attention_metal" /
                                                  "quantized.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_kv_cache(entry: dict, images: dict, folder: pathlib.Path) -> str:
    """A KVCacheCase's inputs (seeded by its name): q, and each sequence's seqlen_k keys and values
    placed in the cache rows the geometry gives (quantized with mx.quantize's rule when bits is
    set); every other cache row keeps 0xff (NaN, or NaN scales). The judge's files hold q, the
    sequences' keys and values in logical order (B, H_kv, seqlen_k, D), dout (unused: no backward)
    and for a quantized cache k_exact and v_exact, their float64 dequantization."""
    fields = dict(entry["case"])
    case = dict(fields.pop("case"))
    case["options"] = grid.Options(**case["options"])
    kc = grid.KVCacheCase(grid.Case(**case), **fields)
    c, g = kc.case, entry["geometry"]
    rng, dtype = SplitMix64(_fnv1a(kc.name)), _numpy_dtype(c.dtype)
    b, kv, sk = c.batch, c.num_kv_heads, c.seqlen_k
    q = rng.normal(b * c.num_heads * c.seqlen_q * c.head_dim, dtype).reshape(b, c.num_heads, c.seqlen_q, c.head_dim)
    _scatter(images["q"], entry["tensors"]["q"], q)
    files = {"q": q}
    t = np.arange(sk)
    slot = (np.asarray(g["table"], np.int64).reshape(b, -1)[:, t // g["rows"]] if kc.page
            else np.repeat(np.arange(b)[:, None], sk, axis=1))
    row = t % g["rows"]
    for role, cols in (("k", c.head_dim), ("v", c.head_dim_v)):
        logical = rng.normal(b * kv * sk * cols, dtype).reshape(b, kv, sk, cols)
        parts = {role: logical}
        if kc.bits:
            quantized = _quantized()
            words, scales, biases = quantized.quantize(logical.astype(dtype), kc.group_size, kc.bits)
            parts = {role: words, f"{role}_scales": scales, f"{role}_biases": biases}
            exact = quantized.dequantize(words, scales, biases, kc.group_size, kc.bits)
            exact.tofile(folder / f"{kc.name}.{role}_exact")
            logical = exact.astype(dtype).astype(np.float32)
        for name, data in parts.items():
            tensor = entry["tensors"][name]
            cache = np.frombuffer(images[tensor["buffer"]], dtype=_numpy_dtype(tensor["dtype"])).reshape(tensor["dims"])
            for n in range(b):
                cache[slot[n], :, row] = np.asarray(data[n]).astype(cache.dtype).transpose(1, 0, 2)
        files[role] = logical
    if kc.page:
        _write_tables(entry, images, {"block_table": g.get("written_table", g["table"])})
    files["dout"] = rng.normal(b * c.num_heads * c.seqlen_q * c.head_dim_v, dtype)
    for name, array in files.items():
        array.astype(np.float32).tofile(folder / f"{kc.name}.{name}")
    return _line(c, entry["outputs"])


# large_offsets.cu makes its inputs and its dump itself: nothing to draw, no line.
def _write_merge(entry: dict, images: dict, folder: pathlib.Path) -> str:
    """A MergeCase's inputs: the dense case's (q, k, v into their buffers; dout only for the judge's
    files); its cases.txt line, the dense case's."""
    fields = dict(entry["case"]["case"])
    fields["options"] = grid.Options(**fields["options"])
    c = grid.Case(**fields)
    for name, array in inputs(c).items():
        if name in images:
            _scatter(images[name], entry["tensors"][name], array)
        array.astype(np.float32).tofile(folder / f"{c.name}.{name}")
    return _line(c, entry["outputs"])


_WRITERS = {"dense": _write_dense, "varlen": _write_varlen, "kv_cache": _write_kv_cache, "merge": _write_merge,
            "large": lambda entry, images, folder: ""}


def write_case(entry: dict, folder: pathlib.Path) -> None:
    """FOLDER/NAME.case (the binary above), NAME.line and the judge's input files of one planned
    case."""
    name = entry["name"]
    names = list(entry["buffers"])
    images = {name: bytearray(b"\xff" * spec["bytes"]) for name, spec in entry["buffers"].items()
              if spec["kind"] == "input"}
    line = _WRITERS[entry.get("kind", "dense")](entry, images, folder)
    out = bytearray(MAGIC)

    def text(value: str) -> bytes:
        return struct.pack("<I", len(value)) + value.encode()

    out += struct.pack("<I", len(names))
    for buffer_name in names:
        spec = entry["buffers"][buffer_name]
        out += text(buffer_name) + struct.pack("<QI", spec["bytes"], KINDS[spec["kind"]])
        if spec["kind"] == "input":
            out += images[buffer_name]

    out += struct.pack("<I", len(entry["dispatches"]))
    for d in entry["dispatches"]:
        params = bytes.fromhex(d["params"])
        out += text(d["kernel"]) + struct.pack("<3I3II", *d["threadgroups"], *d["threads"], len(d["constants"]))
        out += b"".join(struct.pack("<3I", *constant) for constant in d["constants"])
        out += struct.pack("<I", d["params_index"])
        out += struct.pack("<I", len(params)) + params + struct.pack("<I", len(d["bindings"]))
        for index, buffer, offset in d["bindings"]:
            out += struct.pack("<IIQ", index, names.index(buffer), offset)
    out += struct.pack("<I", len(entry["outputs"]))
    for output in entry["outputs"]:
        t = entry["tensors"][output]
        out += text(output) + struct.pack("<IQI4I4Q", names.index(t["buffer"]), t["offset"],
                                          DTYPE_CODES[t["dtype"]], *t["dims"], *t["strides"])
    (folder / f"{name}.case").write_bytes(bytes(out))
    (folder / f"{name}.line").write_text(line)


def write_all(plans: pathlib.Path, folder: pathlib.Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    entries = json.loads(plans.read_text())
    for entry in entries:
        write_case(entry, folder)
    (folder / "cases.list").write_text("".join(e["name"] + "\n" for e in entries))
    print(f"cases.py: {len(entries)} cases written into {folder}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="export the library's plans of a grid (needs the library)")
    p.add_argument("grid", choices=("small", "full", "large"))
    p.add_argument("out", type=pathlib.Path)
    w = sub.add_parser("write", help="draw the inputs and write the case files (numpy only)")
    w.add_argument("plans", type=pathlib.Path)
    w.add_argument("folder", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_grid(args.grid, args.out)
    return write_all(args.plans, args.folder)


if __name__ == "__main__":
    sys.exit(main())
