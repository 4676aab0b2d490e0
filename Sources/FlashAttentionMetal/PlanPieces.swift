/// One part of a split plan, run on its own (by Metal in its own command buffer): the same pass on
/// the problem restricted to a range of batch entries, or, inside one batch entry, to a range of KV
/// heads with their query heads (whole GQA groups); or, when one batch entry and KV head alone
/// exceeds the budget, one dispatch of that unit over a range of its blocks (query blocks for the
/// forward, delta, lse residual and dQ; key blocks for dK/dV), which its parameter struct's
/// `block_offset` tells the kernel. Each buffer of the piece is the part of the full buffer that
/// starts at `byteOffset(of:)`, so the kernels see an ordinary, smaller problem.
///
/// Splitting is exact: a threadgroup's work depends only on its own (batch, head, block) and on
/// the sizes, a GQA group never straddles two pieces (dK/dV sum over the group in order, inside one
/// threadgroup), and no two threadgroups write the same element, so the pieces compute bit for bit
/// what the whole plan computes. The pieces run in order, so a dispatch's block pieces all finish
/// before the next dispatch's start (dQ and dK/dV read the whole unit's delta).
struct PlanPiece {
    /// The pass on the slice.
    let plan: DispatchPlan
    /// Where the slice starts in the full problem.
    let firstBatch: UInt32
    let firstKVHead: UInt32
    /// The problem the offsets refer to.
    let full: Problem
    /// Floating-point operations of the piece, an upper bound (what the completion wait scales with).
    let flops: Int

    init(plan: DispatchPlan, firstBatch: UInt32, firstKVHead: UInt32, full: Problem, flops: Int) {
        self.plan = plan
        self.firstBatch = firstBatch
        self.firstKVHead = firstKVHead
        self.full = full
        self.flops = flops
    }

    /// All of `plan` as one piece.
    init(whole plan: DispatchPlan) {
        self.init(plan: plan, firstBatch: 0, firstKVHead: 0, full: plan.problem, flops: plan.flops)
    }

    /// Bytes from the start of the full buffer of `role` to the start of this piece's part: the
    /// start of a (batch entry, head) block, so a multiple of the element size and of a row, and
    /// a kernel's alignment assumptions about row starts hold in every piece.
    func byteOffset(of role: BufferRole) -> Int {
        role.elementOffset(batch: firstBatch, kvHead: firstKVHead, in: full) * role.elementSize(for: full)
    }
}

extension Problem {
    /// `factors` multiplied, saturating at `Int.max`.
    private static func saturatingProduct(_ factors: [Int]) -> Int {
        var product = 1
        for factor in factors {
            let (next, overflow) = product.multipliedReportingOverflow(by: factor)
            if overflow { return Int.max }
            product = next
        }
        return product
    }

    /// Floating-point operations of a kernel that does `flopsPerScoreElement` per (query head, query
    /// row, key, head_dim element) of `units` units of splitting (batch entry, KV head with its
    /// query heads; all of the problem's by default), head_dim padded to the bucket's; saturating.
    func scoreWork(flopsPerScoreElement: Int, units: Int? = nil) -> Int {
        Problem.saturatingProduct([flopsPerScoreElement, units ?? Int(batch) * Int(numKVHeads), Int(groupSize),
                                   Int(seqlenQ), Int(seqlenK), Int(bucket.head_dim_max)])
    }

    /// An upper bound of the floating-point operations of a score kernel's grid of `blocks` blocks
    /// along x, each of `rows` query rows (of keys: `alongKeys`): the whole problem's `scoreWork`
    /// for a dense batch. In a variable-length batch block x holds those rows of every sequence,
    /// each against its own sequence's keys (query rows), so at most `rows` times the packed total
    /// of the other side per head: `blocks` times that. Saturating.
    func gridWork(flopsPerScoreElement: Int, blocks: UInt32, rows: UInt32, alongKeys: Bool = false) -> Int {
        guard varlen != nil else { return scoreWork(flopsPerScoreElement: flopsPerScoreElement) }
        return Problem.saturatingProduct([flopsPerScoreElement, Int(numHeads), Int(blocks), Int(rows),
                                          Int(alongKeys ? seqlenQ : seqlenK), Int(bucket.head_dim_max)])
    }

    /// Floating-point operations of a kernel that does `flopsPerElement` per element of out (head_dim
    /// padded to the bucket's) of the whole problem; saturating.
    func rowWork(flopsPerElement: Int) -> Int {
        Problem.saturatingProduct([flopsPerElement, Int(batch), Int(numHeads), Int(seqlenQ), Int(bucket.head_dim_max)])
    }
}

extension DispatchPlan {
    /// Floating-point operations of one unit of splitting (one batch entry, one KV head and its
    /// query heads), saturating at `Int.max`.
    var flopsPerUnit: Int {
        problem.scoreWork(flopsPerScoreElement: pass.flopsPerScoreElement, units: 1)
    }

    /// Floating-point operations of the whole plan, saturating.
    var flops: Int { problem.scoreWork(flopsPerScoreElement: pass.flopsPerScoreElement) }

    /// The plan cut into pieces of at most `maxFlops` each, in order of batch entry, then KV head.
    /// Whole batch entries are grouped while a piece holds at least one; otherwise each batch entry
    /// is cut into ranges of KV heads; when one KV head of one batch entry alone is larger, each of
    /// its dispatches with `blockWork` above the budget is cut into ranges of blocks (at least one
    /// block each: a single block larger than `maxFlops` is one piece). A plan within the budget is
    /// one piece: itself. KV-cache and variable-length plans are cut into block ranges only
    /// (`blockPieces(maxFlops:)`).
    func pieces(maxFlops: Int) -> [PlanPiece] {
        let p = problem
        if p.kvCache != nil || p.varlen != nil {
            return flops <= maxFlops ? [PlanPiece(whole: self)] : blockPieces(maxFlops: maxFlops)
        }
        let unitFlops = flopsPerUnit
        let unitsPerPiece = UInt64(max(1, maxFlops / unitFlops))
        let kvHeads = UInt64(p.numKVHeads)
        if unitsPerPiece >= UInt64(p.batch) * kvHeads && unitFlops <= maxFlops {
            return [PlanPiece(whole: self)]
        }
        var pieces: [PlanPiece] = []
        func add(batches: Range<UInt32>, kvHeads: Range<UInt32>) {
            let sliced = DispatchPlan.make(pass, planned: p.slice(batches: batches, kvHeads: kvHeads)).keeping { !$0.wholeProblem }
            guard unitFlops > maxFlops else {
                pieces.append(PlanPiece(plan: sliced, firstBatch: batches.lowerBound, firstKVHead: kvHeads.lowerBound,
                                        full: p, flops: sliced.flops))
                return
            }
            for dispatch in sliced.dispatches {
                for (part, flops) in dispatch.blockRanges(maxFlops: maxFlops, otherwise: sliced.flops) {
                    pieces.append(PlanPiece(plan: sliced.keeping(part), firstBatch: batches.lowerBound,
                                            firstKVHead: kvHeads.lowerBound, full: p, flops: flops))
                }
            }
        }
        if unitsPerPiece >= kvHeads && unitFlops <= maxFlops {
            let step = UInt32(unitsPerPiece / kvHeads)
            for b in stride(from: UInt32(0), to: p.batch, by: Int(step)) {
                add(batches: b..<b + min(step, p.batch - b), kvHeads: 0..<p.numKVHeads)
            }
        } else {
            let step = UInt32(min(unitsPerPiece, kvHeads))
            for b in 0..<p.batch {
                for h in stride(from: UInt32(0), to: p.numKVHeads, by: Int(step)) {
                    add(batches: b..<b + 1, kvHeads: h..<h + min(step, p.numKVHeads - h))
                }
            }
        }
        let whole = keeping(\.wholeProblem)
        if !whole.dispatches.isEmpty {
            pieces.append(PlanPiece(whole: whole))
        }
        return pieces
    }

    /// A KV-cache or variable-length plan in pieces over the whole problem, each one dispatch (or a
    /// range of its blocks, `Dispatch.blockRanges`) in order: such a problem is not sliced by batch
    /// entry or head, since a cache's k and v are addressed through its block table or cache slots
    /// and a variable-length batch's sequence table describes the packed problem. A variable-length
    /// piece starts with its own run of the table kernel: the sequences' structs, which the other
    /// kernels bind in place of the host's, carry the piece's `block_offset` (the table is the same
    /// otherwise, so the pieces stay bit-identical to the whole plan).
    private func blockPieces(maxFlops: Int) -> [PlanPiece] {
        // A variable-length plan starts with the table kernel (DispatchPlan.withSequenceTable).
        let table = problem.varlen == nil ? nil : dispatches.first
        var pieces: [PlanPiece] = []
        for dispatch in dispatches.dropFirst(table == nil ? 0 : 1) {
            for (part, flops) in dispatch.blockRanges(maxFlops: maxFlops, otherwise: self.flops) {
                var run = [part]
                if var table, part.paramsRole == .sequenceTable {
                    table.params.block_offset = part.params.block_offset
                    run.insert(table, at: 0)
                }
                pieces.append(PlanPiece(plan: DispatchPlan(pass: pass, dispatches: run, outputs: outputs,
                                                           workspace: workspace, problem: problem),
                                        firstBatch: 0, firstKVHead: 0, full: problem, flops: flops))
            }
        }
        return pieces
    }

    /// The same plan with only the dispatches `include` accepts.
    func keeping(_ include: (Dispatch) -> Bool) -> DispatchPlan {
        DispatchPlan(pass: pass, dispatches: dispatches.filter(include), outputs: outputs, workspace: workspace,
                     problem: problem)
    }

    /// The same plan with `dispatch` alone.
    func keeping(_ dispatch: Dispatch) -> DispatchPlan {
        DispatchPlan(pass: pass, dispatches: [dispatch], outputs: outputs, workspace: workspace, problem: problem)
    }
}

extension Dispatch {
    /// This dispatch cut along its grid's x axis into ranges of at most `maxFlops` of `blockWork`
    /// (at least one block each), each with `block_offset` at its first block, and the work of
    /// each; itself alone (with its `blockWork`, or `otherwise` without one) when it has no
    /// `blockWork` or fits.
    func blockRanges(maxFlops: Int, otherwise: Int) -> [(Dispatch, Int)] {
        let width = Int(threadgroupsPerGrid.width)
        guard let work = blockWork, work > maxFlops, width > 1 else { return [(self, blockWork ?? otherwise)] }
        let perBlock = work / width + (work % width == 0 ? 0 : 1)
        let step = max(1, maxFlops / perBlock)
        return stride(from: 0, to: width, by: step).map { first in
            let count = min(step, width - first)
            var part = self
            part.params.block_offset = params.block_offset + UInt32(first)
            part.threadgroupsPerGrid.width = UInt32(count)
            return (part, perBlock.multipliedReportingOverflow(by: count).overflow ? Int.max : perBlock * count)
        }
    }
}
