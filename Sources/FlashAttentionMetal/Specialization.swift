import CFlashAttentionMetal

/// The MSL type of a function constant: `bool` or `uint`.
public enum SpecializationType: Hashable, Sendable {
    case bool, uint32
}

/// The value of one of the kernels' function constants for a dispatch (flash_attention_params.h,
/// `FA_FUNCTION_CONSTANTS`: the attention mask's kind, softcap, ALiBi and sinks on or off). Metal
/// fixes it when it builds the kernel's pipeline (`MTLFunctionConstantValues`), so the kernel has
/// no per-element test of the feature; the CPU engine takes it per dispatch; hosts that cannot set
/// function constants prepend it to the source (``functionConstantPrelude(_:)``).
public struct SpecializationConstant: Hashable, Sendable {
    /// As the kernels spell it, e.g. `fa_mask_type`.
    public let name: String
    /// Its `[[function_constant(index)]]`.
    public let index: Int
    public let type: SpecializationType
    /// A bool's value is 0 or 1; a uint's is the value (`fa_mask_type`: `FA_MASK_*`).
    public let value: UInt32
}

extension SpecializationConstant {
    /// The function constants `indices` (`FA_FUNCTION_CONSTANT_*`) with their values for a call
    /// whose parameter struct is `params`, in the order given.
    static func values(_ indices: [Int32], for params: FlashAttentionParams) -> [SpecializationConstant] {
        var params = params
        return indices.map { index in
            let constant = FunctionConstant(index: UInt32(index))
            return SpecializationConstant(name: constant.name, index: Int(index), type: constant.type,
                                          value: fa_function_constant_value(UInt32(index), &params))
        }
    }

    /// `name=value` for each constant, separated by spaces (a bool as 0 or 1): for profiles and
    /// messages.
    static func text(_ specialization: [SpecializationConstant]) -> String {
        specialization.map { "\($0.name)=\($0.value)" }.joined(separator: " ")
    }
}

/// What a host that cannot set function constants (PyTorch's `torch.mps.compile_shader`) puts before
/// the kernel source so that it compiles with `specialization`: the line
/// `#define FA_FUNCTION_CONSTANTS_PREDEFINED 1`, then `constant <bool|uint> <name> = <value>;` for
/// every function constant of the kernels, in index order. The source is compiled whole, so the
/// constants that the dispatch's kernel does not read are defined too, as false or 0: that kernel
/// never reads them (the CPU engine fails any dispatch whose kernel reads a constant its
/// specialization lacks). One library compiled from this text serves every dispatch with the same
/// specialization.
public func functionConstantPrelude(_ specialization: [SpecializationConstant]) -> String {
    var lines = ["#define FA_FUNCTION_CONSTANTS_PREDEFINED 1"]
    for index in 0..<UInt32(FA_FUNCTION_CONSTANT_COUNT) {
        let constant = FunctionConstant(index: index)
        let value = specialization.first { $0.index == Int(index) }?.value ?? 0
        let text = constant.type == .bool ? (value != 0 ? "true" : "false") : "\(value)"
        lines.append("constant \(constant.typeName) \(constant.name) = \(text);")
    }
    return lines.joined(separator: "\n") + "\n"
}

/// One row of `FA_FUNCTION_CONSTANTS`, read from the C table built from it.
private struct FunctionConstant {
    let name: String
    let typeName: String
    let type: SpecializationType

    /// The constant at `index`, which must be below `FA_FUNCTION_CONSTANT_COUNT` (every caller
    /// passes an `FA_FUNCTION_CONSTANT_*` or counts up to it).
    init(index: UInt32) {
        var row = FlashAttentionFunctionConstant()
        let found = fa_function_constant(index, &row) != 0
        assert(found, "no function constant at index \(index)")
        name = found ? String(cString: row.name) : "?"
        typeName = found ? String(cString: row.type_name) : "?"
        type = row.type == UInt32(FA_FUNCTION_CONSTANT_TYPE_bool) ? .bool : .uint32
    }
}
