import CFlashAttentionMetal

/// An attention mask (PyTorch's conventions), broadcastable to `[batch][numHeads][seqlenQ][seqlenK]`:
/// element `(b, h, i, j)` lies at `b * strides.batch + h * strides.head + i * strides.seq + j`, and a
/// zero stride broadcasts that axis (a `[batch][1][1][seqlenK]` padding mask has strides
/// `(seqlenK, 0, 0)`).
public enum AttentionMask: Sendable {
    /// Nonzero: may attend; zero: hidden.
    case boolean([UInt8], strides: TensorStrides)
    /// Added to the scores (float32); `-infinity` hides a key.
    case additive([Float], strides: TensorStrides)
}

/// What shapes the scores besides `q kᵀ`, with FlashAttention's and PyTorch's names and meanings:
/// `s = softcap * tanh(softmaxScale * q·k / softcap) - slope * |i + seqlenK - seqlenQ - j| + mask`,
/// keys outside the window or hidden by a boolean mask get no weight, and each head's sink is a
/// virtual key of logit `sinks[h]` and no value. The defaults leave every one of them off.
public struct AttentionOptions: Sendable {
    /// FlashAttention's sliding window `(left, right)`, bottom-right aligned: query `i` sees key `j`
    /// iff `i + seqlenK - seqlenQ - left <= j <= i + seqlenK - seqlenQ + right`; `-1` leaves a side
    /// unbounded. `causal: true` is `right = 0`.
    public var windowLeft: Int = -1
    public var windowRight: Int = -1
    /// Logit softcapping (Gemma 2); `0` is off.
    public var softcap: Float = 0
    /// ALiBi slopes: `numHeads` values, or `batch * numHeads` (`[batch][numHeads]`).
    public var alibiSlopes: [Float]? = nil
    /// Attention sinks: `numHeads` logits (gpt-oss); the backward then returns `dsinks`.
    public var sinks: [Float]? = nil
    /// A boolean or additive mask; combined with `causal` and the window.
    public var attnMask: AttentionMask? = nil
    /// Dropout on the attention probabilities (``AttentionDropout``); nil or `p` 0 is off. The
    /// backward must be given the forward's.
    public var dropout: AttentionDropout? = nil

    public init(windowLeft: Int = -1, windowRight: Int = -1, softcap: Float = 0, alibiSlopes: [Float]? = nil,
                sinks: [Float]? = nil, attnMask: AttentionMask? = nil, dropout: AttentionDropout? = nil) {
        self.windowLeft = windowLeft
        self.windowRight = windowRight
        self.softcap = softcap
        self.alibiSlopes = alibiSlopes
        self.sinks = sinks
        self.attnMask = attnMask
        self.dropout = dropout
    }
}

/// The validated score modifiers of one problem, in the kernels' terms.
struct ScoreSpec: Equatable {
    /// Effective window bounds (causal folded in as right = 0); -1 unbounded.
    var windowLeft: Int32 = -1
    var windowRight: Int32 = -1
    var softcap: Float = 0
    /// FA_MASK_* kind and the mask's layout over `[batch][heads][seqlenQ][seqlenK]` (nil for none).
    var maskType: UInt32 = UInt32(FA_MASK_NONE)
    var mask: TensorLayout?
    var alibiPerBatch = false
    var hasAlibi = false
    var hasSinks = false

    /// Checks the modifiers for a problem of the given sizes; `maskStrides` matter only when
    /// `maskType` is not `FA_MASK_NONE`.
    init(causal: Bool, window: (left: Int, right: Int)?, softcap: Float, maskType: UInt32,
         maskStrides: TensorStrides, hasAlibi: Bool, alibiPerBatch: Bool, hasSinks: Bool,
         dims: (batch: Int, heads: Int, seqlenQ: Int, seqlenK: Int)) throws {
        if let window {
            for (name, value) in [("window_left", window.left), ("window_right", window.right)] {
                guard value >= -1 && value <= Int(Int32.max) else {
                    throw FlashAttentionError.invalidArgument(
                        "\(name) (\(value)) must be -1 (unbounded) or a number of keys from 0 to \(Int32.max)")
                }
            }
            windowLeft = Int32(window.left)
            windowRight = Int32(window.right)
        }
        if causal { windowRight = 0 }
        guard softcap.isFinite && softcap >= 0 else {
            throw FlashAttentionError.invalidArgument("softcap (\(softcap)) must be finite and at least 0 (0 is off)")
        }
        self.softcap = softcap
        guard maskType <= UInt32(FA_MASK_ADDITIVE_F32) else {
            throw FlashAttentionError.invalidArgument(
                "attn_mask_type (\(maskType)) must be FA_ATTN_MASK_NONE, _BOOL, _ADDITIVE or _ADDITIVE_FLOAT32")
        }
        self.maskType = maskType
        if maskType != UInt32(FA_MASK_NONE) {
            mask = try TensorLayout("attn_mask", strides: maskStrides,
                                    dims: (dims.batch, dims.heads, dims.seqlenQ, dims.seqlenK), written: false,
                                    broadcast: true)
        }
        self.hasAlibi = hasAlibi
        self.alibiPerBatch = alibiPerBatch
        self.hasSinks = hasSinks
    }

    init() {}

    /// The same modifiers over the first `batch` entries and `heads` heads (a piece of a split
    /// plan): the mask spans less.
    func slice(batch: Int, heads: Int) -> ScoreSpec {
        var sliced = self
        sliced.mask = mask?.slice(batch: batch, heads: heads)
        return sliced
    }
}
