"""``flash_attention_metal.torch`` inside ``torch.compile(fullgraph=True)`` and in training: a
transformer block compiled forward and backward, with the library's two operators in the traced
forward and backward graphs and the results of eager PyTorch attention; and a tiny language model
trained with the library's attention, whose losses follow the ones PyTorch's attention gives.

Cost: about 7 s of ./build.sh test's pytest (measured on 2 shared cores; importing PyTorch is not counted).
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch_env import torch  # noqa: E402  (first: skips without PyTorch)
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402

from flash_attention_metal import torch as fat  # noqa: E402
from flash_attention_metal.models.tiny_torch import Block, train  # noqa: E402


def _graphs_backend(graphs: dict):
    """An AOTAutograd backend that keeps the forward and backward FX graphs and runs them eagerly."""
    def keep(name):
        def compiler(graph, _inputs):
            graphs[name] = graph
            return make_boxed_func(graph.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _targets(graph) -> set:
    return {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def _step(model, x):
    out = model(x)
    grads = torch.autograd.grad(out.square().mean(), [x, *model.parameters()])
    return out, grads


def test_compiled_block_forward_and_backward():
    torch.manual_seed(0)
    ours = Block(fat.scaled_dot_product_attention)
    theirs = Block(F.scaled_dot_product_attention)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 37, 64, requires_grad=True)
    graphs = {}
    compiled = torch.compile(ours, fullgraph=True, backend=_graphs_backend(graphs))
    out, grads = _step(compiled, x)
    assert "flash_attention_metal.forward.default" in _targets(graphs["forward"])
    assert "flash_attention_metal.backward.default" in _targets(graphs["backward"])
    eager_out, eager_grads = _step(ours, x)
    reference_out, reference_grads = _step(theirs, x)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, reference_out, rtol=1e-4, atol=1e-5)
    for mine, eager, reference in zip(grads, eager_grads, reference_grads):
        torch.testing.assert_close(mine, eager, rtol=0, atol=1e-6)
        torch.testing.assert_close(mine, reference, rtol=1e-3, atol=1e-5)


def test_compiled_flash_attn_func_with_dynamic_shapes():
    """One compiled function over two sequence lengths (dynamic shapes), bf16, softcap and window."""
    def attention(q, k, v):
        return fat.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=20.0)

    compiled = torch.compile(attention, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (17, 29):
        q, k, v = (torch.randn(2, seqlen, 4, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = compiled(q, k, v)
        out.float().sum().backward()
        expected = attention(*(t.detach().requires_grad_() for t in (q, k, v)))
        assert torch.equal(out, expected)
        assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_training_loss_follows_pytorch_attention():
    """20 AdamW steps of examples/torch_train_tiny.py's 2-layer model in float32 from one
    initialisation and batch order: the losses with the library's attention stay within 1e-4
    (relative) of those with PyTorch's, and fall."""
    ours = torch.tensor(train(fat.scaled_dot_product_attention))
    theirs = torch.tensor(train(F.scaled_dot_product_attention))
    assert ours[-1] < 0.8 * ours[0], f"the model did not learn: {ours}"
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=0)


def test_the_memory_benchmark_measures_every_row():
    """benchmarks/torch_memory.py's measured step at seqlen 64, each of its rows in this process (its
    own run puts each in a fresh one: 50 s here for four imports of PyTorch): the three attentions
    give one loss, the floor's stand-in another."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import torch_memory

    results = {name: torch_memory.child(name, 64) for name, _ in torch_memory.ROWS}
    assert all(r["rss_growth"] >= 0 and r["seconds"] > 0 for r in results.values())
    losses = [results[name]["loss"] for name in ("math", "library", "default")]
    assert max(losses) - min(losses) <= 1e-4 * losses[0] and results["floor"]["loss"] != losses[0]
