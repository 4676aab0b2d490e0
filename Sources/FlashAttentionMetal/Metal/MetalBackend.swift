// The Metal backend of the C ABI and of FlashAttention: host memory in, host memory out. It wraps
// the caller's memory in MTLBuffers, runs a plan as a sequence of command buffers (one per piece,
// against the GPU watchdog), waits for them with a bound, and turns Metal's errors into the
// library's. Not compiled on Linux; each Metal call was checked against Apple's documentation.
#if canImport(Metal)
import CFlashAttentionMetal
#if canImport(Darwin)
import Darwin
#endif
import Foundation
import Metal

final class MetalBackend: ExecutionBackend {
    let name: StaticString = "metal"
    let deviceName: String
    var note: String { kernels.origin }
    /// The device's `gpu-core-count` from the IORegistry (`DeviceCores`), read once; nil when
    /// there is none (the plan then takes FA_NOMINAL_GPU_CORES).
    let gpuCores: UInt32?
    /// The device's matrix units and the tensor-op library (`MetalFlashAttention.tensorOps`).
    var tensorOps: TensorOpsSupport { kernels.tensorOps }

    /// Work per command buffer, in FLOP as FlashAttention counts them (`Pass.flopsPerScoreElement`).
    /// macOS stops a command buffer that runs for seconds and may then refuse the process's later
    /// work; 2^35 FLOP (34 GFLOP) is about 15 ms at the M1's 2.6 TFLOPS FP16 peak, 0.3 s at a
    /// twentieth of it, while a command buffer costs tens of microseconds. The header's
    /// FA_PLAN_PIECE_FLOPS_LOG2, which the PyTorch and MLX hosts read too.
    static let defaultFlopsPerCommandBuffer = 1 << Int(FA_PLAN_PIECE_FLOPS_LOG2)
    /// How long to wait for a command buffer to complete before giving up on the call: this plus
    /// its work at `slowestFlopsPerSecond`, far beyond what the watchdog lets one run, so only a
    /// hung GPU or driver reaches it.
    static let completionTimeoutSeconds = 60.0
    /// A throughput below any Apple-silicon GPU's (the M1's FP16 peak is 2.6 TFLOPS).
    static let slowestFlopsPerSecond = 1e10

    /// `defaultFlopsPerCommandBuffer`; tests lower it to run many command buffers.
    let flopsPerCommandBuffer: Int
    private let kernels: MetalFlashAttention
    private let queue: MTLCommandQueue
    /// The alignment of memory wrapped without a copy: the VM page (16 KiB on Apple silicon).
    private let pageSize = AttentionKVCache.pageBytes
    private let lock = Lock()
    /// Set when the GPU is lost to this process (access revoked, device removed, not permitted):
    /// every later call fails with it as `backendUnavailable`.
    private var lostReason: String?

    /// - Throws: `backendUnavailable` when there is no Apple-silicon Metal device or no command
    ///   queue; `executionFailed` when the shaders do not compile.
    init(flopsPerCommandBuffer: Int = MetalBackend.defaultFlopsPerCommandBuffer) throws {
        self.flopsPerCommandBuffer = flopsPerCommandBuffer
        let device = try MetalBackend.appleSiliconDevice()
        // MTLDevice.makeCommandQueue(): one queue per context, shared by its calls.
        guard let queue = device.makeCommandQueue() else {
            throw FlashAttentionError.backendUnavailable("Metal could not create a command queue on \(device.name)")
        }
        self.queue = queue
        kernels = try MetalFlashAttention(device: device)
        deviceName = device.name
        gpuCores = kernels.gpuCores
    }

    /// The core count of the device a Metal backend takes (`appleSiliconDevice`: on an Apple-silicon
    /// Mac its one GPU, which MTLCreateSystemDefaultDevice() returns, "the device instance Metal
    /// selects as the default", developer.apple.com/documentation/metal/mtlcreatesystemdefaultdevice()),
    /// read once per process (Swift runs a static's initializer once, lazily, on first use); nil
    /// without such a device or count (`GPUCores.libraryDevice`).
    static let defaultDeviceCores: UInt32? = (try? appleSiliconDevice()).flatMap(cores(of:))

    /// The architecture name of the device a Metal backend takes (`GPUArchitecture.libraryDevice`),
    /// read once per process.
    static let defaultDeviceArchitecture: String? = (try? appleSiliconDevice()).flatMap(architecture(of:))

    /// `device.architecture.name` (MTLArchitecture, macOS 14+ / iOS 17+: developer.apple.com/
    /// documentation/metal/mtlarchitecture/name, e.g. `applegpu_g17s`); nil on older systems.
    static func architecture(of device: MTLDevice) -> String? {
        guard #available(macOS 14.0, iOS 17.0, tvOS 17.0, visionOS 1.0, *) else { return nil }
        return device.architecture.name
    }

    /// `device`'s `gpu-core-count` from the IORegistry (`DeviceCores`); nil without IOKit.
    static func cores(of device: MTLDevice) -> UInt32? {
        #if canImport(IOKit)
        return DeviceCores.read(registryID: device.registryID)
        #else
        return nil
        #endif
    }

    /// The first device of family Apple7 or later. MTLCreateSystemDefaultDevice() can return nil in
    /// a process that is not a GUI app; on macOS MTLCopyAllDevices() still lists the GPUs.
    private static func appleSiliconDevice() throws -> MTLDevice {
        var devices: [MTLDevice] = []
        if let device = MTLCreateSystemDefaultDevice() { devices.append(device) }
        #if os(macOS) || targetEnvironment(macCatalyst)
        devices += MTLCopyAllDevices()
        #endif
        if let device = devices.first(where: { $0.supportsFamily(.apple7) }) { return device }
        guard let first = devices.first else {
            throw FlashAttentionError.backendUnavailable("no Metal device found")
        }
        throw FlashAttentionError.backendUnavailable(MetalFlashAttention.notAppleSilicon(first))
    }

    func prepare(_ plan: DispatchPlan) throws {
        if let reason = lock.withLock({ lostReason }) {
            throw FlashAttentionError.backendUnavailable(reason)
        }
        for dispatch in plan.dispatches {
            _ = try kernels.checkedPipeline(for: dispatch)
        }
    }

    /// A GPU page fault (MTLCommandBufferError.pageFault) while running a piece.
    private struct PageFault: Error {
        let message: String
    }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        try prepare(plan)
        var copyInputs = false
        while true {
            let wrapped = try wrap(buffers, for: plan, copyInputs: copyInputs)
            do {
                let commandBuffers = try run(plan.pieces(maxFlops: flopsPerCommandBuffer),
                                             buffers: wrapped.metal, cancellation: cancellation)
                for (role, buffer) in wrapped.copyBack {
                    buffers.copyOutput(role, from: buffer.contents(), of: plan.problem)
                }
                return try profile(plan, commandBuffers: commandBuffers)
            } catch let fault as PageFault {
                // Memory that Metal wrapped without a copy and the GPU then could not read (pages
                // the system would not map for it): once more with copies.
                guard wrapped.wrappedInputs, !copyInputs else {
                    throw FlashAttentionError.internalError(fault.message)
                }
                copyInputs = true
            }
        }
    }

    /// The profile of a completed call. MTLCommandBuffer gpuStartTime and gpuEndTime (host time in
    /// seconds, set once the GPU has finished the command buffer) give the GPU time, summed over the
    /// call's command buffers, one per piece; MTLComputePipelineState staticThreadgroupMemoryLength
    /// gives each kernel's threadgroup memory. Metal has no counters of SIMD-group matrix products
    /// or barriers, and the kernels share command buffers, so those and per-dispatch times are left
    /// unmeasured (nil). The dispatches are the plan's, for the whole problem.
    private func profile(_ plan: DispatchPlan, commandBuffers: [MTLCommandBuffer]) throws -> Profile {
        let dispatches = try plan.dispatches.map { dispatch in
            let state = try kernels.checkedPipeline(for: dispatch)
            return DispatchProfile(dispatch, threadgroupMemoryLength: state.staticThreadgroupMemoryLength,
                                   simdgroupMultiplyAccumulates: nil, threadgroupBarriers: nil,
                                   functionConstantsRead: nil, seconds: nil)
        }
        return Profile(seconds: commandBuffers.reduce(0.0) { $0 + ($1.gpuEndTime - $1.gpuStartTime) },
                       dispatches: dispatches, commandBuffers: commandBuffers.count)
    }

    /// MTLBuffers for every role the plan binds. The workspace in GPU-only memory for the whole
    /// problem (each piece binds its part, as of the caller's buffers). Inputs and caches (the
    /// plan's read-write roles) without a copy (unless `copyInputs`) when the pointer is a page
    /// multiple and the length one too ("a page-aligned pointer", "a length ... that results in a
    /// page-aligned region": https://developer.apple.com/documentation/metal/mtldevice/makebuffer(bytesnocopy:length:options:deallocator:)),
    /// and the range is one writable VM region (`isOneWritableRegion`); else copied
    /// (makeBuffer(bytes:length:options:)). A cache's length is rounded up to whole pages: its last
    /// page is mapped, the kernels never touch the bytes past it, and `flash_attn_with_kvcache`'s
    /// `empty_cache` allocates whole pages, so such a cache is always read in place. A copied cache
    /// comes back to nothing: the kernels do not append (DispatchPlan.caches).
    /// `wrappedInputs` says whether any input was wrapped without a copy. Outputs always in Metal's
    /// own memory (makeBuffer(length:options:), which zero-fills them), copied back only after
    /// every command buffer succeeded and only where the output's layout addresses elements
    /// (HostBuffers.copyOutput): the GPU never writes the caller's memory, even when a call times
    /// out and returns while the GPU still runs, and the gaps of a strided output stay the caller's.
    func wrap(_ buffers: HostBuffers, for plan: DispatchPlan, copyInputs: Bool) throws
        -> (metal: [BufferRole: MTLBuffer], copyBack: [(role: BufferRole, buffer: MTLBuffer)], wrappedInputs: Bool) {
        let device = kernels.device
        var metal = try kernels.makeWorkspace(for: plan)
        var copyBack: [(role: BufferRole, buffer: MTLBuffer)] = []
        var wrappedInputs = false
        let caches = plan.caches
        for role in plan.boundRoles where !plan.workspace.contains(role) {
            guard let host = buffers[role], let base = host.baseAddress else {
                throw FlashAttentionError.internalError("no host buffer for \(role.name)")
            }
            // MTLDevice.maxBufferLength (macOS 10.14+).
            guard host.count <= device.maxBufferLength else {
                throw FlashAttentionError.unsupported(
                    "\(role.name) (\(host.count) bytes) exceeds the largest buffer of \(device.name) "
                        + "(maxBufferLength \(device.maxBufferLength))")
            }
            let shared = MTLResourceOptions.storageModeShared
            var buffer: MTLBuffer?
            if plan.outputs.contains(role) {
                buffer = device.makeBuffer(length: host.count, options: shared)
                if let buffer { copyBack.append((role, buffer)) }
            } else {
                let length = caches.contains(role) ? (host.count + pageSize - 1) / pageSize * pageSize : host.count
                if !copyInputs && Int(bitPattern: base) % pageSize == 0 && length % pageSize == 0
                    && length <= device.maxBufferLength && MetalBackend.isOneWritableRegion(base, length) {
                    buffer = device.makeBuffer(bytesNoCopy: base, length: length, options: shared, deallocator: nil)
                    wrappedInputs = wrappedInputs || buffer != nil
                }
                if buffer == nil {
                    buffer = device.makeBuffer(bytes: base, length: host.count, options: shared)
                }
            }
            guard let buffer else {
                throw FlashAttentionError.outOfMemory(
                    "Metal could not allocate \(host.count) bytes on \(device.name) for \(role.name)")
            }
            metal[role] = buffer
        }
        return (metal, copyBack, wrappedInputs)
    }

    /// Whether `count` bytes at `base` lie in one VM region that the process may write:
    /// mach_vm_region(2) with VM_REGION_BASIC_INFO_64 gives the region at or after an address and its
    /// protection (the object name port it returns is released). Memory mapped read-only (a file
    /// mapped for reading) or spanning regions is copied.
    /// Elsewhere (the stand-in build on Linux) the stand-in's makeBuffer(bytesNoCopy:) checks it.
    private static func isOneWritableRegion(_ base: UnsafeMutableRawPointer, _ count: Int) -> Bool {
        #if canImport(Darwin)
        let start = mach_vm_address_t(UInt(bitPattern: base))
        var address = start
        var size: mach_vm_size_t = 0
        var info = vm_region_basic_info_data_64_t()
        var infoCount = mach_msg_type_number_t(
            MemoryLayout<vm_region_basic_info_data_64_t>.size / MemoryLayout<Int32>.size)
        var object: mach_port_t = 0
        let status = withUnsafeMutablePointer(to: &info) {
            $0.withMemoryRebound(to: Int32.self, capacity: Int(infoCount)) {
                mach_vm_region(mach_task_self_, &address, &size, VM_REGION_BASIC_INFO_64, $0, &infoCount, &object)
            }
        }
        if object != 0 { mach_port_deallocate(mach_task_self_, object) }
        return status == KERN_SUCCESS && address <= start && start + mach_vm_size_t(count) <= address + size
            && info.protection & VM_PROT_WRITE != 0
        #else
        return true
        #endif
    }

    /// Commits one command buffer per piece, in order, then waits once for all of them, and returns
    /// them: the one place where command buffers are made, committed and their completion collected
    /// (the profile reads their GPU times). Cancellation is checked before each commit: a committed
    /// command buffer runs to completion. Every committed command buffer is waited for, even when
    /// encoding a later piece fails or the call is cancelled, because it reads the caller's memory;
    /// the wait for each completion is bounded by `completionSeconds(piece)`. A wait that runs out
    /// fails the call, not the device: the command buffers left running write only Metal's own
    /// buffers, but they may still read inputs wrapped without a copy (makeBuffer(bytesNoCopy:) does
    /// not own that memory), so the error tells the caller to keep the inputs allocated.
    private func run(_ pieces: [PlanPiece], buffers: [BufferRole: MTLBuffer],
                     cancellation: CancellationToken) throws -> [MTLCommandBuffer] {
        let completions = DispatchSemaphore(value: 0)
        var committed: [MTLCommandBuffer] = []
        var encodingError: Error?
        for (n, piece) in pieces.enumerated() {
            do {
                let commandBuffer = try makeCommandBuffer(label: "flash_attention \(n + 1)/\(pieces.count)")
                try kernels.encode(piece, buffers: buffers, into: commandBuffer)
                guard !cancellation.isCancelled else {
                    throw FlashAttentionError.cancelled(
                        "cancelled by fa_context_cancel before command buffer \(n + 1) of \(pieces.count) was "
                            + "committed")
                }
                // MTLCommandBuffer.addCompletedHandler(_:) before commit(); it runs after an error too.
                commandBuffer.addCompletedHandler { _ in completions.signal() }
                commandBuffer.commit()
                committed.append(commandBuffer)
            } catch {
                encodingError = error
                break
            }
        }
        for n in committed.indices {
            let seconds = MetalBackend.completionSeconds(pieces[n])
            guard completions.wait(timeout: .now() + seconds) == .success else {
                throw FlashAttentionError.executionFailed(
                    "Metal: command buffer \(n + 1) of \(pieces.count) did not complete within "
                        + "\(Int(seconds.rounded(.up))) s of the previous one (the GPU or its driver may be hung); the "
                        + "outputs were not written, and the inputs must stay allocated until the process ends "
                        + "(command buffers still running may read them)")
            }
        }
        if let encodingError { throw encodingError }
        for (n, commandBuffer) in committed.enumerated() {
            try check(commandBuffer, piece: pieces[n], number: n + 1, of: pieces.count)
        }
        return committed
    }

    /// The wait for `piece`'s command buffer: `completionTimeoutSeconds` plus its work at
    /// `slowestFlopsPerSecond`.
    private static func completionSeconds(_ piece: PlanPiece) -> Double {
        completionTimeoutSeconds + Double(piece.flops) / slowestFlopsPerSecond
    }

    /// MTLCommandQueue.makeCommandBuffer(descriptor:) with MTLCommandBufferDescriptor.errorOptions
    /// `.encoderExecutionStatus` (all macOS 11+): a failed command buffer's error then says which
    /// encoder, hence which kernel, faulted. It retains its resources (the descriptor's default).
    /// Blocks while the queue's command buffers (64 by default) are all in flight.
    private func makeCommandBuffer(label: String) throws -> MTLCommandBuffer {
        let descriptor = MTLCommandBufferDescriptor()
        descriptor.errorOptions = .encoderExecutionStatus
        guard let commandBuffer = queue.makeCommandBuffer(descriptor: descriptor) else {
            throw FlashAttentionError.executionFailed("Metal could not create a command buffer")
        }
        commandBuffer.label = label
        return commandBuffer
    }

    /// Throws unless `commandBuffer` completed: MTLCommandBuffer.status and .error, whose
    /// MTLCommandBufferError code decides the status (out of memory; watchdog timeout; page fault, a
    /// library defect; the GPU lost to this process).
    private func check(_ commandBuffer: MTLCommandBuffer, piece: PlanPiece, number: Int, of count: Int) throws {
        guard commandBuffer.status != .completed else { return }
        let error = commandBuffer.error
        let text = error?.localizedDescription ?? "status \(commandBuffer.status.rawValue)"
        let kernels = MetalBackend.faultedKernels(error) ?? piece.plan.dispatches.map(\.kernelName)
        let place = "command buffer \(number) of \(count) (\(kernels.joined(separator: ", ")))"
        let code = (error as? MTLCommandBufferError)?.code
        if code == .outOfMemory {
            throw FlashAttentionError.outOfMemory("Metal ran out of memory in \(place): \(text)")
        }
        if code == .timeout {
            throw FlashAttentionError.executionFailed(
                "the GPU watchdog stopped \(place): \(text). Each command buffer holds at most "
                    + "\(flopsPerCommandBuffer) FLOP of work, or one block of rows of a GQA group where "
                    + "that is more (\(piece.flops) FLOP here): use shorter sequences per call")
        }
        if code == .pageFault {
            throw PageFault(message: "GPU page fault in \(place): \(text) (a kernel accessed memory outside its "
                                + "buffers: please report)")
        }
        if let code, MetalBackend.losesTheDevice(code) {
            let reason = "Metal can no longer be used on \(deviceName) by this process: \(text)"
            lock.withLock { lostReason = lostReason ?? reason }
            throw FlashAttentionError.backendUnavailable(reason)
        }
        throw FlashAttentionError.executionFailed("Metal failed in \(place): \(text)")
    }

    /// Codes after which the process cannot use the GPU: access revoked (too many timeouts or
    /// hangs), not permitted, and on macOS the device physically removed.
    private static func losesTheDevice(_ code: MTLCommandBufferError.Code) -> Bool {
        #if os(macOS)
        if code == .deviceRemoved { return true }
        #endif
        return code == .accessRevoked || code == .notPermitted
    }

    /// The labels (kernel names) of the encoders that caused `error`: the NSError's userInfo holds
    /// [MTLCommandBufferEncoderInfo] under MTLCommandBufferEncoderInfoErrorKey (macOS 11+), each with
    /// its label and errorState (.faulted for the cause). Nil when there is no such information.
    private static func faultedKernels(_ error: Error?) -> [String]? {
        guard let error else { return nil }
        let infos = (error as NSError).userInfo[MTLCommandBufferEncoderInfoErrorKey] as? [MTLCommandBufferEncoderInfo]
        let faulted = (infos ?? []).filter { $0.errorState == .faulted }.map(\.label)
        return faulted.isEmpty ? nil : faulted
    }
}
#endif
