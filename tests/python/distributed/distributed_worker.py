"""Run under mpiexec by test_distributed.py: ring attention on every rank, one JSON line per result.

    mpiexec -n P python distributed_worker.py DIR accuracy   forward and backward of every case
                                                  (synthetic, then real SmolLM2 inputs) against the
                                                  float64 reference on the gathered sequence
    mpiexec -n P python distributed_worker.py DIR errors     arguments rejected on one rank or across ranks
    mpiexec -n P python distributed_worker.py DIR raises R   rank R raises in its second backward call
    mpiexec -n P python distributed_worker.py DIR stalls R   rank R stops in its second backward call

Each rank writes its results to DIR/rank<R>.jsonl (lines that ranks print at the same time can
interleave in mpiexec's output): rank 0 the accuracy results, every rank the errors it raised.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest

import flash_attention_metal as fam  # noqa: E402
from flash_attention_metal import accuracy  # noqa: E402
from flash_attention_metal import distributed as dist  # noqa: E402

from conftest import make_inputs  # noqa: E402

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, softmax_scale, dtype, head_dim_v):
# causal and not, GQA and MQA, seqlens not divisible by 2P for P = 2 and 4, bottom-right causal with
# seqlen_q < seqlen_k and seqlen_q > seqlen_k (rows that see no key), head_dim 16 to 128, an explicit
# scale, every dtype of the library, head_dim_v != head_dim.
CASES = [
    (1, 2, 2, 64, 64, 32, False, None, "float16", 32),
    (1, 2, 2, 64, 64, 32, True, None, "float16", 32),
    (2, 4, 2, 37, 37, 16, True, None, "float16", 16),
    (1, 3, 1, 23, 23, 64, False, None, "float16", 64),
    (1, 2, 2, 30, 50, 24, True, None, "float16", 24),
    (1, 2, 2, 50, 30, 40, True, None, "float16", 40),
    (1, 2, 1, 45, 45, 128, True, 0.3, "float16", 128),
    (1, 4, 2, 37, 37, 32, True, None, "bfloat16", 32),
    (1, 2, 1, 30, 30, 16, False, None, "bfloat16", 16),
    (1, 2, 2, 37, 37, 32, True, None, "float32", 32),
    (1, 2, 2, 29, 29, 48, True, None, "float16", 32),
]

# Real attention inputs: SmolLM2-135M's prefill of a 40-token prompt (the library's fixture) at
# three layers, causal GQA 9/3 heads, with N(0, 1) dout.
FIXTURE = Path(fam.__file__).resolve().parent / "data" / "smollm2_attention.npz"
REAL_CASES = ("prefill_layer0_len40", "prefill_layer14_len40", "prefill_layer29_len40")

TIMEOUT_S = 60.0
# How long the "stalls" scenario's rank stops: far beyond the others' 3 s timeout.
JOB_STALL_S = 120.0


_output: Path


def emit(**fields) -> None:
    with open(_output / f"rank{MPI.COMM_WORLD.Get_rank()}.jsonl", "a") as file:
        file.write(json.dumps(fields) + "\n")


def synthetic_case(comm, case) -> None:
    *shape, causal, scale, dtype, head_dim_v = case
    q, k, v, dout = make_inputs(sum(shape), *shape, head_dim_v=head_dim_v, dtype=np.dtype(dtype))
    run_case(comm, list(case), (q, k, v, dout), causal, scale)


def real_case(comm, name: str) -> None:
    with np.load(FIXTURE) as data:
        q, k, v = (data[f"{name}_{x}"] for x in "qkv")
    dout = np.random.default_rng(len(name)).standard_normal(q.shape).astype(q.dtype)
    run_case(comm, name, (q, k, v, dout), True, None)


def run_case(comm, label, tensors, causal: bool, scale) -> None:
    """Ring forward and backward of global ``tensors`` (q, k, v, dout); rank 0 judges the gathered
    results against the float64 reference and writes them with ``label``."""
    q, k, v, dout = tensors
    shard = lambda x: dist.shard_sequence(x, comm=comm, causal=causal)  # noqa: E731
    q_local, k_local, v_local, dout_local = map(shard, (q, k, v, dout))
    forward_profile, backward_profile = [], []
    out, lse = dist.ring_attention(q_local, k_local, v_local, comm=comm, causal=causal, softmax_scale=scale,
                                   timeout=TIMEOUT_S, profile=forward_profile)
    grads = dist.ring_attention_backward(dout_local, q_local, k_local, v_local, out, lse, comm=comm,
                                         causal=causal, softmax_scale=scale, timeout=TIMEOUT_S,
                                         profile=backward_profile)
    gathered = [dist.unshard_sequence(x, comm=comm, causal=causal, timeout=TIMEOUT_S) for x in (out, lse, *grads)]
    sent = [[step.bytes_sent for step in forward_profile], [step.bytes_sent for step in backward_profile]]
    all_sent = comm.gather(sent)
    if comm.Get_rank() != 0:
        return
    metrics = accuracy.evaluate_forward(q, k, v, *gathered[:2], causal=causal, softmax_scale=scale)
    metrics += accuracy.evaluate_backward(dout, q, k, v, *gathered[2:], causal=causal, softmax_scale=scale)
    emit(kind="accuracy", case=label, world_size=comm.Get_size(), passed=all(m.passed for m in metrics),
         detail=accuracy.describe(metrics),
         dtypes=[str(x.dtype) for x in gathered], shapes=[list(x.shape) for x in gathered],
         bytes_sent=all_sent, expected_bytes=expected_bytes(comm.Get_size(), k, v.shape[3], causal))


def expected_bytes(size: int, k, head_dim_v: int, causal: bool):
    """Per rank: bytes sent per forward step and per backward step (K and V in k's dtype, float32 dK
    and dV, of the K/V shard held at that step)."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    layout = dist.SequenceLayout(seqlen_k, size, causal)
    shard = lambda owner: batch * kv_heads * layout.shard_length(owner) * (head_dim + head_dim_v)  # noqa: E731
    result = []
    for rank in range(size):
        owners = [(rank - step) % size for step in range(size)]
        forward = [k.itemsize * shard(o) if step < size - 1 else 0 for step, o in enumerate(owners)]
        backward = [(k.itemsize * shard(o) if step < size - 1 else 0) + (4 * shard(o) if size > 1 else 0)
                    for step, o in enumerate(owners)]
        result.append([forward, backward])
    return result


def report_error(label: str, action) -> None:
    try:
        action()
    except Exception as error:  # the test checks which error each rank raised
        emit(kind="error", label=label, rank=MPI.COMM_WORLD.Get_rank(), error=type(error).__name__, message=str(error))
    else:
        emit(kind="error", label=label, rank=MPI.COMM_WORLD.Get_rank(), error=None, message="")


def errors(comm) -> None:
    rank = comm.Get_rank()
    q, k, v, _ = make_inputs(5, 1, 2, 2, 24, 24, 16)
    q_local, k_local, v_local = (dist.shard_sequence(x, comm=comm, causal=True) for x in (q, k, v))
    wrong_dtype = q_local.astype(np.float64) if rank == 1 else q_local
    report_error("dtype on rank 1", lambda: dist.ring_attention(wrong_dtype, k_local, v_local, comm=comm,
                                                                 causal=True, timeout=TIMEOUT_S))
    other = np.dtype("bfloat16") if rank == 1 else np.float16
    report_error("dtype per rank", lambda: dist.ring_attention(*(x.astype(other) for x in (q_local, k_local, v_local)),
                                                               comm=comm, causal=True, timeout=TIMEOUT_S))
    report_error("scale per rank", lambda: dist.ring_attention(q_local, k_local, v_local, comm=comm, causal=True,
                                                               softmax_scale=0.1 * (rank + 1), timeout=TIMEOUT_S))
    heads = q_local[:, :1].repeat(3, axis=1) if rank == 1 else q_local  # 3 query heads over 2 KV heads
    report_error("heads on rank 1", lambda: dist.ring_attention(heads, k_local, v_local, comm=comm, causal=True,
                                                                timeout=TIMEOUT_S))
    short = q_local[:, :, 3:] if rank == 0 else q_local
    report_error("layout", lambda: dist.ring_attention(short, k_local, v_local, comm=comm, causal=True,
                                                       timeout=TIMEOUT_S))
    wide = np.zeros(q_local.shape[:3] + (q_local.shape[3] + rank,), dtype=np.float16)
    report_error("unshard shapes", lambda: dist.unshard_sequence(wide, comm=comm, causal=True, timeout=TIMEOUT_S))
    report_error("shard too short", lambda: dist.shard_sequence(q[:, :, :comm.Get_size() - 1], comm=comm))


def failing_rank(comm, failing: int, failure) -> None:
    """Forward, then backward in which rank ``failing`` runs ``failure`` in its second attention
    call: the other ranks wait for dK/dV that it never sends."""
    context = fam.default_context()
    q, k, v, dout = make_inputs(9, 1, 2, 2, 64, 64, 16)
    q_local, k_local, v_local, dout_local = (dist.shard_sequence(x, comm=comm, causal=True) for x in (q, k, v, dout))
    out, lse = dist.ring_attention(q_local, k_local, v_local, comm=comm, causal=True, context=context, timeout=3.0)
    if comm.Get_rank() == failing:
        calls, real_backward = [], context.backward

        def backward(*args, **kwargs):
            calls.append(None)
            if len(calls) == 2:
                failure()
            return real_backward(*args, **kwargs)

        context.backward = backward
    try:
        dist.ring_attention_backward(dout_local, q_local, k_local, v_local, out, lse, comm=comm, causal=True,
                                     context=context, timeout=3.0)
    except dist.RingTimeoutError as error:
        emit(kind="timeout", rank=comm.Get_rank(), message=str(error))
        comm.Abort(3)
    else:
        emit(kind="finished", rank=comm.Get_rank())


def raise_failure():
    raise RuntimeError("injected failure")


def stall_failure():
    time.sleep(JOB_STALL_S)


def main() -> None:
    global _output
    comm = MPI.COMM_WORLD
    _output, scenario = Path(sys.argv[1]), sys.argv[2]
    if scenario == "accuracy":
        for case in CASES:
            synthetic_case(comm, case)
        for name in REAL_CASES:
            real_case(comm, name)
    elif scenario == "errors":
        errors(comm)
    elif scenario in ("raises", "stalls"):
        failing_rank(comm, int(sys.argv[3]), raise_failure if scenario == "raises" else stall_failure)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
