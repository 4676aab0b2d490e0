import MSLEngine
import XCTest

/// Threadgroup barriers and threadgroup memory.
final class BarrierTests: XCTestCase {
    func testBarrierMakesThreadgroupWritesVisible() {
        let threads = 256, groups = 4
        let out = HostBuffer<UInt32>(count: threads * groups, zero: 0)
        let r = dispatch("barrier_visibility", [out.binding], groups: (UInt32(groups), 1, 1),
                         threads: (UInt32(threads), 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        for g in 0..<groups {
            for t in 0..<threads {
                XCTAssertEqual(out[g * threads + t], UInt32((threads - 1 - t) * 7 + g), "group \(g) thread \(t)")
            }
        }
    }

    func testThreeDimensionalThreadgroupUsesLinearThreadIndex() {
        let out = HostBuffer<UInt32>(count: 4 * 2 * 3, zero: 0)
        let r = dispatch("barrier_visibility", [out.binding], threads: (4, 2, 3))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        XCTAssertEqual(out.values, (0..<24).map { UInt32((23 - $0) * 7) })
    }

    func testThreadgroupMemoryIsPrivateToEachThreadgroup() {
        let threads = 64, groups = 16
        let mismatches = HostBuffer<UInt32>(count: threads * groups, zero: 99)
        let r = dispatch("threadgroup_private", [mismatches.binding], groups: (UInt32(groups), 1, 1),
                         threads: (UInt32(threads), 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        XCTAssertEqual(mismatches.values, [UInt32](repeating: 0, count: threads * groups))
        XCTAssertGreaterThan(r.stats.workers, 1, "needs more than one worker to show privacy")
    }

    func testThreadReturningWhileOthersWaitIsReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("divergent_return", [out.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_BARRIER_DIVERGENCE, kernel: "divergent_return",
                      sites: [("barrier.metal", "return-barrier")])
        XCTAssertTrue(r.message.contains("thread 5 returned"), r.message)
    }

    func testBarriersAtDifferentSitesAreReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("divergent_barrier_sites", [out.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_BARRIER_DIVERGENCE, kernel: "divergent_barrier_sites",
                      sites: [("barrier.metal", "first-half-barrier"), ("barrier.metal", "second-half-barrier")])
    }

    /// The seed kernels' fault (a barrier inside `if (row out of range) { barrier; continue; }`)
    /// is caught on its own when some rows are out of range, and runs when none is.
    func testSeedStyleConditionalBarrierIsReported() {
        let out = HostBuffer<UInt32>(count: 64, zero: 0)
        let rows = HostBuffer<UInt32>([40])
        let r = dispatch("divergent_loop_barrier", [out.binding, rows.binding], threads: (64, 1, 1))
        assertFailure(r, MSL_ENGINE_BARRIER_DIVERGENCE, kernel: "divergent_loop_barrier",
                      sites: [("barrier.metal", "skip-barrier"), ("barrier.metal", "loop-end-barrier")])

        let allRows = HostBuffer<UInt32>([64])
        let ok = dispatch("divergent_loop_barrier", [out.binding, allRows.binding], threads: (64, 1, 1))
        XCTAssertEqual(ok.status, MSL_ENGINE_SUCCESS, ok.message)
        XCTAssertEqual(out.values, [UInt32](repeating: 1, count: 64))
    }

    func testEngineWorksAfterAFailedThreadgroup() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        for _ in 0..<3 {
            let bad = dispatch("divergent_return", [out.binding], groups: (8, 1, 1), threads: (32, 1, 1))
            XCTAssertEqual(bad.status, MSL_ENGINE_BARRIER_DIVERGENCE)
            XCTAssertTrue(bad.message.contains("threadgroup (0, 0, 0)"), "lowest failing threadgroup: \(bad.message)")
            let good = dispatch("barrier_visibility", [out.binding], threads: (32, 1, 1))
            XCTAssertEqual(good.status, MSL_ENGINE_SUCCESS, good.message)
            XCTAssertEqual(out.values, (0..<32).map { UInt32((31 - $0) * 7) })
        }
    }
}
