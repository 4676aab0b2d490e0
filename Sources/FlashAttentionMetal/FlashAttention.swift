/// Exact, memory-efficient attention (FlashAttention-2, Dao 2023) over float16 host buffers, run
/// by Metal on Apple GPUs or by the CPU engine that executes the same Metal kernels.
///
/// Semantics: `out = softmax(softmaxScale * q kᵀ, masked) v` per head, with `lse` the natural log
/// of the softmax denominator (float32). `causal` masks are aligned bottom-right: query `i` sees key
/// `j` iff `j <= i + seqlenK - seqlenQ`; a query that sees no key gets `out = 0`, `lse = -inf` and
/// zero gradients. Query head `h` reads KV head `h / (numHeads / numKVHeads)`. Results are
/// deterministic. See ``AttentionShape`` for the layout.
///
/// One instance may be used from several threads at once.
public final class FlashAttention: @unchecked Sendable {
    private let context: Context

    /// Creates the device state: for Metal a device, a command queue and the compiled kernels; for
    /// the CPU the engine.
    /// - Throws: ``FlashAttentionError/backendUnavailable(_:)`` when `backend` cannot run here.
    public init(backend: Backend = .auto) throws {
        context = try withAutoreleasePool { try Context(backend) }
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

    /// Forward pass into caller-owned memory: `out` (float16 bit patterns, like `q`) and `lse`
    /// (float32, `[batch][numHeads][seqlenQ]`).
    /// - Parameters:
    ///   - softmaxScale: any finite value; nil means `1 / sqrt(headDim)`.
    /// - Throws: ``FlashAttentionError/invalidArgument(_:)`` for a bad shape, scale or buffer length,
    ///   ``FlashAttentionError/unsupported(_:)`` for `headDim > 256`,
    ///   ``FlashAttentionError/executionFailed(_:)`` when the device fails (outputs are then NaN).
    public func forward(q: UnsafeBufferPointer<UInt16>, k: UnsafeBufferPointer<UInt16>,
                        v: UnsafeBufferPointer<UInt16>, out: UnsafeMutableBufferPointer<UInt16>,
                        lse: UnsafeMutableBufferPointer<Float>, shape: AttentionShape,
                        causal: Bool = false, softmaxScale: Float? = nil) throws {
        try withAutoreleasePool {
            let p = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
            var buffers = HostBuffers()
            try buffers.bindInput(.q, checked(UnsafeRawBufferPointer(q), .q, p), for: p)
            try buffers.bindInput(.k, checked(UnsafeRawBufferPointer(k), .k, p), for: p)
            try buffers.bindInput(.v, checked(UnsafeRawBufferPointer(v), .v, p), for: p)
            try buffers.bindOutput(.out, checked(UnsafeMutableRawBufferPointer(out), .out, p), for: p)
            try buffers.bindOutput(.lse, checked(UnsafeMutableRawBufferPointer(lse), .lse, p), for: p)
            try context.run(DispatchPlan.forward(p), buffers: buffers)
        }
    }

    /// Backward pass into caller-owned memory: `dq` (like `q`), `dk` and `dv` (like `k`) from
    /// `dout` and the `q, k, v, out, lse` of the forward pass. `dk` and `dv` sum over the query
    /// heads that share a KV head.
    /// - Throws: as ``forward(q:k:v:out:lse:shape:causal:softmaxScale:)``.
    public func backward(dout: UnsafeBufferPointer<UInt16>, q: UnsafeBufferPointer<UInt16>,
                         k: UnsafeBufferPointer<UInt16>, v: UnsafeBufferPointer<UInt16>,
                         out: UnsafeBufferPointer<UInt16>, lse: UnsafeBufferPointer<Float>,
                         dq: UnsafeMutableBufferPointer<UInt16>, dk: UnsafeMutableBufferPointer<UInt16>,
                         dv: UnsafeMutableBufferPointer<UInt16>, shape: AttentionShape,
                         causal: Bool = false, softmaxScale: Float? = nil) throws {
        try withAutoreleasePool {
            let p = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
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
            try context.run(DispatchPlan.backward(p), buffers: buffers)
        }
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
private func checked(_ buffer: UnsafeRawBufferPointer, _ role: BufferRole, _ problem: Problem) throws
    -> UnsafeRawPointer {
    try expect(buffer.count / role.elementSize, role, problem)
    guard let base = buffer.baseAddress else {
        throw FlashAttentionError.invalidArgument("\(role.name) must not be null")
    }
    return base
}

private func checked(_ buffer: UnsafeMutableRawBufferPointer, _ role: BufferRole, _ problem: Problem) throws
    -> UnsafeMutableRawPointer {
    UnsafeMutableRawPointer(mutating: try checked(UnsafeRawBufferPointer(buffer), role, problem))
}

// Float16 does not exist on macOS for x86_64; there the UInt16 bit-pattern API above serves.
#if !((os(macOS) || targetEnvironment(macCatalyst)) && arch(x86_64))
extension FlashAttention {
    /// Forward pass over arrays; returns `out` (float16, like `q`) and `lse` (float32,
    /// `[batch][numHeads][seqlenQ]`). See ``forward(q:k:v:out:lse:shape:causal:softmaxScale:)``.
    public func forward(q: [Float16], k: [Float16], v: [Float16], shape: AttentionShape,
                        causal: Bool = false, softmaxScale: Float? = nil) throws
        -> (out: [Float16], lse: [Float]) {
        // Outputs are allocated only once the inputs match a valid shape, so a bad shape cannot
        // ask for an absurd allocation.
        let p = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
        try expect(q.count, .q, p)
        var out = [Float16](repeating: 0, count: p.queryElements)
        var lse = [Float](repeating: 0, count: p.lseElements)
        try q.asBits { q in
            try k.asBits { k in
                try v.asBits { v in
                    try out.asMutableBits { out in
                        try lse.withUnsafeMutableBufferPointer { lse in
                            try forward(q: q, k: k, v: v, out: out, lse: lse, shape: shape, causal: causal,
                                        softmaxScale: softmaxScale)
                        }
                    }
                }
            }
        }
        return (out, lse)
    }

    /// Backward pass over arrays; returns `dq` (like `q`), `dk` and `dv` (like `k`). See
    /// ``backward(dout:q:k:v:out:lse:dq:dk:dv:shape:causal:softmaxScale:)``.
    public func backward(dout: [Float16], q: [Float16], k: [Float16], v: [Float16], out: [Float16],
                         lse: [Float], shape: AttentionShape, causal: Bool = false,
                         softmaxScale: Float? = nil) throws -> (dq: [Float16], dk: [Float16], dv: [Float16]) {
        let p = try Problem.validate(shape, causal: causal, softmaxScale: softmaxScale)
        try expect(q.count, .q, p)
        try expect(k.count, .k, p)
        try expect(v.count, .v, p)
        var dq = [Float16](repeating: 0, count: q.count)
        var dk = [Float16](repeating: 0, count: k.count)
        var dv = [Float16](repeating: 0, count: v.count)
        try dout.asBits { dout in
            try q.asBits { q in
                try k.asBits { k in
                    try v.asBits { v in
                        try out.asBits { out in
                            try lse.withUnsafeBufferPointer { lse in
                                try dq.asMutableBits { dq in
                                    try dk.asMutableBits { dk in
                                        try dv.asMutableBits { dv in
                                            try backward(dout: dout, q: q, k: k, v: v, out: out, lse: lse,
                                                         dq: dq, dk: dk, dv: dv, shape: shape, causal: causal,
                                                         softmaxScale: softmaxScale)
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        return (dq, dk, dv)
    }
}

extension Array where Element == Float16 {
    /// The elements as float16 bit patterns, without a copy.
    fileprivate func asBits<R>(_ body: (UnsafeBufferPointer<UInt16>) throws -> R) rethrows -> R {
        try withUnsafeBufferPointer { try $0.withMemoryRebound(to: UInt16.self, body) }
    }

    fileprivate mutating func asMutableBits<R>(_ body: (UnsafeMutableBufferPointer<UInt16>) throws -> R) rethrows
        -> R {
        try withUnsafeMutableBufferPointer { try $0.withMemoryRebound(to: UInt16.self, body) }
    }
}
#endif
