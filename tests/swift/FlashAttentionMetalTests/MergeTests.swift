import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// fa_merge_attention and FlashAttention.mergeAttention: the plan, validation through the C ABI and
/// the Swift API, and the merge math on the CPU engine (the accuracy tests over real attention are
/// in tests/python/core/test_merge.py).
final class MergeTests: XCTestCase {
    func testPlan() throws {
        let p = try Problem.merge(rows: 9, headDim: 40)
        let plan = DispatchPlan.merge(p)
        XCTAssertEqual(plan.dispatches.count, 1)
        let d = plan.dispatches[0]
        XCTAssertEqual(d.kernelName, "flash_attention_merge_f16")
        XCTAssertEqual(d.bindings, [BufferBinding(index: 0, role: .outA), BufferBinding(index: 1, role: .lseA),
                                    BufferBinding(index: 2, role: .outB), BufferBinding(index: 3, role: .lseB),
                                    BufferBinding(index: 4, role: .out), BufferBinding(index: 5, role: .lse)])
        XCTAssertEqual(d.paramsIndex, Int(FA_MERGE_BUFFER_PARAMS))
        XCTAssertEqual(d.bufferCount, Int(FA_MERGE_BUFFER_COUNT))
        XCTAssertEqual(plan.outputs, [.out, .lse])
        XCTAssertEqual(d.threadgroupsPerGrid, GridSize(width: 3, height: 1, depth: 1))
        XCTAssertEqual(d.threadsPerThreadgroup, GridSize(width: 128, height: 1, depth: 1))
        XCTAssertEqual([d.params.batch, d.params.num_heads, d.params.seqlen_q, d.params.head_dim], [1, 1, 9, 40])
        XCTAssertEqual(BufferRole.outB.byteCount(for: p), 9 * 40 * 2)
        XCTAssertEqual(BufferRole.lseA.byteCount(for: p), 9 * 4)
        for (dtype, suffix) in [(AttentionDType.bfloat16, "bf16"), (.float32, "f32")] {
            let typed = try Problem.merge(rows: 9, headDim: 40, dtype: dtype)
            XCTAssertEqual(DispatchPlan.merge(typed).dispatches[0].kernelName, "flash_attention_merge_\(suffix)")
            XCTAssertEqual(BufferRole.outB.byteCount(for: typed), 9 * 40 * dtype.size)
        }
        let largest = DispatchPlan.merge(try Problem.merge(rows: UInt64(UInt32.max), headDim: 1)).dispatches[0]
        XCTAssertEqual(largest.threadgroupsPerGrid.width, UInt32((UInt64(UInt32.max) + 3) / 4))
    }

    /// Calls fa_merge_attention with buffers of `rows * headDim` halves and `rows` floats.
    private func merge(rows: UInt64, headDim: UInt32, nulls: Set<String> = [], outAliases: String? = nil)
        -> (fa_status, String) {
        var context: OpaquePointer?
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &context), FA_STATUS_SUCCESS)
        defer { fa_context_destroy(context) }
        let n = 64
        let a = UnsafeMutableBufferPointer<UInt16>.allocate(capacity: n)
        let b = UnsafeMutableBufferPointer<UInt16>.allocate(capacity: n)
        let o = UnsafeMutableBufferPointer<UInt16>.allocate(capacity: n)
        let la = UnsafeMutableBufferPointer<Float>.allocate(capacity: n)
        let lb = UnsafeMutableBufferPointer<Float>.allocate(capacity: n)
        let l = UnsafeMutableBufferPointer<Float>.allocate(capacity: n)
        defer { for p in [a, b, o] { p.deallocate() }; for p in [la, lb, l] { p.deallocate() } }
        for p in [a, b] { p.initialize(repeating: 0x3C00) }
        for p in [la, lb] { p.initialize(repeating: 0) }
        func ptr<T>(_ name: String, _ p: UnsafeMutableBufferPointer<T>) -> UnsafeMutablePointer<T>? {
            nulls.contains(name) ? nil : p.baseAddress
        }
        let out = outAliases == "out_a" ? ptr("out", a) : ptr("out", o)
        let lse = outAliases == "lse_b" ? ptr("lse", lb) : ptr("lse", l)
        let status = fa_merge_attention(context, rows, headDim, ptr("out_a", a), ptr("lse_a", la), ptr("out_b", b),
                                        ptr("lse_b", lb), out, lse)
        return (status, String(cString: fa_last_error_message()))
    }

    func testCValidation() {
        XCTAssertEqual(merge(rows: 4, headDim: 16).0, FA_STATUS_SUCCESS)
        for name in ["out_a", "lse_a", "out_b", "lse_b", "out", "lse"] {
            let (status, message) = merge(rows: 4, headDim: 16, nulls: [name])
            XCTAssertEqual(status, FA_STATUS_INVALID_ARGUMENT, name)
            XCTAssertEqual(message, "\(name) must not be null")
        }
        XCTAssertEqual(merge(rows: 0, headDim: 16).1, "rows (0) must be at least 1")
        XCTAssertEqual(merge(rows: 1 << 32, headDim: 16).1, "rows (4294967296) must be at most 4294967295")
        XCTAssertEqual(merge(rows: 4, headDim: 0).1, "head_dim (0) must be at least 1")
        let (status, message) = merge(rows: 4, headDim: 577)
        XCTAssertEqual(status, FA_STATUS_UNSUPPORTED)
        XCTAssertEqual(message, "head_dim (577) must be at most fa_max_head_dim() (576)")
        XCTAssertEqual(merge(rows: 4, headDim: 16, outAliases: "out_a").1,
                       "out must not overlap out_a (outputs are written while inputs are read)")
        XCTAssertEqual(merge(rows: 4, headDim: 16, outAliases: "lse_b").1,
                       "lse must not overlap lse_b (outputs are written while inputs are read)")
        XCTAssertEqual(fa_merge_attention(nil, 1, 1, nil, nil, nil, nil, nil, nil), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()), "context must not be null")
    }

    func testSwiftValidation() throws {
        let attention = try FlashAttention(backend: .cpu)
        let out = [Float16](repeating: 1, count: 12)
        let lse = [Float](repeating: 0, count: 3)
        XCTAssertThrowsError(try attention.mergeAttention(outA: out, lseA: lse, outB: out, lseB: lse, headDim: 5)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("out_a has 12 elements; the shape needs 15"))
        }
        XCTAssertThrowsError(try attention.mergeAttention(outA: out, lseA: lse, outB: out, lseB: lse + [0],
                                                          headDim: 4)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("lse_b has 4 elements; the shape needs 3"))
        }
        XCTAssertThrowsError(try attention.mergeAttention(outA: [Float16](), lseA: [], outB: [], lseB: [], headDim: 4)) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument("rows (0) must be at least 1"))
        }
    }

    /// Rows: both parts seen, one empty, both empty, a NaN output in an empty part (never read), a
    /// part that dominates so much that the other's weight underflows; in every dtype, `out`
    /// within one rounding to the dtype of the float64 merge of the same inputs.
    private func checkMergeMath<E: AttentionElement & Equatable>(_ make: (Float) -> E, _ value: (E) -> Double,
                                                                 ulp: Double, nan: E) throws {
        let attention = try FlashAttention(backend: .cpu)
        let headDim = 70  // more than the 32 threads of a row: each thread strides over two or three
        let lseA: [Float] = [0.5, -.infinity, 2, -.infinity, 1000]
        let lseB: [Float] = [1.5, 3, -.infinity, -.infinity, 0]
        var outA = [E](repeating: make(0), count: lseA.count * headDim)
        var outB = outA
        for i in outA.indices {
            outA[i] = make(Float(i % 13) / 8 - 0.7)
            outB[i] = make(Float(i % 7) / 4 - 0.9)
        }
        for d in 0..<headDim { outA[headDim + d] = nan }
        let (out, lse) = try attention.mergeAttention(outA: outA, lseA: lseA, outB: outB, lseB: lseB,
                                                      headDim: headDim)
        let wa = 1 / (1 + exp(Double(lseB[0] - lseA[0])))
        XCTAssertEqual(Double(lse[0]), 1.5 + log(1 + exp(-1.0)), accuracy: 1e-6)
        for d in 0..<headDim {
            let expected = wa * value(outA[d]) + (1 - wa) * value(outB[d])
            XCTAssertEqual(value(out[d]), expected, accuracy: ulp * max(1, abs(expected)))
            XCTAssertEqual(out[headDim + d], outB[headDim + d])      // only b saw keys
            XCTAssertEqual(out[2 * headDim + d], outA[2 * headDim + d])  // only a saw keys
            XCTAssertEqual(value(out[3 * headDim + d]), 0)           // neither saw keys
            XCTAssertEqual(out[4 * headDim + d], outA[4 * headDim + d])  // b's weight underflows
        }
        XCTAssertEqual(lse[1], 3)
        XCTAssertEqual(lse[2], 2)
        XCTAssertEqual(lse[3], -.infinity)
        XCTAssertEqual(lse[4], 1000)
    }

    func testMergeMathFloat16() throws {
        try checkMergeMath({ Float16($0) }, { Double($0) }, ulp: 1.0 / 1024, nan: .nan)
    }

    func testMergeMathBFloat16() throws {
        try checkMergeMath({ BFloat16($0) }, { Double($0.floatValue) }, ulp: 1.0 / 128,
                           nan: BFloat16(bitPattern: 0x7FC0))
    }

    func testMergeMathFloat32() throws {
        try checkMergeMath({ $0 }, { Double($0) }, ulp: 1e-6, nan: .nan)
    }
}
