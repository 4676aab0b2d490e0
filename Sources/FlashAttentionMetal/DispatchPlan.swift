import CFlashAttentionMetal

/// What a kernel buffer holds. `lse`, `lseA`, `lseB` and the workspaces are float32; every other
/// role holds the problem's dtype. `outA`, `lseA`, `outB`, `lseB` are the two parts that
/// `fa_merge_attention_v2` merges into `out` and `lse`.
enum BufferRole: Int, CaseIterable {
    /// Workspaces: `delta`, D_i = rowsum(dout * out) per query row, and `lseResidual`, what float32
    /// lse could not hold of rows whose |lse| is huge (backward); `partialOut` and
    /// `partialLse`, one normalised output and lse per chunk of keys (split-KV forward); `partialDk`
    /// and `partialDv`, one unscaled dK and dV sum per split of the GQA group (the split dK/dV).
    /// Optional inputs: `attnMask`, `alibiSlopes`, `sinks` (float32); optional output `dsinks`.
    /// KV caches (forward): `blockTable` (int32) and a quantized cache's `kScales`, `kBiases`,
    /// `vScales`, `vBiases` (the dtype), with `k` and `v` then packed uint32 words.
    /// Variable-length batches: `cuSeqlensQ`, `cuSeqlensK` (int32 inputs, sequences + 1) and the
    /// workspace `sequenceTable` (FlashAttentionParams, sequences + 1) that the pass's first kernel
    /// writes and the others bind in place of the parameter struct.
    case q, k, v, out, lse, dout, dq, dk, dv, delta, lseResidual, partialOut, partialLse, attnMask, alibiSlopes, sinks, dsinks,
         outA, lseA, outB, lseB, blockTable, kScales, kBiases, vScales, vBiases, cuSeqlensQ, cuSeqlensK, sequenceTable,
         partialDk, partialDv

    /// The inputs whose rows the kernels copy into threadgroup tiles (in 16-byte chunks when aligned).
    static let copiedInTiles: [BufferRole] = [.q, .k, .v, .out, .dout]

    /// Whether the role holds float32 whatever the problem's dtype.
    var isFloat32: Bool {
        switch self {
        case .lse, .lseA, .lseB, .delta, .lseResidual, .partialOut, .partialLse, .partialDk, .partialDv, .alibiSlopes,
             .sinks, .dsinks:
            return true
        default: return false
        }
    }

    /// Bytes per element for `problem`.
    func elementSize(for problem: Problem) -> Int {
        // (A `where` clause would bind to the last pattern of a case only.)
        if self == .blockTable || (self == .k || self == .v) && problem.kvCache?.quantized ?? false {
            return 4
        }
        switch self {
        case .cuSeqlensQ, .cuSeqlensK: return 4
        case .sequenceTable: return MemoryLayout<FlashAttentionParams>.stride
        case .attnMask: break
        default: return isFloat32 ? 4 : problem.dtype.size
        }
        switch Int32(problem.scores.maskType) {
        case FA_MASK_BOOL: return 1
        case FA_MASK_ADDITIVE: return problem.dtype.size
        default: return 4
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
        case .delta: return "delta"
        case .lseResidual: return "lse_residual"
        case .partialOut: return "partial_out"
        case .partialLse: return "partial_lse"
        case .attnMask: return "attn_mask"
        case .alibiSlopes: return "alibi_slopes"
        case .sinks: return "sinks"
        case .dsinks: return "dsinks"
        case .outA: return "out_a"
        case .lseA: return "lse_a"
        case .outB: return "out_b"
        case .lseB: return "lse_b"
        case .blockTable: return "kv_block_table"
        case .kScales: return "k_scales"
        case .kBiases: return "k_biases"
        case .vScales: return "v_scales"
        case .vBiases: return "v_biases"
        case .cuSeqlensQ: return "cu_seqlens_q"
        case .cuSeqlensK: return "cu_seqlens_k"
        case .sequenceTable: return "sequence_table"
        case .partialDk: return "partial_dk"
        case .partialDv: return "partial_dv"
        }
    }

    /// This buffer's layout in `problem`: a tensor's own, `out`'s for the merge's `outA` and `outB`,
    /// the attention mask's (nil without a mask); nil for lse and the other float32 roles.
    private func layout(in problem: Problem) -> TensorLayout? {
        switch self {
        case .outA, .outB: return problem.layouts[.out]
        case .attnMask: return problem.scores.mask
        default: return problem.layouts[self]
        }
    }

    /// Elements of this buffer for `problem`: for a tensor, the elements its layout spans from
    /// element [0][0][0][0] to the last one.
    func elementCount(for problem: Problem) -> Int {
        switch self {
        case .q, .k, .v, .out, .dout, .dq, .dk, .dv, .outA, .outB: return layout(in: problem)!.extent
        case .lse, .lseA, .lseB, .delta, .lseResidual: return problem.lseElements
        // At most FA_SPLIT_TILED_MAX_QUERY_ROWS rows per head, so these products stay small.
        case .partialOut: return problem.lseElements * Int(problem.split?.chunks ?? 0) * Int(problem.headDimV)
        // A running max and the log of a sum per row and chunk.
        case .partialLse: return problem.lseElements * Int(problem.split?.chunks ?? 0) * 2
        case .attnMask: return layout(in: problem)?.extent ?? 0
        case .alibiSlopes:
            return Int(problem.numHeads) * (problem.scores.alibiPerBatch ? Int(problem.varlen?.sequences ?? problem.batch) : 1)
        case .sinks, .dsinks: return Int(problem.numHeads)
        case .blockTable:
            guard let kv = problem.kvCache, kv.paged else { return 0 }
            return Int(problem.batch) * Int(kv.maxBlocks)
        case .kScales, .kBiases: return problem.kvCache?.scaleCount(problem.layouts[.k]!, cols: problem.headDim) ?? 0
        case .vScales, .vBiases: return problem.kvCache?.scaleCount(problem.layouts[.v]!, cols: problem.headDimV) ?? 0
        case .cuSeqlensQ, .cuSeqlensK, .sequenceTable: return Int(problem.varlen?.sequences ?? 0) + 1
        case .partialDk, .partialDv:
            guard problem.dkvSplits > 1 else { return 0 }
            return GroupSplit.workspaceRows(for: problem, splits: problem.dkvSplits)
                * Int(self == .partialDk ? problem.headDim : problem.headDimV)
        }
    }

    /// Bytes of this buffer for `problem`; never overflows for a validated problem.
    func byteCount(for problem: Problem) -> Int { elementCount(for: problem) * elementSize(for: problem) }

    /// Element offset of the data of batch entry `batch`, KV head `kvHead` (and its first query
    /// head, `kvHead * groupSize`) in this buffer of `problem`: where a piece of a split plan that
    /// starts there binds the buffer. Tensors follow their strides; lse and the workspaces are
    /// contiguous [batch][num_heads]...
    func elementOffset(batch: UInt32, kvHead: UInt32, in problem: Problem) -> Int {
        let b = Int(batch), kv = Int(kvHead), g = Int(problem.groupSize)
        switch self {
        // The mask is bound only when the problem has one.
        case .q, .out, .dout, .dq, .outA, .outB, .attnMask:
            let s = layout(in: problem)!.strides
            return b * s.batch + kv * g * s.head
        case .k, .v, .dk, .dv:
            let s = layout(in: problem)!.strides
            return b * s.batch + kv * s.head
        case .lse, .delta, .lseResidual, .lseA, .lseB:
            return (b * Int(problem.numHeads) + kv * g) * Int(problem.seqlenQ)
        // [batch][num_heads][chunk][seqlen_q] times 2 (partial_lse) or head_dim_v (partial_out).
        case .partialLse, .partialOut:
            let rows = (b * Int(problem.numHeads) + kv * g) * Int(problem.split?.chunks ?? 0) * Int(problem.seqlenQ)
            return rows * (self == .partialLse ? 2 : Int(problem.headDimV))
        case .partialDk, .partialDv:
            let rows = (b * Int(problem.numKVHeads) + kv) * Int(problem.dkvSplits) * Int(problem.seqlenK)
            return rows * Int(self == .partialDk ? problem.headDim : problem.headDimV)
        case .alibiSlopes:
            return (problem.scores.alibiPerBatch ? b * Int(problem.numHeads) : 0) + kv * g
        // dsinks is written only by the dispatch that runs once over the whole problem.
        case .sinks, .dsinks:
            return kv * g
        // KV-cache and variable-length problems are cut into block ranges of the whole problem only
        // (PlanPieces), so their pieces bind every buffer from its start.
        case .blockTable, .kScales, .kBiases, .vScales, .vBiases, .cuSeqlensQ, .cuSeqlensK, .sequenceTable:
            return 0
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
/// `kernelName`, specialised with `specialization`, with `bindings` and the parameter struct at
/// `paramsIndex`.
struct Dispatch {
    let kernelName: String
    let bindings: [BufferBinding]
    let paramsIndex: Int
    /// A piece that runs a range of the grid's x axis sets `block_offset` to its first x.
    var params: FlashAttentionParams
    var threadgroupsPerGrid: GridSize
    let threadsPerThreadgroup: GridSize
    /// Whether the kernel must see the whole problem (it sums over batch entries): a split plan
    /// runs it once, after its pieces, instead of once per piece.
    var wholeProblem = false
    /// For a kernel that adds `params.block_offset` to its threadgroup's x index (x is a block of
    /// query or key rows, or a split-KV (chunk, row block) pair, and threadgroups of different x
    /// share no output): an upper bound of the floating-point operations of the whole grid, so
    /// that a piece can run a range of x alone (`DispatchPlan.pieces(maxFlops:)`). Nil: the
    /// kernel's grid runs whole (its work is small next to the score kernels').
    var blockWork: Int?
    /// The values of the function constants the kernel reads, exactly those: its pipeline is built
    /// for them (one per kernel name and specialization).
    var specialization: [SpecializationConstant] = []
    /// Nil: `params` is bound at `paramsIndex` (as bytes). Otherwise this buffer is, in its place:
    /// the kernels of a variable-length pass read their sequence's struct from `sequenceTable`.
    var paramsRole: BufferRole?

    /// Number of `[[buffer(i)]]` slots, the parameter struct included.
    var bufferCount: Int { bindings.count + 1 }
}

/// The passes a plan can run.
enum Pass {
    case forward, backward, merge

    /// Floating-point operations per (query row, key, head_dim element) of one head, as
    /// FlashAttention's benchmarks count them: forward 2 matrix products (QK^T, PV), backward 2.5x
    /// that. The causal mask is ignored (an upper bound), as is the padding of head_dim.
    var flopsPerScoreElement: Int {
        switch self {
        case .forward: return 4
        case .backward: return 10
        // Two multiply-adds per output element; its problem has seqlen_k 1.
        case .merge: return 4
        }
    }
}

/// The dispatches of one pass, computed once for every backend (FlashAttention-2: forward is
/// Algorithm 1, one kernel; backward is Algorithm 2 split into a D pre-pass, a dQ kernel over query
/// blocks and a dK/dV kernel over key blocks, so that no two threadgroups write the same output
/// element and the result is deterministic without atomics). Every kernel runs
/// `fa_threads_per_threadgroup()` threads per threadgroup.
struct DispatchPlan {
    /// The pass; `make(pass, planned:)` rebuilds the plan for a slice of the problem.
    let pass: Pass
    let dispatches: [Dispatch]
    /// The roles the pass writes for the caller; every other bound role is read only.
    let outputs: [BufferRole]
    /// Roles the backend allocates for the duration of the pass (written and read by its kernels,
    /// never by the caller): `delta` and `lseResidual` for backward.
    let workspace: [BufferRole]
    /// The problem the plan was made for (buffer sizes follow from it).
    let problem: Problem

    /// The read-write roles: a KV cache's `k` and `v` (and a quantized cache's `kScales`, `kBiases`,
    /// `vScales`, `vBiases`) in a forward pass. They are the caller's memory, bound in place (never a
    /// fresh buffer that replaces them): the pass reads them and may write only the rows it appends
    /// at cache_seqlens. No kernel appends yet: on unified memory the caller writes a step's new rows
    /// into the cache (the host append of `flash_attn_with_kvcache`, a few rows) before the pass, and
    /// the GPU reads those very pages, so a backend that must copy a cache in has nothing to copy
    /// back. They may overlap each other (K and V views of one allocation), nothing else.
    var caches: [BufferRole] {
        guard pass == .forward, let kv = problem.kvCache else { return [] }
        return kv.quantized ? [.k, .v, .kScales, .kBiases, .vScales, .vBiases] : [.k, .v]
    }

    /// Every role some dispatch binds, in order of first binding.
    var boundRoles: [BufferRole] {
        var roles: [BufferRole] = []
        for binding in dispatches.flatMap(\.bindings) where !roles.contains(binding.role) {
            roles.append(binding.role)
        }
        return roles
    }

    /// The planner: the plan of `pass` for a validated `problem` on a GPU of `device` cores (the
    /// backend's `ExecutionBackend.gpuCores`; nil: the CPU engine's nominal GPU) whose tensor-op
    /// support is `tensorOps` (the backend's `ExecutionBackend.tensorOps`), made once per call. Here
    /// and only here the split-KV chunking and the dK/dV group split (`GroupSplit`) are decided, for
    /// `GPUCores.planned(device:)` (FLASH_ATTENTION_GPU_CORES wins over the device), and the
    /// tensor-op route, `TensorOps.route` (FLASH_ATTENTION_TENSOR_OPS wins over the device; the plan's
    /// `tensorOps` says which and why).
    /// - Throws: `invalidArgument` when FLASH_ATTENTION_GPU_CORES or FLASH_ATTENTION_TENSOR_OPS is
    ///   set to a bad value.
    static func make(_ pass: Pass, _ problem: Problem, device: UInt32?,
                     tensorOps: TensorOpsSupport = .cpuEngine) throws -> DispatchPlan {
        let route = pass == .merge ? TensorOpsRoute.off : try TensorOps.route(tensorOps)
        return make(pass, planned: problem.planned(forGPUCores: try GPUCores.planned(device: device), tensorOps: route,
                                                   pass: pass))
    }

    /// The tensor-op route the plan was made with (kernels with `tensor` in their names where it is
    /// enabled and one serves the problem).
    var tensorOps: TensorOpsRoute { problem.tensorOps }

    /// The plan of `pass` for a problem the planner has planned (a piece of a split plan: a slice
    /// that keeps the whole plan's chunking).
    static func make(_ pass: Pass, planned problem: Problem) -> DispatchPlan {
        precondition(problem.gpuCores != nil, "a plan needs a problem the planner has planned")
        switch pass {
        case .forward: return forward(planned: problem)
        case .backward: return backward(planned: problem)
        case .merge: return merge(planned: problem)
        }
    }

    /// Forward. Dense: `flash_attention_forward_<dtype>_d<DP>` over (ceil(seqlen_q / forward_block_q),
    /// num_heads, batch) threadgroups, or, where the tensor-op route is enabled and
    /// `TensorOps.forwardServes` the problem, `flash_attention_forward_tensor_<dtype>_d<DP>` over
    /// (ceil(seqlen_q / `TensorOps.queryBlock`), num_heads, batch). Split-KV (`problem.split`, short queries over long caches):
    /// `flash_attention_forward_decode_<dtype>_d<DP>`, `_spec_` or `flash_attention_forward_split_<dtype>_d<DP>`
    /// (`KeyValueSplit.kernel`; `_decode_kvcache_`, `_spec_kvcache_`, `_split_kvcache_` for a KV cache) over
    /// (chunks x row blocks, num_kv_heads, batch) threadgroups writes one partial result per chunk,
    /// then `flash_attention_forward_combine_<dtype>`
    /// over (seqlen_q, num_heads, batch) threadgroups merges them into out and lse.
    private static func forward(planned problem: Problem) -> DispatchPlan {
        let b = problem.bucket
        // A KV cache: the `_kvcache` kernels, which also bind the block table and the scales and
        // biases (placeholders where the cache has none; the kernels then read none).
        let cache = problem.kvCache != nil
        let scoreWork = problem.scoreWork(flopsPerScoreElement: Pass.forward.flopsPerScoreElement)
        guard let split = problem.split else {
            // The tensor-op forward where the route takes it and it serves the problem.
            let tensor = problem.tensorOps.enabled && TensorOps.forwardServes(problem)
            let blockQ = tensor ? TensorOps.queryBlock(b) : b.forward_block_q
            let rowBlocks = blocks(problem.gridSeqlenQ, blockQ)
            let kernel = tensor ? FA_KERNEL_forward_tensor : cache ? FA_KERNEL_forward_kvcache : FA_KERNEL_forward
            let dense = dispatch(kernel, problem,
                                 GridSize(width: rowBlocks, height: problem.numHeads, depth: problem.gridBatch),
                                 blockWork: problem.gridWork(flopsPerScoreElement: Pass.forward.flopsPerScoreElement,
                                                             blocks: rowBlocks, rows: blockQ))
            return withSequenceTable(DispatchPlan(pass: .forward, dispatches: [dense], outputs: [.out, .lse],
                                                  workspace: [], problem: problem))
        }
        let kernel: Int
        switch split.kernel {
        case .decode:
            // A quantized cache of head_dim 32, 64 or 128: the MMA decode (FA_DECODE_MMA_SERVES).
            let packedRows = UInt64(problem.numHeads / problem.numKVHeads) * UInt64(problem.seqlenQ)
            let mma = fa_decode_mma_serves(b.head_dim_max, problem.headDim, problem.headDimV,
                                           problem.kvCache?.bits ?? 0, packedRows) != 0
            kernel = mma ? FA_KERNEL_forward_decode_mma_kvcache
                : cache ? FA_KERNEL_forward_decode_kvcache : FA_KERNEL_forward_decode
        case .spec: kernel = cache ? FA_KERNEL_forward_spec_kvcache : FA_KERNEL_forward_spec
        case .tiled: kernel = cache ? FA_KERNEL_forward_split_kvcache : FA_KERNEL_forward_split
        }
        let chunks = dispatch(kernel, problem,
                              GridSize(width: split.chunks * split.rowBlocks, height: problem.numKVHeads,
                                       depth: problem.batch),
                              blockWork: scoreWork)
        // At most FA_SPLIT_TILED_MAX_QUERY_ROWS rows per head, each merging its chunks: small.
        let combine = dispatch(FA_KERNEL_forward_combine, problem,
                               GridSize(width: problem.seqlenQ, height: problem.numHeads, depth: problem.batch),
                               blockWork: nil)
        return DispatchPlan(pass: .forward, dispatches: [chunks, combine], outputs: [.out, .lse],
                            workspace: [.partialOut, .partialLse], problem: problem)
    }

    /// Backward, four dispatches in order: `flash_attention_backward_delta_<dtype>` over
    /// (ceil(seqlen_q / FA_DELTA_BLOCK_ROWS), num_heads, batch) threadgroups writes `delta`;
    /// `flash_attention_backward_lse_residual_<dtype>_d<DP>` over (ceil(seqlen_q / forward_block_q),
    /// num_heads, batch) threadgroups writes `lseResidual` (recomputing scores only for blocks with
    /// a row whose |lse| is huge); `flash_attention_backward_dq_<dtype>_d<DP>` over (ceil(seqlen_q / dq_block_q), num_heads, batch)
    /// threadgroups writes `dq`; `flash_attention_backward_dkv_<dtype>_d<DP>` over
    /// (ceil(seqlen_k / dkv_block_k), num_kv_heads, batch) threadgroups writes `dk` and `dv`, or, where
    /// the plan splits the GQA group (`problem.dkvSplits` > 1, `GroupSplit`),
    /// `flash_attention_backward_dkv_split_<dtype>_d<DP>` over (that x splits, num_kv_heads, batch)
    /// writes `partialDk` and `partialDv` and `flash_attention_backward_dkv_reduce_<dtype>` over
    /// (ceil(seqlen_k / FA_DKV_REDUCE_ROWS), num_kv_heads, batch) sums them into `dk` and `dv`. Where the
    /// tensor-op route is enabled and `TensorOps.backwardServes` the problem, dQ and dK/dV are
    /// `flash_attention_backward_dq_tensor_<dtype>_d<DP>` and `..._dkv_tensor_...` over blocks of
    /// FA_TENSOR_BLOCK_Q rows and keys (the pre-passes and dsinks stay; the group is not split).
    private static func backward(planned problem: Problem) -> DispatchPlan {
        let b = problem.bucket
        // `flops` per score element over blocks of `block` query rows, or of keys (`alongKeys`); nil:
        // `rowWork` per element of out (the delta pass), which a variable-length pass runs whole.
        func dispatch(_ kernel: Int, rows: UInt32, block: UInt32, heads: UInt32, flops: Int?, alongKeys: Bool = false,
                      rowWork: Int = 0) -> Dispatch {
            let width = blocks(rows, block)
            let work = flops.map { problem.gridWork(flopsPerScoreElement: $0, blocks: width, rows: block,
                                                    alongKeys: alongKeys) }
            return DispatchPlan.dispatch(kernel, problem, GridSize(width: width, height: heads, depth: problem.gridBatch),
                                         blockWork: work ?? (problem.varlen == nil ? rowWork : nil))
        }
        // Matrix products per (query row, key, head_dim element): the residual recomputes Q K^T;
        // dQ recomputes it and forms dO V^T and dS K; dK/dV recompute both scores and add P^T dO
        // and dS^T Q. The delta pass reads each row of dout and out once.
        let delta = dispatch(FA_KERNEL_backward_delta, rows: problem.gridSeqlenQ, block: UInt32(FA_DELTA_BLOCK_ROWS),
                             heads: problem.numHeads, flops: nil, rowWork: problem.rowWork(flopsPerElement: 2))
        let residual = dispatch(FA_KERNEL_backward_lse_residual, rows: problem.gridSeqlenQ, block: b.forward_block_q,
                                heads: problem.numHeads, flops: 2)
        // The tensor-op dQ and dK/dV where the route takes them and they serve the problem: one
        // threadgroup per FA_TENSOR_BLOCK_Q query rows (dQ) or keys (dK/dV).
        let tensor = problem.tensorOps.enabled && TensorOps.backwardServes(problem)
        let dq = dispatch(tensor ? FA_KERNEL_backward_dq_tensor : FA_KERNEL_backward_dq, rows: problem.gridSeqlenQ,
                          block: tensor ? TensorOps.queryBlock(b) : b.dq_block_q, heads: problem.numHeads, flops: 6)
        var gradients = [delta, residual, dq]
        var workspace: [BufferRole] = [.delta, .lseResidual]
        if problem.dkvSplits > 1 {
            // x = key block x splits + split; each threadgroup's work is 1 / splits of the unsplit one's.
            var split = dispatch(FA_KERNEL_backward_dkv_split, rows: problem.gridSeqlenK, block: b.dkv_block_k,
                                 heads: problem.numKVHeads, flops: 8, alongKeys: true)
            split.threadgroupsPerGrid.width *= problem.dkvSplits
            // A few additions per element of dk and dv: small next to the score kernels, run whole.
            let reduce = DispatchPlan.dispatch(FA_KERNEL_backward_dkv_reduce, problem,
                                               GridSize(width: blocks(problem.gridSeqlenK, UInt32(FA_DKV_REDUCE_ROWS)),
                                                        height: problem.numKVHeads, depth: problem.gridBatch),
                                               blockWork: nil)
            gradients += [split, reduce]
            workspace += [.partialDk, .partialDv]
        } else {
            gradients.append(dispatch(tensor ? FA_KERNEL_backward_dkv_tensor : FA_KERNEL_backward_dkv,
                                      rows: problem.gridSeqlenK, block: tensor ? UInt32(FA_TENSOR_BLOCK_Q) : b.dkv_block_k,
                                      heads: problem.numKVHeads, flops: 8, alongKeys: true))
        }
        guard problem.scores.hasSinks else {
            return withSequenceTable(DispatchPlan(pass: .backward, dispatches: gradients,
                                                  outputs: [.dq, .dk, .dv], workspace: workspace,
                                                  problem: problem))
        }
        // dsinks sums over every batch entry: it runs once over the whole problem, after the pieces.
        var dsinks = DispatchPlan.dispatch(FA_KERNEL_backward_dsinks, problem,
                                           GridSize(width: problem.numHeads, height: 1, depth: 1), blockWork: nil)
        dsinks.wholeProblem = true
        return withSequenceTable(DispatchPlan(pass: .backward, dispatches: gradients + [dsinks],
                                              outputs: [.dq, .dk, .dv, .dsinks], workspace: workspace,
                                              problem: problem))
    }

    /// A dispatch of catalogue kernel `kernel` (`FA_KERNEL_*`) for `problem`: the instance of its
    /// dtype and bucket, its buffers bound by role, the function constants it reads.
    private static func dispatch(_ kernel: Int, _ problem: Problem, _ grid: GridSize, blockWork: Int?) -> Dispatch {
        let k = CatalogueKernel.kernel(kernel)
        return Dispatch(kernelName: k.instanceName(for: problem), bindings: k.bindings(for: problem),
                        paramsIndex: k.paramsIndex, params: problem.params, threadgroupsPerGrid: grid,
                        threadsPerThreadgroup: threadgroupSize, blockWork: blockWork,
                        specialization: SpecializationConstant.values(k.constants, for: problem.params))
    }

    /// Threads per threadgroup of every kernel.
    private static var threadgroupSize: GridSize {
        GridSize(width: fa_threads_per_threadgroup(), height: 1, depth: 1)
    }

    /// Merge (`fa_merge_attention_v2`): `flash_attention_merge_<dtype>` over (ceil(seqlen_q /
    /// FA_MERGE_ROWS_PER_THREADGROUP), num_heads, batch) threadgroups, FA_MERGE_THREADS_PER_ROW
    /// threads per row; `problem` gives the row layout (``Problem/merge(rows:headDim:)``).
    private static func merge(planned problem: Problem) -> DispatchPlan {
        let rows = UInt32(FA_MERGE_ROWS_PER_THREADGROUP)
        assert(rows * UInt32(FA_MERGE_THREADS_PER_ROW) == threadgroupSize.width)
        let dispatch = self.dispatch(FA_KERNEL_merge, problem,
                                     GridSize(width: blocks(problem.seqlenQ, rows), height: problem.numHeads,
                                              depth: problem.batch),
                                     blockWork: nil)
        return DispatchPlan(pass: .merge, dispatches: [dispatch], outputs: [.out, .lse], workspace: [],
                            problem: problem)
    }

    /// A variable-length pass (`problem.varlen`): `plan` after `flash_attention_varlen_sequences`
    /// (one threadgroup) writes the sequence table from cu_seqlens_q and cu_seqlens_k, its
    /// dispatches over sequences bind that table at their parameter index (dsinks, which sums over
    /// all rows of the packed problem, keeps the host's struct). Dense plans are returned as they are.
    private static func withSequenceTable(_ plan: DispatchPlan) -> DispatchPlan {
        guard plan.problem.varlen != nil else { return plan }
        let table = dispatch(FA_KERNEL_varlen_sequences, plan.problem, GridSize(width: 1, height: 1, depth: 1),
                             blockWork: nil)
        let dispatches = plan.dispatches.map { dispatch -> Dispatch in
            var d = dispatch
            if !d.wholeProblem { d.paramsRole = .sequenceTable }
            return d
        }
        return DispatchPlan(pass: plan.pass, dispatches: [table] + dispatches, outputs: plan.outputs,
                            workspace: plan.workspace + [.sequenceTable], problem: plan.problem)
    }

    /// ceil(length / block), computed without the overflow of `length + block - 1` near 2^32.
    private static func blocks(_ length: UInt32, _ block: UInt32) -> UInt32 {
        length / block + (length % block == 0 ? 0 : 1)
    }
}

extension Problem {
    /// The query rows, keys and batch entries the grids cover: the longest sequence's and the
    /// sequences of a variable-length batch (whose threadgroups past their sequence's end return).
    var gridSeqlenQ: UInt32 { varlen?.maxSeqlenQ ?? seqlenQ }
    var gridSeqlenK: UInt32 { varlen?.maxSeqlenK ?? seqlenK }
    var gridBatch: UInt32 { varlen?.sequences ?? batch }
}
