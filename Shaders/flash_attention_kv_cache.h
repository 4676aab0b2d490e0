// K/V read from a KV cache as inference engines keep it (flash_attn_with_kvcache): rows addressed
// through a block table (paged) or per sequence (contiguous), stored as the dtype or quantized in
// MLX's affine format (mx.quantize: packed uint32 words of `bits`-bit integers, element j of a row
// in bits [bits * (j % (32 / bits)), + bits) of word j / (32 / bits); one scale and one bias per
// group of `group_size` elements, in the dtype; w = scale * q + bias; ml-explore/mlx
// mlx/ops.cpp, facts only). Values are dequantized in registers as they are loaded: no
// dequantized copy exists in device memory.
//
// The addressing is one small inline function (kv_row) and the loads two (kv_elements, kv_chunk),
// so any kernel can fetch a key or value row slice: the forward kernels copy 16-byte chunks into
// their threadgroup tiles (CacheStream below); a decode kernel whose lanes hold N contiguous
// elements of a row calls kv_elements.
//
// Bounds: every block table value is clamped into [0, kv_num_blocks) and every block index into
// [0, kv_max_blocks), so a wrong table gives wrong numbers but never an access outside the cache
// (the hosts reject such tables before dispatch; the clamps are for memory safety alone).

// One KV head of one sequence of a cache. Offsets count the units of `data`: T elements, or
// uint32 words when quantized (bits 4 or 8).
template <typename T>
struct KVCacheHead {
    device const T *data;     // the head's row 0 (contiguous) or block 0's row 0 (paged)
    device const T *scales;   // quantized: the scales and biases of the same rows, group_size
    device const T *biases;   //   elements per entry, laid out like data (words -> groups)
    device const int *table;  // paged: the sequence's row of block_table
    ulong block_stride;       // paged: units between blocks
    ulong row_stride;         // units between rows
    ulong scale_block_stride; // the same for scales and biases
    ulong scale_row_stride;
    uint page_rows;           // rows per block; 0: contiguous
    uint max_blocks;          // entries of the table row
    uint num_blocks;          // blocks of the cache
    uint bits;                // 0: unquantized; 4 or 8
    uint group_size;
};

// Where row t of the head lies: its offset in data, and in scales/biases (quantized). The only
// division per row is t / page_rows (paged caches).
template <typename T>
inline ulong kv_row(thread const KVCacheHead<T> &c, uint t, thread ulong &scale_row) {
    if (c.page_rows == 0) {
        scale_row = ulong(t) * c.scale_row_stride;
        return ulong(t) * c.row_stride;
    }
    const uint block = min(t / c.page_rows, c.max_blocks - 1);
    FA_DEVICE_READ(c.table + block, 4);
    const uint page = uint(min(max(c.table[block], 0), int(c.num_blocks) - 1));
    const uint r = t - (t / c.page_rows) * c.page_rows;
    scale_row = ulong(page) * c.scale_block_stride + ulong(r) * c.scale_row_stride;
    return ulong(page) * c.block_stride + ulong(r) * c.row_stride;
}

// Elements [col, col + N) of row t as float (N <= 8, col a multiple of N: one quantization group),
// columns at or past `cols` zero.
template <uint N, typename T>
inline void kv_elements(thread const KVCacheHead<T> &c, uint t, uint col, uint cols, thread float *x) {
    ulong scale_row;
    const ulong row = kv_row(c, t, scale_row);
    if (c.bits == 0) {
        FA_UNROLL
        for (uint e = 0; e < N; ++e) {
            x[e] = 0.0f;
            if (col + e < cols) {
                FA_DEVICE_READ(c.data + row + col + e, sizeof(T));
                x[e] = float(c.data[row + col + e]);
            }
        }
        return;
    }
    // The N elements lie in one group and in at most two words (N * bits <= 64, col a multiple of
    // N): each word, the scale and the bias are loaded once.
    device const uint *words = (device const uint *)c.data + row;
    const uint first_bit = col * c.bits;
    const uint w0 = first_bit / 32;
    const bool two = (first_bit % 32) + N * c.bits > 32;
    const ulong group = scale_row + col / c.group_size;
    FA_DEVICE_READ(words + w0, two ? 8 : 4);
    FA_DEVICE_READ(c.scales + group, sizeof(T));
    FA_DEVICE_READ(c.biases + group, sizeof(T));
    const uint lo = words[w0];
    const uint hi = two ? words[w0 + 1] : 0u;
    const float scale = float(c.scales[group]);
    const float bias = float(c.biases[group]);
    const uint mask = (1u << c.bits) - 1u;
    FA_UNROLL
    for (uint e = 0; e < N; ++e) {
        const uint bit = first_bit % 32 + e * c.bits;
        const uint q = ((bit < 32 ? lo >> bit : hi >> (bit - 32))) & mask;
        x[e] = col + e < cols ? scale * float(q) + bias : 0.0f;
    }
}

// The 16-byte chunk `chunk` of row t in the threadgroup tile format (flash_attention_loader.h):
// moved as is when unquantized and aligned (`scalar` 0), else built element by element.
template <typename T>
inline uint4 kv_chunk(thread const KVCacheHead<T> &c, uint t, uint chunk, uint cols, bool scalar) {
    constexpr uint V = FA_CHUNK_BYTES / sizeof(T);
    constexpr uint PER_WORD = TileWords<T>::PER_WORD;
    if (c.bits == 0 && !scalar) {
        ulong scale_row;
        device const T *at = c.data + kv_row(c, t, scale_row) + chunk * V;
        FA_DEVICE_READ(at, FA_CHUNK_BYTES);
        return *(device const uint4 *)at;
    }
    float x[V];
    kv_elements<V>(c, t, chunk * V, cols, x);
    uint4 out = uint4(0);
    FA_UNROLL
    for (uint e = 0; e < V; ++e) {
        out[e / PER_WORD] |= TileWords<T>::bits(T(x[e])) << (16 * (e % PER_WORD));
    }
    return out;
}

// The cache of one KV head of batch element b (K: strides p.k, head_dim; V: p.v, head_dim_v),
// whose data, scales and biases start at the buffers given.
template <typename T>
inline KVCacheHead<T> kv_cache_head(constant FlashAttentionParams &p, device const T *data,
                                    device const T *scales, device const T *biases,
                                    device const int *table, constant FlashAttentionStrides &s,
                                    uint b, uint kv_head, uint cols) {
    KVCacheHead<T> c;
    const bool paged = p.kv_page_rows != 0;
    c.page_rows = p.kv_page_rows;
    c.max_blocks = max(p.kv_max_blocks, 1u);
    c.num_blocks = max(p.kv_num_blocks, 1u);
    c.bits = p.kv_bits;
    c.group_size = max(p.kv_group_size, 1u);
    c.table = table + (paged ? ulong(b) * p.kv_max_blocks : 0);
    c.block_stride = s.batch;
    c.row_stride = s.seq;
    // Scales and biases are laid out like the packed words, a group's entry per row's words.
    const uint words = c.bits == 0 ? 1 : cols * c.bits / 32;
    const uint groups = c.bits == 0 ? 1 : cols / c.group_size;
    c.scale_block_stride = s.batch / words * groups;
    c.scale_row_stride = s.seq / words * groups;
    const ulong first = paged ? ulong(kv_head) * s.head : head_offset(s, b, kv_head);
    const ulong scale_first = paged ? ulong(kv_head) * (s.head / words * groups)
                                    : (ulong(b) * s.batch + ulong(kv_head) * s.head) / words * groups;
    c.data = c.bits == 0 ? data + first : (device const T *)((device const uint *)data + first);
    c.scales = scales + scale_first;
    c.biases = biases + scale_first;
    return c;
}

// One thread's part of copying tiles of ROWS rows of a cache head into threadgroup tiles DP
// columns wide, as TileStream does for a plain tensor (the same (row, chunk) per thread), each row
// addressed through kv_row.
template <typename T, uint ROWS, uint DP>
struct CacheStream {
    typedef T element;
    typedef TileStream<T, ROWS, DP> Geometry;  // V, CHUNKS, STEP, PASSES: TileStream's
    KVCacheHead<T> head;
    uint seqlen;
    uint cols;
    uint row;   // the thread's first row in a tile (ROWS or more: none)
    uint chunk;
    bool cols_inside;
};

template <typename T, uint ROWS, uint DP>
inline CacheStream<T, ROWS, DP> cache_stream(KVCacheHead<T> head, uint seqlen, uint cols, uint tid) {
    typedef TileStream<T, ROWS, DP> S;
    CacheStream<T, ROWS, DP> s;
    s.head = head;
    s.seqlen = seqlen;
    s.cols = cols;
    s.row = tid < S::STEP * S::CHUNKS ? tid / S::CHUNKS : ROWS;
    s.chunk = tid % S::CHUNKS;
    s.cols_inside = s.chunk * S::V < cols;
    return s;
}

// The chunk of a paired tile (PairedRows, flash_attention_loader.h) that holds columns
// [col, col + 4) of rows t and t + 1 (t even): word i is (t, col + i) | (t + 1, col + i) << 16.
template <typename T, uint ROWS, uint DP>
inline uint4 kv_pair_chunk(thread const CacheStream<T, ROWS, DP> &s, uint t, uint col) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (t < s.seqlen) {
        kv_elements<4>(s.head, t, col, s.cols, a);
    }
    if (t + 1 < s.seqlen) {
        kv_elements<4>(s.head, t + 1, col, s.cols, b);
    }
    uint4 out;
    FA_UNROLL
    for (uint i = 0; i < 4; ++i) {
        out[i] = TileWords<T>::bits(T(a[i])) | (TileWords<T>::bits(T(b[i])) << 16);
    }
    return out;
}

// Copies rows [first, first + ROWS) of the cache head into `tile` (zero past seqlen and cols),
// row-major or, PAIRED, in the paired layout: the thread's (tile row, chunk) is then a chunk of
// the pair of rows it holds, built from both rows (no shuffles: rows are fetched one by one).
template <uint ROWS, uint DP, bool PAIRED = false, typename T, typename Tile>
inline void load_tile(Tile tile, thread CacheStream<T, ROWS, DP> &s, uint first,
                      constant FlashAttentionParams &p, uint tid) {
    typedef typename CacheStream<T, ROWS, DP>::Geometry S;
    static_assert(!PAIRED || (PairedRows<T, DP>::ON != 0 && ROWS % 2 == 0),
                  "paired tiles need whole row pairs of a 2-byte type");
    FA_UNROLL
    for (uint k = 0; k < S::PASSES; ++k) {
        const uint r = s.row + k * S::STEP;
        if (r < ROWS) {
            const uint t = first + r;
            if (PAIRED) {
                tile[r][s.chunk] = kv_pair_chunk(s, t - r % 2, r % 2 * (DP / 2) + s.chunk * 4);
            } else {
                tile[r][s.chunk] = s.cols_inside && t < s.seqlen
                                       ? kv_chunk(s.head, t, s.chunk, s.cols, p.scalar_copies != 0)
                                       : uint4(0);
            }
        }
    }
}

// The K/V source of the forward kernels for a cache: streams over batch element b's KV head.
template <typename T>
struct CacheKV {
    device const T *k;
    device const T *v;
    device const int *table;
    device const T *k_scales;
    device const T *k_biases;
    device const T *v_scales;
    device const T *v_biases;

    template <uint ROWS, uint DP>
    inline CacheStream<T, ROWS, DP> keys(constant FlashAttentionParams &p, uint b, uint kv_head,
                                         uint first, uint tid) const {
        return cache_stream<T, ROWS, DP>(
            kv_cache_head(p, k, k_scales, k_biases, table, p.k, b, kv_head, p.head_dim), p.seqlen_k,
            p.head_dim, tid);
    }

    template <uint ROWS, uint DP>
    inline CacheStream<T, ROWS, DP> values(constant FlashAttentionParams &p, uint b, uint kv_head,
                                           uint first, uint tid) const {
        return cache_stream<T, ROWS, DP>(
            kv_cache_head(p, v, v_scales, v_biases, table, p.v, b, kv_head, p.head_dim_v),
            p.seqlen_k, p.head_dim_v, tid);
    }
};

// The cache buffers of the KV-cache forward kernels, after the forward's own.
#define FA_KV_CACHE_KERNEL_BUFFERS(T)                                                              \
    device const int *kv_table [[buffer(FA_KV_CACHE_BUFFER_TABLE)]],                               \
        device const T *k_scales [[buffer(FA_KV_CACHE_BUFFER_K_SCALES)]],                          \
        device const T *k_biases [[buffer(FA_KV_CACHE_BUFFER_K_BIASES)]],                          \
        device const T *v_scales [[buffer(FA_KV_CACHE_BUFFER_V_SCALES)]],                          \
        device const T *v_biases [[buffer(FA_KV_CACHE_BUFFER_V_BIASES)]]
#define FA_KV_CACHE_SOURCE(T) CacheKV<T>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}

// The KV-cache forward kernels of one dtype and bucket: flash_attention_forward_kvcache_* (dense,
// any seqlen_q) and flash_attention_forward_split_kvcache_* (decode shapes; its chunks are merged
// by flash_attention_forward_combine_*), the forward kernels with keys and values read through
// CacheKV.
#define FA_DEFINE_KV_CACHE_KERNELS(T, SUFFIX, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)    \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_kvcache_##SUFFIX##_d##DP##_threadgroup;                            \
    typedef ForwardStorage<T, DP, FWD_BQ, FWD_BK>                                                  \
        flash_attention_forward_split_kvcache_##SUFFIX##_d##DP##_threadgroup;                      \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_kvcache_##SUFFIX##_d##DP(                                  \
        FA_FORWARD_KERNEL_BUFFERS(T), FA_KV_CACHE_KERNEL_BUFFERS(T),                               \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_kvcache_##SUFFIX##_d##DP##_threadgroup tg;             \
        attention_forward<DP, FWD_BQ, FWD_BK>(q, FA_KV_CACHE_SOURCE(T), out, lse, mask, alibi,     \
                                              sinks, params, &tg, tgid, sgid, lane);               \
    }                                                                                              \
                                                                                                   \
    [[max_total_threads_per_threadgroup(FA_THREADS_PER_THREADGROUP)]]                              \
    kernel void flash_attention_forward_split_kvcache_##SUFFIX##_d##DP(                            \
        FA_FORWARD_KERNEL_BUFFERS(T),                                                              \
        device float *partial_out [[buffer(FA_FORWARD_BUFFER_PARTIAL_OUT)]],                       \
        device float *partial_lse [[buffer(FA_FORWARD_BUFFER_PARTIAL_LSE)]],                       \
        FA_KV_CACHE_KERNEL_BUFFERS(T),                                                             \
        uint3 tgid [[threadgroup_position_in_grid]],                                               \
        uint sgid [[simdgroup_index_in_threadgroup]],                                              \
        uint lane [[thread_index_in_simdgroup]]) {                                                 \
        threadgroup flash_attention_forward_split_kvcache_##SUFFIX##_d##DP##_threadgroup tg;       \
        attention_forward_split<DP, FWD_BQ, FWD_BK>(q, FA_KV_CACHE_SOURCE(T), mask, alibi,         \
                                                    partial_out, partial_lse, params, &tg, tgid,   \
                                                    sgid, lane);                                   \
    }
