import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The backward's plan under the tensor-op route (DispatchPlan.backward, TensorOps.backwardServes):
/// dQ and dK/dV on the tensor-op kernels where the route is enabled and they serve the problem, the
/// pre-passes and dsinks unchanged.
final class TensorBackwardPlanTests: XCTestCase {
    private let m5 = TensorOpsSupport(hasUnits: true, hasKernels: true, detail: "applegpu_g17s has matrix units")

    private func problem(headDim: Int = 64, dtype: AttentionDType = .float16) throws -> Problem {
        try Problem.validate(AttentionShape(batch: 2, numHeads: 6, numKVHeads: 3, seqlenQ: 100, seqlenK: 130,
                                            headDim: headDim),
                             dtype: dtype, causal: true, softmaxScale: nil)
    }

    /// 100 query rows and 130 keys: ceil(100 / 64) = 2 dQ blocks of 6 heads, ceil(130 / 64) = 3
    /// dK/dV blocks of 3 KV heads; at head_dim 256 dQ (split over SIMD-group pairs) takes blocks of
    /// FA_TENSOR_PAIR_BLOCK_Q = 32 rows, ceil(100 / 32) = 4, dK/dV keeps 64 keys.
    func testBackwardTakesTheTensorKernelsWhereTheyServe() throws {
        unsetenv(TensorOps.environmentVariable)
        let plan = try DispatchPlan.make(.backward, try problem(), device: nil, tensorOps: m5)
        XCTAssertEqual(plan.dispatches.map(\.kernelName),
                       ["flash_attention_backward_delta_f16", "flash_attention_backward_lse_residual_f16_d64",
                        "flash_attention_backward_dq_tensor_f16_d64", "flash_attention_backward_dkv_tensor_f16_d64"])
        XCTAssertEqual(plan.dispatches[2].threadgroupsPerGrid, GridSize(width: 2, height: 6, depth: 2))
        XCTAssertEqual(plan.dispatches[3].threadgroupsPerGrid, GridSize(width: 3, height: 3, depth: 2))
        let paired = try DispatchPlan.make(.backward, try problem(headDim: 200, dtype: .bfloat16), device: nil,
                                           tensorOps: m5)
        XCTAssertEqual(paired.dispatches.map(\.kernelName).suffix(2),
                       ["flash_attention_backward_dq_tensor_bf16_d256",
                        "flash_attention_backward_dkv_tensor_bf16_d256"])
        XCTAssertEqual(paired.dispatches[2].threadgroupsPerGrid, GridSize(width: 4, height: 6, depth: 2))
        XCTAssertEqual(paired.dispatches[3].threadgroupsPerGrid, GridSize(width: 3, height: 3, depth: 2))
        for (other, suffix) in [(try problem(dtype: .float32), "f32_d64"), (try problem(headDim: 192), "f16_d192"),
                                (try problem(headDim: 32), "f16_d32")] {
            let names = try DispatchPlan.make(.backward, other, device: nil, tensorOps: m5).dispatches.map(\.kernelName)
            XCTAssertTrue(names.contains("flash_attention_backward_dq_\(suffix)"), suffix)
            // The simdgroup-matrix dK/dV, its GQA group split where its threadgroups leave slots idle (GroupSplit).
            XCTAssertTrue(names.contains("flash_attention_backward_dkv_\(suffix)")
                          || names.contains("flash_attention_backward_dkv_split_\(suffix)"), suffix)
        }
        // Without a backend's support (the CPU engine's, unforced) the simdgroup kernels stay.
        XCTAssertFalse(try DispatchPlan.make(.backward, try problem(), device: nil).dispatches
            .contains { $0.kernelName.contains("tensor") })
    }
}
