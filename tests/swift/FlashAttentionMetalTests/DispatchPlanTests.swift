import CFlashAttentionMetal
import XCTest

@testable import FlashAttentionMetal

/// The dispatch plan: kernel names per head-dim bucket, grids, bindings and parameter values.
final class DispatchPlanTests: XCTestCase {
    private func problem(batch: Int = 2, heads: Int = 6, kvHeads: Int = 3, seqlenQ: Int = 100,
                         seqlenK: Int = 33, headDim: Int = 64, causal: Bool = true,
                         scale: Float? = 0.25) throws -> Problem {
        try Problem.validate(AttentionShape(batch: batch, numHeads: heads, numKVHeads: kvHeads, seqlenQ: seqlenQ,
                                            seqlenK: seqlenK, headDim: headDim),
                             causal: causal, softmaxScale: scale)
    }

    /// Every bucket boundary: head_dim -> the bucket's head_dim_max, and 577 rejected.
    func testBucketBoundaries() throws {
        let expected: [(Int, UInt32)] = [(1, 32), (32, 32), (33, 64), (64, 64), (65, 96), (96, 96), (97, 128),
                                         (128, 128), (129, 192), (192, 192), (193, 256), (256, 256), (257, 512),
                                         (512, 512), (513, 576), (576, 576)]
        for (headDim, bucket) in expected {
            let p = try problem(headDim: headDim)
            XCTAssertEqual(p.bucket.head_dim_max, bucket, "head_dim \(headDim)")
            let forward = DispatchPlan.forward(p)
            XCTAssertEqual(forward.dispatches.map(\.kernelName), ["flash_attention_forward_f16_d\(bucket)"])
            let backward = DispatchPlan.backward(p)
            // The group of 2 query heads is split where the 6 x key blocks leave slots idle (GroupSplit).
            let dkv = backward.problem.dkvSplits > 1
                ? ["flash_attention_backward_dkv_split_f16_d\(bucket)", "flash_attention_backward_dkv_reduce_f16"]
                : ["flash_attention_backward_dkv_f16_d\(bucket)"]
            XCTAssertEqual(backward.dispatches.map(\.kernelName),
                           ["flash_attention_backward_delta_f16", "flash_attention_backward_lse_residual_f16_d\(bucket)",
                            "flash_attention_backward_dq_f16_d\(bucket)"] + dkv)
            XCTAssertEqual(forward.dispatches[0].params.head_dim, UInt32(headDim))
        }
        XCTAssertThrowsError(try problem(headDim: 577)) { error in
            XCTAssertEqual(error as? FlashAttentionError,
                           .unsupported("head_dim (577) must be at most fa_max_head_dim() (576)"))
        }
    }

    /// The products test active fragments (partial_columns 1) only where a whole 8-column fragment
    /// of the bucket lies past head_dim: 40 of 64 and 100 of 128, not 60 of 64 or 124 of 128.
    func testPartialColumnsOnlyForWholeZeroFragments() throws {
        for (headDim, partial) in [(64, 0), (60, 0), (57, 0), (56, 1), (40, 1), (124, 0), (120, 1), (100, 1)] {
            XCTAssertEqual(try problem(headDim: headDim).params.partial_columns, UInt32(partial),
                           "head_dim \(headDim)")
        }
    }

    /// The block sizes of the plan are the rows of FA_HEAD_DIM_BUCKETS, read through the C table;
    /// every kernel runs 4 SIMD-groups of 32 threads.
    func testBlockSizesComeFromTheBucketTable() throws {
        // (head_dim_max, forward BQ, dQ BQ, dK/dV BK)
        let table: [(UInt32, UInt32, UInt32, UInt32)] = [
            (32, 32, 32, 32), (64, 32, 32, 32), (96, 32, 32, 32), (128, 32, 32, 32), (192, 32, 16, 16),
            (256, 32, 16, 16), (512, 8, 8, 8), (576, 8, 8, 8),
        ]
        let threads = GridSize(width: 128, height: 1, depth: 1)
        for (dmax, fbq, dqbq, dkvbk) in table {
            let p = try problem(seqlenQ: 100, seqlenK: 33, headDim: Int(dmax))
            let f = DispatchPlan.forward(p).dispatches[0]
            XCTAssertEqual(f.threadsPerThreadgroup, threads)
            XCTAssertEqual(f.threadgroupsPerGrid, GridSize(width: (100 + fbq - 1) / fbq, height: 6, depth: 2))
            let backward = DispatchPlan.backward(p)
            let b = backward.dispatches
            XCTAssertEqual(b.map(\.threadsPerThreadgroup), Array(repeating: threads, count: b.count))
            XCTAssertEqual(b[0].threadgroupsPerGrid, GridSize(width: 1, height: 6, depth: 2))
            // The lse residual runs over the forward's row blocks (it redoes the forward's scores).
            XCTAssertEqual(b[1].threadgroupsPerGrid, f.threadgroupsPerGrid)
            XCTAssertEqual(b[2].threadgroupsPerGrid, GridSize(width: (100 + dqbq - 1) / dqbq, height: 6, depth: 2))
            // dK/dV runs over key blocks (times the group's splits) and KV heads, not query heads.
            XCTAssertEqual(b[3].threadgroupsPerGrid, GridSize(width: (33 + dkvbk - 1) / dkvbk * backward.problem.dkvSplits,
                                                              height: 3, depth: 2))
        }
    }

    func testForwardBindingsAndParams() throws {
        let p = try problem()
        let plan = DispatchPlan.forward(p)
        let d = plan.dispatches[0]
        // attn_mask, alibi_slopes and sinks are absent: lse stands in at their indices, unread.
        XCTAssertEqual(d.bindings, [BufferBinding(index: 0, role: .q), BufferBinding(index: 1, role: .k),
                                    BufferBinding(index: 2, role: .v), BufferBinding(index: 3, role: .out),
                                    BufferBinding(index: 4, role: .lse), BufferBinding(index: 6, role: .lse),
                                    BufferBinding(index: 7, role: .lse), BufferBinding(index: 8, role: .lse)])
        XCTAssertEqual(d.paramsIndex, Int(FA_FORWARD_BUFFER_PARAMS))
        XCTAssertEqual(d.bufferCount, Int(FA_FORWARD_BUFFER_COUNT))
        XCTAssertEqual(plan.outputs, [.out, .lse])
        XCTAssertEqual(plan.workspace, [])
        let params = d.params
        XCTAssertEqual([params.batch, params.num_heads, params.num_kv_heads, params.seqlen_q, params.seqlen_k,
                        params.head_dim], [2, 6, 3, 100, 33, 64])
        XCTAssertEqual(params.window_right, 0, "causal is window_right 0")
        XCTAssertEqual(params.softmax_scale, 0.25)
    }

    func testBackwardBindingsAndParams() throws {
        let p = try problem(causal: false, scale: nil)
        // One GPU core: its 3 dK/dV slots are busy through the 12 threadgroups' waves, so no split.
        let plan = DispatchPlan.make(.backward, planned: p.planned(forGPUCores: 1, tensorOps: .off, pass: .backward))
        let inputs = [BufferBinding(index: 0, role: .dout), BufferBinding(index: 1, role: .q),
                      BufferBinding(index: 2, role: .k), BufferBinding(index: 3, role: .v),
                      BufferBinding(index: 4, role: .out), BufferBinding(index: 5, role: .lse),
                      BufferBinding(index: 7, role: .delta), BufferBinding(index: 8, role: .lse),
                      BufferBinding(index: 9, role: .lse), BufferBinding(index: 10, role: .lse),
                      BufferBinding(index: 11, role: .lseResidual)]
        XCTAssertEqual(plan.dispatches[0].bindings, inputs)
        XCTAssertEqual(plan.dispatches[1].bindings, inputs)
        XCTAssertEqual(plan.dispatches[2].bindings, inputs + [BufferBinding(index: 12, role: .dq)])
        XCTAssertEqual(plan.dispatches[3].bindings,
                       inputs + [BufferBinding(index: 12, role: .dk), BufferBinding(index: 13, role: .dv)])
        XCTAssertEqual(plan.dispatches.map(\.paramsIndex), [6, 6, 6, 6])
        XCTAssertEqual(plan.dispatches.map(\.bufferCount),
                       [Int(FA_BACKWARD_DELTA_BUFFER_COUNT), Int(FA_BACKWARD_LSE_RESIDUAL_BUFFER_COUNT),
                        Int(FA_BACKWARD_DQ_BUFFER_COUNT), Int(FA_BACKWARD_DKV_BUFFER_COUNT)])
        XCTAssertEqual(plan.outputs, [.dq, .dk, .dv])
        // D = rowsum(dout * out) and the lse residual live in workspaces the backend allocates, one
        // float per query row each; the residual pass runs over the forward's row blocks.
        XCTAssertEqual(plan.workspace, [.delta, .lseResidual])
        XCTAssertEqual(BufferRole.delta.byteCount(for: p), BufferRole.lse.byteCount(for: p))
        XCTAssertEqual(BufferRole.lseResidual.byteCount(for: p), BufferRole.lse.byteCount(for: p))
        XCTAssertEqual(plan.dispatches[1].threadgroupsPerGrid,
                       GridSize(width: (p.seqlenQ + p.bucket.forward_block_q - 1) / p.bucket.forward_block_q,
                                height: p.numHeads, depth: p.batch))
        for d in plan.dispatches {
            XCTAssertEqual(d.params.window_right, -1)
            XCTAssertEqual(d.params.softmax_scale, 1 / Float(64).squareRoot())
        }
        // On 10 cores (30 slots) the group splits in 2: the split kernel writes the partial sums,
        // which the reduction reads beside dk and dv; both are workspaces of [2][3][2][33][64] floats.
        let split = DispatchPlan.make(.backward, planned: p.planned(forGPUCores: 10, tensorOps: .off, pass: .backward))
        XCTAssertEqual(split.problem.dkvSplits, 2)
        XCTAssertEqual(split.dispatches.map(\.kernelName).suffix(2),
                       ["flash_attention_backward_dkv_split_f16_d64", "flash_attention_backward_dkv_reduce_f16"])
        let partials = [BufferBinding(index: 14, role: .partialDk), BufferBinding(index: 15, role: .partialDv)]
        XCTAssertEqual(split.dispatches[3].bindings,
                       inputs + [BufferBinding(index: 12, role: .lse), BufferBinding(index: 13, role: .lse)] + partials)
        XCTAssertEqual(split.dispatches[4].bindings,
                       inputs + [BufferBinding(index: 12, role: .dk), BufferBinding(index: 13, role: .dv)] + partials)
        XCTAssertEqual(split.dispatches[3].threadgroupsPerGrid, GridSize(width: 2 * 2, height: 3, depth: 2))
        XCTAssertEqual(split.dispatches[4].threadgroupsPerGrid,
                       GridSize(width: (33 + UInt32(FA_DKV_REDUCE_ROWS) - 1) / UInt32(FA_DKV_REDUCE_ROWS), height: 3, depth: 2))
        XCTAssertEqual(split.dispatches.map(\.params.dkv_splits), [2, 2, 2, 2, 2])
        XCTAssertEqual(split.workspace, [.delta, .lseResidual, .partialDk, .partialDv])
        XCTAssertEqual(BufferRole.partialDk.byteCount(for: split.problem), 2 * 3 * 2 * 33 * 64 * 4)
        XCTAssertEqual(BufferRole.partialDv.byteCount(for: split.problem), 2 * 3 * 2 * 33 * 64 * 4)
        XCTAssertEqual(BufferRole.partialDk.byteCount(for: plan.problem), 0)
    }

    /// The dK/dV group split (GroupSplit): unsplit at 90 % occupancy of the slots' waves or more,
    /// else the smallest divisor of the group that reaches it, else the best divisor.
    func testGroupSplitRule() {
        func splits(_ blocks: UInt32, _ kvHeads: UInt32, _ group: UInt32, _ cores: UInt32,
                    max: UInt32 = .max) -> UInt32 {
            GroupSplit.splits(keyBlocks: blocks, kvHeads: kvHeads, batch: 1, group: group, cores: cores, resident: 2,
                              maxSplits: max)
        }
        // B 1, H 32, 4K tokens, head_dim 128 (docs/performance.md): 128 key blocks.
        XCTAssertEqual([1, 2, 8].map { splits(128, $0, 32 / $0, 10) }, [1, 1, 1])
        XCTAssertEqual([1, 2, 8].map { splits(128, $0, 32 / $0, 40) }, [4, 2, 1])
        XCTAssertEqual(splits(32, 1, 32, 40), 16)  // 1K tokens
        XCTAssertEqual(splits(1, 1, 1, 40), 1)  // no group to split
        XCTAssertEqual(splits(1, 1, 6, 40), 6)  // never reaches 90 %: the whole group, one head each
        // 3 threadgroups in 4 slots (75 %); 2 and 3 splits stay at 75 %, 6 reach 90 %.
        XCTAssertEqual(splits(3, 1, 6, 2), 6)
        // Huge groups: the search stops at 10 waves (8192 slots here), so it is short and the grid small.
        XCTAssertEqual(splits(1, 1, 1 << 31, 4096), 8192)
        XCTAssertEqual(splits(1, 1, 4_294_967_291, 4096), 1)  // a prime: no divisor within 10 waves
        // The workspace bound: at most `max` splits, the best divisor below it, none below 2.
        XCTAssertEqual(splits(32, 1, 32, 40, max: 16), 16)
        XCTAssertEqual(splits(32, 1, 32, 40, max: 8), 2)  // 2, 4 and 8 all at 80 %: the smallest
        XCTAssertEqual(splits(32, 1, 32, 40, max: 1), 1)
    }

    /// FA_DKV_SPLIT_MAX_WORKSPACE_BYTES bounds partial_dk and partial_dv together: planned for 4096
    /// cores, B 1, H 32, 1 KV head, 4K tokens, head_dim 128 would split 32 ways (128 MiB); the plan
    /// takes 16 (64 MiB), and at 128K tokens, where one split needs 128 MiB, none.
    func testGroupSplitWorkspaceBound() throws {
        for (seqlen, expected) in [(4096, UInt32(16)), (131_072, 1)] {
            let p = try problem(batch: 1, heads: 32, kvHeads: 1, seqlenQ: seqlen, seqlenK: seqlen, headDim: 128)
            let planned = p.planned(forGPUCores: 4096, tensorOps: .off, pass: .backward)
            XCTAssertEqual(planned.dkvSplits, expected)
            let perSplit = seqlen * 256 * 4
            XCTAssertEqual(GroupSplit.maxSplits(for: planned), UInt32(Int(FA_DKV_SPLIT_MAX_WORKSPACE_BYTES) / perSplit))
            let workspace = BufferRole.partialDk.byteCount(for: planned) + BufferRole.partialDv.byteCount(for: planned)
            XCTAssertEqual(workspace, expected > 1 ? Int(expected) * perSplit : 0)
            XCTAssertLessThanOrEqual(workspace, Int(FA_DKV_SPLIT_MAX_WORKSPACE_BYTES))
        }
    }

    /// Every buffer slot of every dispatch is bound exactly once, the parameter struct included.
    func testSlotsAreDense() throws {
        let p = try problem()
        for d in DispatchPlan.forward(p).dispatches + DispatchPlan.backward(p).dispatches {
            let indices = (d.bindings.map(\.index) + [d.paramsIndex]).sorted()
            XCTAssertEqual(indices, Array(0..<d.bufferCount), d.kernelName)
        }
    }

    /// Sizes near 2^32 do not overflow the block count.
    func testGridNearUInt32Limit() throws {
        let p = try problem(batch: 1, heads: 1, kvHeads: 1, seqlenQ: Int(UInt32.max), seqlenK: 1, headDim: 1)
        let d = DispatchPlan.forward(p).dispatches[0]
        XCTAssertEqual(d.threadgroupsPerGrid.width, UInt32((Int(UInt32.max) + 31) / 32))
    }

    func testBufferByteCounts() throws {
        let p = try problem(batch: 2, heads: 6, kvHeads: 3, seqlenQ: 5, seqlenK: 7, headDim: 40)
        XCTAssertEqual(BufferRole.q.byteCount(for: p), 2 * 6 * 5 * 40 * 2)
        XCTAssertEqual(BufferRole.dv.byteCount(for: p), 2 * 3 * 7 * 40 * 2)
        XCTAssertEqual(BufferRole.lse.byteCount(for: p), 2 * 6 * 5 * 4)
    }

    /// Decode shapes take the decode forward: for B=1, H=32, KV heads 8, seqlen_q 1, seqlen_k 32768,
    /// head_dim 128 on the nominal GPU (FA_NOMINAL_GPU_CORES = 10, 3 decode threadgroups per core)
    /// two waves, 60 threadgroups at least: 8 chunks of 4096 keys x 8 KV heads; the query heads of
    /// a GQA group packed into one block, and every K/V element read exactly once per call.
    func testDecodeTakesTheDecodeForward() throws {
        let p = try problem(batch: 1, heads: 32, kvHeads: 8, seqlenQ: 1, seqlenK: 32768, headDim: 128,
                            causal: true, scale: nil)
        let split = try XCTUnwrap(p.cpuSplit)
        let plan = DispatchPlan.forward(p)
        XCTAssertEqual(plan.dispatches.map(\.kernelName),
                       ["flash_attention_forward_decode_f16_d128", "flash_attention_forward_combine_f16"])
        XCTAssertEqual(plan.workspace, [.partialOut, .partialLse])
        XCTAssertEqual(plan.dispatches[0].threadgroupsPerGrid, GridSize(width: 8, height: 8, depth: 1))
        XCTAssertEqual([split.rowBlocks, split.chunkKeys], [1, 4096])
        // Keys each threadgroup streams: its chunk (the last one shorter); the chunks tile the cache.
        let streamed = (0..<split.chunks).map { min(split.chunkKeys, p.seqlenK - $0 * split.chunkKeys) }
        XCTAssertEqual(streamed.reduce(0, +), p.seqlenK)
        XCTAssertEqual(plan.dispatches[1].threadgroupsPerGrid, GridSize(width: 1, height: 32, depth: 1))
        XCTAssertEqual([plan.dispatches[0].params.kv_chunks, plan.dispatches[0].params.kv_chunk_keys],
                       [split.chunks, split.chunkKeys])
        XCTAssertEqual(BufferRole.partialLse.elementCount(for: plan.problem), 32 * Int(split.chunks) * 2)
        XCTAssertEqual(BufferRole.partialOut.elementCount(for: plan.problem), 32 * Int(split.chunks) * 128)
    }

    /// The chunk rule at other core counts (docs/decode.md's table): two waves of 3 threadgroups per
    /// core where chunks of at least 64 keys allow it, the shape's maximum otherwise. With 1 KV
    /// head the 32 packed rows take the tiled split kernel (one block of forward_block_q 32 rows).
    func testChunksFollowTheCoreCount() throws {
        var bucket = FlashAttentionBucket()
        XCTAssertEqual(fa_bucket_for_head_dim(UInt32(FA_DTYPE_F16), 128, &bucket), 1)
        func split(_ kvHeads: UInt32, _ keys: UInt32, _ cores: UInt32, seqlenQ: UInt32 = 1) -> KeyValueSplit? {
            KeyValueSplit(batch: 1, numHeads: 32, numKVHeads: kvHeads, seqlenQ: seqlenQ, seqlenK: keys,
                          bucket: bucket, cores: cores)
        }
        for (kvHeads, keys, cores, chunks, threadgroups) in [(8, 32768, 40, 31, 248), (1, 32768, 40, 256, 256),
                                                              (8, 1024, 40, 16, 128), (8, 131072, 80, 61, 488),
                                                              (1, 1024, 10, 16, 16), (1, 131072, 10, 61, 61)]
            as [(UInt32, UInt32, UInt32, UInt32, UInt64)] {
            let s = try XCTUnwrap(split(kvHeads, keys, cores))
            XCTAssertEqual(s.kernel, kvHeads == 1 ? .tiled : .decode)
            XCTAssertEqual([UInt64(s.chunks), s.threadgroups * UInt64(kvHeads)], [UInt64(chunks), threadgroups],
                           "KV heads \(kvHeads), \(keys) keys, \(cores) cores")
            XCTAssertGreaterThanOrEqual(s.chunkKeys, UInt32(FA_SPLIT_MIN_CHUNK_KEYS))
        }
        // 16 rows (speculative decoding): 32 dense threadgroups fill 10 cores (30 at once), not 40.
        XCTAssertNil(split(8, 32768, 10, seqlenQ: 16))
        XCTAssertEqual(try XCTUnwrap(split(8, 32768, 40, seqlenQ: 16)).kernel, .tiled)
        XCTAssertNil(split(8, 32768, 40, seqlenQ: 65))
    }

    /// The split-KV thresholds: the decode kernel at any length where its block holds the packed
    /// rows of a KV head (group x seqlen_q: 8 up to head_dim 128, 4 up to 256, none above), else the
    /// spec kernel where one 16-row block holds them (up to head_dim 256), else the tiled kernel,
    /// which reads the cache once per forward_block_q rows (decode and spec shapes even in one chunk,
    /// where the dense forward would read it once per query head); from 9 rows the tiled kernel
    /// needs two chunks (multiples of FA_SPLIT_MIN_CHUNK_KEYS keys, the last one shorter).
    func testSplitKVThresholds() throws {
        XCTAssertEqual(try problem(seqlenQ: 4, seqlenK: 512).cpuSplit?.kernel, .decode)
        XCTAssertEqual(try problem(seqlenQ: 5, seqlenK: 512).cpuSplit?.kernel, .spec)
        XCTAssertEqual(try problem(seqlenQ: 8, seqlenK: 512).cpuSplit.map { [$0.rowBlocks] }, [1])
        XCTAssertEqual(try problem(seqlenQ: 8, seqlenK: 63).cpuSplit.map { [$0.chunks] }, [1])
        XCTAssertEqual(try problem(seqlenQ: 9, seqlenK: 512).cpuSplit?.kernel, .tiled)
        XCTAssertEqual(try problem(heads: 3, seqlenQ: 16, seqlenK: 512).cpuSplit?.kernel, .spec)
        XCTAssertEqual(try problem(seqlenQ: 1, seqlenK: 7).cpuSplit?.chunks, 1)
        XCTAssertEqual(try problem(seqlenQ: 8, seqlenK: 7).cpuSplit.map { [$0.chunks, $0.rowBlocks] }, [1, 1])
        XCTAssertEqual(try problem(seqlenQ: 2, seqlenK: 512, headDim: 256).cpuSplit?.kernel, .decode)
        XCTAssertEqual(try problem(seqlenQ: 3, seqlenK: 512, headDim: 256).cpuSplit?.kernel, .spec)
        XCTAssertEqual(try problem(kvHeads: 6, seqlenQ: 12, seqlenK: 512, headDim: 512).cpuSplit?.kernel, .tiled)
        XCTAssertEqual(try problem(kvHeads: 6, seqlenQ: 1, seqlenK: 512, headDim: 512).cpuSplit?.kernel, .tiled)
        XCTAssertNil(try problem(seqlenQ: 65, seqlenK: 100_000).cpuSplit)
        XCTAssertNil(try problem(seqlenQ: 9, seqlenK: 63).cpuSplit)
        XCTAssertEqual(try problem(seqlenQ: 9, seqlenK: 128).cpuSplit?.kernel, .tiled)
        // Rows of a GQA group beyond one block: 16 heads per KV head x 8 rows = 128 packed rows.
        let packed = try XCTUnwrap(try problem(batch: 1, heads: 16, kvHeads: 1, seqlenQ: 8, seqlenK: 4096,
                                               headDim: 64).cpuSplit)
        XCTAssertEqual([packed.rowBlocks], [4])
        XCTAssertEqual(packed.kernel, .tiled)
        XCTAssertEqual(try problem(seqlenQ: 100, seqlenK: 33).params.kv_chunks, 1)
    }

    /// FLASH_ATTENTION_GPU_CORES plans for another GPU; a bad value is an error naming it, from the
    /// planner: validation decides no split and reads no core count.
    func testCoreCountOverride() throws {
        defer { unsetenv(GPUCores.environmentVariable) }
        setenv(GPUCores.environmentVariable, "40", 1)
        XCTAssertEqual(try GPUCores.planned(), 40)
        setenv(GPUCores.environmentVariable, "0", 1)
        let p = try problem(seqlenQ: 1, seqlenK: 512)
        XCTAssertNil(p.split)
        XCTAssertNil(p.gpuCores)
        XCTAssertThrowsError(try DispatchPlan.make(.forward, p, device: nil)) { error in
            XCTAssertTrue("\(error)".contains("FLASH_ATTENTION_GPU_CORES (0)"), "\(error)")
        }
        unsetenv(GPUCores.environmentVariable)
        XCTAssertEqual(try GPUCores.planned(), UInt32(FA_NOMINAL_GPU_CORES))
    }

    /// A backend's device count (Metal: the IORegistry's) replaces the nominal GPU unless the
    /// variable is set; the planner's plan for a device is the one it makes for that count however
    /// the count is given, and a piece's plan keeps the chunking it was given.
    func testDeviceCoreCount() throws {
        defer { unsetenv(GPUCores.environmentVariable) }
        XCTAssertEqual(try GPUCores.planned(device: 38), 38)
        XCTAssertEqual(try GPUCores.plan(device: 38).source, .device)
        XCTAssertEqual(try GPUCores.planned(device: 0), 1)
        XCTAssertEqual(try GPUCores.planned(device: nil), UInt32(FA_NOMINAL_GPU_CORES))
        XCTAssertEqual(try GPUCores.plan(device: nil).source, .nominal)
        let p = try problem(batch: 1, heads: 32, kvHeads: 8, seqlenQ: 1, seqlenK: 4096)
        let nominal = try DispatchPlan.make(.forward, p, device: nil)
        XCTAssertEqual(nominal.problem.gpuCores, UInt32(FA_NOMINAL_GPU_CORES))
        let device = try DispatchPlan.make(.forward, p, device: 40)
        XCTAssertEqual(device.problem.gpuCores, 40)
        XCTAssertNotEqual(device.problem.split, nominal.problem.split)
        setenv(GPUCores.environmentVariable, "40", 1)
        XCTAssertEqual(try GPUCores.planned(device: 38), 40)
        XCTAssertEqual(try GPUCores.plan(device: 38).source, .override)
        let overridden = try DispatchPlan.make(.forward, p, device: 38)
        XCTAssertEqual(overridden.problem.split, device.problem.split)
        XCTAssertEqual(overridden.problem.gpuCores, 40)
        XCTAssertEqual(overridden.dispatches.map(\.threadgroupsPerGrid), device.dispatches.map(\.threadgroupsPerGrid))
        XCTAssertEqual(DispatchPlan.make(.forward, planned: nominal.problem).dispatches.map(\.threadgroupsPerGrid),
                       nominal.dispatches.map(\.threadgroupsPerGrid))
    }

    /// A context plans once, for its backend's core count, and its profile says which: a backend
    /// of 40 cores runs the plan made for 40 cores, not the nominal GPU's.
    func testContextPlansForItsBackendsCores() throws {
        let shape = AttentionShape(batch: 1, numHeads: 32, numKVHeads: 8, seqlenQ: 1, seqlenK: 4096, headDim: 64)
        let p = try Problem.validate(shape, causal: false, softmaxScale: nil)
        let backend = PlanRecorder(gpuCores: 40)
        let context = Context(backend: backend)
        try context.run(.forward, p, buffers: HostBuffers())
        let ran = try XCTUnwrap(backend.plans.first)
        XCTAssertEqual(backend.plans.count, 1)
        XCTAssertEqual(ran.problem.gpuCores, 40)
        XCTAssertEqual(ran.problem.split, try DispatchPlan.make(.forward, p, device: 40).problem.split)
        XCTAssertNotEqual(ran.problem.split, p.cpuSplit)
        XCTAssertEqual(context.lastProfile?.gpuCores, 40)
    }

    /// Masks, ALiBi and sinks bind their own buffers; sinks add the dsinks dispatch and output;
    /// causal folds into the window as right = 0.
    func testScoreModifiersInThePlan() throws {
        let shape = AttentionShape(batch: 2, numHeads: 4, numKVHeads: 2, seqlenQ: 10, seqlenK: 12, headDim: 16)
        let options = AttentionOptions(windowLeft: 5, windowRight: 3, softcap: 30,
                                       alibiSlopes: [Float](repeating: 0.1, count: 8), sinks: [1, 2, 3, 4],
                                       attnMask: .boolean([1], strides: TensorStrides(batch: 12, head: 0, seq: 0)))
        let p = try Problem.validate(shape, causal: true, softmaxScale: nil, options: options)
        XCTAssertEqual([p.params.window_left, p.params.window_right], [5, 0])
        XCTAssertEqual(p.params.alibi_batch_stride, 4)
        XCTAssertEqual(BufferRole.attnMask.byteCount(for: p), 1 * 12 + 12)
        XCTAssertEqual(BufferRole.alibiSlopes.elementCount(for: p), 8)
        let forward = DispatchPlan.forward(p).dispatches[0]
        XCTAssertEqual(forward.bindings.suffix(3), [BufferBinding(index: 6, role: .attnMask),
                                                    BufferBinding(index: 7, role: .alibiSlopes),
                                                    BufferBinding(index: 8, role: .sinks)])
        let backward = DispatchPlan.backward(p)
        XCTAssertEqual(backward.dispatches.map(\.kernelName).last, "flash_attention_backward_dsinks")
        XCTAssertEqual(backward.dispatches.last?.threadgroupsPerGrid, GridSize(width: 4, height: 1, depth: 1))
        XCTAssertEqual(backward.outputs, [.dq, .dk, .dv, .dsinks])
        XCTAssertThrowsError(try Problem.validate(shape, causal: false, softmaxScale: nil,
                                                  options: AttentionOptions(windowLeft: -2))) {
            XCTAssertEqual($0 as? FlashAttentionError, .invalidArgument(
                "window_left (-2) must be -1 (unbounded) or a number of keys from 0 to 2147483647"))
        }
        XCTAssertThrowsError(try Problem.validate(shape, causal: false, softmaxScale: nil,
                                                  options: AttentionOptions(softcap: -1))) {
            XCTAssertEqual($0 as? FlashAttentionError,
                           .invalidArgument("softcap (-1.0) must be finite and at least 0 (0 is off)"))
        }
    }
}

/// A backend of `gpuCores` cores that runs nothing and keeps the plans it is given.
private final class PlanRecorder: ExecutionBackend {
    let name: StaticString = "recorder"
    let deviceName = "test"
    let gpuCores: UInt32?
    private(set) var plans: [DispatchPlan] = []

    init(gpuCores: UInt32) { self.gpuCores = gpuCores }

    func execute(_ plan: DispatchPlan, buffers: HostBuffers, cancellation: CancellationToken) throws -> Profile {
        plans.append(plan)
        return Profile(seconds: 0, dispatches: [])
    }
}
