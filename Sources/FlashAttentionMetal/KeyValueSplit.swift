import CFlashAttentionMetal

/// How the split-KV forward (decode: few query rows over a long KV cache) divides the keys of each
/// (batch, KV head) into chunks, or nil for the dense forward. The rule and its reasons are at
/// FA_SPLIT_MAX_QUERY_ROWS in flash_attention_params.h; it depends on the shape alone, so a shape
/// is always computed the same way (bit-identical reruns).
struct KeyValueSplit: Equatable {
    /// Chunks per (batch, KV head); at least 2.
    let chunks: UInt32
    /// Keys per chunk, a multiple of the forward key tile; the last chunk may be shorter.
    let chunkKeys: UInt32
    /// Threadgroups per chunk along x: blocks of forward_block_q packed query rows (group x seqlen_q).
    let rowBlocks: UInt32

    init?(batch: UInt32, numHeads: UInt32, numKVHeads: UInt32, seqlenQ: UInt32, seqlenK: UInt32,
          bucket: FlashAttentionBucket) {
        guard seqlenQ <= UInt32(FA_SPLIT_MAX_QUERY_ROWS) else { return nil }
        let packedRows = UInt64(numHeads / numKVHeads) * UInt64(seqlenQ)
        let rowBlocks = (packedRows + UInt64(bucket.forward_block_q) - 1) / UInt64(bucket.forward_block_q)
        let perChunk = UInt64(batch) * UInt64(numKVHeads) * rowBlocks
        let wanted = (UInt64(FA_SPLIT_TARGET_THREADGROUPS) + perChunk - 1) / perChunk
        let most = UInt64(seqlenK) / UInt64(FA_SPLIT_MIN_CHUNK_KEYS)
        let chunks = min(wanted, most)
        guard chunks >= 2 else { return nil }
        let tile = UInt64(bucket.forward_block_k)
        let keys = (UInt64(seqlenK) + chunks - 1) / chunks
        let chunkKeys = (keys + tile - 1) / tile * tile
        self.chunks = UInt32((UInt64(seqlenK) + chunkKeys - 1) / chunkKeys)
        self.chunkKeys = UInt32(chunkKeys)
        self.rowBlocks = UInt32(rowBlocks)
    }
}
