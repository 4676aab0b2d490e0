import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The KV cache's read-write role: a cache problem's forward plan binds k and v (and a quantized
/// cache's scales and biases) as read-write roles, once per dispatch, never as outputs (no fresh
/// buffer, no copy back); the exported plan says FA_BUFFER_READ_WRITE; the overlap check keeps
/// every other buffer off a cache but lets a cache's K and V share memory; `allocate` gives page
/// multiples.
final class CacheRoleTests: XCTestCase {
    /// A paged float16 cache: 3 blocks of 16 rows, 2 KV heads, head_dim 64 (12 KiB per tensor, not a
    /// page multiple); 4 query heads, 40 keys; `bits` 8 quantizes it (group 64).
    static func cacheProblem(bits: UInt32 = 0, seqlenQ: UInt32 = 3) throws -> Problem {
        var d = fa_problem()
        d.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (d.batch, d.num_heads, d.num_kv_heads, d.seqlen_q, d.seqlen_k, d.head_dim) = (1, 4, 2, seqlenQ, 40, 64)
        d.softmax_scale = 0.125
        d.kv_cache_rows = 16
        // Presence only: validation never reads through these.
        d.kv_block_table = UnsafePointer(bitPattern: 1)
        (d.kv_max_blocks, d.kv_num_blocks) = (3, 3)
        if bits != 0 {
            let marker = UnsafeRawPointer(bitPattern: 1)
            (d.kv_bits, d.kv_group_size) = (bits, 64)
            (d.k_scales, d.k_biases, d.v_scales, d.v_biases) = (marker, marker, marker, marker)
        }
        return try Problem.validate(d)
    }

    func testCachesAreReadWriteRolesBoundOncePerDispatch() throws {
        for (bits, roles) in [(UInt32(0), [BufferRole.k, .v]), (8, [.k, .v, .kScales, .kBiases, .vScales, .vBiases])] {
            // 3 rows: the split kernel and its combine; 70 rows: the dense kernel.
            for seqlenQ in [UInt32(3), 70] {
                let plan = DispatchPlan.forward(try CacheRoleTests.cacheProblem(bits: bits, seqlenQ: seqlenQ))
                XCTAssertEqual(plan.caches, roles)
                XCTAssertTrue(Set(roles).isDisjoint(with: plan.outputs + plan.workspace))
                XCTAssertEqual(plan.dispatches.count, seqlenQ == 3 ? 2 : 1)
                let reading = plan.dispatches[0].bindings.map(\.role)
                for role in roles {
                    XCTAssertEqual(reading.filter { $0 == role }.count, 1, "\(role) in \(plan.dispatches[0].kernelName)")
                }
                let exported = try ExportedPlan(plan, maxFlopsPerPiece: 0)
                XCTAssertEqual(exported.buffers.filter { $0.usage == FA_BUFFER_READ_WRITE }.map(\.role), roles)
                XCTAssertEqual(exported.buffers.filter { $0.usage == FA_BUFFER_OUTPUT }.map(\.role), [.out, .lse])
            }
        }
        // Plain k and v are read-only inputs.
        let plain = DispatchPlan.forward(try Problem.validate(
            AttentionShape(batch: 1, numHeads: 4, numKVHeads: 2, seqlenQ: 3, seqlenK: 40, headDim: 64),
            causal: false, softmaxScale: nil))
        XCTAssertEqual(plain.caches, [])
    }

    func testOverlapCheckExemptsACacheFromItselfOnly() throws {
        let p = try CacheRoleTests.cacheProblem()
        let plan = DispatchPlan.forward(p)
        let memory = try AttentionKVCache.allocate(byteCount: 1 << 17)
        defer { AttentionKVCache.deallocate(memory) }
        let base = memory.baseAddress!
        let kBytes = BufferRole.k.byteCount(for: p)
        func buffers(k: Int, v: Int, q: Int, out: Int) -> HostBuffers {
            var b = HostBuffers()
            b.bindInput(.q, base + q, for: p)
            b.bindInput(.k, base + k, for: p)
            b.bindInput(.v, base + v, for: p)
            b.bindInput(.blockTable, base + (1 << 16), for: p)
            b.bindOutput(.out, base + out, for: p)
            b.bindOutput(.lse, base + (1 << 16) + 4096, for: p)
            return b
        }
        let apart = (k: 0, v: kBytes, q: 2 * kBytes, out: 2 * kBytes + 8192)
        XCTAssertNoThrow(try buffers(k: apart.k, v: apart.v, q: apart.q, out: apart.out).checkOutputsDisjoint(plan))
        // K and V interleaved in one allocation (row by row, 128 bytes apart): allowed.
        XCTAssertNoThrow(try buffers(k: 0, v: 128, q: apart.q, out: apart.out).checkOutputsDisjoint(plan))
        func refused(_ b: HostBuffers, _ message: String, line: UInt = #line) {
            XCTAssertThrowsError(try b.checkOutputsDisjoint(plan), line: line) {
                XCTAssertEqual("\($0)", "\(FlashAttentionError.invalidArgument(message))", line: line)
            }
        }
        refused(buffers(k: 0, v: apart.v, q: kBytes - 64, out: apart.out),
                "k must not overlap q (a KV cache, read and written in place)")
        refused(buffers(k: 0, v: apart.v, q: apart.q, out: kBytes + 64),
                "out must not overlap v (outputs are written while inputs are read)")
    }

    func testAllocateGivesWholePages() throws {
        for count in [0, 1, AttentionKVCache.pageBytes, AttentionKVCache.pageBytes + 1] {
            let memory = try AttentionKVCache.allocate(byteCount: count)
            defer { AttentionKVCache.deallocate(memory) }
            XCTAssertEqual(Int(bitPattern: memory.baseAddress) % AttentionKVCache.pageBytes, 0)
            XCTAssertEqual(memory.count % AttentionKVCache.pageBytes, 0)
            XCTAssertGreaterThanOrEqual(memory.count, max(count, 1))
            XCTAssertTrue(memory.allSatisfy { $0 == 0 }, "an anonymous mapping is zero-filled")
            memory.storeBytes(of: 7, toByteOffset: memory.count - 1, as: UInt8.self)
        }
        XCTAssertGreaterThanOrEqual(AttentionKVCache.pageBytes, 1 << 14)
    }
}
