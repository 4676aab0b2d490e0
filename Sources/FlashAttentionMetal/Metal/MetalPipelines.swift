// The compute pipelines of the kernels' Metal libraries, one per kernel name and specialization (the values of
// the function constants the kernel reads, Dispatch.specialization). Not compiled on Linux; each
// Metal call was checked against Apple's documentation, cited where it is used.
#if canImport(Metal)
import Foundation
import Metal

/// Pipelines built on first use and kept, with the errors of those that could not be built (not
/// retried). Thread-safe.
final class MetalPipelines: @unchecked Sendable {
    private struct Key: Hashable {
        let kernelName: String
        let specialization: [SpecializationConstant]
    }

    private let device: MTLDevice
    /// The kernels: one library, or one per dtype when the whole source did not compile.
    private let libraries: [MTLLibrary]
    /// Why a dtype's kernels are in none of the libraries, by kernel suffix ("f16", "bf16", "f32").
    private let lost: [String: String]
    private let lock = Lock()
    private var built: [Key: Result<MTLComputePipelineState, FlashAttentionError>] = [:]

    init(device: MTLDevice, libraries: [MTLLibrary], lost: [String: String] = [:]) {
        self.device = device
        self.libraries = libraries
        self.lost = lost
    }

    /// The pipeline of `dispatch`'s kernel specialised for its function constants.
    func pipeline(for dispatch: Dispatch) throws -> MTLComputePipelineState {
        let key = Key(kernelName: dispatch.kernelName, specialization: dispatch.specialization)
        return try lock.withLock {
            if let known = built[key] { return known }
            let result = build(key)
            built[key] = result
            return result
        }.get()
    }

    /// MTLDevice.makeComputePipelineState(function:) (throws) of the kernel's function.
    private func build(_ key: Key) -> Result<MTLComputePipelineState, FlashAttentionError> {
        let function: MTLFunction
        switch makeFunction(key) {
        case .success(let made): function = made
        case .failure(let error): return .failure(error)
        }
        do {
            return .success(try device.makeComputePipelineState(function: function))
        } catch {
            return .failure(.executionFailed("Metal could not build the pipeline of \(describe(key)) on "
                                                 + "\(device.name): \(error.localizedDescription)"))
        }
    }

    /// The kernel's function. A kernel without function constants: MTLLibrary.makeFunction(name:),
    /// nil when the library lacks it (developer.apple.com/documentation/metal/mtllibrary/
    /// makefunction(name:)). Otherwise MTLLibrary.makeFunction(name:constantValues:), which throws
    /// when the library lacks the function or a constant the function requires has no value (every
    /// constant of the kernels is required: none is tested with is_function_constant_defined;
    /// .../mtllibrary/makefunction(name:constantvalues:), .../mtlfunctionconstant/required), with
    /// the values set by MTLFunctionConstantValues.setConstantValue(_:type:index:) from a pointer
    /// to a value of the declared type: MSL bool is one byte, as Swift's Bool, and uint four
    /// (.../mtlfunctionconstantvalues/setconstantvalue(_:type:index:)).
    private func makeFunction(_ key: Key) -> Result<MTLFunction, FlashAttentionError> {
        // MTLLibrary.functionNames: the names of the library's functions.
        guard let library = libraries.first(where: { $0.functionNames.contains(key.kernelName) }) else {
            return .failure(missing(key))
        }
        if key.specialization.isEmpty {
            guard let function = library.makeFunction(name: key.kernelName) else { return .failure(missing(key)) }
            return .success(function)
        }
        let values = MTLFunctionConstantValues()
        for constant in key.specialization {
            switch constant.type {
            case .bool:
                var value = constant.value != 0
                values.setConstantValue(&value, type: .bool, index: constant.index)
            case .uint32:
                var value = constant.value
                values.setConstantValue(&value, type: .uint, index: constant.index)
            }
        }
        do {
            return .success(try library.makeFunction(name: key.kernelName, constantValues: values))
        } catch {
            return .failure(.internalError("Metal could not specialise \(describe(key)): "
                                               + "\(error.localizedDescription)"))
        }
    }

    /// Why no library has the kernel.
    private func missing(_ key: Key) -> FlashAttentionError {
        if let dtype = AttentionDType.allCases.first(where: { key.kernelName.contains("_\($0.kernelSuffix)") }),
           let reason = lost[dtype.kernelSuffix] {
            return .unsupported("the \(dtype) kernels did not compile on \(device.name) (\(reason)); the other "
                                    + "dtypes run")
        }
        if key.kernelName.contains("_bf16") {
            // Compiled below MSL 3.1 (or a .metallib built without bfloat): no bfloat kernels.
            return .unsupported("bfloat16 needs Metal Shading Language 3.1 (macOS 14, iOS 17); the kernels on "
                                    + "\(device.name) were compiled without it")
        }
        return .internalError("the Metal library has no kernel named \(key.kernelName)")
    }

    private func describe(_ key: Key) -> String {
        key.specialization.isEmpty
            ? key.kernelName : "\(key.kernelName) (\(SpecializationConstant.text(key.specialization)))"
    }
}
#endif
