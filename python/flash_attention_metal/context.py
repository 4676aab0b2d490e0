"""Context: one libFlashAttentionMetal context (a Metal device and its kernels, or the CPU engine)
and the NumPy forward/backward calls on it.

Math: FlashAttention-2 (Dao, 2023), Algorithms 1 and 2. Semantics as in the C header
flash_attention_metal.h: bottom-right causal alignment, rows without visible keys give out 0,
lse -inf and zero gradients, GQA/MQA by num_heads % num_kv_heads == 0.
"""

from __future__ import annotations

import numpy as np

from . import _interruptible, _validation
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
    def max_head_dim(self) -> int:
        """Largest head_dim the kernels support (``fa_max_head_dim()``)."""
        return int(self._native.lib.fa_max_head_dim())

    @property
    def last_profile(self) -> Profile | None:
        """The profile of the calling thread's last successful ``forward``/``backward`` on this
        context (each thread sees its own calls), or None before one; a failed call leaves it
        unchanged. See ``flash_attention_metal.profile.Profile``: ``seconds`` (Metal: GPU time;
        CPU engine: wall time) and one record per dispatched kernel (name, grid, threads,
        threadgroup memory, and on the CPU engine its SIMD-group matrix products and barriers)."""
        # The main thread's calls run on the interruptible-call worker, which holds their profile.
        return _interruptible.call(lambda: last_profile(self._native, self._handle))

    @property
    def library_path(self) -> str:
        """The file the library was loaded from."""
        return str(self._native.path)

    def forward(self, q, k, v, *, causal=False, softmax_scale=None):
        """Attention forward pass.

        Args:
            q: float16 (batch, num_heads, seqlen_q, head_dim).
            k, v: float16 (batch, num_kv_heads, seqlen_k, head_dim); num_heads % num_kv_heads == 0.
            causal: bool; bottom-right aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q).
            softmax_scale: finite real number; None means 1 / sqrt(head_dim).

        Returns:
            (out, lse): out float16 like q; lse float32 (batch, num_heads, seqlen_q), the natural
            log of the softmax denominator (-inf for rows that see no key). Fresh arrays.

        Raises:
            TypeError, ValueError: invalid arguments (checked before any native call).
            FlashAttentionError: the library reported an error (status_name ``FA_STATUS_CANCELLED``
                when ``cancel`` stopped the call).
            KeyboardInterrupt: Ctrl-C during a call from the main thread (the call is cancelled).
        """
        shape, causal, scale = _validation.check_forward(q, k, v, causal, softmax_scale)
        _validation.check_head_dim(shape, self.max_head_dim)
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        out = np.empty(q.shape, dtype=np.float16)
        lse = np.empty(q.shape[:3], dtype=np.float32)
        ffi, lib = self._native.ffi, self._native.lib
        arguments = (
            self._handle, self._problem(shape, causal, scale),
            _half_in(ffi, q), _half_in(ffi, k), _half_in(ffi, v),
            _half_out(ffi, out), ffi.from_buffer("float[]", lse, require_writable=True),
        )
        _interruptible.call(lambda: self._native.raise_for_status(lib.fa_forward(*arguments)), self.cancel)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal=False, softmax_scale=None):
        """Attention backward pass (FlashAttention-2, Algorithm 2; D_i = rowsum(dout * out)).

        Args:
            dout: float16 like q, the gradient of the loss with respect to out.
            q, k, v: as for ``forward``.
            out, lse: as ``forward`` returned them for the same q, k, v, causal and softmax_scale.
            causal, softmax_scale: as for ``forward``.

        Returns:
            (dq, dk, dv): float16 like q, k, v; dk and dv sum over the query heads that share a KV
            head. Deterministic. Fresh arrays.

        Raises:
            TypeError, ValueError: invalid arguments (checked before any native call).
            FlashAttentionError: the library reported an error (status_name ``FA_STATUS_CANCELLED``
                when ``cancel`` stopped the call).
            KeyboardInterrupt: Ctrl-C during a call from the main thread (the call is cancelled).
        """
        shape, causal, scale = _validation.check_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        _validation.check_head_dim(shape, self.max_head_dim)
        dout, q, k, v, out, lse = (np.ascontiguousarray(a) for a in (dout, q, k, v, out, lse))
        dq = np.empty(q.shape, dtype=np.float16)
        dk = np.empty(k.shape, dtype=np.float16)
        dv = np.empty(v.shape, dtype=np.float16)
        ffi, lib = self._native.ffi, self._native.lib
        arguments = (
            self._handle, self._problem(shape, causal, scale),
            _half_in(ffi, dout), _half_in(ffi, q), _half_in(ffi, k), _half_in(ffi, v),
            _half_in(ffi, out), ffi.from_buffer("float[]", lse),
            _half_out(ffi, dq), _half_out(ffi, dk), _half_out(ffi, dv),
        )
        _interruptible.call(lambda: self._native.raise_for_status(lib.fa_backward(*arguments)), self.cancel)
        return dq, dk, dv

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

    def attention(self, q, k, v, *, causal=False, softmax_scale=None):
        """``forward`` without lse: returns out, float16 like q."""
        return self.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)[0]

    def _problem(self, shape: _validation.Shape, causal: bool, scale: float):
        problem = self._native.ffi.new("fa_problem *")
        problem.struct_size = self._native.ffi.sizeof("fa_problem")
        problem.batch = shape.batch
        problem.num_heads = shape.num_heads
        problem.num_kv_heads = shape.num_kv_heads
        problem.seqlen_q = shape.seqlen_q
        problem.seqlen_k = shape.seqlen_k
        problem.head_dim = shape.head_dim
        problem.causal = int(causal)
        problem.softmax_scale = scale
        return problem


def _half_in(ffi, array: np.ndarray):
    # float16 has no C type; the ABI takes the bit patterns as uint16_t.
    return ffi.from_buffer("uint16_t[]", array)


def _half_out(ffi, array: np.ndarray):
    return ffi.from_buffer("uint16_t[]", array, require_writable=True)


__all__ = ["BACKENDS", "Context", "normalize_backend"]
