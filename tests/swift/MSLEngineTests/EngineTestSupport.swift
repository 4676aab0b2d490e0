import Foundation
import MSLEngine
import MSLEngineTestKernels
import XCTest

/// A host buffer for a dispatch: `count` elements of T, zero-filled, freed on deinit.
final class HostBuffer<T> {
    let pointer: UnsafeMutablePointer<T>
    let count: Int

    init(count: Int, zero: T) {
        self.count = count
        pointer = UnsafeMutablePointer<T>.allocate(capacity: count)
        pointer.initialize(repeating: zero, count: count)
    }

    convenience init(_ values: [T]) {
        self.init(count: values.count, zero: values[0])
        for (i, v) in values.enumerated() { pointer[i] = v }
    }

    deinit { pointer.deallocate() }

    var binding: msl_engine_buffer {
        msl_engine_buffer(contents: UnsafeMutableRawPointer(pointer),
                          length: count * MemoryLayout<T>.stride)
    }

    var values: [T] { Array(UnsafeBufferPointer(start: pointer, count: count)) }
    subscript(i: Int) -> T { pointer[i] }
}

/// The outcome of one dispatch through the engine's C API.
struct DispatchResult {
    let status: msl_engine_status
    let message: String
    let stats: msl_engine_dispatch_stats
}

/// Dispatches `kernel` over `groups` threadgroups of `threads` threads with the given buffers.
func dispatch(_ kernel: String, _ buffers: [msl_engine_buffer], groups: (UInt32, UInt32, UInt32) = (1, 1, 1),
              threads: (UInt32, UInt32, UInt32)) -> DispatchResult {
    msl_engine_test_kernels_register()
    var message = [CChar](repeating: 0, count: 2048)
    let status = buffers.withUnsafeBufferPointer { b in
        msl_engine_dispatch(kernel, b.baseAddress, UInt32(b.count),
                            msl_engine_size(width: groups.0, height: groups.1, depth: groups.2),
                            msl_engine_size(width: threads.0, height: threads.1, depth: threads.2),
                            &message, message.count)
    }
    var stats = msl_engine_dispatch_stats()
    msl_engine_last_dispatch_stats(&stats)
    return DispatchResult(status: status, message: String(cString: message), stats: stats)
}

/// The lines of tests/kernels/`file`.
func kernelSourceLines(_ file: String, sourceFile: StaticString = #filePath) -> [String] {
    let url = URL(fileURLWithPath: "\(sourceFile)").deletingLastPathComponent()
        .appendingPathComponent("../../kernels/\(file)").standardized
    guard let text = try? String(contentsOf: url, encoding: .utf8) else {
        XCTFail("cannot read \(url.path)")
        return []
    }
    return text.components(separatedBy: "\n")
}

/// The line of tests/kernels/`file` that carries the comment "SITE: `marker`" (1-based).
func siteLine(_ marker: String, in file: String) -> Int {
    guard let index = kernelSourceLines(file).firstIndex(where: { $0.hasSuffix("// SITE: \(marker)") }) else {
        XCTFail("no SITE: \(marker) in \(file)")
        return -1
    }
    return index + 1
}

/// "tests/kernels/`file`:line" of the definition of `kernel` ("kernel void <kernel>(").
func definitionSite(_ kernel: String, in file: String) -> String {
    guard let index = kernelSourceLines(file).firstIndex(where: { $0.hasPrefix("kernel void \(kernel)(") }) else {
        XCTFail("no kernel \(kernel) in \(file)")
        return "?"
    }
    return "tests/kernels/\(file):\(index + 1)"
}

/// Asserts that a dispatch failed with `status` and that its message names the kernel and each
/// given source site (file:line).
func assertFailure(_ result: DispatchResult, _ status: msl_engine_status, kernel: String,
                   sites: [(String, String)], file: StaticString = #filePath, line: UInt = #line) {
    XCTAssertEqual(result.status, status, result.message, file: file, line: line)
    XCTAssertTrue(result.message.contains("'\(kernel)'"), "kernel not named: \(result.message)",
                  file: file, line: line)
    for (metal, marker) in sites {
        let site = "\(metal):\(siteLine(marker, in: metal))"
        XCTAssertTrue(result.message.contains(site), "\(site) not named: \(result.message)",
                      file: file, line: line)
    }
}
