import XCTest

@testable import FlashAttentionMetal

/// The Swift API: backends, buffer-length checks, typed errors, and outputs of a failed call.
final class SwiftAPITests: XCTestCase {
    private let shape = AttentionShape(batch: 1, numHeads: 4, numKVHeads: 2, seqlenQ: 5, seqlenK: 7, headDim: 8)

    func testShapeDefaultsAndCounts() {
        let s = AttentionShape(batch: 2, numHeads: 3, seqlenQ: 5, headDim: 8)
        XCTAssertEqual(s.numKVHeads, 3)
        XCTAssertEqual(s.seqlenK, 5)
        XCTAssertEqual(shape.queryElementCount, 4 * 5 * 8)
        XCTAssertEqual(shape.keyElementCount, 2 * 7 * 8)
        XCTAssertEqual(shape.valueElementCount, 2 * 7 * 8)
        let mla = AttentionShape(batch: 1, numHeads: 2, seqlenQ: 3, headDim: 192, headDimV: 128)
        XCTAssertEqual(mla.outputElementCount, 2 * 3 * 128)
        XCTAssertEqual(mla.valueElementCount, 2 * 3 * 128)
        XCTAssertEqual(mla.keyElementCount, 2 * 3 * 192)
        XCTAssertEqual(shape.lseElementCount, 4 * 5)
    }

    func testCPUBackend() throws {
        let attention = try FlashAttention(backend: .cpu)
        XCTAssertEqual(attention.backendName, "cpu")
        XCTAssertTrue(attention.deviceName.hasPrefix("CPU engine"))
    }

    func testMetalUnavailableOffApple() throws {
        #if canImport(Metal)
        throw XCTSkip("Metal exists here")
        #else
        XCTAssertThrowsError(try FlashAttention(backend: .metal)) { error in
            XCTAssertEqual(error as? FlashAttentionError,
                           .backendUnavailable("Metal is not available on this platform"))
        }
        XCTAssertEqual(try FlashAttention().backendName, "cpu")
        #endif
    }

    func testWrongBufferLengths() throws {
        let attention = try FlashAttention(backend: .cpu)
        let q = [Float16](repeating: 0, count: shape.queryElementCount)
        let kv = [Float16](repeating: 0, count: shape.keyElementCount)
        XCTAssertThrowsError(try attention.forward(q: Array(q.dropLast()), k: kv, v: kv, shape: shape)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("q has 159 elements; the shape needs 160"))
        }
        XCTAssertThrowsError(try attention.forward(q: q, k: kv, v: kv + [0], shape: shape)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("v has 113 elements; the shape needs 112"))
        }
        let lse = [Float](repeating: 0, count: 3)
        XCTAssertThrowsError(try attention.backward(dout: q, q: q, k: kv, v: kv, out: q, lse: lse, shape: shape)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("lse has 3 elements; the shape needs 20"))
        }
    }

    /// The Swift API applies the same validation as the C ABI, with the same messages.
    func testShapeValidation() throws {
        let attention = try FlashAttention(backend: .cpu)
        var bad = shape
        bad.numKVHeads = 3
        XCTAssertThrowsError(try attention.forward(q: [Float16](), k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .invalidArgument("num_heads (4) must be a multiple of num_kv_heads (3)"))
        }
        bad = shape
        bad.headDim = 600
        XCTAssertThrowsError(try attention.forward(q: [Float16](), k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .unsupported("head_dim (600) must be at most fa_max_head_dim() (576)"))
        }
        bad.headDim = 512
        XCTAssertThrowsError(try attention.forward(q: [Float](), k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .unsupported("head_dim (512) and head_dim_v (\(bad.headDimV)) with dtype float32 must be at "
                                            + "most 256: float32 tiles of larger heads do not fit 32 KiB of threadgroup "
                                            + "memory; use float16 or bfloat16 (up to fa_max_head_dim(), 576)"))
        }
        bad = shape
        bad.seqlenK = -1
        XCTAssertThrowsError(try attention.forward(q: [Float16](), k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("seqlen_k (-1) must be at least 1"))
        }
        bad = shape
        bad.batch = 1 << 33
        XCTAssertThrowsError(try attention.forward(q: [Float16](), k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("batch (8589934592) must be at most 4294967295"))
        }
        XCTAssertThrowsError(try attention.forward(q: [Float16](), k: [], v: [], shape: shape, softmaxScale: .nan)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("softmax_scale (nan) must be finite"))
        }
    }

    func testErrorDescription() {
        let error = FlashAttentionError.unsupported("head_dim (600) must be at most fa_max_head_dim() (576)")
        XCTAssertEqual(error.description,
                       "FA_STATUS_UNSUPPORTED: head_dim (600) must be at most fa_max_head_dim() (576)")
        XCTAssertEqual(error.message, "head_dim (600) must be at most fa_max_head_dim() (576)")
    }

    /// A backend failure reaches the caller with its message, and every output of the failed pass
    /// holds NaN (float16 0x7E00, float32 NaN) while the inputs are untouched.
    func testFailedRunPoisonsOutputs() throws {
        let problem = try Problem.validate(shape, causal: false, softmaxScale: nil)
        let context = Context(backend: FailingBackend())
        var inputs = [UInt16](repeating: 0x3C00, count: BufferRole.q.elementCount(for: problem))
        var out = [UInt16](repeating: 0, count: BufferRole.out.elementCount(for: problem))
        var lse = [Float](repeating: 0, count: problem.lseElements)
        var k = [UInt16](repeating: 0, count: BufferRole.k.elementCount(for: problem))
        try inputs.withUnsafeMutableBytes { q in
            try out.withUnsafeMutableBytes { o in
                try lse.withUnsafeMutableBytes { l in
                    try k.withUnsafeMutableBytes { k in
                        var buffers = HostBuffers()
                        buffers.bindInput(.q, q.baseAddress!, for: problem)
                        buffers.bindInput(.k, k.baseAddress!, for: problem)
                        buffers.bindInput(.v, k.baseAddress!, for: problem)
                        buffers.bindOutput(.out, o.baseAddress!, for: problem)
                        buffers.bindOutput(.lse, l.baseAddress!, for: problem)
                        XCTAssertThrowsError(try context.run(.forward, problem, buffers: buffers)) {
                            XCTAssertEqual($0 as? FlashAttentionError, .executionFailed("injected failure"))
                        }
                    }
                }
            }
        }
        XCTAssertTrue(out.allSatisfy { $0 == 0x7E00 })
        XCTAssertTrue(lse.allSatisfy(\.isNaN))
        XCTAssertTrue(inputs.allSatisfy { $0 == 0x3C00 })
    }

    /// The options reach the kernels: a (0, 0) window leaves each query its diagonal key alone, so
    /// out is that key's value row; sinks return one gradient per head.
    func testOptionsReachTheKernels() throws {
        let attention = try FlashAttention(backend: .cpu)
        let s = AttentionShape(batch: 1, numHeads: 2, seqlenQ: 6, headDim: 8)
        let q = (0..<s.queryElementCount).map { Float(($0 * 7) % 11) / 11 - 0.5 }
        let v = (0..<s.valueElementCount).map { Float(($0 * 5) % 13) / 13 - 0.5 }
        let (out, _) = try attention.forward(q: q, k: q, v: v, shape: s,
                                             options: AttentionOptions(windowLeft: 0, windowRight: 0))
        XCTAssertEqual(out, v)
        let sinks = AttentionOptions(sinks: [0.5, -1])
        let f = try attention.forward(q: q, k: q, v: v, shape: s, causal: true, options: sinks)
        let g = try attention.backward(dout: v, q: q, k: q, v: v, out: f.out, lse: f.lse, shape: s, causal: true,
                                       options: sinks)
        XCTAssertEqual(g.dsinks.count, 2)
        XCTAssertTrue(g.dsinks.allSatisfy { $0.isFinite && $0 != 0 })
        XCTAssertThrowsError(try attention.forward(q: q, k: q, v: v, shape: s,
                                                   options: AttentionOptions(alibiSlopes: [1, 2, 3]))) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .invalidArgument("alibi_slopes has 3 elements; the shape needs 2"))
        }
    }

    /// Dropout through the Swift API: q = k = 0 makes P uniform (1/8) and v the identity over keys,
    /// so out[i][j] = P_ij Z_ij; the kept pattern is the NumPy twin's
    /// (philox.dropout_keep(0.5, 1, 2, 1, 1, 4, 8)), and the backward takes the same dropout.
    func testDropoutAppliesThePhiloxMask() throws {
        let attention = try FlashAttention(backend: .cpu)
        let s = AttentionShape(batch: 1, numHeads: 1, seqlenQ: 4, seqlenK: 8, headDim: 8)
        let q = [Float](repeating: 0, count: s.queryElementCount)
        let k = [Float](repeating: 0, count: s.keyElementCount)
        let v = (0..<64).map { $0 / 8 == $0 % 8 ? Float(1) : 0 }
        let options = AttentionOptions(dropout: AttentionDropout(p: 0.5, seed: 1, offset: 2))
        let (out, lse) = try attention.forward(q: q, k: k, v: v, shape: s, options: options)
        let kept = ["01111000", "01000111", "10101011", "10010000"].joined().map { $0 == "1" ? Float(0.25) : 0 }
        XCTAssertEqual(out, kept)
        XCTAssertEqual(lse, try attention.forward(q: q, k: k, v: v, shape: s).lse, "lse is of the undropped scores")
        let g = try attention.backward(dout: v.prefix(32).map { $0 }, q: q, k: k, v: v, out: out, lse: lse, shape: s,
                                       options: options)
        // dv[j][i] = P_ij Z_ij dout[i][i]: the transposed pattern.
        for i in 0..<4 { for j in 0..<8 { XCTAssertEqual(g.dv[j * 8 + i], kept[i * 8 + j], "dv[\(j)][\(i)]") } }
        XCTAssertThrowsError(try attention.forward(q: q, k: k, v: v, shape: s,
                                                   options: AttentionOptions(dropout: AttentionDropout(p: 1, seed: 0)))) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("dropout_p (1.0) must be at least 0 and below 1"))
        }
    }
}

private final class FailingBackend: ExecutionBackend {
    let name: StaticString = "failing"
    let deviceName = "test"
    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        throw FlashAttentionError.executionFailed("injected failure")
    }

}
