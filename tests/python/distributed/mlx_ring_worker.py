"""One rank of tests/python/distributed/test_mlx_ring.py (run by mlx.launch --backend ring): ring attention over
mx.distributed against the float64 reference on the gathered sequences, under the accuracy rule,
forward and gradients. Prints "rank R of P: ok" or raises."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest

import mlx.core as mx  # noqa: E402

from conftest import make_inputs  # noqa: E402
from flash_attention_metal import accuracy  # noqa: E402
from flash_attention_metal import mlx as fam_mlx  # noqa: E402


def check(group, dtype, causal, seqlen_q, seqlen_k):
    q, k, v, dout = make_inputs(7, 1, 4, 2, seqlen_q, seqlen_k, 32, dtype=dtype)
    scale = 0.9 * 32 ** -0.5
    shard = lambda x: fam_mlx.shard_sequence(mx.array(x), causal=causal, group=group)  # noqa: E731
    gather = lambda x: np.array(fam_mlx.unshard_sequence(x, causal=causal, group=group), dtype=np.float64)  # noqa: E731

    def f(q, k, v):
        return fam_mlx.ring_attention(q, k, v, scale=scale, causal=causal, group=group)

    (out,), grads = mx.vjp(f, [shard(q), shard(k), shard(v)], [shard(dout)])
    ours = [gather(a) for a in (out, *grads)]
    metrics = accuracy.evaluate_forward(q, k, v, ours[0], None, causal=causal, softmax_scale=scale)
    metrics += accuracy.evaluate_backward(dout, q, k, v, *ours[1:], causal=causal, softmax_scale=scale)
    label = f"rank {group.rank()} of {group.size()}: {np.dtype(dtype).name} causal={causal} Lq={seqlen_q} Lk={seqlen_k}"
    assert all(m.passed for m in metrics), label + "\n" + accuracy.describe(metrics)


def main():
    group = mx.distributed.init(strict=True, backend="ring")
    step = 2 * group.size()
    check(group, np.float32, False, 6 * step, 4 * step)
    check(group, np.float16, True, 8 * step, 8 * step)
    check(group, np.float16, True, 4 * step, 6 * step)
    print(f"rank {group.rank()} of {group.size()}: ok", flush=True)


if __name__ == "__main__":
    main()
