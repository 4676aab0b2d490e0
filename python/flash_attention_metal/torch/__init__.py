"""The library's attention for PyTorch: FlashAttention's ``flash_attn_func`` and a drop-in for
``torch.nn.functional.scaled_dot_product_attention``, both with the fused backward
(FlashAttention-2, Algorithms 1 and 2), on CPU tensors (the CPU engine, through the C ABI, in place)
and MPS tensors (the kernels encoded on PyTorch's MPS stream through ``torch.mps.compile_shader``).

The work is done by two custom operators, ``torch.ops.flash_attention_metal.forward`` and
``.backward`` (``torch.library.custom_op``, with fake implementations and an autograd formula), so
``torch.compile(fullgraph=True)`` traces through them and ``torch.library.opcheck`` passes.
``flash_attention_metal.torch.transformers`` registers the attention with Hugging Face transformers.
``flash_attn_varlen_func`` (CPU tensors) runs on ``varlen_forward`` and ``varlen_backward``;
``flash_attn_with_kvcache`` (CPU tensors, forward only, appending to the caches in place) on
``kvcache_forward``. FlashAttention's packed entry points (``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func`` and their varlen forms) split the packed tensor into views and call
these. ``mps_tensor_ops()`` says which kernels the last MPS pass took, the Metal 4 tensor-op ones
(docs/tensor-ops.md) or not, and why. See docs/pytorch.md.
"""

try:
    import torch  # noqa: F401
except ImportError as error:  # the message names the extra that installs PyTorch
    raise ImportError(
        "flash_attention_metal.torch needs PyTorch: install the package's 'torch' extra, e.g. "
        "pip install -e 'python[torch]' in the repository"
    ) from error

from ._interface import flash_attn_func, scaled_dot_product_attention
from ._kv_cache import flash_attn_with_kvcache
from ._mps import tensor_ops as mps_tensor_ops
from ._packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                      flash_attn_varlen_qkvpacked_func)
from ._varlen import flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "mps_tensor_ops", "scaled_dot_product_attention"]
