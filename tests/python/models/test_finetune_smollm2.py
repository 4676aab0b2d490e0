"""flash_attention_metal.models.smollm2_finetune (examples/finetune_smollm2.py) on a tiny Llama
configuration (2 layers, 4 query and 2 KV heads of head_dim 16): three AdamW steps through transformers with the library's attention and with
PyTorch's math SDPA, from the same weights on the same batches, meet the example's criterion
(per-step losses within 1e-2 relative, the final loss within 2 %), and the weights moved. Needs
transformers; a few seconds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tqdm")

from flash_attention_metal.models import smollm2_finetune as finetune  # noqa: E402


def test_losses_agree_with_the_math_backend():
    tokens = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(3))
    data = finetune.batches(tokens, 3, 2, 32)
    curves, moved = {}, {}
    for run in finetune.RUNS:
        model = finetune.build(run, finetune.llama_config(tiny=True), seed=0)
        before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        curves[run] = finetune.train(model, run, data, lr=1e-3, progress=False)
        moved[run] = not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)
    assert model.config._attn_implementation == "sdpa"
    result = finetune.agreement(curves["library"], curves["math"])
    assert result["passed"], (result, curves)
    assert all(moved.values()) and curves["library"][-1] < curves["library"][0]


def test_the_criterion_can_fail():
    assert not finetune.agreement([2.0, 1.5], [2.0, 1.0])["passed"]
    assert not finetune.agreement([2.05, 1.0], [2.0, 1.0])["passed"]
    assert finetune.agreement([2.001, 1.0], [2.0, 1.0])["passed"]


def test_llama_cpp_rows_are_put_back():
    """The inverse of llama.cpp's converter permutation: rows (2i, 2i + 1) of each head go back to
    (i, i + head_dim / 2)."""
    import numpy as np

    heads, head_dim = 2, 8
    hf = np.arange(heads * head_dim, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    # convert_hf_to_gguf.py's permute: reshape(heads, 2, head_dim / 2, ...).swapaxes(1, 2).
    gguf = hf.reshape(heads, 2, head_dim // 2, 3).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(finetune._rotate_half_rows(gguf, heads), hf)
    assert not np.array_equal(gguf, hf)
