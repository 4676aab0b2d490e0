import CFlashAttentionMetal

/// Host memory for the roles of one pass: each buffer holds exactly `role.byteCount(for:)` bytes.
/// Read-only roles are stored as mutable pointers because both backends bind buffers through
/// mutable pointer types; the kernels never write them.
struct HostBuffers {
    private var storage = [UnsafeMutableRawBufferPointer?](repeating: nil, count: BufferRole.allCases.count)

    subscript(role: BufferRole) -> UnsafeMutableRawBufferPointer? {
        get { storage[role.rawValue] }
        set { storage[role.rawValue] = newValue }
    }

    /// Binds a read-only role.
    mutating func bindInput(_ role: BufferRole, _ pointer: UnsafeRawPointer, for problem: Problem) {
        self[role] = UnsafeMutableRawBufferPointer(start: UnsafeMutableRawPointer(mutating: pointer),
                                                   count: role.byteCount(for: problem))
    }

    /// Binds a written role.
    mutating func bindOutput(_ role: BufferRole, _ pointer: UnsafeMutableRawPointer, for problem: Problem) {
        self[role] = UnsafeMutableRawBufferPointer(start: pointer, count: role.byteCount(for: problem))
    }

    /// Overwrites the plan's outputs with NaN (float16 0x7E00, float32 NaN) so that the outputs of
    /// a failed call never look like results.
    func poisonOutputs(of plan: DispatchPlan) {
        for role in plan.outputs {
            guard let buffer = self[role] else { continue }
            if role.elementSize == 4 {
                buffer.bindMemory(to: Float.self).initialize(repeating: .nan)
            } else {
                buffer.bindMemory(to: UInt16.self).initialize(repeating: 0x7E00)
            }
        }
    }
}

/// Runs dispatch plans on host memory. Implementations are thread-safe: one instance serves
/// concurrent calls.
protocol ExecutionBackend: AnyObject {
    /// "metal" or "cpu".
    var name: StaticString { get }
    /// The device the kernels run on, for users.
    var deviceName: String { get }
    /// How the backend came to be what it is, for users ("" when there is nothing to say): where
    /// the Metal kernels came from, or why `auto` runs on the CPU engine.
    var note: String { get }
    /// Checks, before anything is written, that every kernel of `plan` can run here (Metal: the
    /// device is usable and each pipeline builds and fits the device); `execute` checks the same.
    /// Throws `FlashAttentionError`.
    func prepare(_ plan: DispatchPlan) throws
    /// Runs every dispatch of `plan` in order (in pieces, see `DispatchPlan.pieces(maxFlops:)`) and
    /// returns when all have finished, with what ran (one `DispatchProfile` per dispatch of the plan,
    /// in order, and the number of pieces). Throws `FlashAttentionError` with the device's or
    /// engine's message on failure, `.cancelled` when `cancellation` stopped it (outputs then hold
    /// unspecified values; the caller poisons them).
    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile
}

extension ExecutionBackend {
    var note: String { "" }
    func prepare(_ plan: DispatchPlan) throws {}
}
