"""Shared by the PyTorch tests: tensors to NumPy (bfloat16 through its bits, for the references
only), and the two oracles of the accuracy rule.

- The library's rule (``flash_attention_metal.accuracy``): ``ref`` the float64 reference, ``base``
  the NumPy baselines of the dtype (``accuracy.evaluate_forward``/``evaluate_backward``).
- PyTorch in both roles: ``ref`` is PyTorch's own attention in float64 (the inputs converted
  exactly), ``base`` PyTorch's attention in the inputs' dtype, with ``PYTORCH_FACTOR`` and the
  rule's absolute term.
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


#: The factor on PyTorch's own error when PyTorch is the oracle. Its CPU SDPA keeps S, P and dS in
#: float32 and rounds only its results, so its error is little more than that last rounding
#: (measured: bfloat16 dq 3.7e-3, half an ulp at |dq| in [1, 2)), while the library's rule models a
#: framework that also rounds S, P and dS to the dtype (its base: 5.3e-3 on the same case, ours
#: 8.6e-3 within 2x of it). Against the more accurate oracle we allow 3x, the gradient factor of
#: FlashAttention-2's tests; the library's rule (``assert_rule``) stays the primary check.
PYTORCH_FACTOR = 3.0


def within(ours, base, ref) -> tuple[bool, str]:
    """Whether max|ours - ref| <= PYTORCH_FACTOR * max|base - ref| + the rule's absolute term
    (``accuracy.absolute_term``), and the figures."""
    ours, base, ref = (x.detach().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)
                       for x in (ours, base, ref))
    error = accuracy.max_abs_error(ours, ref)
    bound = PYTORCH_FACTOR * accuracy.max_abs_error(base, ref) + accuracy.absolute_term(ref)
    return error <= bound, f"error {error:.3e}, bound {bound:.3e}"


def assert_rule(outputs: dict, q, k, v, dout, **options) -> None:
    """``outputs`` (out, and dq, dk, dv all or none: tensors in the (B, H, S, D) layout) within the
    library's rule (``accuracy.evaluate_forward``/``evaluate_backward``) for the (B, H, S, D) tensors
    q, k, v and dout under the reference's ``options``."""
    arrays = [to_numpy(t) for t in (q, k, v, dout)]
    metrics = accuracy.evaluate_forward(*arrays[:3], to_numpy(outputs["out"]), None, **options)
    if "dq" in outputs:
        metrics += accuracy.evaluate_backward(arrays[3], *arrays[:3],
                                              *(to_numpy(outputs[name]) for name in ("dq", "dk", "dv")), **options)
    failed = [m for m in metrics if not m.passed]
    assert not failed, "against the float64 reference: " + accuracy.describe(failed)


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
        ok, figures = within(value, results["base"][name], results["ref"][name])
        assert ok, f"{name} against PyTorch: {figures}"
