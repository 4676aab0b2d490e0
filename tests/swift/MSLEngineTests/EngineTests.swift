import Foundation
import MSLEngine
import MSLEngineTestKernels
import XCTest

/// Dispatch validation, limits, determinism, worker threads and fiber switch throughput.
final class EngineTests: XCTestCase {
    override func tearDown() {
        msl_engine_set_worker_count(0)
        super.tearDown()
    }

    func testUnknownKernelIsReported() {
        let r = dispatch("no_such_kernel", [], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_UNKNOWN_KERNEL)
        XCTAssertTrue(r.message.contains("'no_such_kernel'"), r.message)
        XCTAssertEqual(msl_engine_has_kernel("no_such_kernel"), 0)
        XCTAssertEqual(msl_engine_has_kernel("barrier_visibility"), 1)
        XCTAssertEqual(msl_engine_has_kernel("flash_attention_forward_f16_d64"), 1)
    }

    func testMoreThan1024ThreadsIsReported() {
        let out = HostBuffer<UInt32>(count: 2048, zero: 0)
        let r = dispatch("barrier_visibility", [out.binding], threads: (1025, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_INVALID_DISPATCH)
        XCTAssertTrue(r.message.contains("'barrier_visibility' (\(definitionSite("barrier_visibility", in: "barrier.metal")))"),
                      r.message)
        XCTAssertTrue(r.message.contains("1025 threads per threadgroup"), r.message)
        let wide = dispatch("barrier_visibility", [out.binding], threads: (32, 8, 5))
        XCTAssertEqual(wide.status, MSL_ENGINE_INVALID_DISPATCH, "32 x 8 x 5 = 1280 threads")
        let limit = dispatch("barrier_visibility", [out.binding], threads: (1024, 1, 1))
        XCTAssertEqual(limit.status, MSL_ENGINE_SUCCESS, limit.message)
    }

    func testZeroSizesAreReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let noThreads = dispatch("barrier_visibility", [out.binding], threads: (0, 1, 1))
        XCTAssertEqual(noThreads.status, MSL_ENGINE_INVALID_DISPATCH)
        XCTAssertTrue(noThreads.message.contains("'barrier_visibility'"), noThreads.message)
        let noGroups = dispatch("barrier_visibility", [out.binding], groups: (1, 0, 1), threads: (32, 1, 1))
        XCTAssertEqual(noGroups.status, MSL_ENGINE_INVALID_DISPATCH)
        XCTAssertTrue(noGroups.message.contains("zero size"), noGroups.message)
    }

    func testMissingBuffersAreReported() {
        let out = HostBuffer<UInt32>(count: 32, zero: 0)
        let r = dispatch("barrier_storm", [out.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_INVALID_DISPATCH)
        XCTAssertTrue(r.message.contains("'barrier_storm' (\(definitionSite("barrier_storm", in: "barrier.metal")))"), r.message)
        XCTAssertTrue(r.message.contains("reads 2 buffers but the dispatch binds 1"), r.message)
        let null = msl_engine_buffer(contents: nil, length: 0)
        let nullBuffer = dispatch("barrier_storm", [out.binding, null], threads: (32, 1, 1))
        XCTAssertEqual(nullBuffer.status, MSL_ENGINE_INVALID_DISPATCH)
        XCTAssertTrue(nullBuffer.message.contains("buffer 1 is null"), nullBuffer.message)
    }

    func testThreadgroupMemoryLimitIsReported() {
        let out = HostBuffer<Float>(count: 32, zero: 0)
        let r = dispatch("oversized_threadgroup_memory", [out.binding], threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_THREADGROUP_MEMORY_EXCEEDED)
        let site = definitionSite("oversized_threadgroup_memory", in: "limits.metal")
        XCTAssertTrue(r.message.contains("'oversized_threadgroup_memory' (\(site))"), r.message)
        XCTAssertTrue(r.message.contains("32772 bytes"), r.message)
    }

    /// The attention kernels' table is registered without any call (no static initialisers): every
    /// kernel of every dtype and head-dim bucket declares non-empty threadgroup storage within
    /// Apple's 32 KiB; the combine and D pre-pass kernels declare none. float32 has no 512 and 576
    /// buckets (its tiles would not fit), and the decode kernel no instance above 256
    /// (FA_DECODE_MAX_HEAD_DIM: those shapes take the tiled split kernel).
    func testAttentionKernelsAreRegisteredWithinThreadgroupMemory() {
        let buffers = ["flash_attention_forward": 9, "flash_attention_forward_split": 11,
                       "flash_attention_forward_decode": 11,
                       "flash_attention_backward_lse_residual": 12, "flash_attention_backward_dq": 13,
                       "flash_attention_backward_dkv": 14]
        var info = msl_engine_kernel_info()
        for dtype in ["f16", "bf16", "f32"] {
            for dim in [32, 64, 96, 128, 192, 256, 512, 576] {
                for (kernel, count) in buffers {
                    let name = "\(kernel)_\(dtype)_d\(dim)"
                    if dtype == "f32" && dim > 256 || kernel == "flash_attention_forward_decode" && dim > 256 {
                        XCTAssertEqual(msl_engine_describe_kernel(name, &info), 0, name)
                        continue
                    }
                    XCTAssertEqual(msl_engine_describe_kernel(name, &info), 1, name)
                    XCTAssertEqual(info.buffer_count, UInt32(count), name)
                    XCTAssertTrue((1...32768).contains(info.threadgroup_memory_length),
                                  "\(name): \(info.threadgroup_memory_length) bytes")
                }
            }
            // The delta pre-pass stages 64 bytes of 128 rows of dout and out (rows padded by 16 bytes).
            let deltaBytes = 2 * 128 * (64 + 8 * (dtype == "f32" ? 4 : 2))
            for (kernel, count, bytes) in [("flash_attention_backward_delta", 12, deltaBytes),
                                           ("flash_attention_forward_combine", 11, 0)] {
                let name = "\(kernel)_\(dtype)"
                XCTAssertEqual(msl_engine_describe_kernel(name, &info), 1, name)
                XCTAssertEqual(info.buffer_count, UInt32(count), name)
                XCTAssertEqual(info.threadgroup_memory_length, bytes, name)
            }
        }
        XCTAssertEqual(msl_engine_describe_kernel("flash_attention_backward_dsinks", &info), 1)
        XCTAssertEqual(info.buffer_count, 13)
        XCTAssertEqual(info.threadgroup_memory_length, 128 * 4)
        XCTAssertEqual(msl_engine_describe_kernel("no_such_kernel", &info), 0)
    }

    /// Every test kernel's entry names the line where the kernel is defined.
    func testTestKernelEntriesNameTheirDefinitions() {
        msl_engine_test_kernels_register()
        for file in ["barrier.metal", "bfloat.metal", "counters.metal", "simd.metal", "matrix.metal", "limits.metal",
                     "planted_out_of_bounds.metal", "planted_undefined_behaviour.metal", "function_constants.metal", "tensor_ops.metal"] {
            let kernels = kernelSourceLines(file).compactMap { line -> String? in
                guard line.hasPrefix("kernel void ") else { return nil }
                return String(line.dropFirst("kernel void ".count).prefix { $0 != "(" })
            }
            XCTAssertFalse(kernels.isEmpty, file)
            for kernel in kernels {
                var info = msl_engine_kernel_info()
                XCTAssertEqual(msl_engine_describe_kernel(kernel, &info), 1, kernel)
                XCTAssertEqual("\(String(cString: info.file)):\(info.line)", definitionSite(kernel, in: file))
            }
        }
    }

    func testResultsAreDeterministicAcrossRunsAndWorkerCounts() {
        let groups = 64, threads = 96
        let input = HostBuffer((0..<groups * threads).map { Float(sin(Double($0) * 0.37)) * 3 })
        func run(workers: UInt32) -> [UInt32] {
            msl_engine_set_worker_count(workers)
            let out = HostBuffer<Float>(count: groups, zero: 0)
            let r = dispatch("float_reduction", [input.binding, out.binding], groups: (UInt32(groups), 1, 1),
                             threads: (UInt32(threads), 1, 1))
            XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
            XCTAssertEqual(r.stats.workers, min(workers, UInt32(groups)))
            return out.values.map(\.bitPattern)
        }
        let first = run(workers: 1)
        XCTAssertEqual(run(workers: 1), first)
        XCTAssertEqual(run(workers: 2), first)
        XCTAssertEqual(run(workers: 5), first)
        XCTAssertNotEqual(first, [UInt32](repeating: 0, count: groups))
    }

    func testDispatchUsesOneWorkerPerCore() {
        let cores = UInt32(ProcessInfo.processInfo.activeProcessorCount)
        XCTAssertEqual(msl_engine_worker_count(), cores)
        let out = HostBuffer<UInt32>(count: 32 * 64, zero: 0)
        let r = dispatch("barrier_visibility", [out.binding], groups: (64, 1, 1), threads: (32, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        XCTAssertEqual(r.stats.workers, cores)
        XCTAssertEqual(r.stats.threadgroups, 64)
    }

    /// Dispatches from several threads at once each get their own workers and threadgroup memory.
    func testConcurrentDispatchesAreIndependent() {
        let threads = 128, groups = 8
        let outputs = (0..<4).map { _ in HostBuffer<UInt32>(count: threads * groups, zero: 0) }
        let statuses = HostBuffer<Int32>(count: outputs.count, zero: -1)
        DispatchQueue.concurrentPerform(iterations: outputs.count) { i in
            let r = dispatch("barrier_visibility", [outputs[i].binding], groups: (UInt32(groups), 1, 1),
                             threads: (UInt32(threads), 1, 1))
            statuses.pointer[i] = Int32(r.status.rawValue)
        }
        XCTAssertEqual(statuses.values, [Int32](repeating: 0, count: outputs.count))
        let expected = (0..<groups).flatMap { g in (0..<threads).map { UInt32((threads - 1 - $0) * 7 + g) } }
        for out in outputs { XCTAssertEqual(out.values, expected) }
    }

    /// Fiber switches of a barrier-bound kernel: one per lane per barrier and per return (lanes
    /// continue one another), plus the scheduler's switch to the first lane. Their rate is a
    /// benchmark's business (benchmarks/engine_speed.py), not a timed test's.
    func testBarrierSwitchCount() {
        let rounds = HostBuffer<UInt32>([2000])
        let out = HostBuffer<UInt32>(count: 1024, zero: 0)
        msl_engine_set_worker_count(1)
        let r = dispatch("barrier_storm", [out.binding, rounds.binding], threads: (1024, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
        XCTAssertEqual(r.stats.fiber_switches, 1024 * 2001 + 1)
    }

    /// A deliberate out-of-bounds read for tests/run_sanitized.sh, which runs this test alone with
    /// MSL_ENGINE_PLANTED_OOB=1 under AddressSanitizer and expects a heap-buffer-overflow report.
    func testPlantedOutOfBoundsRead() throws {
        guard ProcessInfo.processInfo.environment["MSL_ENGINE_PLANTED_OOB"] == "1" else {
            throw XCTSkip("set MSL_ENGINE_PLANTED_OOB=1 to run the planted out-of-bounds read")
        }
        let input = HostBuffer<Float>(count: 64, zero: 1)
        let out = HostBuffer<Float>(count: 64, zero: 0)
        let count = HostBuffer<UInt32>([1])
        let r = dispatch("planted_out_of_bounds_read", [input.binding, out.binding, count.binding], threads: (64, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
    }

    /// A signed int overflow in an MSL test kernel; tests/run_sanitized.sh runs it with
    /// MSL_ENGINE_PLANTED_UB=1 under UndefinedBehaviorSanitizer and expects its report.
    func testPlantedSignedOverflow() throws {
        guard ProcessInfo.processInfo.environment["MSL_ENGINE_PLANTED_UB"] == "1" else {
            throw XCTSkip("set MSL_ENGINE_PLANTED_UB=1 to run the planted signed overflow")
        }
        let input = HostBuffer<Int32>([Int32.max, 0])
        let out = HostBuffer<Int32>(count: 2, zero: 0)
        let step = HostBuffer<Int32>([1])
        let r = dispatch("planted_signed_overflow", [input.binding, out.binding, step.binding], threads: (2, 1, 1))
        XCTAssertEqual(r.status, MSL_ENGINE_SUCCESS, r.message)
    }
}
