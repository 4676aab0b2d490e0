"""Filling the C ABI's ``fa_problem`` from plain values: one place for the NumPy API and the PyTorch
integration (flash_attention_metal.torch), which both hand the library element strides and
addresses of memory they own.
"""

from __future__ import annotations

from ._validation import Shape

#: fa_dtype enumerators by dtype name (NumPy's and PyTorch's names agree).
DTYPE_CODES = {"float16": "FA_DTYPE_FLOAT16", "bfloat16": "FA_DTYPE_BFLOAT16", "float32": "FA_DTYPE_FLOAT32"}


def new_problem(ffi, lib, shape: Shape, causal: bool, scale: float, dtype_name: str, strides: dict):
    """A new ``fa_problem`` with the sizes, flags and dtype of a call and score options off
    (``set_score_fields`` sets them). ``strides`` maps fa_problem's stride fields (q, k, v, out,
    dout, dq, dk, dv) to (batch, head, seq) element strides; absent ones stay contiguous."""
    problem = ffi.new("fa_problem *")
    problem.struct_size = ffi.sizeof("fa_problem")
    problem.batch = shape.batch
    problem.num_heads = shape.num_heads
    problem.num_kv_heads = shape.num_kv_heads
    problem.seqlen_q = shape.seqlen_q
    problem.seqlen_k = shape.seqlen_k
    problem.head_dim = shape.head_dim
    problem.causal = int(causal)
    problem.softmax_scale = scale
    problem.dtype = getattr(lib, DTYPE_CODES[dtype_name])
    problem.head_dim_v = shape.head_dim_v
    for name, (batch, head, seq) in strides.items():
        field = getattr(problem, name)
        field.batch, field.head, field.seq = batch, head, seq
    return problem


def set_score_fields(problem, ffi, lib, *, window=None, softcap=0.0, mask=None, alibi=None, sinks=None,
                     dropout=None) -> None:
    """Writes the score options into ``problem``: ``window`` (left, right) or None; ``softcap``;
    ``mask`` (address of element [0, 0, 0, 0], (batch, head, row) element strides, fa_attn_mask_type
    enumerator name) or None; ``alibi`` (address, per_batch) or None; ``sinks`` an address or None;
    ``dropout`` (dropout_p, seed, offset) or None. The caller keeps the memory alive until the call
    returns."""
    if window is not None:
        problem.use_window = 1
        problem.window_left, problem.window_right = window
    problem.softcap = softcap
    if mask is not None:
        address, (batch, head, seq), kind = mask
        problem.attn_mask_type = getattr(lib, kind)
        problem.attn_mask = ffi.cast("const void *", address)
        strides = problem.attn_mask_strides
        strides.batch, strides.head, strides.seq = batch, head, seq
    if alibi is not None:
        address, per_batch = alibi
        problem.alibi_slopes = ffi.cast("const float *", address)
        problem.alibi_per_batch = int(per_batch)
    if sinks is not None:
        problem.sinks = ffi.cast("const float *", sinks)
    if dropout is not None:
        problem.dropout_p, problem.dropout_seed, problem.dropout_offset = dropout
