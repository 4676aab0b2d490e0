"""Fine-tuning SmolLM2-135M-Instruct through Hugging Face transformers, with flash_attention_metal's
attention (``metal_attention``, flash_attention_metal.torch.transformers) or PyTorch's SDPA on its
math backend (``sdpa_kernel(SDPBackend.MATH)``, what PyTorch runs on MPS), for
examples/finetune_smollm2.py and its test: the model (transformers' LlamaForCausalLM with SmolLM2's
configuration, weights from ``smollm2.SmolLM2``), seeded batches, the training loop, the comparison
criterion of issue 40, and the memory measurement and its table and plot.

Weights: the GGUF file's (``smollm2``), with llama.cpp's permutation of the q and k rows undone
(its converter, convert_hf_to_gguf.py, pairs rotary dimensions (2i, 2i + 1); transformers' Llama
pairs i and i + head_dim / 2). Needs torch, transformers and tqdm (matplotlib for the plot).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

#: The two runs: the library's attention, and PyTorch's SDPA on the math backend.
RUNS = {"library": "flash_attention_metal (fused backward)",
        "math": "PyTorch SDPA, SDPBackend.MATH (the MPS path)"}
FIRST_STEPS, STEP_RELATIVE, FINAL_RELATIVE = 20, 1e-2, 0.02
_MIB = 1 << 20


def llama_config(tiny: bool = False):
    """transformers' LlamaConfig of SmolLM2-135M (``tiny``: 2 layers of width 64, 4 query and 2 KV
    heads of head_dim 16 and a 256-token vocabulary, for tests)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_id=2)


def _rotate_half_rows(w, heads: int):
    """A q or k projection (heads * head_dim, in) from llama.cpp's row order (pairs 2i, 2i + 1) back
    to transformers' (i, i + head_dim / 2): the inverse of convert_hf_to_gguf.py's permute."""
    rows, cols = w.shape
    return np.ascontiguousarray(w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def load_pretrained(model, smol) -> None:
    """Copies the weights of ``smol`` (smollm2_model.SmolLM2, float32) into ``model``."""
    c = smol.config
    w = smol._w
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    for i in range(c.num_layers):
        layer, prefix = w[i], f"model.layers.{i}."
        qkv = layer["qkv"].T
        state.update({
            prefix + "input_layernorm.weight": layer["attn_norm"],
            prefix + "self_attn.q_proj.weight": _rotate_half_rows(qkv[:q_size], c.num_heads),
            prefix + "self_attn.k_proj.weight": _rotate_half_rows(qkv[q_size:q_size + kv_size], c.num_kv_heads),
            prefix + "self_attn.v_proj.weight": qkv[q_size + kv_size:],
            prefix + "self_attn.o_proj.weight": layer["o"].T,
            prefix + "post_attention_layernorm.weight": layer["ffn_norm"],
            prefix + "mlp.gate_proj.weight": layer["gate_up"].T[:c.ffn_size],
            prefix + "mlp.up_proj.weight": layer["gate_up"].T[c.ffn_size:],
            prefix + "mlp.down_proj.weight": layer["down"].T,
        })
    tensors = {name: torch.from_numpy(value.copy()) for name, value in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()


def build(run: str, config, weights=None, seed: int = 0, dtype=torch.float32, device="cpu"):
    """LlamaForCausalLM with ``config`` and the attention of ``run`` ("library" or "math"), weights
    from ``weights`` (a SmolLM2) or a seeded random initialisation."""
    from transformers import LlamaForCausalLM

    from ..torch import transformers as fam_transformers

    fam_transformers.register()
    torch.manual_seed(seed)
    config._attn_implementation = fam_transformers.NAME if run == "library" else "sdpa"
    model = LlamaForCausalLM(config)
    if weights is not None:
        load_pretrained(model, weights)
    return model.to(device=device, dtype=dtype).train()


def attention_backend(run: str):
    """The context every step of ``run`` executes in: PyTorch's math SDPA backend for "math"."""
    if run == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def batches(tokens, steps: int, batch_size: int, seq_len: int, seed: int = 1) -> list:
    """``steps`` int64 batches (batch_size, seq_len + 1) of windows of ``tokens`` (1-D), drawn
    by a generator seeded with ``seed``: the same list for every run."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens cannot fill a window of seq_len + 1 = {seq_len + 1}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (steps, batch_size), generator=generator)
    return [torch.stack([tokens[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def adamw(model, lr: float):
    """AdamW without weight decay; the fused kernel on the CPU (PyTorch 2.4+), where the
    per-parameter loop would cost as much as a short step."""
    fused = next(model.parameters()).device.type == "cpu"
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=fused)


def train(model, run: str, data: list, lr: float = 1e-4, progress: bool = True) -> list:
    """AdamW steps of the next-token loss over ``data``; returns the losses (floats)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    optimizer = adamw(model, lr)
    losses = []
    bar = tqdm(data, desc=run, unit="step", disable=not progress)
    for batch in bar:
        batch = batch.to(device)
        with attention_backend(run):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def agreement(ours: list, theirs: list) -> dict:
    """The criterion: the largest relative difference of the first FIRST_STEPS losses and that of
    the final loss, and whether both are within bounds."""
    first = max(abs(a - b) / abs(b) for a, b in zip(ours[:FIRST_STEPS], theirs[:FIRST_STEPS]))
    final = abs(ours[-1] - theirs[-1]) / abs(theirs[-1])
    return {"first_steps_relative": first, "final_relative": final,
            "passed": first <= STEP_RELATIVE and final <= FINAL_RELATIVE}


def measure_step(run: str, seq_len: int) -> dict:
    """One training step of the SmolLM2-135M architecture (random weights) at seq_len, batch 1,
    after a warm-up step: ``cli._peak_memory.measured_step``'s figures. Run it in a fresh process."""
    from ..cli._peak_memory import measured_step

    model = build(run, llama_config())
    optimizer = adamw(model, 1e-4)
    generator = torch.Generator().manual_seed(1)

    def step(tokens):
        # Gradients kept from the warm-up (zeroed, not freed): the growth is the step's activations
        # and temporaries, not the 540 MB of float32 gradients every run allocates alike.
        with attention_backend(run):
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
        optimizer.step()
        return loss.item()

    step(torch.randint(0, 49152, (1, 16), generator=generator))  # warm-up: kernels, optimizer state
    return measured_step(step, torch.randint(0, 49152, (1, seq_len), generator=generator))


def memory_table(rows: list) -> str:
    """Markdown: seq_len, the peak RSS growth of each run (MiB) and math / library."""
    lines = ["| seq_len | " + " | ".join(f"{label} (MiB)" for label in RUNS.values()) + " | math / library |",
             "|---:|" + "---:|" * (len(RUNS) + 1)]
    for seq_len in sorted({r["seq_len"] for r in rows}):
        grown = {r["run"]: r["rss_growth"] / _MIB for r in rows if r["seq_len"] == seq_len}
        lines.append(f"| {seq_len} | " + " | ".join(f"{grown[run]:.1f}" for run in RUNS)
                     + f" | {grown['math'] / max(grown['library'], 1e-9):.2f} |")
    return "\n".join(lines)


def plot_memory(rows: list, path: Path) -> None:
    """Peak RSS growth per step against seq_len, one line per run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=120)
    for run, label in RUNS.items():
        points = sorted((r["seq_len"], r["rss_growth"] / _MIB) for r in rows if r["run"] == run)
        axes.plot(*zip(*points), marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("sequence length (tokens, batch 1)")
    axes.set_ylabel("peak RSS growth of one step (MiB)")
    axes.set_title("SmolLM2-135M training step, float32, CPU")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
