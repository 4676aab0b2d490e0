import Foundation
import XCTest

@testable import FlashAttentionMetal

/// The MSL source the Metal backend compiles at run time.
final class EmbeddedShadersTests: XCTestCase {
    private let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    /// The checked-in Generated/EmbeddedShaders.swift holds exactly Shaders/flash_attention.metal with
    /// each quoted #include replaced by the header's text, as tools/embed_shaders.py writes it. (Done
    /// in Swift rather than by running the script: a child process would need Foundation.Process,
    /// whose own allocations the sanitized run would report.)
    func testEmbeddedSourceIsUpToDate() throws {
        let shaders = root.appendingPathComponent("Shaders")
        let metal = try String(contentsOf: shaders.appendingPathComponent("flash_attention.metal"), encoding: .utf8)
        var lines: [String] = []
        for line in metal.split(separator: "\n", omittingEmptySubsequences: false).dropLast(metal.hasSuffix("\n") ? 1 : 0) {
            if let header = quotedInclude(String(line)) {
                let text = try String(contentsOf: shaders.appendingPathComponent(header), encoding: .utf8)
                lines.append("// ---- begin \(header) (spliced by tools/embed_shaders.py) ----")
                lines += text.split(separator: "\n", omittingEmptySubsequences: false)
                    .dropLast(text.hasSuffix("\n") ? 1 : 0).map(String.init)
                lines.append("// ---- end \(header) ----")
            } else {
                lines.append(String(line))
            }
        }
        // A multi-line string literal ends before the newline that precedes its closing delimiter.
        let expected = lines.joined(separator: "\n")
        XCTAssertTrue(EmbeddedShaders.source == expected,
                      "Sources/FlashAttentionMetal/Generated/EmbeddedShaders.swift is stale: run tools/embed_shaders.py")
    }

    /// The file name of a `#include "name"` line, else nil.
    private func quotedInclude(_ line: String) -> String? {
        let compact = line.filter { $0 != " " && $0 != "\t" }
        guard compact.hasPrefix("#include\""), compact.hasSuffix("\""), compact.count > 10 else { return nil }
        return String(compact.dropFirst(9).dropLast())
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
        XCTAssertTrue(source.contains("FA_HEAD_DIM_BUCKETS_F32"))
        for name in ["flash_attention_forward_##SUFFIX##_d", "flash_attention_forward_split_##SUFFIX##_d",
                     "flash_attention_forward_decode_##SUFFIX##_d",
                     "flash_attention_backward_dq_##SUFFIX##_d", "flash_attention_backward_dkv_##SUFFIX##_d",
                     "flash_attention_backward_lse_residual_##SUFFIX##_d",
                     "flash_attention_forward_combine_##SUFFIX", "flash_attention_backward_delta_##SUFFIX"] {
            XCTAssertTrue(source.contains(name), name)
        }
        // The merge kernel and its header (spliced, not included).
        XCTAssertTrue(source.contains("kernel void flash_attention_merge_##SUFFIX("))
        XCTAssertTrue(source.contains("FA_DEFINE_MERGE_KERNEL(bfloat, bf16)"))
        XCTAssertTrue(source.contains("inline float merge_weight("))
    }
}
