import MSLEngine
import XCTest

/// The engine's MSL `bfloat`: round-to-nearest-even from float (ties, NaN, infinity, subnormals,
/// overflow), exact widening of all 65536 encodings, arithmetic, math, vectors and matrices.
final class BFloatTests: XCTestCase {
    /// (float bits, expected bfloat bits), each named by the case it pins.
    static let roundingCases: [(String, UInt32, UInt16)] = [
        ("one", 0x3f80_0000, 0x3f80),
        ("-0", 0x8000_0000, 0x8000),
        ("tie, even below", 0x3f80_8000, 0x3f80),
        ("tie, odd below rounds up", 0x3f81_8000, 0x3f82),
        ("negative tie", 0xbf81_8000, 0xbf82),
        ("just above the tie", 0x3f80_8001, 0x3f81),
        ("just below the tie", 0x3f80_7fff, 0x3f80),
        ("carry into the exponent", 0x3fff_8000, 0x4000),
        ("+inf", 0x7f80_0000, 0x7f80),
        ("-inf", 0xff80_0000, 0xff80),
        ("largest bfloat", 0x7f7f_0000, 0x7f7f),
        ("below the overflow tie", 0x7f7f_7fff, 0x7f7f),
        ("overflow tie rounds to inf", 0x7f7f_8000, 0x7f80),
        ("FLT_MAX overflows", 0x7f7f_ffff, 0x7f80),
        ("-FLT_MAX overflows", 0xff7f_ffff, 0xff80),
        ("smallest normal", 0x0080_0000, 0x0080),
        ("smallest bfloat subnormal", 0x0001_0000, 0x0001),
        ("smallest float subnormal", 0x0000_0001, 0x0000),
        ("subnormal tie, even", 0x0000_8000, 0x0000),
        ("subnormal above the tie", 0x0000_8001, 0x0001),
        ("subnormal tie, odd", 0x0001_8000, 0x0002),
        ("largest subnormal becomes normal", 0x807f_ffff, 0x8080),
        ("quiet NaN", 0x7fc0_0000, 0x7fc0),
        ("signalling NaN, low payload", 0x7f80_0001, 0x7fc0),
        ("negative NaN keeps payload", 0xffa0_0000, 0xffe0),
        ("NaN just below the quiet bit", 0x7fbf_ffff, 0x7fff),
    ]

    func testRoundingFromFloatIsNearestEven() {
        let n = Self.roundingCases.count
        let input = HostBuffer(Self.roundingCases.map { Float(bitPattern: $0.1) })
        let rounded = HostBuffer<UInt16>(count: n, zero: 0)
        let widened = HostBuffer<Float>(count: n, zero: 0)
        let r = dispatch("bfloat_round", [input.binding, rounded.binding, widened.binding],
                         threads: (UInt32(n), 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        for (i, (name, _, expected)) in Self.roundingCases.enumerated() {
            XCTAssertEqual(rounded[i], expected, name)
            XCTAssertEqual(widened[i].bitPattern, UInt32(expected) << 16, name)
        }
    }

    func testWideningIsExactForEveryEncoding() {
        let out = HostBuffer<Float>(count: 65536, zero: 0)
        let r = dispatch("bfloat_widen_all", [out.binding], threads: (256, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        var mismatches = 0
        for bits in 0..<65536 where out[bits].bitPattern != UInt32(bits) << 16 {
            mismatches += 1
            if mismatches <= 5 {
                XCTFail("encoding \(String(bits, radix: 16)) widened to \(out[bits].bitPattern)")
            }
        }
        XCTAssertEqual(mismatches, 0)
    }

    func testArithmeticMathAndVectors() {
        let out = HostBuffer<Float>(count: 21, zero: .nan)
        let r = dispatch("bfloat_arithmetic", [out.binding], threads: (1, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let expected: [(String, Float)] = [
            ("1 + 2^-8 ties to even", 1),
            ("1 + 3 * 2^-8 ties up", 1.015625),
            ("bfloat * float is float", 3 * Float(0.1)),
            ("3 / 10 rounded to bfloat", 0.30078125),
            ("exp(1)", 2.71875),
            ("sqrt(2)", 1.4140625),
            ("max", 0.5),
            ("abs", 3),
            ("isnan, isinf, isfinite", 1),
            ("bfloat to half", 1),
            ("compound assignment rounds", 1),
            ("-0", -0.0),
            ("bfloat * int is bfloat", 6),
            ("fma rounds once", 2.28125),
            ("vector x", 2.5),
            ("vector y", 3),
            ("vector z", 3.5),
            ("vector w", 4),
            ("largest bfloat", Float(bitPattern: 0x7f7f_0000)),
            ("smallest negative subnormal", -Float(bitPattern: 0x0001_0000)),
            ("sizes 2, 4, 8 bytes", 842),
        ]
        for (i, (name, value)) in expected.enumerated() {
            XCTAssertEqual(out[i].bitPattern, value.bitPattern, "\(name): \(out[i]) != \(value)")
        }
    }

    func testBFloatMatrixMultiplyAccumulatesInFloat() {
        // Values exact in bfloat; the float accumulator keeps bits a bfloat result would drop.
        let a = (0..<64).map { Float(($0 * 3) % 7) * 0.5 - 1.5 }
        let b = (0..<64).map { Float(($0 * 5) % 9) * 0.25 - 1 }
        let c = (0..<64).map { Float($0 % 5) * 0x1p-9 + 64 }
        let toBits = { (x: Float) -> UInt16 in UInt16(x.bitPattern >> 16) }
        let (ba, bb, bc) = (HostBuffer(a.map(toBits)), HostBuffer(b.map(toBits)), HostBuffer(c))
        let d = HostBuffer<Float>(count: 64, zero: 0)
        let r = dispatch("matrix_multiply_bfloat", [ba.binding, bb.binding, bc.binding, d.binding],
                         threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        let expected = MatrixTests.product(a.map(Double.init), b.map(Double.init), c.map(Double.init))
        for i in 0..<64 {
            XCTAssertEqual(Double(d[i]), expected[i], "element \(i)")
        }
    }
}
