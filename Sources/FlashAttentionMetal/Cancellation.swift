import MSLEngine

/// The cancellation state of one context: an epoch counter (the engine's `msl_engine_cancellation`,
/// atomic and lock-free) that `cancel()` advances. A call takes a ``CancellationToken`` when it
/// starts, and the token reads as cancelled once the epoch has moved on: a cancel reaches the calls
/// in flight and never a call that starts after it.
final class Cancellation {
    private let state: UnsafeMutablePointer<msl_engine_cancellation>

    init() {
        state = .allocate(capacity: 1)
        state.initialize(to: msl_engine_cancellation(epoch: 0))
    }

    deinit {
        state.deinitialize(count: 1)
        state.deallocate()
    }

    /// Cancels every call whose token was taken before now. Thread-safe; returns at once.
    func cancel() { msl_engine_cancel(state) }

    /// The token of a call that starts now.
    func token() -> CancellationToken {
        CancellationToken(state: state, startEpoch: msl_engine_cancellation_epoch(state))
    }
}

/// What one call checks between units of work: the CPU engine before each threadgroup, the Metal
/// backend before each command buffer. Valid while its ``Cancellation`` lives (the context does for
/// the whole call).
struct CancellationToken {
    let state: UnsafePointer<msl_engine_cancellation>
    let startEpoch: UInt64

    init(state: UnsafeMutablePointer<msl_engine_cancellation>, startEpoch: UInt64) {
        self.state = UnsafePointer(state)
        self.startEpoch = startEpoch
    }

    var isCancelled: Bool { msl_engine_cancellation_epoch(state) != startEpoch }
}
