import Foundation
import XCTest

@testable import FlashAttentionMetal

/// The MSL source the Metal backend compiles at run time.
final class EmbeddedShadersTests: XCTestCase {
    private let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    /// The checked-in Generated/EmbeddedShaders.swift holds exactly Shaders/flash_attention.metal with
    /// each quoted #include replaced by the header's text, the headers' own includes expanded where
    /// they stand, each header once, as tools/embed_shaders.py writes it. (Done in Swift rather than
    /// by running the script: a child process would need Foundation.Process, whose own allocations
    /// the sanitized run would report.)
    func testEmbeddedSourceIsUpToDate() throws {
        let shaders = root.appendingPathComponent("Shaders")
        var lines: [String] = []
        var spliced: Set<String> = []
        func splice(_ name: String) throws {
            let text = try String(contentsOf: shaders.appendingPathComponent(name), encoding: .utf8)
            for line in text.split(separator: "\n", omittingEmptySubsequences: false).dropLast(text.hasSuffix("\n") ? 1 : 0) {
                guard let header = quotedInclude(String(line)) else {
                    lines.append(String(line))
                    continue
                }
                guard spliced.insert(header).inserted else { continue }
                lines.append("// ---- begin \(header) (spliced by tools/embed_shaders.py) ----")
                try splice(header)
                lines.append("// ---- end \(header) ----")
            }
        }
        try splice("flash_attention.metal")
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
        // Every kernel of the catalogue, its body and the instances of every dtype.
        for kernel in ["forward", "forward_split", "forward_decode", "forward_kvcache", "forward_split_kvcache",
                       "forward_decode_kvcache", "forward_combine", "backward_delta", "backward_lse_residual",
                       "backward_dq", "backward_dkv", "backward_dsinks", "varlen_sequences", "merge"] {
            XCTAssertTrue(source.contains("    X(\(kernel), "), kernel)
            XCTAssertTrue(source.contains("inline void kernel_\(kernel)("), kernel)
        }
        for instances in ["FA_DEFINE_DTYPE_KERNELS(half, f16)", "FA_DEFINE_DTYPE_KERNELS(bfloat, bf16)",
                          "FA_DEFINE_DTYPE_KERNELS(float, f32)", "FA_HEAD_DIM_BUCKETS(FA_DEFINE_F16)",
                          "FA_HEAD_DIM_BUCKETS(FA_DEFINE_BF16)", "FA_HEAD_DIM_BUCKETS_F32(FA_DEFINE_F32)"] {
            XCTAssertTrue(source.contains(instances), instances)
        }
        // The merge kernel's header (spliced, not included).
        XCTAssertTrue(source.contains("inline float merge_weight("))
    }
}
