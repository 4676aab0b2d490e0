"""tools/tensor_mix.py: the shared ir_mix.py (../shared/tools, outside the repository) with Metal 4
tensor ops counted (docs/tensor-ops.md): matmul2d runs, their FLOPs from the descriptor, the
cooperative-tensor calls, and the key loop chosen by matrix FLOPs. Skipped where ir_mix.py is not
beside the repository and IR_MIX does not name it."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "tensor_mix.py"
IR_MIX = pathlib.Path(os.environ.get("IR_MIX", ROOT.parent / "shared" / "tools" / "ir_mix.py"))

pytestmark = pytest.mark.skipif(not IR_MIX.is_file(), reason=f"ir_mix.py not found at {IR_MIX} (set IR_MIX)")

# A key loop of two 16x32x16 tensor ops and one exp2 per 32 keys, after a setup loop without any.
KEY_LOOP = """
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
typedef mpp::tensor_ops::matmul2d_descriptor descriptor;

kernel void two_ops_per_key_tile(device const half *k [[buffer(0)]], device float *out [[buffer(1)]],
                                 constant uint &keys [[buffer(2)]]) {
    constexpr auto desc = descriptor(16, 32, 16, false, true, true, descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
    auto left = op.get_left_input_cooperative_tensor<half, half, float>();
    auto right = op.get_right_input_cooperative_tensor<half, half, float>();
    auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
    for (uint i = 0; i < left.get_capacity(); ++i) left[i] = k[i];
    for (uint j = 0; j < keys; j += 32) {
        right.load(tensor<device const half, dextents<int32_t, 2>, tensor_inline>(k + j * 16, dextents<int32_t, 2>(16, 32)));
        op.run(left, right, dest);
        op.run(left, right, dest);
        dest[0] = exp2(dest[0]);
    }
    out[0] = dest[0];
}
"""


def mix(tmp_path, source: pathlib.Path, *kernels: str) -> list[dict]:
    report = tmp_path / "mix.json"
    command = [sys.executable, str(TOOL), str(source), "--ir-mix", str(IR_MIX), "--json", str(report)]
    for kernel in kernels:
        command += ["--kernel", kernel]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def test_counts_the_tensor_ops_of_the_engine_test_kernels(tmp_path):
    by_index, bounds = mix(tmp_path, ROOT / "tests" / "kernels" / "tensor_ops.metal",
                           "tensor_layout_by_index", "tensor_bounds")
    assert by_index["total"]["tensor_op"] == 1
    assert by_index["total"]["tensor_flop"] == 2 * 16 * 32 * 16
    assert by_index["total"]["tensor_op_16x32x16"] == 1
    # operator[], get_multidimensional_index and is_valid_element over 8 + 16 + 16 slots.
    assert by_index["total"]["tensor_elem"] == 3 * (8 + 16 + 16)
    assert bounds["total"]["tensor_ldst"] == 3
    assert "mma" not in by_index["total"]


def test_key_loop_is_the_loop_with_the_most_matrix_flops(tmp_path):
    source = tmp_path / "key_loop.metal"
    source.write_text(KEY_LOOP)
    report = mix(tmp_path, source, "two_ops_per_key_tile")
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    sys.path.insert(0, str(TOOL.parent))
    try:
        import tensor_mix
    finally:
        sys.path.remove(str(TOOL.parent))
    _, loop = tensor_mix.key_loop(report[0])
    assert loop["per_iteration"]["tensor_op"] == 2
    assert loop["per_iteration"]["tensor_flop"] == 2 * 16384
    assert loop["per_iteration"]["exp2"] == 1
    table = subprocess.run([sys.executable, str(TOOL), "--compare", str(path), "--labels", "sample"],
                           check=True, capture_output=True, text=True).stdout
    row = next(line for line in table.splitlines() if line.startswith("| exp2 calls |"))
    # per iteration, per tensor op, per 1024 FLOPs
    assert row == f"| exp2 calls | 1 | 0.50 | {1024 / 32768:.2f} |"
    assert "16x32x16: 2" in table
