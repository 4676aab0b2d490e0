"""What ``bench --compare`` runs side by side: the attention shapes (``Case``) and the
implementations, the library and its peers.

Every implementation gets the same float16 q, k, v, dout and computes the same attention (scale
1/sqrt(head_dim), causal aligned bottom-right) in its own way:

- ``library``: this library's Context (Metal on an Apple GPU, else the CPU engine).
- ``mlx``: ``mx.fast.scaled_dot_product_attention`` in float16 on MLX's default device (the GPU on a
  Mac, the CPU with ``mlx[cpu]`` on Linux); forward+backward through ``mx.vjp``.
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` in float16 on MPS where available,
  else the CPU with PyTorch's default thread settings (reported with the device); forward+backward
  through autograd.
- ``numpy``: the library's float64 NumPy reference (``flash_attention_metal.reference``), which
  materializes the attention matrix.

An operation is a zero-argument callable that returns when the result is computed (MLX evaluated,
MPS synchronized).
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from ._measure import forward_flops, random_inputs

OPERATIONS = ("forward", "fwd+bwd")
PEERS = ("mlx", "torch", "numpy")
# Backward is 2.5x the forward FLOPs (FlashAttention's count), so forward+backward is 3.5x.
_FLOP_FACTOR = {"forward": 1.0, "fwd+bwd": 3.5}


@dataclass(frozen=True)
class Case:
    """One attention shape. Causal cases are square (seqlen_q == seqlen_k), where the bottom-right
    alignment of the library and MLX and the top-left one of PyTorch's ``is_causal`` agree."""

    kind: str
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool

    def __post_init__(self) -> None:
        if self.causal and self.seqlen_q != self.seqlen_k:
            raise ValueError("a causal comparison case must be square (seqlen_q == seqlen_k)")

    @property
    def label(self) -> str:
        """E.g. ``prefill GQA B1 H8/2 256x256 D64 causal`` (H query/KV heads, seqlen_q x seqlen_k)."""
        return (f"{self.kind} B{self.batch} H{self.num_heads}/{self.num_kv_heads} "
                f"{self.seqlen_q}x{self.seqlen_k} D{self.head_dim}" + (" causal" if self.causal else ""))

    def flops(self, operation: str) -> float:
        """FlashAttention's FLOP count of ``operation`` on this shape."""
        return _FLOP_FACTOR[operation] * forward_flops(self.batch, self.num_heads, self.seqlen_q, self.seqlen_k,
                                                       self.head_dim, self.causal)

    def inputs(self) -> list[np.ndarray]:
        """Seeded N(0, 1) float16 q, k, v, dout (the same for every implementation)."""
        query = (self.batch, self.num_heads, self.seqlen_q, self.head_dim)
        key = (self.batch, self.num_kv_heads, self.seqlen_k, self.head_dim)
        return random_inputs([query, key, key, query], zlib.crc32(self.label.encode()), self.label)

    def small(self) -> Case:
        """The same kind of case at 16 keys (and 16 queries unless it decodes one): a warm-up that
        reaches the same kernels without the measured call's allocations."""
        return replace(self, seqlen_q=min(self.seqlen_q, 16), seqlen_k=16)

    def to_dict(self) -> dict:
        return asdict(self)


class Unavailable(Exception):
    """A peer that cannot run here; the message says why and how to install it."""


class Library:
    """This library on a Context."""

    name = "library"

    def __init__(self, context) -> None:
        from .. import __version__

        self.context = context
        self.version = __version__
        self.device = f"{context.backend}: {context.device}"

    def operations(self, case: Case, q, k, v, dout) -> dict[str, Callable[[], object]]:
        context, causal = self.context, case.causal

        def both():
            out, lse = context.forward(q, k, v, causal=causal)
            return context.backward(dout, q, k, v, out, lse, causal=causal)

        return {"forward": lambda: context.forward(q, k, v, causal=causal), "fwd+bwd": both}

    def device_ms(self, case: Case, q, k, v, dout, operation: str) -> float:
        """The library's own time of one more run of ``operation`` from its profile
        (``Context.last_profile``: GPU time on Metal, engine wall time on the CPU)."""
        context, causal = self.context, case.causal
        out, lse = context.forward(q, k, v, causal=causal)
        seconds = context.last_profile.seconds
        if operation == "fwd+bwd":
            context.backward(dout, q, k, v, out, lse, causal=causal)
            seconds += context.last_profile.seconds
        return seconds * 1e3

    def release_caches(self) -> None:
        """Nothing to release: the library allocates per call."""


class NumPyReference:
    """The float64 NumPy reference: exact math that materializes the attention matrix."""

    name = "numpy"

    def __init__(self) -> None:
        from .. import reference

        self.reference = reference
        self.version = np.__version__
        self.device = "CPU (float64 reference)"

    def operations(self, case: Case, q, k, v, dout) -> dict[str, Callable[[], object]]:
        reference, causal = self.reference, case.causal

        def both():
            reference.forward(q, k, v, causal=causal)
            return reference.backward(dout, q, k, v, causal=causal)

        return {"forward": lambda: reference.forward(q, k, v, causal=causal), "fwd+bwd": both}

    def release_caches(self) -> None:
        """Nothing cached."""


class MLX:
    """``mx.fast.scaled_dot_product_attention`` on MLX's default device."""

    name = "mlx"

    def __init__(self) -> None:
        try:
            import mlx.core as mx
        except ImportError:
            raise Unavailable("not installed (macOS on Apple silicon: pip install mlx; "
                              "Linux: pip install 'mlx[cpu]')") from None
        self.mx = mx
        self.version = mx.__version__
        device = mx.default_device()
        try:
            self.device = f"{device.type.name}: {mx.device_info()['device_name']}"
        except (AttributeError, KeyError, RuntimeError):
            self.device = str(device)

    def operations(self, case: Case, q, k, v, dout) -> dict[str, Callable[[], object]]:
        mx = self.mx
        q, k, v, dout = (mx.array(a) for a in (q, k, v, dout))
        scale = 1.0 / float(np.sqrt(case.head_dim))
        mask = "causal" if case.causal else None

        def attention(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        def forward():
            out = attention(q, k, v)
            mx.eval(out)
            return out

        def both():
            result = mx.vjp(attention, [q, k, v], [dout])
            mx.eval(result)
            return result

        return {"forward": forward, "fwd+bwd": both}

    def release_caches(self) -> None:
        """Empties MLX's buffer cache, which would otherwise serve the measured call."""
        self.mx.clear_cache()


class Torch:
    """``torch.nn.functional.scaled_dot_product_attention`` on MPS, else the CPU."""

    name = "torch"

    def __init__(self) -> None:
        try:
            import torch
            from torch.nn import functional
        except ImportError:
            raise Unavailable("not installed (pip install torch)") from None
        self.torch, self.functional = torch, functional
        self.version = torch.__version__
        self.device = "mps" if torch.backends.mps.is_available() else "cpu"
        # PyTorch's own thread settings, left as they are (its default: one intra-op thread per
        # physical core) and reported with the results, since its CPU timings depend on them.
        self.settings = "" if self.device == "mps" else (
            f", {torch.get_num_threads()} intra-op and {torch.get_num_interop_threads()} inter-op threads "
            "(PyTorch's defaults, not changed)")
        major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        # enable_gqa arrived in PyTorch 2.5; before it, users repeat the KV heads themselves.
        self.native_gqa = (major, minor) >= (2, 5)

    def _synchronize(self) -> None:
        if self.device == "mps":
            self.torch.mps.synchronize()

    def operations(self, case: Case, q, k, v, dout) -> dict[str, Callable[[], object]]:
        torch, functional = self.torch, self.functional
        q, k, v, dout = (torch.from_numpy(a).to(self.device) for a in (q, k, v, dout))
        scale = 1.0 / float(np.sqrt(case.head_dim))
        group = case.num_heads // case.num_kv_heads

        def attention(q, k, v):
            options = {}
            if group > 1 and self.native_gqa:
                options["enable_gqa"] = True
            elif group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=scale, **options)

        def forward():
            with torch.no_grad():
                out = attention(q, k, v)
            self._synchronize()
            return out

        def both():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            attention(*leaves).backward(dout)
            self._synchronize()
            return [leaf.grad for leaf in leaves]

        return {"forward": forward, "fwd+bwd": both}

    def release_caches(self) -> None:
        """Returns MPS's cached blocks, which would otherwise serve the measured call."""
        if self.device == "mps":
            self.torch.mps.empty_cache()


def load_peer(name: str):
    """The peer called ``name`` (one of ``PEERS``); raises Unavailable when it cannot run here."""
    return {"mlx": MLX, "torch": Torch, "numpy": NumPyReference}[name]()


__all__ = ["Case", "Library", "MLX", "NumPyReference", "OPERATIONS", "PEERS", "Torch", "Unavailable", "load_peer"]
