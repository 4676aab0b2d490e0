/// The sequences of a variable-length batch (FlashAttention's `flash_attn_varlen_func`): sequence
/// `b` is query rows `cuSeqlensQ[b] ..< cuSeqlensQ[b + 1]` over keys `cuSeqlensK[b] ..< cuSeqlensK[b + 1]`
/// of tensors packed along their rows.
public struct VarlenBatch: Equatable, Sendable {
    /// Cumulative query lengths, `sequences + 1` values: 0 first, non-decreasing, the total last.
    public var cuSeqlensQ: [Int32]
    /// Cumulative key lengths, as many values as `cuSeqlensQ`.
    public var cuSeqlensK: [Int32]

    public init(cuSeqlensQ: [Int32], cuSeqlensK: [Int32]) {
        self.cuSeqlensQ = cuSeqlensQ
        self.cuSeqlensK = cuSeqlensK
    }

    /// Number of sequences.
    public var sequences: Int { cuSeqlensQ.count - 1 }

    /// Checks the tables (host memory: every value) and returns the spec the kernels get, with the
    /// longest sequences as the grid's extent.
    func validated() throws -> VarlenSpec {
        guard cuSeqlensQ.count >= 2, cuSeqlensK.count == cuSeqlensQ.count else {
            throw FlashAttentionError.invalidArgument(
                "cuSeqlensQ (\(cuSeqlensQ.count) values) and cuSeqlensK (\(cuSeqlensK.count)) must hold the same "
                    + "number of values, at least 2 (sequences + 1)")
        }
        func longest(_ table: [Int32], _ name: String) throws -> UInt32 {
            guard table[0] == 0 else {
                throw FlashAttentionError.invalidArgument("\(name)[0] (\(table[0])) must be 0")
            }
            var longest: Int32 = 0
            for i in 1..<table.count {
                guard table[i] >= table[i - 1] else {
                    throw FlashAttentionError.invalidArgument(
                        "\(name) must be non-decreasing: \(name)[\(i - 1)] = \(table[i - 1]) > \(name)[\(i)] = \(table[i])")
                }
                longest = max(longest, table[i] - table[i - 1])
            }
            return UInt32(longest)
        }
        return VarlenSpec(sequences: UInt32(sequences), maxSeqlenQ: try longest(cuSeqlensQ, "cuSeqlensQ"),
                          maxSeqlenK: try longest(cuSeqlensK, "cuSeqlensK"))
    }

    /// The packed problem's shape: `sequences` entries of the totals' rows.
    func shape(numHeads: Int, numKVHeads: Int?, headDim: Int, headDimV: Int?) -> AttentionShape {
        AttentionShape(batch: sequences, numHeads: numHeads, numKVHeads: numKVHeads,
                       seqlenQ: Int(cuSeqlensQ.last ?? 0), seqlenK: Int(cuSeqlensK.last ?? 0), headDim: headDim,
                       headDimV: headDimV)
    }
}

extension FlashAttention {
    /// Forward pass over a variable-length batch into caller-owned memory, C-contiguous: `q`
    /// `[totalQ][numHeads][headDim]`, `k` `[totalK][numKVHeads][headDim]`, `v`
    /// `[totalK][numKVHeads][headDimV]`, `out` `[totalQ][numHeads][headDimV]`, `lse` float32
    /// `[numHeads][totalQ]` (FlashAttention's layouts; totals = the tables' last values, at least 1).
    /// Each sequence attends only within itself, causal and the window bottom-right aligned per
    /// sequence; `options.alibiSlopes` may hold `numHeads` or `sequences * numHeads` slopes;
    /// `options.attnMask` must be nil. Rows of a sequence without keys get out 0 and lse -inf.
    /// - Throws: as ``forward(q:k:v:out:lse:shape:causal:softmaxScale:options:)``, and
    ///   `invalidArgument` for a table that breaks ``VarlenBatch``'s rules.
    public func forwardVarlen<Element: AttentionElement>(
        q: UnsafeBufferPointer<Element>, k: UnsafeBufferPointer<Element>, v: UnsafeBufferPointer<Element>,
        out: UnsafeMutableBufferPointer<Element>, lse: UnsafeMutableBufferPointer<Float>, batch: VarlenBatch,
        numHeads: Int, numKVHeads: Int? = nil, headDim: Int, headDimV: Int? = nil, causal: Bool = false,
        softmaxScale: Float? = nil, options: AttentionOptions = AttentionOptions()
    ) throws {
        try withAutoreleasePool {
            let p = try varlenProblem(batch, numHeads, numKVHeads, headDim, headDimV, Element.attentionDType, causal,
                                      softmaxScale, options)
            let buffers = try forwardBuffers(q: q, k: k, v: v, out: out, lse: lse, p)
            try withTables(batch, p, buffers) { buffers in
                try withOptionalInputs(options, p, buffers) { try context.run(.forward, p, buffers: $0) }
            }
        }
    }

    /// Backward pass over a variable-length batch: `dq`, `dk`, `dv` like `q`, `k`, `v` (layouts of
    /// ``forwardVarlen(q:k:v:out:lse:batch:numHeads:numKVHeads:headDim:headDimV:causal:softmaxScale:options:)``)
    /// from `dout` (like `out`) and the forward's `out` and `lse`; `dsinks` (`numHeads` floats, summed
    /// over the sequences) with `options.sinks`. Deterministic, no atomics.
    /// - Throws: as ``forwardVarlen(q:k:v:out:lse:batch:numHeads:numKVHeads:headDim:headDimV:causal:softmaxScale:options:)``;
    ///   `invalidArgument` when sinks are given without `dsinks`.
    public func backwardVarlen<Element: AttentionElement>(
        dout: UnsafeBufferPointer<Element>, q: UnsafeBufferPointer<Element>, k: UnsafeBufferPointer<Element>,
        v: UnsafeBufferPointer<Element>, out: UnsafeBufferPointer<Element>, lse: UnsafeBufferPointer<Float>,
        dq: UnsafeMutableBufferPointer<Element>, dk: UnsafeMutableBufferPointer<Element>,
        dv: UnsafeMutableBufferPointer<Element>, batch: VarlenBatch, numHeads: Int, numKVHeads: Int? = nil,
        headDim: Int, headDimV: Int? = nil, causal: Bool = false, softmaxScale: Float? = nil,
        options: AttentionOptions = AttentionOptions(), dsinks: UnsafeMutableBufferPointer<Float>? = nil
    ) throws {
        try withAutoreleasePool {
            let p = try varlenProblem(batch, numHeads, numKVHeads, headDim, headDimV, Element.attentionDType, causal,
                                      softmaxScale, options)
            let buffers = try backwardBuffers(dout: dout, q: q, k: k, v: v, out: out, lse: lse, dq: dq, dk: dk, dv: dv,
                                              dsinks: dsinks, p)
            try withTables(batch, p, buffers) { buffers in
                try withOptionalInputs(options, p, buffers) { try context.run(.backward, p, buffers: $0) }
            }
        }
    }

    private func varlenProblem(_ batch: VarlenBatch, _ numHeads: Int, _ numKVHeads: Int?, _ headDim: Int,
                               _ headDimV: Int?, _ dtype: AttentionDType, _ causal: Bool, _ softmaxScale: Float?,
                               _ options: AttentionOptions) throws -> Problem {
        let spec = try batch.validated()
        let shape = batch.shape(numHeads: numHeads, numKVHeads: numKVHeads, headDim: headDim, headDimV: headDimV)
        // Contiguous (total, heads, dim) tensors; one batch entry spanning the whole tensor.
        func packed(_ rows: Int, _ heads: Int, _ dim: Int) -> TensorStrides {
            TensorStrides(batch: max(rows, 1) * heads * dim, head: dim, seq: heads * dim)
        }
        let (h, hk, d, dv) = (shape.numHeads, shape.numKVHeads, shape.headDim, shape.headDimV)
        let (sq, sk) = (shape.seqlenQ, shape.seqlenK)
        let strides = ProblemStrides(q: packed(sq, h, d), k: packed(sk, hk, d), v: packed(sk, hk, dv),
                                     out: packed(sq, h, dv), dout: packed(sq, h, dv), dq: packed(sq, h, d),
                                     dk: packed(sk, hk, d), dv: packed(sk, hk, dv))
        return try Problem.validate(shape, dtype: dtype, causal: causal, softmaxScale: softmaxScale,
                                    strides: strides, options: options, varlen: spec)
    }

    private func withTables(_ batch: VarlenBatch, _ p: Problem, _ buffers: HostBuffers,
                            _ body: (HostBuffers) throws -> Void) throws {
        var buffers = buffers
        try batch.cuSeqlensQ.withUnsafeBytes { cuQ in
            try batch.cuSeqlensK.withUnsafeBytes { cuK in
                buffers.bindInput(.cuSeqlensQ, cuQ.baseAddress!, for: p)
                buffers.bindInput(.cuSeqlensK, cuK.baseAddress!, for: p)
                try body(buffers)
            }
        }
    }
}
