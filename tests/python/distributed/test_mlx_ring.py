"""``flash_attention_metal.mlx.ring_attention`` over mx.distributed: 2 and 4 processes on localhost
through MLX's ring backend (``mlx.launch --backend ring``; MLX's MPI backend loads Open MPI's
symbols, not the MPICH wheel of the distributed extra). Each rank checks out, dq, dk, dv of the
gathered sequences against the float64 reference under the accuracy rule (tests/python/
mlx_ring_worker.py: contiguous and zigzag layouts, seqlen_q != seqlen_k, float32 and float16).
About 10 s (2 ranks) and 25 s (4 ranks) on 2 cores."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install -e 'python[mlx]'; needs Python 3.10+)")

from flash_attention_metal import mlx as fam_mlx  # noqa: E402

# Serial (conftest.py): the ring backend listens on runs of ports found free just before.
pytestmark = pytest.mark.serial

if not fam_mlx.NATIVE:
    pytest.skip(fam_mlx.PATH_NOTE, allow_module_level=True)

_WORKER = Path(__file__).resolve().parent / "mlx_ring_worker.py"


def _free_port_run(count: int) -> int:
    """A port p with p ... p + count - 1 free now (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            start = probe.getsockname()[1]
        if start + count > 65535:
            continue
        sockets = []
        try:
            for offset in range(count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", start + offset))
            return start
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_attention_over_the_ring_backend_matches_the_reference(ranks):
    launch = ("import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; "
              "sys.exit(main())")
    command = [sys.executable, "-c", launch, "--backend", "ring", "-n", str(ranks),
               "--starting-port", str(_free_port_run(ranks)), "--", sys.executable, str(_WORKER)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.endswith(": ok")) == \
        [f"rank {r} of {ranks}: ok" for r in range(ranks)], result.stdout


def test_shards_must_have_equal_lengths():
    group = mx.distributed.init()  # a single process: a group of one
    with pytest.raises(ValueError, match=r"^x: seqlen 5 must be a multiple of 2"):
        fam_mlx.shard_sequence(mx.zeros((1, 2, 5, 4)), causal=True, group=group)
    q = mx.zeros((1, 2, 4, 8))
    with pytest.raises(TypeError, match="^causal must be a bool"):
        fam_mlx.ring_attention(q, q, q, scale=0.5, causal="yes", group=group)
