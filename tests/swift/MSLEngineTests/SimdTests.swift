import MSLEngine
import XCTest

/// SIMD-group functions: lane rules, reductions, partial SIMD-groups, divergence.
final class SimdTests: XCTestCase {
    func testSimdFunctionsFollowLaneRules() {
        let threads = 64, results = 14
        let out = HostBuffer<UInt32>(count: threads * results, zero: 0)
        let r = dispatch("simd_functions", [out.binding], threads: (UInt32(threads), 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        func v(_ t: Int) -> UInt32 { UInt32(3 * t + 1) }
        for t in 0..<threads {
            let lane = t % 32, base = t - lane
            let got = Array(out.values[t * results..<(t + 1) * results])
            let group = (0..<32).map { v(base + $0) }
            XCTAssertEqual(got[0], v(base + (lane + 3) % 32), "simd_shuffle, thread \(t)")
            XCTAssertEqual(got[1], lane + 5 <= 31 ? v(t + 5) : v(t), "simd_shuffle_down keeps the upper lanes, thread \(t)")
            XCTAssertEqual(got[2], lane >= 3 ? v(t - 3) : v(t), "simd_shuffle_up keeps the lower lanes, thread \(t)")
            XCTAssertEqual(got[3], v(base + (lane ^ 6)), "simd_shuffle_xor, thread \(t)")
            XCTAssertEqual(got[4], v(base + 9), "simd_broadcast, thread \(t)")
            XCTAssertEqual(got[5], v(base), "simd_broadcast_first, thread \(t)")
            XCTAssertEqual(got[6], group.reduce(0, +), "simd_sum, thread \(t)")
            XCTAssertEqual(got[7], v(base + 31), "simd_max, thread \(t)")
            XCTAssertEqual(got[8], v(base), "simd_min, thread \(t)")
            XCTAssertEqual(got[9], group[0...lane].reduce(0, +), "simd_prefix_inclusive_sum, thread \(t)")
            XCTAssertEqual(got[10], group[0..<lane].reduce(0, +), "simd_prefix_exclusive_sum, thread \(t)")
            let floatSum = (0..<32).reduce(Float(0)) { $0 + Float(base + $1) * 0.5 }
            XCTAssertEqual(Float(bitPattern: got[11]), floatSum, "float simd_sum, thread \(t)")
            XCTAssertEqual(got[12], lane == 0 ? 1 : 0, "simd_is_first, thread \(t)")
            let pair = lane + 1 <= 31 ? v(t + 1) + UInt32(lane + 1) * 1000 : v(t) + UInt32(lane) * 1000
            XCTAssertEqual(got[13], pair, "vector simd_shuffle_down, thread \(t)")
        }
    }

    func testPartialLastSimdGroup() {
        let threads = 40
        let out = HostBuffer<UInt32>(count: threads * 7, zero: 0)
        let r = dispatch("simd_partial", [out.binding], threads: (UInt32(threads), 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        for t in 0..<threads {
            let lane = t % 32, base = t - lane, size = t < 32 ? 32 : 8
            let group = (0..<size).map { UInt32(base + $0 + 1) }
            let got = Array(out.values[t * 7..<(t + 1) * 7])
            XCTAssertEqual(got[0], group.reduce(0, +), "simd_sum over the active lanes, thread \(t)")
            XCTAssertEqual(got[1], group.last, "simd_max, thread \(t)")
            XCTAssertEqual(got[2], group.first, "simd_broadcast_first, thread \(t)")
            XCTAssertEqual(got[3], lane >= 1 ? UInt32(t) : UInt32(t + 1), "simd_shuffle_up, thread \(t)")
            XCTAssertEqual(got[4], UInt32(lane))
            XCTAssertEqual(got[5], UInt32(t / 32))
            XCTAssertEqual(got[6], 2)
        }
    }

    func testShuffleDownIntoMissingLanesOfAPartialGroupIsReported() {
        let out = HostBuffer<UInt32>(count: 40, zero: 0)
        let r = dispatch("simd_partial_shuffle_down", [out.binding], threads: (40, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "simd_partial_shuffle_down",
                      sites: [("simd.metal", "partial-shuffle-down")])
        XCTAssertTrue(r.message.contains("lane 4 reads lane 8, which is inactive"), r.message)
    }

    func testReturnedLanesAreInactive() {
        let out = HostBuffer<UInt32>(count: 64, zero: 7)
        let r = dispatch("simd_after_return", [out.binding], threads: (64, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        for t in 0..<64 {
            let lane = t % 32, base = t - lane
            let expected = lane < 16 ? UInt32((base..<base + 16).reduce(0, +)) : 0
            XCTAssertEqual(out[t], expected, "thread \(t)")
        }
    }

    func testSimdFunctionReachedByHalfTheLanesIsReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("simd_half_lanes", [out.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "simd_half_lanes",
                      sites: [("simd.metal", "half-lanes-sum"), ("simd.metal", "half-lanes-barrier")])
        XCTAssertTrue(r.message.contains("lanes 0-15 wait at simd_sum"), r.message)
    }

    func testDifferentSimdFunctionsAreReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("simd_different_functions", [out.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "simd_different_functions",
                      sites: [("simd.metal", "different-sum"), ("simd.metal", "different-max")])
    }

    func testShuffleFromLaneOutsideTheSimdGroupIsReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("simd_invalid_lane", [out.binding], threads: (32, 1, 1))
        assertFailure(r, MSL_ENGINE_SIMDGROUP_DIVERGENCE, kernel: "simd_invalid_lane",
                      sites: [("simd.metal", "invalid-lane")])
        XCTAssertTrue(r.message.contains("asks for lane 40"), r.message)
    }
}
