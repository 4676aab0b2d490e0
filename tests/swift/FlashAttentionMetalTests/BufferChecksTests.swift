import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The checks that need the buffers themselves, through the C ABI and the Swift API: no output
/// overlaps another argument of its call (every output of every call against every other argument,
/// and the boundary), and backward's lse, whose values are never refused (NaN, +inf, -inf).
final class BufferChecksTests: XCTestCase {
    /// One disjoint 512-byte slot per argument name, every byte pattern float16/bfloat16 1.0 (as a
    /// float32, 0.0078 or so: finite).
    private final class Arena {
        static let slot = 512
        let names: [String]
        let bytes: UnsafeMutableRawBufferPointer

        init(_ names: [String]) {
            self.names = names
            bytes = .allocate(byteCount: Arena.slot * names.count, alignment: 64)
            bytes.bindMemory(to: UInt16.self).initialize(repeating: 0x3C00)
        }

        deinit { bytes.deallocate() }

        subscript(name: String) -> UnsafeMutableRawPointer {
            bytes.baseAddress! + Arena.slot * names.firstIndex(of: name)!
        }

        var snapshot: [UInt8] { Array(bytes) }
    }

    /// One entry point: its argument names and a call that takes each argument's address.
    private struct Call {
        let name: String
        let inputs: [String]
        let outputs: [String]
        /// Returns nil on success, else the error message.
        let run: (_ address: (String) -> UnsafeMutableRawPointer) -> String?
    }

    /// Batch 1, 2 query heads on 1 KV head, 3 queries, 4 keys, head_dim 8, float16.
    private static func cProblem(sinks: UnsafeMutableRawPointer? = nil, dsinks: UnsafeMutableRawPointer? = nil)
        -> fa_problem {
        var p = fa_problem()
        p.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) = (1, 2, 1, 3, 4, 8)
        p.softmax_scale = 0.5
        p.sinks = sinks.map { UnsafePointer($0.assumingMemoryBound(to: Float.self)) }
        p.dsinks = dsinks?.assumingMemoryBound(to: Float.self)
        return p
    }

    private static let shape = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 3, seqlenK: 4,
                                              headDim: 8)

    private var context: OpaquePointer?

    override func setUpWithError() throws {
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &context), FA_STATUS_SUCCESS)
    }

    override func tearDown() {
        fa_context_destroy(context)
    }

    private func status(_ status: fa_status) -> String? {
        status == FA_STATUS_SUCCESS ? nil : "\(String(cString: fa_status_name(status))): "
            + String(cString: fa_last_error_message())
    }

    private func swiftError(_ body: () throws -> Void) -> String? {
        do {
            try body()
            return nil
        } catch let error as FlashAttentionError {
            return "\(error.status == FA_STATUS_INVALID_ARGUMENT ? "FA_STATUS_INVALID_ARGUMENT" : "other"): "
                + error.message
        } catch {
            return "\(error)"
        }
    }

    private var cCalls: [Call] {
        let ctx = context
        func half(_ p: UnsafeMutableRawPointer) -> UnsafeMutablePointer<UInt16> { p.assumingMemoryBound(to: UInt16.self) }
        func float(_ p: UnsafeMutableRawPointer) -> UnsafeMutablePointer<Float> { p.assumingMemoryBound(to: Float.self) }
        return [
            Call(name: "fa_forward", inputs: ["q", "k", "v"], outputs: ["out", "lse"]) { a in
                var p = Self.cProblem()
                return self.status(fa_forward(ctx, &p, a("q"), a("k"), a("v"), a("out"), float(a("lse"))))
            },
            Call(name: "fa_backward", inputs: ["dout", "q", "k", "v", "out", "lse", "sinks"],
                 outputs: ["dq", "dk", "dv", "dsinks"]) { a in
                var p = Self.cProblem(sinks: a("sinks"), dsinks: a("dsinks"))
                return self.status(fa_backward(ctx, &p, a("dout"), a("q"), a("k"), a("v"), a("out"), float(a("lse")),
                                               a("dq"), a("dk"), a("dv")))
            },
            Call(name: "fa_merge_attention", inputs: ["out_a", "lse_a", "out_b", "lse_b"], outputs: ["out", "lse"]) { a in
                self.status(fa_merge_attention(ctx, 6, 8, half(a("out_a")), float(a("lse_a")), half(a("out_b")),
                                               float(a("lse_b")), half(a("out")), float(a("lse"))))
            },
            Call(name: "fa_merge_attention_v2", inputs: ["out_a", "lse_a", "out_b", "lse_b"],
                 outputs: ["out", "lse"]) { a in
                self.status(fa_merge_attention_v2(ctx, 6, 8, FA_DTYPE_FLOAT32.rawValue, a("out_a"), float(a("lse_a")),
                                                  a("out_b"), float(a("lse_b")), a("out"), float(a("lse"))))
            },
        ]
    }

    private func swiftCalls() throws -> [Call] {
        let attention = try FlashAttention(backend: .cpu)
        let shape = Self.shape
        func input<T>(_ p: UnsafeMutableRawPointer, _ count: Int, _: T.Type = T.self) -> UnsafeBufferPointer<T> {
            UnsafeBufferPointer(start: p.assumingMemoryBound(to: T.self), count: count)
        }
        func output<T>(_ p: UnsafeMutableRawPointer, _ count: Int, _: T.Type = T.self) -> UnsafeMutableBufferPointer<T> {
            UnsafeMutableBufferPointer(start: p.assumingMemoryBound(to: T.self), count: count)
        }
        let (nq, nk, nl) = (shape.queryElementCount, shape.keyElementCount, shape.lseElementCount)
        return [
            Call(name: "forward", inputs: ["q", "k", "v"], outputs: ["out", "lse"]) { a in
                self.swiftError {
                    try attention.forward(q: input(a("q"), nq, UInt16.self), k: input(a("k"), nk), v: input(a("v"), nk),
                                          out: output(a("out"), nq), lse: output(a("lse"), nl), shape: shape)
                }
            },
            Call(name: "backward", inputs: ["dout", "q", "k", "v", "out", "lse"], outputs: ["dq", "dk", "dv", "dsinks"]) { a in
                self.swiftError {
                    try attention.backward(dout: input(a("dout"), nq, UInt16.self), q: input(a("q"), nq),
                                           k: input(a("k"), nk), v: input(a("v"), nk), out: input(a("out"), nq),
                                           lse: input(a("lse"), nl), dq: output(a("dq"), nq), dk: output(a("dk"), nk),
                                           dv: output(a("dv"), nk), shape: shape,
                                           options: AttentionOptions(sinks: [0.5, -1]), dsinks: output(a("dsinks"), 2))
                }
            },
            Call(name: "mergeAttention", inputs: ["out_a", "lse_a", "out_b", "lse_b"], outputs: ["out", "lse"]) { a in
                self.swiftError {
                    try attention.mergeAttention(outA: input(a("out_a"), 48, BFloat16.self), lseA: input(a("lse_a"), 6),
                                                 outB: input(a("out_b"), 48), lseB: input(a("lse_b"), 6),
                                                 out: output(a("out"), 48), lse: output(a("lse"), 6), headDim: 8)
                }
            },
        ]
    }

    /// Each output of `call` placed on each other argument: INVALID_ARGUMENT naming both, and
    /// nothing written; distinct slots succeed.
    private func checkOverlaps(_ call: Call, file: StaticString = #filePath, line: UInt = #line) {
        let names = call.inputs + call.outputs
        let arena = Arena(names)
        XCTAssertNil(call.run { arena[$0] }, "\(call.name) with disjoint buffers", file: file, line: line)
        for output in call.outputs {
            for other in names where other != output {
                let before = arena.snapshot
                let message = call.run { $0 == output ? arena[other] : arena[$0] }
                let named = [output, other].contains { a in
                    let b = a == output ? other : output
                    return message?.hasPrefix("FA_STATUS_INVALID_ARGUMENT: \(a) must not overlap \(b) ") ?? false
                }
                XCTAssertTrue(named, "\(call.name): \(output) on \(other) gave \(message ?? "success")",
                              file: file, line: line)
                XCTAssertEqual(arena.snapshot, before, "\(call.name) wrote although \(output) overlaps \(other)",
                               file: file, line: line)
            }
        }
    }

    func testEveryOutputOfEveryCEntryPointMustNotOverlap() {
        for call in cCalls { checkOverlaps(call) }
    }

    func testEveryOutputOfEverySwiftCallMustNotOverlap() throws {
        for call in try swiftCalls() { checkOverlaps(call) }
    }

    /// The boundary: `out` overlapping the last element of `q` is refused, `out` starting right
    /// after it is not (the byte ranges the plan binds, nothing more).
    func testOverlapIsByteExact() {
        let forward = cCalls[0]
        let arena = Arena(forward.inputs + forward.outputs + ["spare"])
        let qBytes = BufferRole.q.byteCount(for: try! Problem.validate(Self.shape, causal: false, softmaxScale: nil))
        XCTAssertEqual(forward.run { $0 == "out" ? arena["q"] + qBytes - 2 : arena[$0] },
                       "FA_STATUS_INVALID_ARGUMENT: out must not overlap q (outputs are written while inputs are read)")
        XCTAssertNil(forward.run { name in
            switch name {
            case "q": return arena["spare"]
            case "out": return arena["spare"] + qBytes
            default: return arena[name]
            }
        })
    }

    // MARK: lse

    /// Runs fa_forward then fa_backward on `problem` (random inputs, float16), with the forward's
    /// lse passed through `edit` first; returns the backward's message (nil on success) and dq, dk,
    /// dv as floats.
    private func backward(_ problem: fa_problem, mask: [UInt8] = [], edit: (inout [Float]) -> Void)
        -> (message: String?, grads: [Float]) {
        var p = problem
        var rng = SystemRandomNumberGenerator()
        func tensor(_ count: Int) -> [UInt16] {
            (0..<count).map { _ in Float16(Float.random(in: -1...1, using: &rng)).bitPattern }
        }
        let nq = Int(p.batch * p.num_heads * p.seqlen_q * p.head_dim)
        let nk = Int(p.batch * p.num_kv_heads * p.seqlen_k * p.head_dim)
        let q = tensor(nq), k = tensor(nk), v = tensor(nk), dout = tensor(nq)
        var out = [UInt16](repeating: 0, count: nq)
        var lse = [Float](repeating: 0, count: Int(p.batch * p.num_heads * p.seqlen_q))
        var (dq, dk, dv) = ([UInt16](repeating: 0, count: nq), [UInt16](repeating: 0, count: nk),
                            [UInt16](repeating: 0, count: nk))
        return mask.withUnsafeBytes { m in
            if !mask.isEmpty { p.attn_mask = m.baseAddress }
            XCTAssertEqual(fa_forward(context, &p, q, k, v, &out, &lse), FA_STATUS_SUCCESS)
            edit(&lse)
            let message = status(fa_backward(context, &p, dout, q, k, v, out, lse, &dq, &dk, &dv))
            return (message, (dq + dk + dv).map { Float(Float16(bitPattern: $0)) })
        }
    }

    /// No path checks lse values (FlashAttention and PyTorch do not): NaN and +inf, which forward
    /// gives rows with a NaN or +inf score, give NaN gradients; -inf (forward's lse of a row
    /// without visible keys) gives that row zero gradients, also on a row that sees keys. The
    /// C ABI (every mask kind and sinks) and the Swift API.
    func testBackwardAcceptsEveryLse() throws {
        for value in [Float.nan, .infinity, -.infinity] {
            let r = backward(Self.cProblem()) { $0[3] = value }
            XCTAssertNil(r.message, "lse \(value)")
            XCTAssertEqual(r.grads.contains(where: \.isNaN), value != -.infinity, "lse \(value)")
        }
        var sinks: [Float] = [0.25, -0.5]
        var dsinks: [Float] = [0, 0]
        let message = sinks.withUnsafeMutableBytes { s in
            dsinks.withUnsafeMutableBytes { d in
                backward(Self.cProblem(sinks: s.baseAddress, dsinks: d.baseAddress)) { $0[4] = -.infinity }.message
            }
        }
        XCTAssertNil(message)
        XCTAssertTrue(dsinks.allSatisfy(\.isFinite), "\(dsinks)")
        let attention = try FlashAttention(backend: .cpu)
        let shape = Self.shape
        let q = [Float](repeating: 0.5, count: shape.queryElementCount)
        let k = [Float](repeating: 0.25, count: shape.keyElementCount)
        var (out, lse) = try attention.forward(q: q, k: k, v: k, shape: shape)
        lse[2] = .nan
        let (dq, _, _) = try attention.backward(dout: out, q: q, k: k, v: k, out: out, lse: lse, shape: shape)
        XCTAssertTrue(dq[16..<24].allSatisfy(\.isNaN) && dq[0..<16].allSatisfy(\.isFinite), "\(dq)")
    }

    /// The kernels' rule for each lse value, run on the CPU engine below the C ABI: -inf gives its
    /// row zero gradients, NaN and +inf NaN ones (and NaN in every key's dk and dv and in the
    /// head's dsinks, as the row sees every key), finite rows stay finite.
    func testKernelsGradientsForNonFiniteLse() throws {
        let problem = try Problem.validate(Self.shape, dtype: .float32, causal: false, softmaxScale: nil,
                                           options: AttentionOptions(sinks: [0.25, -0.5]))
        let shape = Self.shape
        let q = (0..<shape.queryElementCount).map { Float($0 % 7) / 7 - 0.4 }
        let k = (0..<shape.keyElementCount).map { Float($0 % 5) / 5 - 0.3 }
        let lse: [Float] = [-.infinity, .nan, .infinity, 1, 2, 3]
        // Host copies of the arrays, bound by role; the outputs start as 9 so that unwritten
        // elements show.
        var memory: [UnsafeMutableRawBufferPointer] = []
        defer { memory.forEach { $0.deallocate() } }
        func place(_ values: [Float]) -> UnsafeMutableRawPointer {
            let bytes = UnsafeMutableRawBufferPointer.allocate(byteCount: values.count * 4, alignment: 16)
            bytes.copyMemory(from: UnsafeRawBufferPointer(start: values, count: values.count * 4))
            memory.append(bytes)
            return bytes.baseAddress!
        }
        var b = HostBuffers()
        let qAt = place(q), kAt = place(k)
        for role in [BufferRole.q, .dout, .out] { b.bindInput(role, qAt, for: problem) }
        for role in [BufferRole.k, .v] { b.bindInput(role, kAt, for: problem) }
        b.bindInput(.lse, place(lse), for: problem)
        b.bindInput(.sinks, place([0.25, -0.5]), for: problem)
        for (role, count) in [(BufferRole.dq, q.count), (.dk, k.count), (.dv, k.count), (.dsinks, 2)] {
            b.bindOutput(role, place([Float](repeating: 9, count: count)), for: problem)
        }
        let cancellation = Cancellation()
        _ = try CPUBackend().execute(DispatchPlan.backward(problem), buffers: b, cancellation: cancellation.token())
        func read(_ role: BufferRole) -> [Float] { Array(b[role]!.bindMemory(to: Float.self)) }
        let (dq, dk, dv, dsinks) = (read(.dq), read(.dk), read(.dv), read(.dsinks))
        XCTAssertTrue(dq[0..<8].allSatisfy { $0 == 0 }, "row with lse -inf: \(dq[0..<8])")
        XCTAssertTrue(dq[8..<24].allSatisfy(\.isNaN), "rows with lse NaN, +inf: \(dq[8..<24])")
        XCTAssertTrue(dq[24...].allSatisfy(\.isFinite) && dq[24...].contains { $0 != 0 })
        XCTAssertTrue((dk + dv).allSatisfy(\.isNaN) && dsinks[0].isNaN && dsinks[1].isFinite, "\(dk) \(dv) \(dsinks)")
    }
}
