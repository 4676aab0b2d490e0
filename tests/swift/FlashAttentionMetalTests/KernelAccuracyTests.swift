import Foundation
import XCTest

@testable import FlashAttentionMetal

/// The three attention kernels of Shaders/flash_attention.metal, run by the CPU engine through the
/// Swift API, against the float64 reference under the accuracy rule of design.md.
final class KernelAccuracyTests: XCTestCase {
    /// Small enough to run under the sanitizers, covering seqlen 1, 17, 33, 100, head_dim 16, 40, 64,
    /// 80, 128, causal with seqlen_q above and below seqlen_k (rows with no key), GQA and MQA.
    static let cases: [AttentionCase] = [
        AttentionCase(batch: 1, heads: 2, kvHeads: 2, seqlenQ: 1, seqlenK: 17, headDim: 16, causal: true),
        AttentionCase(batch: 2, heads: 2, kvHeads: 1, seqlenQ: 17, seqlenK: 17, headDim: 40, causal: false),
        AttentionCase(batch: 1, heads: 2, kvHeads: 2, seqlenQ: 33, seqlenK: 33, headDim: 64, causal: true),
        AttentionCase(batch: 1, heads: 2, kvHeads: 1, seqlenQ: 100, seqlenK: 100, headDim: 80, causal: false),
        AttentionCase(batch: 1, heads: 1, kvHeads: 1, seqlenQ: 100, seqlenK: 33, headDim: 128, causal: true),
        AttentionCase(batch: 1, heads: 2, kvHeads: 1, seqlenQ: 33, seqlenK: 100, headDim: 16, causal: true),
        AttentionCase(batch: 1, heads: 1, kvHeads: 1, seqlenQ: 17, seqlenK: 1, headDim: 128, causal: false),
    ]

    private func inputs(_ c: AttentionCase, seed: UInt64) -> (q: [Float16], k: [Float16], v: [Float16], dout: [Float16]) {
        var rng = Normal16(seed: seed)
        return (rng.next(c.qCount), rng.next(c.kvCount), rng.next(c.kvCount), rng.next(c.qCount))
    }

    private func shape(_ c: AttentionCase) -> AttentionShape {
        AttentionShape(batch: c.batch, numHeads: c.heads, numKVHeads: c.kvHeads, seqlenQ: c.seqlenQ,
                       seqlenK: c.seqlenK, headDim: c.headDim)
    }

    func testForwardAndBackwardMatchTheReference() throws {
        let attention = try FlashAttention(backend: .cpu)
        for (n, c) in Self.cases.enumerated() {
            let x = inputs(c, seed: UInt64(n + 1))
            let ours = try attention.forward(q: x.q, k: x.k, v: x.v, shape: shape(c), causal: c.causal)
            let ref = Reference.forward(c, q: x.q, k: x.k, v: x.v)
            let base = Reference.baseForward(c, q: x.q, k: x.k, v: x.v).out
            let outError = Reference.maxError(ours.out.map(Double.init), ref.out)
            let outBound = 2 * Reference.maxError(base, ref.out) + Reference.absoluteTerm(ref.out)
            XCTAssertLessThanOrEqual(outError, outBound, "out, \(c)")
            for (mine, exact) in zip(ours.lse, ref.lse) {
                if exact == -.infinity {
                    XCTAssertEqual(mine, -.infinity, "lse of a row without keys, \(c)")
                } else {
                    XCTAssertLessThanOrEqual(abs(Double(mine) - exact), 1e-4 * max(1, abs(exact)), "lse, \(c)")
                }
            }

            let grads = try attention.backward(dout: x.dout, q: x.q, k: x.k, v: x.v, out: ours.out, lse: ours.lse,
                                               shape: shape(c), causal: c.causal)
            let gradRef = Reference.backward(c, dout: x.dout, q: x.q, k: x.k, v: x.v)
            let gradBase = Reference.baseBackward(c, dout: x.dout, q: x.q, k: x.k, v: x.v)
            for (name, mine, exact, framework) in [
                ("dq", grads.dq, gradRef.dq, gradBase.dq), ("dk", grads.dk, gradRef.dk, gradBase.dk),
                ("dv", grads.dv, gradRef.dv, gradBase.dv),
            ] {
                let error = Reference.maxError(mine.map(Double.init), exact)
                let bound = 2 * Reference.maxError(framework, exact) + Reference.absoluteTerm(exact)
                XCTAssertLessThanOrEqual(error, bound, "\(name), \(c)")
            }
        }
    }

    /// The Metal 4 tensor-op forward (FLASH_ATTENTION_TENSOR_OPS=1: the CPU engine's matmul2d
    /// emulation), so that the sanitized runs cover it too: head_dim 64 (two threadgroups of 64 rows,
    /// causal) and 128, within the rule's tensor-op term (4x the base error plus atol).
    func testTensorOpForwardMatchesTheReference() throws {
        setenv(TensorOps.environmentVariable, "1", 1)
        defer { unsetenv(TensorOps.environmentVariable) }
        let attention = try FlashAttention(backend: .cpu)
        for (n, c) in [AttentionCase(batch: 1, heads: 2, kvHeads: 1, seqlenQ: 100, seqlenK: 70, headDim: 64, causal: true),
                       AttentionCase(batch: 1, heads: 1, kvHeads: 1, seqlenQ: 65, seqlenK: 33, headDim: 128,
                                     causal: false)].enumerated() {
            let x = inputs(c, seed: UInt64(n + 60))
            let ours = try attention.forward(q: x.q, k: x.k, v: x.v, shape: shape(c), causal: c.causal)
            XCTAssertEqual(attention.lastProfile?.dispatches.map(\.kernelName),
                           ["flash_attention_forward_tensor_f16_d\(c.headDim)"])
            let ref = Reference.forward(c, q: x.q, k: x.k, v: x.v)
            let base = Reference.baseForward(c, q: x.q, k: x.k, v: x.v).out
            let outError = Reference.maxError(ours.out.map(Double.init), ref.out)
            XCTAssertLessThanOrEqual(outError, 4 * Reference.maxError(base, ref.out) + Reference.absoluteTerm(ref.out),
                                     "out, \(c)")
            XCTAssertTrue(attention.lastProfile?.tensorOps.hasPrefix("tensor ops: FLASH_ATTENTION_TENSOR_OPS=1") ?? false)
            for (mine, exact) in zip(ours.lse, ref.lse) {
                if exact == -.infinity {
                    XCTAssertEqual(mine, -.infinity, "lse of a row without keys, \(c)")
                } else {
                    XCTAssertLessThanOrEqual(abs(Double(mine) - exact), 1e-4 * max(1, abs(exact)), "lse, \(c)")
                }
            }
        }
    }

    /// The bfloat16 and float32 kernels (so that the sanitized runs cover them too) on float16 inputs
    /// rounded to bfloat16's 8 significant bits (exact in all three types), against the float64
    /// reference of those values. Their bound is the float16 base's error scaled by the rounding
    /// unit: 8x for bfloat16 (2^-7 against float16's 2^-10); for float32 1/64 of it, which a kernel
    /// that rounds anything to a 16-bit type exceeds while float32's own errors (~1e-7) stay far below.
    func testBFloat16AndFloat32MatchTheReference() throws {
        let attention = try FlashAttention(backend: .cpu)
        for (n, c) in [Self.cases[2], Self.cases[5]].enumerated() {
            let x = inputs(c, seed: UInt64(n + 40))
            let round = { (a: [Float16]) -> [Float16] in a.map { Float16(BFloat16(Float($0)).floatValue) } }
            let (q, k, v, dout) = (round(x.q), round(x.k), round(x.v), round(x.dout))
            XCTAssertEqual(q.map { BFloat16(Float($0)).floatValue }, q.map(Float.init), "inputs exact in bfloat16")
            let ref = Reference.forward(c, q: q, k: k, v: v)
            let gradRef = Reference.backward(c, dout: dout, q: q, k: k, v: v)
            let base = Reference.baseForward(c, q: q, k: k, v: v).out
            let gradBase = Reference.baseBackward(c, dout: dout, q: q, k: k, v: v)
            let exact = [ref.out, gradRef.dq, gradRef.dk, gradRef.dv]
            let base16 = zip([base, gradBase.dq, gradBase.dk, gradBase.dv], exact).map { Reference.maxError($0, $1) }
            func check<E: AttentionElement>(_ convert: (Float16) -> E, _ widen: (E) -> Double, scale: Double) throws {
                let f = try attention.forward(q: q.map(convert), k: k.map(convert), v: v.map(convert), shape: shape(c),
                                              causal: c.causal)
                let g = try attention.backward(dout: dout.map(convert), q: q.map(convert), k: k.map(convert),
                                               v: v.map(convert), out: f.out, lse: f.lse, shape: shape(c),
                                               causal: c.causal)
                for (i, (name, mine)) in [("out", f.out), ("dq", g.dq), ("dk", g.dk), ("dv", g.dv)].enumerated() {
                    let error = Reference.maxError(mine.map(widen), exact[i])
                    let bound = 2 * scale * base16[i] + Reference.absoluteTerm(exact[i])
                    XCTAssertLessThanOrEqual(error, bound, "\(E.self) \(name), \(c)")
                }
            }
            try check({ BFloat16(Float($0)) }, { Double($0.floatValue) }, scale: 8)
            try check({ Float($0) }, { Double($0) }, scale: 1.0 / 64)
        }
    }

    /// Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key and give out 0,
    /// lse -inf and zero dq, with no NaN anywhere.
    func testRowsWithoutKeys() throws {
        let c = AttentionCase(batch: 1, heads: 1, kvHeads: 1, seqlenQ: 40, seqlenK: 8, headDim: 16, causal: true)
        let x = inputs(c, seed: 99)
        let attention = try FlashAttention(backend: .cpu)
        let f = try attention.forward(q: x.q, k: x.k, v: x.v, shape: shape(c), causal: true)
        let g = try attention.backward(dout: x.dout, q: x.q, k: x.k, v: x.v, out: f.out, lse: f.lse,
                                       shape: shape(c), causal: true)
        let emptyRows = c.seqlenQ - c.seqlenK
        XCTAssertEqual(Array(f.lse[..<emptyRows]), [Float](repeating: -.infinity, count: emptyRows))
        XCTAssertTrue(f.out[..<(emptyRows * c.headDim)].allSatisfy { $0 == 0 })
        XCTAssertTrue(g.dq[..<(emptyRows * c.headDim)].allSatisfy { $0 == 0 })
        XCTAssertFalse((f.out + g.dq + g.dk + g.dv).contains { $0.isNaN })
        XCTAssertTrue(f.lse[emptyRows...].allSatisfy { $0.isFinite })
    }

    /// Two runs give bit-identical outputs.
    func testDeterministic() throws {
        let c = AttentionCase(batch: 1, heads: 4, kvHeads: 2, seqlenQ: 33, seqlenK: 40, headDim: 40, causal: true)
        let x = inputs(c, seed: 7)
        let attention = try FlashAttention(backend: .cpu)
        func run() throws -> (halves: [UInt16], lse: [UInt32]) {
            let f = try attention.forward(q: x.q, k: x.k, v: x.v, shape: shape(c), causal: true)
            let g = try attention.backward(dout: x.dout, q: x.q, k: x.k, v: x.v, out: f.out, lse: f.lse,
                                           shape: shape(c), causal: true)
            return ((f.out + g.dq + g.dk + g.dv).map(\.bitPattern), f.lse.map(\.bitPattern))
        }
        let first = try run()
        let second = try run()
        XCTAssertEqual(first.halves, second.halves)
        XCTAssertEqual(first.lse, second.lse)
    }

    /// Several threads on one context at once give the single-threaded results.
    func testConcurrentCallsOnOneContext() throws {
        let c = AttentionCase(batch: 1, heads: 2, kvHeads: 1, seqlenQ: 17, seqlenK: 33, headDim: 64, causal: false)
        let attention = try FlashAttention(backend: .cpu)
        let inputsPerThread = (0..<4).map { inputs(c, seed: 1000 + UInt64($0)) }
        let shape = self.shape(c)
        let expected = try inputsPerThread.map {
            try attention.forward(q: $0.q, k: $0.k, v: $0.v, shape: shape).out.map(\.bitPattern)
        }
        let results = ResultBox(count: inputsPerThread.count * 3)
        DispatchQueue.concurrentPerform(iterations: results.count) { n in
            let x = inputsPerThread[n % inputsPerThread.count]
            let out = try? attention.forward(q: x.q, k: x.k, v: x.v, shape: shape).out.map(\.bitPattern)
            results.set(n, out)
        }
        for n in 0..<results.count {
            XCTAssertEqual(results.get(n), expected[n % expected.count], "thread \(n)")
        }
    }
}

/// Per-thread result slots written from concurrentPerform.
private final class ResultBox: @unchecked Sendable {
    private let lock = NSLock()
    private var values: [[UInt16]?]
    let count: Int
    init(count: Int) {
        self.count = count
        values = Array(repeating: nil, count: count)
    }
    func set(_ n: Int, _ value: [UInt16]?) { lock.withLock { values[n] = value } }
    func get(_ n: Int) -> [UInt16]? { lock.withLock { values[n] } }
}
