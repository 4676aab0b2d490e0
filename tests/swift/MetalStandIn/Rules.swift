// The stand-in `Metal` module: the Metal API the library's Metal backend uses (and nothing else),
// with Apple's signatures, backed by host memory and the CPU engine (Sources/MSLEngine), which runs
// the same kernels by name. Tests only: tests/metal_standin/build.sh compiles the backend against it
// on Linux. Where Apple documents a precondition, breaking it stops the process with the rule and
// its page, as Metal's API validation layer does on a Mac (docs/metal.md).
#if canImport(Glibc)
import Glibc
#endif
import Foundation

/// Stops the process: `rule` broken, as documented at `page` (developer.apple.com/documentation/metal/...).
func violation(_ rule: String, _ page: String) -> Never {
    fatalError("Metal stand-in: \(rule) (https://developer.apple.com/documentation/metal/\(page))")
}

/// Apple silicon's VM page: bytesNoCopy buffers must start and end on one.
let applePageSize = 16 * 1024

/// Host time in seconds (Metal's GPU times are host times; Linux's monotonic clock stands for mach time).
func hostSeconds() -> Double {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC, &now)
    return Double(now.tv_sec) + Double(now.tv_nsec) * 1e-9
}

/// Faults a test asks for through `$FLASH_ATTENTION_METAL_STANDIN_FAULT`, to reach the backend's
/// error paths that a healthy device never takes:
/// - `compile:3.1`: makeLibrary(source:options:) fails at that language version (3.0 or 3.1);
///   `compile:tensor`: the tensor-op library (flash_attention_tensor.metal) fails to compile;
/// - `commit:<code>:<n>`: the next n command buffers committed after the value was set complete
///   with MTLCommandBufferError code <code> (timeout, pageFault, outOfMemory, accessRevoked,
///   notPermitted, internal); n is `all` for every one.
final class FaultPlan: @unchecked Sendable {
    static let shared = FaultPlan()
    private let lock = NSLock()
    private var seen = ""
    private var used = 0

    private func current() -> [Substring] {
        guard let value = getenv("FLASH_ATTENTION_METAL_STANDIN_FAULT") else {
            seen = ""
            return []
        }
        let text = String(cString: value)
        if text != seen {
            seen = text
            used = 0
        }
        return text.split(separator: ":")
    }

    /// Whether compiling at `major.minor` a source that defines the kernels of `dtypes` (kernel
    /// suffixes) fails: "compile:3.1" fails every compile at MSL 3.1, "compile:f16" every compile
    /// that defines the float16 kernels.
    func compileFails(major: Int, minor: Int, dtypes: Set<String>) -> Bool {
        lock.lock()
        defer { lock.unlock() }
        let parts = current()
        return parts.count == 2 && parts[0] == "compile"
            && (parts[1] == "\(major).\(minor)" || dtypes.contains(String(parts[1])))
    }

    /// The error code the next committed command buffer completes with, if any.
    func commitFault() -> MTLCommandBufferError.Code? {
        lock.lock()
        defer { lock.unlock() }
        let parts = current()
        guard parts.count == 3, parts[0] == "commit" else { return nil }
        let codes: [Substring: MTLCommandBufferError.Code] = [
            "timeout": .timeout, "pageFault": .pageFault, "outOfMemory": .outOfMemory,
            "accessRevoked": .accessRevoked, "notPermitted": .notPermitted, "internal": .internal,
        ]
        guard let code = codes[parts[1]] else {
            fatalError("Metal stand-in: unknown fault code \(parts[1]) in FLASH_ATTENTION_METAL_STANDIN_FAULT")
        }
        if parts[2] != "all" {
            guard let count = Int(parts[2]), used < count else { return nil }
        }
        used += 1
        return code
    }
}
