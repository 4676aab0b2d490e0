import CFlashAttentionMetal

/// The sizes of one attention problem.
///
/// Tensors (contiguous row-major unless strides say otherwise): `q`, `dq` are
/// `[batch][numHeads][seqlenQ][headDim]`; `out`, `dout` are `[batch][numHeads][seqlenQ][headDimV]`;
/// `k`, `dk` are `[batch][numKVHeads][seqlenK][headDim]`; `v`, `dv` are
/// `[batch][numKVHeads][seqlenK][headDimV]`; `lse` is `[batch][numHeads][seqlenQ]`.
/// `numHeads` must be a multiple of `numKVHeads` (GQA/MQA: query head `h` reads KV head
/// `h / (numHeads / numKVHeads)`), and `headDim` and `headDimV` lie in `1...576`
/// (`1...256` in float32).
public struct AttentionShape: Equatable, Sendable {
    /// Number of independent sequences.
    public var batch: Int
    /// Number of query heads.
    public var numHeads: Int
    /// Number of key/value heads; divides `numHeads`.
    public var numKVHeads: Int
    /// Number of queries per sequence.
    public var seqlenQ: Int
    /// Number of keys (and values) per sequence.
    public var seqlenK: Int
    /// Size of each query and key head vector, `1...576` (`1...256` in float32).
    public var headDim: Int
    /// Size of each value (and output) head vector, `1...576` (`1...256` in float32).
    public var headDimV: Int

    /// Creates a shape; `numKVHeads` defaults to `numHeads` (plain multi-head attention), `seqlenK`
    /// to `seqlenQ` (self-attention) and `headDimV` to `headDim`. Nothing is checked until the shape
    /// is used.
    public init(batch: Int, numHeads: Int, numKVHeads: Int? = nil, seqlenQ: Int, seqlenK: Int? = nil,
                headDim: Int, headDimV: Int? = nil) {
        self.batch = batch
        self.numHeads = numHeads
        self.numKVHeads = numKVHeads ?? numHeads
        self.seqlenQ = seqlenQ
        self.seqlenK = seqlenK ?? seqlenQ
        self.headDim = headDim
        self.headDimV = headDimV ?? headDim
    }

    /// Elements of `q` and `dq`: `batch * numHeads * seqlenQ * headDim`
    /// (wrapping arithmetic; a validated shape never overflows).
    public var queryElementCount: Int { batch &* numHeads &* seqlenQ &* headDim }
    /// Elements of `out` and `dout`: `batch * numHeads * seqlenQ * headDimV`.
    public var outputElementCount: Int { batch &* numHeads &* seqlenQ &* headDimV }
    /// Elements of `k` and `dk`: `batch * numKVHeads * seqlenK * headDim`.
    public var keyElementCount: Int { batch &* numKVHeads &* seqlenK &* headDim }
    /// Elements of `k` and `dk` (the 0.1 name, from when `v` always had `headDim` columns).
    @available(*, deprecated, renamed: "keyElementCount")
    public var keyValueElementCount: Int { keyElementCount }
    /// Elements of `v` and `dv`: `batch * numKVHeads * seqlenK * headDimV`.
    public var valueElementCount: Int { batch &* numKVHeads &* seqlenK &* headDimV }
    /// Elements of `lse`: `batch * numHeads * seqlenQ`.
    public var lseElementCount: Int { batch &* numHeads &* seqlenQ }
}

/// Strides of the tensors of one call; nil means contiguous. `out`, `dout`, `dq`, `dk`, `dv` are
/// written (or read) by their own strides, independent of the inputs'.
struct ProblemStrides {
    var q, k, v, out, dout, dq, dk, dv: TensorStrides?
}

/// The sequences of a variable-length batch (``Problem/varlen``): `sequences` packed along the rows
/// of a one-entry problem, each covering at most `maxSeqlenQ` query rows and `maxSeqlenK` keys.
struct VarlenSpec: Equatable {
    let sequences: UInt32
    let maxSeqlenQ: UInt32
    let maxSeqlenK: UInt32
}

/// A validated attention problem: the one place where shapes, dtype, layouts, flags and the scale
/// are checked, for the C exports and the Swift API alike. Holding a `Problem` means every rule
/// below held.
struct Problem {
    let batch: UInt32
    let numHeads: UInt32
    let numKVHeads: UInt32
    let seqlenQ: UInt32
    let seqlenK: UInt32
    let headDim: UInt32
    let headDimV: UInt32
    let dtype: AttentionDType
    let causal: Bool
    let softmaxScale: Float
    /// The row of the dtype's bucket table the kernels use for max(headDim, headDimV).
    let bucket: FlashAttentionBucket
    /// Layouts of the eight tensors (their extents fit in `Int` bytes).
    let layouts: [BufferRole: TensorLayout]
    /// The split-KV chunking of the forward pass, or nil for the dense forward; decided by the
    /// planner (`DispatchPlan.make`), never by validation.
    let split: KeyValueSplit?
    /// The GPU core count `split` was planned for; nil in a problem the planner has not planned.
    let gpuCores: UInt32?
    /// Whether the plan takes the tensor-op kernels (`TensorOps.route`); `.off` until planned.
    let tensorOps: TensorOpsRoute
    /// Window, softcap, mask, ALiBi and sinks.
    let scores: ScoreSpec
    /// The KV cache k and v are read from (forward), or nil for plain tensors.
    let kvCache: KVCacheSpec?
    /// Nil for a dense problem. A variable-length batch is a problem of one batch entry whose
    /// seqlen_q and seqlen_k rows are the packed totals, cut into sequences by the kernels.
    let varlen: VarlenSpec?
    /// Dropout on P, or nil for none. A problem with dropout runs the dense forward (never split).
    let dropout: DropoutSpec?

    /// The size of a 0.1 `fa_problem`: the fields up to `softmax_scale`.
    private static let firstVersionSize = MemoryLayout<fa_problem>.offset(of: \fa_problem.dtype)!

    /// Validates a C descriptor. `pointer` may be null; its `struct_size` is read first so that no
    /// byte past what the caller declared is read, and fields past it take their defaults.
    static func validate(_ pointer: UnsafePointer<fa_problem>?) throws -> Problem {
        try validate(descriptor(pointer))
    }

    /// Validates a descriptor already read by `descriptor(_:)` (fields past the caller's
    /// `struct_size` zero).
    static func validate(_ p: fa_problem) throws -> Problem {
        guard p.causal <= 1 else {
            throw FlashAttentionError.invalidArgument("causal (\(p.causal)) must be 0 or 1")
        }
        guard let dtype = AttentionDType(rawValue: p.dtype) else {
            throw FlashAttentionError.invalidArgument(
                "dtype (\(p.dtype)) must be FA_DTYPE_FLOAT16, FA_DTYPE_BFLOAT16 or FA_DTYPE_FLOAT32")
        }
        func strides(_ s: fa_strides, _ name: String) throws -> TensorStrides? {
            if s.batch == 0 && s.head == 0 && s.seq == 0 { return nil }
            for value in [s.batch, s.head, s.seq] where value < 0 || value > Int64(Int.max) {
                throw FlashAttentionError.invalidArgument("\(name) strides (\(s.batch), \(s.head), \(s.seq)) must not be negative")
            }
            return TensorStrides(batch: Int(s.batch), head: Int(s.head), seq: Int(s.seq))
        }
        let isVarlen = p.cu_seqlens_q != nil || p.cu_seqlens_k != nil
        let headDimV = Int(p.head_dim_v == 0 ? p.head_dim : p.head_dim_v)
        // A packed tensor without strides is contiguous (total, heads, dim); its one batch entry's
        // stride is the whole tensor's span.
        func strides(_ s: fa_strides, _ name: String, heads: UInt32, rows: UInt32, dim: Int) throws -> TensorStrides? {
            let given = try strides(s, name)
            guard isVarlen && given == nil else { return given }
            // Checked: the dimensions are not validated yet (found by CABIFuzzTests).
            let seq = Int(heads).multipliedReportingOverflow(by: dim)
            let batch = Int(max(rows, 1)).multipliedReportingOverflow(by: seq.partialValue)
            guard !seq.overflow, !batch.overflow else {
                throw FlashAttentionError.invalidArgument(
                    "\(name): \(rows) rows x \(heads) heads x \(dim) elements overflow 64-bit element offsets")
            }
            return TensorStrides(batch: batch.partialValue, head: dim, seq: seq.partialValue)
        }
        let (h, hk, d, sq, sk) = (p.num_heads, p.num_kv_heads, Int(p.head_dim), p.seqlen_q, p.seqlen_k)
        let layout = ProblemStrides(q: try strides(p.q, "q", heads: h, rows: sq, dim: d),
                                    k: try strides(p.k, "k", heads: hk, rows: sk, dim: d),
                                    v: try strides(p.v, "v", heads: hk, rows: sk, dim: headDimV),
                                    out: try strides(p.out, "out", heads: h, rows: sq, dim: headDimV),
                                    dout: try strides(p.dout, "dout", heads: h, rows: sq, dim: headDimV),
                                    dq: try strides(p.dq, "dq", heads: h, rows: sq, dim: d),
                                    dk: try strides(p.dk, "dk", heads: hk, rows: sk, dim: d),
                                    dv: try strides(p.dv, "dv", heads: hk, rows: sk, dim: headDimV))
        let shape = AttentionShape(batch: Int(p.batch), numHeads: Int(p.num_heads), numKVHeads: Int(p.num_kv_heads),
                                   seqlenQ: Int(p.seqlen_q), seqlenK: Int(p.seqlen_k), headDim: Int(p.head_dim),
                                   headDimV: p.head_dim_v == 0 ? Int(p.head_dim) : Int(p.head_dim_v))
        guard p.use_window <= 1, p.alibi_per_batch <= 1 else {
            throw FlashAttentionError.invalidArgument(
                "use_window (\(p.use_window)) and alibi_per_batch (\(p.alibi_per_batch)) must be 0 or 1")
        }
        guard p.attn_mask_type == UInt32(FA_MASK_NONE) || p.attn_mask != nil else {
            throw FlashAttentionError.invalidArgument("attn_mask must not be null when attn_mask_type is set")
        }
        let maskStrides = TensorStrides(batch: Int(p.attn_mask_strides.batch), head: Int(p.attn_mask_strides.head),
                                        seq: Int(p.attn_mask_strides.seq))
        var varlen: VarlenSpec?
        if p.cu_seqlens_q != nil || p.cu_seqlens_k != nil {
            guard p.cu_seqlens_q != nil && p.cu_seqlens_k != nil else {
                throw FlashAttentionError.invalidArgument("cu_seqlens_q and cu_seqlens_k must be given together")
            }
            varlen = VarlenSpec(sequences: p.batch, maxSeqlenQ: p.max_seqlen_q, maxSeqlenK: p.max_seqlen_k)
        }
        let kvCache = try KVCacheSpec.validate(p)
        let dropout = try DropoutSpec(AttentionDropout(p: p.dropout_p, seed: p.dropout_seed, offset: p.dropout_offset),
                                      numHeads: Int(p.num_heads), kvCache: kvCache != nil)
        return try Problem(shape, dtype: dtype, causal: p.causal == 1, softmaxScale: p.softmax_scale, strides: layout,
                           window: p.use_window == 1 ? (Int(p.window_left), Int(p.window_right)) : nil,
                           softcap: p.softcap, maskType: p.attn_mask_type, maskStrides: maskStrides,
                           hasAlibi: p.alibi_slopes != nil, alibiPerBatch: p.alibi_per_batch == 1,
                           hasSinks: p.sinks != nil, kvCache: kvCache, varlen: varlen, dropout: dropout)
    }

    /// The caller's descriptor as far as its `struct_size` goes, later fields zero (their defaults).
    /// - Throws: `invalidArgument` for a null pointer, a `struct_size` below the 0.1 struct, or one
    ///   above this library's `fa_problem` with a non-zero byte past it.
    static func descriptor(_ pointer: UnsafePointer<fa_problem>?) throws -> fa_problem {
        guard let pointer else {
            throw FlashAttentionError.invalidArgument("problem must not be null")
        }
        let declaredSize = Int(UnsafeRawPointer(pointer).load(as: UInt32.self))
        guard declaredSize >= firstVersionSize else {
            throw FlashAttentionError.invalidArgument(
                "problem->struct_size (\(declaredSize)) must be at least \(firstVersionSize) (the 0.1 fa_problem)")
        }
        // A newer caller's struct: its fields past ours must be zero (their defaults), as the
        // extensible structs of Linux's copy_struct_from_user; a set field we do not know is refused.
        let known = MemoryLayout<fa_problem>.size
        if declaredSize > known {
            let tail = UnsafeRawBufferPointer(start: UnsafeRawPointer(pointer) + known, count: declaredSize - known)
            if let offset = tail.firstIndex(where: { $0 != 0 }) {
                throw FlashAttentionError.invalidArgument(
                    "problem->struct_size (\(declaredSize)) is above sizeof(fa_problem) (\(known)) of this library, "
                        + "and byte \(known + offset) is not zero: a field of a newer fa_problem that this library "
                        + "does not know is set")
            }
        }
        var p = fa_problem()
        withUnsafeMutableBytes(of: &p) { bytes in
            bytes.copyMemory(from: UnsafeRawBufferPointer(start: pointer,
                                                          count: min(declaredSize, MemoryLayout<fa_problem>.size)))
        }
        return p
    }

    /// Validates a Swift shape; `softmaxScale` nil means `1 / sqrt(headDim)`.
    static func validate(_ shape: AttentionShape, dtype: AttentionDType = .float16, causal: Bool,
                         softmaxScale: Float?, strides: ProblemStrides = ProblemStrides(),
                         options: AttentionOptions = AttentionOptions(), varlen: VarlenSpec? = nil) throws -> Problem {
        let scale = softmaxScale ?? (shape.headDim > 0 ? 1 / Float(shape.headDim).squareRoot() : 1)
        var maskType = UInt32(FA_MASK_NONE)
        var maskStrides = TensorStrides(batch: 0, head: 0, seq: 0)
        switch options.attnMask {
        case .boolean(_, let s): (maskType, maskStrides) = (UInt32(FA_MASK_BOOL), s)
        case .additive(_, let s): (maskType, maskStrides) = (UInt32(FA_MASK_ADDITIVE_F32), s)
        case nil: break
        }
        let window = options.windowLeft == -1 && options.windowRight == -1
            ? nil : (options.windowLeft, options.windowRight)
        let alibiPerBatch = options.alibiSlopes.map { $0.count != shape.numHeads } ?? false
        let dropout = try options.dropout.flatMap {
            try DropoutSpec($0, numHeads: shape.numHeads, kvCache: false)
        }
        return try Problem(shape, dtype: dtype, causal: causal, softmaxScale: scale, strides: strides,
                           window: window, softcap: options.softcap, maskType: maskType, maskStrides: maskStrides,
                           hasAlibi: options.alibiSlopes != nil, alibiPerBatch: alibiPerBatch,
                           hasSinks: options.sinks != nil, varlen: varlen, dropout: dropout)
    }

    /// Validates the sizes of a merge (`fa_merge_attention_v2`): `rows` rows of `headDim` elements
    /// of `dtype`, laid out as the `out` and `lse` of a forward problem with one sequence of `rows`
    /// queries in one head (the merge kernel reads only batch, num_heads, seqlen_q and head_dim).
    static func merge(rows: UInt64, headDim: Int, dtype: AttentionDType = .float16) throws -> Problem {
        guard rows >= 1 else {
            throw FlashAttentionError.invalidArgument("rows (0) must be at least 1")
        }
        guard rows <= UInt64(UInt32.max) else {
            throw FlashAttentionError.invalidArgument("rows (\(rows)) must be at most \(UInt32.max)")
        }
        return try Problem(AttentionShape(batch: 1, numHeads: 1, seqlenQ: Int(rows), seqlenK: 1, headDim: headDim),
                           dtype: dtype, causal: false, softmaxScale: 1, strides: ProblemStrides())
    }

    /// Memberwise: the checked initializer below and `slice` end here.
    private init(batch: UInt32, numHeads: UInt32, numKVHeads: UInt32, seqlenQ: UInt32, seqlenK: UInt32,
                 headDim: UInt32, headDimV: UInt32, dtype: AttentionDType, causal: Bool, softmaxScale: Float,
                 bucket: FlashAttentionBucket, layouts: [BufferRole: TensorLayout], scores: ScoreSpec,
                 split: KeyValueSplit?, gpuCores: UInt32?, tensorOps: TensorOpsRoute = .off, kvCache: KVCacheSpec?,
                 varlen: VarlenSpec? = nil, dropout: DropoutSpec? = nil) {
        self.batch = batch
        self.numHeads = numHeads
        self.numKVHeads = numKVHeads
        self.seqlenQ = seqlenQ
        self.seqlenK = seqlenK
        self.headDim = headDim
        self.headDimV = headDimV
        self.dtype = dtype
        self.causal = causal
        self.softmaxScale = softmaxScale
        self.bucket = bucket
        self.layouts = layouts
        self.scores = scores
        self.split = split
        self.gpuCores = gpuCores
        self.tensorOps = tensorOps
        self.kvCache = kvCache
        self.varlen = varlen
        self.dropout = dropout
    }

    private init(_ shape: AttentionShape, dtype: AttentionDType, causal: Bool, softmaxScale: Float,
                 strides: ProblemStrides, window: (left: Int, right: Int)? = nil, softcap: Float = 0,
                 maskType: UInt32 = UInt32(FA_MASK_NONE),
                 maskStrides: TensorStrides = TensorStrides(batch: 0, head: 0, seq: 0), hasAlibi: Bool = false,
                 alibiPerBatch: Bool = false, hasSinks: Bool = false, kvCache: KVCacheSpec? = nil,
                 varlen: VarlenSpec? = nil, dropout: DropoutSpec? = nil) throws {
        // A variable-length batch: `batch` sequences packed into one entry of the totals' rows.
        var shape = shape
        if let varlen {
            guard kvCache == nil else {
                throw FlashAttentionError.invalidArgument(
                    "cu_seqlens_q and cu_seqlens_k (variable-length batches) cannot be combined with a KV cache (kv_cache_rows)")
            }
            try Problem.checkVarlen(varlen, shape: shape, maskType: maskType)
            shape.batch = 1
        }
        let dims = [("batch", shape.batch), ("num_heads", shape.numHeads), ("num_kv_heads", shape.numKVHeads),
                    ("seqlen_q", shape.seqlenQ), ("seqlen_k", shape.seqlenK), ("head_dim", shape.headDim),
                    ("head_dim_v", shape.headDimV)]
        for (name, value) in dims {
            guard value >= 1 else {
                throw FlashAttentionError.invalidArgument("\(name) (\(value)) must be at least 1")
            }
            // The kernels take every size as a 32-bit unsigned field of FlashAttentionParams.
            guard value <= Int(UInt32.max) else {
                throw FlashAttentionError.invalidArgument("\(name) (\(value)) must be at most \(UInt32.max)")
            }
        }
        guard shape.numHeads % shape.numKVHeads == 0 else {
            throw FlashAttentionError.invalidArgument(
                "num_heads (\(shape.numHeads)) must be a multiple of num_kv_heads (\(shape.numKVHeads))")
        }
        for (name, value) in [("head_dim", shape.headDim), ("head_dim_v", shape.headDimV)]
            where value > Int(fa_max_head_dim()) {
            throw FlashAttentionError.unsupported(
                "\(name) (\(value)) must be at most fa_max_head_dim() (\(fa_max_head_dim()))")
        }
        var bucket = FlashAttentionBucket()
        guard fa_bucket_for_head_dim(dtype.rawValue, UInt32(max(shape.headDim, shape.headDimV)), &bucket) != 0 else {
            // Only float32's table stops below fa_max_head_dim() (FA_MAX_HEAD_DIM_F32).
            throw FlashAttentionError.unsupported(
                "head_dim (\(shape.headDim)) and head_dim_v (\(shape.headDimV)) with dtype float32 must be at most "
                    + "\(FA_MAX_HEAD_DIM_F32): float32 tiles of larger heads do not fit 32 KiB of threadgroup "
                    + "memory; use float16 or bfloat16 (up to fa_max_head_dim(), \(fa_max_head_dim()))")
        }
        guard softmaxScale.isFinite else {
            throw FlashAttentionError.invalidArgument("softmax_scale (\(softmaxScale)) must be finite")
        }
        let (b, h, hk, sq, sk) = (shape.batch, shape.numHeads, shape.numKVHeads, shape.seqlenQ, shape.seqlenK)
        let tensors: [(BufferRole, TensorStrides?, (Int, Int, Int, Int))] = [
            (.q, strides.q, (b, h, sq, shape.headDim)),
            (.k, strides.k, kvCache.map { (Int($0.slots), hk, Int($0.cacheRows), $0.units(UInt32(shape.headDim))) }
                ?? (b, hk, sk, shape.headDim)),
            (.v, strides.v, kvCache.map { (Int($0.slots), hk, Int($0.cacheRows), $0.units(UInt32(shape.headDimV))) }
                ?? (b, hk, sk, shape.headDimV)),
            (.out, strides.out, (b, h, sq, shape.headDimV)),
            (.dout, strides.dout, (b, h, sq, shape.headDimV)), (.dq, strides.dq, (b, h, sq, shape.headDim)),
            (.dk, strides.dk, (b, hk, sk, shape.headDim)), (.dv, strides.dv, (b, hk, sk, shape.headDimV)),
        ]
        var layouts: [BufferRole: TensorLayout] = [:]
        for (role, given, tensorDims) in tensors {
            let layout = try TensorLayout(role.name, strides: given, dims: tensorDims,
                                          written: [.out, .dq, .dk, .dv].contains(role))
            let size = (role == .k || role == .v) && kvCache?.quantized ?? false ? 4 : dtype.size
            guard !layout.extent.multipliedReportingOverflow(by: size).overflow else {
                throw FlashAttentionError.invalidArgument(
                    "\(role.name) (\(layout.extent) elements) has more bytes than fit in a 64-bit size")
            }
            layouts[role] = layout
        }
        try kvCache?.checkStrides(layouts[.k]!, cols: UInt32(shape.headDim), name: "k")
        try kvCache?.checkStrides(layouts[.v]!, cols: UInt32(shape.headDimV), name: "v")
        // lse (and the delta workspace) must fit too; `lseElements` is then this product.
        _ = try TensorLayout.checkedCount([b, h, sq], bytesPerElement: 4, of: "lse")
        let scores = try ScoreSpec(causal: causal, window: window, softcap: softcap, maskType: maskType,
                                   maskStrides: maskStrides, hasAlibi: hasAlibi, alibiPerBatch: alibiPerBatch,
                                   hasSinks: hasSinks, dims: (b, h, sq, sk))
        self.init(batch: UInt32(b), numHeads: UInt32(h), numKVHeads: UInt32(hk), seqlenQ: UInt32(sq),
                  seqlenK: UInt32(sk), headDim: UInt32(shape.headDim), headDimV: UInt32(shape.headDimV), dtype: dtype,
                  causal: causal, softmaxScale: softmaxScale, bucket: bucket, layouts: layouts, scores: scores,
                  split: nil, gpuCores: nil, kvCache: kvCache, varlen: varlen, dropout: dropout)
    }

    /// The same problem with the split-KV chunking planned for `cores` GPU cores and the tensor-op
    /// route `tensorOps`: the planner's decisions (`DispatchPlan.make`), made once per call.
    func planned(forGPUCores cores: UInt32, tensorOps: TensorOpsRoute) -> Problem {
        Problem(batch: batch, numHeads: numHeads, numKVHeads: numKVHeads, seqlenQ: seqlenQ, seqlenK: seqlenK,
                headDim: headDim, headDimV: headDimV, dtype: dtype, causal: causal, softmaxScale: softmaxScale,
                bucket: bucket, layouts: layouts, scores: scores,
                split: varlen != nil || dropout != nil ? nil : KeyValueSplit(batch: batch, numHeads: numHeads,
                                                                              numKVHeads: numKVHeads,
                                                            seqlenQ: seqlenQ, seqlenK: seqlenK, bucket: bucket,
                                                            cores: cores),
                gpuCores: cores, tensorOps: tensorOps, kvCache: kvCache, varlen: varlen, dropout: dropout)
    }

    /// The rules of a variable-length batch that the host can check (the tables' values live where
    /// the kernels read them and are clamped there: flash_attention_varlen.h).
    private static func checkVarlen(_ varlen: VarlenSpec, shape: AttentionShape, maskType: UInt32) throws {
        guard varlen.sequences >= 1 else {
            throw FlashAttentionError.invalidArgument("batch (0), the number of sequences, must be at least 1")
        }
        for (name, value, total) in [("max_seqlen_q", varlen.maxSeqlenQ, shape.seqlenQ),
                                     ("max_seqlen_k", varlen.maxSeqlenK, shape.seqlenK)]
            where value < 1 || Int(value) > total {
            throw FlashAttentionError.invalidArgument(
                "\(name) (\(value)) must be at least 1 and at most the total rows (\(total))")
        }
        guard maskType == UInt32(FA_MASK_NONE) else {
            throw FlashAttentionError.invalidArgument("attn_mask must be NULL with cu_seqlens (variable-length batches)")
        }
    }

    /// The same problem restricted to `batches` batch entries and `kvHeads` KV heads with their
    /// query heads (whole GQA groups): what one piece of a split plan runs. Its buffers are the
    /// parts of this problem's buffers that start at `BufferRole.elementOffset` (see `PlanPiece`).
    /// The split-KV chunking stays the whole problem's (it would otherwise follow the smaller grid),
    /// so that a piece computes exactly what the whole plan computes for its rows.
    func slice(batches: Range<UInt32>, kvHeads: Range<UInt32>) -> Problem {
        precondition(!batches.isEmpty && batches.upperBound <= batch, "batch range outside the problem")
        precondition(!kvHeads.isEmpty && kvHeads.upperBound <= numKVHeads, "KV head range outside the problem")
        // Sub-ranges of a validated problem: every count below is at most the full one.
        let b = Int(batches.count), kv = Int(kvHeads.count), h = kv * Int(groupSize)
        var sliced: [BufferRole: TensorLayout] = [:]
        for (role, layout) in layouts {
            sliced[role] = layout.slice(batch: b, heads: layout.rows.heads == Int(numKVHeads) ? kv : h)
        }
        return Problem(batch: UInt32(b), numHeads: UInt32(h), numKVHeads: UInt32(kv), seqlenQ: seqlenQ,
                       seqlenK: seqlenK, headDim: headDim, headDimV: headDimV, dtype: dtype, causal: causal,
                       softmaxScale: softmaxScale, bucket: bucket, layouts: sliced,
                       scores: scores.slice(batch: b, heads: h),
                       split: split, gpuCores: gpuCores, tensorOps: tensorOps, kvCache: kvCache, varlen: varlen,
                       dropout: dropout?.slice(batch: batches.lowerBound, head: kvHeads.lowerBound * groupSize))
    }

    /// Elements of lse (and of the delta workspace): batch * numHeads * seqlenQ (checked by validation).
    var lseElements: Int { Int(batch) * Int(numHeads) * Int(seqlenQ) }

    /// Query heads per KV head (the GQA group).
    var groupSize: UInt32 { numHeads / numKVHeads }

    /// The kernels' parameter struct for this problem.
    var params: FlashAttentionParams {
        func strides(_ role: BufferRole) -> FlashAttentionStrides { layouts[role]!.params }
        // Columns a head dim fills in whole 8-column fragments: the products skip fragments only
        // where this falls short of the bucket (the tiles are zero past head_dim in any case).
        func fragmentColumns(_ dim: UInt32) -> UInt32 { (dim + 7) / 8 * 8 }
        var params = FlashAttentionParams(
            q: strides(.q), k: strides(.k), v: strides(.v), out: strides(.out), dout: strides(.dout),
            dq: strides(.dq), dk: strides(.dk), dv: strides(.dv),
            mask: scores.mask?.params ?? FlashAttentionStrides(batch: 0, head: 0, seq: 0),
            alibi_batch_stride: scores.alibiPerBatch ? UInt64(numHeads) : 0, dropout_seed: 0, dropout_offset: 0,
            batch: batch, num_heads: numHeads, num_kv_heads: numKVHeads, seqlen_q: seqlenQ, seqlen_k: seqlenK,
            head_dim: headDim, head_dim_v: headDimV, window_left: scores.windowLeft,
            window_right: scores.windowRight, softmax_scale: softmaxScale, softcap: scores.softcap,
            mask_type: scores.maskType, has_alibi: scores.hasAlibi ? 1 : 0, has_sinks: scores.hasSinks ? 1 : 0,
            kv_chunks: split?.chunks ?? 1, kv_chunk_keys: split?.chunkKeys ?? seqlenK,
            scalar_copies: layoutsAllowChunks ? 0 : 1,
            partial_columns: fragmentColumns(headDim) == bucket.head_dim_max
                && fragmentColumns(headDimV) == bucket.head_dim_max ? 0 : 1,
            block_offset: 0, kv_page_rows: 0, kv_max_blocks: 0, kv_num_blocks: 0, kv_bits: 0, kv_group_size: 0,
            sequences: varlen?.sequences ?? 0, seq_q0: 0, seq_k0: 0, lse_rows: 0,
            dropout_threshold: 0, dropout_scale: 1, dropout_stream0: 0, dropout_heads: 0)
        kvCache?.apply(to: &params)
        dropout?.apply(to: &params)
        return params
    }

    /// Whether the tensors the kernels copy in tiles (`BufferRole.copiedInTiles`) can be copied in
    /// FA_CHUNK_BYTES-byte chunks as far as the layouts go: head_dim, head_dim_v and every stride are
    /// multiples of FA_CHUNK_BYTES in bytes (the addresses are checked per call:
    /// `FlashAttentionParams.checkingAlignment`). Strides of axes of length 1 count too, so that the
    /// pieces of a split plan, which start at multiples of the strides, get the whole plan's answer.
    var layoutsAllowChunks: Bool {
        let size = dtype.size, chunk = Int(FA_CHUNK_BYTES)
        guard (Int(headDim) * size) % chunk == 0 && (Int(headDimV) * size) % chunk == 0 else { return false }
        return BufferRole.copiedInTiles.allSatisfy { role in
            // A quantized cache's words are dequantized element by element, never moved in chunks.
            if (role == .k || role == .v) && kvCache?.quantized ?? false { return true }
            guard let layout = layouts[role] else { return true }
            return [layout.strides.batch, layout.strides.head, layout.strides.seq].allSatisfy {
                // A stride whose bytes overflow (an axis of length 1 may hold any stride) never chunks.
                let (bytes, overflow) = $0.multipliedReportingOverflow(by: size)
                return !overflow && bytes % chunk == 0
            }
        }
    }
}

extension FlashAttentionParams {
    /// These parameters with `scalar_copies` set when a tensor the kernels copy in tiles starts at a
    /// byte address that is not a multiple of FA_CHUNK_BYTES (an in-place view such as x[..., 1:65]):
    /// the kernels' 16-byte loads need aligned rows. `address(role)` is where a bound role's tensor
    /// starts (on Metal its offset in a buffer whose contents are page-aligned), nil when unbound.
    func checkingAlignment(_ address: (BufferRole) -> UInt?) -> FlashAttentionParams {
        var params = self
        let chunked = BufferRole.copiedInTiles.filter { kv_bits == 0 || ($0 != .k && $0 != .v) }
        if chunked.contains(where: { address($0).map { $0 % UInt(FA_CHUNK_BYTES) != 0 } ?? false }) {
            params.scalar_copies = 1
        }
        return params
    }
}
