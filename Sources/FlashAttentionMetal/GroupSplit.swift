import CFlashAttentionMetal
import MSLEngine

/// How the backward's dK/dV cuts each KV head's GQA group over threadgroups (few KV heads: MQA,
/// Gemma). Unsplit, `flash_attention_backward_dkv_<dtype>_d<DP>` runs one threadgroup per (batch
/// entry, KV head, key block), each summing over the whole group, so a problem with one or two KV
/// heads has few, long threadgroups. Split, `flash_attention_backward_dkv_split_<dtype>_d<DP>` runs
/// `splits` threadgroups per key block, each over consecutive query heads, writing float32 partial
/// sums that `flash_attention_backward_dkv_reduce_<dtype>` adds in split order (no atomics).
///
/// The measure is occupancy over the dispatch: with R threadgroups resident per core (the kernel's
/// threadgroup bytes against FA_CORE_THREADGROUP_BYTES) and C cores, n equal threadgroups run in
/// ceil(n / (C R)) waves, and the slots are busy n / (ceil(n / (C R)) C R) of the time. A split of
/// s threadgroups per key block makes n s threadgroups, each 1 / s as long. The plan keeps the
/// unsplit grid when that is at least FA_DKV_SPLIT_MIN_OCCUPANCY percent; otherwise it takes the
/// smallest divisor s of the group that reaches it, or, where none does, the divisor with the
/// highest occupancy (the smallest of equals) among those that give at most 10 waves. The split
/// never exceeds `maxSplits(for:)`, the most splits whose two float32 workspaces (`partial_dk`,
/// `partial_dv`) fit FA_DKV_SPLIT_MAX_WORKSPACE_BYTES together: a huge problem's workspace stays
/// bounded (it takes fewer splits, or none). Like `KeyValueSplit`, the answer depends on the shape
/// and the planned core count alone: a plan computes a shape the same way every time (bit-identical
/// reruns; the CPU engine and a GPU of that core count agree). Different split counts add the same
/// products in different groupings, so their results differ in rounding only (docs/performance.md).
enum GroupSplit {
    /// Splits per key block for a grid of `keyBlocks` x `kvHeads` x `batch` unsplit threadgroups of
    /// a group of `group` query heads, on `cores` cores that each hold `resident` threadgroups, at
    /// most `maxSplits` (the workspace bound).
    static func splits(keyBlocks: UInt32, kvHeads: UInt32, batch: UInt32, group: UInt32, cores: UInt32,
                       resident: UInt32, maxSplits: UInt32) -> UInt32 {
        let threadgroups = UInt64(keyBlocks) * UInt64(kvHeads) * UInt64(batch)
        let slots = UInt64(cores) * UInt64(max(resident, 1))
        // Busy slot-time over the dispatch's slot-time, as a fraction n / d.
        func occupancy(_ s: UInt32) -> (busy: UInt64, total: UInt64) {
            let n = threadgroups * UInt64(s)
            return (n, (n + slots - 1) / slots * slots)
        }
        func atLeast(_ a: (busy: UInt64, total: UInt64), percent: UInt64) -> Bool {
            a.busy * 100 >= a.total * percent
        }
        let percent = UInt64(FA_DKV_SPLIT_MIN_OCCUPANCY)
        guard group > 1, maxSplits > 1, !atLeast(occupancy(1), percent: percent) else { return 1 }
        // From 10 waves on the occupancy is above 90 %: no larger split is tried (this also bounds
        // the loop, and the split grid, for huge groups).
        let limit = UInt32(min(UInt64(group), UInt64(maxSplits), (10 * slots + threadgroups - 1) / max(threadgroups, 1)))
        var best: UInt32 = 1
        for s in stride(from: UInt32(2), through: limit, by: 1) where group % s == 0 {
            let o = occupancy(s)
            if atLeast(o, percent: percent) { return s }
            let b = occupancy(best)
            if o.busy * b.total > b.busy * o.total { best = s }
        }
        return best
    }

    /// `splits` for `problem` (the grid its backward would run) on `cores` cores, with the dK/dV
    /// kernel's threadgroup bytes as the CPU engine compiles them (the same source as Metal's).
    static func splits(for problem: Problem, cores: UInt32) -> UInt32 {
        let kernel = CatalogueKernel.kernel(Int(FA_KERNEL_backward_dkv)).instanceName(for: problem)
        var info = msl_engine_kernel_info()
        let bytes = msl_engine_describe_kernel(kernel, &info) != 0 ? info.threadgroup_memory_length : 0
        let resident = bytes == 0 ? 1 : max(1, Int(FA_CORE_THREADGROUP_BYTES) / bytes)
        let block = problem.bucket.dkv_block_k
        let keyBlocks = problem.gridSeqlenK / block + (problem.gridSeqlenK % block == 0 ? 0 : 1)
        return splits(keyBlocks: keyBlocks, kvHeads: problem.numKVHeads, batch: problem.gridBatch,
                      group: problem.groupSize, cores: cores, resident: UInt32(resident),
                      maxSplits: maxSplits(for: problem))
    }

    /// Rows of `partial_dk` and of `partial_dv` for `splits` splits: [batch][num_kv_heads][splits]
    /// [seqlen_k] (a varlen problem's seqlen_k is the packed total).
    static func workspaceRows(for problem: Problem, splits: UInt32) -> Int {
        Int(problem.batch) * Int(problem.numKVHeads) * Int(splits) * Int(problem.seqlenK)
    }

    /// The most splits whose two workspaces (float32 rows of head_dim and head_dim_v) take at most
    /// FA_DKV_SPLIT_MAX_WORKSPACE_BYTES together (at least 1; up to UInt32.max).
    static func maxSplits(for problem: Problem) -> UInt32 {
        let perSplit = workspaceRows(for: problem, splits: 1) * (Int(problem.headDim) + Int(problem.headDimV)) * 4
        return UInt32(min(Int(FA_DKV_SPLIT_MAX_WORKSPACE_BYTES) / max(perSplit, 1), Int(UInt32.max)))
    }
}
