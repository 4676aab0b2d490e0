"""The library's attention as a Hugging Face transformers attention implementation.

    import flash_attention_metal.torch.transformers as fam_transformers
    fam_transformers.register()                      # once, before loading the model
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="metal_attention")

``register`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and transformers' own
SDPA mask builder (``sdpa_mask``) to its ``AttentionMaskInterface`` under the same name, so the
model hands this function the masks it would hand PyTorch's SDPA (padding, sliding windows, or
None where the mask is plainly causal). GQA runs without repeating key and value; Gemma 2's
``softcap`` is applied in the kernels. Written for transformers 5 (tested with 5.24: its attention
and mask interfaces); transformers is not a dependency of this package.
"""

from __future__ import annotations

from ._interface import _sdpa

#: The implementation's name. transformers treats every name containing "flash" as one of its
#: FlashAttention integrations (transformers.utils.generic.is_flash_attention_requested), whose
#: unpadded inputs and masks this function does not take.
NAME = "metal_attention"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      softcap=None, **kwargs):
    """transformers' attention-function interface: query (batch, heads, q_len, head_dim), key and
    value (batch, kv_heads, kv_len, head_dim), ``attention_mask`` the SDPA mask (bool, True = attend,
    or additive) or None; returns (attn_output (batch, q_len, heads, head_dim), None). Causality
    follows transformers' SDPA integration: ``is_causal`` (else ``module.is_causal``, default True)
    when there is no mask and more than one query.

    Raises NotImplementedError for attention weights (``output_attentions``), ``position_bias`` and
    ``s_aux`` (attention sinks), which this integration does not have yet.
    """
    for unsupported in ("position_bias", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"{unsupported}: not supported by the flash_attention_metal attention yet")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions: the attention weights are never formed; use attn_implementation='eager'")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = _sdpa(query, key, value, attention_mask, dropout, causal, scaling, True, 0.0 if softcap is None else softcap)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Registers ``attention_forward`` and transformers' SDPA masks as attention implementation
    ``name``; then pass ``attn_implementation=name`` to ``from_pretrained`` (or set
    ``model.config._attn_implementation``). Raises ImportError when transformers is missing."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
