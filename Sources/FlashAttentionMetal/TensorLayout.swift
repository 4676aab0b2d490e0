import CFlashAttentionMetal

/// The element type of the tensors of one call (`q`, `k`, `v`, `out`, `dout`, `dq`, `dk`, `dv`);
/// `lse` is always float32. Every product accumulates in float32 and every output is rounded to the
/// dtype once (to nearest even). bfloat16 needs MSL 3.1 (macOS 14, iOS 17) on the Metal backend.
public enum AttentionDType: UInt32, CaseIterable, Sendable {
    case float16 = 0
    case bfloat16 = 1
    case float32 = 2

    /// Bytes per element.
    public var size: Int { self == .float32 ? 4 : 2 }

    /// The suffix of this dtype's kernel instances (`f16`, `bf16`, `f32`).
    var kernelSuffix: String {
        switch self {
        case .float16: return "f16"
        case .bfloat16: return "bf16"
        case .float32: return "f32"
        }
    }
}

/// Element strides of a `[batch][heads][seqlen][headDim]` tensor whose last axis is contiguous:
/// element `(b, h, i, d)` lies at `b * batch + h * head + i * seq + d`.
public struct TensorStrides: Equatable, Sendable {
    public var batch: Int
    public var head: Int
    public var seq: Int

    public init(batch: Int, head: Int, seq: Int) {
        self.batch = batch
        self.head = head
        self.seq = seq
    }

    /// Row-major contiguous strides of a tensor with `heads` heads, `seqlen` rows and `cols`
    /// columns (wrapping arithmetic: a validated problem never overflows).
    public static func contiguous(heads: Int, seqlen: Int, cols: Int) -> TensorStrides {
        TensorStrides(batch: heads &* seqlen &* cols, head: seqlen &* cols, seq: cols)
    }
}

/// A tensor's checked layout: its strides and the number of elements it spans from element
/// [0][0][0][0] to the last one (what a buffer must hold).
struct TensorLayout: Equatable {
    let strides: TensorStrides
    let extent: Int
    /// (batch, heads, seqlen) rows of `cols` elements each.
    let rows: (batch: Int, heads: Int, seqlen: Int)
    let cols: Int

    static func == (a: TensorLayout, b: TensorLayout) -> Bool {
        a.strides == b.strides && a.extent == b.extent && a.rows == b.rows && a.cols == b.cols
    }

    /// Checks `strides` (nil: contiguous) for a tensor of `dims` = (batch, heads, seqlen, cols).
    /// Strides must be positive, or, for a `broadcast` input (the attention mask, whose elements
    /// are at most 4 bytes), not negative: a zero stride repeats that axis. A tensor the call writes
    /// (`written`) must not overlap itself: once the axes are sorted by stride, each stride must
    /// step over everything the smaller axes span.
    init(_ name: String, strides given: TensorStrides?, dims: (Int, Int, Int, Int), written: Bool,
         broadcast: Bool = false) throws {
        let (batch, heads, seqlen, cols) = dims
        if given == nil {
            _ = try TensorLayout.checkedCount([batch, heads, seqlen, cols], of: name)
        }
        let strides = given ?? .contiguous(heads: heads, seqlen: seqlen, cols: cols)
        let axes = [("batch", strides.batch, batch), ("head", strides.head, heads), ("seq", strides.seq, seqlen)]
        var extent = cols
        for (axis, stride, count) in axes {
            guard stride >= (broadcast ? 0 : 1) else {
                throw FlashAttentionError.invalidArgument(broadcast
                    ? "\(name) strides: the \(axis) stride (\(stride)) must not be negative (0 broadcasts)"
                    : "\(name) strides: the \(axis) stride (\(stride)) must be at least 1 (or all three strides 0 "
                        + "for the contiguous layout)")
            }
            let (span, overflow) = stride.multipliedReportingOverflow(by: count - 1)
            let (sum, overflowSum) = extent.addingReportingOverflow(span)
            // The caller checks a tensor's bytes with its dtype; a broadcast input's (4 bytes at
            // most) are checked here.
            guard !overflow, !overflowSum, !(broadcast && sum.multipliedReportingOverflow(by: 4).overflow) else {
                throw FlashAttentionError.invalidArgument(broadcast
                    ? "\(name) spans more elements than fit in a 64-bit size"
                    : "\(name) has more elements than fit in a 64-bit size")
            }
            extent = sum
        }
        if written {
            var covered = cols
            for (axis, stride, count) in axes.filter({ $0.2 > 1 }).sorted(by: { $0.1 < $1.1 }) {
                guard stride >= covered else {
                    throw FlashAttentionError.invalidArgument(
                        "\(name) strides overlap: the \(axis) stride (\(stride)) must be at least \(covered), the "
                            + "elements one step of the smaller axes spans (\(name) is written)")
                }
                covered = stride * (count - 1) + covered
            }
        }
        self.strides = strides
        self.extent = extent
        self.rows = (batch, heads, seqlen)
        self.cols = cols
    }

    /// The product of `factors`, checked so that the byte size of a buffer of that many elements
    /// fits in `Int` (pointer arithmetic on the host and 64-bit offsets in the kernels).
    static func checkedCount(_ factors: [Int], bytesPerElement: Int = 1, of name: String) throws -> Int {
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

    /// The same strides over the first `batch` entries and `heads` heads: the part a piece of a
    /// split plan binds from its own start.
    func slice(batch: Int, heads: Int) -> TensorLayout {
        TensorLayout(strides: strides, rows: (batch, heads, rows.seqlen), cols: cols)
    }

    private init(strides: TensorStrides, rows: (batch: Int, heads: Int, seqlen: Int), cols: Int) {
        self.strides = strides
        self.rows = rows
        self.cols = cols
        extent = (rows.batch - 1) * strides.batch + (rows.heads - 1) * strides.head + (rows.seqlen - 1) * strides.seq
            + cols
    }

    /// Calls `body` with the element offset of every row, in memory order of the logical layout.
    func forEachRow(_ body: (Int) -> Void) {
        for b in 0..<rows.batch {
            for h in 0..<rows.heads {
                for i in 0..<rows.seqlen {
                    body(b * strides.batch + h * strides.head + i * strides.seq)
                }
            }
        }
    }

    /// The kernels' form of the strides.
    var params: FlashAttentionStrides {
        FlashAttentionStrides(batch: UInt64(strides.batch), head: UInt64(strides.head), seq: UInt64(strides.seq))
    }
}
