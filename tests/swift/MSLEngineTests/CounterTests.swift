import MSLEngine
import XCTest

/// The dispatch counters of msl_engine_dispatch_stats: SIMD-group matrix products and threadgroup
/// barriers, counted once per collective and once per threadgroup barrier, summed over workers.
final class CounterTests: XCTestCase {
    override func tearDown() {
        msl_engine_set_worker_count(0)
    }

    /// counted_matrix_work: rounds + 1 products per SIMD-group, rounds + 1 barriers per threadgroup.
    func testMatrixProductsAndBarriersAreCountedOncePerCollective() {
        let rounds: UInt32 = 5
        let groups: (UInt32, UInt32, UInt32) = (3, 2, 1)
        let threads: (UInt32, UInt32, UInt32) = (64, 2, 1) // 4 SIMD-groups of 32
        let threadgroups = Int(groups.0 * groups.1 * groups.2), perGroup = Int(threads.0 * threads.1 * threads.2)
        let roundsBuffer = HostBuffer<UInt32>([rounds])
        for workers: UInt32 in [1, 2, 4] {
            msl_engine_set_worker_count(workers)
            let out = HostBuffer<Float>(count: threadgroups * perGroup, zero: -1)
            let r = withExtendedLifetime(roundsBuffer) {
                dispatch("counted_matrix_work", [out.binding, roundsBuffer.binding], groups: groups, threads: threads)
            }
            XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
            XCTAssertEqual(r.stats.simdgroup_multiply_accumulates, UInt64(threadgroups * 4) * UInt64(rounds + 1),
                           "\(workers) workers")
            XCTAssertEqual(r.stats.threadgroup_barriers, UInt64(threadgroups) * UInt64(rounds + 1),
                           "\(workers) workers")
            for simdgroup in 0..<(threadgroups * perGroup / 32) {
                let sum = out.values[simdgroup * 32..<(simdgroup + 1) * 32].reduce(0, +)
                XCTAssertEqual(sum, Float(8 * rounds), "SIMD-group \(simdgroup)")
            }
        }
    }

    /// Other SIMD-group collectives (loads, stores, shuffles) are not products; a kernel without
    /// barriers counts none; a dispatch without products counts none.
    func testOnlyMatrixProductsAndBarrierReleasesCount() {
        let a = HostBuffer<Float>(count: 64, zero: 1), d = HostBuffer<Float>(count: 64, zero: 0)
        let elements = HostBuffer<Float>(count: 64, zero: 0)
        let product = dispatch("matrix_multiply_float", [a.binding, a.binding, a.binding, d.binding, elements.binding],
                               threads: (32, 1, 1))
        XCTAssertEqual(product.status, MSL_ENGINE_SUCCESS, product.message)
        XCTAssertEqual(product.stats.simdgroup_multiply_accumulates, 1)
        XCTAssertEqual(product.stats.threadgroup_barriers, 0)

        let out = HostBuffer<UInt32>(count: 256, zero: 0), rounds = HostBuffer<UInt32>([7])
        let storm = withExtendedLifetime(rounds) {
            dispatch("barrier_storm", [out.binding, rounds.binding], groups: (3, 1, 1), threads: (256, 1, 1))
        }
        XCTAssertEqual(storm.status, MSL_ENGINE_SUCCESS, storm.message)
        XCTAssertEqual(storm.stats.simdgroup_multiply_accumulates, 0)
        XCTAssertEqual(storm.stats.threadgroup_barriers, 3 * 7)
    }

    /// Device reads are counted per buffer only when the calling thread asked for it
    /// (msl_engine_count_device_reads); otherwise the counts stay zero. Matrix products and
    /// barriers are counted either way (above).
    func testDeviceReadsAreCountedOnlyWhenAsked() {
        defer { msl_engine_count_device_reads(0) }
        let n = 96
        let input = HostBuffer<Float>((0..<n).map(Float.init))
        for (counting, workers): (Int32, UInt32) in [(1, 1), (1, 2), (0, 2), (1, 2)] {
            msl_engine_set_worker_count(workers)
            msl_engine_count_device_reads(counting)
            let out = HostBuffer<Float>(count: n, zero: -1)
            let r = withExtendedLifetime(input) {
                dispatch("counted_reads", [input.binding, out.binding], groups: (3, 1, 1), threads: (32, 1, 1))
            }
            XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
            XCTAssertEqual(out.values, input.values)
            XCTAssertEqual(r.stats.device_bytes_read.0, counting == 1 ? UInt64(4 * n) : 0, "counting \(counting)")
            XCTAssertEqual(r.stats.device_bytes_read.1, 0, "out is only written")
        }
    }

    /// The counters belong to the calling thread's last dispatch: a failed lookup resets them.
    func testCountersDescribeOnlyTheLastDispatch() {
        let out = HostBuffer<Float>(count: 32, zero: 0), rounds = HostBuffer<UInt32>([2])
        let r = withExtendedLifetime(rounds) {
            dispatch("counted_matrix_work", [out.binding, rounds.binding], threads: (32, 1, 1))
        }
        XCTAssertEqual(r.stats.simdgroup_multiply_accumulates, 3)
        let unknown = dispatch("no_such_kernel", [], threads: (32, 1, 1))
        XCTAssertEqual(unknown.status, MSL_ENGINE_UNKNOWN_KERNEL)
        XCTAssertEqual(unknown.stats.simdgroup_multiply_accumulates, 0)
        XCTAssertEqual(unknown.stats.threadgroup_barriers, 0)
    }
}
