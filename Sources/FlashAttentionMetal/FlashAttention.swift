import CFlashAttentionMetal

/// Exact, memory-efficient attention (FlashAttention-2, Dao 2023) over float16, bfloat16 or float32
/// host buffers, run by Metal on Apple GPUs or by the CPU engine that executes the same Metal
/// kernels.
///
/// Semantics: `out = softmax(softmaxScale * q kᵀ, masked) v` per head, with `lse` the natural log
/// of the softmax denominator (float32). `causal` masks are aligned bottom-right: query `i` sees key
/// `j` iff `j <= i + seqlenK - seqlenQ`; a query that sees no key gets `out = 0`, `lse = -inf` and
/// zero gradients. Query head `h` reads KV head `h / (numHeads / numKVHeads)`. Results are
/// deterministic. See ``AttentionShape`` for the layout.
///
/// Buffers: no output may share memory with another output or an input of the same call (byte
/// ranges from each buffer's first to its last element; checked, `invalidArgument`, nothing
/// written). Backward takes the `lse` forward returned, whatever its values: a NaN or `+inf` lse (a
/// row with a NaN or `+inf` score) gives that row NaN gradients, `-inf` (a row without visible keys)
/// zero gradients; lse values are not checked (docs/semantics.md, "Non-finite values").
///
/// One instance may be used from several threads at once.
public final class FlashAttention: @unchecked Sendable {
    /// The library's version, "MAJOR.MINOR.PATCH" (`FA_VERSION` of the C header).
    public static var version: String { FA_VERSION }

    let context: Context

    /// Creates the device state: for Metal a device, a command queue and the compiled kernels; for
    /// the CPU the engine.
    /// - Throws: ``FlashAttentionError/backendUnavailable(_:)`` when `backend` cannot run here.
    public init(backend: Backend = .auto) throws {
        context = try withAutoreleasePool { try Context(backend) }
    }

    /// An instance over `context` (tests: a CPU engine with a small piece budget).
    init(context: Context) {
        self.context = context
    }

    /// `"metal"` or `"cpu"`.
    public var backendName: String { context.backend.name.description }

    /// The Metal device name, or a description of the CPU engine.
    public var deviceName: String { context.backend.deviceName }

    /// Why the backend is what it is ("" when there is nothing to say): where the Metal kernels came
    /// from (a `.metallib` next to the library, or the embedded source compiled at creation), or why
    /// `.auto` runs (some) kernels on the CPU engine. With `.auto`, `backendName`, `deviceName` and
    /// this note can change after a call: when the GPU is lost, later calls run on the CPU engine.
    public var backendNote: String { context.backend.note }

    /// Cancels the calls in flight on this instance, from any thread: each stops early (the CPU
    /// engine within its current threadgroups, Metal before its next command buffer) and throws
    /// ``FlashAttentionError/cancelled(_:)`` with its outputs set to NaN, unless it had already
    /// finished its work. Calls that start afterwards run normally. Returns at once.
    public func cancel() { context.cancel() }

    /// The profile of the calling thread's last successful ``forward(q:k:v:out:lse:shape:causal:softmaxScale:)``
    /// or ``backward(dout:q:k:v:out:lse:dq:dk:dv:shape:causal:softmaxScale:)`` on this instance:
    /// its kernels in dispatch order with their grids, threadgroup sizes and static threadgroup
    /// memory, and the time they took (Metal: GPU time from the command buffers' `gpuStartTime`
    /// and `gpuEndTime`; CPU engine: the engine's wall time, plus per kernel the 8x8x8 SIMD-group
    /// matrix products and threadgroup barriers it executed). nil before the first successful call
    /// on this thread; a failed call leaves it unchanged. Each thread sees only its own calls.
    public var lastProfile: Profile? { context.lastProfile }

    /// Forward pass into caller-owned memory: `out` (like `v`'s element type, `[batch][numHeads]
    /// [seqlenQ][headDimV]`) and `lse` (float32, `[batch][numHeads][seqlenQ]`). All tensors are
    /// contiguous with the element type `Element` (its ``AttentionElement/attentionDType``).
    /// - Parameters:
    ///   - softmaxScale: any finite value; nil means `1 / sqrt(headDim)`.
    ///   - options: sliding window, softcap, ALiBi, sinks and `attnMask` (``AttentionOptions``).
    /// - Throws: ``FlashAttentionError/invalidArgument(_:)`` for a bad shape, scale, option or buffer length,
    ///   or an output overlapping another buffer of the call;
    ///   ``FlashAttentionError/unsupported(_:)`` for `headDim` or `headDimV` above 576 (256 in
    ///   float32) or bfloat16 where Metal lacks it, ``FlashAttentionError/executionFailed(_:)`` when the device fails
    ///   (outputs are then NaN).
    public func forward<Element: AttentionElement>(
        q: UnsafeBufferPointer<Element>, k: UnsafeBufferPointer<Element>, v: UnsafeBufferPointer<Element>,
        out: UnsafeMutableBufferPointer<Element>, lse: UnsafeMutableBufferPointer<Float>, shape: AttentionShape,
        causal: Bool = false, softmaxScale: Float? = nil, options: AttentionOptions = AttentionOptions()
    ) throws {
        try withAutoreleasePool {
            let p = try Problem.validate(shape, dtype: Element.attentionDType, causal: causal,
                                         softmaxScale: softmaxScale, options: options)
            let buffers = try forwardBuffers(q: q, k: k, v: v, out: out, lse: lse, p)
            try withOptionalInputs(options, p, buffers) { try context.run(.forward, p, buffers: $0) }
        }
    }

    /// Backward pass into caller-owned memory: `dq` (like `q`), `dk` (like `k`) and `dv` (like `v`)
    /// from `dout` and the `q, k, v, out, lse` of the forward pass. `dk` and `dv` sum over the query
    /// heads that share a KV head. With `options.sinks`, `dsinks` (`numHeads` floats) receives the
    /// sinks' gradient. Math: FlashAttention-2 (Dao 2023), Algorithm 2; rows with |lse| >= 256 get
    /// their softmax normaliser recomputed (`fa_backward` in the C header says when).
    /// `lse` is the forward's, any values: NaN or `+inf` make that row's gradients NaN, `-inf`
    /// zero.
    /// - Throws: as ``forward(q:k:v:out:lse:shape:causal:softmaxScale:options:)``; `invalidArgument`
    ///   when sinks are given without `dsinks`.
    public func backward<Element: AttentionElement>(
        dout: UnsafeBufferPointer<Element>, q: UnsafeBufferPointer<Element>, k: UnsafeBufferPointer<Element>,
        v: UnsafeBufferPointer<Element>, out: UnsafeBufferPointer<Element>, lse: UnsafeBufferPointer<Float>,
        dq: UnsafeMutableBufferPointer<Element>, dk: UnsafeMutableBufferPointer<Element>,
        dv: UnsafeMutableBufferPointer<Element>, shape: AttentionShape, causal: Bool = false,
        softmaxScale: Float? = nil, options: AttentionOptions = AttentionOptions(),
        dsinks: UnsafeMutableBufferPointer<Float>? = nil
    ) throws {
        try withAutoreleasePool {
            let p = try Problem.validate(shape, dtype: Element.attentionDType, causal: causal,
                                         softmaxScale: softmaxScale, options: options)
            let buffers = try backwardBuffers(dout: dout, q: q, k: k, v: v, out: out, lse: lse, dq: dq, dk: dk, dv: dv,
                                              dsinks: dsinks, p)
            try withOptionalInputs(options, p, buffers) { try context.run(.backward, p, buffers: $0) }
        }
    }

    /// Forward pass over arrays; returns `out` (`[batch][numHeads][seqlenQ][headDimV]`) and `lse`
    /// (float32, `[batch][numHeads][seqlenQ]`). See
    /// ``forward(q:k:v:out:lse:shape:causal:softmaxScale:options:)``.
    public func forward<Element: AttentionElement>(q: [Element], k: [Element], v: [Element], shape: AttentionShape,
                                                   causal: Bool = false, softmaxScale: Float? = nil,
                                                   options: AttentionOptions = AttentionOptions()) throws
        -> (out: [Element], lse: [Float]) {
        // Outputs are allocated only once the inputs match a valid shape, so a bad shape cannot
        // ask for an absurd allocation.
        let p = try Problem.validate(shape, dtype: Element.attentionDType, causal: causal, softmaxScale: softmaxScale,
                                     options: options)
        try expect(q.count, .q, p)
        var out = [Element](repeating: Element(), count: BufferRole.out.elementCount(for: p))
        var lse = [Float](repeating: 0, count: p.lseElements)
        try q.withUnsafeBufferPointer { q in
            try k.withUnsafeBufferPointer { k in
                try v.withUnsafeBufferPointer { v in
                    try out.withUnsafeMutableBufferPointer { out in
                        try lse.withUnsafeMutableBufferPointer { lse in
                            try forward(q: q, k: k, v: v, out: out, lse: lse, shape: shape, causal: causal,
                                        softmaxScale: softmaxScale, options: options)
                        }
                    }
                }
            }
        }
        return (out, lse)
    }

    /// Backward pass over arrays; returns `dq` (like `q`), `dk` (like `k`) and `dv` (like `v`). See
    /// ``backward(dout:q:k:v:out:lse:dq:dk:dv:shape:causal:softmaxScale:options:dsinks:)``.
    public func backward<Element: AttentionElement>(
        dout: [Element], q: [Element], k: [Element], v: [Element], out: [Element], lse: [Float],
        shape: AttentionShape, causal: Bool = false, softmaxScale: Float? = nil
    ) throws -> (dq: [Element], dk: [Element], dv: [Element]) {
        let g = try backward(dout: dout, q: q, k: k, v: v, out: out, lse: lse, shape: shape, causal: causal,
                             softmaxScale: softmaxScale, options: AttentionOptions())
        return (g.dq, g.dk, g.dv)
    }

    /// Backward pass over arrays with score modifiers; returns `dq`, `dk`, `dv` and, with
    /// `options.sinks`, `dsinks` (`numHeads` floats; empty without sinks).
    public func backward<Element: AttentionElement>(
        dout: [Element], q: [Element], k: [Element], v: [Element], out: [Element], lse: [Float],
        shape: AttentionShape, causal: Bool = false, softmaxScale: Float? = nil, options: AttentionOptions
    ) throws -> (dq: [Element], dk: [Element], dv: [Element], dsinks: [Float]) {
        let p = try Problem.validate(shape, dtype: Element.attentionDType, causal: causal, softmaxScale: softmaxScale,
                                     options: options)
        try expect(q.count, .q, p)
        try expect(k.count, .k, p)
        try expect(v.count, .v, p)
        var dq = [Element](repeating: Element(), count: q.count)
        var dk = [Element](repeating: Element(), count: k.count)
        var dv = [Element](repeating: Element(), count: v.count)
        var dsinks = [Float](repeating: 0, count: p.scores.hasSinks ? Int(p.numHeads) : 0)
        try dout.withUnsafeBufferPointer { dout in
            try q.withUnsafeBufferPointer { q in
                try k.withUnsafeBufferPointer { k in
                    try v.withUnsafeBufferPointer { v in
                        try out.withUnsafeBufferPointer { out in
                            try lse.withUnsafeBufferPointer { lse in
                                try dq.withUnsafeMutableBufferPointer { dq in
                                    try dk.withUnsafeMutableBufferPointer { dk in
                                        try dv.withUnsafeMutableBufferPointer { dv in
                                            try dsinks.withUnsafeMutableBufferPointer { dsinks in
                                                try backward(dout: dout, q: q, k: k, v: v, out: out, lse: lse,
                                                             dq: dq, dk: dk, dv: dv, shape: shape, causal: causal,
                                                             softmaxScale: softmaxScale, options: options,
                                                             dsinks: p.scores.hasSinks ? dsinks : nil)
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        return (dq, dk, dv, dsinks)
    }
}

/// Runs `body` with `options`' mask, ALiBi slopes and sinks bound (checked against `problem`).
/// The forward's buffers, each checked against `p`'s length for its role.
func forwardBuffers<Element>(q: UnsafeBufferPointer<Element>, k: UnsafeBufferPointer<Element>,
                             v: UnsafeBufferPointer<Element>, out: UnsafeMutableBufferPointer<Element>,
                             lse: UnsafeMutableBufferPointer<Float>, _ p: Problem) throws -> HostBuffers {
    var buffers = HostBuffers()
    try buffers.bindInput(.q, checked(UnsafeRawBufferPointer(q), .q, p), for: p)
    try buffers.bindInput(.k, checked(UnsafeRawBufferPointer(k), .k, p), for: p)
    try buffers.bindInput(.v, checked(UnsafeRawBufferPointer(v), .v, p), for: p)
    try buffers.bindOutput(.out, checked(UnsafeMutableRawBufferPointer(out), .out, p), for: p)
    try buffers.bindOutput(.lse, checked(UnsafeMutableRawBufferPointer(lse), .lse, p), for: p)
    return buffers
}

/// The backward's buffers, each checked against `p`'s length for its role; `dsinks` is required
/// with sinks.
func backwardBuffers<Element>(dout: UnsafeBufferPointer<Element>, q: UnsafeBufferPointer<Element>,
                              k: UnsafeBufferPointer<Element>, v: UnsafeBufferPointer<Element>,
                              out: UnsafeBufferPointer<Element>, lse: UnsafeBufferPointer<Float>,
                              dq: UnsafeMutableBufferPointer<Element>, dk: UnsafeMutableBufferPointer<Element>,
                              dv: UnsafeMutableBufferPointer<Element>, dsinks: UnsafeMutableBufferPointer<Float>?,
                              _ p: Problem) throws -> HostBuffers {
    var buffers = HostBuffers()
    try buffers.bindInput(.dout, checked(UnsafeRawBufferPointer(dout), .dout, p), for: p)
    try buffers.bindInput(.q, checked(UnsafeRawBufferPointer(q), .q, p), for: p)
    try buffers.bindInput(.k, checked(UnsafeRawBufferPointer(k), .k, p), for: p)
    try buffers.bindInput(.v, checked(UnsafeRawBufferPointer(v), .v, p), for: p)
    try buffers.bindInput(.out, checked(UnsafeRawBufferPointer(out), .out, p), for: p)
    try buffers.bindInput(.lse, checked(UnsafeRawBufferPointer(lse), .lse, p), for: p)
    try buffers.bindOutput(.dq, checked(UnsafeMutableRawBufferPointer(dq), .dq, p), for: p)
    try buffers.bindOutput(.dk, checked(UnsafeMutableRawBufferPointer(dk), .dk, p), for: p)
    try buffers.bindOutput(.dv, checked(UnsafeMutableRawBufferPointer(dv), .dv, p), for: p)
    if p.scores.hasSinks {
        guard let dsinks else {
            throw FlashAttentionError.invalidArgument("dsinks must be given with sinks")
        }
        try buffers.bindOutput(.dsinks, checked(UnsafeMutableRawBufferPointer(dsinks), .dsinks, p), for: p)
    }
    return buffers
}

func withOptionalInputs(_ options: AttentionOptions, _ problem: Problem, _ buffers: HostBuffers,
                                _ body: (HostBuffers) throws -> Void) throws {
    var buffers = buffers
    func bind<T>(_ array: [T]?, _ role: BufferRole, _ next: () throws -> Void) throws {
        guard let array else { return try next() }
        try array.withUnsafeBytes { bytes in
            try buffers.bindInput(role, checked(bytes, role, problem), for: problem)
            try next()
        }
    }
    var maskBytes: [UInt8]?
    var maskFloats: [Float]?
    switch options.attnMask {
    case .boolean(let values, _): maskBytes = values
    case .additive(let values, _): maskFloats = values
    case nil: break
    }
    try bind(options.alibiSlopes, .alibiSlopes) {
        try bind(options.sinks, .sinks) {
            try bind(maskBytes, .attnMask) {
                try bind(maskFloats, .attnMask) { try body(buffers) }
            }
        }
    }
}

extension FlashAttention {
    /// Merges two attention results over disjoint key sets of the same queries into the result
    /// over their union, into caller-owned memory: the log-sum-exp combine of split-KV decoding and
    /// ring attention. Per row, with `m = max(lseA, lseB)`, `wA = exp(lseA - m)`,
    /// `wB = exp(lseB - m)`: `out = (wA outA + wB outB) / (wA + wB)` and `lse = m + log(wA + wB)`,
    /// in float32, `out` rounded to `Element` once. A part with lse `-inf` (it saw no key)
    /// contributes nothing and its out is not used; a row empty in both parts gets `out = 0`,
    /// `lse = -inf`.
    ///
    /// - Parameters:
    ///   - outA, outB: `rows * headDim` elements (`[rows][headDim]`) of any ``AttentionElement``
    ///     (float16, bfloat16, float32; `UInt16` as float16 bit patterns), e.g. the `out` of
    ///     ``forward(q:k:v:out:lse:shape:causal:softmaxScale:options:)`` over each key set.
    ///   - lseA, lseB: float32, `rows` elements, the matching `lse`; `rows = lseA.count`.
    ///   - out, lse: the merge, sized like `outA` and `lseA`; must not overlap each other or any
    ///     input (checked: `invalidArgument`).
    ///   - headDim: `1...576` (`1...256` in float32).
    /// - Throws: ``FlashAttentionError/invalidArgument(_:)`` for mismatched counts, `rows` outside
    ///   `1...UInt32.max` or overlapping buffers, ``FlashAttentionError/unsupported(_:)`` for
    ///   `headDim > 576` (256 in float32; or bfloat16 where Metal lacks it), ``FlashAttentionError/executionFailed(_:)``
    ///   when the device fails (outputs are then NaN).
    public func mergeAttention<Element: AttentionElement>(
        outA: UnsafeBufferPointer<Element>, lseA: UnsafeBufferPointer<Float>, outB: UnsafeBufferPointer<Element>,
        lseB: UnsafeBufferPointer<Float>, out: UnsafeMutableBufferPointer<Element>,
        lse: UnsafeMutableBufferPointer<Float>, headDim: Int
    ) throws {
        try withAutoreleasePool {
            let p = try Problem.merge(rows: UInt64(lseA.count), headDim: headDim, dtype: Element.attentionDType)
            var buffers = HostBuffers()
            try buffers.bindInput(.outA, checked(UnsafeRawBufferPointer(outA), .outA, p), for: p)
            try buffers.bindInput(.lseA, checked(UnsafeRawBufferPointer(lseA), .lseA, p), for: p)
            try buffers.bindInput(.outB, checked(UnsafeRawBufferPointer(outB), .outB, p), for: p)
            try buffers.bindInput(.lseB, checked(UnsafeRawBufferPointer(lseB), .lseB, p), for: p)
            try buffers.bindOutput(.out, checked(UnsafeMutableRawBufferPointer(out), .out, p), for: p)
            try buffers.bindOutput(.lse, checked(UnsafeMutableRawBufferPointer(lse), .lse, p), for: p)
            try context.run(.merge, p, buffers: buffers)
        }
    }

    /// Merges two attention results over disjoint key sets into the result over their union;
    /// returns `out` (like `outA`) and `lse` (float32, like `lseA`). See
    /// ``mergeAttention(outA:lseA:outB:lseB:out:lse:headDim:)``.
    public func mergeAttention<Element: AttentionElement>(outA: [Element], lseA: [Float], outB: [Element],
                                                          lseB: [Float], headDim: Int) throws
        -> (out: [Element], lse: [Float]) {
        let p = try Problem.merge(rows: UInt64(lseA.count), headDim: headDim, dtype: Element.attentionDType)
        try expect(outA.count, .outA, p)
        var out = [Element](repeating: Element(), count: BufferRole.out.elementCount(for: p))
        var lse = [Float](repeating: 0, count: p.lseElements)
        try outA.withUnsafeBufferPointer { outA in
            try lseA.withUnsafeBufferPointer { lseA in
                try outB.withUnsafeBufferPointer { outB in
                    try lseB.withUnsafeBufferPointer { lseB in
                        try out.withUnsafeMutableBufferPointer { out in
                            try lse.withUnsafeMutableBufferPointer { lse in
                                try mergeAttention(outA: outA, lseA: lseA, outB: outB, lseB: lseB, out: out,
                                                   lse: lse, headDim: headDim)
                            }
                        }
                    }
                }
            }
        }
        return (out, lse)
    }
}

/// Throws unless a buffer of `count` elements is exactly what `role` needs for `problem`.
private func expect(_ count: Int, _ role: BufferRole, _ problem: Problem) throws {
    let needed = role.elementCount(for: problem)
    guard count == needed else {
        throw FlashAttentionError.invalidArgument("\(role.name) has \(count) elements; the shape needs \(needed)")
    }
}

/// The start of `buffer` after checking that it holds exactly the elements `role` needs.
func checked(_ buffer: UnsafeRawBufferPointer, _ role: BufferRole, _ problem: Problem) throws
    -> UnsafeRawPointer {
    try expect(buffer.count / role.elementSize(for: problem), role, problem)
    guard let base = buffer.baseAddress else {
        throw FlashAttentionError.invalidArgument("\(role.name) must not be null")
    }
    return base
}

func checked(_ buffer: UnsafeMutableRawBufferPointer, _ role: BufferRole, _ problem: Problem) throws
    -> UnsafeMutableRawPointer {
    UnsafeMutableRawPointer(mutating: try checked(UnsafeRawBufferPointer(buffer), role, problem))
}
