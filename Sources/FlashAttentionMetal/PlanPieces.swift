/// One part of a split plan, run on its own (by Metal in its own command buffer): the same pass on
/// the problem restricted to a range of batch entries, or, inside one batch entry, to a range of KV
/// heads with their query heads (whole GQA groups). Each buffer of the piece is the part of the full
/// buffer that starts at `byteOffset(of:)`, so the kernels see an ordinary, smaller problem.
///
/// Splitting is exact: a threadgroup's work depends only on its own (batch, head, block) and on
/// the sizes, and a GQA group never straddles two pieces (dK/dV sum over the group in order), so
/// the pieces compute bit for bit what the whole plan computes.
struct PlanPiece {
    /// The pass on the slice.
    let plan: DispatchPlan
    /// Where the slice starts in the full problem.
    let firstBatch: UInt32
    let firstKVHead: UInt32
    /// The problem the offsets refer to.
    let full: Problem

    init(plan: DispatchPlan, firstBatch: UInt32, firstKVHead: UInt32, full: Problem) {
        self.plan = plan
        self.firstBatch = firstBatch
        self.firstKVHead = firstKVHead
        self.full = full
    }

    /// All of `plan` as one piece.
    init(whole plan: DispatchPlan) {
        self.init(plan: plan, firstBatch: 0, firstKVHead: 0, full: plan.problem)
    }

    /// Bytes from the start of the full buffer of `role` to the start of this piece's part: the
    /// start of a (batch entry, head) block, so a multiple of the element size and of a row, and
    /// a kernel's alignment assumptions about row starts hold in every piece.
    func byteOffset(of role: BufferRole) -> Int {
        role.elementOffset(batch: firstBatch, kvHead: firstKVHead, in: full) * role.elementSize(for: full)
    }
}

extension DispatchPlan {
    /// Floating-point operations of one unit of splitting (one batch entry, one KV head and its
    /// query heads), saturating at `Int.max`.
    var flopsPerUnit: Int {
        let p = problem
        var flops = pass.flopsPerScoreElement
        for factor in [Int(p.groupSize), Int(p.seqlenQ), Int(p.seqlenK), Int(p.bucket.head_dim_max)] {
            let (product, overflow) = flops.multipliedReportingOverflow(by: factor)
            if overflow { return Int.max }
            flops = product
        }
        return flops
    }

    /// The plan cut into pieces of at most `maxFlops` each (one unit when a unit alone is larger), in
    /// order of batch entry, then KV head. Whole batch entries are grouped while a piece holds at
    /// least one; otherwise each batch entry is cut into ranges of KV heads. A plan within the
    /// budget is one piece: itself.
    func pieces(maxFlops: Int) -> [PlanPiece] {
        let p = problem
        let unitsPerPiece = UInt64(max(1, maxFlops / flopsPerUnit))
        let kvHeads = UInt64(p.numKVHeads)
        if unitsPerPiece >= UInt64(p.batch) * kvHeads {
            return [PlanPiece(whole: self)]
        }
        var pieces: [PlanPiece] = []
        func add(batches: Range<UInt32>, kvHeads: Range<UInt32>) {
            let sliced = DispatchPlan.make(pass, p.slice(batches: batches, kvHeads: kvHeads))
            pieces.append(PlanPiece(plan: sliced.keeping { !$0.wholeProblem }, firstBatch: batches.lowerBound,
                                    firstKVHead: kvHeads.lowerBound, full: p))
        }
        if unitsPerPiece >= kvHeads {
            let step = UInt32(unitsPerPiece / kvHeads)
            for b in stride(from: UInt32(0), to: p.batch, by: Int(step)) {
                add(batches: b..<b + min(step, p.batch - b), kvHeads: 0..<p.numKVHeads)
            }
        } else {
            let step = UInt32(unitsPerPiece)
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

    /// The same plan with only the dispatches `include` accepts.
    func keeping(_ include: (Dispatch) -> Bool) -> DispatchPlan {
        DispatchPlan(pass: pass, dispatches: dispatches.filter(include), outputs: outputs, workspace: workspace,
                     problem: problem)
    }
}
