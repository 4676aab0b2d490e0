import CFlashAttentionMetal
import XCTest

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A fuzz target over the C ABI's validation: random `fa_problem`s (every field, valid-looking and
/// not: dimensions, dtypes, strides, flags, window, softcap and scale including NaN and infinities,
/// masks, ALiBi, sinks, KV caches with random block tables, variable-length batches with random
/// cu_seqlens) through `fa_plan_create`, `fa_forward` and `fa_backward`. Every buffer ends at a
/// PROT_NONE guard page, so a read or write past it faults even without AddressSanitizer; tables
/// (cu_seqlens, block tables) are exactly as long as the problem says. Each call must return
/// FA_STATUS_SUCCESS or a named error with a message; never crash, hang or touch memory out of bounds
/// (the sanitized run, tests/run_sanitized.sh, runs it under ASan and UBSan).
///
/// Time-bounded: `FA_FUZZ_SECONDS` (default 2; run_sanitized.sh sets 40); `FA_FUZZ_SEED` (default 1,
/// so that CI replays a prefix of a sequence that passed for 75 s; pass another for new ground)
/// replays a run (the seed is in every failure message). A longer run: docs/testing.md ("Fuzzing the C ABI").
/// A small deterministic generator (SplitMix64), so that a seed replays a run.
private struct Random {
    var state: UInt64
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476C_E484_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
    mutating func below(_ n: UInt64) -> UInt64 { next() % n }
    mutating func chance(_ percent: UInt64) -> Bool { below(100) < percent }
    /// Mostly small values, sometimes 0, the limits or anything.
    mutating func dimension(_ small: UInt64) -> UInt32 {
        switch below(20) {
        case 0: return 0
        case 1: return UInt32.max
        case 2: return UInt32(truncatingIfNeeded: next())
        case 3: return 1 << UInt32(below(32))
        default: return UInt32(1 + below(small))
        }
    }
    mutating func float() -> Float {
        let specials: [Float] = [.nan, .infinity, -.infinity, 0, -0.0, .greatestFiniteMagnitude, .leastNonzeroMagnitude, -1]
        return chance(25) ? specials[Int(below(UInt64(specials.count)))] : Float(Int(below(2000)) - 1000) / 100
    }
    mutating func int32() -> Int32 {
        chance(70) ? Int32(below(48)) - 2 : Int32(truncatingIfNeeded: next())
    }
    mutating func pick<T>(_ options: [T]) -> T { options[Int(below(UInt64(options.count)))] }
    mutating func strides() -> fa_strides {
        if chance(60) { return fa_strides() }
        var s: [Int64] = []
        for _ in 0..<3 { s.append(chance(10) ? Int64(bitPattern: next()) : Int64(below(4096)) - (chance(5) ? 8 : 0)) }
        return fa_strides(batch: s[0], head: s[1], seq: s[2])
    }
}


final class CABIFuzzTests: XCTestCase {
    /// `bytes` of memory whose last byte is followed by a PROT_NONE page.
    private final class Guarded {
        let base: UnsafeMutableRawPointer
        let mapped: Int
        let start: UnsafeMutableRawPointer

        init(bytes: Int) {
            let page = Int(sysconf(Int32(_SC_PAGESIZE)))
            let body = (bytes + page - 1) / page * page
            mapped = body + page
            base = mmap(nil, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0)!
            mprotect(base + body, page, PROT_NONE)
            start = base + (body - bytes)
            memset(start, 0, bytes)
        }

        deinit { munmap(base, mapped) }
    }

    /// Elements of every tensor buffer: enough for any contiguous layout of the small dimensions
    /// the generator favours (4 x 8 x 48 x 600) and the strides it draws below 4096.
    private static let tensorElements = 1 << 18

    func testRandomProblemsGetSuccessOrANamedError() throws {
        let environment = ProcessInfo.processInfo.environment
        let seconds = Double(environment["FA_FUZZ_SECONDS"] ?? "") ?? 2
        let seed = UInt64(environment["FA_FUZZ_SEED"] ?? "") ?? 1
        var random = Random(state: seed)
        var context: OpaquePointer?
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &context), FA_STATUS_SUCCESS)
        defer { fa_context_destroy(context) }
        let tensors = (0..<10).map { _ in Guarded(bytes: Self.tensorElements * 4) }
        let deadline = Date().addingTimeInterval(seconds)
        var calls = 0, successes = 0
        while Date() < deadline {
            var keep: [Guarded] = []
            var p = randomProblem(&random, tensors: tensors, keep: &keep)
            let (status, message) = call(&random, &p, context: context, tensors: tensors)
            calls += 1
            if status == FA_STATUS_SUCCESS {
                successes += 1
            } else {
                let name = String(cString: fa_status_name(status))
                XCTAssertTrue(name.hasPrefix("FA_STATUS_") && name != "FA_STATUS_INTERNAL_ERROR",
                              "seed \(seed), call \(calls): \(name): \(message)")
                XCTAssertFalse(message.isEmpty, "seed \(seed), call \(calls): \(name) without a message")
            }
            if !(status == FA_STATUS_SUCCESS || status == FA_STATUS_INVALID_ARGUMENT
                    || status == FA_STATUS_UNSUPPORTED || status == FA_STATUS_OUT_OF_MEMORY) {
                XCTFail("seed \(seed), call \(calls): \(String(cString: fa_status_name(status))): \(message)")
            }
            withExtendedLifetime(keep) {}
        }
        XCTAssertGreaterThan(calls, 0, "seed \(seed)")
        print("CABIFuzzTests: seed \(seed), \(calls) calls in \(seconds) s, \(successes) successful")
    }

    /// One call of a random entry point on `p`; its status and message.
    private func call(_ random: inout Random, _ p: inout fa_problem, context: OpaquePointer?,
                      tensors: [Guarded]) -> (fa_status, String) {
        let t = tensors.map { $0.start }
        let lse = t[4].assumingMemoryBound(to: Float.self)
        let executable = Self.fits(p)
        let status: fa_status = withUnsafePointer(to: &p) { problem in
            switch executable ? random.below(3) : 0 {
            case 0:
                var plan: OpaquePointer?
                let s = fa_plan_create(problem, random.chance(50) ? FA_PASS_FORWARD : FA_PASS_BACKWARD, 0, &plan)
                fa_plan_destroy(plan)
                return s
            case 1:
                return fa_forward(context, problem, t[0], t[1], t[2], t[3], lse)
            default:
                return fa_backward(context, problem, t[5], t[0], t[1], t[2], t[3], lse, t[6], t[7], t[8])
            }
        }
        return (status, String(cString: fa_last_error_message()))
    }

    /// Whether every tensor and table `p` declares lies inside the fuzz's buffers, so that the
    /// entry points that read memory may be called (the library cannot know a buffer's size: a
    /// shape larger than the memory passed is the caller's error). Others go to fa_plan_create only,
    /// which reads no memory. Also keeps executed problems small (the CPU engine under ASan).
    private static func fits(_ p: fa_problem) -> Bool {
        let known = UInt32(MemoryLayout<fa_problem>.size)
        guard p.struct_size == known else { return false }
        let dims = [p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.kv_cache_rows, p.kv_max_blocks,
                    p.kv_num_blocks, p.max_seqlen_q, p.max_seqlen_k].map(UInt64.init)
        let width = UInt64(max(p.head_dim, p.head_dim_v))
        guard dims.allSatisfy({ $0 <= 64 }), width <= 600 else { return false }
        let rows = max(UInt64(p.seqlen_q), UInt64(p.seqlen_k), UInt64(p.kv_cache_rows) * max(UInt64(p.kv_max_blocks), 1))
        let leading = max(UInt64(p.batch), UInt64(p.kv_num_blocks)) * max(UInt64(p.num_heads), UInt64(p.num_kv_heads))
        guard leading * rows * width <= UInt64(tensorElements) / 2,
              UInt64(p.batch) * UInt64(p.num_heads) * UInt64(p.seqlen_q) * UInt64(p.seqlen_k) * width <= 1 << 21
        else { return false }
        let all = [p.q, p.k, p.v, p.out, p.dout, p.dq, p.dk, p.dv, p.attn_mask_strides]
        let span = { (s: fa_strides) in UInt64(clamping: s.batch) + UInt64(clamping: s.head) + UInt64(clamping: s.seq) }
        guard all.allSatisfy({ $0.batch >= 0 && $0.head >= 0 && $0.seq >= 0 && $0.batch < 4096 && $0.head < 4096
                && $0.seq < 4096 }) else { return false }
        // Each tensor's last element: at most (every dimension - 1) x the sum of its strides + width.
        let largest = max(dims.max()!, UInt64(p.seqlen_k) + 1)
        guard all.allSatisfy({ largest * span($0) + max(width, largest) <= UInt64(tensorElements) / 2 }) else { return false }
        return true
    }

    /// A random problem over `tensors`; the tables it points to are appended to `keep`, each exactly
    /// as long as the problem's fields say, ending at a guard page.
    private func randomProblem(_ r: inout Random, tensors: [Guarded], keep: inout [Guarded]) -> fa_problem {
        var p = fa_problem()
        p.struct_size = r.chance(95) ? UInt32(MemoryLayout<fa_problem>.size) : UInt32(r.below(UInt64(MemoryLayout<fa_problem>.size)))
        p.batch = r.dimension(4)
        p.num_kv_heads = r.dimension(4)
        p.num_heads = r.chance(80) && p.num_kv_heads < 5 ? p.num_kv_heads * UInt32(1 + r.below(3)) : r.dimension(8)
        p.seqlen_q = r.dimension(40)
        p.seqlen_k = r.dimension(48)
        p.head_dim = r.chance(10) ? r.dimension(700) : r.pick([8, 16, 32, 64, 1, 33] as [UInt32])
        p.head_dim_v = r.chance(80) ? 0 : r.dimension(600)
        p.causal = r.chance(90) ? UInt32(r.below(2)) : r.dimension(4)
        p.softmax_scale = r.chance(80) ? 0.125 : r.float()
        p.dtype = r.chance(90) ? UInt32(r.below(3)) : r.dimension(8)
        if r.chance(20) {
            (p.q, p.k, p.v, p.out) = (r.strides(), r.strides(), r.strides(), r.strides())
            (p.dout, p.dq, p.dk, p.dv) = (r.strides(), r.strides(), r.strides(), r.strides())
        }
        if r.chance(25) {
            p.use_window = r.chance(90) ? 1 : r.dimension(4)
            (p.window_left, p.window_right) = (r.int32(), r.int32())
        }
        if r.chance(15) { p.softcap = r.float() }
        if r.chance(15) {
            p.attn_mask_type = r.chance(90) ? UInt32(r.below(4)) : r.dimension(8)
            p.attn_mask = r.chance(90) ? UnsafeRawPointer(tensors[9].start) : nil
            p.attn_mask_strides = r.strides()
        }
        if r.chance(15) {
            p.alibi_slopes = UnsafePointer(tensors[9].start.assumingMemoryBound(to: Float.self))
            p.alibi_per_batch = r.chance(90) ? UInt32(r.below(2)) : r.dimension(4)
        }
        if r.chance(15) {
            p.sinks = UnsafePointer(tensors[9].start.assumingMemoryBound(to: Float.self))
            p.dsinks = r.chance(80) ? tensors[9].start.assumingMemoryBound(to: Float.self) + 4096 : nil
        }
        if r.chance(20) {
            p.kv_cache_rows = r.dimension(16)
            p.kv_bits = r.chance(70) ? 0 : r.pick([4, 8, 3] as [UInt32])
            p.kv_group_size = r.pick([32, 64, 128, 7] as [UInt32])
            if r.chance(60) {
                p.kv_max_blocks = r.dimension(6)
                p.kv_num_blocks = r.dimension(6)
                let entries = Int(min(UInt64(p.batch) * UInt64(p.kv_max_blocks), 4096))
                let table = Guarded(bytes: max(entries, 1) * 4)
                let values = table.start.assumingMemoryBound(to: Int32.self)
                for i in 0..<entries { values[i] = r.int32() }
                keep.append(table)
                p.kv_block_table = UnsafePointer(values)
            }
            if p.kv_bits != 0 {
                let scales = UnsafeRawPointer(tensors[9].start)
                (p.k_scales, p.k_biases, p.v_scales, p.v_biases) = (scales, scales, scales, scales)
            }
        }
        if r.chance(20) {
            p.max_seqlen_q = r.dimension(40)
            p.max_seqlen_k = r.dimension(48)
            let entries = Int(min(UInt64(p.batch) + 1, 4096))
            for side in 0..<2 where r.chance(95) {
                let table = Guarded(bytes: entries * 4)
                let values = table.start.assumingMemoryBound(to: Int32.self)
                var total: Int32 = 0
                for i in 0..<entries {
                    values[i] = r.chance(85) ? total : r.int32()
                    total += Int32(r.below(20))
                }
                keep.append(table)
                if side == 0 { p.cu_seqlens_q = UnsafePointer(values) } else { p.cu_seqlens_k = UnsafePointer(values) }
            }
        }
        return p
    }
}
