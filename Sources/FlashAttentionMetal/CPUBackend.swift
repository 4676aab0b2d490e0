#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal
import MSLEngine

extension SpecializationType {
    /// The engine's name for the type.
    var engineType: msl_engine_constant_type {
        switch self {
        case .bool: return MSL_ENGINE_CONSTANT_BOOL
        case .uint32: return MSL_ENGINE_CONSTANT_UINT
        }
    }
}

/// Runs the plan on the CPU engine, which executes the same `Shaders/flash_attention.metal` source
/// with Metal's threadgroup semantics (see Sources/MSLEngine).
final class CPUBackend: ExecutionBackend {
    let name: StaticString = "cpu"
    let deviceName: String
    /// Work per piece of a plan (`DispatchPlan.pieces(maxFlops:)`). The CPU has no watchdog, so
    /// a plan runs whole; tests lower it to run the pieces the Metal backend would.
    let flopsPerPiece: Int

    /// Fails with `backendUnavailable` when the engine lacks the attention kernels (a build defect, or
    /// on x86-64 a CPU without AVX2, F16C and FMA).
    init(flopsPerPiece: Int = .max) throws {
        self.flopsPerPiece = flopsPerPiece
        let probe = "flash_attention_forward_f16_d\(FA_MAX_HEAD_DIM)"
        guard msl_engine_has_kernel(probe) != 0 else {
            throw FlashAttentionError.backendUnavailable(
                "the CPU engine has no kernel named \(probe) (on x86-64 it needs AVX2, F16C and FMA)")
        }
        deviceName = "CPU engine (MSL on \(msl_engine_worker_count()) worker threads)"
    }

    /// Set to 1 in the environment, the profile counts the bytes each dispatch reads from every
    /// buffer (`DispatchProfile.deviceBytesRead`); otherwise those counts are nil and the engine
    /// skips the counting, which costs it time on every tile copy. Read at each call.
    static let countDeviceReadsVariable = "FLASH_ATTENTION_COUNT_DEVICE_READS"

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        let countReads = getenv(Self.countDeviceReadsVariable).map { String(cString: $0) == "1" } ?? false
        msl_engine_count_device_reads(countReads ? 1 : 0)
        var buffers = buffers
        var workspace: [UnsafeMutableRawPointer] = []
        defer { workspace.forEach { free($0) } }
        // For the whole problem; each piece uses its part, as it does of the caller's buffers.
        for role in plan.workspace {
            let bytes = role.byteCount(for: plan.problem)
            guard let memory = malloc(max(bytes, 1)) else {
                throw FlashAttentionError.outOfMemory("CPU engine: cannot allocate \(bytes) bytes for \(role.name)")
            }
            workspace.append(memory)
            buffers[role] = UnsafeMutableRawBufferPointer(start: memory, count: bytes)
        }
        // The pieces run the plan's dispatches on slices; each dispatch's record sums its pieces.
        let pieces = plan.pieces(maxFlops: flopsPerPiece)
        var profile = Profile(seconds: 0, dispatches: plan.dispatches.map { Self.emptyRecord($0, countReads: countReads) },
                              commandBuffers: pieces.count)
        for piece in pieces {
            for dispatch in piece.plan.dispatches {
                try run(dispatch, of: piece, buffers: buffers, cancellation: cancellation)
                // A split plan's pieces hold its dispatches in order, some only in its last piece.
                guard let n = plan.dispatches.firstIndex(where: { $0.kernelName == dispatch.kernelName }) else {
                    continue
                }
                var stats = msl_engine_dispatch_stats()
                msl_engine_last_dispatch_stats(&stats)
                profile.dispatches[n].simdgroupMultiplyAccumulates? += stats.simdgroup_multiply_accumulates
                profile.dispatches[n].threadgroupBarriers? += stats.threadgroup_barriers
                withUnsafeBytes(of: stats.device_bytes_read) { counts in
                    for (i, bytes) in counts.bindMemory(to: UInt64.self).enumerated() {
                        profile.dispatches[n].deviceBytesRead?[i] += bytes
                    }
                }
                let before = profile.dispatches[n].functionConstantsRead ?? []
                profile.dispatches[n].functionConstantsRead = dispatch.specialization.enumerated().compactMap {
                    stats.function_constants_read & (1 << $0.offset) != 0 || before.contains($0.element.name)
                        ? $0.element.name : nil
                }
                profile.dispatches[n].seconds? += stats.seconds
                profile.seconds += stats.seconds
            }
        }
        return profile
    }

    /// The record of `dispatch` before it runs: its threadgroup storage, zero counts and time
    /// (no byte counts when they are not counted).
    private static func emptyRecord(_ dispatch: Dispatch, countReads: Bool) -> DispatchProfile {
        var info = msl_engine_kernel_info()
        let memory = msl_engine_describe_kernel(dispatch.kernelName, &info) != 0 ? info.threadgroup_memory_length : 0
        return DispatchProfile(dispatch, threadgroupMemoryLength: memory, simdgroupMultiplyAccumulates: 0,
                               threadgroupBarriers: 0,
                               deviceBytesRead: countReads ? [UInt64](repeating: 0, count: Int(MSL_ENGINE_COUNTED_BUFFERS)) : nil,
                               functionConstantsRead: [], seconds: 0)
    }

    /// The engine checks `cancellation` before every threadgroup, the first one included.
    private func run(_ dispatch: Dispatch, of piece: PlanPiece, buffers: HostBuffers,
                     cancellation: CancellationToken) throws {
        var params = dispatch.params.checkingAlignment { role in
            buffers[role]?.baseAddress.map { UInt(bitPattern: $0 + piece.byteOffset(of: role)) }
        }
        try withUnsafeMutableBytes(of: &params) { paramBytes in
            var slots = [msl_engine_buffer](repeating: msl_engine_buffer(contents: nil, length: 0),
                                            count: dispatch.bufferCount)
            for binding in dispatch.bindings {
                guard let buffer = buffers[binding.role] else {
                    throw FlashAttentionError.internalError(
                        "\(dispatch.kernelName): no buffer for \(binding.role.name)")
                }
                slots[binding.index] = msl_engine_buffer(
                    contents: buffer.baseAddress.map { $0 + piece.byteOffset(of: binding.role) },
                    length: binding.role.byteCount(for: piece.plan.problem))
            }
            if let role = dispatch.paramsRole, let table = buffers[role] {
                slots[dispatch.paramsIndex] = msl_engine_buffer(contents: table.baseAddress, length: table.count)
            } else {
                slots[dispatch.paramsIndex] = msl_engine_buffer(contents: paramBytes.baseAddress,
                                                                length: paramBytes.count)
            }
            let constants = dispatch.specialization.map {
                msl_engine_function_constant(index: UInt32($0.index), type: $0.type.engineType.rawValue,
                                             value: $0.value)
            }
            var message = [CChar](repeating: 0, count: 1024)
            let status = msl_engine_dispatch_specialized(
                dispatch.kernelName, slots, UInt32(slots.count), constants, UInt32(constants.count),
                msl_engine_size(width: dispatch.threadgroupsPerGrid.width,
                                height: dispatch.threadgroupsPerGrid.height,
                                depth: dispatch.threadgroupsPerGrid.depth),
                msl_engine_size(width: dispatch.threadsPerThreadgroup.width,
                                height: dispatch.threadsPerThreadgroup.height,
                                depth: dispatch.threadsPerThreadgroup.depth),
                cancellation.state, cancellation.startEpoch, &message, message.count)
            guard status != MSL_ENGINE_SUCCESS else { return }
            let text = "CPU engine: " + String(decoding: message.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) },
                                                   as: UTF8.self)
            switch status {
            case MSL_ENGINE_OUT_OF_MEMORY: throw FlashAttentionError.outOfMemory(text)
            case MSL_ENGINE_CANCELLED: throw FlashAttentionError.cancelled("cancelled by fa_context_cancel: \(text)")
            // A kernel the plan names but the engine lacks, or a constant it reads that the plan does
            // not set, is a defect of the library, not a user error.
            case MSL_ENGINE_UNKNOWN_KERNEL, MSL_ENGINE_FUNCTION_CONSTANT_UNSET:
                throw FlashAttentionError.internalError(text)
            default: throw FlashAttentionError.executionFailed(text)
            }
        }
    }
}
