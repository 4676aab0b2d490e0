import MSLEngine
import XCTest

/// SIMD-group matrices: products against a reference, Apple's lane mapping, load/store addressing.
final class MatrixTests: XCTestCase {
    /// Apple's mapping: lane l holds row ((l / 4) & 4) + (l / 2) % 4 and two columns from
    /// ((l / 4) & 2) * 2 + (l % 2) * 2.
    static func owner(row: Int, column: Int) -> Int {
        (0..<32).first { l in
            ((l / 4) & 4) + (l / 2) % 4 == row && ((l / 4) & 2) * 2 + (l % 2) * 2 == column - column % 2
        }!
    }

    static func product(_ a: [Double], _ b: [Double], _ c: [Double]) -> [Double] {
        (0..<64).map { i in
            let (r, col) = (i / 8, i % 8)
            return c[i] + (0..<8).reduce(0.0) { $0 + a[r * 8 + $1] * b[$1 * 8 + col] }
        }
    }

    func testFloatMultiplyAccumulateAndThreadElementsMapping() {
        let a = (0..<64).map { Float(($0 * 7) % 13) - 6 }
        let b = (0..<64).map { Float(($0 * 5) % 11) * 0.25 - 1 }
        let c = (0..<64).map { Float($0 % 9) * 0.5 }
        let (ba, bb, bc) = (HostBuffer(a), HostBuffer(b), HostBuffer(c))
        let d = HostBuffer<Float>(count: 64, zero: 0)
        let elements = HostBuffer<Float>(count: 64, zero: 0)
        let r = dispatch("matrix_multiply_float", [ba.binding, bb.binding, bc.binding, d.binding, elements.binding],
                         threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let expected = Self.product(a.map(Double.init), b.map(Double.init), c.map(Double.init))
        for i in 0..<64 {
            XCTAssertEqual(Double(d[i]), expected[i], accuracy: 1e-4, "element \(i)")
        }
        for lane in 0..<32 {
            let row = ((lane / 4) & 4) + (lane / 2) % 4
            let column = ((lane / 4) & 2) * 2 + (lane % 2) * 2
            XCTAssertEqual(elements[lane * 2], a[row * 8 + column], "lane \(lane) first element")
            XCTAssertEqual(elements[lane * 2 + 1], a[row * 8 + column + 1], "lane \(lane) second element")
        }
    }

    func testHalfMultiplyAccumulate() {
        let a = (0..<64).map { Float16(Float(($0 * 3) % 7) * 0.5 - 1.5) }
        let b = (0..<64).map { Float16(Float(($0 * 5) % 9) * 0.25 - 1) }
        let c = (0..<64).map { Float16(Float($0 % 5) - 2) }
        let (ba, bb, bc) = (HostBuffer(a), HostBuffer(b), HostBuffer(c))
        let d = HostBuffer<Float16>(count: 64, zero: 0)
        let r = dispatch("matrix_multiply_half", [ba.binding, bb.binding, bc.binding, d.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let expected = Self.product(a.map { Double(Float($0)) }, b.map { Double(Float($0)) }, c.map { Double(Float($0)) })
        for i in 0..<64 {
            XCTAssertEqual(Float(d[i]), Float(Float16(Float(expected[i]))), "element \(i)")
        }
    }

    /// Transposed load at an origin, the diagonal constructor, thread_elements() writes seen by
    /// the store (each lane owns its two elements), store at an origin, make_filled.
    func testLayoutOriginTransposeAndThreadElementsOwnership() {
        let src = (0..<256).map { Float($0) }
        let bsrc = HostBuffer(src)
        let dst = HostBuffer<Float>(count: 256, zero: -1)
        let r = dispatch("matrix_layout", [bsrc.binding, dst.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        for row in 0..<16 {
            for column in 0..<16 {
                let got = dst[row * 16 + column]
                if row >= 8 && column < 8 {
                    let (r, c) = (row - 8, column)
                    // Transposed load at origin (x 8, y 0): element (r, c) = src[(8 + c) * 16 + r].
                    let loaded = src[(8 + c) * 16 + r]
                    let lane = Self.owner(row: r, column: c)
                    XCTAssertEqual(got, loaded * Float(lane + 1), "(\(row), \(column))")
                } else if row < 8 && column >= 8 {
                    XCTAssertEqual(got, 2, "filled (\(row), \(column))")
                } else {
                    XCTAssertEqual(got, -1, "untouched (\(row), \(column))")
                }
            }
        }
    }

    func testMatrixOperationInPartialSimdGroupIsReported() {
        let src = HostBuffer<Float>(count: 64, zero: 1)
        let dst = HostBuffer<Float>(count: 64, zero: 0)
        let r = dispatch("matrix_partial_group", [src.binding, dst.binding], threads: (16, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "matrix_partial_group",
                      sites: [("matrix.metal", "partial-matrix-load")])
    }
}
