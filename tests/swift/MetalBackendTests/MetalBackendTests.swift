// The Metal backend on the stand-in Metal module (tests/metal_standin/build.sh compiles and runs
// this file; it needs `canImport(Metal)`): the host path in many command buffers and the app path
// (MetalFlashAttention encoding into the caller's command buffer), each bit for bit the CPU backend's.
import CFlashAttentionMetal
import Metal
import XCTest

@testable import FlashAttentionMetal

final class MetalBackendTests: XCTestCase {
    /// For XCTMain: tests/metal_standin/build.sh runs this file without SwiftPM's test discovery.
    static let allTests = [
        ("testCommandBufferPiecesEqualTheCPUBackend", testCommandBufferPiecesEqualTheCPUBackend),
        ("testEncodeForwardEqualsTheCPUBackend", testEncodeForwardEqualsTheCPUBackend),
        ("testBlockPiecesEqualTheCPUBackend", testBlockPiecesEqualTheCPUBackend),
        ("testKVCacheIsBoundInPlace", testKVCacheIsBoundInPlace),
        ("testTensorOpsRouteAndLibrary", testTensorOpsRouteAndLibrary),
        ("testTensorOpsLibraryFromFile", testTensorOpsLibraryFromFile),
        ("testPipelinesNeedEveryFunctionConstant", testPipelinesNeedEveryFunctionConstant),
    ]

    private let shape = AttentionShape(batch: 2, numHeads: 4, numKVHeads: 2, seqlenQ: 19, seqlenK: 23, headDim: 24)

    private func inputs(_ p: Problem, seed: UInt64) -> (q: [Float16], k: [Float16], v: [Float16], dout: [Float16]) {
        var state = seed
        func next(_ count: Int) -> [Float16] {
            (0..<count).map { _ in
                state = state &* 6364136223846793005 &+ 1442695040888963407
                return Float16(Float(Int64(bitPattern: state) >> 40) / Float(1 << 22))
            }
        }
        return (next(BufferRole.q.elementCount(for: p)), next(BufferRole.k.elementCount(for: p)),
                next(BufferRole.k.elementCount(for: p)), next(BufferRole.q.elementCount(for: p)))
    }

    /// Forward then backward through `context`: every output's bits, and each pass's command buffers.
    private func run(_ context: Context, _ p: Problem, seed: UInt64) throws -> (bits: [[UInt32]], pieces: [Int]) {
        let (q, k, v, dout) = inputs(p, seed: seed)
        var out = [Float16](repeating: 0, count: BufferRole.q.elementCount(for: p)), dq = out
        var lse = [Float](repeating: 0, count: p.lseElements)
        var dk = [Float16](repeating: 0, count: BufferRole.k.elementCount(for: p)), dv = dk
        var pieces: [Int] = []
        try q.withUnsafeBytes { q in try k.withUnsafeBytes { k in try v.withUnsafeBytes { v in
            try dout.withUnsafeBytes { dout in try out.withUnsafeMutableBytes { out in
                try lse.withUnsafeMutableBytes { lse in try dq.withUnsafeMutableBytes { dq in
                    try dk.withUnsafeMutableBytes { dk in try dv.withUnsafeMutableBytes { dv in
                        var f = HostBuffers()
                        f.bindInput(.q, q.baseAddress!, for: p)
                        f.bindInput(.k, k.baseAddress!, for: p)
                        f.bindInput(.v, v.baseAddress!, for: p)
                        f.bindOutput(.out, out.baseAddress!, for: p)
                        f.bindOutput(.lse, lse.baseAddress!, for: p)
                        try context.run(.forward, p, buffers: f)
                        pieces.append(context.lastProfile?.commandBuffers ?? 0)
                        var b = f
                        b.bindInput(.out, out.baseAddress!, for: p)
                        b.bindInput(.lse, lse.baseAddress!, for: p)
                        b.bindInput(.dout, dout.baseAddress!, for: p)
                        b.bindOutput(.dq, dq.baseAddress!, for: p)
                        b.bindOutput(.dk, dk.baseAddress!, for: p)
                        b.bindOutput(.dv, dv.baseAddress!, for: p)
                        try context.run(.backward, p, buffers: b)
                        pieces.append(context.lastProfile?.commandBuffers ?? 0)
                    } }
                } }
            } }
        } } }
        let halves = [out, dq, dk, dv].map { $0.map { UInt32($0.bitPattern) } }
        return (halves + [lse.map(\.bitPattern)], pieces)
    }

    /// The host path cut into one command buffer per piece (per KV head, per batch entry, whole)
    /// gives the CPU backend's results bit for bit, and commits as many command buffers as pieces.
    func testCommandBufferPiecesEqualTheCPUBackend() throws {
        for causal in [false, true] {
            let p = try Problem.validate(shape, causal: causal, softmaxScale: nil)
            let reference = try run(Context(backend: try CPUBackend()), p, seed: causal ? 1 : 2)
            let unit = try DispatchPlan.make(.forward, p, device: nil).flopsPerUnit
            for budget in [unit, 2 * unit, MetalBackend.defaultFlopsPerCommandBuffer] {
                let metal = try run(Context(backend: try MetalBackend(flopsPerCommandBuffer: budget)), p,
                                    seed: causal ? 1 : 2)
                XCTAssertEqual(metal.bits, reference.bits, "causal \(causal), \(budget) FLOP per command buffer")
                XCTAssertEqual(metal.pieces, [try DispatchPlan.make(.forward, p, device: nil), try DispatchPlan.make(.backward, p, device: nil)].map {
                    $0.pieces(maxFlops: budget).count
                })
            }
        }
    }

    /// One KV head (a GQA group of 2) of 100 x 90 rows, causal with a window, in budgets below
    /// one unit: every dispatch runs in command buffers of ranges of query or key blocks, each with
    /// its own parameter bytes (`block_offset`), and gives the CPU backend's results bit for bit.
    func testBlockPiecesEqualTheCPUBackend() throws {
        let p = try Problem.validate(AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 100, seqlenK: 90,
                                                    headDim: 24),
                                     causal: true, softmaxScale: nil,
                                     options: AttentionOptions(windowLeft: 40, windowRight: -1))
        let reference = try run(Context(backend: try CPUBackend()), p, seed: 4)
        let unit = try DispatchPlan.make(.forward, p, device: nil).flopsPerUnit
        for budget in [1, unit / 2] {
            let metal = try run(Context(backend: try MetalBackend(flopsPerCommandBuffer: budget)), p, seed: 4)
            XCTAssertEqual(metal.bits, reference.bits, "\(budget) FLOP per command buffer")
            let expected = [try DispatchPlan.make(.forward, p, device: nil), try DispatchPlan.make(.backward, p, device: nil)].map { $0.pieces(maxFlops: budget).count }
            XCTAssertEqual(metal.pieces, expected)
            XCTAssertGreaterThan(expected[0], 1)
        }
    }

    /// The app path: encodeForward into a command buffer the test owns, then commit and wait.
    func testEncodeForwardEqualsTheCPUBackend() throws {
        let device = try XCTUnwrap(MTLCreateSystemDefaultDevice())
        let kernels = try MetalFlashAttention(device: device)
        let p = try Problem.validate(shape, causal: true, softmaxScale: nil)
        let (q, k, v, _) = inputs(p, seed: 3)
        let expected = try FlashAttention(backend: .cpu).forward(q: q, k: k, v: v, shape: shape, causal: true)
        func buffer<T>(_ values: [T]) throws -> MTLBuffer {
            try XCTUnwrap(values.withUnsafeBytes {
                device.makeBuffer(bytes: $0.baseAddress!, length: $0.count, options: .storageModeShared)
            })
        }
        let out = try XCTUnwrap(device.makeBuffer(length: q.count * 2, options: .storageModeShared))
        let lse = try XCTUnwrap(device.makeBuffer(length: p.lseElements * 4, options: .storageModeShared))
        let queue = try XCTUnwrap(device.makeCommandQueue())
        let commandBuffer = try XCTUnwrap(queue.makeCommandBuffer(descriptor: MTLCommandBufferDescriptor()))
        let qBuffer = try buffer(q), kBuffer = try buffer(k), vBuffer = try buffer(v)
        try kernels.encodeForward(into: commandBuffer, q: qBuffer, k: kBuffer, v: vBuffer, out: out, lse: lse,
                                  shape: shape, causal: true)
        commandBuffer.commit()
        commandBuffer.waitUntilCompleted()
        XCTAssertEqual(commandBuffer.status, .completed)
        XCTAssertGreaterThan(commandBuffer.gpuEndTime, commandBuffer.gpuStartTime)
        let outBits = (0..<q.count).map { out.contents().load(fromByteOffset: 2 * $0, as: UInt16.self) }
        let lseBits = (0..<p.lseElements).map { lse.contents().load(fromByteOffset: 4 * $0, as: UInt32.self) }
        XCTAssertEqual(outBits, expected.out.map(\.bitPattern))
        XCTAssertEqual(lseBits, expected.lse.map(\.bitPattern))

        // A committed command buffer is refused before anything is encoded; so is an output that
        // shares memory with an input.
        XCTAssertThrowsError(try kernels.encodeForward(into: commandBuffer, q: qBuffer, k: kBuffer, v: vBuffer,
                                                       out: out, lse: lse, shape: shape)) {
            guard case .invalidArgument(let message)? = $0 as? FlashAttentionError else {
                return XCTFail("\($0)")
            }
            XCTAssertTrue(message.contains("already committed"), message)
        }
        let fresh = try XCTUnwrap(queue.makeCommandBuffer(descriptor: MTLCommandBufferDescriptor()))
        XCTAssertThrowsError(try kernels.encodeForward(into: fresh, q: qBuffer, k: kBuffer, v: vBuffer, out: qBuffer,
                                                       lse: lse, shape: shape)) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .invalidArgument("out shares memory with q: an output may not alias another output or an input"))
        }
    }

    /// The tensor-op route on Metal (docs/tensor-ops.md): an M1's architecture gets no tensor-op
    /// library and the simdgroup kernels; an M5's (the stand-in's FLASH_ATTENTION_METAL_STANDIN_ARCH)
    /// compiles the MSL 4.0 library and takes the tensor-op forward unasked, bit for bit what the CPU
    /// backend gives with the path forced; a tensor-op library that fails to compile loses only that
    /// path, its reason in the backend's note, and FLASH_ATTENTION_TENSOR_OPS=0 forbids it.
    func testTensorOpsRouteAndLibrary() throws {
        defer {
            for name in ["FLASH_ATTENTION_METAL_STANDIN_ARCH", "FLASH_ATTENTION_METAL_STANDIN_FAULT",
                         TensorOps.environmentVariable] {
                unsetenv(name)
            }
        }
        let device = try XCTUnwrap(MTLCreateSystemDefaultDevice())
        let p = try Problem.validate(AttentionShape(batch: 1, numHeads: 2, numKVHeads: 1, seqlenQ: 70, seqlenK: 45,
                                                    headDim: 64),
                                     causal: true, softmaxScale: nil)
        func forwardKernels(_ kernels: MetalFlashAttention) throws -> [String] {
            try DispatchPlan.make(.forward, p, device: kernels.gpuCores, tensorOps: kernels.tensorOps).dispatches
                .map(\.kernelName)
        }
        let m1 = try MetalFlashAttention(device: device)
        XCTAssertFalse(m1.tensorOps.hasUnits || m1.tensorOps.hasKernels, m1.tensorOps.detail)
        XCTAssertEqual(try forwardKernels(m1), ["flash_attention_forward_f16_d64"])

        setenv("FLASH_ATTENTION_METAL_STANDIN_ARCH", "applegpu_g17s", 1)
        let m5 = try MetalFlashAttention(device: device)
        XCTAssertTrue(m5.tensorOps.hasUnits && m5.tensorOps.hasKernels, m5.tensorOps.detail)
        XCTAssertEqual(try forwardKernels(m5), ["flash_attention_forward_tensor_f16_d64"])
        let metal = try run(Context(backend: try MetalBackend()), p, seed: 5)
        setenv(TensorOps.environmentVariable, "1", 1)
        XCTAssertEqual(metal.bits[0], try run(Context(backend: try CPUBackend()), p, seed: 5).bits[0])
        setenv(TensorOps.environmentVariable, "0", 1)
        XCTAssertEqual(try forwardKernels(m5), ["flash_attention_forward_f16_d64"])
        unsetenv(TensorOps.environmentVariable)

        setenv("FLASH_ATTENTION_METAL_STANDIN_FAULT", "compile:tensor", 1)
        let lost = try MetalFlashAttention(device: device)
        XCTAssertTrue(lost.tensorOps.hasUnits)
        XCTAssertFalse(lost.tensorOps.hasKernels)
        XCTAssertTrue(lost.origin.contains("the tensor-op library (MSL 4.0) did not compile"), lost.origin)
        XCTAssertEqual(try forwardKernels(lost), ["flash_attention_forward_f16_d64"])
        setenv(TensorOps.environmentVariable, "1", 1)
        XCTAssertEqual(try forwardKernels(lost), ["flash_attention_forward_f16_d64"])
    }

    /// The tensor-op library from build.sh's .metallib when Metal accepts the file (the stand-in
    /// accepts its own library files only), else from the embedded source; the backend note says
    /// which, and why the file was not used. A refused file and a failed compile lose only the
    /// tensor-op path.
    func testTensorOpsLibraryFromFile() throws {
        defer {
            for name in ["FLASH_ATTENTION_METAL_STANDIN_ARCH", "FLASH_ATTENTION_METAL_STANDIN_FAULT"] { unsetenv(name) }
        }
        setenv("FLASH_ATTENTION_METAL_STANDIN_ARCH", "applegpu_g17s", 1)
        let device = try XCTUnwrap(MTLCreateSystemDefaultDevice())
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("fa-tensor-metallib-\(getpid())")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: folder) }
        let file = folder.appendingPathComponent(PrecompiledShaders.tensorFileName).path
        try "metal-standin-metallib tensor\n".write(toFile: file, atomically: true, encoding: .utf8)

        let loaded = MetalFlashAttention.tensorLibrary(for: device, precompiled: file)
        XCTAssertNotNil(loaded.library)
        XCTAssertTrue(loaded.support.hasUnits && loaded.support.hasKernels, loaded.support.detail)
        XCTAssertEqual(loaded.origin, "tensor-op kernels from \(file)")
        // The file needs no compiler: a source compile that would fail is never tried.
        setenv("FLASH_ATTENTION_METAL_STANDIN_FAULT", "compile:tensor", 1)
        XCTAssertNotNil(MetalFlashAttention.tensorLibrary(for: device, precompiled: file).library)
        unsetenv("FLASH_ATTENTION_METAL_STANDIN_FAULT")

        try "not a library\n".write(toFile: file, atomically: true, encoding: .utf8)
        let compiled = MetalFlashAttention.tensorLibrary(for: device, precompiled: file)
        XCTAssertNotNil(compiled.library)
        let origin = try XCTUnwrap(compiled.origin)
        XCTAssertTrue(origin.hasPrefix("tensor-op kernels compiled from the embedded source at MSL 4.0 (\(file) was "
                                       + "refused: "), origin)
        let absent = try XCTUnwrap(MetalFlashAttention.tensorLibrary(for: device, precompiled: nil).origin)
        XCTAssertTrue(absent.contains("no \(PrecompiledShaders.tensorFileName) for this OS"), absent)

        setenv("FLASH_ATTENTION_METAL_STANDIN_FAULT", "compile:tensor", 1)
        let lost = MetalFlashAttention.tensorLibrary(for: device, precompiled: file)
        XCTAssertNil(lost.library)
        XCTAssertTrue(lost.support.hasUnits && !lost.support.hasKernels)
        let why = try XCTUnwrap(lost.origin)
        XCTAssertTrue(why.hasPrefix("no tensor-op kernels: the tensor-op library (MSL 4.0) did not compile: ")
                      && why.contains("\(file) was refused"), why)
        XCTAssertTrue(lost.support.detail.contains("did not compile"), lost.support.detail)
    }

    /// Metal builds a pipeline only from a function specialised with a value for every function
    /// constant it uses (developer.apple.com/documentation/metal/mtllibrary/makefunction(name:) and
    /// .../makefunction(name:constantvalues:)); the stand-in now refuses the others as Metal does,
    /// and the backend's pipelines, made from the plan's specialisation, pass.
    func testPipelinesNeedEveryFunctionConstant() throws {
        let device = try XCTUnwrap(MTLCreateSystemDefaultDevice())
        let options = MTLCompileOptions()
        options.languageVersion = .version3_1
        let library = try device.makeLibrary(source: EmbeddedShaders.source, options: options)
        let name = "flash_attention_forward_f16_d64"
        let unspecialised = try XCTUnwrap(library.makeFunction(name: name))
        XCTAssertThrowsError(try device.makeComputePipelineState(function: unspecialised))
        XCTAssertThrowsError(try library.makeFunction(name: name, constantValues: MTLFunctionConstantValues()))
        // A kernel without function constants (the merge) needs none.
        let merge = try XCTUnwrap(library.makeFunction(name: "flash_attention_merge_f16"))
        XCTAssertNoThrow(try device.makeComputePipelineState(function: merge))

        let p = try Problem.validate(shape, causal: true, softmaxScale: nil)
        let kernels = try MetalFlashAttention(device: device)
        for pass in [Pass.forward, .backward] {
            for dispatch in try DispatchPlan.make(pass, p, device: kernels.gpuCores).dispatches {
                XCTAssertNoThrow(try kernels.checkedPipeline(for: dispatch), dispatch.kernelName)
            }
        }
    }

    /// A KV cache (a read-write role) on page-aligned memory is bound in place even though its
    /// bytes (12 KiB) are not a page multiple: its MTLBuffer is the caller's memory, rounded up to
    /// the page, and nothing is copied back to it; q, not page-aligned, is copied. One page off,
    /// or with copies forced (the page-fault retry), the cache is copied in once.
    func testKVCacheIsBoundInPlace() throws {
        var d = fa_problem()
        d.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (d.batch, d.num_heads, d.num_kv_heads, d.seqlen_q, d.seqlen_k, d.head_dim) = (1, 4, 2, 3, 40, 64)
        (d.kv_cache_rows, d.kv_max_blocks, d.kv_num_blocks) = (16, 3, 3)
        d.kv_block_table = UnsafePointer(bitPattern: 4)
        let p = try Problem.validate(d)
        let plan = try DispatchPlan.make(.forward, p, device: nil)
        let page = AttentionKVCache.pageBytes
        XCTAssertNotEqual(BufferRole.k.byteCount(for: p) % page, 0)
        let memory = try AttentionKVCache.allocate(byteCount: 8 * page)
        defer { AttentionKVCache.deallocate(memory) }
        memory.initializeMemory(as: UInt8.self, repeating: 0)
        let base = memory.baseAddress!
        func wrapped(cacheAt offset: Int, copyInputs: Bool = false) throws
            -> (metal: [BufferRole: MTLBuffer], copyBack: [(role: BufferRole, buffer: MTLBuffer)], wrappedInputs: Bool) {
            var b = HostBuffers()
            b.bindInput(.k, base + offset, for: p)
            b.bindInput(.v, base + offset + 2 * page, for: p)
            b.bindInput(.q, base + 6 * page + 16, for: p)
            b.bindInput(.blockTable, base + 7 * page, for: p)
            b.bindOutput(.out, base + 5 * page, for: p)
            b.bindOutput(.lse, base + 7 * page + 64, for: p)
            return try MetalBackend().wrap(b, for: plan, copyInputs: copyInputs)
        }
        let inPlace = try wrapped(cacheAt: 0)
        for (role, offset) in [(BufferRole.k, 0), (.v, 2 * page)] {
            let buffer = try XCTUnwrap(inPlace.metal[role])
            XCTAssertEqual(buffer.contents(), base + offset, "\(role) bound in place")
            XCTAssertEqual(buffer.length, page)
        }
        XCTAssertNotEqual(inPlace.metal[.q]?.contents(), base + 6 * page + 16)
        XCTAssertEqual(inPlace.copyBack.map(\.role), [.out, .lse])
        XCTAssertTrue(inPlace.wrappedInputs)
        for copied in [try wrapped(cacheAt: 64), try wrapped(cacheAt: 0, copyInputs: true)] {
            XCTAssertNotEqual(copied.metal[.k]?.contents(), base + 64)
            XCTAssertNotEqual(copied.metal[.k]?.contents(), base)
            XCTAssertEqual(copied.metal[.k]?.length, BufferRole.k.byteCount(for: p))
            XCTAssertEqual(copied.copyBack.map(\.role), [.out, .lse])
        }
    }
}
