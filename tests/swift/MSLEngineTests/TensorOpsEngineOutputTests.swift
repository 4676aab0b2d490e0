import Foundation
import MSLEngine
import XCTest

/// The engine's outputs of the tensor-op runs that tests/cuda/tensor_ops_check.cu makes on an
/// NVIDIA GPU, held to the committed tests/cuda/tensor_ops_engine.txt, which the CUDA check
/// compares with its own outputs bit for bit (tests/cuda/tensor_ops_compare.py): the two
/// emulations of matmul2d must agree exactly (docs/tensor-ops.md). With
/// FLASH_ATTENTION_WRITE_TENSOR_OPS_ENGINE=1 the test writes the file instead (after a deliberate
/// change of the emulation; the CUDA side must then change the same way).
final class TensorOpsEngineOutputTests: XCTestCase {
    static let writeVariable = "FLASH_ATTENTION_WRITE_TENSOR_OPS_ENGINE"

    static var committedFile: URL {
        URL(fileURLWithPath: "\(#filePath)").deletingLastPathComponent()
            .appendingPathComponent("../../cuda/tensor_ops_engine.txt").standardized
    }

    /// [0.5, 1) with every mantissa bit drawn from a multiplicative hash (tensor_ops_check.cu's
    /// float_a and float_b): exact in any language.
    static func hashed(_ count: Int, _ multiplier: UInt32) -> [Float] {
        (0..<count).map { Float(bitPattern: 0x3f00_0000 | ((UInt32($0) &* multiplier) >> 9)) }
    }

    func run(_ kernel: String, _ inputs: [msl_engine_buffer], outputs: [HostBuffer<Float>], layout: String) {
        setenv(TensorOpsTests.layoutVariable, layout, 1)
        defer { unsetenv(TensorOpsTests.layoutVariable) }
        let r = dispatch(kernel, inputs + outputs.map(\.binding), threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
    }

    /// The runs of tensor_ops_check.cu's run_all, named as it names them: every cross-check kernel
    /// under the M5 layout, the two layout kernels under the permuted one too.
    func outputs() -> [(String, [Float])] {
        let (a, b) = (HostBuffer(TensorOpsTests.halfA), HostBuffer(TensorOpsTests.halfB))
        let bt = HostBuffer((0..<512).map { e in TensorOpsTests.halfB[(e % 16) * 32 + e / 16] })
        let c = HostBuffer((0..<512).map { Float($0 % 11) * 0.5 - 2 })
        var named: [(String, [Float])] = []
        let d = HostBuffer<Float>(count: 512, zero: 0)
        run("tensor_matmul_half", [a.binding, bt.binding, c.binding], outputs: [d], layout: "m5")
        named.append(("tensor_matmul_half.m5", d.values))
        let (fa, fb) = (HostBuffer(Self.hashed(256, 2_654_435_761)), HostBuffer(Self.hashed(512, 2_246_822_519)))
        let (exact, relaxed) = (HostBuffer<Float>(count: 512, zero: 0), HostBuffer<Float>(count: 512, zero: 0))
        run("tensor_matmul_float", [fa.binding, fb.binding], outputs: [exact, relaxed], layout: "m5")
        named.append(("tensor_matmul_float.m5.exact", exact.values))
        named.append(("tensor_matmul_float.m5.relaxed", relaxed.values))
        for (kernel, layout) in [("tensor_layout_by_index", "m5"), ("tensor_layout_assumed", "m5"),
                                 ("tensor_bounds", "m5"), ("tensor_run_on_tensors", "m5"),
                                 ("tensor_layout_by_index", "permuted"), ("tensor_layout_assumed", "permuted")] {
            let out = HostBuffer<Float>(count: 512, zero: -1)
            run(kernel, [a.binding, b.binding], outputs: [out], layout: layout)
            named.append(("\(kernel).\(layout)", out.values))
        }
        return named
    }

    /// tensor_ops_engine.txt's text: a comment, then per output lines of "name first" and 32
    /// float32 bit patterns in hex.
    static func text(_ outputs: [(String, [Float])]) -> String {
        var lines = ["# The CPU engine's outputs of tests/kernels/tensor_ops.metal's cross-check runs "
                     + "(TensorOpsEngineOutputTests; tests/cuda/tensor_ops_check.cu --write makes the CUDA build's)"]
        for (name, values) in outputs {
            for first in stride(from: 0, to: values.count, by: 32) {
                let words = values[first..<min(first + 32, values.count)].map { String(format: "%08x", $0.bitPattern) }
                lines.append(([name, String(first)] + words).joined(separator: " "))
            }
        }
        return lines.joined(separator: "\n") + "\n"
    }

    func testEngineOutputsAreTheCommittedOnes() throws {
        let produced = Self.text(outputs())
        if ProcessInfo.processInfo.environment[Self.writeVariable] == "1" {
            try produced.write(to: Self.committedFile, atomically: true, encoding: .utf8)
            return
        }
        let committed = try String(contentsOf: Self.committedFile, encoding: .utf8)
        let (got, want) = (produced.components(separatedBy: "\n"), committed.components(separatedBy: "\n"))
        XCTAssertEqual(got.count, want.count, "line count")
        for (line, (g, w)) in zip(got, want).enumerated() where g != w {
            XCTFail("tensor_ops_engine.txt line \(line + 1) differs from the engine's output:\n\(w)\n\(g)")
            break
        }
    }
}
