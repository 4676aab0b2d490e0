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
        XCTAssertEqual(shape.keyValueElementCount, 2 * 7 * 8)
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
        let kv = [Float16](repeating: 0, count: shape.keyValueElementCount)
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
        XCTAssertThrowsError(try attention.forward(q: [], k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .invalidArgument("num_heads (4) must be a multiple of num_kv_heads (3)"))
        }
        bad = shape
        bad.headDim = 300
        XCTAssertThrowsError(try attention.forward(q: [], k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .unsupported("head_dim (300) must be at most fa_max_head_dim() (256)"))
        }
        bad = shape
        bad.seqlenK = -1
        XCTAssertThrowsError(try attention.forward(q: [], k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("seqlen_k (-1) must be at least 1"))
        }
        bad = shape
        bad.batch = 1 << 33
        XCTAssertThrowsError(try attention.forward(q: [], k: [], v: [], shape: bad)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("batch (8589934592) must be at most 4294967295"))
        }
        XCTAssertThrowsError(try attention.forward(q: [], k: [], v: [], shape: shape, softmaxScale: .nan)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("softmax_scale (nan) must be finite"))
        }
    }

    func testErrorDescription() {
        let error = FlashAttentionError.unsupported("head_dim (300) must be at most fa_max_head_dim() (256)")
        XCTAssertEqual(error.description,
                       "FA_STATUS_UNSUPPORTED: head_dim (300) must be at most fa_max_head_dim() (256)")
        XCTAssertEqual(error.message, "head_dim (300) must be at most fa_max_head_dim() (256)")
    }

    /// A backend failure reaches the caller with its message, and every output of the failed pass
    /// holds NaN (float16 0x7E00, float32 NaN) while the inputs are untouched.
    func testFailedRunPoisonsOutputs() throws {
        let problem = try Problem.validate(shape, causal: false, softmaxScale: nil)
        let context = Context(backend: FailingBackend())
        var inputs = [UInt16](repeating: 0x3C00, count: problem.queryElements)
        var out = [UInt16](repeating: 0, count: problem.queryElements)
        var lse = [Float](repeating: 0, count: problem.lseElements)
        var k = [UInt16](repeating: 0, count: problem.keyValueElements)
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
                        XCTAssertThrowsError(try context.run(DispatchPlan.forward(problem), buffers: buffers)) {
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
}

private final class FailingBackend: ExecutionBackend {
    let name: StaticString = "failing"
    let deviceName = "test"
    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        throw FlashAttentionError.executionFailed("injected failure")
    }
}
