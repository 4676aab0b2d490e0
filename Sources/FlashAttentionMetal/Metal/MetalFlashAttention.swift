// The kernels compiled for one MTLDevice, and the encoding of a plan (or a piece of one) into a
// command buffer: shared by the host path (MetalBackend.swift) and by apps that keep their tensors
// in their own MTLBuffers. Not compiled on Linux. Every Metal call was checked against Apple's
// documentation; the comments name each API with its availability where that is later than the
// package's platforms (macOS 13, iOS 16).
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
/// must belong to `device` and hold at least that many bytes, and no output may share memory with
/// another buffer of the call (both are checked). A call adds one compute encoder per kernel to the
/// command buffer; the results are ready when the command buffer completes. The whole pass goes into
/// that one command buffer, and macOS stops command buffers that run for seconds: split very large
/// work over several calls and command buffers (the host API, ``FlashAttention``, splits by itself).
///
/// What the caller owes Metal's rules:
/// - Hazards: Metal orders this call's reads after earlier writes to tracked buffers (the default)
///   and later reads after its writes. It does not for untracked buffers
///   (`.hazardTrackingModeUntracked`, or buffers from a heap with untracked hazard tracking, the
///   heap default): then order the commands that write the inputs before, and those that read the
///   outputs after, the encoders of this call yourself (an `MTLFence` within a queue, an `MTLEvent`
///   across queues). Between its own kernels the library passes data only through a workspace it
///   allocates per call (tracked, `.storageModePrivate`: D_i of the backward pass, the partial
///   results of the split-KV forward).
/// - Lifetimes: a command buffer made with `makeCommandBufferWithUnretainedReferences()` does not
///   keep the buffers alive; keep them until it completes. The library keeps its own workspace alive
///   until then either way.
///
/// Thread-safe: the library and the pipeline cache are shared; each call uses only the command
/// buffer it is given.
public final class MetalFlashAttention: @unchecked Sendable {
    /// The device the kernels were compiled for.
    public let device: MTLDevice
    /// Where the kernels came from, for users (``FlashAttention/backendNote``).
    let origin: String
    /// The device's GPU core count (`MetalBackend.cores(of:)`), which the plans encoded here are
    /// made for; nil when the IORegistry gives none.
    let gpuCores: UInt32?
    /// The device's matrix units and whether the tensor-op library compiled (`tensorLibrary`).
    let tensorOps: TensorOpsSupport
    /// One pipeline per kernel name and specialization, built on first use.
    private let pipelines: MetalPipelines

    /// Loads the precompiled `flash_attention-<hash>-msl<version>.metallib` that `./build.sh` puts
    /// next to the library when Metal accepts it; else compiles the embedded MSL source (Shaders/
    /// with its header spliced in), which needs no Metal toolchain but takes seconds. The tensor-op
    /// kernels the same way, as a library of their own where wanted (`tensorLibrary`). Pipelines are built per kernel
    /// and specialization (the function constants of its features) on first use.
    /// - Throws: ``FlashAttentionError/backendUnavailable(_:)`` when `device` is not an Apple-silicon
    ///   GPU (family Apple7: M1, A14 and later), ``FlashAttentionError/executionFailed(_:)`` with the
    ///   compiler's message when the source does not compile.
    public init(device: MTLDevice) throws {
        // MTLDevice.supportsFamily(_:) and MTLGPUFamily.apple7 (macOS 10.15+).
        guard device.supportsFamily(.apple7) else {
            throw FlashAttentionError.backendUnavailable(MetalFlashAttention.notAppleSilicon(device))
        }
        self.device = device
        let kernels = try MetalFlashAttention.libraries(for: device)
        let tensor = MetalFlashAttention.tensorLibrary(for: device)
        tensorOps = tensor.support
        origin = kernels.origin + (tensor.origin.map { "; " + $0 } ?? "")
        pipelines = MetalPipelines(device: device, libraries: kernels.libraries + (tensor.library.map { [$0] } ?? []),
                                   lost: kernels.lost)
        gpuCores = MetalBackend.cores(of: device)
    }

    /// Why `device` cannot run the kernels.
    static func notAppleSilicon(_ device: MTLDevice) -> String {
        "\(device.name) is not an Apple-silicon GPU (Metal GPU family Apple7 or later: M1, A14 and later), "
            + "which the kernels' SIMD-group matrices need"
    }

    // MARK: Library

    /// The libraries that hold the kernels, where they came from, and why a dtype's kernels are
    /// missing (by kernel suffix).
    private struct Kernels {
        let libraries: [MTLLibrary]
        let origin: String
        var lost: [String: String] = [:]
    }

    private static func libraries(for device: MTLDevice) throws -> Kernels {
        var why = "no \(PrecompiledShaders.fileNames) for this OS next to the library"
        // The newest version this OS runs (PrecompiledShaders.path); MSL 3.0's has no bfloat16 kernels.
        if let url = precompiledLibraryURL() {
            do {
                // MTLDevice.makeLibrary(URL:) (macOS 10.13+), throws when it cannot load the file.
                return Kernels(libraries: [try device.makeLibrary(URL: url)], origin: "kernels from \(url.path)")
            } catch {
                why = "\(url.path) was refused: \(error.localizedDescription)"
            }
        }
        let compiled = "kernels compiled from the embedded source when the context was created (\(why)"
        // MTLDevice.makeLibrary(source:options:): no include path, hence the spliced header. The
        // whole source at the newest version the OS has (MSL 3.1 where it has bfloat).
        let versions = try languageVersions()
        let whole: String
        do {
            return Kernels(libraries: [try device.makeLibrary(source: EmbeddedShaders.source,
                                                              options: compileOptions(versions[0]))],
                           origin: compiled + ")")
        } catch {
            whole = "MSL \(name(versions[0])) failed: " + error.localizedDescription
        }
        // That failed: each dtype alone (a prelude defining FA_DTYPES), at each version in turn
        // (bfloat16 only from MSL 3.1), so that a compiler failure loses only its dtype.
        var libraries: [MTLLibrary] = []
        var lost: [String: String] = [:]
        for dtype in AttentionDType.allCases {
            var failures: [String] = []
            for version in versions where dtype != .bfloat16 || version.rawValue & 0xFFFF >= UInt(FA_MSL_BFLOAT_VERSION_MINOR) {
                do {
                    libraries.append(try device.makeLibrary(source: "#define FA_DTYPES \(dtypeMask(dtype))\n"
                                                                + EmbeddedShaders.source,
                                                            options: compileOptions(version)))
                    failures = []
                    break
                } catch {
                    failures.append("MSL \(name(version)) failed: " + error.localizedDescription)
                }
            }
            if !failures.isEmpty { lost[dtype.kernelSuffix] = failures.joined(separator: "; ") }
        }
        guard !libraries.isEmpty else {
            throw FlashAttentionError.executionFailed(
                "Metal could not compile the embedded shaders for \(device.name): \(whole); each dtype alone: "
                    + AttentionDType.allCases.compactMap { lost[$0.kernelSuffix].map { "\($0)" } }.joined(separator: "; "))
        }
        let missing = AttentionDType.allCases.compactMap { dtype in
            lost[dtype.kernelSuffix].map { "without the \(dtype) kernels: \($0)" }
        }
        return Kernels(libraries: libraries,
                       origin: compiled + "; the whole source did not compile (\(whole)), so each dtype was compiled "
                           + "alone" + missing.map { "; " + $0 }.joined() + ")",
                       lost: lost)
    }

    /// The tensor-op kernels' library, what the device offers them, and where the kernels came
    /// from for the backend note (nil where no library was wanted). Matrix units:
    /// `TensorOpsSupport.units` of MTLDevice.architecture.name (e.g. `applegpu_g17s`, the M5's Apple
    /// GPU family 10); Metal has no query for the units themselves. The library is made only where
    /// the route may take it (`TensorOps.wantsLibrary`: matrix units, or FLASH_ATTENTION_TENSOR_OPS=1
    /// when the context is made; never with 0): `precompiled` (build.sh's MSL 4.0 .metallib of
    /// exactly EmbeddedShaders.tensorSource, PrecompiledShaders.tensorPath) when Metal accepts it
    /// (MTLDevice.makeLibrary(URL:) throws otherwise, e.g. for a file built for a newer OS), else
    /// the embedded tensor-op source compiled at MSL 4.0. A compile failure loses only this path;
    /// its reason goes into the support's detail (the profile's route) and the origin (the backend
    /// note). MTLLanguageVersion raw value 4 << 16 is version4_0 (macOS 26+, spelled by value so
    /// that older SDKs build): an imported C enum's init(rawValue:) accepts any value, so the OS
    /// check, not the optional, keeps 4.0 from an OS without it; the check asks for 26.2, the
    /// floor of `TensorOps.wantsLibrary`.
    static func tensorLibrary(for device: MTLDevice, precompiled: String? = PrecompiledShaders.tensorPath)
        -> (library: MTLLibrary?, support: TensorOpsSupport, origin: String?) {
        let (units, what) = MetalBackend.architecture(of: device).map(TensorOpsSupport.units(architecture:))
            ?? (false, "MTLDevice.architecture needs macOS 14 or iOS 17")
        guard TensorOps.wantsLibrary(hasUnits: units) else {
            return (nil, TensorOpsSupport(hasUnits: units, hasKernels: false, detail: what + "; no tensor-op library"), nil)
        }
        func lost(_ why: String) -> (library: MTLLibrary?, support: TensorOpsSupport, origin: String?) {
            (nil, TensorOpsSupport(hasUnits: units, hasKernels: false, detail: what + "; " + why),
             "no tensor-op kernels: " + why)
        }
        var absent = "no \(PrecompiledShaders.tensorFileName) for this OS next to the library"
        if let path = precompiled {
            do {
                let library = try device.makeLibrary(URL: URL(fileURLWithPath: path))
                return (library, TensorOpsSupport(hasUnits: units, hasKernels: true, detail: what),
                        "tensor-op kernels from \(path)")
            } catch {
                absent = "\(path) was refused: \(error.localizedDescription)"
            }
        }
        guard #available(macOS 26.2, iOS 26.2, tvOS 26.2, visionOS 26.2, *),
              let version = MTLLanguageVersion(rawValue: 4 << 16) else {
            return lost("the tensor-op library needs MSL 4.0 on macOS 26.2 or iOS 26.2; \(absent)")
        }
        do {
            let library = try device.makeLibrary(source: EmbeddedShaders.tensorSource, options: compileOptions(version))
            return (library, TensorOpsSupport(hasUnits: units, hasKernels: true, detail: what),
                    "tensor-op kernels compiled from the embedded source at MSL 4.0 (\(absent))")
        } catch {
            return lost("the tensor-op library (MSL 4.0) did not compile: \(error.localizedDescription); \(absent)")
        }
    }

    /// FA_DTYPE_MASK_* of `dtype` (Shaders/flash_attention_params.h).
    private static func dtypeMask(_ dtype: AttentionDType) -> Int32 {
        switch dtype {
        case .float16: return FA_DTYPE_MASK_F16
        case .bfloat16: return FA_DTYPE_MASK_BF16
        case .float32: return FA_DTYPE_MASK_F32
        }
    }

    /// "3.1" for MSL 3.1.
    private static func name(_ version: MTLLanguageVersion) -> String {
        "\(version.rawValue >> 16).\(version.rawValue & 0xFFFF)"
    }

    /// The .metallib next to the library (``PrecompiledShaders/path``).
    private static func precompiledLibraryURL() -> URL? {
        PrecompiledShaders.path.map { URL(fileURLWithPath: $0) }
    }

    /// The language versions to compile at, in order: FA_MSL_VERSION_MAJOR.FA_MSL_BFLOAT_VERSION_MINOR
    /// (3.1, which adds the bfloat16 kernels) where the OS has it (macOS 14, iOS 17), then
    /// FA_MSL_VERSION_MAJOR.FA_MSL_VERSION_MINOR (3.0). MTLLanguageVersion raw values are
    /// major << 16 | minor (version3_0 = 196608, version3_1 = 196609;
    /// developer.apple.com/documentation/metal/mtllanguageversion).
    private static func languageVersions() throws -> [MTLLanguageVersion] {
        var minors = [UInt(FA_MSL_VERSION_MINOR)]
        if #available(macOS 14.0, iOS 17.0, tvOS 17.0, visionOS 1.0, *) {
            minors.insert(UInt(FA_MSL_BFLOAT_VERSION_MINOR), at: 0)
        }
        return try minors.map { minor in
            let raw = UInt(FA_MSL_VERSION_MAJOR) << 16 | minor
            guard let version = MTLLanguageVersion(rawValue: raw) else {
                throw FlashAttentionError.internalError("no MTLLanguageVersion for raw value \(raw)")
            }
            return version
        }
    }

    /// The options build.sh's `xcrun metal` uses too: `version` and safe math with precise
    /// functions, so that infinities (lse of a row without keys) and exp/log precision are as the
    /// CPU engine computes them. MTLCompileOptions.fastMathEnabled = false sets mathMode .safe and
    /// mathFloatingPointFunctions .precise (developer.apple.com/documentation/metal/mtlcompileoptions/
    /// mathmode); it exists in every SDK (deprecated from macOS 15 and iOS 18, where mathMode
    /// replaces it), so one line serves every Xcode from 15 on.
    private static func compileOptions(_ version: MTLLanguageVersion) -> MTLCompileOptions {
        let options = MTLCompileOptions()
        options.languageVersion = version
        options.fastMathEnabled = false
        return options
    }

    // MARK: Pipelines

    /// The pipeline of `dispatch`'s kernel, after checking that the dispatch fits it: register
    /// pressure can lower maxTotalThreadsPerThreadgroup below the threadgroup size, and an
    /// oversized dispatch has been seen to run silently as zeros.
    func checkedPipeline(for dispatch: Dispatch) throws -> MTLComputePipelineState {
        let state = try pipelines.pipeline(for: dispatch)
        let size = dispatch.threadsPerThreadgroup
        let threads = Int(size.width) * Int(size.height) * Int(size.depth)
        // MTLComputePipelineState.maxTotalThreadsPerThreadgroup, .staticThreadgroupMemoryLength
        // (macOS 11+); MTLDevice.maxThreadgroupMemoryLength (macOS 10.13+).
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

    // MARK: Encoding

    /// Encodes the forward pass: `out` and `lse` from `q`, `k`, `v` (contiguous, elements of
    /// `dtype`; `lse` float32).
    /// - Parameters:
    ///   - dtype: the element type of every buffer but `lse`.
    ///   - softmaxScale: any finite value; nil means `1 / sqrt(headDim)`.
    /// - Throws: ``FlashAttentionError/invalidArgument(_:)`` for a bad shape, a buffer that is too
    ///   small or from another device, an output sharing memory with another buffer, or a command
    ///   buffer of another device; ``FlashAttentionError/unsupported(_:)`` when a kernel needs more
    ///   than the device offers. Nothing is encoded when it throws.
    public func encodeForward(into commandBuffer: MTLCommandBuffer, q: MTLBuffer, k: MTLBuffer, v: MTLBuffer,
                              out: MTLBuffer, lse: MTLBuffer, shape: AttentionShape, dtype: AttentionDType = .float16,
                              causal: Bool = false, softmaxScale: Float? = nil) throws {
        try withAutoreleasePool {
            let problem = try Problem.validate(shape, dtype: dtype, causal: causal, softmaxScale: softmaxScale)
            try encode(.forward, problem, buffers: [.q: q, .k: k, .v: v, .out: out, .lse: lse],
                       into: commandBuffer)
        }
    }

    /// Encodes the backward pass: `dq`, `dk`, `dv` from `dout` and the `q`, `k`, `v`, `out`, `lse`
    /// of the forward pass. `dk` and `dv` sum over the query heads that share a KV head. `lse` is
    /// not read on the host (no path checks its values): a row whose lse is -inf gets zero
    /// gradients, one whose lse is NaN or +inf NaN gradients.
    /// - Throws: as ``encodeForward(into:q:k:v:out:lse:shape:dtype:causal:softmaxScale:)``.
    public func encodeBackward(into commandBuffer: MTLCommandBuffer, dout: MTLBuffer, q: MTLBuffer, k: MTLBuffer,
                               v: MTLBuffer, out: MTLBuffer, lse: MTLBuffer, dq: MTLBuffer, dk: MTLBuffer,
                               dv: MTLBuffer, shape: AttentionShape, dtype: AttentionDType = .float16,
                               causal: Bool = false, softmaxScale: Float? = nil) throws {
        try withAutoreleasePool {
            let problem = try Problem.validate(shape, dtype: dtype, causal: causal, softmaxScale: softmaxScale)
            try encode(.backward, problem,
                       buffers: [.dout: dout, .q: q, .k: k, .v: v, .out: out, .lse: lse, .dq: dq, .dk: dk, .dv: dv],
                       into: commandBuffer)
        }
    }

    /// Encodes the merge of two attention results over disjoint key sets (see
    /// ``FlashAttention/mergeAttention(outA:lseA:outB:lseB:out:lse:headDim:)``): `outA`, `outB`,
    /// `out` `[rows][headDim]` elements of `dtype`, `lseA`, `lseB`, `lse` float32 `[rows]`.
    /// - Throws: as ``encodeForward(into:q:k:v:out:lse:shape:dtype:causal:softmaxScale:)``, and
    ///   ``FlashAttentionError/invalidArgument(_:)`` for `rows` outside `1...UInt32.max`.
    public func encodeMerge(into commandBuffer: MTLCommandBuffer, outA: MTLBuffer, lseA: MTLBuffer, outB: MTLBuffer,
                            lseB: MTLBuffer, out: MTLBuffer, lse: MTLBuffer, rows: Int, headDim: Int,
                            dtype: AttentionDType = .float16) throws {
        try withAutoreleasePool {
            guard rows >= 1 else { throw FlashAttentionError.invalidArgument("rows (\(rows)) must be at least 1") }
            let problem = try Problem.merge(rows: UInt64(rows), headDim: headDim, dtype: dtype)
            try encode(.merge, problem,
                       buffers: [.outA: outA, .lseA: lseA, .outB: outB, .lseB: lseB, .out: out, .lse: lse],
                       into: commandBuffer)
        }
    }

    /// The app path: the plan of `pass` for `problem` on this device's core count, every check,
    /// then the whole plan into `commandBuffer`.
    private func encode(_ pass: Pass, _ problem: Problem, buffers: [BufferRole: MTLBuffer],
                        into commandBuffer: MTLCommandBuffer) throws {
        let plan = try DispatchPlan.make(pass, problem, device: gpuCores, tensorOps: tensorOps)
        // MTLCommandBuffer.status: encoders and addCompletedHandler(_:) only before commit().
        guard commandBuffer.status == .notEnqueued || commandBuffer.status == .enqueued else {
            throw FlashAttentionError.invalidArgument(
                "the command buffer was already committed (MTLCommandBufferStatus \(commandBuffer.status.rawValue)); "
                    + "pass one that is not committed yet")
        }
        guard commandBuffer.device === device else {
            throw FlashAttentionError.invalidArgument(
                "the command buffer belongs to \(commandBuffer.device.name), not to \(device.name), the device "
                    + "the kernels were compiled for")
        }
        var ranges: [(role: BufferRole, start: UInt64, end: UInt64)] = []
        var hostRanges: [(role: BufferRole, start: UInt64, end: UInt64)] = []
        for role in plan.boundRoles where !plan.workspace.contains(role) {
            guard let buffer = buffers[role] else {
                throw FlashAttentionError.internalError("no buffer for \(role.name)")
            }
            guard buffer.device === device else {
                throw FlashAttentionError.invalidArgument("\(role.name) belongs to another MTLDevice")
            }
            let needed = role.byteCount(for: plan.problem)
            guard buffer.length >= needed else {
                throw FlashAttentionError.invalidArgument(
                    "\(role.name) has \(buffer.length) bytes; the shape needs \(needed)")
            }
            // MTLBuffer.gpuAddress (macOS 13+, iOS 16+) finds one buffer or heap bound twice;
            // MTLBuffer.contents() (CPU-visible storage only) finds two bytesNoCopy buffers over one
            // allocation, which may have different GPU addresses.
            ranges.append((role, buffer.gpuAddress, buffer.gpuAddress + UInt64(needed)))
            // contents() is NULL for .private; .managed exists on macOS and Mac Catalyst only.
            var cpuVisible = buffer.storageMode == .shared
            #if os(macOS) || targetEnvironment(macCatalyst)
            cpuVisible = cpuVisible || buffer.storageMode == .managed
            #endif
            if cpuVisible {
                let start = UInt64(UInt(bitPattern: buffer.contents()))
                hostRanges.append((role, start, start + UInt64(needed)))
            }
        }
        for list in [ranges, hostRanges] {
            for output in list where plan.outputs.contains(output.role) {
                for other in list
                where other.role != output.role && other.start < output.end && output.start < other.end {
                    throw FlashAttentionError.invalidArgument(
                        "\(output.role.name) shares memory with \(other.role.name): an output may not alias "
                            + "another output or an input")
                }
            }
        }
        let workspace = try makeWorkspace(for: plan)
        try encode(PlanPiece(whole: plan), buffers: buffers.merging(workspace) { app, _ in app },
                   into: commandBuffer)
        // The command buffer may not retain its resources (unretained references): this closure
        // keeps the workspace alive until it completes. The handler is @Sendable; MTLBuffer need not
        // be, so the workspace travels in a box that only keeps it alive.
        let keepAlive = KeepAlive(workspace)
        commandBuffer.addCompletedHandler { _ in withExtendedLifetime(keepAlive) {} }
    }

    /// The plan's workspace roles for the whole problem, in GPU-only memory: MTLDevice
    /// makeBuffer(length:options:) with .storageModePrivate, tracked by Metal's hazard tracking
    /// (the default), so a kernel that reads it waits for the one that wrote it.
    func makeWorkspace(for plan: DispatchPlan) throws -> [BufferRole: MTLBuffer] {
        var workspace: [BufferRole: MTLBuffer] = [:]
        for role in plan.workspace {
            let bytes = role.byteCount(for: plan.problem)
            guard bytes <= device.maxBufferLength else {
                throw FlashAttentionError.unsupported(
                    "the \(role.name) workspace (\(bytes) bytes) exceeds the largest buffer of \(device.name) "
                        + "(maxBufferLength \(device.maxBufferLength))")
            }
            guard let buffer = device.makeBuffer(length: max(bytes, 1), options: .storageModePrivate) else {
                throw FlashAttentionError.outOfMemory(
                    "Metal could not allocate \(bytes) bytes on \(device.name) for the \(role.name) workspace")
            }
            workspace[role] = buffer
        }
        return workspace
    }

    /// Encodes `piece` into `commandBuffer`: one compute encoder per dispatch, in order, labelled
    /// with its kernel name (a GPU fault then names the kernel), each buffer bound at the piece's
    /// offset. Every pipeline is checked before the first encoder exists.
    func encode(_ piece: PlanPiece, buffers: [BufferRole: MTLBuffer], into commandBuffer: MTLCommandBuffer) throws {
        let dispatches = piece.plan.dispatches
        let states = try dispatches.map { try checkedPipeline(for: $0) }
        for role in piece.plan.boundRoles where buffers[role] == nil {
            throw FlashAttentionError.internalError("no Metal buffer for \(role.name)")
        }
        for (dispatch, state) in zip(dispatches, states) {
            // MTLCommandBuffer.makeComputeCommandEncoder(); MTLComputeCommandEncoder
            // setComputePipelineState(_:), setBuffer(_:offset:index:) (device buffers: offsets are
            // multiples of the element size), setBytes(_:length:index:) (below 4 KB: the parameter
            // struct, MemoryLayout<FlashAttentionParams>.stride bytes), dispatchThreadgroups(_:threadsPerThreadgroup:), endEncoding().
            guard let encoder = commandBuffer.makeComputeCommandEncoder() else {
                throw FlashAttentionError.executionFailed("Metal could not create a compute command encoder")
            }
            encoder.label = dispatch.kernelName
            encoder.setComputePipelineState(state)
            for binding in dispatch.bindings {
                encoder.setBuffer(buffers[binding.role], offset: piece.byteOffset(of: binding.role),
                                  index: binding.index)
            }
            // The plan's roles, not only this dispatch's: a varlen pass's first dispatch copies its
            // struct into the sequence table that the kernels reading q, k, v, out, dout use.
            let bound = piece.plan.boundRoles
            var params = dispatch.params.checkingAlignment { role in
                bound.contains(role) ? UInt(piece.byteOffset(of: role)) : nil
            }
            if let role = dispatch.paramsRole {
                encoder.setBuffer(buffers[role], offset: 0, index: dispatch.paramsIndex)
            } else {
                encoder.setBytes(&params, length: MemoryLayout<FlashAttentionParams>.stride, index: dispatch.paramsIndex)
            }
            encoder.dispatchThreadgroups(metalSize(dispatch.threadgroupsPerGrid),
                                         threadsPerThreadgroup: metalSize(dispatch.threadsPerThreadgroup))
            encoder.endEncoding()
        }
    }

    private func metalSize(_ size: GridSize) -> MTLSize {
        MTLSize(width: Int(size.width), height: Int(size.height), depth: Int(size.depth))
    }
}

/// Holds Metal objects until a command buffer's completed handler (a @Sendable closure) has run;
/// nothing reads them through it.
private final class KeepAlive: @unchecked Sendable {
    private let objects: [BufferRole: MTLBuffer]
    init(_ objects: [BufferRole: MTLBuffer]) { self.objects = objects }
}
#endif
