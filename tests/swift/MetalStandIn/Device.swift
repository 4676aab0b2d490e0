// The device and its buffers: host memory.
#if canImport(Glibc)
import Glibc
#endif
import Foundation
import CFlashAttentionMetal
import IOKit
import MSLEngine

// https://developer.apple.com/documentation/metal/mtlgpufamily
public enum MTLGPUFamily: Int, Sendable {
    case apple7 = 1007
}

// https://developer.apple.com/documentation/metal/mtlstoragemode
public enum MTLStorageMode: UInt, Sendable {
    case shared = 0
    case `private` = 2
}

// https://developer.apple.com/documentation/metal/mtlresourceoptions
public struct MTLResourceOptions: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    // https://developer.apple.com/documentation/metal/mtlresourceoptions/storagemodeshared
    public static let storageModeShared = MTLResourceOptions([])
    // https://developer.apple.com/documentation/metal/mtlresourceoptions/storagemodeprivate
    public static let storageModePrivate = MTLResourceOptions(rawValue: 2 << 4)

    var storageMode: MTLStorageMode { contains(.storageModePrivate) ? .private : .shared }
}

// https://developer.apple.com/documentation/metal/mtlsize
public struct MTLSize: Sendable {
    public var width: Int
    public var height: Int
    public var depth: Int
    // https://developer.apple.com/documentation/metal/mtlsize/init(width:height:depth:)
    public init(width: Int, height: Int, depth: Int) {
        self.width = width
        self.height = height
        self.depth = depth
    }
}

// https://developer.apple.com/documentation/metal/mtlarchitecture
public final class MTLArchitecture: @unchecked Sendable {
    // https://developer.apple.com/documentation/metal/mtlarchitecture/name
    public let name: String
    init(name: String) { self.name = name }
}

// https://developer.apple.com/documentation/metal/mtldevice
public protocol MTLDevice: AnyObject {
    // https://developer.apple.com/documentation/metal/mtldevice/architecture (macOS 14+)
    var architecture: MTLArchitecture { get }
    // https://developer.apple.com/documentation/metal/mtldevice/name
    var name: String { get }
    // https://developer.apple.com/documentation/metal/mtldevice/registryid
    var registryID: UInt64 { get }
    // https://developer.apple.com/documentation/metal/mtldevice/maxbufferlength
    var maxBufferLength: Int { get }
    // https://developer.apple.com/documentation/metal/mtldevice/maxthreadgroupmemorylength
    var maxThreadgroupMemoryLength: Int { get }
    // https://developer.apple.com/documentation/metal/mtldevice/supportsfamily(_:)
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool
    // https://developer.apple.com/documentation/metal/mtldevice/makecommandqueue()
    func makeCommandQueue() -> MTLCommandQueue?
    // https://developer.apple.com/documentation/metal/mtldevice/makebuffer(length:options:)
    func makeBuffer(length: Int, options: MTLResourceOptions) -> MTLBuffer?
    // https://developer.apple.com/documentation/metal/mtldevice/makebuffer(bytes:length:options:)
    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer?
    // https://developer.apple.com/documentation/metal/mtldevice/makebuffer(bytesnocopy:length:options:deallocator:)
    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: (@Sendable (UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer?
    // https://developer.apple.com/documentation/metal/mtldevice/makelibrary(url:)
    func makeLibrary(URL url: URL) throws -> MTLLibrary
    // https://developer.apple.com/documentation/metal/mtldevice/makelibrary(source:options:)
    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary
    // https://developer.apple.com/documentation/metal/mtldevice/makecomputepipelinestate(function:)
    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState
}

// https://developer.apple.com/documentation/metal/mtlcreatesystemdefaultdevice()
public func MTLCreateSystemDefaultDevice() -> MTLDevice? { StandInDevice.shared }

// https://developer.apple.com/documentation/metal/mtlbuffer
public protocol MTLBuffer: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlresource/device
    var device: MTLDevice { get }
    // https://developer.apple.com/documentation/metal/mtlbuffer/length
    var length: Int { get }
    // https://developer.apple.com/documentation/metal/mtlresource/storagemode
    var storageMode: MTLStorageMode { get }
    // https://developer.apple.com/documentation/metal/mtlbuffer/gpuaddress
    var gpuAddress: UInt64 { get }
    // https://developer.apple.com/documentation/metal/mtlbuffer/contents()
    func contents() -> UnsafeMutableRawPointer
}

/// The one device: Apple7 limits (32 KiB of threadgroup memory), buffers of host memory.
final class StandInDevice: MTLDevice, @unchecked Sendable {
    static let shared = StandInDevice()

    let name = "Metal stand-in (CPU engine)"
    /// The stand-in IOKit's accelerator entry for this device.
    let registryID = standInAcceleratorRegistryID
    let maxBufferLength = 1 << 34
    let maxThreadgroupMemoryLength = 32 * 1024

    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool { gpuFamily == .apple7 }

    /// An M1's (`applegpu_g13s`: no matrix units), or $FLASH_ATTENTION_METAL_STANDIN_ARCH's (tests
    /// of the tensor-op route set `applegpu_g17s`, an M5's), read on each use.
    var architecture: MTLArchitecture {
        MTLArchitecture(name: getenv("FLASH_ATTENTION_METAL_STANDIN_ARCH").map { String(cString: $0) } ?? "applegpu_g13s")
    }

    func makeCommandQueue() -> MTLCommandQueue? { StandInCommandQueue(device: self) }

    func makeBuffer(length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        checkLength(length, "mtldevice/makebuffer(length:options:)")
        // Zero-filled, as documented.
        guard let memory = calloc(max(length, 1), 1) else { return nil }
        return StandInBuffer(device: self, memory: memory, length: length, storageMode: options.storageMode,
                             release: { free(memory) })
    }

    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        checkLength(length, "mtldevice/makebuffer(bytes:length:options:)")
        guard let memory = malloc(max(length, 1)) else { return nil }
        memory.copyMemory(from: pointer, byteCount: length)
        return StandInBuffer(device: self, memory: memory, length: length, storageMode: options.storageMode,
                             release: { free(memory) })
    }

    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: (@Sendable (UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer? {
        let page = "mtldevice/makebuffer(bytesnocopy:length:options:deallocator:)"
        checkLength(length, page)
        if Int(bitPattern: pointer) % applePageSize != 0 || length % applePageSize != 0 {
            violation("makeBuffer(bytesNoCopy:) needs a page-aligned pointer and a length that ends on a page "
                          + "(\(applePageSize) bytes on Apple silicon): got \(pointer), \(length) bytes", page)
        }
        // Memory that is not readable and writable end to end is refused (nil), as Metal may refuse
        // memory it cannot map for the GPU.
        guard WritableMappings.cover(pointer, length) else { return nil }
        return StandInBuffer(device: self, memory: pointer, length: length, storageMode: options.storageMode,
                             release: { deallocator?(pointer, length) })
    }

    private func checkLength(_ length: Int, _ page: String) {
        if length <= 0 || length > maxBufferLength {
            violation("a buffer's length must be in 1...maxBufferLength (\(maxBufferLength)): got \(length)", page)
        }
    }

    /// The stand-in's own library files only, as tests write them: a first line
    /// `metal-standin-metallib tensor` (the tensor-op kernels, as a .metallib of
    /// flash_attention_tensor.metal) or `metal-standin-metallib kernels` (every other kernel).
    /// Anything else, a real .metallib included, is refused, as Metal refuses a file it cannot load.
    func makeLibrary(URL url: URL) throws -> MTLLibrary {
        let text = (try? String(contentsOfFile: url.path, encoding: .utf8)) ?? ""
        switch text.split(separator: "\n", maxSplits: 1).first.map(String.init) ?? "" {
        case "metal-standin-metallib tensor":
            return StandInLibrary(device: self, dtypes: ["f16", "f32", "bf16"], tensor: true)
        case "metal-standin-metallib kernels":
            return StandInLibrary(device: self, dtypes: ["f16", "f32", "bf16"])
        default:
            throw NSError(domain: "MTLLibraryErrorDomain", code: 1, userInfo: [
                NSLocalizedDescriptionKey: "the Metal stand-in loads only its own library files (\(url.path))",
            ])
        }
    }

    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary {
        let version = options?.languageVersion ?? .version3_1
        let major = Int(version.rawValue >> 16), minor = Int(version.rawValue & 0xFFFF)
        // The source's `#if defined(__HAVE_BFLOAT__)` drops the bfloat16 kernels below MSL 3.1, and a
        // first line `#define FA_DTYPES <mask>` keeps only those dtypes (flash_attention.metal).
        let withBFloat = major > 3 || (major == 3 && minor >= 1)
        var dtypes: Set<String> = withBFloat ? ["f16", "f32", "bf16"] : ["f16", "f32"]
        let prelude = "#define FA_DTYPES "
        if source.hasPrefix(prelude), let mask = Int(source.dropFirst(prelude.count).prefix { $0 != "\n" }) {
            let bits = [("f16", Int(FA_DTYPE_MASK_F16)), ("f32", Int(FA_DTYPE_MASK_F32)), ("bf16", Int(FA_DTYPE_MASK_BF16))]
            dtypes = dtypes.filter { suffix in bits.contains { $0.0 == suffix && mask & $0.1 != 0 } }
        }
        if FaultPlan.shared.compileFails(major: major, minor: minor, dtypes: dtypes) {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 3, userInfo: [
                NSLocalizedDescriptionKey: "program_source: error: (stand-in fault) MSL \(major).\(minor) refused",
            ])
        }
        guard source.contains("kernel void") else {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 3,
                          userInfo: [NSLocalizedDescriptionKey: "program_source: no kernel"])
        }
        // The tensor-op source (MetalPerformancePrimitives) compiles from MSL 4.0 only.
        let tensor = source.contains("<MetalPerformancePrimitives/MetalPerformancePrimitives.h>")
        if tensor && (major < 4 || FaultPlan.shared.compileFails(major: major, minor: minor, dtypes: ["tensor"])) {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 3, userInfo: [
                NSLocalizedDescriptionKey: "program_source: error: (stand-in) the tensor-op source did not compile at "
                    + "MSL \(major).\(minor)",
            ])
        }
        return StandInLibrary(device: self, dtypes: dtypes, tensor: tensor)
    }

    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState {
        guard let function = computeFunction as? StandInFunction, function.device === self else {
            violation("a pipeline's function must come from a library of the same device",
                      "mtldevice/makecomputepipelinestate(function:)")
        }
        // makeFunction(name:) of a kernel that uses function constants gives a function that can only
        // be queried, not made into a pipeline (mtllibrary/makefunction(name:)).
        if function.constants == nil, let used = catalogueConstants(of: function.name), used != 0 {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 2, userInfo: [
                NSLocalizedDescriptionKey: "\(function.name) uses function constants (mask \(used)): make it with "
                    + "makeFunction(name:constantValues:) to build a pipeline",
            ])
        }
        var info = msl_engine_kernel_info()
        guard msl_engine_describe_kernel(function.name, &info) != 0 else {
            fatalError("Metal stand-in: the CPU engine has no kernel \(function.name)")
        }
        // Compiling fails when a kernel declares more threadgroup memory than the device has.
        guard info.threadgroup_memory_length <= maxThreadgroupMemoryLength else {
            throw NSError(domain: "MTLLibraryErrorDomain", code: 2, userInfo: [
                NSLocalizedDescriptionKey: "\(function.name) declares \(info.threadgroup_memory_length) bytes of "
                    + "threadgroup memory; the device has \(maxThreadgroupMemoryLength)",
            ])
        }
        return StandInPipeline(function: function, staticThreadgroupMemoryLength: info.threadgroup_memory_length)
    }
}

final class StandInBuffer: MTLBuffer, @unchecked Sendable {
    let device: MTLDevice
    let memory: UnsafeMutableRawPointer
    let length: Int
    let storageMode: MTLStorageMode
    private let release: () -> Void

    init(device: MTLDevice, memory: UnsafeMutableRawPointer, length: Int, storageMode: MTLStorageMode,
         release: @escaping () -> Void) {
        self.device = device
        self.memory = memory
        self.length = length
        self.storageMode = storageMode
        self.release = release
    }

    deinit { release() }

    var gpuAddress: UInt64 { UInt64(UInt(bitPattern: memory)) }

    func contents() -> UnsafeMutableRawPointer {
        // Documented: NULL for private storage, which the CPU cannot address.
        if storageMode == .private {
            violation("contents() of a buffer with private storage (the CPU cannot address it)", "mtlbuffer/contents()")
        }
        return memory
    }
}

/// Whether a range of addresses lies in mappings that are readable and writable, end to end
/// (/proc/self/maps): what wrapping caller memory without a copy assumes. The file is read to its
/// end (String(contentsOfFile:) stops after its first 4 KiB on Linux, since /proc reports size 0,
/// and would miss the high mappings of large allocations).
enum WritableMappings {
    static func cover(_ pointer: UnsafeRawPointer, _ length: Int) -> Bool {
        guard let file = FileHandle(forReadingAtPath: "/proc/self/maps") else { return true }
        defer { file.closeFile() }
        let maps = String(decoding: file.readDataToEndOfFile(), as: UTF8.self)
        var next = UInt(bitPattern: pointer)
        let end = next + UInt(length)
        for line in maps.split(separator: "\n") {
            let fields = line.split(separator: " ")
            guard fields.count >= 2 else { continue }
            let bounds = fields[0].split(separator: "-").compactMap { UInt($0, radix: 16) }
            guard bounds.count == 2, bounds[0] <= next, next < bounds[1] else { continue }
            guard fields[1].hasPrefix("rw") else { return false }
            next = bounds[1]
            if next >= end { return true }
        }
        return false
    }
}
