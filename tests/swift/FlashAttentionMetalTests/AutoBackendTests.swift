import XCTest

@testable import FlashAttentionMetal

/// `auto` never fails where the CPU engine works: it falls back when Metal cannot be set up, runs a
/// plan whose pipelines Metal cannot build on the CPU engine, and leaves Metal for good once the
/// device is lost, saying why in the note each time. (A stand-in plays Metal here.)
final class AutoBackendTests: XCTestCase {
    // 65 rows: the dense forward (up to 64 the plan may take the split-KV or decode kernels).
    private let problem = try! Problem.validate(AttentionShape(batch: 1, numHeads: 2, seqlenQ: 65, headDim: 8),
                                                causal: false, softmaxScale: nil)
    /// A token nobody cancels.
    private let cancellation = Cancellation()
    private var token: CancellationToken { cancellation.token() }

    func testNoMetalMeansTheCPUEngineWithTheReason() throws {
        let auto = try AutoBackend { throw FlashAttentionError.backendUnavailable("no Metal device found") }
        XCTAssertEqual(auto.name.description, "cpu")
        XCTAssertTrue(auto.deviceName.hasPrefix("CPU engine"))
        XCTAssertEqual(auto.note, "the CPU engine runs the kernels: no Metal device found")
        let shaders = try AutoBackend { throw FlashAttentionError.executionFailed("the shaders do not compile") }
        XCTAssertEqual(shaders.name.description, "cpu")
        XCTAssertEqual(shaders.note, "the CPU engine runs the kernels: the shaders do not compile")
    }

    func testAPlanMetalCannotBuildRunsOnTheCPU() throws {
        let metal = StandInMetal()
        metal.refuse = .executionFailed("Metal could not build the pipeline of flash_attention_forward_f16_d32: X")
        let auto = try AutoBackend { metal }
        XCTAssertEqual(auto.note, "kernels from a stand-in")
        let forward = DispatchPlan.forward(problem)
        let memory = ZeroBuffers(problem)
        let profile = try auto.execute(forward, buffers: memory.buffers, cancellation: token)
        XCTAssertEqual(metal.executed, 0)
        XCTAssertGreaterThan(profile.dispatches.first?.simdgroupMultiplyAccumulates ?? 0, 0, "the CPU engine ran it")
        XCTAssertEqual(auto.name.description, "metal", "other plans stay on Metal")
        XCTAssertEqual(auto.note, "kernels from a stand-in; the CPU engine runs flash_attention_forward_f16_d32: Metal "
                       + "could not build the pipeline of flash_attention_forward_f16_d32: X")
        XCTAssertTrue(memory.lse.allSatisfy { abs($0 - log(65)) < 1e-5 }, "zero scores over 65 keys: lse = log 65")
        metal.refuse = nil
        _ = try auto.execute(forward, buffers: memory.buffers, cancellation: token)
        XCTAssertEqual(metal.executed, 1)
    }

    func testALostDeviceMovesEveryLaterCallToTheCPU() throws {
        let metal = StandInMetal()
        let auto = try AutoBackend { metal }
        _ = try auto.execute(DispatchPlan.forward(problem), buffers: HostBuffers(), cancellation: token)
        XCTAssertEqual(metal.executed, 1)
        metal.refuse = .backendUnavailable("access to the GPU was revoked")
        XCTAssertThrowsError(try auto.execute(DispatchPlan.backward(problem), buffers: HostBuffers(),
                                              cancellation: token))
        metal.refuse = nil
        XCTAssertEqual(auto.name.description, "cpu")
        XCTAssertTrue(auto.deviceName.hasPrefix("CPU engine"))
        XCTAssertEqual(auto.note, "the CPU engine runs the kernels since Metal became unusable: access to the GPU "
                       + "was revoked")
        let memory = ZeroBuffers(problem)
        _ = try auto.execute(DispatchPlan.forward(problem), buffers: memory.buffers, cancellation: token)
        XCTAssertEqual(metal.executed, 1, "Metal is not asked again")
        XCTAssertTrue(memory.lse.allSatisfy { abs($0 - log(65)) < 1e-5 }, "the CPU engine ran it")
    }
}

/// Zero-filled memory for q, k, v, out and lse of `problem` (MHA: every half buffer has the same size).
private final class ZeroBuffers {
    private let halves: UnsafeMutableBufferPointer<UInt16>
    private let floats: UnsafeMutableBufferPointer<Float>
    private(set) var buffers = HostBuffers()

    init(_ problem: Problem) {
        halves = .allocate(capacity: 4 * BufferRole.q.elementCount(for: problem))
        halves.initialize(repeating: 0)
        floats = .allocate(capacity: problem.lseElements)
        floats.initialize(repeating: .nan)
        for (n, role) in [BufferRole.q, .k, .v, .out].enumerated() {
            buffers.bindOutput(role, halves.baseAddress! + n * BufferRole.q.elementCount(for: problem), for: problem)
        }
        buffers.bindOutput(.lse, floats.baseAddress!, for: problem)
    }

    deinit {
        halves.deallocate()
        floats.deallocate()
    }

    var lse: [Float] { Array(floats) }
}

/// Plays the Metal backend: refuses plans in `prepare` when told to, counts the plans it runs.
private final class StandInMetal: ExecutionBackend {
    let name: StaticString = "metal"
    let deviceName = "Stand-in GPU"
    let note = "kernels from a stand-in"
    var refuse: FlashAttentionError?
    var executed = 0

    func prepare(_ plan: DispatchPlan) throws {
        if let refuse { throw refuse }
    }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        executed += 1
        return Profile(seconds: 0, dispatches: [])
    }
}
