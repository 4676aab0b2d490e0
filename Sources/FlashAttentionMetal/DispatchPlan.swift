import CFlashAttentionMetal

/// What a kernel buffer holds. `lse` is float32; every other role is float16.
enum BufferRole: Int, CaseIterable {
    case q, k, v, out, lse, dout, dq, dk, dv

    /// Bytes per element.
    var elementSize: Int { self == .lse ? 4 : 2 }

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
        }
    }

    /// Elements of this buffer for `problem`: q-like roles follow the query heads and length,
    /// k-like roles the KV heads and key length.
    func elementCount(for problem: Problem) -> Int {
        switch self {
        case .q, .out, .dout, .dq: return problem.queryElements
        case .k, .v, .dk, .dv: return problem.keyValueElements
        case .lse: return problem.lseElements
        }
    }

    /// Bytes of this buffer for `problem`; never overflows for a validated problem.
    func byteCount(for problem: Problem) -> Int { elementCount(for: problem) * elementSize }

    /// Element offset of the data of batch entry `batch`, KV head `kvHead` (and its first query
    /// head, `kvHead * groupSize`) in this buffer of `problem`: where a piece of a split plan that
    /// starts there binds the buffer.
    func elementOffset(batch: UInt32, kvHead: UInt32, in problem: Problem) -> Int {
        let b = Int(batch), kv = Int(kvHead), g = Int(problem.groupSize)
        switch self {
        case .q, .out, .dout, .dq:
            return (b * Int(problem.numHeads) + kv * g) * Int(problem.seqlenQ) * Int(problem.headDim)
        case .k, .v, .dk, .dv:
            return (b * Int(problem.numKVHeads) + kv) * Int(problem.seqlenK) * Int(problem.headDim)
        case .lse:
            return (b * Int(problem.numHeads) + kv * g) * Int(problem.seqlenQ)
        }
    }
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

/// The passes a plan can run.
enum Pass {
    case forward, backward

    /// Floating-point operations per (query row, key, head_dim element) of one head, as
    /// FlashAttention's benchmarks count them: forward 2 matrix products (QK^T, PV), backward 2.5x
    /// that. The causal mask is ignored (an upper bound), as is the padding of head_dim.
    var flopsPerScoreElement: Int {
        switch self {
        case .forward: return 4
        case .backward: return 10
        }
    }
}

/// The dispatches of one pass, computed once for every backend (FlashAttention-2: forward is
/// Algorithm 1, one kernel; backward is Algorithm 2 split into a dQ kernel over query blocks and a
/// dK/dV kernel over key blocks, so that no two threadgroups write the same output element and the
/// result is deterministic without atomics).
struct DispatchPlan {
    /// The pass; `make(pass, problem)` rebuilds the plan for a slice of the problem.
    let pass: Pass
    let dispatches: [Dispatch]
    /// The roles the pass writes; every other bound role is read only.
    let outputs: [BufferRole]
    /// The problem the plan was made for (buffer sizes follow from it).
    let problem: Problem

    /// Every role some dispatch binds, in order of first binding.
    var boundRoles: [BufferRole] {
        var roles: [BufferRole] = []
        for binding in dispatches.flatMap(\.bindings) where !roles.contains(binding.role) {
            roles.append(binding.role)
        }
        return roles
    }

    /// The plan of `pass` for `problem`.
    static func make(_ pass: Pass, _ problem: Problem) -> DispatchPlan {
        switch pass {
        case .forward: return forward(problem)
        case .backward: return backward(problem)
        }
    }

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
        return DispatchPlan(pass: .forward, dispatches: [dispatch], outputs: [.out, .lse], problem: problem)
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
        return DispatchPlan(pass: .backward, dispatches: [dq, dkv], outputs: [.dq, .dk, .dv], problem: problem)
    }

    /// ceil(length / block), computed without the overflow of `length + block - 1` near 2^32.
    private static func blocks(_ length: UInt32, _ block: UInt32) -> UInt32 {
        length / block + (length % block == 0 ? 0 : 1)
    }
}
