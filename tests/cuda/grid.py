"""The CUDA check's case grids: the attention problems the plan-fed replay runs (tests/cuda/cases.py
writes them, replay.cu runs them). Plain data, no library. Each case has a stable name such as
"f16_d40_b1_h8x2_q33_k77_causal" (dtype, head_dim and "v<head_dim_v>" when it differs, batch,
num_heads x num_kv_heads, seqlen_q, seqlen_k, mask, "_s<scale>" for a non-default scale, the score
modifiers and "_<layout>" for a layout other than bhsd) that --case filters select. Layouts: bhsd
contiguous; bshd FlashAttention's order for every tensor; qkv the slices of one packed projection
(and of one packed gradient), out and dout bshd; gapped padding between rows, heads and batches.
Both grids also hold non-finite inputs (issue 36), dropout (issue 40) and the Metal 4 tensor-op
kernels (issue 37), nonfinite_cases, dropout_cases and tensor_cases below; and the variable-length,
KV-cache and merge cases that the replay runs through the library's plans (varlen_cases,
kv_cache_cases, merge_cases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

F16, BF16, F32 = "f16", "bf16", "f32"
MASKS = ("none", "boolean", "additive", "additive_f32")  # problem.h's MaskKind, dump.h's numbers
LAYOUTS = ("bhsd", "bshd", "qkv", "gapped")


@dataclass(frozen=True)
class Options:
    """Score modifiers (problem.h's ScoreOptions): window sides (-1 unbounded), softcap, the mask's
    kind and whether it has a batch and a head axis, ALiBi (per batch too), sinks."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    mask: str = "none"
    mask_per_batch: bool = False
    mask_per_head: bool = False
    alibi: bool = False
    alibi_per_batch: bool = False
    sinks: bool = False

    def name(self) -> str:
        """The modifiers' part of a case name."""
        text = ""
        if self.window_left >= 0 or self.window_right >= 0:
            side = lambda w: "n" if w < 0 else str(w)  # noqa: E731
            text += f"_w{side(self.window_left)}.{side(self.window_right)}"
        if self.softcap > 0:
            text += f"_cap{self.softcap:g}"
        if self.mask != "none":
            short = {"boolean": "mbool", "additive": "madd", "additive_f32": "maddf32"}[self.mask]
            text += f"_{short}.{'b' if self.mask_per_batch else '1'}{'h' if self.mask_per_head else '1'}"
        if self.alibi:
            text += "_alibib" if self.alibi_per_batch else "_alibi"
        if self.sinks:
            text += "_sinks"
        return text


@dataclass(frozen=True)
class Case:
    """One problem: dtype, sizes, causal, softmax_scale, layout, modifiers, and the value an
    additive mask hides keys with (-inf, or float32's lowest finite value: "_min")."""

    name: str
    dtype: str
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    causal: bool
    softmax_scale: float
    layout: str = "bhsd"
    options: Options = field(default_factory=Options)
    mask_hide: float = -math.inf
    nonfinite: str = ""  # "" or a NONFINITE_PLACEMENTS key: where cases.py plants NaN and infinities
    dropout_p: float = 0.0  # dropout on P (FlashAttention's dropout_p), with its Philox seed and offset
    dropout_seed: int = 0
    dropout_offset: int = 0
    tensor_ops: bool = False  # planned with the Metal 4 tensor-op kernels forced (tensor_cases)


def case(dtype, d, b, h, kv, sq, sk, causal, *, dv=0, scale=0.0, layout="bhsd", options=Options()) -> Case:
    """A case named by its parameters, with the default scale 1/sqrt(head_dim)."""
    head_dim_v = dv or d
    name = f"{dtype}_d{d}" + (f"v{head_dim_v}" if head_dim_v != d else "")
    name += f"_b{b}_h{h}x{kv}_q{sq}_k{sk}_{'causal' if causal else 'full'}"
    if scale:
        name += f"_s{scale:g}"
    name += options.name()
    if layout != "bhsd":
        name += f"_{layout}"
    # float32 arithmetic, as the C++ grid computes it.
    import numpy as np
    softmax_scale = float(np.float32(scale)) if scale else float(np.float32(1.0 / math.sqrt(d)))
    return Case(name, dtype, b, h, kv, sq, sk, d, head_dim_v, causal, softmax_scale, layout, options)


def finite_min(c: Case) -> Case:
    """The case with its additive mask hiding keys with float32's lowest finite value."""
    import numpy as np
    return replace(c, name=c.name + "_min", mask_hide=float(np.finfo(np.float32).min))


# Issue 36 (docs/semantics.md, "Non-finite values"): (tensor, batch, head, row, column, value) of
# each planted element; rows past a tensor's length are left out. Keys 64, 79, 95, 127 are the first,
# a middle and the last key of 64-key chunks and tiles; batch 1 stays finite, so every case has rows
# that the accuracy rule (and the planted exp2 -> exp fault) still sees.
_NAN, _INF = math.nan, math.inf
NONFINITE_PLACEMENTS = {
    "k": (("k", 0, 0, 64, 3, _NAN), ("k", 0, -1, 79, 5, _INF), ("k", 0, 0, 95, 0, -_INF), ("k", 0, -1, 127, -1, _NAN)),
    "v": (("v", 0, 0, 64, 3, _NAN), ("v", 0, -1, 79, 5, _INF), ("v", 0, 0, 95, 0, -_INF), ("v", 0, -1, 127, -1, _NAN)),
    "q": (("q", 0, 0, 0, 3, _NAN), ("q", 0, -1, -1, 5, _INF), ("q", 0, 1, 0, 0, -_INF)),
    "issue36": (("k", 0, 0, 3, 7, _NAN),),  # the reproducer: heads 0-3 NaN, heads 4-7 finite
}


def nonfinite(c: Case, placement: str) -> Case:
    """The case with NaN and infinities planted in its inputs (NONFINITE_PLACEMENTS[placement])."""
    return replace(c, name=f"{c.name}_nonfinite.{placement}", nonfinite=placement)


def dropout(c: Case, p: float, seed: int, offset: int, tag: str = "") -> Case:
    """The case with dropout p on the probabilities, Philox-keyed by seed and offset."""
    return replace(c, name=f"{c.name}_drop{p:g}{tag}", dropout_p=p, dropout_seed=seed, dropout_offset=offset)


def nonfinite_cases() -> list[Case]:
    """Issue 36's cases, in both grids: NaN and infinities in k, v and q rows on the dense (72 rows),
    tiled split (16 query heads over 1 KV head, one row) and decode (4:1 GQA, two rows) paths,
    forward and backward (a NaN in q reaches dq, dk, dv), and the issue's reproducer. No mask,
    window or causal: no key is hidden from a row, so rows the reference gives finite must be
    finite (docs/semantics.md lets a non-finite v at a hidden key reach a row)."""
    shapes = [case(F16, 64, 2, 4, 2, 72, 160, False), case(F16, 64, 2, 16, 1, 1, 160, False),
              case(F32, 64, 2, 4, 1, 2, 160, False)]
    c = [nonfinite(s, where) for s in shapes for where in ("k", "v", "q")]
    c.append(nonfinite(case(BF16, 128, 2, 4, 2, 40, 90, False), "q"))
    c.append(nonfinite(case(F32, 64, 1, 8, 2, 1, 2000, False), "issue36"))
    return c


def dropout_cases() -> list[Case]:
    """Issue 40's cases, in both grids: dropout 0.17 forward and backward, float16 and float32, head
    dims 64 and 128, causal, a window, GQA; one with seed and offset near 2^64 so that the Philox
    counter wraps."""
    return [dropout(case(F16, 64, 2, 4, 2, 100, 100, True), 0.17, 1234, 5678),
            dropout(case(F32, 128, 1, 8, 2, 70, 77, False, options=mods(window=(16, 8))), 0.17, 42, 7),
            dropout(case(F16, 128, 2, 8, 2, 65, 90, False, options=mods(window=(20, -1))), 0.17,
                    2**64 - 3, 2**64 - 5, ".wrap"),
            dropout(case(F32, 64, 2, 6, 3, 80, 60, True), 0.17, 99, 0)]


@dataclass(frozen=True)
class VarlenCase:
    """A variable-length batch (flash_attn_varlen_func): sequence n has seqlens_q[n] query rows and
    seqlens_k[n] keys, packed contiguous (total, heads, head_dim); causal, the window, softcap and
    ALiBi (per head, or per sequence with alibi_per_batch) per sequence; no mask (varlen has none)
    and no sinks (dsinks sums over the sequences). Judged sequence by sequence as dense problems
    (each at least one row and one key; sequence n's ALiBi slopes as per-head ones)."""

    name: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    causal: bool
    softmax_scale: float
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    options: Options = field(default_factory=Options)
    tensor_ops: bool = False  # planned with the Metal 4 tensor-op kernels forced (tensor_cases)

    def sequence(self, n: int) -> Case:
        """Sequence n as the dense batch-1 case that judges it (named NAME.s<n>)."""
        return Case(f"{self.name}.s{n}", self.dtype, 1, self.num_heads, self.num_kv_heads, self.seqlens_q[n],
                    self.seqlens_k[n], self.head_dim, self.head_dim_v, self.causal, self.softmax_scale,
                    options=replace(self.options, alibi_per_batch=False), tensor_ops=self.tensor_ops)


def varlen(dtype, d, h, kv, seqlens_q, seqlens_k, causal, *, options=Options()) -> VarlenCase:
    """A VarlenCase named like the dense cases, its scale 1/sqrt(head_dim) in float32."""
    import numpy as np
    name = (f"varlen_{dtype}_d{d}_h{h}x{kv}_q{'.'.join(map(str, seqlens_q))}_k{'.'.join(map(str, seqlens_k))}"
            f"_{'causal' if causal else 'full'}{options.name()}")
    return VarlenCase(name, dtype, h, kv, d, d, causal, float(np.float32(1.0 / math.sqrt(d))), tuple(seqlens_q),
                      tuple(seqlens_k), options)


def tensor(c):
    """Case or VarlenCase c planned with the Metal 4 tensor-op kernels forced (issue 37:
    fa_plan_create_for with the tensor-op library ready, under FLASH_ATTENTION_TENSOR_OPS=1; cases.py refuses a case whose
    forward or backward plan then names no tensor-op kernel), named tensor_<name>."""
    return replace(c, name=f"tensor_{c.name}", tensor_ops=True)


def tensor_cases(small: bool = False) -> list:
    """The tensor-op kernels (forward, dQ, dK/dV; docs/tensor-ops.md) through their exported plans,
    in both grids: head dims 64, 96, 128, 256 and 80 (the 96 bucket, columns past head_dim), float16
    and bfloat16, causal rows, GQA and MQA (empty causal rows), a window with softcap, ALiBi per
    batch with sinks, boolean and additive masks, head_dim_v != head_dim, the bshd and gapped
    layouts, dropout and a variable-length batch. Query rows stay above the split-KV forward's
    (the tensor-op forward serves the dense one only). The sanitizer grid takes the first five,
    one per bucket and the varlen batch, at most 50 rows (the emulation gathers every operand
    by warp shuffles: slow under the tools)."""
    small_cases = [
        tensor(case(F16, 64, 1, 4, 2, 40, 50, True)),
        tensor(case(BF16, 96, 1, 2, 2, 33, 40, False, options=mods(window=(12, 4), softcap=10))),
        tensor(case(F16, 128, 1, 2, 1, 20, 40, True, options=mods(mask=("boolean", False, True), alibi="head",
                                                                   sinks=True))),
        tensor(case(BF16, 256, 1, 2, 1, 20, 33, True)),
        tensor(varlen(F16, 64, 4, 2, (9, 17, 33), (7, 17, 40), True)),
    ]
    if small:
        return small_cases
    return small_cases + [
        tensor(case(F16, 64, 2, 4, 4, 100, 100, True)),
        tensor(case(BF16, 64, 1, 8, 2, 70, 77, True)),
        tensor(case(BF16, 96, 2, 4, 1, 77, 33, True)),
        tensor(case(F16, 80, 1, 4, 2, 70, 90, False, options=mods(window=(20, 8)))),
        tensor(case(F16, 128, 2, 4, 2, 65, 100, False, options=mods(alibi="batch", sinks=True))),
        tensor(case(BF16, 128, 1, 8, 2, 100, 100, True, options=mods(mask=("additive", True, True)))),
        tensor(case(F16, 256, 2, 4, 2, 65, 70, True, options=mods(softcap=20, window=(16, 0),
                                                                  mask=("additive_f32", True, False)))),
        tensor(case(BF16, 256, 2, 2, 2, 65, 65, False)),
        tensor(case(F16, 128, 1, 4, 2, 40, 60, True, dv=64)),
        tensor(case(BF16, 64, 2, 4, 2, 65, 70, False, dv=128)),
        tensor(case(F16, 64, 1, 8, 2, 70, 77, True, layout="bshd")),
        tensor(case(BF16, 96, 2, 4, 1, 60, 50, False, layout="gapped", options=mods(mask=("boolean", True, True)))),
        tensor(dropout(case(F16, 64, 2, 4, 2, 70, 80, True), 0.17, 1234, 5678)),
        tensor(varlen(BF16, 128, 4, 2, (64, 3, 70), (64, 30, 70), False, options=mods(window=(16, 0)))),
    ]


@dataclass(frozen=True)
class KVCacheCase:
    """A forward over KV caches (flash_attn_with_kvcache): batch sequences of seqlen_k cached keys
    each, contiguous (cache_rows rows per sequence) or paged (page rows per block, blocks handed out
    in shuffled order through a block table with spare blocks), of the dtype or mx.quantize's
    packed words (bits 4 or 8, group_size). Judged as the dense problem over the cached keys (a
    quantized cache against its float64 dequantized keys and values). wrong_table: the block
    table written to the device holds entries outside [0, num_blocks) (each where the kernels'
    clamp gives back the block the rows are in: above the last block, below 0) and garbage in its
    unused entries, so the case passes only if every table read is clamped."""

    case: Case
    cache_rows: int = 0  # contiguous: rows per sequence (>= seqlen_k); 0 when paged
    page: int = 0        # paged: rows per block; 0 when contiguous
    bits: int = 0
    group_size: int = 64
    wrong_table: bool = False

    @property
    def name(self) -> str:
        return self.case.name


def kv_cache(c: Case, *, cache_rows=0, page=0, bits=0, group_size=64, wrong_table=False) -> KVCacheCase:
    """The case c over a KV cache, its name telling the cache."""
    tag = f"_page{page}" if page else f"_rows{cache_rows}"
    tag += f"_q{bits}g{group_size}" if bits else ""
    tag += "_wrongtable" if wrong_table else ""
    return KVCacheCase(replace(c, name=f"kvcache_{c.name}{tag}"), cache_rows, page, bits, group_size, wrong_table)


def varlen_cases(small: bool = False) -> list[VarlenCase]:
    """Variable-length batches through the exported plans: GQA with causal rows that see no key
    (a sequence with more queries than keys), one-row sequences, a window, softcap with ALiBi slopes
    per sequence; every dtype. The sanitizer grid takes the first."""
    c = [varlen(F16, 64, 4, 2, (5, 17, 1, 33), (7, 17, 40, 20), True),
         varlen(BF16, 128, 8, 8, (64, 3, 70), (64, 3, 70), False, options=mods(window=(16, 0))),
         varlen(F32, 40, 6, 2, (12, 9), (30, 9), True),
         varlen(F16, 96, 4, 4, (20, 7, 33), (25, 7, 40), True, options=mods(softcap=20, alibi="batch"))]
    return (c[:1] if small else c) + [t for t in tensor_cases(small) if isinstance(t, VarlenCase)]


def kv_cache_cases(small: bool = False) -> list[KVCacheCase]:
    """KV-cache forwards through the exported plans: contiguous and paged caches, 4- and 8-bit
    quantized ones, decode shapes (split-KV, decode kernels) and longer query blocks (the dense
    KV-cache kernel), a block table with entries out of range (wrong_table), the speculative-decoding
    widths over contiguous, paged and quantized caches (pages of 5 rows: a page boundary inside
    every tile), every dtype. The sanitizer grid takes the first three and a paged speculative one."""
    c = [kv_cache(case(BF16, 64, 2, 8, 2, 1, 200, True), page=32, bits=4, group_size=32),
         kv_cache(case(F16, 128, 2, 4, 4, 100, 120, True), cache_rows=128, bits=8, group_size=64),
         kv_cache(case(F16, 64, 2, 4, 2, 12, 50, True), page=16, bits=4, group_size=64, wrong_table=True),
         kv_cache(case(F16, 64, 2, 8, 2, 1, 300, True), cache_rows=320),
         kv_cache(case(F16, 128, 3, 4, 4, 7, 90, True), page=16),
         kv_cache(case(F32, 64, 2, 4, 2, 20, 150, True), page=64),
         kv_cache(case(F32, 64, 1, 6, 3, 2, 260, False), page=48, bits=8, group_size=32),
         # The speculative-decoding kernel (2-16 packed rows per KV head) over each cache kind.
         kv_cache(case(F16, 128, 2, 8, 2, 4, 200, True), page=16),
         kv_cache(case(BF16, 64, 1, 8, 1, 2, 260, True), cache_rows=288, bits=8, group_size=64),
         kv_cache(case(F32, 64, 2, 12, 1, 1, 300, True), page=5, bits=4, group_size=32),
         kv_cache(case(F16, 64, 2, 4, 2, 40, 90, True), page=5, bits=8, group_size=32)]
    return c[:3] + c[7:8] if small else c


@dataclass(frozen=True)
class MergeCase:
    """fa_merge_attention through plans: the forward over keys [0, split) and the forward over keys
    [split, seqlen_k) (each a plan of its own, binding k and v at the split's offset), then the merge
    plan of their out and lse (float16: fa_plan_create_merge's dtype). Judged as the dense case over
    all keys (causal off and no modifiers, so each part's mask is the whole mask's restriction)."""

    case: Case
    split: int

    @property
    def name(self) -> str:
        return self.case.name


def merge_cases() -> list[MergeCase]:
    """The merge kernel through plans, in both grids: GQA, a split inside a key tile and one at a
    tile's edge, head_dim_v != head_dim."""
    return [MergeCase(replace(c, name=f"merge_{c.name}_at{split}"), split) for c, split in (
        (case(F16, 64, 2, 4, 2, 40, 90, False), 37),
        (case(F16, 128, 1, 2, 2, 33, 128, False, dv=64), 64))]


def large_offsets_case() -> Case:
    """large_offsets.cu's problem: q, out, dout and dq of 2^32 + 640 elements (seqlen_q 2^25 + 5,
    head_dim 128, one head; row 2^25 starts at element 2^32) over 16 keys, float16, causal off."""
    return replace(case(F16, 128, 1, 1, 1, 2**25 + 5, 16, False), name="large_offsets_f16_d128_k16")


def mods(*, window=None, softcap=0.0, mask=None, alibi=None, sinks=False) -> Options:
    """Options from keywords: window (left, right), mask (kind, per_batch, per_head), alibi
    "head" or "batch"."""
    left, right = window if window else (-1, -1)
    kind, per_batch, per_head = mask if mask else ("none", False, False)
    return Options(left, right, softcap, kind, per_batch, per_head, alibi is not None, alibi == "batch", sinks)


def full_grid() -> list[Case]:
    """The accuracy grid: float16 over every head-dim bucket, causal on and off, GQA 8/2 and MQA,
    cross-attention both ways (with causal empty rows), decode, batch 2, odd lengths, longer
    sequences and scales, short GQA queries (2-8 rows) for the split-KV forward; bfloat16 and
    float32 over every bucket of their tables; strided layouts and head_dim_v != head_dim (MLA's
    192/128 among them) in every dtype; every score modifier in every dtype (windows, some leaving
    rows empty, softcap, ALiBi per head and per batch, sinks with dsinks, boolean and additive
    masks broadcast and full, a float32-minimum additive mask, all at once); rows whose |lse| >=
    256 for the backward's lse residual; then the non-finite and dropout cases."""
    c: list[Case] = []
    for d in (1, 3, 32, 40, 59, 64, 80, 96, 104, 128, 160, 192, 200, 256, 300, 512, 576):
        c += [case(F16, d, 2, 3, 3, 100, 100, False), case(F16, d, 2, 3, 3, 100, 100, True),
              case(F16, d, 1, 8, 2, 33, 77, True), case(F16, d, 2, 4, 1, 77, 33, True),
              case(F16, d, 2, 4, 1, 77, 33, False), case(F16, d, 2, 2, 2, 1, 129, True)]
    c += [case(F16, 16, 1, 1, 1, 1, 1, False), case(F16, 64, 1, 2, 2, 257, 257, True),
          case(F16, 128, 1, 2, 1, 200, 131, False), case(F16, 256, 1, 1, 1, 65, 300, True),
          case(F16, 72, 2, 6, 3, 31, 31, True, scale=0.5), case(F16, 64, 1, 2, 2, 63, 65, False, scale=-0.3),
          case(F16, 32, 2, 4, 2, 130, 97, True, scale=2.0)]
    for d in (1, 40, 64, 96, 128, 160, 200, 256, 512, 576):
        c += [case(BF16, d, 2, 3, 3, 100, 100, True), case(BF16, d, 1, 8, 2, 33, 77, True),
              case(BF16, d, 2, 4, 1, 77, 33, True), case(BF16, d, 2, 2, 2, 1, 129, True)]
    c.append(case(BF16, 64, 1, 2, 2, 63, 65, False, scale=-0.3))
    for d in (3, 40, 64, 96, 104, 128, 160, 192, 200, 256):
        c += [case(F32, d, 2, 3, 3, 100, 100, False), case(F32, d, 2, 3, 3, 100, 100, True),
              case(F32, d, 1, 8, 2, 33, 77, True), case(F32, d, 2, 4, 1, 77, 33, True),
              case(F32, d, 2, 2, 2, 1, 129, True)]
    c += [case(F32, 64, 1, 2, 2, 257, 257, True), case(F32, 128, 1, 2, 1, 200, 131, False),
          case(F32, 256, 1, 1, 1, 65, 300, True), case(F32, 32, 2, 4, 2, 130, 97, True, scale=2.0)]
    for t in (F16, BF16, F32):
        c += [case(t, 64, 2, 8, 2, 3, 300, True), case(t, 128, 1, 4, 1, 8, 200, False),
              case(t, 256, 1, 6, 2, 5, 90, True), case(t, 32, 1, 16, 2, 7, 150, True)]
    c += [case(F16, 64, 1, 8, 2, 33, 77, True, layout="bshd"), case(F16, 40, 2, 4, 1, 77, 33, True, layout="gapped"),
          case(F16, 64, 2, 4, 4, 100, 100, True, layout="qkv"), case(F16, 128, 2, 8, 2, 65, 65, False, layout="qkv"),
          case(F16, 64, 2, 8, 2, 3, 300, True, layout="bshd"), case(BF16, 128, 2, 3, 3, 100, 100, True, layout="bshd"),
          case(BF16, 200, 1, 8, 2, 33, 77, True, layout="gapped"), case(BF16, 96, 1, 8, 2, 65, 65, True, layout="qkv"),
          case(F32, 256, 2, 4, 1, 77, 33, True, layout="bshd"), case(F32, 96, 2, 3, 3, 100, 100, True, layout="gapped"),
          case(F32, 32, 2, 3, 3, 50, 50, False, layout="qkv"), case(F32, 256, 1, 2, 2, 40, 40, True, layout="qkv"),
          case(F32, 128, 1, 4, 1, 8, 200, False, layout="gapped")]
    for t in (F16, BF16, F32):
        c += [case(t, 192, 2, 3, 3, 100, 100, True, dv=128), case(t, 192, 1, 8, 2, 33, 77, True, dv=128),
              case(t, 192, 2, 4, 1, 77, 33, False, dv=128), case(t, 192, 1, 8, 2, 3, 300, True, dv=128),
              case(t, 192, 1, 4, 2, 65, 65, True, dv=128, layout="bshd")]
    c += [case(F16, 64, 2, 3, 3, 100, 100, True, dv=128), case(F16, 128, 1, 8, 2, 33, 77, True, dv=64),
          case(F16, 3, 2, 4, 1, 77, 33, True, dv=40), case(F16, 256, 1, 2, 2, 50, 70, False, dv=1),
          case(F16, 1, 1, 2, 2, 70, 50, True, dv=256, layout="gapped"), case(BF16, 40, 2, 3, 3, 100, 100, True, dv=3),
          case(BF16, 100, 1, 8, 2, 33, 77, True, dv=200, layout="bshd"), case(BF16, 256, 2, 2, 2, 1, 129, True, dv=64),
          case(F32, 32, 2, 3, 3, 100, 100, True, dv=96), case(F32, 128, 1, 8, 2, 33, 77, True, dv=40),
          case(F32, 256, 2, 4, 1, 77, 33, True, dv=192), case(F32, 64, 2, 2, 2, 1, 129, True, dv=256, layout="bshd")]
    for t in (F16, BF16):
        c += [case(t, 576, 1, 8, 2, 33, 77, True, dv=512), case(t, 576, 2, 16, 1, 1, 300, True, dv=512),
              case(t, 576, 1, 4, 1, 20, 40, False, dv=512, layout="bshd")]
    c.append(case(BF16, 512, 1, 4, 1, 5, 200, True, dv=256))
    for t in (F16, BF16, F32):
        c += [case(t, 64, 1, 2, 1, 2048, 2048, True, options=mods(window=(512, -1))),
              case(t, 40, 1, 8, 2, 33, 77, False, options=mods(window=(8, 8))),
              case(t, 96, 2, 3, 3, 100, 100, False, options=mods(window=(20, -1))),
              case(t, 64, 2, 3, 3, 100, 100, False, options=mods(window=(-1, 4))),
              case(t, 32, 2, 4, 1, 77, 33, False, options=mods(window=(5, 3))),
              case(t, 128, 2, 4, 1, 77, 33, True, options=mods(window=(0, -1))),
              case(t, 64, 2, 4, 4, 65, 90, True, scale=0.5, options=mods(softcap=5)),
              case(t, 128, 1, 8, 2, 100, 100, False, options=mods(softcap=30)),
              case(t, 256, 1, 4, 2, 60, 60, True, options=mods(softcap=20, window=(16, 0))),
              case(t, 64, 2, 8, 2, 100, 100, True, options=mods(alibi="head")),
              case(t, 128, 2, 4, 1, 50, 120, False, options=mods(alibi="batch")),
              case(t, 64, 2, 4, 2, 100, 100, True, options=mods(sinks=True)),
              case(t, 32, 2, 4, 1, 77, 33, True, options=mods(sinks=True)),
              case(t, 192, 1, 8, 2, 33, 77, False, options=mods(sinks=True)),
              case(t, 64, 2, 4, 2, 60, 80, False, options=mods(mask=("boolean", True, True))),
              case(t, 32, 2, 3, 3, 100, 100, True, options=mods(mask=("boolean", False, False))),
              case(t, 96, 2, 4, 1, 77, 33, False, options=mods(mask=("boolean", True, False))),
              case(t, 160, 1, 4, 2, 40, 90, True, options=mods(mask=("boolean", False, True))),
              case(t, 64, 2, 4, 1, 70, 70, False, options=mods(mask=("additive", False, True))),
              case(t, 128, 2, 4, 2, 65, 100, True, options=mods(mask=("additive", True, True))),
              case(t, 40, 2, 3, 3, 100, 100, False, options=mods(mask=("additive_f32", False, False))),
              case(t, 256, 2, 2, 1, 45, 70, False, options=mods(mask=("additive_f32", True, False))),
              finite_min(case(t, 64, 2, 4, 2, 50, 90, False, options=mods(mask=("additive_f32", True, True)))),
              finite_min(case(t, 128, 1, 4, 2, 40, 70, True,
                              options=mods(mask=("additive_f32", False, True), sinks=True))),
              case(t, 32, 2, 4, 2, 50, 60, True, scale=30.0, options=mods(sinks=True)),
              case(t, 128, 2, 8, 2, 90, 130, True, options=mods(window=(40, -1), softcap=30,
                                                                mask=("boolean", True, False), alibi="batch",
                                                                sinks=True)),
              case(t, 64, 1, 4, 4, 100, 100, False, options=mods(window=(30, 10), softcap=10,
                                                                 mask=("additive", False, True), alibi="head",
                                                                 sinks=True)),
              case(t, 64, 2, 8, 2, 4, 600, True, options=mods(window=(256, -1), alibi="head", sinks=True)),
              case(t, 128, 1, 4, 1, 1, 700, False, options=mods(softcap=30, mask=("additive", True, True))),
              case(t, 256, 2, 6, 2, 8, 512, True, options=mods(mask=("boolean", True, False), sinks=True)),
              case(t, 32, 1, 16, 2, 7, 520, False, options=mods(window=(100, 50), softcap=5,
                                                                mask=("additive_f32", False, True))),
              case(t, 64, 1, 8, 2, 16, 600, True, options=mods(alibi="head", sinks=True)),
              case(t, 64, 2, 4, 2, 60, 70, True, layout="gapped",
                   options=mods(mask=("additive", True, True), sinks=True)),
              case(t, 64, 2, 4, 2, 65, 65, False, layout="qkv", options=mods(window=(10, 10), alibi="batch")),
              case(t, 128, 1, 8, 2, 5, 300, True, layout="bshd",
                   options=mods(mask=("boolean", False, True), sinks=True))]
    for t in (F16, BF16):
        c += [case(t, 512, 1, 4, 2, 40, 60, True, options=mods(window=(20, -1), softcap=30,
                                                               mask=("additive", True, True), alibi="batch",
                                                               sinks=True)),
              case(t, 576, 1, 8, 1, 2, 600, True, dv=512, layout="bshd",
                   options=mods(window=(300, -1), mask=("boolean", True, False), sinks=True))]
    return c + nonfinite_cases() + dropout_cases() + [t for t in tensor_cases() if isinstance(t, Case)]


def small_grid() -> list[Case]:
    """The sanitizer grid (seqlen <= 100): every dtype, the buckets, GQA, MQA, cross-attention
    both ways, decode and short GQA queries (split-KV forward), causal empty rows, strided layouts,
    head_dim_v != head_dim, float32 at head_dim 256 (whose backward kernels share one tile buffer),
    each score modifier at least once, and two cases whose lse residual dispatch recomputes rows, so
    that racecheck sees its barriers."""
    return [
        case(F16, 1, 2, 2, 2, 37, 37, False), case(F16, 3, 2, 3, 3, 100, 100, True),
        case(F16, 32, 2, 4, 1, 77, 33, True), case(F16, 40, 1, 8, 2, 33, 77, True),
        case(F16, 64, 2, 2, 2, 1, 99, True), case(F16, 72, 1, 6, 3, 31, 31, True, scale=0.5),
        case(F16, 96, 1, 4, 2, 50, 17, True), case(F16, 128, 2, 3, 3, 100, 100, True),
        case(F16, 160, 1, 4, 2, 40, 90, True), case(F16, 200, 2, 2, 2, 1, 100, True),
        case(F16, 256, 2, 2, 2, 45, 70, True), case(F16, 256, 1, 6, 2, 5, 90, True),
        case(BF16, 32, 1, 2, 2, 1, 64, True), case(BF16, 64, 1, 4, 1, 65, 64, True),
        case(BF16, 104, 2, 2, 1, 17, 50, False), case(BF16, 128, 1, 8, 2, 70, 45, True),
        case(BF16, 192, 1, 4, 4, 50, 20, True), case(BF16, 256, 1, 4, 1, 100, 33, True),
        case(F32, 3, 2, 2, 2, 37, 37, False), case(F32, 32, 2, 4, 1, 77, 33, True),
        case(F32, 64, 2, 2, 2, 1, 99, True), case(F32, 96, 1, 4, 2, 50, 17, True),
        case(F32, 128, 1, 2, 2, 65, 65, False), case(F32, 192, 2, 2, 2, 33, 33, False),
        case(F32, 256, 2, 2, 2, 45, 70, True), case(F32, 256, 1, 4, 1, 100, 33, True),
        case(F32, 256, 1, 6, 2, 5, 90, True),
        case(F16, 64, 1, 8, 2, 33, 77, True, layout="bshd"),
        case(BF16, 128, 1, 8, 2, 65, 65, True, layout="qkv"),
        case(F32, 40, 2, 4, 1, 77, 33, True, layout="gapped"),
        case(F16, 192, 1, 8, 2, 33, 77, True, dv=128),
        case(BF16, 192, 1, 4, 2, 50, 50, True, dv=128, layout="bshd"),
        case(F32, 192, 1, 8, 2, 3, 100, True, dv=128),
        case(F16, 64, 2, 2, 1, 40, 90, False, dv=256),
        case(F16, 512, 1, 4, 2, 40, 70, True),
        case(BF16, 576, 1, 8, 1, 1, 100, True, dv=512),
        case(F16, 64, 2, 4, 1, 77, 33, False, options=mods(window=(5, 3))),
        case(BF16, 128, 1, 4, 2, 100, 100, True, scale=0.5, options=mods(window=(16, -1), softcap=5)),
        case(F32, 64, 2, 4, 1, 50, 90, False, options=mods(alibi="batch")),
        case(F16, 32, 2, 4, 2, 77, 33, True, options=mods(sinks=True)),
        case(BF16, 64, 2, 4, 2, 60, 80, False, options=mods(mask=("boolean", True, True))),
        case(F16, 96, 2, 4, 1, 70, 70, False, layout="gapped", options=mods(mask=("additive", False, True))),
        case(F32, 256, 2, 2, 2, 45, 70, True, options=mods(window=(20, -1), softcap=30,
                                                           mask=("additive_f32", True, False), alibi="head",
                                                           sinks=True)),
        case(F16, 64, 2, 8, 2, 4, 100, True, options=mods(window=(40, -1), mask=("boolean", False, True),
                                                          alibi="head", sinks=True)),
        finite_min(case(F16, 128, 1, 4, 2, 40, 70, True, options=mods(mask=("additive_f32", False, True)))),
        case(BF16, 32, 2, 4, 2, 50, 60, True, scale=30.0, options=mods(sinks=True)),
    ] + nonfinite_cases() + dropout_cases() + [t for t in tensor_cases(small=True) if isinstance(t, Case)]
