// Libraries, functions with their constants, and pipelines: the CPU engine's kernels by name.
import CFlashAttentionMetal
import Foundation
import MSLEngine

// https://developer.apple.com/documentation/metal/mtllanguageversion
public enum MTLLanguageVersion: UInt, Sendable {
    // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_0
    case version3_0 = 196608
    // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_1
    case version3_1 = 196609
    // https://developer.apple.com/documentation/metal/mtllanguageversion/version4_0
    case version4_0 = 262144
}

// https://developer.apple.com/documentation/metal/mtlcompileoptions
public final class MTLCompileOptions {
    public init() {}
    // https://developer.apple.com/documentation/metal/mtlcompileoptions/languageversion
    public var languageVersion: MTLLanguageVersion = .version3_1
    // https://developer.apple.com/documentation/metal/mtlcompileoptions/fastmathenabled
    public var fastMathEnabled = true
}

// https://developer.apple.com/documentation/metal/mtldatatype
public enum MTLDataType: UInt, Sendable {
    case uint = 33
    case bool = 53
}

// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues
public final class MTLFunctionConstantValues {
    fileprivate var values: [Int: (type: MTLDataType, bits: UInt32)] = [:]
    public init() {}

    // https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalue(_:type:index:)
    public func setConstantValue(_ value: UnsafeRawPointer, type: MTLDataType, index: Int) {
        switch type {
        case .bool: values[index] = (type, UInt32(value.load(as: UInt8.self)))
        case .uint: values[index] = (type, value.loadUnaligned(as: UInt32.self))
        }
    }
}

// https://developer.apple.com/documentation/metal/mtllibrary
public protocol MTLLibrary: AnyObject {
    // https://developer.apple.com/documentation/metal/mtllibrary/functionnames
    var functionNames: [String] { get }
    // https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:)
    func makeFunction(name functionName: String) -> MTLFunction?
    // https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:constantvalues:)
    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction
}

// https://developer.apple.com/documentation/metal/mtlfunction
public protocol MTLFunction: AnyObject {}

// https://developer.apple.com/documentation/metal/mtlcomputepipelinestate
public protocol MTLComputePipelineState: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/maxtotalthreadsperthreadgroup
    var maxTotalThreadsPerThreadgroup: Int { get }
    // https://developer.apple.com/documentation/metal/mtlcomputepipelinestate/staticthreadgroupmemorylength
    var staticThreadgroupMemoryLength: Int { get }
}

/// The engine's kernels of `dtypes` (kernel suffixes: no bfloat16 ones when compiled below MSL
/// 3.1, only the prelude's when the source starts with one) and those of no dtype; the tensor-op
/// kernels (`_tensor_` in their names) only in a tensor-op library (`tensor`: a source of
/// flash_attention_tensor.metal), and only they there.
final class StandInLibrary: MTLLibrary, @unchecked Sendable {
    let device: StandInDevice
    let functionNames: [String]

    init(device: StandInDevice, dtypes: Set<String>, tensor: Bool = false) {
        self.device = device
        var names: [String] = []
        while let name = msl_engine_kernel_name(names.count) {
            names.append(String(cString: name))
        }
        functionNames = names.filter { name in
            ["f16", "f32", "bf16"].allSatisfy { dtypes.contains($0) || !name.contains("_\($0)") }
                && name.contains("_tensor_") == tensor
        }
    }

    func makeFunction(name functionName: String) -> MTLFunction? {
        functionNames.contains(functionName) ? StandInFunction(device: device, name: functionName, constants: nil) : nil
    }

    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction {
        guard functionNames.contains(name) else {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 5,
                          userInfo: [NSLocalizedDescriptionKey: "Function \(name) was not found in the library"])
        }
        // Compilation fails without a value for every function constant the function uses
        // (mtllibrary/makefunction(name:constantvalues:)); values for others are ignored.
        let used = catalogueConstants(of: name) ?? 0
        if let missing = (0..<32).first(where: { used & (1 << $0) != 0 && constantValues.values[$0] == nil }) {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 5, userInfo: [
                NSLocalizedDescriptionKey: "\(name): no value for function constant \(missing), which it uses",
            ])
        }
        let constants = constantValues.values.sorted { $0.key < $1.key }.map {
            msl_engine_function_constant(index: UInt32($0.key),
                                         type: ($0.value.type == .bool ? MSL_ENGINE_CONSTANT_BOOL
                                                    : MSL_ENGINE_CONSTANT_UINT).rawValue,
                                         value: $0.value.bits)
        }
        return StandInFunction(device: device, name: name, constants: constants)
    }
}

/// The function constants kernel `name` uses (bit i: [[function_constant(i)]]), from the kernel
/// catalogue's row whose name is the longest that `name` spells as flash_attention_<row>[_...];
/// nil for a name of no row.
func catalogueConstants(of name: String) -> UInt32? {
    var best: (length: Int, constants: UInt32)?
    var row = FlashAttentionKernel()
    var index: UInt32 = 0
    while fa_kernel(index, &row) != 0 {
        let stem = "flash_attention_" + String(cString: row.name)
        if (name == stem || name.hasPrefix(stem + "_")) && stem.count > (best?.length ?? 0) {
            best = (stem.count, row.constants)
        }
        index += 1
    }
    return best?.constants
}

/// A kernel and, when made with constant values, those values. Which constants a kernel reads is
/// known only when a thread reads one: a dispatch that reads an unset constant stops the process
/// (on a Mac, makeFunction(name:constantValues:) throws and no pipeline exists).
final class StandInFunction: MTLFunction, @unchecked Sendable {
    let device: StandInDevice
    let name: String
    let constants: [msl_engine_function_constant]?

    init(device: StandInDevice, name: String, constants: [msl_engine_function_constant]?) {
        self.device = device
        self.name = name
        self.constants = constants
    }
}

final class StandInPipeline: MTLComputePipelineState, @unchecked Sendable {
    let function: StandInFunction
    /// Apple GPUs' limit; register pressure can lower it on a Mac, never here.
    let maxTotalThreadsPerThreadgroup = 1024
    let staticThreadgroupMemoryLength: Int

    init(function: StandInFunction, staticThreadgroupMemoryLength: Int) {
        self.function = function
        self.staticThreadgroupMemoryLength = staticThreadgroupMemoryLength
    }
}
