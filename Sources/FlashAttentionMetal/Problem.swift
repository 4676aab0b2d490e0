import CFlashAttentionMetal

/// The sizes of one attention problem.
///
/// Layout (row-major, contiguous): `q`, `out`, `dout`, `dq` are
/// `[batch][numHeads][seqlenQ][headDim]`; `k`, `v`, `dk`, `dv` are
/// `[batch][numKVHeads][seqlenK][headDim]`; `lse` is `[batch][numHeads][seqlenQ]`.
/// `numHeads` must be a multiple of `numKVHeads` (GQA/MQA: query head `h` reads KV head
/// `h / (numHeads / numKVHeads)`), and `headDim` lies in `1...256`.
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
    /// Size of each head vector, `1...256`.
    public var headDim: Int

    /// Creates a shape; `numKVHeads` defaults to `numHeads` (plain multi-head attention) and
    /// `seqlenK` to `seqlenQ` (self-attention). Nothing is checked until the shape is used.
    public init(batch: Int, numHeads: Int, numKVHeads: Int? = nil, seqlenQ: Int, seqlenK: Int? = nil,
                headDim: Int) {
        self.batch = batch
        self.numHeads = numHeads
        self.numKVHeads = numKVHeads ?? numHeads
        self.seqlenQ = seqlenQ
        self.seqlenK = seqlenK ?? seqlenQ
        self.headDim = headDim
    }

    /// Elements of `q`, `out`, `dout`, `dq`: `batch * numHeads * seqlenQ * headDim`
    /// (wrapping arithmetic; a validated shape never overflows).
    public var queryElementCount: Int { batch &* numHeads &* seqlenQ &* headDim }
    /// Elements of `k`, `v`, `dk`, `dv`: `batch * numKVHeads * seqlenK * headDim`.
    public var keyValueElementCount: Int { batch &* numKVHeads &* seqlenK &* headDim }
    /// Elements of `lse`: `batch * numHeads * seqlenQ`.
    public var lseElementCount: Int { batch &* numHeads &* seqlenQ }
}

/// A validated attention problem: the one place where shapes, flags and the scale are checked, for
/// the C exports and the Swift API alike. Holding a `Problem` means every rule below held.
struct Problem {
    let batch: UInt32
    let numHeads: UInt32
    let numKVHeads: UInt32
    let seqlenQ: UInt32
    let seqlenK: UInt32
    let headDim: UInt32
    let causal: Bool
    let softmaxScale: Float
    /// The row of FA_HEAD_DIM_BUCKETS the kernels use for `headDim`.
    let bucket: FlashAttentionBucket
    /// Element counts of the q-like, kv-like and lse buffers; their byte sizes fit in `Int`.
    let queryElements: Int
    let keyValueElements: Int
    let lseElements: Int
    /// The split-KV chunking of the forward pass, or nil for the dense forward.
    let split: KeyValueSplit?

    /// Validates a C descriptor. `pointer` may be null; its `struct_size` is read first so that no
    /// byte past what the caller declared is read.
    static func validate(_ pointer: UnsafePointer<fa_problem>?) throws -> Problem {
        guard let pointer else {
            throw FlashAttentionError.invalidArgument("problem must not be null")
        }
        let declaredSize = UnsafeRawPointer(pointer).load(as: UInt32.self)
        let requiredSize = MemoryLayout<fa_problem>.size
        guard Int(declaredSize) >= requiredSize else {
            throw FlashAttentionError.invalidArgument(
                "problem->struct_size (\(declaredSize)) must be at least sizeof(fa_problem) (\(requiredSize))")
        }
        let p = pointer.pointee
        guard p.causal <= 1 else {
            throw FlashAttentionError.invalidArgument("causal (\(p.causal)) must be 0 or 1")
        }
        return try Problem(batch: Int(p.batch), numHeads: Int(p.num_heads), numKVHeads: Int(p.num_kv_heads),
                           seqlenQ: Int(p.seqlen_q), seqlenK: Int(p.seqlen_k), headDim: Int(p.head_dim),
                           causal: p.causal == 1, softmaxScale: p.softmax_scale)
    }

    /// Validates a Swift shape; `softmaxScale` nil means `1 / sqrt(headDim)`.
    static func validate(_ shape: AttentionShape, causal: Bool, softmaxScale: Float?) throws -> Problem {
        let scale = softmaxScale ?? (shape.headDim > 0 ? 1 / Float(shape.headDim).squareRoot() : 1)
        return try Problem(batch: shape.batch, numHeads: shape.numHeads, numKVHeads: shape.numKVHeads,
                           seqlenQ: shape.seqlenQ, seqlenK: shape.seqlenK, headDim: shape.headDim,
                           causal: causal, softmaxScale: scale)
    }

    /// Memberwise: the checked initializer below and `slice` end here.
    private init(batch: UInt32, numHeads: UInt32, numKVHeads: UInt32, seqlenQ: UInt32, seqlenK: UInt32,
                 headDim: UInt32, causal: Bool, softmaxScale: Float, bucket: FlashAttentionBucket,
                 queryElements: Int, keyValueElements: Int, lseElements: Int, split: KeyValueSplit?) {
        self.batch = batch
        self.numHeads = numHeads
        self.numKVHeads = numKVHeads
        self.seqlenQ = seqlenQ
        self.seqlenK = seqlenK
        self.headDim = headDim
        self.causal = causal
        self.softmaxScale = softmaxScale
        self.bucket = bucket
        self.queryElements = queryElements
        self.keyValueElements = keyValueElements
        self.lseElements = lseElements
        self.split = split
    }

    private init(batch: Int, numHeads: Int, numKVHeads: Int, seqlenQ: Int, seqlenK: Int, headDim: Int,
                 causal: Bool, softmaxScale: Float) throws {
        let dims = [("batch", batch), ("num_heads", numHeads), ("num_kv_heads", numKVHeads),
                    ("seqlen_q", seqlenQ), ("seqlen_k", seqlenK), ("head_dim", headDim)]
        for (name, value) in dims {
            guard value >= 1 else {
                throw FlashAttentionError.invalidArgument("\(name) (\(value)) must be at least 1")
            }
            // The kernels take every size as a 32-bit unsigned field of FlashAttentionParams.
            guard value <= Int(UInt32.max) else {
                throw FlashAttentionError.invalidArgument("\(name) (\(value)) must be at most \(UInt32.max)")
            }
        }
        guard numHeads % numKVHeads == 0 else {
            throw FlashAttentionError.invalidArgument(
                "num_heads (\(numHeads)) must be a multiple of num_kv_heads (\(numKVHeads))")
        }
        var bucket = FlashAttentionBucket()
        guard fa_bucket_for_head_dim(UInt32(headDim), &bucket) != 0 else {
            throw FlashAttentionError.unsupported(
                "head_dim (\(headDim)) must be at most fa_max_head_dim() (\(fa_max_head_dim()))")
        }
        guard softmaxScale.isFinite else {
            throw FlashAttentionError.invalidArgument("softmax_scale (\(softmaxScale)) must be finite")
        }
        let query = try Problem.checkedCount([batch, numHeads, seqlenQ, headDim], bytesPerElement: 2, of: "q")
        let keyValue = try Problem.checkedCount([batch, numKVHeads, seqlenK, headDim], bytesPerElement: 2,
                                                of: "k")
        let lse = try Problem.checkedCount([batch, numHeads, seqlenQ], bytesPerElement: 4, of: "lse")
        self.init(batch: UInt32(batch), numHeads: UInt32(numHeads), numKVHeads: UInt32(numKVHeads),
                  seqlenQ: UInt32(seqlenQ), seqlenK: UInt32(seqlenK), headDim: UInt32(headDim), causal: causal,
                  softmaxScale: softmaxScale, bucket: bucket, queryElements: query, keyValueElements: keyValue,
                  lseElements: lse,
                  split: KeyValueSplit(batch: UInt32(batch), numHeads: UInt32(numHeads),
                                       numKVHeads: UInt32(numKVHeads), seqlenQ: UInt32(seqlenQ),
                                       seqlenK: UInt32(seqlenK), bucket: bucket))
    }

    /// The product of `factors`, checked so that the byte size of a buffer of that many elements
    /// fits in `Int` (pointer arithmetic on the host and 64-bit offsets in the kernels).
    private static func checkedCount(_ factors: [Int], bytesPerElement: Int, of name: String) throws -> Int {
        var count = 1
        for factor in factors {
            let (product, overflow) = count.multipliedReportingOverflow(by: factor)
            guard !overflow else {
                throw FlashAttentionError.invalidArgument("\(name) has more elements than fit in a 64-bit size")
            }
            count = product
        }
        guard !count.multipliedReportingOverflow(by: bytesPerElement).overflow else {
            throw FlashAttentionError.invalidArgument("\(name) (\(count) elements) has more bytes than fit in a 64-bit size")
        }
        return count
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
        return Problem(batch: UInt32(b), numHeads: UInt32(h), numKVHeads: UInt32(kv), seqlenQ: seqlenQ,
                       seqlenK: seqlenK, headDim: headDim, causal: causal, softmaxScale: softmaxScale,
                       bucket: bucket, queryElements: b * h * Int(seqlenQ) * Int(headDim),
                       keyValueElements: b * kv * Int(seqlenK) * Int(headDim),
                       lseElements: b * h * Int(seqlenQ), split: split)
    }

    /// Query heads per KV head (the GQA group).
    var groupSize: UInt32 { numHeads / numKVHeads }

    /// The kernels' parameter struct for this problem.
    var params: FlashAttentionParams {
        FlashAttentionParams(batch: batch, num_heads: numHeads, num_kv_heads: numKVHeads, seqlen_q: seqlenQ,
                             seqlen_k: seqlenK, head_dim: headDim, causal: causal ? 1 : 0,
                             softmax_scale: softmaxScale, kv_chunks: split?.chunks ?? 1,
                             kv_chunk_keys: split?.chunkKeys ?? seqlenK)
    }

    /// The Swift shape of this problem.
    var shape: AttentionShape {
        AttentionShape(batch: Int(batch), numHeads: Int(numHeads), numKVHeads: Int(numKVHeads),
                       seqlenQ: Int(seqlenQ), seqlenK: Int(seqlenK), headDim: Int(headDim))
    }
}
