import MSLEngine
import MSLEngineTestKernels
import XCTest

/// Function constants (msl_engine_dispatch_specialized): a kernel reads the dispatch's values; a
/// read of one the dispatch does not set, or sets with another type, fails the dispatch with a
/// message naming the constant (Metal refuses such a pipeline), never a default; a bad list is an
/// invalid dispatch; the stats say which constants were read.
final class FunctionConstantTests: XCTestCase {
    private let threads: UInt32 = 40

    private func bool(_ index: UInt32, _ value: Bool) -> msl_engine_function_constant {
        msl_engine_function_constant(index: index, type: MSL_ENGINE_CONSTANT_BOOL.rawValue, value: value ? 1 : 0)
    }

    private func uint(_ index: UInt32, _ value: UInt32) -> msl_engine_function_constant {
        msl_engine_function_constant(index: index, type: MSL_ENGINE_CONSTANT_UINT.rawValue, value: value)
    }

    /// function_constant_reader with `constants`; its output and the dispatch's outcome.
    private func run(_ constants: [msl_engine_function_constant]) -> (DispatchResult, [UInt32]) {
        msl_engine_test_kernels_register()
        let out = HostBuffer<UInt32>(count: Int(threads), zero: 0xFFFF_FFFF)
        var message = [CChar](repeating: 0, count: 2048)
        let buffers = [out.binding]
        let status = withExtendedLifetime(out) {
            constants.withUnsafeBufferPointer { c in
                msl_engine_dispatch_specialized("function_constant_reader", buffers, 1, c.baseAddress,
                                                UInt32(c.count), msl_engine_size(width: 1, height: 1, depth: 1),
                                                msl_engine_size(width: threads, height: 1, depth: 1), nil, 0,
                                                &message, message.count)
            }
        }
        var stats = msl_engine_dispatch_stats()
        msl_engine_last_dispatch_stats(&stats)
        return (DispatchResult(status: status, message: String(cString: message), stats: stats), out.values)
    }

    func testTheKernelReadsTheDispatchsValues() {
        let (on, out) = run([uint(5, 1000), bool(0, true)])
        XCTAssertEqual(on.status, MSL_ENGINE_SUCCESS, on.message)
        XCTAssertEqual(out, (0..<threads).map { 1000 + $0 })
        XCTAssertEqual(on.stats.function_constants_read, 0b11, "both read")

        let (off, plain) = run([bool(0, false), uint(5, 1000)])
        XCTAssertEqual(off.status, MSL_ENGINE_SUCCESS, off.message)
        XCTAssertEqual(plain, Array(0..<threads))
        XCTAssertEqual(off.stats.function_constants_read, 0b01, "fc_count is not read when fc_use_count is false")
    }

    /// Reading a constant the dispatch lacks is an error naming it; a constant that is never read
    /// may be absent (the engine finds a missing constant when a thread reads it).
    func testReadingAnUnsetConstantFailsTheDispatch() {
        let (missing, _) = run([bool(0, true)])
        assertFailure(missing, MSL_ENGINE_FUNCTION_CONSTANT_UNSET, kernel: "function_constant_reader", sites: [])
        XCTAssertTrue(missing.message.contains("function constant 'fc_count' (index 5, uint), which the dispatch "
                                                   + "does not set"), missing.message)
        XCTAssertEqual(missing.stats.threadgroups, 0)

        let (unread, out) = run([bool(0, false)])
        XCTAssertEqual(unread.status, MSL_ENGINE_SUCCESS, unread.message)
        XCTAssertEqual(out, Array(0..<threads))

        let buffer = HostBuffer<UInt32>(count: Int(threads), zero: 0)
        let none = withExtendedLifetime(buffer) {
            dispatch("function_constant_reader", [buffer.binding], threads: (threads, 1, 1))
        }
        assertFailure(none, MSL_ENGINE_FUNCTION_CONSTANT_UNSET, kernel: "function_constant_reader", sites: [])
        XCTAssertTrue(none.message.contains("'fc_use_count' (index 0, bool)"), none.message)
    }

    /// Each dispatch reads its own constants: values a worker cached for an earlier dispatch are
    /// neither reused nor taken for set.
    func testAnEarlierDispatchsConstantsAreNotReused() {
        let (first, out) = run([uint(5, 1000), bool(0, true)])
        XCTAssertEqual(first.status, MSL_ENGINE_SUCCESS, first.message)
        XCTAssertEqual(out, (0..<threads).map { 1000 + $0 })
        let (second, changed) = run([bool(0, true), uint(5, 7)])
        XCTAssertEqual(second.status, MSL_ENGINE_SUCCESS, second.message)
        XCTAssertEqual(changed, (0..<threads).map { 7 + $0 })
        let (missing, _) = run([bool(0, true)])
        assertFailure(missing, MSL_ENGINE_FUNCTION_CONSTANT_UNSET, kernel: "function_constant_reader", sites: [])
        let (retyped, _) = run([bool(0, true), bool(5, true)])
        assertFailure(retyped, MSL_ENGINE_FUNCTION_CONSTANT_UNSET, kernel: "function_constant_reader", sites: [])
        XCTAssertTrue(retyped.message.contains("'fc_count' (index 5) as uint, but the dispatch sets it as bool"),
                      retyped.message)
    }

    func testAConstantSetWithAnotherTypeFailsTheDispatch() {
        let (result, _) = run([uint(0, 1), uint(5, 3)])
        assertFailure(result, MSL_ENGINE_FUNCTION_CONSTANT_UNSET, kernel: "function_constant_reader", sites: [])
        XCTAssertTrue(result.message.contains("reads function constant 'fc_use_count' (index 0) as bool, but the "
                                                  + "dispatch sets it as uint"), result.message)
    }

    func testBadListsAreInvalidDispatches() {
        let cases: [([msl_engine_function_constant], String)] = [
            ([bool(0, true), uint(0, 1)], "function constant 0 is set twice"),
            ([msl_engine_function_constant(index: 0, type: MSL_ENGINE_CONSTANT_BOOL.rawValue, value: 2)],
             "bool function constant 0 has value 2; a bool is 0 or 1"),
            ([msl_engine_function_constant(index: 0, type: 7, value: 0)], "function constant 0 has unknown type 7"),
            ((0..<33).map { uint($0, 0) }, "33 function constants; at most 32 are allowed"),
        ]
        for (constants, text) in cases {
            let (result, out) = run(constants)
            XCTAssertEqual(result.status, MSL_ENGINE_INVALID_DISPATCH, result.message)
            XCTAssertTrue(result.message.contains(text), result.message)
            XCTAssertTrue(out.allSatisfy { $0 == 0xFFFF_FFFF }, "nothing ran")
        }
    }
}
