import XCTest

@testable import FlashAttentionMetal

/// Splitting a plan into pieces (one Metal command buffer each, against the GPU watchdog): which
/// pieces, where their buffers start, and that the CPU engine running the pieces gives bit for bit
/// the results of the whole plan.
final class PlanPiecesTests: XCTestCase {
    /// batch 3, 6 query heads over 2 KV heads (GQA groups of 3).
    private func problem(causal: Bool = true) throws -> Problem {
        try Problem.validate(AttentionShape(batch: 3, numHeads: 6, numKVHeads: 2, seqlenQ: 37, seqlenK: 29,
                                            headDim: 40),
                             causal: causal, softmaxScale: nil)
    }

    /// (first batch, batch count, first KV head, KV head count) of each piece.
    private func layout(_ pieces: [PlanPiece]) -> [[UInt32]] {
        pieces.map { [$0.firstBatch, $0.plan.problem.batch, $0.firstKVHead, $0.plan.problem.numKVHeads] }
    }

    func testUnitWork() throws {
        let p = try problem()
        // group 3 x seqlen_q 37 x seqlen_k 29 x head_dim bucket 64, 4 (forward) or 10 (backward) flops.
        XCTAssertEqual(DispatchPlan.forward(p).flopsPerUnit, 4 * 3 * 37 * 29 * 64)
        XCTAssertEqual(DispatchPlan.backward(p).flopsPerUnit, 10 * 3 * 37 * 29 * 64)
        let huge = try Problem.validate(AttentionShape(batch: 1, numHeads: 1, seqlenQ: Int(UInt32.max),
                                                       seqlenK: Int(UInt32.max), headDim: 256),
                                        causal: false, softmaxScale: nil)
        XCTAssertEqual(DispatchPlan.backward(huge).flopsPerUnit, Int.max)
    }

    /// One head of a 32K x 32K backward (head_dim 128) in command buffers of 2^35 FLOP: every
    /// dispatch but delta is cut into ranges of blocks, none above the budget, each range starting
    /// where the previous one ended.
    func testLongHeadIsCutIntoBlockRanges() throws {
        let p = try Problem.validate(AttentionShape(batch: 1, numHeads: 1, seqlenQ: 32_768, seqlenK: 32_768,
                                                    headDim: 128),
                                     causal: true, softmaxScale: nil)
        let plan = DispatchPlan.backward(p)
        let budget = 1 << 35
        let pieces = plan.pieces(maxFlops: budget)
        XCTAssertTrue(pieces.allSatisfy { $0.plan.dispatches.count == 1 && $0.flops <= budget })
        for dispatch in plan.dispatches {
            let parts = pieces.map { $0.plan.dispatches[0] }.filter { $0.kernelName == dispatch.kernelName }
            XCTAssertEqual(parts.map(\.params.block_offset),
                           parts.indices.map { parts[..<$0].reduce(0) { $0 + $1.threadgroupsPerGrid.width } })
            XCTAssertEqual(parts.reduce(0) { $0 + $1.threadgroupsPerGrid.width }, dispatch.threadgroupsPerGrid.width)
        }
        // 1024 blocks of 32 rows each. Delta: 2 x 32768 x 128 FLOP, one piece. The lse residual:
        // 2 x 32768^2 x 128 = 2^38 FLOP, 128 blocks per piece. dQ: 6 x 2^37, 42 blocks per piece.
        // dK/dV: 8 x 2^37 = 2^40, 32 blocks per piece.
        XCTAssertEqual(pieces.map { $0.plan.dispatches[0].threadgroupsPerGrid.width },
                       [256] + Array(repeating: 128, count: 8) + Array(repeating: 42, count: 24) + [16]
                        + Array(repeating: 32, count: 32))
    }

    /// Budgets of 1 to 6 units: KV head ranges inside a batch entry below 2 units, whole batch
    /// entries from 2, the whole plan from 6.
    func testPieceLayout() throws {
        let plan = DispatchPlan.forward(try problem())
        let unit = plan.flopsPerUnit
        XCTAssertEqual(layout(plan.pieces(maxFlops: unit)),
                       [[0, 1, 0, 1], [0, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1], [2, 1, 0, 1], [2, 1, 1, 1]])
        // Below one unit, each unit's 2 query blocks run one per piece.
        XCTAssertEqual(layout(plan.pieces(maxFlops: unit - 1)), layout(plan.pieces(maxFlops: unit)).flatMap { [$0, $0] })
        XCTAssertEqual(layout(plan.pieces(maxFlops: 2 * unit)), [[0, 1, 0, 2], [1, 1, 0, 2], [2, 1, 0, 2]])
        XCTAssertEqual(layout(plan.pieces(maxFlops: 5 * unit - 1)), [[0, 2, 0, 2], [2, 1, 0, 2]])
        XCTAssertEqual(layout(plan.pieces(maxFlops: 6 * unit)), [[0, 3, 0, 2]])
        XCTAssertEqual(layout(plan.pieces(maxFlops: .max)), [[0, 3, 0, 2]])
    }

    /// A KV head range of 3 over 8 KV heads leaves a shorter last range; query heads follow the
    /// KV heads in whole groups.
    func testUnevenHeadRanges() throws {
        let p = try Problem.validate(AttentionShape(batch: 1, numHeads: 16, numKVHeads: 8, seqlenQ: 5, seqlenK: 5,
                                                    headDim: 8),
                                     causal: false, softmaxScale: nil)
        let plan = DispatchPlan.backward(p)
        let pieces = plan.pieces(maxFlops: 3 * plan.flopsPerUnit)
        XCTAssertEqual(layout(pieces), [[0, 1, 0, 3], [0, 1, 3, 3], [0, 1, 6, 2]])
        XCTAssertEqual(pieces.map(\.plan.problem.numHeads), [6, 6, 4])
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .q) }, [0, 6 * 5 * 8 * 2, 12 * 5 * 8 * 2])
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .dk) }, [0, 3 * 5 * 8 * 2, 6 * 5 * 8 * 2])
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .lse) }, [0, 6 * 5 * 4, 12 * 5 * 4])
        // The backward's workspaces: D_i and the lse residual per query row, laid out like lse; the
        // 8 dK/dV threadgroups leave the nominal 30 slots idle, so each group of 2 is split in 2, with
        // partial sums of [kv head][split][key][head_dim] floats.
        XCTAssertEqual(plan.workspace, [.delta, .lseResidual, .partialDk, .partialDv])
        XCTAssertEqual(plan.problem.dkvSplits, 2)
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .partialDk) }, [0, 3 * 2 * 5 * 8 * 4, 6 * 2 * 5 * 8 * 4])
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .delta) }, [0, 6 * 5 * 4, 12 * 5 * 4])
        XCTAssertEqual(pieces.map { $0.byteOffset(of: .lseResidual) }, [0, 6 * 5 * 4, 12 * 5 * 4])
    }

    /// Each piece is the plan of its slice (same pass, grids over the slice's heads and batch),
    /// and the pieces tile every buffer exactly: consecutive, no gap, no overlap.
    func testPiecesTileTheBuffers() throws {
        for plan in [DispatchPlan.forward(try problem()), DispatchPlan.backward(try problem())] {
            for units in 1...6 {
                let pieces = plan.pieces(maxFlops: units * plan.flopsPerUnit)
                for piece in pieces {
                    let expected = DispatchPlan.make(plan.pass, planned: piece.plan.problem)
                    XCTAssertEqual(piece.plan.dispatches.map(\.kernelName), expected.dispatches.map(\.kernelName))
                    XCTAssertEqual(piece.plan.dispatches.map(\.threadgroupsPerGrid.depth),
                                   piece.plan.dispatches.map { _ in piece.plan.problem.batch })
                    XCTAssertEqual(piece.plan.problem.numHeads, piece.plan.problem.numKVHeads * 3)
                }
                // Every role the plan binds (optional inputs it lacks are not bound).
                for role in plan.boundRoles {
                    var next = 0
                    for piece in pieces {
                        XCTAssertEqual(piece.byteOffset(of: role), next, "\(role.name), \(units) units")
                        next += role.byteCount(for: piece.plan.problem)
                    }
                    XCTAssertEqual(next, role.byteCount(for: plan.problem), "\(role.name), \(units) units")
                }
            }
        }
    }

    /// The CPU engine running the pieces gives the results of the whole plan, bit for bit, for
    /// every way of cutting a problem (per KV head, per batch entry, whole), forward and backward,
    /// causal and not; the backward's `delta` workspace is cut like lse.
    func testPiecesGiveBitIdenticalResults() throws {
        let whole = Context(backend: try CPUBackend())
        for causal in [false, true] {
            let p = try Problem.validate(AttentionShape(batch: 2, numHeads: 4, numKVHeads: 2, seqlenQ: 19, seqlenK: 23,
                                                        headDim: 24),
                                         causal: causal, softmaxScale: nil)
            var rng = Normal16(seed: causal ? 11 : 12)
            let q = rng.next(BufferRole.q.elementCount(for: p)), k = rng.next(BufferRole.k.elementCount(for: p)), v = rng.next(BufferRole.k.elementCount(for: p))
            let dout = rng.next(BufferRole.q.elementCount(for: p))
            let reference = try forwardAndBackward(whole, p, q: q, k: k, v: v, dout: dout)
            // Forward / backward pieces: per KV head / per KV head, per batch entry / per KV head,
            // whole / per batch entry.
            let forwardUnit = DispatchPlan.forward(p).flopsPerUnit
            for budget in [forwardUnit, 2 * forwardUnit, 2 * DispatchPlan.backward(p).flopsPerUnit] {
                let split = Context(backend: try CPUBackend(flopsPerPiece: budget))
                let result = try forwardAndBackward(split, p, q: q, k: k, v: v, dout: dout)
                assertSame(result, reference, "causal \(causal), \(budget) flops per piece")
            }
        }
    }

    /// Dropout in pieces: each piece's Philox stream starts at its first batch entry and query head
    /// (`DropoutSpec.slice`), so the pieces draw the whole plan's mask and give its results bit for
    /// bit; the problem is never split-KV, even where it would be without dropout.
    func testPiecesWithDropoutGiveBitIdenticalResults() throws {
        let options = AttentionOptions(dropout: AttentionDropout(p: 0.3, seed: 0xDEAD_BEEF_0123, offset: 1 << 40))
        let p = try Problem.validate(AttentionShape(batch: 2, numHeads: 4, numKVHeads: 2, seqlenQ: 19, seqlenK: 23,
                                                    headDim: 24),
                                     causal: true, softmaxScale: nil, options: options)
        var rng = Normal16(seed: 21)
        let q = rng.next(BufferRole.q.elementCount(for: p)), k = rng.next(BufferRole.k.elementCount(for: p))
        let v = rng.next(BufferRole.k.elementCount(for: p)), dout = rng.next(BufferRole.q.elementCount(for: p))
        let reference = try forwardAndBackward(Context(backend: try CPUBackend()), p, q: q, k: k, v: v, dout: dout)
        let undropped = try forwardAndBackward(Context(backend: try CPUBackend()),
                                               try Problem.validate(AttentionShape(batch: 2, numHeads: 4, numKVHeads: 2,
                                                                                   seqlenQ: 19, seqlenK: 23, headDim: 24),
                                                                    causal: true, softmaxScale: nil),
                                               q: q, k: k, v: v, dout: dout)
        XCTAssertNotEqual(reference[0], undropped[0], "dropout changes out")
        let unit = DispatchPlan.backward(p).flopsPerUnit
        for budget in [DispatchPlan.forward(p).flopsPerUnit, unit, 2 * unit, 1] {
            let split = Context(backend: try CPUBackend(flopsPerPiece: budget))
            assertSame(try forwardAndBackward(split, p, q: q, k: k, v: v, dout: dout), reference, "budget \(budget)")
        }
        let decode = try Problem.validate(AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 2, seqlenK: 600,
                                                         headDim: 16),
                                          causal: true, softmaxScale: nil, options: options)
        XCTAssertNil(decode.split, "dropout runs the dense forward")
    }

    /// The split-KV forward (decode) in pieces keeps the whole problem's chunks of keys (a piece
    /// alone would choose more, and so another summation order), and its partial workspaces are cut
    /// per query head: bit for bit the whole plan's out and lse.
    func testSplitKeyValuePiecesKeepTheChunks() throws {
        let shape = AttentionShape(batch: 3, numHeads: 4, numKVHeads: 2, seqlenQ: 2, seqlenK: 16_384, headDim: 8)
        let p = try Problem.validate(shape, causal: true, softmaxScale: nil)
        let alone = try Problem.validate(AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 2,
                                                        seqlenK: 16_384, headDim: 8),
                                         causal: true, softmaxScale: nil)
        let chunks = try XCTUnwrap(p.cpuSplit).chunks
        XCTAssertNotEqual(try XCTUnwrap(alone.cpuSplit).chunks, chunks, "the test needs a shape whose pieces differ")
        let plan = DispatchPlan.forward(p)
        let pieces = plan.pieces(maxFlops: plan.flopsPerUnit)
        XCTAssertEqual(pieces.count, 6)
        XCTAssertTrue(pieces.allSatisfy { $0.plan.problem.split == p.cpuSplit })
        XCTAssertEqual(pieces[1].byteOffset(of: .partialLse), 2 * Int(chunks) * 2 * 2 * 4)
        XCTAssertEqual(pieces[1].byteOffset(of: .partialOut), 2 * Int(chunks) * 2 * 8 * 4)


        // Run on a shorter cache (10 chunks of 64 keys, cheap on the CPU engine): the pieces bind
        // their parts of the partial workspaces.
        let short = try Problem.validate(AttentionShape(batch: 3, numHeads: 4, numKVHeads: 2, seqlenQ: 2,
                                                        seqlenK: 600, headDim: 8),
                                         causal: true, softmaxScale: nil)
        XCTAssertEqual(short.cpuSplit?.chunks, 10)
        var rng = Normal16(seed: 5)
        let q = rng.next(BufferRole.q.elementCount(for: short)), k = rng.next(BufferRole.k.elementCount(for: short))
        let v = rng.next(BufferRole.k.elementCount(for: short))
        let reference = try forward(Context(backend: try CPUBackend()), short, q: q, k: k, v: v)
        let perHead = try CPUBackend(flopsPerPiece: DispatchPlan.forward(short).flopsPerUnit)
        let result = try forward(Context(backend: perHead), short, q: q, k: k, v: v)
        assertSame(result, reference, "split-KV forward in 6 pieces")
        // Below one unit: each unit's split kernel one (chunk, row block) per piece, then its combine.
        let perBlock = DispatchPlan.forward(short).pieces(maxFlops: 1)
        XCTAssertEqual(perBlock.map { $0.plan.dispatches[0].params.block_offset },
                       Array(repeating: Array(0..<10) + [0], count: 6).flatMap { $0 })
        let blocks = try forward(Context(backend: try CPUBackend(flopsPerPiece: 1)), short, q: q, k: k, v: v)
        assertSame(blocks, reference, "split-KV forward in blocks")
    }

    /// The profile of a pass run in pieces counts them (Metal: one command buffer each) and keeps
    /// one record per dispatch of the plan, for the whole problem: its grid, and counts summed over
    /// the pieces that equal the whole run's.
    func testProfileShowsThePieces() throws {
        let p = try problem()
        var rng = Normal16(seed: 3)
        let q = rng.next(BufferRole.q.elementCount(for: p)), k = rng.next(BufferRole.k.elementCount(for: p)), v = rng.next(BufferRole.k.elementCount(for: p))
        let dout = rng.next(BufferRole.q.elementCount(for: p))
        let whole = Context(backend: try CPUBackend())
        _ = try forwardAndBackward(whole, p, q: q, k: k, v: v, dout: dout)
        let split = Context(backend: try CPUBackend(flopsPerPiece: DispatchPlan.backward(p).flopsPerUnit))
        _ = try forwardAndBackward(split, p, q: q, k: k, v: v, dout: dout)
        let (one, six) = (try XCTUnwrap(whole.lastProfile), try XCTUnwrap(split.lastProfile))
        XCTAssertEqual(one.commandBuffers, 1)
        XCTAssertEqual(six.commandBuffers, 6, "batch 3 x 2 KV heads, one each")
        let plan = DispatchPlan.backward(p)
        XCTAssertEqual(six.dispatches.map(\.kernelName), plan.dispatches.map(\.kernelName))
        XCTAssertEqual(six.dispatches.map(\.threadgroupsPerGrid),
                       plan.dispatches.map { .init($0.threadgroupsPerGrid) })
        XCTAssertEqual(six.dispatches.map(\.simdgroupMultiplyAccumulates),
                       one.dispatches.map(\.simdgroupMultiplyAccumulates))
        XCTAssertEqual(six.dispatches.map(\.threadgroupBarriers), one.dispatches.map(\.threadgroupBarriers))
        XCTAssertTrue(six.dispatches.allSatisfy {
            ($0.simdgroupMultiplyAccumulates ?? 0) > 0 || $0.kernelName.hasPrefix("flash_attention_backward_delta")
                || $0.kernelName.hasPrefix("flash_attention_backward_lse_residual")
                || $0.kernelName.hasPrefix("flash_attention_backward_dkv_reduce")
        })
    }

    /// Score modifiers split too: a per-batch ALiBi, a padding mask broadcast over heads and query
    /// rows, a window and sinks give the whole plan's results bit for bit, and dsinks (a sum over
    /// every batch entry) runs once after the pieces.
    func testPiecesWithScoreModifiersAndSinks() throws {
        let shape = AttentionShape(batch: 3, numHeads: 4, numKVHeads: 2, seqlenQ: 9, seqlenK: 14, headDim: 16)
        let mask = (0..<(3 * 14)).map { UInt8($0 % 5 == 3 ? 0 : 1) }
        let options = AttentionOptions(windowLeft: 6, windowRight: 2, softcap: 4,
                                       alibiSlopes: (0..<12).map { Float($0) / 24 }, sinks: [0.5, -1, 2, 0],
                                       attnMask: .boolean(mask, strides: TensorStrides(batch: 14, head: 0, seq: 0)))
        let p = try Problem.validate(shape, causal: false, softmaxScale: nil, options: options)
        var rng = Normal16(seed: 13)
        let q = rng.next(BufferRole.q.elementCount(for: p)), k = rng.next(BufferRole.k.elementCount(for: p))
        let v = rng.next(BufferRole.v.elementCount(for: p)), dout = rng.next(BufferRole.out.elementCount(for: p))
        let slopes = options.alibiSlopes!, sinks = options.sinks!
        func run(_ context: Context) throws -> [[UInt32]] {
            try modifiedOutputs(context, p, q: q, k: k, v: v, dout: dout, mask: mask, slopes: slopes, sinks: sinks)
        }
        let reference = try run(Context(backend: try CPUBackend()))
        XCTAssertTrue(reference[5].allSatisfy { Float(bitPattern: $0) != 0 }, "dsinks computed")
        let unit = DispatchPlan.backward(p).flopsPerUnit
        for budget in [unit, 2 * unit, 2 * Int(p.numKVHeads) * unit] {
            assertSame(try run(Context(backend: try CPUBackend(flopsPerPiece: budget))), reference, "budget \(budget)")
        }
        let pieces = DispatchPlan.backward(p).pieces(maxFlops: unit)
        XCTAssertEqual(pieces.last?.plan.dispatches.map(\.kernelName), ["flash_attention_backward_dsinks"])
        XCTAssertFalse(pieces.dropLast().contains { $0.plan.dispatches.contains(where: \.wholeProblem) })
    }

    /// One KV head (a GQA group of 2) of 300 x 300 rows, causal with a window, ALiBi, a padding
    /// mask, softcap and sinks, in budgets below one unit: each dispatch runs in ranges of query
    /// blocks (forward, delta, lse residual, dQ) or key blocks (dK/dV), each piece with its own
    /// `block_offset`, and the results are the whole plan's bit for bit, dsinks included.
    func testBlockPiecesGiveBitIdenticalResults() throws {
        let shape = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 300, seqlenK: 300, headDim: 16)
        let mask = (0..<300).map { UInt8($0 % 7 == 5 ? 0 : 1) }
        let options = AttentionOptions(windowLeft: 90, windowRight: -1, softcap: 5, alibiSlopes: [0.25, 0.0625],
                                       sinks: [1, -0.5],
                                       attnMask: .boolean(mask, strides: TensorStrides(batch: 300, head: 0, seq: 0)))
        let p = try Problem.validate(shape, causal: true, softmaxScale: nil, options: options)
        var rng = Normal16(seed: 17)
        let q = rng.next(BufferRole.q.elementCount(for: p)), k = rng.next(BufferRole.k.elementCount(for: p))
        let v = rng.next(BufferRole.v.elementCount(for: p)), dout = rng.next(BufferRole.out.elementCount(for: p))
        func run(_ flopsPerPiece: Int) throws -> [[UInt32]] {
            try modifiedOutputs(Context(backend: try CPUBackend(flopsPerPiece: flopsPerPiece)), p, q: q, k: k, v: v,
                                dout: dout, mask: mask, slopes: options.alibiSlopes!, sinks: options.sinks!)
        }
        let reference = try run(.max)
        let forward = DispatchPlan.forward(p), backward = DispatchPlan.backward(p)
        // 10 query blocks of 32 rows (forward, dQ, lse residual), 3 of 128 (delta), 10 key blocks.
        for budget in [1, forward.flopsPerUnit / 3] {
            let pieces = forward.pieces(maxFlops: budget) + backward.pieces(maxFlops: budget)
            XCTAssertGreaterThan(pieces.count, 8, "budget \(budget)")
            XCTAssertTrue(pieces.allSatisfy { $0.plan.dispatches.count == 1 })
            XCTAssertTrue(pieces.contains { $0.plan.dispatches[0].params.block_offset > 0 })
            assertSame(try run(budget), reference, "budget \(budget)")
        }
        XCTAssertEqual(forward.pieces(maxFlops: 1).count, 10)
        // delta 3, lse residual 10, dQ 10, dK/dV 10 key blocks x 2 splits of the group (GroupSplit: 10
        // threadgroups in the nominal 50 slots) and their reduction whole, then dsinks over the whole problem.
        XCTAssertEqual(backward.problem.dkvSplits, 2)
        XCTAssertEqual(backward.pieces(maxFlops: 1).map { $0.plan.dispatches[0].params.block_offset },
                       Array(0..<3) + Array(0..<10) + Array(0..<10) + Array(0..<20) + [0, 0])
    }

    private func assertSame(_ result: [[UInt32]], _ reference: [[UInt32]], _ label: String,
                            file: StaticString = #filePath, line: UInt = #line) {
        for (n, (mine, whole)) in zip(result, reference).enumerated() {
            let first = mine.indices.first { mine[$0] != whole[$0] }
            XCTAssertNil(first, "output \(n) differs first at element \(first ?? 0): \(label)", file: file, line: line)
        }
    }
}

/// The forward's buffers: q, k, v in, out and lse out.
private func forwardBuffers(_ p: Problem, _ q: UnsafeRawBufferPointer, _ k: UnsafeRawBufferPointer,
                            _ v: UnsafeRawBufferPointer, _ out: UnsafeMutableRawBufferPointer,
                            _ lse: UnsafeMutableRawBufferPointer) -> HostBuffers {
    var f = HostBuffers()
    f.bindInput(.q, q.baseAddress!, for: p)
    f.bindInput(.k, k.baseAddress!, for: p)
    f.bindInput(.v, v.baseAddress!, for: p)
    f.bindOutput(.out, out.baseAddress!, for: p)
    f.bindOutput(.lse, lse.baseAddress!, for: p)
    return f
}

/// Forward on `context`; out and lse as bit patterns.
private func forward(_ context: Context, _ p: Problem, q: [Float16], k: [Float16], v: [Float16]) throws -> [[UInt32]] {
    var out = [Float16](repeating: 0, count: BufferRole.q.elementCount(for: p))
    var lse = [Float](repeating: 0, count: p.lseElements)
    try q.withUnsafeBytes { q in
        try k.withUnsafeBytes { k in
            try v.withUnsafeBytes { v in
                try out.withUnsafeMutableBytes { out in
                    try lse.withUnsafeMutableBytes { lse in
                        try context.run(.forward, p, buffers: forwardBuffers(p, q, k, v, out, lse))
                    }
                }
            }
        }
    }
    return [out.map { UInt32($0.bitPattern) }, lse.map(\.bitPattern)]
}

/// Forward then backward on `context`; every output as bit patterns.
private func forwardAndBackward(_ context: Context, _ p: Problem, q: [Float16], k: [Float16], v: [Float16],
                                dout: [Float16]) throws -> [[UInt32]] {
    var out = [Float16](repeating: 0, count: BufferRole.q.elementCount(for: p))
    var lse = [Float](repeating: 0, count: p.lseElements)
    var dq = out, dk = [Float16](repeating: 0, count: BufferRole.k.elementCount(for: p)), dv = dk
    try q.withUnsafeBytes { q in
        try k.withUnsafeBytes { k in
            try v.withUnsafeBytes { v in
                try dout.withUnsafeBytes { dout in
                    try out.withUnsafeMutableBytes { out in
                        try lse.withUnsafeMutableBytes { lse in
                            try dq.withUnsafeMutableBytes { dq in
                                try dk.withUnsafeMutableBytes { dk in
                                    try dv.withUnsafeMutableBytes { dv in
                                        let f = forwardBuffers(p, q, k, v, out, lse)
                                        try context.run(.forward, p, buffers: f)
                                        var b = f
                                        b.bindInput(.dout, dout.baseAddress!, for: p)
                                        b.bindOutput(.dq, dq.baseAddress!, for: p)
                                        b.bindOutput(.dk, dk.baseAddress!, for: p)
                                        b.bindOutput(.dv, dv.baseAddress!, for: p)
                                        try context.run(.backward, p, buffers: b)
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let halves = [out, dq, dk, dv].map { $0.map { UInt32($0.bitPattern) } }
    return halves + [lse.map(\.bitPattern)]
}

/// Forward then backward on `context` with a boolean mask, ALiBi slopes and sinks (the problem's
/// options); out, dq, dk, dv, lse and dsinks as bit patterns.
private func modifiedOutputs(_ context: Context, _ p: Problem, q: [Float16], k: [Float16], v: [Float16],
                             dout: [Float16], mask: [UInt8], slopes: [Float], sinks: [Float]) throws -> [[UInt32]] {
    var out = [Float16](repeating: 0, count: BufferRole.out.elementCount(for: p))
    var lse = [Float](repeating: 0, count: p.lseElements)
    var dq = [Float16](repeating: 0, count: q.count), dk = [Float16](repeating: 0, count: k.count), dv = dk
    var dsinks = [Float](repeating: 0, count: Int(p.numHeads))
    try withExtendedLifetime((q, k, v, dout, mask, slopes, sinks)) {
        try out.withUnsafeMutableBytes { out in
            try lse.withUnsafeMutableBytes { lse in
                try dq.withUnsafeMutableBytes { dq in
                    try dk.withUnsafeMutableBytes { dk in
                        try dv.withUnsafeMutableBytes { dv in
                            try dsinks.withUnsafeMutableBytes { ds in
                                var f = HostBuffers()
                                for (role, array) in [(BufferRole.q, q), (.k, k), (.v, v), (.dout, dout)] {
                                    array.withUnsafeBytes { f.bindInput(role, $0.baseAddress!, for: p) }
                                }
                                mask.withUnsafeBytes { f.bindInput(.attnMask, $0.baseAddress!, for: p) }
                                slopes.withUnsafeBytes { f.bindInput(.alibiSlopes, $0.baseAddress!, for: p) }
                                sinks.withUnsafeBytes { f.bindInput(.sinks, $0.baseAddress!, for: p) }
                                f.bindOutput(.out, out.baseAddress!, for: p)
                                f.bindOutput(.lse, lse.baseAddress!, for: p)
                                try context.run(.forward, p, buffers: f)
                                f.bindOutput(.dq, dq.baseAddress!, for: p)
                                f.bindOutput(.dk, dk.baseAddress!, for: p)
                                f.bindOutput(.dv, dv.baseAddress!, for: p)
                                f.bindOutput(.dsinks, ds.baseAddress!, for: p)
                                try context.run(.backward, p, buffers: f)
                            }
                        }
                    }
                }
            }
        }
    }
    return [out, dq, dk, dv].map { $0.map { UInt32($0.bitPattern) } } + [lse, dsinks].map { $0.map(\.bitPattern) }
}

/// KV-cache and variable-length plans, which are cut into block ranges of the whole problem only:
/// the pieces give the whole plan's bits on the CPU engine, and a variable-length piece first
/// rewrites the sequence table with its own `block_offset`.
final class BlockOnlyPiecesTests: XCTestCase {
    /// Memory for the calls' arguments, freed when the test ends.
    private var allocations: [UnsafeMutableBufferPointer<Float>] = []

    override func tearDown() {
        allocations.forEach { $0.deallocate() }
        allocations = []
    }

    /// `count` floats, sin-filled from `seed`, or filled with `fill`.
    private func buffer(_ count: Int, _ seed: Int = 0, fill: Float? = nil) -> UnsafeMutableBufferPointer<Float> {
        let memory = UnsafeMutableBufferPointer<Float>.allocate(capacity: count)
        for i in 0..<count { memory[i] = fill ?? Float(sin(Double(i * 7 + seed))) }
        allocations.append(memory)
        return memory
    }

    private func attention(flopsPerPiece: Int) throws -> FlashAttention {
        FlashAttention(context: Context(backend: try CPUBackend(flopsPerPiece: flopsPerPiece)))
    }

    private func assertSame(_ result: [UnsafeMutableBufferPointer<Float>], _ reference: [UnsafeMutableBufferPointer<Float>],
                            _ label: String, file: StaticString = #filePath, line: UInt = #line) {
        for (n, (mine, whole)) in zip(result, reference).enumerated() {
            XCTAssertFalse(whole.contains { $0.isNaN }, "output \(n) written: \(label)", file: file, line: line)
            XCTAssertEqual(mine.map(\.bitPattern), whole.map(\.bitPattern), "output \(n): \(label)", file: file, line: line)
        }
    }

    /// Sequences of 40, 0 and 70 query rows (50, 3, 67 keys), causal with a window, sinks and a
    /// slope per sequence and head: forward and backward in pieces of one block (and of a few)
    /// equal the whole run bit for bit.
    func testVarlenPiecesGiveBitIdenticalResults() throws {
        let batch = VarlenBatch(cuSeqlensQ: [0, 40, 40, 110], cuSeqlensK: [0, 50, 53, 120])
        let (heads, kvHeads, dim, tq, tk) = (2, 1, 16, 110, 120)
        let options = AttentionOptions(windowLeft: 30, windowRight: 5,
                                       alibiSlopes: [0.25, 0.5, 0.125, 0.0625, 0.3, 0.2], sinks: [0.5, -1])
        let q = buffer(tq * heads * dim, 1), k = buffer(tk * kvHeads * dim, 2), v = buffer(tk * kvHeads * dim, 3)
        let dout = buffer(tq * heads * dim, 4)
        func run(_ flopsPerPiece: Int) throws -> [UnsafeMutableBufferPointer<Float>] {
            let attention = try attention(flopsPerPiece: flopsPerPiece)
            let out = buffer(tq * heads * dim, fill: .nan), lse = buffer(heads * tq, fill: .nan)
            let dq = buffer(q.count, fill: .nan), dk = buffer(k.count, fill: .nan), dv = buffer(v.count, fill: .nan)
            let dsinks = buffer(heads, fill: .nan)
            try attention.forwardVarlen(q: UnsafeBufferPointer(q), k: UnsafeBufferPointer(k), v: UnsafeBufferPointer(v),
                                        out: out, lse: lse, batch: batch, numHeads: heads, numKVHeads: kvHeads,
                                        headDim: dim, causal: true, options: options)
            try attention.backwardVarlen(dout: UnsafeBufferPointer(dout), q: UnsafeBufferPointer(q),
                                         k: UnsafeBufferPointer(k), v: UnsafeBufferPointer(v),
                                         out: UnsafeBufferPointer(out), lse: UnsafeBufferPointer(lse), dq: dq, dk: dk,
                                         dv: dv, batch: batch, numHeads: heads, numKVHeads: kvHeads, headDim: dim,
                                         causal: true, options: options, dsinks: dsinks)
            return [out, lse, dq, dk, dv, dsinks]
        }
        let whole = try run(.max)
        for budget in [1, 200_000] {
            assertSame(try run(budget), whole, "budget \(budget)")
        }
        // The plan's pieces: each dispatch over sequences (3 query blocks of 32 of the longest
        // sequence's 70 rows; dK/dV 3 key blocks of 32 of 67) after a table run with its block_offset.
        let p = try Problem.validate(batch.shape(numHeads: heads, numKVHeads: kvHeads, headDim: dim, headDimV: nil),
                                     dtype: .float32, causal: true, softmaxScale: nil, options: options,
                                     varlen: try batch.validated())
        let backward = DispatchPlan.backward(p).pieces(maxFlops: 1)
        for piece in backward where piece.plan.dispatches.last?.paramsRole == .sequenceTable {
            XCTAssertEqual(piece.plan.dispatches.map(\.kernelName).first, "flash_attention_varlen_sequences")
            XCTAssertEqual(piece.plan.dispatches.count, 2)
            XCTAssertEqual(piece.plan.dispatches[0].params.block_offset, piece.plan.dispatches[1].params.block_offset)
        }
        // dK/dV: 3 key blocks x 2 splits of the group (GroupSplit), then their reduction whole.
        XCTAssertEqual(DispatchPlan.backward(p).problem.dkvSplits, 2)
        XCTAssertEqual(backward.map { $0.plan.dispatches.last!.kernelName.split(separator: "_")[3] },
                       ["delta"] + Array(repeating: "lse", count: 3) + Array(repeating: "dq", count: 3)
                        + Array(repeating: "dkv", count: 7) + ["dsinks"])
        XCTAssertEqual(backward.map { $0.plan.dispatches.last!.params.block_offset },
                       [0, 0, 1, 2, 0, 1, 2] + Array(0..<6) + [0, 0])
        XCTAssertEqual(DispatchPlan.forward(p).pieces(maxFlops: .max).count, 1)
    }

    /// A paged cache (shuffled blocks) read by the dense kernel (65 query rows) and by the split-KV
    /// kernel (2 rows): pieces of one block of the grid, then the combine, equal the whole run.
    func testKVCachePiecesGiveBitIdenticalResults() throws {
        let (heads, kvHeads, seqlenK, dim, page) = (4, 2, 77, 32, 8)
        let table: [Int32] = [3, 0, 5, 1, 4, 10, 7, 9, 6, 8]
        let kPaged = buffer(11 * kvHeads * page * dim, 2), vPaged = buffer(11 * kvHeads * page * dim, 3)
        for seqlenQ in [65, 2] {
            let shape = AttentionShape(batch: 1, numHeads: heads, numKVHeads: kvHeads, seqlenQ: seqlenQ,
                                       seqlenK: seqlenK, headDim: dim)
            let q = buffer(heads * seqlenQ * dim, 1)
            func run(_ flopsPerPiece: Int) throws -> [UnsafeMutableBufferPointer<Float>] {
                let out = buffer(heads * seqlenQ * dim, fill: .nan), lse = buffer(heads * seqlenQ, fill: .nan)
                try table.withUnsafeBufferPointer { t in
                    let cache = AttentionKVCache(k: UnsafeRawBufferPointer(kPaged), v: UnsafeRawBufferPointer(vPaged),
                                                 rows: page, blockTable: t, maxBlocks: 10, numBlocks: 11)
                    try attention(flopsPerPiece: flopsPerPiece).forward(q: UnsafeBufferPointer(q), cache: cache,
                                                                        out: out, lse: lse, shape: shape, causal: true)
                }
                return [out, lse]
            }
            let whole = try run(.max)
            assertSame(try run(1), whole, "seqlen_q \(seqlenQ)")
        }
    }
}
