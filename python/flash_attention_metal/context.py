"""Context: one libFlashAttentionMetal context (a Metal device and its kernels, or the CPU engine)
and the NumPy forward/backward calls on it: float16, bfloat16 (``ml_dtypes.bfloat16``) or float32,
layout "bhsd" or "bshd", head_dim_v != head_dim, and the score options attn_mask, window_size,
softcap, alibi_slopes and sinks (FlashAttention's and PyTorch's names and meanings).

Math: FlashAttention-2 (Dao, 2023), Algorithms 1 and 2. Semantics as in the C header
flash_attention_metal.h: bottom-right causal alignment, rows without visible keys give out 0,
lse -inf (sinks[h] with sinks) and zero gradients, GQA/MQA by num_heads % num_kv_heads == 0.
"""

from __future__ import annotations

import numpy as np

from . import _abi, _interruptible, _layout, _validation, _varlen, plan
from ._native import NativeLibrary, native
from .profile import Profile, last_profile

BACKENDS = ("auto", "metal", "cpu")


def normalize_backend(value, name: str = "backend") -> str:
    """A backend name as every entry point takes it: a str, case and surrounding spaces ignored.

    ``name`` is what the error calls the value (the argument, or the environment variable).
    Raises TypeError for a non-str, ValueError for a name outside ``BACKENDS``.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a str (one of {', '.join(map(repr, BACKENDS))}), got {type(value).__name__}"
        )
    normalized = value.strip().lower()
    if normalized not in BACKENDS:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, BACKENDS))} (case and surrounding spaces "
            f"ignored), got {value!r}"
        )
    return normalized


class Context:
    """A library context on one backend; safe to use from several threads at once.

    Args:
        backend: ``"auto"`` (Metal where available, else the CPU engine), ``"metal"`` or ``"cpu"``;
            case and surrounding spaces are ignored (``normalize_backend``).

    Attributes:
        backend: the backend in use, ``"metal"`` or ``"cpu"``.
        device: the Metal device name, or a description of the CPU engine.
        note: why the backend is what it is (``""`` when there is nothing to say): where the Metal
            kernels came from, or why ``"auto"`` runs kernels on the CPU engine.
        requested_backend: the ``backend`` argument, normalized.

    With ``"auto"``, ``backend``, ``device`` and ``note`` are read at each access: a context whose
    GPU is lost (access revoked, device removed) runs later calls on the CPU engine.

    Raises:
        TypeError: backend is not a str.
        ValueError: an unknown backend name.
        FlashAttentionError: the library cannot be loaded, or the backend is unavailable
            (``FA_STATUS_BACKEND_UNAVAILABLE``, e.g. ``"metal"`` off Apple GPUs).
    """

    def __init__(self, backend: str = "auto") -> None:
        backend = normalize_backend(backend)
        self._native: NativeLibrary = native()
        ffi, lib = self._native.ffi, self._native.lib
        holder = ffi.new("fa_context **")
        backend_code = {"auto": lib.FA_BACKEND_AUTO, "metal": lib.FA_BACKEND_METAL, "cpu": lib.FA_BACKEND_CPU}
        self._native.raise_for_status(lib.fa_context_create(backend_code[backend], holder))
        self._handle = ffi.gc(holder[0], lib.fa_context_destroy)
        self.requested_backend = backend

    @property
    def backend(self) -> str:
        """``"metal"`` or ``"cpu"``."""
        return self._native.ffi.string(self._native.lib.fa_context_backend_name(self._handle)).decode()

    @property
    def device(self) -> str:
        """The Metal device name, or a description of the CPU engine."""
        return self._text(self._native.lib.fa_context_device_name(self._handle))

    @property
    def note(self) -> str:
        """Why the backend is what it is (``fa_context_backend_note``); ``""`` when nothing to say."""
        return self._text(self._native.lib.fa_context_backend_note(self._handle))

    def _text(self, pointer) -> str:
        return self._native.ffi.string(pointer).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Context(backend={self.backend!r}, device={self.device!r})"

    @property
    def gpu_cores(self) -> tuple[int, str]:
        """The GPU core count this context's calls plan their split-KV chunks for, and where it
        comes from: "FLASH_ATTENTION_GPU_CORES", "device" (Metal) or "nominal" (``plan.gpu_cores``;
        docs/decode.md). Raises FlashAttentionError for a bad FLASH_ATTENTION_GPU_CORES."""
        return plan.gpu_cores(self._handle, self._native)

    @property
    def max_head_dim(self) -> int:
        """Largest head_dim the kernels support (``fa_max_head_dim()``)."""
        return int(self._native.lib.fa_max_head_dim())

    @property
    def last_profile(self) -> Profile | None:
        """The profile of the calling thread's last successful ``forward``, ``backward`` or
        ``merge_attention`` on this context (each thread sees its own calls), or None before one;
        a failed call leaves it unchanged. See ``flash_attention_metal.profile.Profile``: ``seconds`` (Metal: GPU time;
        CPU engine: wall time) and one record per dispatched kernel (name, grid, threads,
        threadgroup memory, and on the CPU engine its SIMD-group matrix products and barriers)."""
        # The main thread's calls run on the interruptible-call worker, which holds their profile.
        return _interruptible.call(lambda: last_profile(self._native, self._handle))

    @property
    def library_path(self) -> str:
        """The file the library was loaded from."""
        return str(self._native.path)

    def forward(self, q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", attn_mask=None,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                dropout_offset=0, out=None, lse=None):
        """Attention forward pass.

        Scores are s = softcap * tanh(softmax_scale * q.k / softcap) (or softmax_scale * q.k when
        softcap is 0) - alibi_slopes[b, h] * |i + seqlen_k - seqlen_q - j| + attn_mask[b, h, i, j]
        (additive); keys outside the window, the causal mask or a boolean attn_mask get no weight;
        each head's sink joins the softmax denominator. Math: ``flash_attention_metal.reference``.

        Args:
            q: (batch, num_heads, seqlen_q, head_dim) for ``layout="bhsd"``, or
                (batch, seqlen_q, num_heads, head_dim) for ``"bshd"``; numpy.float16,
                ml_dtypes.bfloat16 or numpy.float32.
            k: (batch, num_kv_heads, seqlen_k, head_dim) in the same layout and dtype;
                num_heads % num_kv_heads == 0.
            v: like k, but with head_dim_v (1 ... max_head_dim, may differ from head_dim) last.
            causal: bool; bottom-right aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q),
                i.e. window right = 0.
            softmax_scale: finite real number; None means 1 / sqrt(head_dim).
            layout: ``"bhsd"`` (PyTorch, MLX) or ``"bshd"`` (FlashAttention); q, k, v, out only.
            attn_mask: None; bool (PyTorch's convention: True = may attend); or additive, in q's
                dtype or float32 (-inf hides a key; NaN and +inf are errors). Indexed (batch,
                num_heads, seqlen_q, seqlen_k) in every layout, any shape NumPy broadcasts to that
                (e.g. a (batch, 1, 1, seqlen_k) padding mask); size-1 axes are not expanded in memory.
                Combined with causal and the window. No gradient.
            window_size: FlashAttention's (left, right) sliding window, -1 = unbounded side: query i
                sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
            softcap: logit softcapping (Gemma 2), finite, >= 0; 0.0 is off.
            alibi_slopes: float32 (num_heads,) or (batch, num_heads), finite (FlashAttention's ALiBi:
                the bias is added to the scaled score). No gradient.
            sinks: float32 (num_heads,), finite: one virtual key per head with logit sinks[h] and no
                value (gpt-oss); backward then returns dsinks.
            dropout_p: FlashAttention's attention dropout, a real number in [0, 1); 0.0 is off. Each
                probability is dropped or kept and scaled by 1 / (1 - dropout_p) after the softmax
                (lse stays that of the undropped scores); ``philox.dropout_keep`` gives the mask.
            dropout_seed, dropout_offset: ints in [0, 2**64): the Philox key and counter base of the
                mask (the seed is required when dropout_p > 0); pass the backward the same three.
            out, lse: optional arrays to write the results into instead of fresh ones: out of q's
                dtype and the shape of the result in ``layout``, its last axis contiguous and its
                other strides positive; lse float32 (batch, num_heads, seqlen_q), C-contiguous;
                both writable and sharing no memory with q, k, v or each other.

        Any view whose last axis is contiguous (e.g. ``qkv[:, :, 0]`` of a (B, L, 3, H, D)
        projection) is read in place; other arrays are copied once (``_layout``).

        Returns:
            (out, lse): out in q's dtype and layout, with head_dim_v last, laid out in memory like
            q; lse float32 (batch, num_heads, seqlen_q) in either layout, the natural log of the
            softmax denominator (sinks included). A row left without keys gets out 0 and lse -inf,
            or lse sinks[h] with sinks. Fresh arrays, or the ``out`` and ``lse`` given. Accumulation
            is in float32; out is rounded once to the dtype.

        Raises:
            TypeError, ValueError: invalid arguments, each naming the argument and the rule, before
                anything is written (a rule the library enforces, e.g. the largest head_dim: its
                ``errors.ArgumentError``, a ValueError and a FlashAttentionError).
            FlashAttentionError: the library reported an error (status_name ``FA_STATUS_CANCELLED``
                when ``cancel`` stopped the call).
            KeyboardInterrupt: Ctrl-C during a call from the main thread (the call is cancelled).
        """
        checked = _validation.check_forward(
            q, k, v, causal, softmax_scale, layout, attn_mask=attn_mask, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
            dropout_offset=dropout_offset)
        return self._forward(q, k, v, checked, layout, out, lse)

    def _forward(self, q, k, v, checked, layout, out=None, lse=None):
        """``forward`` on arguments ``_validation.check_forward`` passed, ``checked`` being what it
        returned: the given outputs checked, then the call (the library refuses a problem it does
        not take before it writes anything)."""
        shape, causal, scale, options = checked
        lse_shape = (shape.batch, shape.num_heads, shape.seqlen_q)
        _check_given_outputs({"out": (out, q.dtype, q.shape[:3] + (shape.head_dim_v,)),
                              "lse": (lse, np.float32, lse_shape)}, layout, {"q": q, "k": k, "v": v})
        out = _layout.new_output(q, shape.head_dim_v) if out is None else out
        lse = np.empty(lse_shape, dtype=np.float32) if lse is None else lse
        tensors = {name: _layout.as_input(a, layout) for name, a in (("q", q), ("k", k), ("v", v))}
        tensors["out"] = _layout.as_output(out, layout)
        ffi = self._native.ffi
        problem, keep = _abi.numpy_problem(self._native, shape, causal, scale, q.dtype, tensors, options)
        self._call("fa_forward", problem, *(_abi.pointer(ffi, tensors[name].address) for name in ("q", "k", "v", "out")),
                   ffi.from_buffer("float[]", lse, require_writable=True))
        del keep  # the arrays the problem points into lived until here
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, layout="bhsd",
                 attn_mask=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                 dropout_p=0.0, dropout_seed=None, dropout_offset=0, dq=None, dk=None, dv=None):
        """Attention backward pass (FlashAttention-2, Algorithm 2; D_i = rowsum(dout * out)), through
        the softcap's tanh exactly.

        Args:
            dout: like out (q's dtype and layout, head_dim_v last), the gradient of the loss with
                respect to out.
            q, k, v: as for ``forward``.
            out, lse: as ``forward`` returned them for the same q, k, v and options. Rows whose
                |lse| >= 256 (a whole row masked with float32's minimum, say), where float32 lse
                may have lost part of log(row sum) beside the row max, get their normaliser
                recomputed from the scores when lse is this forward's (the C header's fa_backward
                says when, and what that means for the lse of a longer row).
            causal, softmax_scale, layout, attn_mask, window_size, softcap, alibi_slopes, sinks,
                dropout_p, dropout_seed, dropout_offset: as for ``forward`` (views read in place
                likewise; the dropout mask is regenerated from the seed and offset, so they must be
                the forward's).
            dq, dk, dv: optional arrays to write the gradients into instead of fresh ones, each of
                q's dtype and shaped like q, k, v, with the rules of ``forward``'s ``out``
                (writable in place, sharing no memory with any other argument).

        Returns:
            (dq, dk, dv) without sinks, (dq, dk, dv, dsinks) with them: dq, dk, dv in the dtype and
            layout of q, k, v and shaped like them, each laid out in memory like its input; dk and dv
            sum over the query heads that share a KV head; dsinks float32 (num_heads,),
            -sum over batch and query rows of exp(sinks[h] - lse) * D. No gradient for attn_mask or
            alibi_slopes. Deterministic. Fresh arrays, or the ones given.

        Raises:
            TypeError, ValueError: invalid arguments, each naming the argument and the rule, before
                anything is written (a rule the library enforces, e.g. the largest head_dim: its
                ``errors.ArgumentError``, a ValueError and a FlashAttentionError).
            FlashAttentionError: the library reported an error (status_name ``FA_STATUS_CANCELLED``
                when ``cancel`` stopped the call).
            KeyboardInterrupt: Ctrl-C during a call from the main thread (the call is cancelled).
        """
        checked = _validation.check_backward(
            dout, q, k, v, out, lse, causal, softmax_scale, layout, attn_mask=attn_mask,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
            dropout_seed=dropout_seed, dropout_offset=dropout_offset)
        return self._backward(dout, q, k, v, out, lse, checked, layout, dq, dk, dv)

    def _backward(self, dout, q, k, v, out, lse, checked, layout, dq=None, dk=None, dv=None):
        """``backward`` on arguments ``_validation.check_backward`` passed, ``checked`` being what
        it returned, as ``_forward``."""
        shape, causal, scale, options = checked
        given = {"dq": dq, "dk": dk, "dv": dv}
        _check_given_outputs({name: (given[name], q.dtype, like.shape) for name, like in zip(given, (q, k, v))},
                             layout, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
        grads = [_layout.new_output(like, like.shape[3]) if grad is None else grad
                 for grad, like in zip(given.values(), (q, k, v))]
        inputs = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
        tensors = {name: _layout.as_input(a, layout) for name, a in inputs}
        tensors.update((name, _layout.as_output(g, layout)) for name, g in zip(("dq", "dk", "dv"), grads))
        lse = np.ascontiguousarray(lse)
        ffi = self._native.ffi
        problem, keep = _abi.numpy_problem(self._native, shape, causal, scale, q.dtype, tensors, options)
        if options.sinks is not None:
            grads.append(np.empty(shape.num_heads, dtype=np.float32))
            problem.dsinks = ffi.from_buffer("float[]", grads[3], require_writable=True)
        pointers = {name: _abi.pointer(ffi, tensor.address) for name, tensor in tensors.items()}
        self._call("fa_backward", problem, *(pointers[name] for name in ("dout", "q", "k", "v", "out")),
                   ffi.from_buffer("float[]", lse), *(pointers[name] for name in ("dq", "dk", "dv")))
        del keep  # the arrays the problem points into lived until here
        return tuple(grads)

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                       softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                       dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        """Attention forward over a variable-length batch (FlashAttention's flash_attn_varlen_func):
        sequences packed along the rows instead of padded.

        Args:
            q: (total_q, num_heads, head_dim); k: (total_k, num_kv_heads, head_dim); v: (total_k,
                num_kv_heads, head_dim_v); one dtype of float16, bfloat16, float32. Views whose last
                axis is contiguous are read in place.
            cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), starting at 0, non-decreasing, ending at
                total_q and total_k: sequence b is query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
                over keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]), and attends only within itself. A
                sequence may be empty (0 rows or 0 keys).
            max_seqlen_q, max_seqlen_k: ints at least the longest sequence of each table (the grid
                covers the longest one the table holds).
            causal, softmax_scale, window_size, softcap, sinks: as for ``forward``, per sequence
                (causal and the window bottom-right aligned in each sequence); alibi_slopes float32
                (num_heads,) or (batch, num_heads); dropout_p, dropout_seed, dropout_offset as for
                ``forward``, the mask of sequence b that of batch entry b with rows and keys counted
                from the sequence's first. No attn_mask.

        Returns:
            (out, lse): out (total_q, num_heads, head_dim_v) in q's dtype, lse float32 (num_heads,
            total_q), FlashAttention's layout. Rows of a sequence without keys get out 0 and lse -inf
            (sinks[h] with sinks). Fresh C-contiguous arrays.

        Raises:
            TypeError, ValueError: invalid arguments, each naming the argument and the rule (the
                tables are checked here, in host memory; the library only clamps them).
            FlashAttentionError: the library reported an error.
        """
        checked = _varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       softmax_scale, window_size=window_size, softcap=softcap,
                                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                       dropout_seed=dropout_seed, dropout_offset=dropout_offset)
        return _varlen.forward(self, q, k, v, checked)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        """Attention backward over a variable-length batch: the gradients of ``forward_varlen``.

        Args:
            dout: like out, (total_q, num_heads, head_dim_v) in q's dtype.
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k and the options: as
                for ``forward_varlen``.
            out, lse: as ``forward_varlen`` returned them for the same arguments.

        Returns:
            (dq, dk, dv) shaped like q, k, v in their dtype, and dsinks float32 (num_heads,) after
            them when sinks are given (summed over all sequences). dk and dv sum over each GQA group;
            rows of empty sequences get zero gradients. Deterministic (no atomics).

        Raises:
            TypeError, ValueError: invalid arguments, each naming the argument and the rule, before
                anything is written (a rule the library enforces, e.g. the largest head_dim: its
                ``errors.ArgumentError``, a ValueError and a FlashAttentionError).
            FlashAttentionError: the library reported an error.
        """
        checked = _varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       softmax_scale, window_size=window_size, softcap=softcap,
                                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                       dropout_seed=dropout_seed, dropout_offset=dropout_offset)
        return _varlen.backward(self, dout, q, k, v, out, lse, checked)

    def _call(self, function: str, *arguments) -> None:
        """``_native.lib.<function>(context, *arguments)``: a C ABI call on this context (fa_forward,
        fa_backward, fa_plan_execute, ...), with arguments made through ``_native.ffi`` (a problem
        from ``flash_attention_metal._abi``), kept alive by the caller until it returns. The one way
        every front end of this package calls the library (package-internal, as ``_native``, the
        loaded library): interruptible when made from the main thread (Ctrl-C cancels it,
        KeyboardInterrupt); raises FlashAttentionError when the library reports a failure
        (``ArgumentError``, also a ValueError, for an argument it refuses)."""
        call = getattr(self._native.lib, function)
        _interruptible.call(lambda: self._native.raise_for_status(call(self._handle, *arguments)), self.cancel)

    def cancel(self) -> None:
        """Cancels the calls in flight on this context, from any thread (``fa_context_cancel``).

        Each call that started before stops early (the CPU engine within its current threadgroups,
        Metal before its next command buffer) and raises FlashAttentionError with status_name
        ``FA_STATUS_CANCELLED``, unless it had already finished its work; calls that start
        afterwards run normally. Returns at once. Ctrl-C during a call made from the main thread
        does this and raises KeyboardInterrupt there, so it also cancels the calls other threads
        have in flight on the same context.
        """
        self._native.raise_for_status(self._native.lib.fa_context_cancel(self._handle))

    def attention(self, q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", attn_mask=None,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        """``forward`` without lse: returns out, in q's dtype and layout."""
        return self.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, attn_mask=attn_mask,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                            dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)[0]

    def merge_attention(self, out_a, lse_a, out_b, lse_b):
        """Merges two attention results over disjoint key sets of the same queries into the result
        over their union (the log-sum-exp combine of split-KV decoding and ring attention).

        Per row, with m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m):
        out = (w_a out_a + w_b out_b) / (w_a + w_b) and lse = m + log(w_a + w_b), in float32 with
        one rounding of out to its dtype. A part with lse -inf (it saw no key) contributes nothing
        and its out is not used; a row empty in both parts gets out 0 and lse -inf (no NaN).
        ``forward`` over keys k[:, :, :s] merged with ``forward`` over k[:, :, s:] is ``forward``
        over all keys (for causal masks, when each part's mask is the restriction of the full one).

        Args:
            out_a, out_b: float16, bfloat16 or float32 (one dtype), one shape (..., head_dim), e.g.
                ``forward``'s out.
            lse_a, lse_b: float32 of shape (...), the leading shape of out_a, e.g. ``forward``'s lse.

        Returns:
            (out, lse): out like out_a (dtype and shape), lse float32 like lse_a. Fresh arrays.

        Raises:
            TypeError, ValueError: invalid arguments, each naming the argument and the rule, before
                anything is written (a rule the library enforces, e.g. the largest head_dim: its
                ``errors.ArgumentError``, a ValueError and a FlashAttentionError).
            FlashAttentionError: the library reported an error (status_name ``FA_STATUS_CANCELLED``
                when ``cancel`` stopped the call).
            KeyboardInterrupt: Ctrl-C during a call from the main thread (the call is cancelled).
        """
        rows, head_dim = _validation.check_merge(out_a, lse_a, out_b, lse_b)
        # Shapes first: np.ascontiguousarray turns a 0-D lse (one row) into shape (1,).
        out = np.empty(out_a.shape, dtype=out_a.dtype)
        lse = np.empty(lse_a.shape, dtype=np.float32)
        out_a, lse_a, out_b, lse_b = (np.ascontiguousarray(a) for a in (out_a, lse_a, out_b, lse_b))
        ffi, lib = self._native.ffi, self._native.lib
        self._call("fa_merge_attention_v2", rows, head_dim, getattr(lib, _abi.DTYPE_CODES[out.dtype.name]),
                   _address(ffi, out_a), ffi.from_buffer("float[]", lse_a),
                   _address(ffi, out_b), ffi.from_buffer("float[]", lse_b),
                   _address(ffi, out), ffi.from_buffer("float[]", lse, require_writable=True))
        return out, lse

    def _problem(self, shape: _validation.Shape, causal: bool, scale: float, dtype=np.float16, tensors=None):
        """A bare fa_problem of this context's library, score options off (``_abi.new_problem``);
        ``tensors`` maps fa_problem's stride fields to their ``_abi.Tensor`` (absent: contiguous)."""
        strides = {name: tensor.strides for name, tensor in (tensors or {}).items()}
        return _abi.new_problem(self._native.ffi, self._native.lib, shape, causal, scale, np.dtype(dtype).name,
                                strides)


def _check_given_outputs(outputs: dict, layout: str, inputs: dict) -> None:
    """Checks the outputs a caller provides, ``name: (array or None, dtype, shape)``, each against
    the inputs and the outputs checked before it (``_layout.check_given_output``)."""
    others = dict(inputs)
    for name, (array, dtype, shape) in outputs.items():
        if array is not None:
            _layout.check_given_output(name, array, dtype, shape, layout, others)
            others[name] = array


def _address(ffi, array: np.ndarray):
    # A contiguous array's data as void * (cffi's from_buffer cannot read ml_dtypes' bfloat16); the
    # caller keeps the array alive for the call.
    return _abi.pointer(ffi, array.ctypes.data)


__all__ = ["BACKENDS", "Context", "normalize_backend"]
