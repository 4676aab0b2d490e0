/// `Backend.auto`: the Metal backend where it can run the kernels, else the CPU engine, which runs
/// the same kernels everywhere. Metal is given up for good when it cannot be set up (no device, not
/// an Apple-silicon GPU, the shaders do not compile) or the device is lost (access revoked, device
/// removed: `prepare` then reports `backendUnavailable`); a plan whose pipelines Metal cannot build
/// or fit runs on the CPU engine while the others stay on Metal. Each fallback is kept in `note`.
/// An error while a plan runs (a page fault, a timeout) is reported, not retried on the CPU.
final class AutoBackend: ExecutionBackend {
    private let lock = Lock()
    private var metal: ExecutionBackend?
    private var cpu: ExecutionBackend?
    private var notes: [String] = []

    /// - Parameter makeMetal: the Metal backend, or why there is none.
    init(makeMetal: () throws -> ExecutionBackend) throws {
        do {
            metal = try makeMetal()
        } catch {
            notes.append("the CPU engine runs the kernels: \(AutoBackend.message(error))")
            cpu = try CPUBackend()
        }
    }

    var name: StaticString { lock.withLock { metal?.name ?? "cpu" } }

    var deviceName: String {
        lock.withLock { (metal ?? cpu)?.deviceName ?? "" }
    }

    var note: String {
        lock.withLock { ([metal?.note ?? ""] + notes).filter { !$0.isEmpty }.joined(separator: "; ") }
    }

    var gpuCores: UInt32? {
        lock.withLock { metal?.gpuCores }
    }

    /// Metal's while it is used (a plan it cannot prepare runs on the CPU engine, which runs
    /// tensor-op kernels too); the CPU engine's after Metal was given up.
    var tensorOps: TensorOpsSupport {
        lock.withLock { metal?.tensorOps ?? .cpuEngine }
    }

    func prepare(_ plan: DispatchPlan) throws {
        try runner(for: plan).prepare(plan)
    }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        try runner(for: plan).execute(plan, buffers: buffers, cancellation: cancellation)
    }

    /// Metal when it can run `plan`, else the CPU engine (recording why).
    private func runner(for plan: DispatchPlan) throws -> ExecutionBackend {
        if let metal = lock.withLock({ metal }) {
            do {
                try metal.prepare(plan)
                return metal
            } catch FlashAttentionError.backendUnavailable(let reason) {
                return try fallBack(note: "the CPU engine runs the kernels since Metal became unusable: \(reason)",
                                    forGood: true)
            } catch {
                let kernels = plan.dispatches.map(\.kernelName).joined(separator: ", ")
                return try fallBack(note: "the CPU engine runs \(kernels): \(AutoBackend.message(error))",
                                    forGood: false)
            }
        }
        return try fallBack(note: nil, forGood: false)
    }

    private func fallBack(note: String?, forGood: Bool) throws -> ExecutionBackend {
        try lock.withLock {
            if forGood { metal = nil }
            if let note, !notes.contains(note) { notes.append(note) }
            if let cpu { return cpu }
            let created = try CPUBackend()
            cpu = created
            return created
        }
    }

    private static func message(_ error: Error) -> String {
        (error as? FlashAttentionError)?.message ?? "\(error)"
    }
}
