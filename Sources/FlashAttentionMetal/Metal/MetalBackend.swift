// The Metal backend: the only file that calls Metal. It turns a DispatchPlan into Metal API calls,
// for host memory (MetalBackend, behind the C ABI and FlashAttention) and for an app's own
// MTLBuffers and MTLCommandBuffer (MetalFlashAttention). Not compiled on Linux; every call was
// checked against Apple's documentation (see the comments at each group of calls).
#if canImport(Metal)
import CFlashAttentionMetal
import Foundation
import Metal

/// The attention kernels compiled for one `MTLDevice`, encoding into command buffers that the app
/// owns, so tensors stay on the GPU.
///
/// Buffers hold the layout of ``AttentionShape`` from offset 0: `q`, `out`, `dout`, `dq` float16
/// `[batch][numHeads][seqlenQ][headDim]`; `k`, `v`, `dk`, `dv` float16
/// `[batch][numKVHeads][seqlenK][headDim]`; `lse` float32 `[batch][numHeads][seqlenQ]`. Each buffer
/// must belong to `device` and hold at least that many bytes. Encoding adds one compute encoder to
/// the command buffer; the results are ready when the command buffer completes.
///
/// Thread-safe: the library and the pipeline cache are shared; each call uses only the command
/// buffer it is given.
public final class MetalFlashAttention: @unchecked Sendable {
    /// The device the kernels were compiled for.
    public let device: MTLDevice
    private let library: MTLLibrary
    private let lock = NSLock()
    private var pipelines: [String: MTLComputePipelineState] = [:]

    /// Compiles the embedded MSL source (Shaders/flash_attention.metal with its header spliced in)
    /// for `device`. No Metal toolchain is needed at run time.
    /// - Throws: ``FlashAttentionError/executionFailed(_:)`` with the compiler's message.
    public init(device: MTLDevice) throws {
        self.device = device
        // fastMathEnabled = false gives mathMode .safe and precise exp/log on every OS version (the
        // newer mathMode property is missing from the macOS 14 SDK); rows without keys store -inf,
        // which fast math may treat as poison.
        let options = MTLCompileOptions()
        options.fastMathEnabled = false
        do {
            library = try device.makeLibrary(source: EmbeddedShaders.source, options: options)
        } catch {
            throw FlashAttentionError.executionFailed(
                "Metal could not compile the embedded shaders for \(device.name): \(error.localizedDescription)")
        }
    }

    /// Encodes the forward pass: `out` and `lse` from `q`, `k`, `v`.
    /// - Parameter softmaxScale: any finite value; nil means `1 / sqrt(headDim)`.
    /// - Throws: ``FlashAttentionError/invalidArgument(_:)`` for a bad shape or a buffer that is too
    ///   small or from another device, ``FlashAttentionError/unsupported(_:)`` when the kernel needs
    ///   more than the device offers. Nothing is encoded when it throws.
    public func encodeForward(into commandBuffer: MTLCommandBuffer, q: MTLBuffer, k: MTLBuffer, v: MTLBuffer,
                              out: MTLBuffer, lse: MTLBuffer, shape: AttentionShape, causal: Bool = false,
                              softmaxScale: Float? = nil) throws {
        let problem = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
        try encode(DispatchPlan.forward(problem), buffers: [.q: q, .k: k, .v: v, .out: out, .lse: lse],
                   into: commandBuffer)
    }

    /// Encodes the backward pass (the dQ and the dK/dV kernels): `dq`, `dk`, `dv` from `dout` and the
    /// `q`, `k`, `v`, `out`, `lse` of the forward pass.
    /// - Throws: as ``encodeForward(into:q:k:v:out:lse:shape:causal:softmaxScale:)``.
    public func encodeBackward(into commandBuffer: MTLCommandBuffer, dout: MTLBuffer, q: MTLBuffer, k: MTLBuffer,
                               v: MTLBuffer, out: MTLBuffer, lse: MTLBuffer, dq: MTLBuffer, dk: MTLBuffer,
                               dv: MTLBuffer, shape: AttentionShape, causal: Bool = false,
                               softmaxScale: Float? = nil) throws {
        let problem = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
        try encode(DispatchPlan.backward(problem),
                   buffers: [.dout: dout, .q: q, .k: k, .v: v, .out: out, .lse: lse, .dq: dq, .dk: dk, .dv: dv],
                   into: commandBuffer)
    }

    /// Encodes every dispatch of `plan` in one compute encoder and returns their pipelines, in
    /// order. All checks run before the encoder exists, so a failure leaves the command buffer
    /// untouched.
    @discardableResult
    func encode(_ plan: DispatchPlan, buffers: [BufferRole: MTLBuffer], into commandBuffer: MTLCommandBuffer) throws
        -> [MTLComputePipelineState] {
        for dispatch in plan.dispatches {
            for binding in dispatch.bindings {
                let needed = binding.role.byteCount(for: plan.problem)
                guard let buffer = buffers[binding.role] else {
                    throw FlashAttentionError.internalError("\(dispatch.kernelName): no buffer for \(binding.role.name)")
                }
                guard buffer.device === device else {
                    throw FlashAttentionError.invalidArgument("\(binding.role.name) belongs to another MTLDevice")
                }
                guard buffer.length >= needed else {
                    throw FlashAttentionError.invalidArgument(
                        "\(binding.role.name) has \(buffer.length) bytes; the shape needs \(needed)")
                }
            }
        }
        let states = try plan.dispatches.map { try checkedPipeline(for: $0) }
        // MTLCommandBuffer.makeComputeCommandEncoder(), MTLComputeCommandEncoder
        // setComputePipelineState(_:), setBuffer(_:offset:index:), setBytes(_:length:index:) (data
        // below 4 KB: the 32-byte parameter struct), dispatchThreadgroups(_:threadsPerThreadgroup:),
        // endEncoding().
        guard let encoder = commandBuffer.makeComputeCommandEncoder() else {
            throw FlashAttentionError.executionFailed("Metal could not create a compute command encoder")
        }
        for (dispatch, state) in zip(plan.dispatches, states) {
            encoder.setComputePipelineState(state)
            for binding in dispatch.bindings {
                encoder.setBuffer(buffers[binding.role], offset: 0, index: binding.index)
            }
            var params = dispatch.params
            encoder.setBytes(&params, length: MemoryLayout<FlashAttentionParams>.size, index: dispatch.paramsIndex)
            encoder.dispatchThreadgroups(metalSize(dispatch.threadgroupsPerGrid),
                                         threadsPerThreadgroup: metalSize(dispatch.threadsPerThreadgroup))
        }
        encoder.endEncoding()
        return states
    }

    /// The cached pipeline of a dispatch's kernel, after checking the dispatch fits it: register
    /// pressure can lower maxTotalThreadsPerThreadgroup below the threadgroup size, and an
    /// oversized dispatch has been seen to run silently as zeros.
    private func checkedPipeline(for dispatch: Dispatch) throws -> MTLComputePipelineState {
        let state = try pipeline(named: dispatch.kernelName)
        let size = dispatch.threadsPerThreadgroup
        let threads = Int(size.width) * Int(size.height) * Int(size.depth)
        guard threads <= state.maxTotalThreadsPerThreadgroup else {
            throw FlashAttentionError.unsupported(
                "\(dispatch.kernelName) needs \(threads) threads per threadgroup; on \(device.name) it allows "
                    + "\(state.maxTotalThreadsPerThreadgroup)")
        }
        guard state.staticThreadgroupMemoryLength <= device.maxThreadgroupMemoryLength else {
            throw FlashAttentionError.unsupported(
                "\(dispatch.kernelName) needs \(state.staticThreadgroupMemoryLength) bytes of threadgroup memory; "
                    + "\(device.name) has \(device.maxThreadgroupMemoryLength)")
        }
        return state
    }

    /// MTLLibrary.makeFunction(name:) and MTLDevice.makeComputePipelineState(function:), once per
    /// kernel name.
    private func pipeline(named name: String) throws -> MTLComputePipelineState {
        lock.lock()
        defer { lock.unlock() }
        if let state = pipelines[name] { return state }
        guard let function = library.makeFunction(name: name) else {
            throw FlashAttentionError.internalError("the embedded shaders have no kernel named \(name)")
        }
        do {
            let state = try device.makeComputePipelineState(function: function)
            pipelines[name] = state
            return state
        } catch {
            throw FlashAttentionError.executionFailed(
                "Metal could not build the pipeline of \(name): \(error.localizedDescription)")
        }
    }

    private func metalSize(_ size: GridSize) -> MTLSize {
        MTLSize(width: Int(size.width), height: Int(size.height), depth: Int(size.depth))
    }
}

/// Runs plans on host memory: wraps the caller's memory in shared buffers (without a copy when the
/// pointer and length are page multiples, which NumPy memory usually is not), encodes, commits and
/// waits, then copies the outputs back where they were copied.
final class MetalBackend: ExecutionBackend {
    let name: StaticString = "metal"
    let deviceName: String
    private let kernels: MetalFlashAttention
    private let queue: MTLCommandQueue
    private let pageSize = Int(sysconf(_SC_PAGESIZE))

    /// - Throws: `backendUnavailable` when there is no Metal device or queue; `executionFailed` when
    ///   the shaders do not compile.
    init() throws {
        guard let device = MetalBackend.defaultDevice() else {
            throw FlashAttentionError.backendUnavailable("no Metal device found")
        }
        guard let queue = device.makeCommandQueue() else {
            throw FlashAttentionError.backendUnavailable("Metal could not create a command queue on \(device.name)")
        }
        self.queue = queue
        kernels = try MetalFlashAttention(device: device)
        deviceName = device.name
    }

    /// MTLCreateSystemDefaultDevice() can return nil in a process that is not a GUI app; on macOS
    /// MTLCopyAllDevices() still lists the GPUs (it exists on iOS only from iOS 18).
    private static func defaultDevice() -> MTLDevice? {
        if let device = MTLCreateSystemDefaultDevice() { return device }
        #if os(macOS) || targetEnvironment(macCatalyst)
        return MTLCopyAllDevices().first
        #else
        return nil
        #endif
    }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        let device = kernels.device
        var wrapped: [BufferRole: MTLBuffer] = [:]
        var copyBack: [(host: UnsafeMutableRawBufferPointer, buffer: MTLBuffer)] = []
        for role in Set(plan.dispatches.flatMap { $0.bindings.map(\.role) }) {
            guard let host = buffers[role], let base = host.baseAddress else {
                throw FlashAttentionError.internalError("no host buffer for \(role.name)")
            }
            guard host.count <= device.maxBufferLength else {
                throw FlashAttentionError.unsupported(
                    "\(role.name) (\(host.count) bytes) exceeds the largest buffer of \(device.name) "
                        + "(maxBufferLength \(device.maxBufferLength))")
            }
            // MTLDevice.makeBuffer(bytesNoCopy:length:options:deallocator:) needs a page-aligned
            // pointer and length, and may still refuse memory (Apple: one VM region, not malloc);
            // then makeBuffer(bytes:length:options:) copies inputs and makeBuffer(length:options:)
            // provides outputs that are copied back after the command buffer completes.
            let shared = MTLResourceOptions.storageModeShared
            var buffer: MTLBuffer?
            if Int(bitPattern: base) % pageSize == 0 && host.count % pageSize == 0 {
                buffer = device.makeBuffer(bytesNoCopy: base, length: host.count, options: shared, deallocator: nil)
            }
            if buffer == nil {
                if plan.outputs.contains(role) {
                    buffer = device.makeBuffer(length: host.count, options: shared)
                    if let buffer { copyBack.append((host, buffer)) }
                } else {
                    buffer = device.makeBuffer(bytes: base, length: host.count, options: shared)
                }
            }
            guard let metalBuffer = buffer else {
                throw FlashAttentionError.outOfMemory(
                    "Metal could not allocate \(host.count) bytes on \(device.name) for \(role.name)")
            }
            wrapped[role] = metalBuffer
        }
        // MTLCommandQueue.makeCommandBuffer(); MTLCommandBuffer commit(), waitUntilCompleted(),
        // status (.completed or .error) and error (MTLCommandBufferError, code .outOfMemory etc.).
        guard let commandBuffer = queue.makeCommandBuffer() else {
            throw FlashAttentionError.executionFailed("Metal could not create a command buffer")
        }
        let states = try kernels.encode(plan, buffers: wrapped, into: commandBuffer)
        // Cancellation is checked between command buffers: a committed one runs to completion.
        guard !cancellation.isCancelled else {
            throw FlashAttentionError.cancelled("cancelled by fa_context_cancel before the command buffer was committed")
        }
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        guard commandBuffer.status == .completed else {
            let text = commandBuffer.error?.localizedDescription ?? "status \(commandBuffer.status.rawValue)"
            if let error = commandBuffer.error as? MTLCommandBufferError {
                switch error.code {
                case .outOfMemory:
                    throw FlashAttentionError.outOfMemory("Metal command buffer failed: \(text)")
                case .timeout:
                    // One pass is one command buffer; the GPU watchdog bounds how long it may run.
                    throw FlashAttentionError.executionFailed(
                        "Metal command buffer failed: \(text) (the GPU watchdog stopped it: split the batch "
                            + "or the heads over several calls)")
                default:
                    break
                }
            }
            throw FlashAttentionError.executionFailed("Metal command buffer failed: \(text)")
        }
        for (host, buffer) in copyBack {
            host.copyMemory(from: UnsafeRawBufferPointer(start: buffer.contents(), count: host.count))
        }
        return Self.profile(plan, states: states, commandBuffers: [commandBuffer])
    }

    /// The profile of a completed call. MTLCommandBuffer gpuStartTime and gpuEndTime (host time in
    /// seconds, set once the GPU has finished the command buffer: read after waitUntilCompleted())
    /// give the GPU time, summed over the call's command buffers; MTLComputePipelineState
    /// staticThreadgroupMemoryLength gives each kernel's threadgroup memory. Metal has no counters
    /// of SIMD-group matrix products or barriers, and the kernels share command buffers, so those
    /// and per-dispatch times are left unmeasured (nil).
    private static func profile(_ plan: DispatchPlan, states: [MTLComputePipelineState],
                                commandBuffers: [MTLCommandBuffer]) -> Profile {
        Profile(seconds: commandBuffers.reduce(0.0) { $0 + ($1.gpuEndTime - $1.gpuStartTime) },
                dispatches: zip(plan.dispatches, states).map { dispatch, state in
                    DispatchProfile(dispatch, threadgroupMemoryLength: state.staticThreadgroupMemoryLength,
                                    simdgroupMultiplyAccumulates: nil, threadgroupBarriers: nil, seconds: nil)
                })
    }
}
#endif
