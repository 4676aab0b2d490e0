import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The tensor-op route (TensorOps.swift): FLASH_ATTENTION_TENSOR_OPS over the device's support, the
/// architecture test, and the plans it gives.
final class TensorOpsRouteTests: XCTestCase {
    private let m5 = TensorOpsSupport(hasUnits: true, hasKernels: true, detail: "applegpu_g17s has matrix units")
    private let lost = TensorOpsSupport(hasUnits: true, hasKernels: false, detail: "the library did not compile")

    override func tearDown() {
        unsetenv(TensorOps.environmentVariable)
    }

    private func problem(seqlenQ: Int = 100, seqlenK: Int = 33, headDim: Int = 64,
                         dtype: AttentionDType = .float16) throws -> Problem {
        try Problem.validate(AttentionShape(batch: 2, numHeads: 6, numKVHeads: 3, seqlenQ: seqlenQ, seqlenK: seqlenK,
                                            headDim: headDim),
                             dtype: dtype, causal: true, softmaxScale: nil)
    }

    /// MLX's parse of MTLArchitecture.name: generation 17 and later, 18 for a phone's `p`.
    func testArchitectureGeneration() {
        for (name, units) in [("applegpu_g17s", true), ("applegpu_g17g", true), ("applegpu_g18d", true),
                              ("applegpu_g16s", false), ("applegpu_g13g", false), ("applegpu_g17p", false),
                              ("applegpu_g18p", true), ("", false), ("g7", false), ("applegpu_gxxs", false)] {
            XCTAssertEqual(TensorOpsSupport.hasMatrixUnits(architecture: name), units, name)
        }
    }

    /// A host of exported plans (fa_plan_create_for): the device's units from the architecture it
    /// names (the OS is checked in the process: always new enough off Apple), its library's state,
    /// and whether it should compile the library (TensorOps.wantsLibrary, as the Metal host asks).
    func testHostsOfExportedPlans() {
        guard #available(macOS 26.2, iOS 26.2, tvOS 26.2, visionOS 26.2, *) else {
            XCTAssertFalse(TensorOpsSupport.host(architecture: "applegpu_g17s", library: FA_TENSOR_LIBRARY_READY,
                                                 error: nil).hasUnits)
            return
        }
        let ready = TensorOpsSupport.host(architecture: "applegpu_g17s", library: FA_TENSOR_LIBRARY_READY, error: nil)
        XCTAssertEqual(ready, m5)
        let failed = TensorOpsSupport.host(architecture: "applegpu_g17s", library: FA_TENSOR_LIBRARY_FAILED,
                                           error: "no MetalPerformancePrimitives")
        XCTAssertTrue(failed.hasUnits && !failed.hasKernels)
        XCTAssertEqual(failed.detail, "applegpu_g17s has matrix units; the host's tensor-op library failed: "
                           + "no MetalPerformancePrimitives")
        let old = TensorOpsSupport.host(architecture: "applegpu_g15g", library: FA_TENSOR_LIBRARY_NONE, error: nil)
        XCTAssertFalse(old.hasUnits || old.hasKernels)
        XCTAssertTrue(old.detail.hasSuffix("; the host compiled no tensor-op library"), old.detail)
        unsetenv(TensorOps.environmentVariable)
        XCTAssertTrue(TensorOps.wantsLibrary(hasUnits: true))
        XCTAssertFalse(TensorOps.wantsLibrary(hasUnits: false))
        setenv(TensorOps.environmentVariable, "1", 1)
        XCTAssertTrue(TensorOps.wantsLibrary(hasUnits: false))
        setenv(TensorOps.environmentVariable, "0", 1)
        XCTAssertFalse(TensorOps.wantsLibrary(hasUnits: true))
        setenv(TensorOps.environmentVariable, "yes", 1)
        XCTAssertFalse(TensorOps.wantsLibrary(hasUnits: true))
    }

    /// Unset: the device decides; 1: forced wherever the backend can run the kernels; 0: forbidden;
    /// anything else is refused naming the variable.
    func testRouteFollowsTheOverrideThenTheDevice() throws {
        unsetenv(TensorOps.environmentVariable)
        XCTAssertFalse(try TensorOps.route(.cpuEngine).enabled)
        XCTAssertTrue(try TensorOps.route(m5).enabled)
        XCTAssertTrue(try TensorOps.route(m5).m5)
        XCTAssertFalse(try TensorOps.route(lost).enabled)
        setenv(TensorOps.environmentVariable, "1", 1)
        XCTAssertTrue(try TensorOps.route(.cpuEngine).enabled)
        XCTAssertFalse(try TensorOps.route(.cpuEngine).m5)
        let forcedButLost = try TensorOps.route(lost)
        XCTAssertFalse(forcedButLost.enabled)
        XCTAssertTrue(forcedButLost.reason.contains("did not compile"), forcedButLost.reason)
        setenv(TensorOps.environmentVariable, "0", 1)
        XCTAssertFalse(try TensorOps.route(m5).enabled)
        XCTAssertEqual(try TensorOps.route(m5).reason, "simdgroup kernels: FLASH_ATTENTION_TENSOR_OPS=0")
        setenv(TensorOps.environmentVariable, "true", 1)
        XCTAssertThrowsError(try TensorOps.route(m5)) { error in
            XCTAssertTrue("\(error)".contains("FLASH_ATTENTION_TENSOR_OPS (true) must be 1"), "\(error)")
        }
    }

    /// The forward takes flash_attention_forward_tensor_<dtype>_d<DP> over blocks of
    /// FA_TENSOR_BLOCK_Q rows (FA_TENSOR_PAIR_BLOCK_Q at head_dim 256, split over SIMD-group pairs)
    /// where the route is enabled and the kernel serves the problem; float32,
    /// head_dim 192 and split-KV shapes keep their kernels, as does a plan made without a backend's
    /// support (the CPU engine's); a piece keeps the route.
    func testPlansTakeTheTensorForwardWhereItServes() throws {
        let p = try problem()
        let plan = try DispatchPlan.make(.forward, p, device: nil, tensorOps: m5)
        XCTAssertEqual(plan.dispatches.map(\.kernelName), ["flash_attention_forward_tensor_f16_d64"])
        XCTAssertEqual(plan.dispatches[0].threadgroupsPerGrid, GridSize(width: 2, height: 6, depth: 2))
        XCTAssertEqual(plan.tensorOps.reason, "tensor ops: applegpu_g17s has matrix units")
        let paired = try DispatchPlan.make(.forward, try problem(headDim: 256), device: nil, tensorOps: m5)
        XCTAssertEqual(paired.dispatches.map(\.kernelName), ["flash_attention_forward_tensor_f16_d256"])
        XCTAssertEqual(paired.dispatches[0].threadgroupsPerGrid, GridSize(width: 4, height: 6, depth: 2))
        XCTAssertEqual(DispatchPlan.make(.forward, planned: plan.problem.slice(batches: 1..<2, kvHeads: 0..<1))
            .dispatches.map(\.kernelName), ["flash_attention_forward_tensor_f16_d64"])
        XCTAssertEqual(try DispatchPlan.make(.forward, try problem(headDim: 80, dtype: .bfloat16), device: nil,
                                             tensorOps: m5).dispatches.map(\.kernelName),
                       ["flash_attention_forward_tensor_bf16_d96"])
        for (other, kernel) in [(try problem(dtype: .float32), "flash_attention_forward_f32_d64"),
                                (try problem(headDim: 192), "flash_attention_forward_f16_d192")] {
            XCTAssertEqual(try DispatchPlan.make(.forward, other, device: nil, tensorOps: m5).dispatches.map(\.kernelName),
                           [kernel])
        }
        // A row stride beyond int32 (a tensor's stride) keeps the simdgroup kernel.
        let wide = try Problem.validate(AttentionShape(batch: 1, numHeads: 1, numKVHeads: 1, seqlenQ: 100, seqlenK: 33,
                                                       headDim: 64),
                                        causal: false, softmaxScale: nil,
                                        strides: ProblemStrides(q: TensorStrides(batch: 1 << 40, head: 1 << 40,
                                                                                 seq: 1 << 31)))
        XCTAssertEqual(try DispatchPlan.make(.forward, wide, device: nil, tensorOps: m5).dispatches.map(\.kernelName),
                       ["flash_attention_forward_f16_d64"])
        let decode = try DispatchPlan.make(.forward, try problem(seqlenQ: 1, seqlenK: 4096), device: nil, tensorOps: m5)
        XCTAssertFalse(decode.dispatches.contains { $0.kernelName.contains("tensor") })
        XCTAssertEqual(try DispatchPlan.make(.forward, p, device: nil).dispatches.map(\.kernelName),
                       ["flash_attention_forward_f16_d64"])
    }
}
