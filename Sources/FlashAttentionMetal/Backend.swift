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

    /// Throws `invalidArgument` when an output or a cache (read-write role) of `plan` shares memory
    /// with another bound buffer: a kernel that reads an element after another thread wrote it
    /// would give a result that depends on scheduling. The caches are exempt among themselves: the
    /// pass writes only rows it appends, which the checks of the append keep apart, so K and V may
    /// be views of one allocation (vLLM's (blocks, 2, ...) cache).
    func checkOutputsDisjoint(_ plan: DispatchPlan) throws {
        let bound = BufferRole.allCases.compactMap { role in self[role].map { (role, $0) } }
        let caches = plan.caches
        for written in plan.outputs + caches {
            guard let span = self[written], let start = span.baseAddress, span.count > 0 else { continue }
            for (role, other) in bound where role != written && !(caches.contains(written) && caches.contains(role)) {
                guard let otherStart = other.baseAddress, other.count > 0 else { continue }
                if start < otherStart + other.count && otherStart < start + span.count {
                    let what = caches.contains(written) ? "(a KV cache, read and written in place)"
                        : "(outputs are written while inputs are read)"
                    throw FlashAttentionError.invalidArgument("\(written.name) must not overlap \(role.name) \(what)")
                }
            }
        }
    }

    /// Copies output `role` from `source`, memory laid out as the caller's buffer (the Metal
    /// backend's own output buffers), writing only the elements the role's layout addresses: the
    /// bytes between the rows of a strided output stay the caller's, as the CPU backend leaves
    /// them. Float32 roles (lse, dsinks) are dense and copied whole.
    func copyOutput(_ role: BufferRole, from source: UnsafeRawPointer, of problem: Problem) {
        guard let buffer = self[role], let base = buffer.baseAddress else { return }
        guard !role.isFloat32, let layout = problem.layouts[role] else {
            base.copyMemory(from: source, byteCount: buffer.count)
            return
        }
        let size = problem.dtype.size
        layout.forEachRow { start in
            (base + start * size).copyMemory(from: source + start * size, byteCount: layout.cols * size)
        }
    }

    /// Overwrites the elements of the plan's outputs with NaN of their dtype (float16 0x7E00,
    /// bfloat16 0x7FC0, float32 NaN) so that the outputs of a failed call never look like results.
    /// A strided output is written only where its layout addresses elements.
    func poisonOutputs(of plan: DispatchPlan) {
        let problem = plan.problem
        for role in plan.outputs {
            guard let buffer = self[role] else { continue }
            if role.isFloat32 {
                buffer.bindMemory(to: Float.self).initialize(repeating: .nan)
                continue
            }
            guard let layout = problem.layouts[role] else { continue }
            switch problem.dtype {
            case .float32:
                let elements = buffer.bindMemory(to: Float.self)
                layout.forEachRow { start in elements[start..<start + layout.cols].update(repeating: .nan) }
            case .float16, .bfloat16:
                let nan: UInt16 = problem.dtype == .float16 ? 0x7E00 : 0x7FC0
                let elements = buffer.bindMemory(to: UInt16.self)
                layout.forEachRow { start in elements[start..<start + layout.cols].update(repeating: nan) }
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
    /// The device's GPU core count where the backend reads one (Metal: the IORegistry's
    /// `gpu-core-count`), for the split-KV plan (`GPUCores.planned`); nil for the CPU engine, which
    /// plans for the nominal GPU.
    var gpuCores: UInt32? { get }
    /// What the backend offers the tensor-op kernels, for the plan's route (`TensorOps.route`):
    /// Metal's device and tensor-op library; the CPU engine's emulation (`.cpuEngine`).
    var tensorOps: TensorOpsSupport { get }
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
    var gpuCores: UInt32? { nil }
    var tensorOps: TensorOpsSupport { .cpuEngine }
    func prepare(_ plan: DispatchPlan) throws {}
}
