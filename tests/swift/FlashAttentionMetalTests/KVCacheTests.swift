import XCTest
@testable import FlashAttentionMetal

/// The Swift KV-cache forward: a paged cache whose blocks are shuffled gives, bit for bit, the
/// forward over the same keys and values stored contiguously; a wrong block table is refused.
final class KVCacheTests: XCTestCase {
    func testPagedCacheEqualsContiguousForward() throws {
        let attention = try FlashAttention(backend: .cpu)
        // 65 rows: the dense kernels on both sides (up to 64 rows the plain call may take the
        // decode kernel, which sums in another order than the cache's split kernel).
        let (heads, kvHeads, seqlenQ, seqlenK, dim, page) = (4, 2, 65, 77, 32, 8)
        let shape = AttentionShape(batch: 1, numHeads: heads, numKVHeads: kvHeads, seqlenQ: seqlenQ, seqlenK: seqlenK,
                                   headDim: dim)
        func values(_ count: Int, _ seed: Int) -> [Float] { (0..<count).map { Float(sin(Double($0 * 7 + seed))) } }
        let q = values(heads * seqlenQ * dim, 1)
        let k = values(kvHeads * seqlenK * dim, 2), v = values(kvHeads * seqlenK * dim, 3)
        let table: [Int32] = [3, 0, 5, 1, 4, 10, 7, 9, 6, 8]  // 10 blocks of 8 rows hold 77 keys; block 2 is unused
        var kPaged = [Float](repeating: .nan, count: 11 * kvHeads * page * dim), vPaged = kPaged
        for h in 0..<kvHeads {
            for t in 0..<seqlenK {
                let to = ((Int(table[t / page]) * kvHeads + h) * page + t % page) * dim
                let from = (h * seqlenK + t) * dim
                kPaged.replaceSubrange(to..<to + dim, with: k[from..<from + dim])
                vPaged.replaceSubrange(to..<to + dim, with: v[from..<from + dim])
            }
        }
        let expected = try attention.forward(q: q, k: k, v: v, shape: shape, causal: true)
        var out = [Float](repeating: 0, count: heads * seqlenQ * dim), lse = [Float](repeating: 0, count: heads * seqlenQ)
        func run(_ table: [Int32]) throws {
            try q.withUnsafeBufferPointer { q in
                try kPaged.withUnsafeBytes { kb in
                    try vPaged.withUnsafeBytes { vb in
                        try table.withUnsafeBufferPointer { t in
                            try out.withUnsafeMutableBufferPointer { o in
                                try lse.withUnsafeMutableBufferPointer { l in
                                    let cache = AttentionKVCache(k: kb, v: vb, rows: page, blockTable: t, maxBlocks: 10,
                                                                 numBlocks: 11)
                                    try attention.forward(q: q, cache: cache, out: o, lse: l, shape: shape, causal: true)
                                }
                            }
                        }
                    }
                }
            }
        }
        try run(table)
        XCTAssertEqual(out, expected.out)
        XCTAssertEqual(lse, expected.lse)
        XCTAssertThrowsError(try run([3, 0, 11, 1, 4, 10, 7, 9, 6, 8])) { error in
            XCTAssertTrue("\(error)".contains("kv_block_table[0][2] (11) must lie in [0, kv_num_blocks = 11)"), "\(error)")
        }
    }
}
