@testable import FlashAttentionMetal

/// The plans a CPU context makes (`DispatchPlan.make` for no device: FLASH_ATTENTION_GPU_CORES when
/// set, else the nominal GPU), for tests that inspect or run a plan of a validated problem.
extension DispatchPlan {
    static func forward(_ problem: Problem) -> DispatchPlan { cpuPlan(.forward, problem) }
    static func backward(_ problem: Problem) -> DispatchPlan { cpuPlan(.backward, problem) }
    static func merge(_ problem: Problem) -> DispatchPlan { cpuPlan(.merge, problem) }

    /// The tests that set a bad FLASH_ATTENTION_GPU_CORES call the planner itself.
    private static func cpuPlan(_ pass: Pass, _ problem: Problem) -> DispatchPlan {
        try! make(pass, problem, device: nil)
    }
}

extension Problem {
    /// The split-KV chunking a CPU context's planner decides for this problem's forward pass.
    var cpuSplit: KeyValueSplit? { DispatchPlan.forward(self).problem.split }
}
