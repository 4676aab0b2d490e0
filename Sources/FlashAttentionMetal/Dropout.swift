import CFlashAttentionMetal

/// Attention dropout (FlashAttention's): each probability of P is dropped with probability `p`
/// after the softmax and the kept ones are scaled by `1 / (1 - p)`; lse stays that of the undropped
/// scores. The mask is a pure function of (`seed`, `offset`, batch entry, query head, query row,
/// key) through Philox-4x32-10 (Shaders/flash_attention_philox.h specifies the mapping), so the
/// backward given the same values regenerates the forward's mask, and every backend, tiling and
/// head-dim bucket draws the same bits.
public struct AttentionDropout: Equatable, Sendable {
    /// Probability of dropping an element, `0 <= p < 1` (carried as float32).
    public var p: Float
    /// The Philox key.
    public var seed: UInt64
    /// The base of the Philox counter (a caller drawing several masks from one seed advances it by
    /// at least `(seqlenK + 3) / 4` per call).
    public var offset: UInt64

    public init(p: Float, seed: UInt64, offset: UInt64 = 0) {
        self.p = p
        self.seed = seed
        self.offset = offset
    }
}

/// A validated dropout in the kernels' terms (FlashAttentionParams' dropout fields).
struct DropoutSpec: Equatable {
    /// An element is dropped iff its Philox word is below this: min(round(p 2^32), 2^32 - 1).
    let threshold: UInt32
    /// 1 / (1 - p) in float64, rounded to float32.
    let scale: Float
    let seed: UInt64
    let offset: UInt64
    /// The Philox stream of the problem's first (batch entry, head) and the whole call's heads
    /// (`Problem.slice` moves the first).
    var stream0: UInt32 = 0
    let heads: UInt32

    /// Checks `p` and the combination; nil when nothing is dropped (p 0, or so small that no 32-bit
    /// word falls below its threshold and 1 / (1 - p) rounds to 1).
    /// - Throws: `invalidArgument` naming dropout_p for a p outside [0, 1) and for dropout with a
    ///   KV cache (FlashAttention's flash_attn_with_kvcache has none).
    init?(_ dropout: AttentionDropout, numHeads: Int, kvCache: Bool) throws {
        guard dropout.p >= 0 && dropout.p < 1 else {
            throw FlashAttentionError.invalidArgument("dropout_p (\(dropout.p)) must be at least 0 and below 1")
        }
        let threshold = (Double(dropout.p) * 4294967296).rounded()
        guard threshold >= 1 else { return nil }
        guard !kvCache else {
            throw FlashAttentionError.invalidArgument(
                "dropout_p (\(dropout.p)) must be 0 with a KV cache (kv_cache_rows): dropout is for training shapes")
        }
        self.threshold = UInt32(min(threshold, Double(UInt32.max)))
        scale = Float(1 / (1 - Double(dropout.p)))
        seed = dropout.seed
        offset = dropout.offset
        heads = UInt32(numHeads)
    }

    /// The same dropout for a piece that starts at batch entry `batch` and query head `head`.
    func slice(batch: UInt32, head: UInt32) -> DropoutSpec {
        var sliced = self
        sliced.stream0 = stream0 &+ batch &* heads &+ head
        return sliced
    }

    /// Writes the fields into a parameter struct.
    func apply(to params: inout FlashAttentionParams) {
        params.dropout_seed = seed
        params.dropout_offset = offset
        params.dropout_threshold = threshold
        params.dropout_scale = scale
        params.dropout_stream0 = stream0
        params.dropout_heads = heads
    }
}
