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
        let tensor = try splicedSource(folder: root.appendingPathComponent("Shaders"), metal: "flash_attention_tensor.metal")
        XCTAssertTrue(EmbeddedShaders.tensorSource + "\n" == tensor,
                      "the embedded tensor-op source differs from Shaders/: the EmbedShaders plugin did not rerun")
    }

    /// The tensor-op library's source: self-contained, the tensor-op kernels' body and instances,
    /// Metal 4's header; the other library's source has none of them (a failure to compile one
    /// library loses only its kernels).
    func testTensorSourceIsItsOwnLibrary() throws {
        let tensor = EmbeddedShaders.tensorSource
        for line in tensor.split(separator: "\n") where line.trimmingCharacters(in: .whitespaces).hasPrefix("#include") {
            XCTAssertTrue(line.contains("<"), "quoted include left in the embedded tensor-op source: \(line)")
        }
        XCTAssertTrue(tensor.contains("#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>"))
        XCTAssertTrue(tensor.contains("inline void kernel_forward_tensor("))
        XCTAssertTrue(tensor.contains("FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_F16)"))
        XCTAssertTrue(tensor.contains("FA_HEAD_DIM_BUCKETS(FA_DEFINE_TENSOR_BF16)"))
        XCTAssertFalse(EmbeddedShaders.source.contains("MetalPerformancePrimitives"))
        XCTAssertFalse(EmbeddedShaders.source.contains("inline void kernel_forward_tensor("))
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
                       "forward_decode_kvcache", "forward_decode_mma_kvcache", "forward_combine", "backward_delta",
                       "backward_lse_residual", "backward_dq", "backward_dkv", "backward_dsinks", "varlen_sequences", "merge"] {
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
