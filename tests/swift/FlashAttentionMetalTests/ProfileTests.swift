import CFlashAttentionMetal
import Foundation
import MSLEngine
import XCTest

@testable import FlashAttentionMetal

/// The profile of the last call (FlashAttention.lastProfile, fa_context_last_profile) on the CPU
/// engine: it follows the dispatch plan, its counters are exact and reproducible, and each thread
/// and each context keeps its own. The checks hold for any kernels (they compare with the plan and
/// with other runs, never with kernel specifics).
final class ProfileTests: XCTestCase {
    private let shape = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 70, seqlenK: 90, headDim: 40)

    private func inputs(_ shape: AttentionShape, seed: Int = 1) -> (q: [Float16], k: [Float16], v: [Float16]) {
        func values(_ count: Int, _ salt: Int) -> [Float16] {
            (0..<count).map { Float16(Float(($0 * 37 + salt * 11 + seed) % 23) / 11 - 1) }
        }
        return (values(shape.queryElementCount, 1), values(shape.keyElementCount, 2),
                values(shape.valueElementCount, 3))
    }

    private func forwardProfile(_ attention: FlashAttention, _ shape: AttentionShape, causal: Bool = false) throws
        -> Profile {
        let (q, k, v) = inputs(shape)
        _ = try attention.forward(q: q, k: k, v: v, shape: shape, causal: causal)
        return try XCTUnwrap(attention.lastProfile)
    }

    private func backwardProfile(_ attention: FlashAttention, _ shape: AttentionShape, causal: Bool = false) throws
        -> Profile {
        let (q, k, v) = inputs(shape)
        let (out, lse) = try attention.forward(q: q, k: k, v: v, shape: shape, causal: causal)
        _ = try attention.backward(dout: q, q: q, k: k, v: v, out: out, lse: lse, shape: shape, causal: causal)
        return try XCTUnwrap(attention.lastProfile)
    }

    /// Each record names the plan's kernel with the plan's grid and threadgroup size, the engine's
    /// threadgroup storage of that kernel, counters, and a time; the call's time is their sum.
    private func assertMatchesPlan(_ profile: Profile, _ plan: DispatchPlan, file: StaticString = #filePath,
                                   line: UInt = #line) {
        XCTAssertEqual(profile.dispatches.map(\.kernelName), plan.dispatches.map(\.kernelName), file: file, line: line)
        for (record, dispatch) in zip(profile.dispatches, plan.dispatches) {
            XCTAssertEqual(record.threadgroupsPerGrid, DispatchProfile.Size(dispatch.threadgroupsPerGrid),
                           record.kernelName, file: file, line: line)
            XCTAssertEqual(record.threadsPerThreadgroup, DispatchProfile.Size(dispatch.threadsPerThreadgroup),
                           record.kernelName, file: file, line: line)
            var info = msl_engine_kernel_info()
            XCTAssertEqual(msl_engine_describe_kernel(dispatch.kernelName, &info), 1, file: file, line: line)
            XCTAssertEqual(record.threadgroupMemoryLength, info.threadgroup_memory_length, record.kernelName,
                           file: file, line: line)
            XCTAssertEqual(record.specialization, dispatch.specialization, record.kernelName, file: file, line: line)
            XCTAssertTrue(Set(record.functionConstantsRead ?? ["none counted"]).isSubset(of: dispatch.specialization.map(\.name)),
                          record.kernelName, file: file, line: line)
            XCTAssertNotNil(record.simdgroupMultiplyAccumulates, file: file, line: line)
            XCTAssertNotNil(record.threadgroupBarriers, file: file, line: line)
            XCTAssertGreaterThan(record.seconds ?? 0, 0, record.kernelName, file: file, line: line)
        }
        XCTAssertEqual(profile.seconds, profile.dispatches.reduce(0) { $0 + ($1.seconds ?? 0) }, accuracy: 1e-12,
                       file: file, line: line)
    }

    private func total(_ profile: Profile, _ counter: KeyPath<DispatchProfile, UInt64?>) -> UInt64 {
        profile.dispatches.reduce(0) { $0 + ($1[keyPath: counter] ?? 0) }
    }

    /// Whether the kernels use SIMD-group matrices at all (the products are then counted).
    private var kernelsUseSimdgroupMatrices: Bool { EmbeddedShaders.source.contains("simdgroup_multiply_accumulate") }

    func testForwardAndBackwardProfilesFollowThePlan() throws {
        let attention = try FlashAttention(backend: .cpu)
        // The second shape is a decode step (two queries over a longer KV cache), whose plan may differ.
        let decode = AttentionShape(batch: 1, numHeads: 4, numKVHeads: 2, seqlenQ: 2, seqlenK: 600, headDim: 64)
        for shape in [shape, decode] {
            try assertProfilesFollowThePlan(attention, shape)
        }
    }

    private func assertProfilesFollowThePlan(_ attention: FlashAttention, _ shape: AttentionShape) throws {
        for causal in [false, true] {
            let problem = try Problem.validate(shape, causal: causal, softmaxScale: nil)
            let forward = try forwardProfile(attention, shape, causal: causal)
            assertMatchesPlan(forward, DispatchPlan.forward(problem))
            let backward = try backwardProfile(attention, shape, causal: causal)
            assertMatchesPlan(backward, DispatchPlan.backward(problem))
            for profile in [forward, backward] {
                XCTAssertGreaterThan(total(profile, \.threadgroupBarriers), 0)
                // The decode kernel's products are SIMD-group sums, not matrices.
                let decode = profile.dispatches.contains { $0.kernelName.hasPrefix("flash_attention_forward_decode_") }
                if kernelsUseSimdgroupMatrices && !decode {
                    XCTAssertGreaterThan(total(profile, \.simdgroupMultiplyAccumulates), 0)
                } else {
                    XCTAssertEqual(total(profile, \.simdgroupMultiplyAccumulates), 0)
                }
            }
        }
    }

    /// Threadgroups are independent, so twice the batch executes exactly twice the products and
    /// barriers of every kernel; the same call again executes exactly the same; a causal mask never
    /// adds work.
    func testCountersAreExactAndReproducible() throws {
        let attention = try FlashAttention(backend: .cpu)
        var doubled = shape
        doubled.batch = 2
        for profileOf in [forwardProfile, backwardProfile] {
            let one = try profileOf(attention, shape, false)
            let again = try profileOf(attention, shape, false)
            let two = try profileOf(attention, doubled, false)
            let causal = try profileOf(attention, shape, true)
            for counter in [\DispatchProfile.simdgroupMultiplyAccumulates, \DispatchProfile.threadgroupBarriers] {
                XCTAssertEqual(again.dispatches.map { $0[keyPath: counter] }, one.dispatches.map { $0[keyPath: counter] })
                XCTAssertEqual(two.dispatches.map { $0[keyPath: counter] },
                               one.dispatches.map { $0[keyPath: counter].map { 2 * $0 } })
                XCTAssertLessThanOrEqual(total(causal, counter), total(one, counter))
            }
        }
    }

    func testEachThreadAndEachContextKeepsItsOwnProfile() throws {
        let first = try FlashAttention(backend: .cpu), second = try FlashAttention(backend: .cpu)
        XCTAssertNil(first.lastProfile)
        let forward = try forwardProfile(first, shape)
        XCTAssertNil(second.lastProfile, "another context")
        let backward = try backwardProfile(second, shape)
        XCTAssertEqual(first.lastProfile?.dispatches.map(\.kernelName), forward.dispatches.map(\.kernelName))
        XCTAssertEqual(second.lastProfile?.dispatches.map(\.kernelName), backward.dispatches.map(\.kernelName))

        // Another thread sees nothing of this thread's calls, then only its own call.
        let other = OtherThreadResult()
        var doubled = shape
        doubled.batch = 2
        let doubledShape = doubled
        let done = DispatchSemaphore(value: 0)
        let thread = Thread {
            other.before = first.lastProfile
            do {
                other.after = try self.forwardProfile(first, doubledShape)
            } catch {
                other.error = error
            }
            done.signal()
        }
        thread.start()
        done.wait()
        XCTAssertNil(other.error)
        XCTAssertNil(other.before)
        XCTAssertEqual(other.after?.dispatches.first?.threadgroupsPerGrid.depth, 2)
        XCTAssertEqual(first.lastProfile?.dispatches.first?.threadgroupsPerGrid.depth, 1, "this thread's own")
    }

    func testFailedCallLeavesTheLastProfile() throws {
        let attention = try FlashAttention(backend: .cpu)
        let before = try forwardProfile(attention, shape)
        XCTAssertThrowsError(try attention.forward(q: [UInt16](), k: [], v: [], shape: shape))
        XCTAssertEqual(attention.lastProfile?.dispatches.map(\.kernelName), before.dispatches.map(\.kernelName))
        XCTAssertEqual(attention.lastProfile?.seconds, before.seconds)
    }

    /// The C ABI reads the same profile, with its versioning and error rules.
    func testCProfileABI() throws {
        var ctx: OpaquePointer?
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &ctx), FA_STATUS_SUCCESS)
        defer { fa_context_destroy(ctx) }
        var profile = fa_profile()
        profile.struct_size = UInt32(MemoryLayout<fa_profile>.size)
        XCTAssertEqual(fa_context_last_profile(ctx, &profile), FA_STATUS_SUCCESS)
        XCTAssertEqual(profile.dispatch_count, 0, "no call yet")
        XCTAssertEqual(profile.seconds, 0)
        XCTAssertEqual(profile.command_buffers, 0)
        XCTAssertEqual(profile.gpu_cores, 0)

        var problem = fa_problem()
        problem.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (problem.batch, problem.num_heads, problem.num_kv_heads) = (1, 2, 1)
        (problem.seqlen_q, problem.seqlen_k, problem.head_dim, problem.causal) = (70, 90, 40, 1)
        problem.softmax_scale = 0.2
        let (q, k, v) = inputs(shape)
        var out = [UInt16](repeating: 0, count: q.count)
        var lse = [Float](repeating: 0, count: shape.lseElementCount)
        let status = q.withUnsafeBufferPointer { q in
            k.withUnsafeBufferPointer { k in
                v.withUnsafeBufferPointer { v in
                    q.withMemoryRebound(to: UInt16.self) { q in
                        k.withMemoryRebound(to: UInt16.self) { k in
                            v.withMemoryRebound(to: UInt16.self) { v in
                                fa_forward(ctx, &problem, q.baseAddress, k.baseAddress, v.baseAddress, &out, &lse)
                            }
                        }
                    }
                }
            }
        }
        XCTAssertEqual(status, FA_STATUS_SUCCESS, String(cString: fa_last_error_message()))
        XCTAssertEqual(fa_context_last_profile(ctx, &profile), FA_STATUS_SUCCESS)
        let plan = DispatchPlan.forward(try Problem.validate(&problem))
        XCTAssertEqual(Int(profile.dispatch_count), plan.dispatches.count)
        XCTAssertGreaterThan(profile.seconds, 0)
        XCTAssertEqual(profile.command_buffers, 1)
        XCTAssertEqual(profile.gpu_cores, UInt32(FA_NOMINAL_GPU_CORES), "the CPU engine plans for the nominal GPU")

        var record = fa_dispatch_profile()
        record.struct_size = UInt32(MemoryLayout<fa_dispatch_profile>.size)
        XCTAssertEqual(fa_context_last_profile_dispatch(ctx, 0, &record), FA_STATUS_SUCCESS)
        let name = withUnsafeBytes(of: record.kernel_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
        XCTAssertEqual(name, plan.dispatches[0].kernelName)
        let specialization = withUnsafeBytes(of: record.specialization) {
            String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self)
        }
        XCTAssertEqual(specialization, "fa_mask_type=0 fa_has_softcap=0 fa_has_alibi=0 fa_has_sinks=0 fa_has_dropout=0")
        let grid = plan.dispatches[0].threadgroupsPerGrid, threads = plan.dispatches[0].threadsPerThreadgroup
        XCTAssertTrue(record.threadgroups_per_grid == (grid.width, grid.height, grid.depth))
        XCTAssertTrue(record.threads_per_threadgroup == (threads.width, threads.height, threads.depth))
        XCTAssertGreaterThan(record.threadgroup_memory_length, 0)
        XCTAssertNotEqual(record.simdgroup_multiply_accumulates, .max, "measured on the CPU engine")
        XCTAssertGreaterThan(record.threadgroup_barriers, 0)
        XCTAssertNotEqual(record.threadgroup_barriers, .max)
        XCTAssertEqual(record.seconds, profile.seconds, accuracy: 1e-12, "one dispatch")

        func failure(_ status: fa_status) -> String {
            XCTAssertEqual(status, FA_STATUS_INVALID_ARGUMENT)
            return String(cString: fa_last_error_message())
        }
        XCTAssertEqual(failure(fa_context_last_profile_dispatch(ctx, profile.dispatch_count, &record)),
                       "index (1) must be less than the last profile's dispatch_count (1)")
        XCTAssertEqual(failure(fa_context_last_profile(nil, &profile)), "context must not be null")
        XCTAssertEqual(failure(fa_context_last_profile(ctx, nil)), "profile must not be null")
        XCTAssertEqual(failure(fa_context_last_profile_dispatch(ctx, 0, nil)), "dispatch must not be null")
        profile.struct_size = 8
        XCTAssertEqual(failure(fa_context_last_profile(ctx, &profile)),
                       "profile->struct_size (8) must be at least sizeof(fa_profile) (\(MemoryLayout<fa_profile>.size))")
        record.struct_size = 0
        XCTAssertEqual(failure(fa_context_last_profile_dispatch(ctx, 0, &record)),
                       "dispatch->struct_size (0) must be at least 248 (fa_dispatch_profile up to specialization)")
        // A caller built before device_bytes_read: the older fields, the counts left alone.
        record.struct_size = 248
        record.device_bytes_read.0 = 7
        XCTAssertEqual(fa_context_last_profile_dispatch(ctx, 0, &record), FA_STATUS_SUCCESS)
        XCTAssertEqual(record.device_bytes_read.0, 7)
    }
}

/// What the other thread of testEachThreadAndEachContextKeepsItsOwnProfile saw; written by that
/// thread before it signals, read after the wait.
private final class OtherThreadResult: @unchecked Sendable {
    var before: Profile?
    var after: Profile?
    var error: Error?
}
