import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The specialisation of the kernels (Dispatch.specialization): each dispatch carries exactly the
/// function constants its kernel reads, with the problem's values; the CPU engine, which fails any
/// read of a constant the dispatch lacks, shows every read constant in the profile; and the
/// prelude that hosts without function constants put before the source.
final class SpecializationTests: XCTestCase {
    /// One combination of the four features; the mask is nil (none), boolean or additive (float32).
    private struct Features: CustomStringConvertible {
        var mask: AttentionMask.Kind?
        var softcap = false
        var alibi = false
        var sinks = false

        var description: String { "mask \(mask.map { "\($0)" } ?? "none") softcap \(softcap) alibi \(alibi) sinks \(sinks)" }

        var maskType: UInt32 {
            switch mask {
            case nil: return UInt32(FA_MASK_NONE)
            case .boolean: return UInt32(FA_MASK_BOOL)
            case .additive: return UInt32(FA_MASK_ADDITIVE_F32)
            }
        }

        /// Options with these features for `shape` (a [seqlenQ][seqlenK] mask broadcast over batch and
        /// heads, hiding one key in three).
        func options(_ shape: AttentionShape) -> AttentionOptions {
            let pairs = shape.seqlenQ * shape.seqlenK
            let strides = TensorStrides(batch: 0, head: 0, seq: shape.seqlenK)
            var options = AttentionOptions(softcap: softcap ? 20 : 0,
                                           alibiSlopes: alibi ? (0..<shape.numHeads).map { 0.25 / Float($0 + 1) } : nil,
                                           sinks: sinks ? (0..<shape.numHeads).map { Float($0) - 0.5 } : nil)
            switch mask {
            case nil: break
            case .boolean: options.attnMask = .boolean((0..<pairs).map { $0 % 3 == 0 ? 0 : 1 }, strides: strides)
            case .additive: options.attnMask = .additive((0..<pairs).map { $0 % 3 == 0 ? -.infinity : 0.5 },
                                                         strides: strides)
            }
            return options
        }
    }

    /// Every mask kind the Swift API takes, with softcap, ALiBi and sinks each on and off.
    private static let grid: [Features] = [nil, AttentionMask.Kind.boolean, .additive].flatMap { mask in
        [false, true].flatMap { softcap in
            [false, true].flatMap { alibi in
                [false, true].map { sinks in Features(mask: mask, softcap: softcap, alibi: alibi, sinks: sinks) }
            }
        }
    }

    private static let dense = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 20, seqlenK: 45,
                                              headDim: 16)
    /// Few query rows over many keys: the split-KV forward.
    private static let decode = AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 2, seqlenK: 600,
                                               headDim: 16)

    /// The names of the constants each kernel reads, by kernel name.
    private func expectedConstants(_ kernel: String) -> [String] {
        let score = ["fa_mask_type", "fa_has_softcap", "fa_has_alibi"]
        for (prefix, names) in [("flash_attention_forward_split_", score), ("flash_attention_forward_decode_", score),
                                ("flash_attention_forward_combine_", ["fa_has_sinks"]),
                                ("flash_attention_forward_", score + ["fa_has_sinks", "fa_has_dropout"]),
                                ("flash_attention_backward_lse_residual_", score + ["fa_has_sinks"]),
                                ("flash_attention_backward_dq_", score + ["fa_has_dropout"]),
                                ("flash_attention_backward_dkv_reduce_", []),
                                ("flash_attention_backward_dkv_", score + ["fa_has_dropout"])]
        where kernel.hasPrefix(prefix) {
            return names
        }
        return []  // delta, dsinks, merge
    }

    /// The value each constant has for `features`.
    private func expectedValue(_ name: String, _ features: Features) -> UInt32 {
        switch name {
        case "fa_mask_type": return features.maskType
        case "fa_has_softcap": return features.softcap ? 1 : 0
        case "fa_has_alibi": return features.alibi ? 1 : 0
        case "fa_has_dropout": return 0
        default: return features.sinks ? 1 : 0
        }
    }

    func testEachDispatchCarriesTheConstantsItsKernelReadsWithTheProblemsValues() throws {
        let indices = ["fa_mask_type": 0, "fa_has_softcap": 1, "fa_has_alibi": 2, "fa_has_sinks": 3, "fa_has_dropout": 4]
        for features in Self.grid {
            for shape in [Self.dense, Self.decode] {
                let problem = try Problem.validate(shape, causal: true, softmaxScale: nil,
                                                   options: features.options(shape))
                let plans = [DispatchPlan.forward(problem), DispatchPlan.backward(problem)]
                for dispatch in plans.flatMap(\.dispatches) {
                    let names = expectedConstants(dispatch.kernelName)
                    XCTAssertEqual(dispatch.specialization.map(\.name), names, "\(dispatch.kernelName), \(features)")
                    for constant in dispatch.specialization {
                        XCTAssertEqual(constant.index, indices[constant.name], constant.name)
                        XCTAssertEqual(constant.type, constant.name == "fa_mask_type" ? .uint32 : .bool, constant.name)
                        XCTAssertEqual(constant.value, expectedValue(constant.name, features),
                                       "\(dispatch.kernelName) \(constant.name), \(features)")
                    }
                }
            }
        }
        let merge = DispatchPlan.merge(try Problem.merge(rows: 10, headDim: 64))
        XCTAssertEqual(merge.dispatches.map(\.specialization), [[]])
    }

    /// The CPU engine fails any read of a constant the dispatch lacks, so that every pass over the
    /// feature grid succeeds shows that the plan covers each kernel's reads; the profile's reads
    /// show that every constant the plan gives is read (none is given in vain and splits pipelines
    /// for nothing). The lse residual kernel recomputes scores only for rows whose |lse| is huge,
    /// so on these inputs it reads none.
    func testTheEngineReadsExactlyThePlannedConstants() throws {
        let attention = try FlashAttention(backend: .cpu)
        for features in Self.grid {
            for shape in [Self.dense, Self.decode] {
                let q = (0..<shape.queryElementCount).map { Float(($0 * 7) % 11) / 11 - 0.5 }
                let k = (0..<shape.keyElementCount).map { Float(($0 * 5) % 13) / 13 - 0.5 }
                let v = (0..<shape.valueElementCount).map { Float(($0 * 3) % 7) / 7 - 0.5 }
                let options = features.options(shape)
                let (out, lse) = try attention.forward(q: q, k: k, v: v, shape: shape, options: options)
                var profiles = [try XCTUnwrap(attention.lastProfile)]
                if shape.seqlenQ == Self.dense.seqlenQ {
                    _ = try attention.backward(dout: out, q: q, k: k, v: v, out: out, lse: lse, shape: shape,
                                               options: options)
                    profiles.append(try XCTUnwrap(attention.lastProfile))
                }
                for record in profiles.flatMap(\.dispatches) {
                    let planned = record.specialization.map(\.name)
                    XCTAssertEqual(planned, expectedConstants(record.kernelName), record.kernelName)
                    let read = try XCTUnwrap(record.functionConstantsRead, "the CPU engine counts reads")
                    if record.kernelName.hasPrefix("flash_attention_backward_lse_residual_") {
                        XCTAssertTrue(Set(read).isSubset(of: planned), "\(record.kernelName): \(read)")
                    } else {
                        XCTAssertEqual(read, planned, "\(record.kernelName), \(features)")
                    }
                }
            }
        }
    }

    /// A dispatch without a constant its kernel reads fails on the CPU engine as a library defect,
    /// naming the kernel and the constant (Metal would refuse to build the pipeline).
    func testADispatchWithoutItsConstantsFails() throws {
        let shape = Self.dense
        let problem = try Problem.validate(shape, causal: false, softmaxScale: nil)
        let planned = DispatchPlan.forward(problem)
        var dispatch = try XCTUnwrap(planned.dispatches.first)
        dispatch.specialization = dispatch.specialization.filter { $0.name != "fa_has_softcap" }
        let stripped = DispatchPlan(pass: .forward, dispatches: [dispatch], outputs: planned.outputs,
                                    workspace: planned.workspace, problem: problem)
        let inputs = [UInt16](repeating: 0x3C00, count: shape.keyElementCount + shape.queryElementCount)
        var out = [UInt16](repeating: 0, count: shape.queryElementCount)
        var lse = [Float](repeating: 0, count: problem.lseElements)
        let cancellation = Cancellation()
        XCTAssertThrowsError(try inputs.withUnsafeBytes { input in
            try out.withUnsafeMutableBytes { out in
                try lse.withUnsafeMutableBytes { lse in
                    var buffers = HostBuffers()
                    for role in [BufferRole.q, .k, .v] { buffers.bindInput(role, input.baseAddress!, for: problem) }
                    buffers.bindOutput(.out, out.baseAddress!, for: problem)
                    buffers.bindOutput(.lse, lse.baseAddress!, for: problem)
                    return try CPUBackend().execute(stripped, buffers: buffers, cancellation: cancellation.token())
                }
            }
        }) { error in
            guard case .internalError(let message) = error as? FlashAttentionError else {
                return XCTFail("\(error)")
            }
            XCTAssertTrue(message.contains("'\(dispatch.kernelName)'"), message)
            XCTAssertTrue(message.contains("function constant 'fa_has_softcap' (index 1, bool), which the dispatch "
                                               + "does not set"), message)
        }
    }

    func testThePreludeDefinesEveryConstantInIndexOrder() {
        let mask = SpecializationConstant(name: "fa_mask_type", index: 0, type: .uint32, value: UInt32(FA_MASK_ADDITIVE))
        let sinks = SpecializationConstant(name: "fa_has_sinks", index: 3, type: .bool, value: 1)
        XCTAssertEqual(functionConstantPrelude([sinks, mask]), """
            #define FA_FUNCTION_CONSTANTS_PREDEFINED 1
            constant uint fa_mask_type = 2;
            constant bool fa_has_softcap = false;
            constant bool fa_has_alibi = false;
            constant bool fa_has_sinks = true;
            constant bool fa_has_dropout = false;

            """)
        // A kernel without constants (merge) still gets every definition: the source compiles whole.
        XCTAssertEqual(functionConstantPrelude([]).split(separator: "\n").count, 1 + Int(FA_FUNCTION_CONSTANT_COUNT))
        XCTAssertEqual(SpecializationConstant.text([mask, sinks]), "fa_mask_type=2 fa_has_sinks=1")
    }
}

extension AttentionMask {
    /// The mask kinds of the Swift API.
    fileprivate enum Kind { case boolean, additive }
}
