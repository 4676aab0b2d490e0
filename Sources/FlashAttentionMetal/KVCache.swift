#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

/// The KV cache a forward problem reads `k` and `v` from (fa_problem's `kv_*` fields, documented
/// in the C header): contiguous per sequence or paged through a block table, elements of the dtype
/// or mx.quantize's affine format. The kernels (Shaders/flash_attention_kv_cache.h) address rows
/// through it and dequantize in registers.
struct KVCacheSpec {
    /// Rows per sequence (contiguous) or per block (paged).
    let cacheRows: UInt32
    /// Whether rows are found through the block table.
    let paged: Bool
    /// Entries per row of the block table (paged), else 1.
    let maxBlocks: UInt32
    /// Blocks of the cache (paged), else the batch.
    let slots: UInt32
    /// 0: elements of the dtype; 4 or 8: packed words.
    let bits: UInt32
    let groupSize: UInt32

    var quantized: Bool { bits != 0 }

    /// Units (elements, or uint32 words when quantized) of a row of `cols` elements.
    func units(_ cols: UInt32) -> Int { quantized ? Int(cols * bits / 32) : Int(cols) }

    /// Scale (and bias) entries of a row of `cols` elements.
    func groups(_ cols: UInt32) -> Int { quantized ? Int(cols / groupSize) : 0 }

    /// Checks the `kv_*` fields of `p` (nil when `kv_cache_rows` is 0: plain k and v). Pointers
    /// are not read (a plan's problem may hold markers): `checkBlockTable` reads the table.
    static func validate(_ p: fa_problem) throws -> KVCacheSpec? {
        guard p.kv_cache_rows != 0 else {
            guard p.kv_block_table == nil && p.kv_bits == 0 && p.k_scales == nil && p.v_scales == nil else {
                throw FlashAttentionError.invalidArgument(
                    "kv_cache_rows is 0 (plain k and v), but kv_block_table, kv_bits or scales are set")
            }
            return nil
        }
        let headDimV = p.head_dim_v == 0 ? p.head_dim : p.head_dim_v
        guard [0, 4, 8].contains(p.kv_bits) else {
            throw FlashAttentionError.invalidArgument("kv_bits (\(p.kv_bits)) must be 0, 4 or 8")
        }
        if p.kv_bits != 0 {
            guard [32, 64, 128].contains(p.kv_group_size) else {
                throw FlashAttentionError.invalidArgument("kv_group_size (\(p.kv_group_size)) must be 32, 64 or 128")
            }
            guard p.head_dim % p.kv_group_size == 0 && headDimV % p.kv_group_size == 0 else {
                throw FlashAttentionError.invalidArgument(
                    "head_dim (\(p.head_dim)) and head_dim_v (\(headDimV)) must be multiples of kv_group_size (\(p.kv_group_size))")
            }
            guard p.k_scales != nil && p.k_biases != nil && p.v_scales != nil && p.v_biases != nil else {
                throw FlashAttentionError.invalidArgument("a quantized cache (kv_bits \(p.kv_bits)) needs k_scales, k_biases, v_scales and v_biases")
            }
        } else if p.k_scales != nil || p.k_biases != nil || p.v_scales != nil || p.v_biases != nil {
            throw FlashAttentionError.invalidArgument("scales and biases are given but kv_bits is 0")
        }
        let paged = p.kv_block_table != nil
        let rows = UInt64(p.kv_cache_rows)
        if paged {
            guard p.kv_max_blocks >= 1 && p.kv_num_blocks >= 1 else {
                throw FlashAttentionError.invalidArgument(
                    "kv_max_blocks (\(p.kv_max_blocks)) and kv_num_blocks (\(p.kv_num_blocks)) must be at least 1 with a block table")
            }
            // The table's batch x kv_max_blocks int32 entries must have a size (the plan binds it whole).
            _ = try TensorLayout.checkedCount([Int(p.batch), Int(p.kv_max_blocks)], bytesPerElement: 4,
                                              of: "kv_block_table")
        }
        let capacity = paged ? UInt64(p.kv_max_blocks) * rows : rows
        guard UInt64(p.seqlen_k) <= capacity else {
            throw FlashAttentionError.invalidArgument(
                "seqlen_k (\(p.seqlen_k)) must be at most the cache's capacity (\(capacity) rows per sequence)")
        }
        return KVCacheSpec(cacheRows: p.kv_cache_rows, paged: paged, maxBlocks: paged ? p.kv_max_blocks : 1,
                           slots: paged ? p.kv_num_blocks : p.batch, bits: p.kv_bits,
                           groupSize: p.kv_bits == 0 ? 0 : p.kv_group_size)
    }

    /// Checks, in host memory, every entry of `table` (the caller's kv_block_table of `problem`)
    /// that holds one of the first seqlen_k rows of a batch element: in [0, kv_num_blocks). The
    /// kernels clamp the entries anyway; this turns a wrong table into an error before dispatch.
    func checkBlockTable(_ table: UnsafePointer<Int32>?, _ problem: Problem) throws {
        guard paged, let table else { return }
        let used = (Int(problem.seqlenK) + Int(cacheRows) - 1) / Int(cacheRows)
        for b in 0..<Int(problem.batch) {
            for i in 0..<used {
                let entry = table[b * Int(maxBlocks) + i]
                guard entry >= 0 && UInt32(entry) < slots else {
                    throw FlashAttentionError.invalidArgument(
                        "kv_block_table[\(b)][\(i)] (\(entry)) must lie in [0, kv_num_blocks = \(slots)): it holds rows of batch element \(b)")
                }
            }
        }
    }

    /// Checks that the strides of a quantized cache tensor are whole rows of words (so that its
    /// scales and biases are laid out like it, a row's groups where its words are).
    func checkStrides(_ layout: TensorLayout, cols: UInt32, name: String) throws {
        guard quantized else { return }
        let words = units(cols)
        let s = layout.strides
        guard s.batch % words == 0 && s.head % words == 0 && s.seq % words == 0 else {
            throw FlashAttentionError.invalidArgument(
                "\(name) strides (\(s.batch), \(s.head), \(s.seq)) must be multiples of its words per row (\(words)) in a quantized cache")
        }
    }

    /// Elements of the scales (or biases) that go with a quantized cache tensor laid out by
    /// `layout`, whose rows hold `cols` elements.
    func scaleCount(_ layout: TensorLayout, cols: UInt32) -> Int {
        guard quantized else { return 0 }
        return (layout.extent - units(cols)) / units(cols) * groups(cols) + groups(cols)
    }

    /// The kernels' fields.
    func apply(to params: inout FlashAttentionParams) {
        params.kv_page_rows = paged ? cacheRows : 0
        params.kv_max_blocks = maxBlocks
        params.kv_num_blocks = slots
        params.kv_bits = bits
        params.kv_group_size = groupSize
    }
}

/// A KV cache for ``FlashAttention/forward(q:cache:out:lse:shape:causal:softmaxScale:)``: the keys
/// and values of `shape.batch` sequences, contiguous (`blockTable` nil: `[batch][numKVHeads][rows]
/// [headDim]`) or paged (`[numBlocks][numKVHeads][rows][headDim]`, `rows` the page_block_size, row t
/// of sequence b in block `blockTable[b * maxBlocks + t / rows]`), elements of the call's dtype or,
/// with `bits` 4 or 8, mx.quantize's packed uint32 words with `kScales`, `kBiases`, `vScales`,
/// `vBiases` (one element of the dtype per `groupSize` elements of a row, laid out like the words).
/// The fields mirror fa_problem's `kv_*` fields (flash_attention_metal.h has the full rules). Each
/// buffer must hold at least the bytes the layout spans; the memory must stay valid for the call.
/// Allocate caches with ``allocate(byteCount:)`` so that the Metal backend reads them in place.
public struct AttentionKVCache {
    public var k: UnsafeRawBufferPointer
    public var v: UnsafeRawBufferPointer
    /// Rows per sequence (contiguous) or per block (paged), >= seqlenK (contiguous).
    public var rows: Int
    public var blockTable: UnsafeBufferPointer<Int32>?
    public var maxBlocks: Int
    public var numBlocks: Int
    public var bits: Int
    public var groupSize: Int
    public var kScales: UnsafeRawBufferPointer?
    public var kBiases: UnsafeRawBufferPointer?
    public var vScales: UnsafeRawBufferPointer?
    public var vBiases: UnsafeRawBufferPointer?

    /// A cache of plain elements; pass `blockTable`, `maxBlocks` and `numBlocks` for a paged one.
    public init(k: UnsafeRawBufferPointer, v: UnsafeRawBufferPointer, rows: Int,
                blockTable: UnsafeBufferPointer<Int32>? = nil, maxBlocks: Int = 0, numBlocks: Int = 0,
                bits: Int = 0, groupSize: Int = 0, kScales: UnsafeRawBufferPointer? = nil,
                kBiases: UnsafeRawBufferPointer? = nil, vScales: UnsafeRawBufferPointer? = nil,
                vBiases: UnsafeRawBufferPointer? = nil) {
        self.k = k
        self.v = v
        self.rows = rows
        self.blockTable = blockTable
        self.maxBlocks = maxBlocks
        self.numBlocks = numBlocks
        self.bits = bits
        self.groupSize = groupSize
        self.kScales = kScales
        self.kBiases = kBiases
        self.vScales = vScales
        self.vBiases = vBiases
    }
}

extension AttentionKVCache {
    /// The granule of memory that the Metal backend reads in place: the VM page, 16 KiB on Apple
    /// silicon (at least that everywhere, a multiple of any smaller page).
    public static let pageBytes = max(Int(sysconf(Int32(_SC_PAGESIZE))), 1 << 14)

    /// Zero-filled memory for one cache tensor of `byteCount` bytes (`k`, `v`, or a quantized
    /// cache's words, scales or biases) in an anonymous mapping that starts on a page and spans
    /// whole pages (at least one): memory the Metal backend wraps in place rather than copying it
    /// on every call, since makeBuffer(bytesNoCopy:length:options:deallocator:) takes a
    /// page-aligned pointer and length, in memory from mmap or vm_allocate, not malloc (Apple's
    /// newBufferWithBytesNoCopy documentation). Append new rows into it directly: on unified memory
    /// the GPU reads the very same pages. Free it with ``deallocate(_:)``.
    /// - Throws: `outOfMemory` when the system gives no mapping of that size.
    public static func allocate(byteCount: Int) throws -> UnsafeMutableRawBufferPointer {
        let length = max(1, (max(byteCount, 0) + pageBytes - 1) / pageBytes) * pageBytes
        // One page more than needed, trimmed to a pageBytes multiple where the VM page is smaller.
        guard let mapped = mmap(nil, length + pageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0),
              mapped != UnsafeMutableRawPointer(bitPattern: -1) else {
            throw FlashAttentionError.outOfMemory("mmap of \(length + pageBytes) bytes for a KV cache failed")
        }
        let head = (pageBytes - Int(bitPattern: mapped) % pageBytes) % pageBytes
        if head > 0 { munmap(mapped, head) }
        munmap(mapped + head + length, pageBytes - head)
        return UnsafeMutableRawBufferPointer(start: mapped + head, count: length)
    }

    /// Frees memory from ``allocate(byteCount:)``.
    public static func deallocate(_ memory: UnsafeMutableRawBufferPointer) {
        if let base = memory.baseAddress { munmap(base, memory.count) }
    }
}

extension FlashAttention {
    /// Forward pass over a KV cache (no append: write new rows into the cache first): `q`, `out`
    /// and `lse` as in ``forward(q:k:v:out:lse:shape:causal:softmaxScale:options:)`` (contiguous),
    /// `shape.seqlenK` keys of every sequence read through `cache`, bottom-right causal when
    /// `causal`. Score options beyond causal and the scale: the C ABI (`fa_forward`'s `kv_*` fields).
    /// - Throws: `invalidArgument` for a wrong size, a cache field outside its rule, a buffer smaller
    ///   than its layout or a block-table entry outside `[0, numBlocks)` (checked before any kernel
    ///   runs; the kernels clamp entries as well).
    public func forward<Element: AttentionElement>(
        q: UnsafeBufferPointer<Element>, cache: AttentionKVCache, out: UnsafeMutableBufferPointer<Element>,
        lse: UnsafeMutableBufferPointer<Float>, shape: AttentionShape, causal: Bool = false, softmaxScale: Float? = nil
    ) throws {
        func u32(_ value: Int, _ name: String) throws -> UInt32 {
            guard let v = UInt32(exactly: value) else {
                throw FlashAttentionError.invalidArgument("\(name) (\(value)) must lie in 0 ... \(UInt32.max)")
            }
            return v
        }
        var d = fa_problem()
        d.struct_size = UInt32(MemoryLayout<fa_problem>.size)
        (d.batch, d.num_heads, d.num_kv_heads) = (try u32(shape.batch, "batch"), try u32(shape.numHeads, "num_heads"),
                                                  try u32(shape.numKVHeads, "num_kv_heads"))
        (d.seqlen_q, d.seqlen_k) = (try u32(shape.seqlenQ, "seqlen_q"), try u32(shape.seqlenK, "seqlen_k"))
        (d.head_dim, d.head_dim_v) = (try u32(shape.headDim, "head_dim"), try u32(shape.headDimV, "head_dim_v"))
        d.causal = causal ? 1 : 0
        d.softmax_scale = softmaxScale ?? 1 / Float(max(shape.headDim, 1)).squareRoot()
        d.dtype = Element.attentionDType.rawValue
        d.kv_cache_rows = try u32(cache.rows, "rows")
        d.kv_block_table = cache.blockTable?.baseAddress
        d.kv_max_blocks = try u32(cache.maxBlocks, "maxBlocks")
        d.kv_num_blocks = try u32(cache.numBlocks, "numBlocks")
        d.kv_bits = try u32(cache.bits, "bits")
        d.kv_group_size = try u32(cache.groupSize, "groupSize")
        (d.k_scales, d.k_biases) = (cache.kScales?.baseAddress, cache.kBiases?.baseAddress)
        (d.v_scales, d.v_biases) = (cache.vScales?.baseAddress, cache.vBiases?.baseAddress)
        guard d.kv_cache_rows > 0 else {
            throw FlashAttentionError.invalidArgument("rows (0) must be at least 1")
        }
        try withAutoreleasePool {
            let p = try Problem.validate(d)
            if let table = cache.blockTable, table.count < Int(p.batch) * Int(d.kv_max_blocks) {
                throw FlashAttentionError.invalidArgument(
                    "blockTable has \(table.count) entries; batch x maxBlocks is \(Int(p.batch) * Int(d.kv_max_blocks))")
            }
            try p.kvCache?.checkBlockTable(d.kv_block_table, p)
            var buffers = HostBuffers()
            func bind(_ role: BufferRole, _ bytes: UnsafeRawBufferPointer?) throws {
                guard let bytes, let base = bytes.baseAddress, bytes.count >= role.byteCount(for: p) else {
                    throw FlashAttentionError.invalidArgument(
                        "\(role.name) must hold at least \(role.byteCount(for: p)) bytes, got \(bytes?.count ?? 0)")
                }
                buffers.bindInput(role, base, for: p)
            }
            try bind(.q, UnsafeRawBufferPointer(q))
            try bind(.k, cache.k)
            try bind(.v, cache.v)
            if let table = cache.blockTable { try bind(.blockTable, UnsafeRawBufferPointer(table)) }
            if cache.bits != 0 {
                for (role, bytes) in [(BufferRole.kScales, cache.kScales), (.kBiases, cache.kBiases),
                                      (.vScales, cache.vScales), (.vBiases, cache.vBiases)] {
                    try bind(role, bytes)
                }
            }
            for (role, bytes) in [(BufferRole.out, UnsafeMutableRawBufferPointer(out)),
                                  (.lse, UnsafeMutableRawBufferPointer(lse))] {
                guard let base = bytes.baseAddress, bytes.count == role.byteCount(for: p) else {
                    throw FlashAttentionError.invalidArgument(
                        "\(role.name) must hold \(role.byteCount(for: p)) bytes, got \(bytes.count)")
                }
                buffers.bindOutput(role, base, for: p)
            }
            try context.run(.forward, p, buffers: buffers)
        }
    }
}
