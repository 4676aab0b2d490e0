#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal
import MSLEngine

/// Runs the plan on the CPU engine, which executes the same `Shaders/flash_attention.metal` source
/// with Metal's threadgroup semantics (see Sources/MSLEngine).
final class CPUBackend: ExecutionBackend {
    let name: StaticString = "cpu"
    let deviceName: String

    /// Fails with `backendUnavailable` when the engine lacks the attention kernels (a build defect, or
    /// on x86-64 a CPU without AVX2, F16C and FMA).
    init() throws {
        let probe = "flash_attention_forward_d\(FA_MAX_HEAD_DIM)"
        guard msl_engine_has_kernel(probe) != 0 else {
            throw FlashAttentionError.backendUnavailable(
                "the CPU engine has no kernel named \(probe) (on x86-64 it needs AVX2, F16C and FMA)")
        }
        deviceName = "CPU engine (MSL on \(msl_engine_worker_count()) worker threads)"
    }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        var buffers = buffers
        var workspace: [UnsafeMutableRawPointer] = []
        defer { workspace.forEach { free($0) } }
        for role in plan.workspace {
            let bytes = role.byteCount(for: plan.problem)
            guard let memory = malloc(max(bytes, 1)) else {
                throw FlashAttentionError.outOfMemory("CPU engine: cannot allocate \(bytes) bytes for \(role.name)")
            }
            workspace.append(memory)
            buffers[role] = UnsafeMutableRawBufferPointer(start: memory, count: bytes)
        }
        var profile = Profile(seconds: 0, dispatches: [])
        for dispatch in plan.dispatches {
            try run(dispatch, buffers: buffers, cancellation: cancellation)
            profile.dispatches.append(Self.lastDispatchProfile(dispatch))
            profile.seconds += profile.dispatches.last?.seconds ?? 0
        }
        return profile
    }

    /// What the engine reports for the calling thread's last dispatch, which ran `dispatch`.
    private static func lastDispatchProfile(_ dispatch: Dispatch) -> DispatchProfile {
        var stats = msl_engine_dispatch_stats()
        msl_engine_last_dispatch_stats(&stats)
        var info = msl_engine_kernel_info()
        let memory = msl_engine_describe_kernel(dispatch.kernelName, &info) != 0 ? info.threadgroup_memory_length : 0
        return DispatchProfile(dispatch, threadgroupMemoryLength: memory,
                               simdgroupMultiplyAccumulates: stats.simdgroup_multiply_accumulates,
                               threadgroupBarriers: stats.threadgroup_barriers, seconds: stats.seconds)
    }

    /// The engine checks `cancellation` before every threadgroup, the first one included.
    private func run(_ dispatch: Dispatch, buffers: HostBuffers, cancellation: CancellationToken) throws {
        var params = dispatch.params
        try withUnsafeMutableBytes(of: &params) { paramBytes in
            var slots = [msl_engine_buffer](repeating: msl_engine_buffer(contents: nil, length: 0),
                                            count: dispatch.bufferCount)
            for binding in dispatch.bindings {
                guard let buffer = buffers[binding.role] else {
                    throw FlashAttentionError.internalError(
                        "\(dispatch.kernelName): no buffer for \(binding.role.name)")
                }
                slots[binding.index] = msl_engine_buffer(contents: buffer.baseAddress, length: buffer.count)
            }
            slots[dispatch.paramsIndex] = msl_engine_buffer(contents: paramBytes.baseAddress,
                                                            length: paramBytes.count)
            var message = [CChar](repeating: 0, count: 1024)
            let status = msl_engine_dispatch_cancellable(
                dispatch.kernelName, slots, UInt32(slots.count),
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
            // A kernel the plan names but the engine lacks is a build defect, not a user error.
            case MSL_ENGINE_UNKNOWN_KERNEL: throw FlashAttentionError.internalError(text)
            default: throw FlashAttentionError.executionFailed(text)
            }
        }
    }
}
