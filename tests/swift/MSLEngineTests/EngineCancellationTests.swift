import MSLEngine
import MSLEngineTestKernels
import XCTest

/// msl_engine_dispatch_cancellable: an advanced epoch stops a dispatch, between
/// threadgroups and inside one.
final class EngineCancellationTests: XCTestCase {
    private func dispatchCancellable(_ cancellation: UnsafeMutablePointer<msl_engine_cancellation>,
                                     startEpoch: UInt64, out: HostBuffer<UInt32>, groups: UInt32)
        -> DispatchResult {
        msl_engine_test_kernels_register()
        var message = [CChar](repeating: 0, count: 512)
        var buffers = [out.binding]
        let status = msl_engine_dispatch_cancellable(
            "barrier_visibility", &buffers, 1, msl_engine_size(width: groups, height: 1, depth: 1),
            msl_engine_size(width: 32, height: 1, depth: 1), cancellation, startEpoch, &message, message.count)
        var stats = msl_engine_dispatch_stats()
        msl_engine_last_dispatch_stats(&stats)
        return DispatchResult(status: status, message: String(cString: message), stats: stats)
    }

    func testCancelBeforeTheDispatchRunsNoThreadgroup() {
        var cancellation = msl_engine_cancellation(epoch: 0)
        let start = msl_engine_cancellation_epoch(&cancellation)
        msl_engine_cancel(&cancellation)
        XCTAssertEqual(msl_engine_cancellation_epoch(&cancellation), start + 1)
        let out = HostBuffer<UInt32>(count: 32 * 64, zero: 0)
        let r = dispatchCancellable(&cancellation, startEpoch: start, out: out, groups: 64)
        XCTAssertEqual(r.status, MSL_ENGINE_CANCELLED)
        XCTAssertEqual(r.message, "kernel 'barrier_visibility' cancelled after 0 of 64 threadgroups")
        XCTAssertEqual(r.stats.threadgroups, 0)
        XCTAssertEqual(out.values, [UInt32](repeating: 0, count: out.count))
    }

    /// A cancel before the dispatch's start epoch was read does not touch it.
    func testCancelBeforeTheStartEpochLeavesTheDispatchAlone() {
        var cancellation = msl_engine_cancellation(epoch: 0)
        msl_engine_cancel(&cancellation)
        let out = HostBuffer<UInt32>(count: 32 * 64, zero: 0)
        let r = dispatchCancellable(&cancellation, startEpoch: msl_engine_cancellation_epoch(&cancellation),
                                    out: out, groups: 64)
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        XCTAssertEqual(r.stats.threadgroups, 64)
        XCTAssertEqual(out[0], 31 * 7)
    }
}
