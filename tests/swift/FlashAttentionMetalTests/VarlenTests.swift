import XCTest

@testable import FlashAttentionMetal

/// The Swift API of variable-length batches: each sequence equals the dense call on it alone (the
/// same kernels, the same bits), empty sequences, and the checks of the tables.
final class VarlenTests: XCTestCase {
    // Over 8 query rows each (a dense call of at most 8 takes the split-KV forward).
    let batch = VarlenBatch(cuSeqlensQ: [0, 9, 9, 21], cuSeqlensK: [0, 10, 13, 25])
    let (heads, kvHeads, dim) = (2, 1, 16)

    private func values(_ count: Int, _ seed: Int) -> [Float] {
        (0..<count).map { Float(sin(Double($0 * 7 + seed))) }
    }

    /// Rows `rows` of a packed `[total][h][dim]` array as a contiguous `[h][rows][dim]` one.
    private func alone(_ packed: [Float], _ rows: Range<Int>, _ h: Int) -> [Float] {
        var result: [Float] = []
        for head in 0..<h {
            for row in rows {
                result += packed[(row * h + head) * dim ..< (row * h + head + 1) * dim]
            }
        }
        return result
    }

    func testEachSequenceEqualsTheDenseCall() throws {
        let attention = try FlashAttention(backend: .cpu)
        let (tq, tk) = (21, 25)
        let q = values(tq * heads * dim, 1), k = values(tk * kvHeads * dim, 2), v = values(tk * kvHeads * dim, 3)
        var out = [Float](repeating: .nan, count: tq * heads * dim)
        var lse = [Float](repeating: .nan, count: heads * tq)
        try q.withUnsafeBufferPointer { q in
            try k.withUnsafeBufferPointer { k in
                try v.withUnsafeBufferPointer { v in
                    try out.withUnsafeMutableBufferPointer { out in
                        try lse.withUnsafeMutableBufferPointer { lse in
                            try attention.forwardVarlen(q: q, k: k, v: v, out: out, lse: lse, batch: batch,
                                                        numHeads: heads, numKVHeads: kvHeads, headDim: dim,
                                                        causal: true)
                        }
                    }
                }
            }
        }
        for b in [0, 2] {
            let rows = Int(batch.cuSeqlensQ[b])..<Int(batch.cuSeqlensQ[b + 1])
            let keys = Int(batch.cuSeqlensK[b])..<Int(batch.cuSeqlensK[b + 1])
            let shape = AttentionShape(batch: 1, numHeads: heads, numKVHeads: kvHeads, seqlenQ: rows.count,
                                       seqlenK: keys.count, headDim: dim)
            let dense = try attention.forward(q: alone(q, rows, heads), k: alone(k, keys, kvHeads),
                                              v: alone(v, keys, kvHeads), shape: shape, causal: true)
            XCTAssertEqual(alone(out, rows, heads), dense.out, "sequence \(b)")
            for h in 0..<heads {
                XCTAssertEqual(Array(lse[h * tq + rows.lowerBound ..< h * tq + rows.upperBound]),
                               Array(dense.lse[h * rows.count ..< (h + 1) * rows.count]), "sequence \(b)")
            }
        }
    }

    func testTablesAreChecked() throws {
        let attention = try FlashAttention(backend: .cpu)
        let q = [Float](repeating: 0, count: 4 * dim)
        var out = q
        var lse = [Float](repeating: 0, count: 4)
        let bad = VarlenBatch(cuSeqlensQ: [0, 3, 2, 4], cuSeqlensK: [0, 1, 2, 4])
        XCTAssertThrowsError(try q.withUnsafeBufferPointer { q in
            try out.withUnsafeMutableBufferPointer { out in
                try lse.withUnsafeMutableBufferPointer { lse in
                    try attention.forwardVarlen(q: q, k: q, v: q, out: out, lse: lse, batch: bad, numHeads: 1,
                                                headDim: dim)
                }
            }
        }) { error in
            XCTAssertEqual((error as? FlashAttentionError)?.message,
                           "cuSeqlensQ must be non-decreasing: cuSeqlensQ[1] = 3 > cuSeqlensQ[2] = 2")
        }
    }
}
