import CFlashAttentionMetal
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// How the split-KV forward divides the keys of each (batch, KV head) into chunks, or nil for the
/// dense forward. Two kernels write the chunks' partial results (merged by
/// `flash_attention_forward_combine`), each threadgroup reading its chunk of K and V once for a
/// block of packed query rows (the GQA group's, group x seqlen_q per KV head):
/// - `decode` (`flash_attention_forward_decode_<dtype>_d<DP>`, Shaders/flash_attention_decode.h)
///   for seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS when the packed rows fit one of its blocks
///   (`fa_decode_serves`: FA_DECODE_ROWS rows, head_dim_max <= FA_DECODE_MAX_HEAD_DIM), whatever
///   the length: the cache is read once per call;
/// - `spec` (`flash_attention_forward_spec_<dtype>_d<DP>`: the tiled split kernel with blocks of
///   FA_SPEC_BLOCK_Q packed rows, 16) in place of `tiled` below wherever one such block holds the
///   packed rows (`fa_spec_serves`: speculative-decoding verify widths and chunked prefill, 2-16
///   query rows times the group): one block per KV head and chunk, so the cache is read once per
///   call, with half the products per key of a 32-row block;
/// - `tiled` (`flash_attention_forward_split_<dtype>_d<DP>`) for the other seqlen_q <=
///   FA_SPLIT_MAX_QUERY_ROWS (large GQA groups, e.g. 32 query heads over 1 KV head, and head_dim
///   above 256), whose blocks of forward_block_q packed rows read the cache once per block where
///   decode blocks would read it once per FA_DECODE_ROWS rows; and up to
///   FA_SPLIT_TILED_MAX_QUERY_ROWS (speculative decoding, chunked prefill) when the dense grid
///   would give fewer threadgroups than the GPU's cores hold at once.
///
/// Chunks (docs/decode.md has the table): every core gets two waves of threadgroups,
/// 2 x cores x threadgroups resident per core, where the keys allow chunks of at least
/// FA_SPLIT_MIN_CHUNK_KEYS; chunk lengths are multiples of that. The plan depends on the shape and
/// the core count alone, so a shape is always computed the same way (bit-identical reruns, and
/// the CPU engine and a GPU of the same core count agree).
struct KeyValueSplit: Equatable {
    enum Kernel: Equatable {
        case decode
        case spec
        case tiled
    }

    let kernel: Kernel
    /// Chunks per (batch, KV head); at least 1 (seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS) or 2.
    let chunks: UInt32
    /// Keys per chunk, a multiple of FA_SPLIT_MIN_CHUNK_KEYS; the last chunk may be shorter.
    let chunkKeys: UInt32
    /// Threadgroups per chunk along x: blocks of packed query rows (group x seqlen_q), of
    /// FA_DECODE_ROWS rows (decode), FA_SPEC_BLOCK_Q rows (spec) or forward_block_q rows (tiled).
    let rowBlocks: UInt32

    init?(batch: UInt32, numHeads: UInt32, numKVHeads: UInt32, seqlenQ: UInt32, seqlenK: UInt32,
          bucket: FlashAttentionBucket, cores: UInt32) {
        let decodeShape = seqlenQ <= UInt32(FA_SPLIT_MAX_QUERY_ROWS)
        let packedRows = UInt64(numHeads / numKVHeads) * UInt64(seqlenQ)
        let kernel: Kernel
        let rowsPerBlock: UInt64
        let resident: UInt64
        if decodeShape && fa_decode_serves(bucket.head_dim_max, packedRows) != 0 {
            kernel = .decode
            rowsPerBlock = UInt64(fa_decode_rows(bucket.head_dim_max))
            resident = UInt64(FA_CORE_THREADGROUP_BYTES) / UInt64(fa_decode_threadgroup_bytes(bucket.head_dim_max))
        } else if seqlenQ <= UInt32(FA_SPLIT_TILED_MAX_QUERY_ROWS) {
            // The spec kernel wherever its one block holds the packed rows, the tiled one otherwise.
            let spec = fa_spec_serves(bucket.head_dim_max, bucket.forward_block_q, packedRows) != 0
            kernel = spec ? .spec : .tiled
            rowsPerBlock = UInt64(spec ? fa_spec_block_q(bucket.forward_block_q) : bucket.forward_block_q)
            resident = UInt64(FA_FORWARD_MIN_THREADGROUPS_PER_CORE)
            let denseRows = UInt64(bucket.forward_block_q)
            let dense = UInt64(batch) * UInt64(numHeads) * ((UInt64(seqlenQ) + denseRows - 1) / denseRows)
            guard decodeShape || dense < UInt64(cores) * resident else { return nil }
        } else {
            return nil
        }
        let rowBlocks = (packedRows + rowsPerBlock - 1) / rowsPerBlock
        let perChunk = UInt64(batch) * UInt64(numKVHeads) * rowBlocks
        let target = 2 * UInt64(cores) * max(resident, 1)
        let wanted = (target + perChunk - 1) / perChunk
        let granule = UInt64(FA_SPLIT_MIN_CHUNK_KEYS)
        let most = max(UInt64(seqlenK) / granule, 1)
        let chunks = min(wanted, most)
        let keys = (UInt64(seqlenK) + chunks - 1) / chunks
        // Rounded down: the chunks made are at least the chunks wanted (two waves at least).
        let chunkKeys = max(keys / granule, 1) * granule
        let made = (UInt64(seqlenK) + chunkKeys - 1) / chunkKeys
        // Decode shapes stay split even in one chunk: the dense forward would read the cache once
        // per query head.
        guard decodeShape || made >= 2 else { return nil }
        self.kernel = kernel
        self.chunks = UInt32(made)
        self.chunkKeys = UInt32(chunkKeys)
        self.rowBlocks = UInt32(rowBlocks)
    }

    /// Threadgroups of the chunks' dispatch.
    var threadgroups: UInt64 { UInt64(chunks) * UInt64(rowBlocks) }
}

/// The GPU core count plans are made for: `FLASH_ATTENTION_GPU_CORES` from the environment when set
/// (read each time the planner makes a plan: `DispatchPlan.make`), else the device's count where the backend reads one
/// (`ExecutionBackend.gpuCores`: the Metal backend, from the IORegistry; for `fa_plan_create`,
/// `libraryDevice`), else FA_NOMINAL_GPU_CORES, the nominal GPU of the CPU engine (so its results
/// never depend on the machine). Tests and users set the variable to plan for another GPU; the
/// split-KV chunking (`KeyValueSplit`) and the dK/dV group split (`GroupSplit`) are its readers.
enum GPUCores {
    static let environmentVariable = "FLASH_ATTENTION_GPU_CORES"
    static let limit: UInt32 = 4096

    /// Where a planned count comes from (`fa_gpu_cores_source`).
    enum Source: Equatable {
        case nominal, device, override

        var abi: fa_gpu_cores_source {
            switch self {
            case .nominal: return FA_GPU_CORES_NOMINAL
            case .device: return FA_GPU_CORES_DEVICE
            case .override: return FA_GPU_CORES_OVERRIDE
            }
        }
    }

    /// The override's value, else `device` (clamped to 1...limit), else FA_NOMINAL_GPU_CORES; and
    /// which of the three it is.
    /// - Throws: `invalidArgument` when the variable is set but not a whole number in 1...4096.
    static func plan(device: UInt32?) throws -> (cores: UInt32, source: Source) {
        guard let value = getenv(environmentVariable) else {
            guard let device else { return (UInt32(FA_NOMINAL_GPU_CORES), .nominal) }
            return (min(max(device, 1), limit), .device)
        }
        let text = String(cString: value)
        guard let cores = UInt32(text), (1...limit).contains(cores) else {
            throw FlashAttentionError.invalidArgument(
                "\(environmentVariable) (\(text)) must be a whole number of GPU cores from 1 to \(limit)")
        }
        return (cores, .override)
    }

    /// `plan(device:)`'s count.
    static func planned(device: UInt32? = nil) throws -> UInt32 { try plan(device: device).cores }

    /// The core count of the Metal device the library runs on (the one a Metal context takes), read
    /// once per process; nil off Metal or when the device gives none. What `fa_plan_create` plans
    /// for: its hosts (PyTorch's MPS and MLX's GPU paths) encode the plan on that device.
    static var libraryDevice: UInt32? {
        #if canImport(Metal)
        return MetalBackend.defaultDeviceCores
        #else
        return nil
        #endif
    }
}
