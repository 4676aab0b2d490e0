#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
#if canImport(ObjectiveC)
import ObjectiveC
#endif
import CFlashAttentionMetal

/// Which backend runs the kernels.
public enum Backend: Sendable, Equatable {
    /// Metal where it can run the kernels (an Apple-silicon GPU), else the CPU engine; see
    /// ``FlashAttention/backendNote`` for why.
    case auto
    /// An Apple GPU through Metal; `backendUnavailable` elsewhere, with the reason.
    case metal
    /// The CPU engine running the same `.metal` kernels.
    case cpu
}

/// What an `fa_context` points to: a backend and the C strings the ABI hands out. The backends are
/// thread-safe, so one context serves concurrent calls.
final class Context {
    let backend: ExecutionBackend
    private let lock = Lock()
    /// `strdup` copies of the names and notes handed to C: valid while the context lives, as the
    /// header promises (with `auto` the device name and the note can change after a call).
    private var cStrings: [String: UnsafeMutablePointer<CChar>] = [:]
    /// What `cancel()` advances and every call's token reads.
    private let cancellation = Cancellation()

    init(_ kind: Backend) throws {
        switch kind {
        case .cpu:
            backend = try CPUBackend()
        case .metal:
            backend = try Context.makeMetalBackend()
        case .auto:
            backend = try AutoBackend(makeMetal: Context.makeMetalBackend)
        }
    }

    /// A context around an existing backend (tests inject failing ones).
    init(backend: ExecutionBackend) {
        self.backend = backend
    }

    deinit { cStrings.values.forEach { free($0) } }

    /// A C copy of `text` that lives as long as the context; nil only when out of memory.
    func cString(_ text: String) -> UnsafePointer<CChar>? {
        lock.withLock {
            if let copy = cStrings[text] { return UnsafePointer(copy) }
            guard let copy = strdup(text) else { return nil }
            cStrings[text] = copy
            return UnsafePointer(copy)
        }
    }

    private static func makeMetalBackend() throws -> ExecutionBackend {
        #if canImport(Metal)
        return try MetalBackend()
        #else
        throw FlashAttentionError.backendUnavailable("Metal is not available on this platform")
        #endif
    }

    /// Plans `pass` for `problem` on the backend's GPU core count and tensor-op support
    /// (`DispatchPlan.make`, once) and
    /// runs that plan (`run(_:buffers:)`).
    /// - Throws: `invalidArgument` for a bad FLASH_ATTENTION_GPU_CORES, and as `run(_:buffers:)`.
    func run(_ pass: Pass, _ problem: Problem, buffers: HostBuffers) throws {
        try run(DispatchPlan.make(pass, problem, device: backend.gpuCores, tensorOps: backend.tensorOps),
                buffers: buffers)
    }

    /// Runs `plan` as it was made and keeps its profile as the calling thread's last one on this
    /// context; on failure (cancellation included) poisons its outputs and rethrows (the last
    /// profile stays that of the last success). Every entry point comes through here, so here is
    /// the check that needs the buffers: no output overlaps another bound buffer (`invalidArgument`
    /// before anything is written). Backward's lse values are not checked: every lse forward
    /// returns is valid (docs/semantics.md, "Non-finite values"). The profile reports the core
    /// count the plan was made for.
    func run(_ plan: DispatchPlan, buffers: HostBuffers) throws {
        try buffers.checkOutputsDisjoint(plan)
        let profile: Profile
        do {
            profile = try backend.execute(plan, buffers: buffers, cancellation: cancellation.token())
        } catch {
            buffers.poisonOutputs(of: plan)
            throw error
        }
        var planned = profile
        planned.gpuCores = Int(plan.problem.gpuCores ?? UInt32(FA_NOMINAL_GPU_CORES))
        planned.tensorOps = plan.tensorOps.reason
        ProfileStore.record(planned, for: self)
    }

    /// Cancels the calls in flight (see fa_context_cancel); thread-safe, returns at once.
    func cancel() { cancellation.cancel() }

    /// The profile of the calling thread's last successful call on this context; nil before one.
    var lastProfile: Profile? { ProfileStore.last(for: self) }
}

/// Runs `body` inside an autorelease pool where Objective-C exists: Metal objects are autoreleased,
/// and threads that Python or C start have no pool, so without one memory grows on every call.
@inline(__always)
func withAutoreleasePool<T>(_ body: () throws -> T) rethrows -> T {
    #if canImport(ObjectiveC)
    return try autoreleasepool(invoking: body)
    #else
    return try body()
    #endif
}
