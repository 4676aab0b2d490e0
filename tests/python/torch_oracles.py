"""Shared by the PyTorch tests: tensors to NumPy (bfloat16 through its bits, for the references
only), and the two oracles of the accuracy rule.

- The library's rule (``flash_attention_metal.accuracy``): ``ref`` the float64 reference, ``base``
  the NumPy baseline of the dtype: max|ours - ref| <= factor * max|base - ref| + slack(dtype).
- PyTorch in both roles: ``ref`` is PyTorch's own attention in float64 (the inputs converted
  exactly), ``base`` PyTorch's attention in the inputs' dtype, with the same factors and slack.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from flash_attention_metal import accuracy, reference


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a NumPy array of the same dtype (bfloat16: ml_dtypes.bfloat16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def within(ours, base, ref, factor: float, dtype) -> tuple[bool, str]:
    """Whether max|ours - ref| <= factor * max|base - ref| + slack(dtype), and the figures."""
    ours, base, ref = (x.detach().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)
                       for x in (ours, base, ref))
    error = accuracy.max_abs_error(ours, ref)
    bound = factor * accuracy.max_abs_error(base, ref) + accuracy.slack(np.dtype(dtype))
    return error <= bound, f"error {error:.3e}, bound {bound:.3e}"


def assert_rule(outputs: dict, q, k, v, dout, **options) -> None:
    """``outputs`` (out, dq, dk, dv: tensors in the (B, H, S, D) layout) within the library's rule
    for the (B, H, S, D) tensors q, k, v and dout under the reference's ``options``."""
    arrays = [to_numpy(t) for t in (q, k, v, dout)]
    dtype = arrays[0].dtype
    ref_out, _ = reference.forward(*arrays[:3], **options)
    base_out, _ = accuracy.base_forward(*arrays[:3], **options)
    refs = reference.backward(arrays[3], *arrays[:3], **options)
    bases = accuracy.base_backward(arrays[3], *arrays[:3], **options)
    checks = {"out": (base_out, ref_out, accuracy.OUT_FACTOR)}
    checks.update((name, (base, ref, accuracy.GRAD_FACTOR)) for name, base, ref in zip(("dq", "dk", "dv"), bases, refs))
    for name, ours in outputs.items():
        base, ref, factor = checks[name]
        ok, figures = within(ours, base, ref, factor, dtype)
        assert ok, f"{name} against the float64 reference: {figures}"


def assert_like_pytorch(ours: dict, function, inputs: dict, dout, dtype) -> None:
    """``ours`` (out, and the gradients of (out * dout).sum() by input name) within the rule with
    PyTorch as the oracle: ``function(**inputs)`` in float64 as ref, in ``dtype`` as base."""
    results = {}
    for name, cast in (("ref", torch.float64), ("base", dtype)):
        leaves = {key: t.detach().to(cast).requires_grad_(t.requires_grad) if t.is_floating_point() else t
                  for key, t in inputs.items()}
        out = function(**leaves)
        differentiable = [key for key, t in leaves.items() if t.requires_grad]
        grads = torch.autograd.grad((out * dout.to(cast)).sum(), [leaves[key] for key in differentiable])
        results[name] = {"out": out, **dict(zip(differentiable, grads))}
    for name, value in ours.items():
        factor = accuracy.OUT_FACTOR if name == "out" else accuracy.GRAD_FACTOR
        ok, figures = within(value, results["base"][name], results["ref"][name], factor, to_numpy(value).dtype)
        assert ok, f"{name} against PyTorch: {figures}"
