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
    /// Metal where a Metal device exists, else the CPU engine.
    case auto
    /// An Apple GPU through Metal; `backendUnavailable` elsewhere.
    case metal
    /// The CPU engine running the same `.metal` kernels.
    case cpu
}

/// What an `fa_context` points to: a backend and the C strings the ABI hands out. Immutable after
/// creation, and the backends are thread-safe, so one context serves concurrent calls.
final class Context {
    let backend: ExecutionBackend
    /// `strdup` of the device name: valid while the context lives, as the header promises.
    let deviceNameCString: UnsafeMutablePointer<CChar>?
    /// What `cancel()` advances and every call's token reads.
    private let cancellation = Cancellation()

    init(_ kind: Backend) throws {
        switch kind {
        case .cpu:
            backend = try CPUBackend()
        case .metal:
            backend = try Context.makeMetalBackend()
        case .auto:
            // Auto falls back to the CPU only when Metal is absent or has no device, never to hide a
            // Metal failure of another kind.
            do {
                backend = try Context.makeMetalBackend()
            } catch FlashAttentionError.backendUnavailable {
                backend = try CPUBackend()
            }
        }
        deviceNameCString = strdup(backend.deviceName)
    }

    /// A context around an existing backend (tests inject failing ones).
    init(backend: ExecutionBackend) {
        self.backend = backend
        deviceNameCString = strdup(backend.deviceName)
    }

    deinit { free(deviceNameCString) }

    private static func makeMetalBackend() throws -> ExecutionBackend {
        #if canImport(Metal)
        return try MetalBackend()
        #else
        throw FlashAttentionError.backendUnavailable("Metal is not available on this platform")
        #endif
    }

    /// Runs `plan` and keeps its profile as the calling thread's last one on this context; on
    /// failure (cancellation included) poisons its outputs and rethrows (the last profile stays
    /// that of the last success).
    func run(_ plan: DispatchPlan, buffers: HostBuffers) throws {
        let profile: Profile
        do {
            profile = try backend.execute(plan, buffers: buffers, cancellation: cancellation.token())
        } catch {
            buffers.poisonOutputs(of: plan)
            throw error
        }
        ProfileStore.record(profile, for: self)
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
