import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The dispatch plan through the C ABI (fa_plan_*): the records say what the plan says, pieces bind
/// at their offsets, fa_plan_execute on the CPU engine gives fa_forward's and fa_backward's bits,
/// and every misuse is a named error.
final class ExportedPlanTests: XCTestCase {
    private var ctx: OpaquePointer?

    override func setUpWithError() throws {
        XCTAssertEqual(fa_context_create(FA_BACKEND_CPU, &ctx), FA_STATUS_SUCCESS)
    }

    override func tearDown() { fa_context_destroy(ctx) }

    /// 2 batch entries, 6 query heads over 3 KV heads, causal, head_dim 40 (bucket 64).
    private func descriptor(seqlenQ: UInt32 = 37, seqlenK: UInt32 = 29, sinks: Bool = false) -> fa_problem {
        var p = fa_problem()
        p.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim) = (2, 6, 3, seqlenQ, seqlenK, 40)
        (p.causal, p.softmax_scale) = (1, 0.2)
        if sinks {
            // Presence only: fa_plan_create never reads through it.
            p.sinks = UnsafePointer(bitPattern: 1)
        }
        return p
    }

    private func create(_ problem: fa_problem, _ pass: fa_pass, maxFlops: UInt64 = 0) throws -> OpaquePointer {
        var p = problem
        var plan: OpaquePointer?
        let status = fa_plan_create(&p, pass, maxFlops, &plan)
        XCTAssertEqual(status, FA_STATUS_SUCCESS, String(cString: fa_last_error_message()))
        return try XCTUnwrap(plan)
    }

    private func info(_ plan: OpaquePointer) -> fa_plan_info {
        var i = fa_plan_info()
        i.struct_size = UInt32(MemoryLayout<fa_plan_info>.size)
        XCTAssertEqual(fa_plan_get_info(plan, &i), FA_STATUS_SUCCESS)
        return i
    }

    private func dispatch(_ plan: OpaquePointer, _ n: UInt32) -> fa_plan_dispatch {
        var d = fa_plan_dispatch()
        d.struct_size = UInt32(MemoryLayout<fa_plan_dispatch>.size)
        XCTAssertEqual(fa_plan_get_dispatch(plan, n, &d), FA_STATUS_SUCCESS)
        return d
    }

    private func bindings(_ plan: OpaquePointer, _ n: UInt32) -> [fa_plan_binding] {
        (0..<dispatch(plan, n).binding_count).map { i in
            var b = fa_plan_binding()
            b.struct_size = UInt32(MemoryLayout<fa_plan_binding>.size)
            XCTAssertEqual(fa_plan_get_binding(plan, n, i, &b), FA_STATUS_SUCCESS)
            return b
        }
    }

    /// The specialisation records of dispatch `n`, as Swift values.
    private func specializations(_ plan: OpaquePointer, _ n: UInt32) -> [SpecializationConstant] {
        (0..<dispatch(plan, n).specialization_count).map { i in
            var s = fa_plan_specialization()
            s.struct_size = UInt32(MemoryLayout<fa_plan_specialization>.size)
            XCTAssertEqual(fa_plan_get_specialization(plan, n, i, &s), FA_STATUS_SUCCESS)
            return SpecializationConstant(name: String(cString: s.name), index: Int(s.index),
                                          type: s.type == FA_SPECIALIZATION_BOOL.rawValue ? .bool : .uint32,
                                          value: s.value)
        }
    }

    private func buffers(_ plan: OpaquePointer) -> [fa_plan_buffer] {
        (0..<info(plan).buffer_count).map { i in
            var b = fa_plan_buffer()
            b.struct_size = UInt32(MemoryLayout<fa_plan_buffer>.size)
            XCTAssertEqual(fa_plan_get_buffer(plan, i, &b), FA_STATUS_SUCCESS)
            return b
        }
    }

    /// The records of `plan` equal the Swift plan `expected`, field by field (one piece).
    private func assertRecords(_ plan: OpaquePointer, equal expected: DispatchPlan,
                               file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertEqual(info(plan).dispatch_count, UInt32(expected.dispatches.count), file: file, line: line)
        XCTAssertEqual(info(plan).piece_count, 1, file: file, line: line)
        for (n, want) in expected.dispatches.enumerated() {
            let d = dispatch(plan, UInt32(n))
            XCTAssertEqual(String(cString: d.kernel_name), want.kernelName, file: file, line: line)
            XCTAssertEqual([d.threadgroups_per_grid.0, d.threadgroups_per_grid.1, d.threadgroups_per_grid.2],
                           [want.threadgroupsPerGrid.width, want.threadgroupsPerGrid.height,
                            want.threadgroupsPerGrid.depth], file: file, line: line)
            XCTAssertEqual(d.threads_per_threadgroup.0, want.threadsPerThreadgroup.width, file: file, line: line)
            XCTAssertEqual(d.params_index, UInt32(want.paramsIndex), file: file, line: line)
            XCTAssertEqual(specializations(plan, UInt32(n)), want.specialization, file: file, line: line)
            XCTAssertEqual(String(cString: d.constants_prelude), functionConstantPrelude(want.specialization),
                           file: file, line: line)
            // The fields' bytes (the struct's tail padding holds whatever the copies left in it).
            var params = want.params
            let fields = MemoryLayout<FlashAttentionParams>.offset(of: \FlashAttentionParams.kv_chunk_keys)!
                + MemoryLayout<UInt32>.size
            let bytes = withUnsafeBytes(of: &params) { Array($0.prefix(fields)) }
            XCTAssertEqual(Int(d.params_size), MemoryLayout<FlashAttentionParams>.stride, file: file, line: line)
            XCTAssertEqual(Array(UnsafeRawBufferPointer(start: d.params, count: fields)), bytes,
                           file: file, line: line)
            let got = bindings(plan, UInt32(n))
            // A dispatch that reads its parameters from a buffer (a varlen pass's sequence table)
            // lists that buffer last, at its parameter index.
            let bound = want.bindings
                + (want.paramsRole.map { [BufferBinding(index: want.paramsIndex, role: $0)] } ?? [])
            XCTAssertEqual(d.params_from_buffer, want.paramsRole == nil ? 0 : 1, file: file, line: line)
            XCTAssertEqual(got.map(\.index), bound.map { UInt32($0.index) }, file: file, line: line)
            XCTAssertEqual(got.map(\.role), bound.map { $0.role.abi.rawValue }, file: file, line: line)
            XCTAssertEqual(got.map(\.byte_offset), bound.map { _ in 0 }, file: file, line: line)
            XCTAssertEqual(got.map(\.byte_length),
                           bound.map { UInt64($0.role.byteCount(for: expected.problem)) }, file: file, line: line)
            // Every [[buffer(i)]] from 0 to the last is bound once: the bindings and the parameters.
            let slots = Set(got.map(\.index) + (d.params_from_buffer == 1 ? [] : [d.params_index]))
            XCTAssertEqual(slots, Set(0..<(d.binding_count + 1 - d.params_from_buffer)), file: file, line: line)
        }
        let list = buffers(plan)
        XCTAssertEqual(list.map(\.role), expected.boundRoles.map { $0.abi.rawValue }, file: file, line: line)
        for (buffer, role) in zip(list, expected.boundRoles) {
            let usage = expected.workspace.contains(role) ? FA_BUFFER_WORKSPACE
                : expected.outputs.contains(role) ? FA_BUFFER_OUTPUT
                : expected.caches.contains(role) ? FA_BUFFER_READ_WRITE : FA_BUFFER_INPUT
            XCTAssertEqual(buffer.usage, usage.rawValue, "\(role)", file: file, line: line)
            XCTAssertEqual(buffer.byte_count, UInt64(role.byteCount(for: expected.problem)), file: file, line: line)
            XCTAssertEqual(buffer.element_size, UInt32(role.elementSize(for: expected.problem)), file: file, line: line)
        }
    }

    func testRecordsAreThePlan() throws {
        let dense = descriptor()
        var d = dense
        let problem = try Problem.validate(&d)
        for (pass, expected) in [(FA_PASS_FORWARD, DispatchPlan.forward(problem)),
                                 (FA_PASS_BACKWARD, DispatchPlan.backward(problem))] {
            let plan = try create(dense, pass)
            defer { fa_plan_destroy(plan) }
            XCTAssertEqual(info(plan).pass, pass.rawValue)
            assertRecords(plan, equal: expected)
        }
        // Decode: the split-KV forward (chunks, then combine) and its two workspaces.
        var decode = descriptor(seqlenQ: 2, seqlenK: 4000)
        let split = DispatchPlan.forward(try Problem.validate(&decode))
        XCTAssertEqual(split.workspace, [.partialOut, .partialLse])
        let splitPlan = try create(decode, FA_PASS_FORWARD)
        defer { fa_plan_destroy(splitPlan) }
        assertRecords(splitPlan, equal: split)
        // Sinks: the backward ends with the dsinks dispatch, which writes the dsinks buffer.
        var withSinks = descriptor(sinks: true)
        let sinksPlan = DispatchPlan.backward(try Problem.validate(&withSinks))
        XCTAssertEqual(sinksPlan.dispatches.last?.kernelName, "flash_attention_backward_dsinks")
        let exported = try create(withSinks, FA_PASS_BACKWARD)
        defer { fa_plan_destroy(exported) }
        assertRecords(exported, equal: sinksPlan)
        // Merge.
        var merge: OpaquePointer?
        XCTAssertEqual(fa_plan_create_merge(300, 64, &merge), FA_STATUS_SUCCESS)
        defer { fa_plan_destroy(merge) }
        assertRecords(try XCTUnwrap(merge), equal: DispatchPlan.merge(try Problem.merge(rows: 300, headDim: 64)))
        XCTAssertEqual(info(try XCTUnwrap(merge)).pass, FA_PASS_MERGE.rawValue)
    }

    /// Pieces: the dispatches of each piece in turn, binding at the piece's offsets with the sliced
    /// problem's parameters.
    func testPiecesBindAtTheirOffsets() throws {
        var d = descriptor()
        let whole = DispatchPlan.backward(try Problem.validate(&d))
        let pieces = whole.pieces(maxFlops: 2 * whole.flopsPerUnit)
        // 2 batch entries x 3 KV heads, 2 KV heads per piece: 4 pieces.
        XCTAssertEqual(pieces.count, 4)
        let plan = try create(d, FA_PASS_BACKWARD, maxFlops: UInt64(2 * whole.flopsPerUnit))
        defer { fa_plan_destroy(plan) }
        XCTAssertEqual(info(plan).piece_count, 4)
        var n: UInt32 = 0
        for (number, piece) in pieces.enumerated() {
            for want in piece.plan.dispatches {
                let got = dispatch(plan, n)
                XCTAssertEqual(got.piece, UInt32(number))
                XCTAssertEqual(String(cString: got.kernel_name), want.kernelName)
                XCTAssertEqual(UnsafeRawPointer(got.params).load(as: FlashAttentionParams.self).batch,
                               want.params.batch)
                XCTAssertEqual(bindings(plan, n).map(\.byte_offset),
                               want.bindings.map { UInt64(piece.byteOffset(of: $0.role)) })
                n += 1
            }
        }
        XCTAssertEqual(info(plan).dispatch_count, n)
        XCTAssertNotEqual(bindings(plan, n - 1).map(\.byte_offset), bindings(plan, 0).map(\.byte_offset))
    }

    /// A problem with features: the forward's function constants (a bool mask, softcap, ALiBi) in
    /// its records and in its prelude, which sets every function constant of the kernels.
    func testSpecializationRecords() throws {
        var p = descriptor()
        p.softcap = 30
        p.attn_mask_type = UInt32(FA_ATTN_MASK_BOOL.rawValue)
        p.attn_mask = UnsafeRawPointer(bitPattern: 1)
        p.alibi_slopes = UnsafePointer(bitPattern: 1)
        let plan = try create(p, FA_PASS_FORWARD)
        defer { fa_plan_destroy(plan) }
        let got = specializations(plan, 0)
        XCTAssertEqual(got.map(\.name), ["fa_mask_type", "fa_has_softcap", "fa_has_alibi", "fa_has_sinks",
                                         "fa_has_dropout"])
        XCTAssertEqual(got.map(\.value), [UInt32(FA_MASK_BOOL), 1, 1, 0, 0])
        XCTAssertEqual(String(cString: dispatch(plan, 0).constants_prelude), """
            #define FA_FUNCTION_CONSTANTS_PREDEFINED 1
            constant uint fa_mask_type = 1;
            constant bool fa_has_softcap = true;
            constant bool fa_has_alibi = true;
            constant bool fa_has_sinks = false;
            constant bool fa_has_dropout = false;

            """)
        var s = fa_plan_specialization()
        s.struct_size = UInt32(MemoryLayout<fa_plan_specialization>.size)
        XCTAssertEqual(fa_plan_get_specialization(plan, 0, 5, &s), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()),
                       "index (5) must be less than the dispatch's specialization_count (5)")
    }

    /// fa_plan_execute on the CPU engine writes exactly what fa_forward and fa_backward write.
    func testExecuteGivesTheCallsBits() throws {
        var p = descriptor()
        let problem = try Problem.validate(&p)
        var rng = Normal16(seed: 25)
        let q = rng.next(BufferRole.q.elementCount(for: problem))
        let k = rng.next(BufferRole.k.elementCount(for: problem))
        let v = rng.next(BufferRole.v.elementCount(for: problem))
        let dout = rng.next(BufferRole.dout.elementCount(for: problem))
        var out = [Float16](repeating: 0, count: q.count), lse = [Float](repeating: 0, count: problem.lseElements)
        XCTAssertEqual(fa_forward(ctx, &p, q, k, v, &out, &lse), FA_STATUS_SUCCESS)
        var dq = [Float16](repeating: 0, count: q.count), dk = [Float16](repeating: 0, count: k.count)
        var dv = dk
        XCTAssertEqual(fa_backward(ctx, &p, dout, q, k, v, out, lse, &dq, &dk, &dv), FA_STATUS_SUCCESS)

        let memory = RoleMemory()
        memory.set(FA_BUFFER_ROLE_Q, q)
        memory.set(FA_BUFFER_ROLE_K, k)
        memory.set(FA_BUFFER_ROLE_V, v)
        memory.set(FA_BUFFER_ROLE_OUT, out.map { _ in Float16(0) })
        memory.set(FA_BUFFER_ROLE_LSE, lse.map { _ in Float(0) })
        let forward = try create(p, FA_PASS_FORWARD)
        defer { fa_plan_destroy(forward) }
        XCTAssertEqual(fa_plan_execute(ctx, forward, memory.table, UInt32(memory.table.count)), FA_STATUS_SUCCESS,
                       String(cString: fa_last_error_message()))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_OUT, Float16.self, out.count).map(\.bitPattern), out.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_LSE, Float.self, lse.count).map(\.bitPattern), lse.map(\.bitPattern))

        memory.set(FA_BUFFER_ROLE_DOUT, dout)
        for role in [FA_BUFFER_ROLE_DQ, FA_BUFFER_ROLE_DK, FA_BUFFER_ROLE_DV] {
            memory.set(role, [Float16](repeating: 0, count: role == FA_BUFFER_ROLE_DQ ? dq.count : dk.count))
        }
        let backward = try create(p, FA_PASS_BACKWARD)
        defer { fa_plan_destroy(backward) }
        XCTAssertEqual(fa_plan_execute(ctx, backward, memory.table, UInt32(memory.table.count)), FA_STATUS_SUCCESS,
                       String(cString: fa_last_error_message()))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DQ, Float16.self, dq.count).map(\.bitPattern), dq.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DK, Float16.self, dk.count).map(\.bitPattern), dk.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DV, Float16.self, dv.count).map(\.bitPattern), dv.map(\.bitPattern))
    }

    /// A variable-length problem (3 sequences, one without queries) through fa_plan_create: its
    /// records are the plan's (the sequence-table dispatch first, the others binding the table at
    /// their parameter index), a caller built before params_from_buffer gets the dispatches that
    /// bind bytes (its struct's bytes only) and a named error for the others, and fa_plan_execute
    /// with the tables as FA_BUFFER_ROLE_CU_SEQLENS_Q and _K gives fa_forward's and fa_backward's bits.
    func testVarlenPlan() throws {
        var cuQ: [Int32] = [0, 5, 5, 14], cuK: [Int32] = [0, 7, 10, 21]
        var p = descriptor(seqlenQ: 14, seqlenK: 21)
        p.batch = 3
        (p.max_seqlen_q, p.max_seqlen_k) = (9, 11)
        let problem = try cuQ.withUnsafeBufferPointer { q in
            try cuK.withUnsafeBufferPointer { k in
                p.cu_seqlens_q = q.baseAddress
                p.cu_seqlens_k = k.baseAddress
                return try Problem.validate(&p)
            }
        }
        // Presence only, as for the optional inputs; the tables come through the buffers.
        p.cu_seqlens_q = UnsafePointer(bitPattern: 4)
        p.cu_seqlens_k = UnsafePointer(bitPattern: 4)
        let forward = try create(p, FA_PASS_FORWARD), backward = try create(p, FA_PASS_BACKWARD)
        defer {
            fa_plan_destroy(forward)
            fa_plan_destroy(backward)
        }
        assertRecords(forward, equal: DispatchPlan.forward(problem))
        assertRecords(backward, equal: DispatchPlan.backward(problem))
        XCTAssertEqual(String(cString: dispatch(forward, 0).kernel_name), "flash_attention_varlen_sequences")
        XCTAssertEqual(bindings(forward, 1).last?.role, FA_BUFFER_ROLE_SEQUENCE_TABLE.rawValue)
        XCTAssertEqual(buffers(forward).first { $0.role == FA_BUFFER_ROLE_SEQUENCE_TABLE.rawValue }?.usage,
                       FA_BUFFER_WORKSPACE.rawValue)

        let legacy = MemoryLayout<fa_plan_dispatch>.offset(of: \fa_plan_dispatch.params_from_buffer)!
        var old = fa_plan_dispatch()
        old.struct_size = UInt32(legacy)
        old.params_from_buffer = 77
        XCTAssertEqual(fa_plan_get_dispatch(forward, 0, &old), FA_STATUS_SUCCESS)
        XCTAssertEqual(String(cString: old.kernel_name), "flash_attention_varlen_sequences")
        XCTAssertEqual(old.params_from_buffer, 77, "bytes past the caller's struct_size stay as they were")
        XCTAssertEqual(fa_plan_get_dispatch(forward, 1, &old), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()),
                       "dispatch->struct_size (\(legacy)) must be at least sizeof(fa_plan_dispatch) "
                           + "(\(MemoryLayout<fa_plan_dispatch>.size)) for dispatch 1, which reads its parameters "
                           + "from the sequence_table buffer (params_from_buffer)")

        var rng = Normal16(seed: 35)
        let q = rng.next(BufferRole.q.elementCount(for: problem))
        let k = rng.next(BufferRole.k.elementCount(for: problem))
        let v = rng.next(BufferRole.v.elementCount(for: problem))
        let dout = rng.next(BufferRole.dout.elementCount(for: problem))
        var out = [Float16](repeating: 0, count: q.count), lse = [Float](repeating: 0, count: problem.lseElements)
        var dq = out, dk = [Float16](repeating: 0, count: k.count), dv = dk
        cuQ.withUnsafeBufferPointer { tq in
            cuK.withUnsafeBufferPointer { tk in
                var call = p
                (call.cu_seqlens_q, call.cu_seqlens_k) = (tq.baseAddress, tk.baseAddress)
                XCTAssertEqual(fa_forward(ctx, &call, q, k, v, &out, &lse), FA_STATUS_SUCCESS)
                XCTAssertEqual(fa_backward(ctx, &call, dout, q, k, v, out, lse, &dq, &dk, &dv), FA_STATUS_SUCCESS)
            }
        }
        let memory = RoleMemory()
        for (role, values) in [(FA_BUFFER_ROLE_Q, q), (FA_BUFFER_ROLE_K, k), (FA_BUFFER_ROLE_V, v)] {
            memory.set(role, values)
        }
        memory.set(FA_BUFFER_ROLE_OUT, [Float16](repeating: 0, count: out.count))
        memory.set(FA_BUFFER_ROLE_LSE, [Float](repeating: 0, count: lse.count))
        memory.set(FA_BUFFER_ROLE_CU_SEQLENS_Q, cuQ)
        memory.set(FA_BUFFER_ROLE_CU_SEQLENS_K, cuK)
        XCTAssertEqual(fa_plan_execute(ctx, forward, memory.table, 26), FA_STATUS_INVALID_ARGUMENT)
        XCTAssertEqual(String(cString: fa_last_error_message()),
                       "buffers[26] (cu_seqlens_q), which the plan reads, must not be null")
        XCTAssertEqual(fa_plan_execute(ctx, forward, memory.table, UInt32(memory.table.count)), FA_STATUS_SUCCESS,
                       String(cString: fa_last_error_message()))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_OUT, Float16.self, out.count).map(\.bitPattern), out.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_LSE, Float.self, lse.count).map(\.bitPattern), lse.map(\.bitPattern))
        memory.set(FA_BUFFER_ROLE_OUT, out)
        memory.set(FA_BUFFER_ROLE_DOUT, dout)
        for role in [FA_BUFFER_ROLE_DQ, FA_BUFFER_ROLE_DK, FA_BUFFER_ROLE_DV] {
            memory.set(role, [Float16](repeating: 0, count: role == FA_BUFFER_ROLE_DQ ? dq.count : dk.count))
        }
        XCTAssertEqual(fa_plan_execute(ctx, backward, memory.table, UInt32(memory.table.count)), FA_STATUS_SUCCESS,
                       String(cString: fa_last_error_message()))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DQ, Float16.self, dq.count).map(\.bitPattern), dq.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DK, Float16.self, dk.count).map(\.bitPattern), dk.map(\.bitPattern))
        XCTAssertEqual(memory.get(FA_BUFFER_ROLE_DV, Float16.self, dv.count).map(\.bitPattern), dv.map(\.bitPattern))
    }

    /// Misuse of the plan functions: named errors, nothing written.
    func testErrors() throws {
        var p = descriptor()
        var plan: OpaquePointer?
        func expect(_ status: fa_status, _ message: String, line: UInt = #line) {
            XCTAssertEqual(status, FA_STATUS_INVALID_ARGUMENT, line: line)
            XCTAssertEqual(String(cString: fa_last_error_message()), message, line: line)
        }
        expect(fa_plan_create(&p, FA_PASS_MERGE, 0, &plan),
               "pass (2) must be FA_PASS_FORWARD or FA_PASS_BACKWARD (FA_PASS_MERGE: fa_plan_create_merge)")
        XCTAssertNil(plan)
        expect(fa_plan_create(nil, FA_PASS_FORWARD, 0, &plan), "problem must not be null")
        expect(fa_plan_create(&p, FA_PASS_FORWARD, 0, nil), "out_plan must not be null")
        p.num_heads = 4
        expect(fa_plan_create(&p, FA_PASS_FORWARD, 0, &plan), "num_heads (4) must be a multiple of num_kv_heads (3)")
        p = descriptor()
        let forward = try create(p, FA_PASS_FORWARD)
        defer { fa_plan_destroy(forward) }
        var d = fa_plan_dispatch()
        d.struct_size = UInt32(MemoryLayout<fa_plan_dispatch>.size)
        expect(fa_plan_get_dispatch(forward, 1, &d), "index (1) must be less than the plan's dispatch_count (1)")
        expect(fa_plan_get_dispatch(nil, 0, &d), "plan must not be null")
        d.struct_size = 8
        let legacy = MemoryLayout<fa_plan_dispatch>.offset(of: \fa_plan_dispatch.params_from_buffer)!
        expect(fa_plan_get_dispatch(forward, 0, &d),
               "dispatch->struct_size (8) must be at least \(legacy) (fa_plan_dispatch up to constants_prelude)")
        var b = fa_plan_binding()
        b.struct_size = UInt32(MemoryLayout<fa_plan_binding>.size)
        expect(fa_plan_get_binding(forward, 3, 0, &b), "dispatch (3) must be less than the plan's dispatch_count (1)")
        expect(fa_plan_get_binding(forward, 0, 9, &b), "index (9) must be less than the dispatch's binding_count (8)")

        let memory = RoleMemory()
        let problem = try Problem.validate(&p)
        for role in [BufferRole.q, .k, .v, .out] {
            memory.set(role.abi, [Float16](repeating: 0, count: role.elementCount(for: problem)))
        }
        expect(fa_plan_execute(ctx, forward, memory.table, UInt32(memory.table.count)),
               "buffers[4] (lse), which the plan writes, must not be null")
        expect(fa_plan_execute(ctx, forward, memory.table, 3),
               "buffers[3] (out), which the plan writes, must not be null")
        memory.set(FA_BUFFER_ROLE_LSE, [Float](repeating: 0, count: problem.lseElements))
        memory.set(FA_BUFFER_ROLE_DQ, [Float16](repeating: 0, count: 1))
        expect(fa_plan_execute(ctx, forward, memory.table, UInt32(memory.table.count)),
               "buffers[6] (dq) must be NULL: the plan does not use it")
        memory.table[Int(FA_BUFFER_ROLE_DQ.rawValue)] = nil
        memory.table[Int(FA_BUFFER_ROLE_OUT.rawValue)] = memory.table[Int(FA_BUFFER_ROLE_Q.rawValue)]
        expect(fa_plan_execute(ctx, forward, memory.table, UInt32(memory.table.count)),
               "out must not overlap q (outputs are written while inputs are read)")
        expect(fa_plan_execute(nil, forward, memory.table, UInt32(memory.table.count)), "context must not be null")
        // Workspaces belong to the library.
        let backward = try create(p, FA_PASS_BACKWARD)
        defer { fa_plan_destroy(backward) }
        for role in [BufferRole.dout, .dq, .dk, .dv] {
            memory.set(role.abi, [Float16](repeating: 0, count: role.elementCount(for: problem)))
        }
        memory.table[Int(FA_BUFFER_ROLE_OUT.rawValue)] = nil
        memory.set(FA_BUFFER_ROLE_OUT, [Float16](repeating: 0, count: BufferRole.out.elementCount(for: problem)))
        memory.set(FA_BUFFER_ROLE_DELTA, [Float](repeating: 0, count: problem.lseElements))
        expect(fa_plan_execute(ctx, backward, memory.table, UInt32(memory.table.count)),
               "buffers[9] (delta) must be NULL: it is a workspace, which the library allocates")
    }

    /// The kernel source is the embedded, self-contained one; no .metallib exists on Linux builds.
    func testKernelSource() throws {
        XCTAssertEqual(String(cString: try XCTUnwrap(fa_plan_kernel_source())), EmbeddedShaders.source)
        XCTAssertFalse(EmbeddedShaders.source.contains("#include \""))
        #if os(Linux)
        XCTAssertNil(fa_plan_metallib_path())
        XCTAssertNil(fa_plan_tensor_metallib_path())
        #endif
    }
}

/// Host memory for the roles of fa_plan_execute: `table` is its buffers argument.
private final class RoleMemory {
    var table = [UnsafeMutableRawPointer?](repeating: nil, count: Int(FA_BUFFER_ROLE_COUNT.rawValue))
    private var owned: [UnsafeMutableRawPointer] = []

    func set<T>(_ role: fa_buffer_role, _ values: [T]) {
        let bytes = values.count * MemoryLayout<T>.stride
        let memory = UnsafeMutableRawPointer.allocate(byteCount: max(bytes, 1), alignment: 16)
        values.withUnsafeBytes { memory.copyMemory(from: $0.baseAddress!, byteCount: bytes) }
        owned.append(memory)
        table[Int(role.rawValue)] = memory
    }

    func get<T>(_ role: fa_buffer_role, _ type: T.Type, _ count: Int) -> [T] {
        Array(UnsafeBufferPointer(start: table[Int(role.rawValue)]!.assumingMemoryBound(to: T.self), count: count))
    }

    deinit { owned.forEach { $0.deallocate() } }
}
