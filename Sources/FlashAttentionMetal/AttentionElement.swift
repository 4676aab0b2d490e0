/// A Swift element type the kernels read and write, and the dtype it stands for: `Float16`
/// (float16), ``BFloat16`` (bfloat16), `Float` (float32), and `UInt16` as float16 bit patterns
/// (for platforms without `Float16`, such as macOS on x86_64). All tensors of one call share it.
public protocol AttentionElement {
    /// The zero element.
    init()
    /// The dtype the kernels use for this element type.
    static var attentionDType: AttentionDType { get }
}

extension Float: AttentionElement {
    public static var attentionDType: AttentionDType { .float32 }
}

/// float16 bit patterns.
extension UInt16: AttentionElement {
    public static var attentionDType: AttentionDType { .float16 }
}

#if !((os(macOS) || targetEnvironment(macCatalyst)) && arch(x86_64))
extension Float16: AttentionElement {
    public static var attentionDType: AttentionDType { .float16 }
}
#endif

/// A bfloat16 value (8 exponent bits, 7 mantissa bits: the upper half of a float32), stored as its
/// bit pattern; Swift has no built-in bfloat16.
public struct BFloat16: AttentionElement, Equatable, Hashable, Sendable {
    /// The 16 bits: sign, 8 exponent bits, 7 mantissa bits.
    public var bitPattern: UInt16

    /// Zero.
    public init() { bitPattern = 0 }

    public init(bitPattern: UInt16) { self.bitPattern = bitPattern }

    /// `value` rounded to the nearest bfloat16 (ties to even); NaN stays a quiet NaN.
    public init(_ value: Float) {
        let bits = value.bitPattern
        if value.isNaN {
            bitPattern = UInt16(truncatingIfNeeded: bits >> 16) | 0x0040
        } else {
            let rounding = 0x7FFF + ((bits >> 16) & 1)
            bitPattern = UInt16(truncatingIfNeeded: (bits &+ rounding) >> 16)
        }
    }

    /// The exact float32 value.
    public var floatValue: Float { Float(bitPattern: UInt32(bitPattern) << 16) }

    public static var attentionDType: AttentionDType { .bfloat16 }
}
