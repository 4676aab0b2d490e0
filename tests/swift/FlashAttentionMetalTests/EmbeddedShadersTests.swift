import Foundation
import XCTest

@testable import FlashAttentionMetal
import ShaderSplice

/// The MSL source the Metal backend compiles at run time.
final class EmbeddedShadersTests: XCTestCase {
    private let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    /// The embedded source (EmbeddedShaders.swift, generated at build time by the EmbedShaders tool)
    /// is Shaders/ spliced now, and its hash names it. (The splice is called here rather than the
    /// tool run: a child process would need Foundation.Process, whose own allocations the
    /// sanitized run would report.)
    func testEmbeddedSourceIsUpToDate() throws {
        let spliced = try splicedSource(folder: root.appendingPathComponent("Shaders"), metal: "flash_attention.metal")
        // A multi-line string literal ends before the newline that precedes its closing delimiter.
        XCTAssertTrue(EmbeddedShaders.source + "\n" == spliced,
                      "the embedded source differs from Shaders/: the EmbedShaders plugin did not rerun")
        XCTAssertEqual(EmbeddedShaders.sourceHash, sourceHash(spliced))
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
