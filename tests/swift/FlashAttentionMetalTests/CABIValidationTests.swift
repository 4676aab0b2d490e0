import Foundation
import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// Every validation error path of the C ABI: the status and the message text.
final class CABIValidationTests: XCTestCase {
    private var context: OpaquePointer?

    override func setUpWithError() throws {
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &context), FA_STATUS_SUCCESS,
                       String(cString: fa_last_error_message()))
    }

    override func tearDown() {
        fa_context_destroy(context)
        context = nil
    }

    private func validProblem() -> fa_problem {
        var p = fa_problem()
        p.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) = (1, 2, 1, 3, 4, 8)
        p.softmax_scale = 0.5
        return p
    }

    /// Calls fa_forward and fa_backward with buffers large enough for `validProblem()` and returns
    /// both statuses; `nulls` names the pointer arguments passed as null.
    private func call(_ problem: fa_problem?, nulls: Set<String> = [], context: OpaquePointer?? = nil)
        -> (forward: fa_status, forwardMessage: String, backward: fa_status, backwardMessage: String) {
        let ctx = context ?? self.context
        var half = [UInt16](repeating: 0x3C00, count: 1024)
        var float = [Float](repeating: 0, count: 1024)
        var outs = (0..<5).map { _ in [UInt16](repeating: 0, count: 1024) }
        var lse = [Float](repeating: 0, count: 1024)
        return half.withUnsafeMutableBufferPointer { h in
            float.withUnsafeMutableBufferPointer { f in
                lse.withUnsafeMutableBufferPointer { l in
                    outs.withUnsafeMutableBufferPointer { o in
                        o[0].withUnsafeMutableBufferPointer { o0 in
                            o[1].withUnsafeMutableBufferPointer { o1 in
                                o[2].withUnsafeMutableBufferPointer { o2 in
                                    o[3].withUnsafeMutableBufferPointer { o3 in
                                        func ptr<T>(_ name: String, _ p: UnsafeMutableBufferPointer<T>) -> UnsafeMutablePointer<T>? {
                                            nulls.contains(name) ? nil : p.baseAddress
                                        }
                                        var prob = problem ?? validProblem()
                                        return withUnsafePointer(to: &prob) { pp in
                                            let pr = problem == nil ? nil : pp
                                            let fs = fa_forward(ctx, pr, ptr("q", h), ptr("k", h), ptr("v", h),
                                                                ptr("out", o0), ptr("lse", l))
                                            let fm = String(cString: fa_last_error_message())
                                            let bs = fa_backward(ctx, pr, ptr("dout", h), ptr("q", h), ptr("k", h),
                                                                 ptr("v", h), ptr("out", h), ptr("lse", f),
                                                                 ptr("dq", o1), ptr("dk", o2), ptr("dv", o3))
                                            let bm = String(cString: fa_last_error_message())
                                            return (fs, fm, bs, bm)
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    private func expect(_ problem: fa_problem?, _ status: fa_status, _ message: String, nulls: Set<String> = [],
                        file: StaticString = #filePath, line: UInt = #line) {
        let r = call(problem, nulls: nulls)
        XCTAssertEqual(r.forward, status, "forward", file: file, line: line)
        XCTAssertEqual(r.forwardMessage, message, "forward", file: file, line: line)
        XCTAssertEqual(r.backward, status, "backward", file: file, line: line)
        XCTAssertEqual(r.backwardMessage, message, "backward", file: file, line: line)
    }

    private func modified(_ change: (inout fa_problem) -> Void) -> fa_problem {
        var p = validProblem()
        change(&p)
        return p
    }

    func testValidProblemSucceeds() {
        let r = call(validProblem())
        XCTAssertEqual(r.forward, FA_STATUS_SUCCESS, r.forwardMessage)
        XCTAssertEqual(r.backward, FA_STATUS_SUCCESS, r.backwardMessage)
    }

    func testNullContext() {
        let r = call(validProblem(), context: .some(nil))
        XCTAssertEqual(r.forward, FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(r.forwardMessage, "context must not be null")
        XCTAssertEqual(r.backward, FA_STATUS_INVALID_ARGUMENT)
    }

    func testNullProblem() {
        expect(nil, FA_STATUS_INVALID_ARGUMENT, "problem must not be null")
    }

    func testStructSize() {
        expect(modified { $0.struct_size = 0 }, FA_STATUS_INVALID_ARGUMENT,
               "problem->struct_size (0) must be at least 36 (the 0.1 fa_problem)")
        expect(modified { $0.struct_size = 35 }, FA_STATUS_INVALID_ARGUMENT,
               "problem->struct_size (35) must be at least 36 (the 0.1 fa_problem)")
        // A 0.1 caller's struct ends at softmax_scale: the fields after it are not read (here they
        // hold an invalid dtype) and take their defaults.
        let old = call(modified { $0.struct_size = 36; $0.dtype = 99 })
        XCTAssertEqual(old.forward, FA_STATUS_SUCCESS, old.forwardMessage)
        XCTAssertEqual(old.backward, FA_STATUS_SUCCESS, old.backwardMessage)
    }

    /// A larger struct from a newer header is accepted when the bytes past ours are zero (the
    /// newer fields' defaults), and refused naming the first non-zero byte otherwise.
    func testStructSizeAboveOursNeedsAZeroTail() throws {
        let size = MemoryLayout<fa_problem>.size
        let bytes = UnsafeMutableRawBufferPointer.allocate(byteCount: size + 64, alignment: 16)
        defer { bytes.deallocate() }
        bytes.initializeMemory(as: UInt8.self, repeating: 0)
        var p = validProblem()
        p.struct_size = UInt32(size + 64)
        withUnsafeBytes(of: &p) { bytes.copyMemory(from: $0) }
        let pointer = UnsafePointer(bytes.baseAddress!.assumingMemoryBound(to: fa_problem.self))
        XCTAssertNoThrow(try Problem.validate(pointer))
        bytes[size + 10] = 1
        XCTAssertThrowsError(try Problem.validate(pointer)) {
            XCTAssertEqual(($0 as? FlashAttentionError)?.message,
                           "problem->struct_size (\(size + 64)) is above sizeof(fa_problem) (\(size)) of this library, "
                               + "and byte \(size + 10) is not zero: a field of a newer fa_problem that this library "
                               + "does not know is set")
        }
    }

    func testDTypeAndHeadDimV() {
        expect(modified { $0.dtype = 3 }, FA_STATUS_INVALID_ARGUMENT,
               "dtype (3) must be FA_DTYPE_FLOAT16, FA_DTYPE_BFLOAT16 or FA_DTYPE_FLOAT32")
        expect(modified { $0.head_dim_v = 577 }, FA_STATUS_UNSUPPORTED,
               "head_dim_v (577) must be at most fa_max_head_dim() (576)")
        // float32's kernels stop at 256 (their tiles would not fit 32 KiB): rejected before dispatch.
        expect(modified { $0.dtype = FA_DTYPE_FLOAT32.rawValue; $0.head_dim_v = 257 }, FA_STATUS_UNSUPPORTED,
               "head_dim (8) and head_dim_v (257) with dtype float32 must be at most 256: float32 tiles of larger "
                   + "heads do not fit 32 KiB of threadgroup memory; use float16 or bfloat16 (up to "
                   + "fa_max_head_dim(), 576)")
    }

    /// Strides: positive, and written tensors never overlap themselves.
    func testStrides() {
        expect(modified { $0.k = fa_strides(batch: 64, head: -32, seq: 8) }, FA_STATUS_INVALID_ARGUMENT,
               "k strides (64, -32, 8) must not be negative")
        expect(modified { $0.q = fa_strides(batch: 48, head: 0, seq: 8) }, FA_STATUS_INVALID_ARGUMENT,
               "q strides: the head stride (0) must be at least 1 (or all three strides 0 for the contiguous layout)")
        // out rows of 8 elements 4 apart overlap; the same strides are fine for the input q.
        expect(modified { $0.out = fa_strides(batch: 64, head: 16, seq: 4) }, FA_STATUS_INVALID_ARGUMENT,
               "out strides overlap: the seq stride (4) must be at least 8, the elements one step of the smaller "
                   + "axes spans (out is written)")
        let reading = call(modified { $0.q = fa_strides(batch: 64, head: 16, seq: 4) })
        XCTAssertEqual(reading.forward, FA_STATUS_SUCCESS, reading.forwardMessage)
        // (batch, seqlen, heads, head_dim) strides for every tensor: FlashAttention's layout.
        let bshd = call(modified {
            $0.q = fa_strides(batch: 48, head: 8, seq: 16); $0.out = $0.q; $0.dout = $0.q; $0.dq = $0.q
            $0.k = fa_strides(batch: 32, head: 8, seq: 8); $0.v = $0.k; $0.dk = $0.k; $0.dv = $0.k
        })
        XCTAssertEqual(bshd.forward, FA_STATUS_SUCCESS, bshd.forwardMessage)
        XCTAssertEqual(bshd.backward, FA_STATUS_SUCCESS, bshd.backwardMessage)
    }

    func testZeroDimensions() {
        let fields: [(String, WritableKeyPath<fa_problem, UInt32>)] = [
            ("batch", \.batch), ("num_heads", \.num_heads), ("num_kv_heads", \.num_kv_heads),
            ("seqlen_q", \.seqlen_q), ("seqlen_k", \.seqlen_k), ("head_dim", \.head_dim),
        ]
        for (name, field) in fields {
            expect(modified { $0[keyPath: field] = 0 }, FA_STATUS_INVALID_ARGUMENT, "\(name) (0) must be at least 1")
        }
    }

    func testHeadsMustDivide() {
        expect(modified { $0.num_heads = 12; $0.num_kv_heads = 5 }, FA_STATUS_INVALID_ARGUMENT,
               "num_heads (12) must be a multiple of num_kv_heads (5)")
    }

    func testHeadDimAboveTheLimitIsUnsupported() {
        XCTAssertEqual(fa_max_head_dim(), 576)
        expect(modified { $0.head_dim = 577 }, FA_STATUS_UNSUPPORTED,
               "head_dim (577) must be at most fa_max_head_dim() (576)")
        expect(modified { $0.head_dim = UInt32.max }, FA_STATUS_UNSUPPORTED,
               "head_dim (4294967295) must be at most fa_max_head_dim() (576)")
    }

    func testCausalFlag() {
        expect(modified { $0.causal = 2 }, FA_STATUS_INVALID_ARGUMENT, "causal (2) must be 0 or 1")
    }

    func testSoftmaxScaleMustBeFinite() {
        expect(modified { $0.softmax_scale = .nan }, FA_STATUS_INVALID_ARGUMENT, "softmax_scale (nan) must be finite")
        expect(modified { $0.softmax_scale = .infinity }, FA_STATUS_INVALID_ARGUMENT,
               "softmax_scale (inf) must be finite")
        expect(modified { $0.softmax_scale = -.infinity }, FA_STATUS_INVALID_ARGUMENT,
               "softmax_scale (-inf) must be finite")
    }

    /// Sizes whose byte counts overflow a 64-bit size are rejected before any pointer is touched.
    func testElementCountOverflow() {
        expect(modified {
            $0.batch = UInt32.max; $0.num_heads = UInt32.max; $0.num_kv_heads = 1; $0.seqlen_q = UInt32.max
            $0.head_dim = 256
        }, FA_STATUS_INVALID_ARGUMENT, "q has more elements than fit in a 64-bit size")
        expect(modified {
            $0.batch = 1 << 30; $0.num_heads = 1 << 30; $0.num_kv_heads = 1; $0.seqlen_q = 1; $0.head_dim = 4
        }, FA_STATUS_INVALID_ARGUMENT, "q (4611686018427387904 elements) has more bytes than fit in a 64-bit size")
        expect(modified {
            $0.batch = UInt32.max; $0.num_heads = 1; $0.num_kv_heads = 1; $0.seqlen_q = 1
            $0.seqlen_k = UInt32.max; $0.head_dim = 256
        }, FA_STATUS_INVALID_ARGUMENT, "k has more elements than fit in a 64-bit size")
    }

    func testNullBuffers() {
        for name in ["q", "k", "v", "out", "lse"] {
            let r = call(validProblem(), nulls: [name])
            XCTAssertEqual(r.forward, FA_STATUS_INVALID_ARGUMENT, name)
            XCTAssertEqual(r.forwardMessage, "\(name) must not be null")
        }
        for name in ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"] {
            let r = call(validProblem(), nulls: [name])
            XCTAssertEqual(r.backward, FA_STATUS_INVALID_ARGUMENT, name)
            XCTAssertEqual(r.backwardMessage, "\(name) must not be null")
        }
    }

    func testContextCreateErrors() {
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, nil), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()), "out_context must not be null")
        var ctx: OpaquePointer?
        XCTAssertEqual(fa_context_create(fa_backend(rawValue: 7), &ctx), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()),
                       "backend (7) must be FA_BACKEND_AUTO, FA_BACKEND_METAL or FA_BACKEND_CPU")
        XCTAssertNil(ctx)
        #if !canImport(Metal)
        XCTAssertEqual(fa_context_create(FA_BACKEND_METAL, &ctx), FA_STATUS_BACKEND_UNAVAILABLE)
        XCTAssertEqual(String(cString: fa_last_error_message()), "Metal is not available on this platform")
        XCTAssertNil(ctx)
        XCTAssertEqual(fa_context_create(FA_BACKEND_AUTO, &ctx), FA_STATUS_SUCCESS)
        XCTAssertEqual(String(cString: fa_context_backend_name(ctx)), "cpu")
        XCTAssertEqual(String(cString: fa_context_backend_note(ctx)),
                       "the CPU engine runs the kernels: Metal is not available on this platform")
        fa_context_destroy(ctx)
        #endif
    }

    func testContextNames() {
        XCTAssertEqual(String(cString: fa_context_backend_name(context)), "cpu")
        XCTAssertTrue(String(cString: fa_context_device_name(context)).hasPrefix("CPU engine"))
        XCTAssertEqual(String(cString: fa_context_backend_note(context)), "")
        XCTAssertNil(fa_context_backend_name(nil))
        XCTAssertNil(fa_context_device_name(nil))
        XCTAssertNil(fa_context_backend_note(nil))
        fa_context_destroy(nil)
    }

    /// fa_gpu_cores: the CPU context and (off Metal) exported plans plan for the nominal GPU unless
    /// FLASH_ATTENTION_GPU_CORES says otherwise; null outputs are refused by name.
    func testGPUCores() {
        defer { unsetenv(GPUCores.environmentVariable) }
        unsetenv(GPUCores.environmentVariable)
        var cores: UInt32 = 0
        var source: UInt32 = 9
        XCTAssertEqual(fa_gpu_cores(context, &cores, &source), FA_STATUS_SUCCESS)
        XCTAssertEqual([cores, source], [UInt32(FA_NOMINAL_GPU_CORES), FA_GPU_CORES_NOMINAL.rawValue])
        setenv(GPUCores.environmentVariable, "24", 1)
        XCTAssertEqual(fa_gpu_cores(nil, &cores, &source), FA_STATUS_SUCCESS)
        XCTAssertEqual([cores, source], [24, FA_GPU_CORES_OVERRIDE.rawValue])
        XCTAssertEqual(fa_gpu_cores(context, nil, &source), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()), "out_cores must not be null")
        XCTAssertEqual(fa_gpu_cores(context, &cores, nil), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()), "out_source must not be null")
    }

    /// Messages are per thread: a failure on another thread leaves this thread's message alone.
    func testLastErrorIsPerThread() {
        expect(modified { $0.causal = 2 }, FA_STATUS_INVALID_ARGUMENT, "causal (2) must be 0 or 1")
        let other = Thread {
            var ctx: OpaquePointer?
            _ = fa_context_create(fa_backend(rawValue: 9), &ctx)
        }
        other.start()
        while !other.isFinished { usleep(1000) }
        XCTAssertEqual(String(cString: fa_last_error_message()), "causal (2) must be 0 or 1")
    }

    func testStatusNamesAndVersion() {
        XCTAssertEqual(String(cString: fa_status_name(FA_STATUS_UNSUPPORTED)), "FA_STATUS_UNSUPPORTED")
        XCTAssertEqual(String(cString: fa_version()).split(separator: ".").count, 3)
    }
}
