import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// Cancelling a context: the calls in flight stop with `cancelled` and NaN outputs; later calls run.
final class CancellationTests: XCTestCase {
    private let shape = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 70, seqlenK: 90, headDim: 32)

    /// Runs a forward pass of `shape` on `context`; returns the outputs and the error, if any.
    private func forward(on context: Context) throws -> (out: [UInt16], lse: [Float], error: Error?) {
        let problem = try Problem.validate(shape, causal: true, softmaxScale: nil)
        var q = [UInt16](repeating: 0x3C00, count: BufferRole.q.elementCount(for: problem))
        var kv = [UInt16](repeating: 0x3800, count: BufferRole.k.elementCount(for: problem))
        var out = [UInt16](repeating: 0, count: BufferRole.q.elementCount(for: problem))
        var lse = [Float](repeating: 0, count: problem.lseElements)
        var failure: Error?
        q.withUnsafeMutableBytes { q in
            kv.withUnsafeMutableBytes { kv in
                out.withUnsafeMutableBytes { o in
                    lse.withUnsafeMutableBytes { l in
                        var buffers = HostBuffers()
                        buffers.bindInput(.q, q.baseAddress!, for: problem)
                        buffers.bindInput(.k, kv.baseAddress!, for: problem)
                        buffers.bindInput(.v, kv.baseAddress!, for: problem)
                        buffers.bindOutput(.out, o.baseAddress!, for: problem)
                        buffers.bindOutput(.lse, l.baseAddress!, for: problem)
                        do { try context.run(.forward, problem, buffers: buffers) } catch { failure = error }
                    }
                }
            }
        }
        return (out, lse, failure)
    }

    /// The cancel arrives while the call is in the backend (deterministically: the backend itself
    /// cancels before handing the plan to the CPU engine, which then runs no threadgroup).
    func testCancelDuringACallStopsItAndPoisonsItsOutputs() throws {
        let backend = CancellingBackend(wrapping: try CPUBackend())
        let context = Context(backend: backend)
        backend.context = context
        let cancelled = try forward(on: context)
        guard case .cancelled(let message)? = cancelled.error as? FlashAttentionError else {
            return XCTFail("expected cancelled, got \(String(describing: cancelled.error))")
        }
        XCTAssertTrue(message.hasPrefix("cancelled by fa_context_cancel: CPU engine: kernel 'flash_attention_forward_f16_d32"
                                        + "' cancelled after 0 of "), message)
        XCTAssertTrue(cancelled.out.allSatisfy { $0 == 0x7E00 })
        XCTAssertTrue(cancelled.lse.allSatisfy(\.isNaN))

        backend.cancelsNextCall = false
        let later = try forward(on: context)
        XCTAssertNil(later.error)
        XCTAssertTrue(later.lse.allSatisfy(\.isFinite))
    }

    func testCAbiCancel() throws {
        XCTAssertEqual(fa_context_cancel(nil), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()), "context must not be null")
        XCTAssertEqual(String(cString: fa_status_name(FA_STATUS_CANCELLED)), "FA_STATUS_CANCELLED")
        XCTAssertEqual(FlashAttentionError.cancelled("x").status, FA_STATUS_CANCELLED)
        var handle: OpaquePointer?
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &handle), FA_STATUS_SUCCESS)
        defer { fa_context_destroy(handle) }
        // Nothing in flight: the cancel reaches no call, and the next call runs.
        XCTAssertEqual(fa_context_cancel(handle), FA_STATUS_SUCCESS)
        var problem = fa_problem()
        problem.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (problem.batch, problem.num_heads, problem.num_kv_heads) = (1, 1, 1)
        (problem.seqlen_q, problem.seqlen_k, problem.head_dim, problem.softmax_scale) = (4, 4, 8, 0.5)
        let inputs = [UInt16](repeating: 0x3C00, count: 32)
        var out = [UInt16](repeating: 0, count: 32)
        var lse = [Float](repeating: 0, count: 4)
        XCTAssertEqual(fa_forward(handle, &problem, inputs, inputs, inputs, &out, &lse), FA_STATUS_SUCCESS)
        XCTAssertEqual(out, inputs)
    }
}

/// Delegates to a real backend after cancelling its context (while `cancelsNextCall`).
private final class CancellingBackend: ExecutionBackend {
    let name: StaticString = "cancelling"
    let deviceName = "test"
    private let wrapped: ExecutionBackend
    weak var context: Context?
    var cancelsNextCall = true

    init(wrapping backend: ExecutionBackend) { wrapped = backend }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        if cancelsNextCall { context?.cancel() }
        return try wrapped.execute(plan, buffers: buffers, cancellation: cancellation)
    }
}
