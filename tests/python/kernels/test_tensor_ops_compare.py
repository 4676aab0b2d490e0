"""tests/cuda/tensor_ops_compare.py, the CUDA check's bit-for-bit comparison of the tensor-op
emulation's outputs with the CPU engine's committed ones (tests/cuda/tensor_ops_engine.txt, held to
the engine by TensorOpsEngineOutputTests): it passes the same bits and names a flipped bit or a
missing output."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "cuda" / "tensor_ops_compare.py"
ENGINE = ROOT / "tests" / "cuda" / "tensor_ops_engine.txt"


def compare(cuda: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(ENGINE), str(cuda)], capture_output=True, text=True)


def test_the_engine_file_holds_nine_outputs_and_equals_itself(tmp_path):
    copy = tmp_path / "cuda.txt"
    copy.write_text(ENGINE.read_text())
    result = compare(copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "cuda-tensor-identity: 9 outputs, 0 mismatches"


def test_one_flipped_bit_and_a_missing_output_fail(tmp_path):
    lines = ENGINE.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("tensor_bounds.m5 64 "))
    words = lines[first].split()
    words[2 + 5] = f"{int(words[2 + 5], 16) ^ 1:08x}"  # element 64 + 5, last mantissa bit
    lines[first] = " ".join(words)
    lines = [line for line in lines if not line.startswith("tensor_matmul_half.m5 ")]
    cuda = tmp_path / "cuda.txt"
    cuda.write_text("\n".join(lines) + "\n")
    result = compare(cuda)
    assert result.returncode == 1
    assert "FAIL tensor_matmul_half.m5: not in the CUDA output" in result.stdout
    assert "FAIL tensor_bounds.m5: 1 of 512 elements differ; element 69:" in result.stdout
    assert result.stdout.splitlines()[-1] == "cuda-tensor-identity: 9 outputs, 2 mismatches"
