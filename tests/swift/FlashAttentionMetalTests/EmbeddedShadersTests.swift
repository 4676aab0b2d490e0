import Foundation
import XCTest

@testable import FlashAttentionMetal

/// The MSL source the Metal backend compiles at run time.
final class EmbeddedShadersTests: XCTestCase {
    private let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    /// The checked-in Generated/EmbeddedShaders.swift matches Shaders/ (tools/embed_shaders.py --check).
    func testEmbeddedSourceIsUpToDate() throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["python3", root.appendingPathComponent("tools/embed_shaders.py").path, "--check"]
        let stderr = Pipe()
        process.standardError = stderr
        try process.run()
        process.waitUntilExit()
        let message = String(decoding: stderr.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        XCTAssertEqual(process.terminationStatus, 0, message)
    }

    /// makeLibrary(source:) has no include path: only angle-bracket system headers may remain, and
    /// the parameter struct and every kernel instance of the plan must be in the source.
    func testSourceIsSelfContained() throws {
        let source = EmbeddedShaders.source
        for line in source.split(separator: "\n") where line.trimmingCharacters(in: .whitespaces).hasPrefix("#include") {
            XCTAssertTrue(line.contains("<"), "quoted include left in the embedded source: \(line)")
        }
        XCTAssertTrue(source.contains("typedef struct FlashAttentionParams"))
        XCTAssertTrue(source.contains("FA_HEAD_DIM_BUCKETS"))
        for name in ["flash_attention_forward_d", "flash_attention_backward_dq_d", "flash_attention_backward_dkv_d"] {
            XCTAssertTrue(source.contains(name), name)
        }
    }
}
