import CFlashAttentionMetal

/// What one forward, backward or merge call ran: its kernels in dispatch order and how long they took.
///
/// Read it with ``FlashAttention/lastProfile`` (or `fa_context_last_profile` in C) on the thread
/// that made the call. Times are measured, never estimated: on Metal the GPU time of the call's
/// command buffers, on the CPU engine the engine's wall time. Neither is an Apple GPU figure when
/// it comes from the CPU engine.
public struct Profile: Sendable, Equatable {
    /// Seconds the call's kernels ran. Metal: the GPU time of the call's command buffers,
    /// `gpuEndTime - gpuStartTime` summed over them. CPU engine: the wall time of its dispatches,
    /// summed.
    public var seconds: Double
    /// One record per kernel dispatch of the pass, in order, for the whole problem (forward: one
    /// or two; backward: three). When the pass ran in pieces, each record sums its pieces.
    public var dispatches: [DispatchProfile]
    /// The pieces the pass ran in: on Metal one command buffer each, so that none runs into the
    /// GPU watchdog (ranges of batch entries, or of KV heads with their query heads, of at most
    /// 2^35 FLOP each); on the CPU engine the same pieces in turn (one, as the CPU has no watchdog).
    public var commandBuffers: Int
    /// The GPU core count the split-KV chunks were planned for: `FLASH_ATTENTION_GPU_CORES` when
    /// set, else the device's (Metal: the IORegistry's `gpu-core-count`), else
    /// FA_NOMINAL_GPU_CORES (the CPU engine; docs/decode.md).
    public var gpuCores: Int
    /// The tensor-op route the plan took and why (`FLASH_ATTENTION_TENSOR_OPS` or the device's
    /// support), e.g. "tensor ops: FLASH_ATTENTION_TENSOR_OPS=1 (...)" or "simdgroup kernels: ...";
    /// the kernels that ran have `tensor` in their names where it was taken and one served the
    /// problem. Empty for a profile made by hand.
    public var tensorOps: String = ""

    /// Creates a profile from its parts.
    public init(seconds: Double, dispatches: [DispatchProfile], commandBuffers: Int = 1,
                gpuCores: Int = Int(FA_NOMINAL_GPU_CORES)) {
        self.seconds = seconds
        self.dispatches = dispatches
        self.commandBuffers = commandBuffers
        self.gpuCores = gpuCores
    }
}

/// One kernel dispatch of a ``Profile``: what was launched, and on the CPU engine what it executed.
public struct DispatchProfile: Sendable, Equatable {
    /// A 3-D size (x fastest), as in `MTLSize`.
    public struct Size: Sendable, Equatable {
        public var width: Int
        public var height: Int
        public var depth: Int

        /// Creates a size.
        public init(width: Int, height: Int, depth: Int) {
            self.width = width
            self.height = height
            self.depth = depth
        }
    }

    /// The kernel function's name, e.g. `flash_attention_forward_d64`.
    public var kernelName: String
    /// Threadgroups per grid, as passed to `dispatchThreadgroups`.
    public var threadgroupsPerGrid: Size
    /// Threads per threadgroup.
    public var threadsPerThreadgroup: Size
    /// Bytes of threadgroup memory the kernel declares statically. Metal: the pipeline's
    /// `staticThreadgroupMemoryLength`; CPU engine: the size of the kernel's threadgroup storage.
    public var threadgroupMemoryLength: Int
    /// 8x8x8 `simdgroup_multiply_accumulate` (and `simdgroup_multiply`) products the dispatch
    /// executed, counted once per SIMD-group call. CPU engine only; nil on Metal.
    public var simdgroupMultiplyAccumulates: UInt64?
    /// Threadgroup barriers the dispatch executed, counted once per threadgroup and barrier.
    /// CPU engine only; nil on Metal.
    public var threadgroupBarriers: UInt64?
    /// Bytes the dispatch read from each bound buffer, indexed by its `[[buffer(i)]]` index (the
    /// first FA_PROFILE_COUNTED_BUFFERS): the loads of the kernels' tile copies and decode slice
    /// loads (q, k, v, out, dout; not the masks, ALiBi slopes, sinks, lse or workspaces). CPU
    /// engine with `FLASH_ATTENTION_COUNT_DEVICE_READS=1` in the environment at the call only
    /// (the counting slows the engine); nil otherwise and on Metal.
    public var deviceBytesRead: [UInt64]?
    /// The function constants the kernel was specialised with (its pipeline's on Metal): the
    /// features it was compiled for (``SpecializationConstant``).
    public var specialization: [SpecializationConstant]
    /// The names of the constants of ``specialization`` that some thread read, in its order. CPU
    /// engine only; nil on Metal.
    public var functionConstantsRead: [String]?
    /// Wall time of this dispatch on the CPU engine; nil on Metal, where the call's kernels share
    /// command buffers and only ``Profile/seconds`` is measured.
    public var seconds: Double?

    /// Creates a dispatch record from its parts.
    public init(kernelName: String, threadgroupsPerGrid: Size, threadsPerThreadgroup: Size,
                threadgroupMemoryLength: Int, simdgroupMultiplyAccumulates: UInt64?,
                threadgroupBarriers: UInt64?, deviceBytesRead: [UInt64]? = nil,
                specialization: [SpecializationConstant] = [],
                functionConstantsRead: [String]? = nil, seconds: Double?) {
        self.kernelName = kernelName
        self.threadgroupsPerGrid = threadgroupsPerGrid
        self.threadsPerThreadgroup = threadsPerThreadgroup
        self.threadgroupMemoryLength = threadgroupMemoryLength
        self.simdgroupMultiplyAccumulates = simdgroupMultiplyAccumulates
        self.threadgroupBarriers = threadgroupBarriers
        self.deviceBytesRead = deviceBytesRead
        self.specialization = specialization
        self.functionConstantsRead = functionConstantsRead
        self.seconds = seconds
    }

    /// The record of a planned dispatch, with what the backend measured.
    init(_ dispatch: Dispatch, threadgroupMemoryLength: Int, simdgroupMultiplyAccumulates: UInt64?,
         threadgroupBarriers: UInt64?, deviceBytesRead: [UInt64]? = nil, functionConstantsRead: [String]?,
         seconds: Double?) {
        self.init(kernelName: dispatch.kernelName,
                  threadgroupsPerGrid: Size(dispatch.threadgroupsPerGrid),
                  threadsPerThreadgroup: Size(dispatch.threadsPerThreadgroup),
                  threadgroupMemoryLength: threadgroupMemoryLength,
                  simdgroupMultiplyAccumulates: simdgroupMultiplyAccumulates,
                  threadgroupBarriers: threadgroupBarriers, deviceBytesRead: deviceBytesRead,
                  specialization: dispatch.specialization,
                  functionConstantsRead: functionConstantsRead, seconds: seconds)
    }
}

extension DispatchProfile.Size {
    init(_ size: GridSize) {
        self.init(width: Int(size.width), height: Int(size.height), depth: Int(size.depth))
    }
}
