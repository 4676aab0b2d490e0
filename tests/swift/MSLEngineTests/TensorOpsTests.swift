import Foundation
import MSLEngine
import XCTest

/// Metal 4 tensor ops (mpp::tensor_ops::matmul2d, cooperative tensors) in the CPU engine:
/// products against float64 and against the documented accumulation order, relaxed-precision
/// truncation, bounds, the scope and capacity faults, and the layout run twice (M5, permuted).
final class TensorOpsTests: XCTestCase {
    static let layoutVariable = "FLASH_ATTENTION_TENSOR_LAYOUT"

    override func tearDown() {
        unsetenv(Self.layoutVariable)
        super.tearDown()
    }

    /// The documented order: start from c, add a[i][k] * b[k][j] for k ascending, one fused
    /// multiply-add each.
    static func ordered(_ a: [Float], _ b: [Float], _ c: [Float], k: Int, n: Int) -> [Float] {
        (0..<(c.count)).map { e in
            let (i, j) = (e / n, e % n)
            return (0..<k).reduce(c[e]) { $0.addingProduct(a[i * k + $1], b[$1 * n + j]) }
        }
    }

    static func reference(_ a: [Float], _ b: [Float], _ c: [Float], k: Int, n: Int) -> (value: [Double], magnitude: [Double]) {
        var value = [Double](repeating: 0, count: c.count)
        var magnitude = [Double](repeating: 0, count: c.count)
        for e in 0..<c.count {
            let (i, j) = (e / n, e % n)
            value[e] = Double(c[e])
            magnitude[e] = abs(Double(c[e]))
            for q in 0..<k {
                let term: Double = Double(a[i * k + q]) * Double(b[q * n + j])
                value[e] += term
                magnitude[e] += abs(term)
            }
        }
        return (value, magnitude)
    }

    static func truncated(_ x: Float) -> Float { Float(bitPattern: x.bitPattern & ~0x1fff) }

    static let halfA = (0..<256).map { Float16(Float(($0 * 7) % 23) * 0.125 - 1.375) }
    static let halfB = (0..<512).map { Float16(Float(($0 * 5) % 19) * 0.0625 - 0.5) }

    /// d = a * bᵀ + c (16x32x16, half operands, transposed right operand through tensor loads):
    /// bit-identical to the k-ascending fused order, and within 16 float ulps of float64.
    func testHalfProductMatchesReference() {
        let a = Self.halfA
        let b = Self.halfB  // b as 16x32 (k x n)
        let bt = (0..<512).map { e in b[(e % 16) * 32 + e / 16] }  // 32x16: bt[n][k] = b[k][n]
        let c = (0..<512).map { Float($0 % 11) * 0.5 - 2 }
        let (ba, bbt, bc) = (HostBuffer(a), HostBuffer(bt), HostBuffer(c))
        let d = HostBuffer<Float>(count: 512, zero: 0)
        let r = dispatch("tensor_matmul_half", [ba.binding, bbt.binding, bc.binding, d.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let (af, bf) = (a.map(Float.init), b.map(Float.init))
        let ordered = Self.ordered(af, bf, c, k: 16, n: 32)
        let (value, magnitude) = Self.reference(af, bf, c, k: 16, n: 32)
        for e in 0..<512 {
            XCTAssertEqual(d[e], ordered[e], "element \(e): documented order")
            XCTAssertLessThanOrEqual(abs(Double(d[e]) - value[e]), 16 * 0x1p-24 * magnitude[e], "element \(e)")
        }
    }

    /// Float operands: without relaxed_precision the exact fused order; with it, operands
    /// truncated toward zero to 10 mantissa bits, an error near 2^-11 relative, measurable.
    func testRelaxedPrecisionTruncatesFloatOperands() {
        let a = (0..<256).map { Float(0.5 + 0.4999 * abs(sin(Double($0) * 1.37))) }
        let b = (0..<512).map { Float(0.5 + 0.4999 * abs(cos(Double($0) * 0.71))) }
        let (ba, bb) = (HostBuffer(a), HostBuffer(b))
        let exact = HostBuffer<Float>(count: 512, zero: 0)
        let relaxed = HostBuffer<Float>(count: 512, zero: 0)
        let r = dispatch("tensor_matmul_float", [ba.binding, bb.binding, exact.binding, relaxed.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let zero = [Float](repeating: 0, count: 512)
        XCTAssertEqual(exact.values, Self.ordered(a, b, zero, k: 16, n: 32))
        XCTAssertEqual(relaxed.values, Self.ordered(a.map(Self.truncated), b.map(Self.truncated), zero, k: 16, n: 32))
        let value = Self.reference(a, b, zero, k: 16, n: 32).value
        let relative = { (d: [Float]) in (0..<512).map { abs(Double(d[$0]) - value[$0]) / value[$0] }.max()! }
        XCTAssertLessThan(relative(exact.values), 0x1p-21)
        XCTAssertGreaterThan(relative(relaxed.values), 0x1p-12, "truncation not measurable")
        XCTAssertLessThan(relative(relaxed.values), 0x1p-9)
    }

    func runLayout(_ kernel: String, layout: String?) -> (DispatchResult, [Float]) {
        if let layout { setenv(Self.layoutVariable, layout, 1) } else { unsetenv(Self.layoutVariable) }
        defer { unsetenv(Self.layoutVariable) }
        let (ba, bb) = (HostBuffer(Self.halfA), HostBuffer(Self.halfB))
        let d = HostBuffer<Float>(count: 512, zero: -1)
        return (dispatch(kernel, [ba.binding, bb.binding, d.binding], threads: (32, 1, 1)), d.values)
    }

    var halfProduct: [Float] {
        Self.ordered(Self.halfA.map(Float.init), Self.halfB.map(Float.init), [Float](repeating: 0, count: 512), k: 16, n: 32)
    }

    /// Code that places elements through get_multidimensional_index passes under both maps.
    func testIndexFunctionsPassUnderBothLayouts() {
        for layout in [nil, "m5", "permuted"] {
            let (r, d) = runLayout("tensor_layout_by_index", layout: layout)
            XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
            XCTAssertEqual(d, halfProduct, "layout \(layout ?? "default")")
        }
    }

    /// The planted assumption of MLX's M5 fragment map passes under M5 and is caught by the
    /// permuted map.
    func testPlantedLayoutAssumptionCaughtByPermutedLayout() {
        let (r5, d5) = runLayout("tensor_layout_assumed", layout: "m5")
        XCTAssertEqual(r5.status, MSL_ENGINE_SUCCESS, r5.message)
        XCTAssertEqual(d5, halfProduct)
        let (rp, dp) = runLayout("tensor_layout_assumed", layout: "permuted")
        XCTAssertEqual(rp.status, MSL_ENGINE_SUCCESS, rp.message)
        let wrong = zip(dp, halfProduct).filter { $0 != $1 }.count
        XCTAssertGreaterThan(wrong, 256, "the permuted layout must expose the assumption")
    }

    /// run() with tensor operands and a tensor destination (multiply_accumulate from its
    /// contents, -1 everywhere): the same fused order.
    func testRunOnTensorOperands() {
        let (ba, bb) = (HostBuffer(Self.halfA), HostBuffer(Self.halfB))
        let d = HostBuffer<Float>(count: 512, zero: -1)
        let r = dispatch("tensor_run_on_tensors", [ba.binding, bb.binding, d.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let c = [Float](repeating: -1, count: 512)
        XCTAssertEqual(d.values, Self.ordered(Self.halfA.map(Float.init), Self.halfB.map(Float.init), c, k: 16, n: 32))
    }

    /// Loads past a tensor's extents read 0; stores outside the extents are dropped.
    func testLoadsPastExtentsReadZeroAndStoresClip() {
        let (ba, bb) = (HostBuffer(Self.halfA), HostBuffer(Self.halfB))
        let d = HostBuffer<Float>(count: 512, zero: -1)
        let r = dispatch("tensor_bounds", [ba.binding, bb.binding, d.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let (a, b) = (Self.halfA.map(Float.init), Self.halfB.map(Float.init))
        for row in 0..<16 {
            for column in 0..<32 {
                let (i, j) = (row - 6, column - 12)
                if i >= 0 && i < 10 && j >= 0 && j < 20 {
                    let expected = (0..<12).reduce(Float(0)) { $0.addingProduct(a[i * 16 + $1], b[$1 * 32 + j]) }
                    XCTAssertEqual(d[row * 32 + column], expected, "(\(row), \(column))")
                } else {
                    XCTAssertEqual(d[row * 32 + column], -1, "untouched (\(row), \(column))")
                }
            }
        }
    }

    func testMissingLaneIsReported() {
        let a = HostBuffer(Self.halfA)
        let d = HostBuffer<Float>(count: 512, zero: 0)
        let r = dispatch("tensor_missing_lane", [a.binding, d.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "tensor_missing_lane",
                      sites: [("tensor_ops.metal", "tensor-missing-lane")])
        XCTAssertTrue(r.message.contains("matmul2d") && r.message.contains("lane 31"), r.message)
    }

    func testDivergentDescriptorIsReported() {
        let d = HostBuffer<Float>(count: 512, zero: 0)
        let r = dispatch("tensor_divergent_descriptor", [d.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "tensor_divergent_descriptor",
                      sites: [("tensor_ops.metal", "tensor-plain"), ("tensor_ops.metal", "tensor-transposed")])
    }

    func testIndexPastCapacityIsReported() {
        let d = HostBuffer<Float>(count: 512, zero: 0)
        let r = dispatch("tensor_capacity_overrun", [d.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SIMDGROUP_DIVERGENCE, r.message)
        XCTAssertTrue(r.message.contains("'tensor_capacity_overrun'"), r.message)
        XCTAssertTrue(r.message.contains("past get_capacity()"), r.message)
        XCTAssertEqual(d.values, [Float](repeating: 0, count: 512), "no store after the fault")
    }
}
