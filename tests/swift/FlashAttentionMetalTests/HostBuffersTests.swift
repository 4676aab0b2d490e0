import XCTest

@testable import FlashAttentionMetal

/// Copying the Metal backend's output buffers back into the caller's memory
/// (HostBuffers.copyOutput): only the elements a layout addresses are written.
final class HostBuffersTests: XCTestCase {
    /// `out` as the first 4 columns of 8-wide rows: the other 4 columns of each row belong to the
    /// caller and must keep their bytes, as the CPU backend, which writes in place, leaves them.
    func testStridedOutputKeepsTheGaps() throws {
        let shape = AttentionShape(batch: 2, numHeads: 2, seqlenQ: 3, seqlenK: 5, headDim: 4)
        let strides = ProblemStrides(out: TensorStrides(batch: 2 * 3 * 8, head: 3 * 8, seq: 8))
        let problem = try Problem.validate(shape, causal: false, softmaxScale: nil, strides: strides)
        let count = BufferRole.out.byteCount(for: problem) / 2
        XCTAssertEqual(count, 48 + 24 + 2 * 8 + 4)  // the extent: the last row ends at column 4

        let sentinel: UInt16 = 0xABCD
        var caller = [UInt16](repeating: sentinel, count: count)
        let source = (0..<count).map { UInt16($0) }
        caller.withUnsafeMutableBytes { callerBytes in
            source.withUnsafeBytes { sourceBytes in
                var buffers = HostBuffers()
                buffers.bindOutput(.out, callerBytes.baseAddress!, for: problem)
                buffers.copyOutput(.out, from: sourceBytes.baseAddress!, of: problem)
            }
        }
        var written = 0
        for e in 0..<count {
            if e % 8 < 4 {
                XCTAssertEqual(caller[e], source[e], "element \(e), addressed by the layout")
                written += 1
            } else {
                XCTAssertEqual(caller[e], sentinel, "element \(e), between rows")
            }
        }
        XCTAssertEqual(written, 2 * 2 * 3 * 4)
    }

    /// lse is float32 and dense: copied whole.
    func testFloat32RolesAreCopiedWhole() throws {
        let problem = try Problem.validate(AttentionShape(batch: 1, numHeads: 2, seqlenQ: 3, seqlenK: 3, headDim: 8),
                                           causal: true, softmaxScale: nil)
        let count = BufferRole.lse.byteCount(for: problem) / 4
        XCTAssertEqual(count, 6)
        var caller = [Float](repeating: .nan, count: count)
        let source = (0..<count).map { Float($0) + 0.5 }
        caller.withUnsafeMutableBytes { callerBytes in
            source.withUnsafeBytes { sourceBytes in
                var buffers = HostBuffers()
                buffers.bindOutput(.lse, callerBytes.baseAddress!, for: problem)
                buffers.copyOutput(.lse, from: sourceBytes.baseAddress!, of: problem)
            }
        }
        XCTAssertEqual(caller, source)
    }
}
