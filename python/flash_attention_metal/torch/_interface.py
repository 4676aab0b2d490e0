"""The public functions: FlashAttention's ``flash_attn_func`` and PyTorch's
``scaled_dot_product_attention``, their arguments checked (TypeError for types and dtypes,
ValueError for shapes and values, NotImplementedError for what does not exist yet, each naming the
argument) and mapped onto the operators of ``_ops``.

Everything here reads only shapes, strides, dtypes and Python values, so ``torch.compile`` traces it
(``fullgraph=True``); checks that need the library or the data run inside the operators.
"""

from __future__ import annotations

import torch

from .. import _validation
from .. import dropout as dropout_module
from . import _ops
from ._tensors import DTYPES, as_numpy


def draw_dropout(dropout_p: float, device: torch.device) -> tuple[float, int, int]:
    """(dropout_p, seed, offset) of one call: with dropout_p > 0 the seed and the Philox counter
    base are drawn from the default generator of ``device`` (so ``torch.manual_seed`` reproduces a
    mask), each in [0, 2**63); the autograd formula saves them for the backward, which regenerates
    the same mask. (0.0, 0, 0) without dropout (nothing drawn)."""
    if dropout_p == 0.0:
        return 0.0, 0, 0
    seed, offset = torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device).tolist()
    return dropout_p, seed, offset


def _autocast(*tensors):
    """``tensors`` cast to the autocast dtype where autocast is on for their device (PyTorch lists
    scaled_dot_product_attention among the operators it runs in the lower precision; the custom
    operators have no autocast kernel of their own), else as given."""
    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return tensors
    if not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) for t in tensors) if dtype in DTYPES else tensors


def _empty(tensors) -> bool:
    return all(isinstance(t, torch.Tensor) for t in tensors) and any(t.numel() == 0 for t in tensors)


def _check_tensors(tensors: dict, min_ndim: int, max_ndim: int) -> None:
    """Each of ``tensors`` (name -> value) must be a tensor of min_ndim ... max_ndim dimensions, none
    of them empty, all of one dtype of float16, bfloat16 and float32 and on one CPU or MPS device."""
    (first_name, first), *_ = tensors.items()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {t.dtype} (convert it "
                            f"explicitly, e.g. {name}.to(torch.float16))")
        if t.dtype != first.dtype:
            raise TypeError(f"{name} must have {first_name}'s dtype {first.dtype}, got {t.dtype}")
        if t.device.type not in ("cpu", "mps"):
            raise ValueError(f"{name} is on {t.device}: flash_attention_metal.torch runs CPU and MPS tensors")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} and {first_name} on {first.device}: pass one device")
        if not min_ndim <= t.dim() <= max_ndim:
            wanted = str(min_ndim) if min_ndim == max_ndim else f"{min_ndim} or more"
            raise ValueError(f"{name} must have {wanted} dimensions, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} has an empty dimension (shape {tuple(t.shape)}); every dimension must be at "
                             "least 1")


def _check_no_grad(name: str, t) -> None:
    if t is not None and t.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"{name} requires grad: no gradient flows to {name}; detach it")


def _check_alibi(alibi_slopes, q: torch.Tensor, batch: int, heads: int):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes shape {tuple(alibi_slopes.shape)} must be (nheads,) = ({heads},) or "
                         f"(batch_size, nheads) = ({batch}, {heads})")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} and q on {q.device}: pass one device")
    _check_no_grad("alibi_slopes", alibi_slopes)
    return alibi_slopes


def _forward(q, k, v, attn_mask, alibi_slopes, scale, causal, window, softcap, bshd, dropout_p=0.0):
    """(out, lse) of the forward operator, dropout's seed and offset drawn here."""
    left, right = window if window is not None else (-1, -1)
    return _ops.forward(q, k, v, attn_mask, alibi_slopes, scale, causal, left, right, softcap, bshd,
                        *draw_dropout(dropout_p, q.device))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=True, return_attn_probs=False):
    """FlashAttention's ``flash_attn_func``: exact attention with a fused backward, in the (batch,
    seqlen, nheads, headdim) layout.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); float16, bfloat16 or float32; CPU or MPS.
        k: (batch_size, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (MQA/GQA).
        v: (batch_size, seqlen_k, nheads_k, headdim_v) (headdim_v may differ from headdim).
        dropout_p: attention dropout in [0, 1) (FlashAttention's: each probability dropped after the
            softmax, the kept ones scaled by 1 / (1 - dropout_p); lse of the undropped scores). The
            mask's seed and Philox offset are drawn from the default generator of q's device
            (``torch.manual_seed`` reproduces it) and saved for the backward, which regenerates
            the mask (flash_attention_metal.philox.dropout_keep gives it). Pass 0.0 in evaluation.
        softmax_scale: the scaling of q k^T before the softmax; None means 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask (FlashAttention >= 2.1): query i sees key j iff
            j <= i + seqlen_k - seqlen_q.
        window_size: (left, right) sliding window, -1 unbounded: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
        softcap: > 0 applies softcap * tanh(scores / softcap) (Gemma 2); 0.0 is off.
        alibi_slopes: float32 (nheads,) or (batch_size, nheads): a bias of
            -slope * |i + seqlen_k - seqlen_q - j| on the scaled scores; no gradient.
        deterministic: a bool, accepted either way: the backward is always deterministic (no
            atomics).
        return_attn_probs: False returns out; True FlashAttention's tuple (out, softmax_lse,
            S_dmask) (for testing only): softmax_lse float32 (batch_size, nheads, seqlen_q), the
            natural log of the softmax denominator (-inf for a row without keys; no gradient);
            S_dmask at dropout_p 0 FlashAttention's placeholder, an empty tensor of q's dtype and
            shape (0,); at dropout_p > 0 (batch_size, nheads, seqlen_q, seqlen_k) in q's dtype,
            exp(scaled score - the row's max over its visible keys) per element, negated where the
            element was dropped and 0 where it is masked (computed on the host from q, k and the
            call's mask bits, ``flash_attention_metal.dropout.s_dmask``; no gradient).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v) in q's dtype, contiguous. Rows that see no
        key are 0. Differentiable with respect to q, k and v (the library's fused backward); with
        return_attn_probs the tuple above.

    Raises:
        TypeError, ValueError: invalid arguments, named (dropout_p outside [0, 1): ValueError).
        NotImplementedError: alibi_slopes that require grad.
        FlashAttentionError: the library reported an error.
    """
    dropout_p = _validation.check_dropout_p(dropout_p)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    q, k, v = _autocast(q, k, v)
    _check_tensors({"q": q, "k": k, "v": v}, 4, 4)
    batch, seqlen_q, heads, head_dim = q.shape
    # How the tensors agree is checked here: the library sees one set of sizes (q's and k's), not each
    # tensor. The sizes' own rules (head_dim, nheads a multiple of nheads_k) are the library's.
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"q, k and v must have one batch_size, got {q.shape[0]}, {k.shape[0]} and {v.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k's headdim {k.shape[3]} must be q's {head_dim}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v's (seqlen_k, nheads_k) {tuple(v.shape[1:3])} must be k's {tuple(k.shape[1:3])}")
    causal = _validation.check_causal(causal)
    window = _validation.check_window_size(window_size)
    softcap = _validation.check_softcap(softcap)
    scale = _validation.resolve_softmax_scale(softmax_scale, head_dim)
    alibi_slopes = _check_alibi(alibi_slopes, q, batch, heads)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    left, right = window if window is not None else (-1, -1)
    dropout = draw_dropout(dropout_p, q.device)
    out, lse = _ops.forward(qt, kt, vt, None, alibi_slopes, scale, causal, left, right, softcap, True, *dropout)
    if not return_attn_probs:
        return out.transpose(1, 2)
    return out.transpose(1, 2), lse, _s_dmask(qt, kt, alibi_slopes, scale, causal, window, softcap, dropout)


def _s_dmask(q, k, alibi_slopes, scale, causal, window, softcap, dropout) -> torch.Tensor:
    """FlashAttention's S_dmask of (B, H, S, D) q and k (``flash_attn_func``'s return_attn_probs)."""
    if dropout[0] == 0.0:
        return q.new_empty((0,))
    slopes = None if alibi_slopes is None else alibi_slopes.detach().cpu().numpy()
    mask = dropout_module.s_dmask(as_numpy(q.detach().cpu()), as_numpy(k.detach().cpu()), dropout, causal=causal,
                                  softmax_scale=scale, window_size=window or (-1, -1), softcap=softcap,
                                  alibi_slopes=slopes)
    return torch.from_numpy(mask).to(dtype=q.dtype, device=q.device)


def _mask(attn_mask, query: torch.Tensor, target: tuple) -> torch.Tensor | None:
    """attn_mask checked and broadcast (without copying) to ``target``, the shape of the scores."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be a bool tensor (True = take part) or a floating-point one (added to the "
                        f"scores), got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} and query on {query.device}: pass one device")
    _check_no_grad("attn_mask", attn_mask)
    if attn_mask.dim() > len(target) or any(
            size not in (1, want) for size, want in zip(reversed(attn_mask.shape), reversed(target))):
        raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} is not broadcastable to the scores' shape "
                         f"{tuple(target)}")
    if attn_mask.is_floating_point() and attn_mask.dtype not in (query.dtype, torch.float32):
        attn_mask = attn_mask.to(torch.float32)
    return attn_mask.expand(target)


def _heads(query, key, value, enable_gqa: bool) -> int:
    """The heads of the output, by PyTorch's rules: with enable_gqa, the query's (the library then
    requires a multiple of the key heads); without, equal heads or one side's broadcast from 1."""
    hq, hk = query.shape[-3], key.shape[-3]
    if value.shape[-3] != hk:
        raise ValueError(f"value has {value.shape[-3]} heads and key {hk}: they must be equal")
    if enable_gqa:
        return hq
    if hq != hk and 1 not in (hq, hk):
        raise ValueError(f"query has {hq} heads and key {hk}: they must be equal or 1 (broadcast), or pass "
                         "enable_gqa=True for grouped-query attention")
    return max(hq, hk)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap) -> torch.Tensor:
    """scaled_dot_product_attention with the library's softcap (Hugging Face's Gemma 2 path)."""
    dropout_p = _validation.check_dropout_p(dropout_p)
    query, key, value = _autocast(query, key, value)
    if _empty((query, key, value)):
        # Nothing to compute (batch, heads or a sequence of 0): PyTorch's own result, empty or,
        # without keys, zeros, with its checks and autograd.
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                                dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                                                enable_gqa=enable_gqa)
    _check_tensors({"query": query, "key": key, "value": value}, 3, 64)
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key and value must have one number of dimensions, got {query.dim()}, {key.dim()} "
                         f"and {value.dim()}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's embedding size {key.shape[-1]} must be query's {query.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value's sequence length {value.shape[-2]} must be key's {key.shape[-2]}")
    is_causal = _validation.check_causal(is_causal)
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    scale = _validation.resolve_softmax_scale(scale, query.shape[-1], "scale")
    three_d = query.dim() == 3
    if three_d:
        query, key, value = (t.unsqueeze(-3) for t in (query, key, value))
    try:
        leading = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        raise ValueError(f"the batch dimensions of query {tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])} and "
                         f"value {tuple(value.shape[:-3])} do not broadcast") from None
    heads = _heads(query, key, value, enable_gqa)
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    scores = (*leading, heads, seqlen_q, seqlen_k)
    mask = _mask(attn_mask, query, scores[:-3] + scores[-2:] if three_d else scores)
    if mask is not None and three_d:
        mask = mask.unsqueeze(-3)
    query = query.expand(*leading, heads, *query.shape[-2:]).flatten(0, -4)
    key, value = (t.expand(*leading, *t.shape[-3:]).flatten(0, -4) for t in (key, value))
    mask = None if mask is None else mask.flatten(0, -4)
    # PyTorch aligns is_causal top-left (torch.tril): query i sees key j iff j <= i.
    causal, window = False, None
    if is_causal:
        if seqlen_q < seqlen_k:
            # Keys past the last query's position are seen by no query.
            key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
            mask = None if mask is None else mask[..., :seqlen_q]
        if seqlen_q > seqlen_k:
            window = (-1, seqlen_q - seqlen_k)
        else:
            causal = True
    bshd = query.stride(1) < query.stride(2)
    out = _forward(query, key, value, mask, None, scale, causal, window, softcap, bshd, dropout_p)[0]
    out = out.reshape(*leading, heads, seqlen_q, value.shape[-1])
    return out.squeeze(-3) if three_d else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """PyTorch's ``torch.nn.functional.scaled_dot_product_attention`` with the library's fused
    forward and backward: ``softmax(query @ key^T * scale + bias) @ value``.

    Args:
        query: (N, ..., Hq, L, E) or (N, L, E); float16, bfloat16 or float32; CPU or MPS.
        key: (N, ..., H, S, E); value: (N, ..., H, S, Ev), query's dtype and device. The batch
            dimensions broadcast; heads must be equal or one of them 1, or with ``enable_gqa`` Hq a
            multiple of H (query head h reads key head h // (Hq // H)).
        attn_mask: None; bool (True = take part in attention) or floating point (added to the
            scores; a dtype other than query's or float32 is converted to float32), broadcastable to
            (N, ..., Hq, L, S); never expanded in memory; no gradient.
        dropout_p: attention dropout in [0, 1), as ``flash_attn_func``'s (seed and offset drawn from
            the default generator of query's device and saved for the backward).
        is_causal: PyTorch's causal mask, aligned top-left (torch.tril): query i sees key j iff
            j <= i, whatever L and S. Combined with attn_mask when both are given.
        scale: None means 1 / sqrt(E).
        enable_gqa: grouped-query attention without repeating key and value.

    Returns:
        (N, ..., Hq, L, Ev) in query's dtype (under ``torch.autocast``, its dtype, as PyTorch's).
        A row that sees no key is 0 (as PyTorch's math backend). Differentiable with respect to
        query, key and value. Empty tensors (a dimension of 0) give PyTorch's own result (empty,
        or zeros where S is 0).

    Raises:
        TypeError, ValueError: invalid arguments, named.
        NotImplementedError: an attn_mask that requires grad.
        FlashAttentionError: the library reported an error.
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, 0.0)
