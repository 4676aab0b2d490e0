import CFlashAttentionMetal

/// What a kernel buffer holds. The lse roles are float32; every other role is float16.
/// `outA`, `lseA`, `outB`, `lseB` are the two parts that `fa_merge_attention` merges into `out`
/// and `lse`.
enum BufferRole: Int, CaseIterable {
    case q, k, v, out, lse, dout, dq, dk, dv, outA, lseA, outB, lseB

    /// Bytes per element.
    var elementSize: Int {
        switch self {
        case .lse, .lseA, .lseB: return 4
        default: return 2
        }
    }

    /// The C argument name, for messages.
    var name: String {
        switch self {
        case .q: return "q"
        case .k: return "k"
        case .v: return "v"
        case .out: return "out"
        case .lse: return "lse"
        case .dout: return "dout"
        case .dq: return "dq"
        case .dk: return "dk"
        case .dv: return "dv"
        case .outA: return "out_a"
        case .lseA: return "lse_a"
        case .outB: return "out_b"
        case .lseB: return "lse_b"
        }
    }

    /// Elements of this buffer for `problem`: q-like roles follow the query heads and length,
    /// k-like roles the KV heads and key length.
    func elementCount(for problem: Problem) -> Int {
        switch self {
        case .q, .out, .dout, .dq, .outA, .outB: return problem.queryElements
        case .k, .v, .dk, .dv: return problem.keyValueElements
        case .lse, .lseA, .lseB: return problem.lseElements
        }
    }

    /// Bytes of this buffer for `problem`; never overflows for a validated problem.
    func byteCount(for problem: Problem) -> Int { elementCount(for: problem) * elementSize }
}

/// A 3-D size, as in `MTLSize` and `msl_engine_size`.
struct GridSize: Equatable {
    var width: UInt32
    var height: UInt32
    var depth: UInt32
}

/// Buffer `role` is bound at `[[buffer(index)]]`.
struct BufferBinding: Equatable {
    let index: Int
    let role: BufferRole
}

/// One kernel launch: `dispatchThreadgroups(threadgroupsPerGrid, threadsPerThreadgroup)` of
/// `kernelName` with `bindings` and the parameter struct at `paramsIndex`.
struct Dispatch {
    let kernelName: String
    let bindings: [BufferBinding]
    let paramsIndex: Int
    let params: FlashAttentionParams
    let threadgroupsPerGrid: GridSize
    let threadsPerThreadgroup: GridSize

    /// Number of `[[buffer(i)]]` slots, the parameter struct included.
    var bufferCount: Int { bindings.count + 1 }
}

/// The dispatches of one pass, computed once for every backend (FlashAttention-2: forward is
/// Algorithm 1, one kernel; backward is Algorithm 2 split into a dQ kernel over query blocks and a
/// dK/dV kernel over key blocks, so that no two threadgroups write the same output element and the
/// result is deterministic without atomics).
struct DispatchPlan {
    let dispatches: [Dispatch]
    /// The roles the pass writes; every other bound role is read only.
    let outputs: [BufferRole]
    /// The problem the plan was made for (buffer sizes follow from it).
    let problem: Problem

    /// Forward: `flash_attention_forward_d<DP>` over (ceil(seqlen_q / forward_block_q), num_heads,
    /// batch) threadgroups of forward_block_q threads.
    static func forward(_ problem: Problem) -> DispatchPlan {
        let b = problem.bucket
        let dispatch = Dispatch(
            kernelName: "flash_attention_forward_d\(b.head_dim_max)",
            bindings: [BufferBinding(index: Int(FA_FORWARD_BUFFER_Q), role: .q),
                       BufferBinding(index: Int(FA_FORWARD_BUFFER_K), role: .k),
                       BufferBinding(index: Int(FA_FORWARD_BUFFER_V), role: .v),
                       BufferBinding(index: Int(FA_FORWARD_BUFFER_OUT), role: .out),
                       BufferBinding(index: Int(FA_FORWARD_BUFFER_LSE), role: .lse)],
            paramsIndex: Int(FA_FORWARD_BUFFER_PARAMS),
            params: problem.params,
            threadgroupsPerGrid: GridSize(width: blocks(problem.seqlenQ, b.forward_block_q),
                                          height: problem.numHeads, depth: problem.batch),
            threadsPerThreadgroup: GridSize(width: b.forward_block_q, height: 1, depth: 1))
        return DispatchPlan(dispatches: [dispatch], outputs: [.out, .lse], problem: problem)
    }

    /// Backward: `flash_attention_backward_dq_d<DP>` over (ceil(seqlen_q / backward_block_q),
    /// num_heads, batch) threadgroups of backward_block_q threads, then
    /// `flash_attention_backward_dkv_d<DP>` over (ceil(seqlen_k / backward_block_k), num_kv_heads,
    /// batch) threadgroups of backward_block_k threads. Neither reads what the other writes.
    static func backward(_ problem: Problem) -> DispatchPlan {
        let b = problem.bucket
        let inputs = [BufferBinding(index: Int(FA_BACKWARD_BUFFER_DOUT), role: .dout),
                      BufferBinding(index: Int(FA_BACKWARD_BUFFER_Q), role: .q),
                      BufferBinding(index: Int(FA_BACKWARD_BUFFER_K), role: .k),
                      BufferBinding(index: Int(FA_BACKWARD_BUFFER_V), role: .v),
                      BufferBinding(index: Int(FA_BACKWARD_BUFFER_OUT), role: .out),
                      BufferBinding(index: Int(FA_BACKWARD_BUFFER_LSE), role: .lse)]
        let dq = Dispatch(
            kernelName: "flash_attention_backward_dq_d\(b.head_dim_max)",
            bindings: inputs + [BufferBinding(index: Int(FA_BACKWARD_BUFFER_DQ), role: .dq)],
            paramsIndex: Int(FA_BACKWARD_BUFFER_PARAMS),
            params: problem.params,
            threadgroupsPerGrid: GridSize(width: blocks(problem.seqlenQ, b.backward_block_q),
                                          height: problem.numHeads, depth: problem.batch),
            threadsPerThreadgroup: GridSize(width: b.backward_block_q, height: 1, depth: 1))
        let dkv = Dispatch(
            kernelName: "flash_attention_backward_dkv_d\(b.head_dim_max)",
            bindings: inputs + [BufferBinding(index: Int(FA_BACKWARD_BUFFER_DK), role: .dk),
                                BufferBinding(index: Int(FA_BACKWARD_BUFFER_DV), role: .dv)],
            paramsIndex: Int(FA_BACKWARD_BUFFER_PARAMS),
            params: problem.params,
            threadgroupsPerGrid: GridSize(width: blocks(problem.seqlenK, b.backward_block_k),
                                          height: problem.numKVHeads, depth: problem.batch),
            threadsPerThreadgroup: GridSize(width: b.backward_block_k, height: 1, depth: 1))
        return DispatchPlan(dispatches: [dq, dkv], outputs: [.dq, .dk, .dv], problem: problem)
    }

    /// Merge (`fa_merge_attention`): `flash_attention_merge` over (ceil(seqlen_q /
    /// FA_MERGE_ROWS_PER_THREADGROUP), num_heads, batch) threadgroups of
    /// FA_MERGE_ROWS_PER_THREADGROUP * FA_MERGE_THREADS_PER_ROW threads; `problem` gives the row
    /// layout (``Problem/merge(rows:headDim:)``).
    static func merge(_ problem: Problem) -> DispatchPlan {
        let rows = UInt32(FA_MERGE_ROWS_PER_THREADGROUP)
        let dispatch = Dispatch(
            kernelName: "flash_attention_merge",
            bindings: [BufferBinding(index: Int(FA_MERGE_BUFFER_OUT_A), role: .outA),
                       BufferBinding(index: Int(FA_MERGE_BUFFER_LSE_A), role: .lseA),
                       BufferBinding(index: Int(FA_MERGE_BUFFER_OUT_B), role: .outB),
                       BufferBinding(index: Int(FA_MERGE_BUFFER_LSE_B), role: .lseB),
                       BufferBinding(index: Int(FA_MERGE_BUFFER_OUT), role: .out),
                       BufferBinding(index: Int(FA_MERGE_BUFFER_LSE), role: .lse)],
            paramsIndex: Int(FA_MERGE_BUFFER_PARAMS),
            params: problem.params,
            threadgroupsPerGrid: GridSize(width: blocks(problem.seqlenQ, rows), height: problem.numHeads,
                                          depth: problem.batch),
            threadsPerThreadgroup: GridSize(width: rows * UInt32(FA_MERGE_THREADS_PER_ROW), height: 1, depth: 1))
        return DispatchPlan(dispatches: [dispatch], outputs: [.out, .lse], problem: problem)
    }

    /// ceil(length / block), computed without the overflow of `length + block - 1` near 2^32.
    private static func blocks(_ length: UInt32, _ block: UInt32) -> UInt32 {
        length / block + (length % block == 0 ? 0 : 1)
    }
}
