// K/V read from a KV cache as inference engines keep it (flash_attn_with_kvcache): rows addressed
// through a block table (paged) or per sequence (contiguous), stored as the dtype or quantized in
// MLX's affine format (mx.quantize: packed uint32 words of `bits`-bit integers, element j of a row
// in bits [bits * (j % (32 / bits)), + bits) of word j / (32 / bits); one scale and one bias per
// group of `group_size` elements, in the dtype; w = scale * q + bias; ml-explore/mlx
// mlx/ops.cpp, facts only). Values are dequantized in registers as they are loaded: no
// dequantized copy exists in device memory.
//
// The tiled kernels read a cache by its kind, one key loop per kind (kv_cache_kind,
// FA_WITH_CACHE_SOURCE): a contiguous unquantized cache as a plain tensor (DeviceKV), a paged one by
// 16-byte chunks whose rows one cursor per tile row finds for K and V and a SIMD-group's lanes share
// (PagedKV<T, 0>), a quantized one by the same cursors and chunks dequantized in registers as the
// MMA decode's lanes dequantize (PagedKV<T, BITS>), an unquantized paged one
// off 16-byte boundaries element by element
// (CacheKV: kv_elements, kv_chunk). The decode kernel's lanes load their slices of a row straight
// into registers (CacheDecodeRows, kv_dequantize).
//
// Bounds: every block table value is clamped into [0, kv_num_blocks) and every block index into
// [0, kv_max_blocks), so a wrong table gives wrong numbers but never an access outside the cache
// (the hosts reject such tables before dispatch; the clamps are for memory safety alone).
#ifndef FLASH_ATTENTION_KV_CACHE_H
#define FLASH_ATTENTION_KV_CACHE_H

#include "flash_attention_decode.h"

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
    uint group_shift;         // log2(group_size) (32, 64 or 128)
    uint word_group_shift;    // log2(words per group): a row's offset in data >> it is its offset in
                              // scales and biases (strides are whole rows of words, checked by the hosts)
};

// Entry `block` of a sequence's block table row (max_blocks entries), both clamped into range
// (num_blocks blocks in the cache).
inline uint kv_page(device const int *table, uint max_blocks, uint num_blocks, uint block) {
    block = min(block, max_blocks - 1);
    FA_DEVICE_READ(table + block, 4);
    return uint(min(max(table[block], 0), int(num_blocks) - 1));
}

// A row of a cache head and where it lies: block `block` of the table row (paged; 0 contiguous),
// row r within it, offsets `row` in data and `scale_row` in scales/biases. Moved forward by
// kv_advance without dividing: the table is read and the offsets multiplied out only when the row
// enters another block.
struct KVCursor {
    uint block;
    uint r;
    ulong row;
    ulong scale_row;
};

// The offsets of the cursor's (block, r): the table read, clamped (kv_page), and the multiplies.
template <typename T>
inline void kv_seek(thread const KVCacheHead<T> &c, thread KVCursor &at) {
    const uint page = c.page_rows == 0 ? 0 : kv_page(c.table, c.max_blocks, c.num_blocks, at.block);
    at.row = ulong(page) * c.block_stride + ulong(at.r) * c.row_stride;
    at.scale_row = ulong(page) * c.scale_block_stride + ulong(at.r) * c.scale_row_stride;
}

// The cursor at row t of the head: the one division, t / page_rows (paged caches).
template <typename T>
inline KVCursor kv_cursor(thread const KVCacheHead<T> &c, uint t) {
    KVCursor at;
    at.block = c.page_rows == 0 ? 0 : t / c.page_rows;
    at.r = t - at.block * c.page_rows;
    kv_seek(c, at);
    return at;
}

// The cursor moved n rows on: within the block by adding n rows' strides; into another block by
// subtracting page_rows (as often as n spans blocks) and kv_seek.
template <typename T>
inline void kv_advance(thread const KVCacheHead<T> &c, thread KVCursor &at, uint n) {
    at.r += n;
    if (c.page_rows != 0 && at.r >= c.page_rows) {
        while (at.r >= c.page_rows) {
            at.r -= c.page_rows;
            ++at.block;
        }
        kv_seek(c, at);
        return;
    }
    at.row += ulong(n) * c.row_stride;
    at.scale_row += ulong(n) * c.scale_row_stride;
}

// Elements [col, col + N) of the row at `at` as float (N <= 8, col a multiple of N: one
// quantization group), columns at or past `cols` zero.
template <uint N, typename T>
inline void kv_elements(thread const KVCacheHead<T> &c, thread const KVCursor &at, uint col, uint cols,
                        thread float *x) {
    const ulong row = at.row;
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
    const ulong group = at.scale_row + (col >> c.group_shift);
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

// The 16-byte chunk `chunk` of the row at `at` in the threadgroup tile format
// (flash_attention_loader.h): moved as is when unquantized and aligned (`scalar` 0), else built
// element by element.
template <typename T>
inline uint4 kv_chunk(thread const KVCacheHead<T> &c, thread const KVCursor &at, uint chunk, uint cols,
                      bool scalar) {
    constexpr uint V = FA_CHUNK_BYTES / sizeof(T);
    constexpr uint PER_WORD = TileWords<T>::PER_WORD;
    if (c.bits == 0 && !scalar) {
        device const T *from = c.data + at.row + chunk * V;
        FA_DEVICE_READ(from, FA_CHUNK_BYTES);
        return *(device const uint4 *)from;
    }
    float x[V];
    kv_elements<V>(c, at, chunk * V, cols, x);
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
    c.group_shift = c.group_size >= 128 ? 7 : c.group_size >= 64 ? 6 : 5;
    // A group's words: group_size * bits / 32 (4 to 32, a power of two).
    c.word_group_shift = c.bits == 8 ? c.group_shift - 2 : c.bits == 4 ? c.group_shift - 3 : 0;
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
// [col, col + 4) of rows t and t + 1 (t even, at row t): word i is (t, col + i) | (t + 1, col + i) << 16.
template <typename T, uint ROWS, uint DP>
inline uint4 kv_pair_chunk(thread const CacheStream<T, ROWS, DP> &s, thread const KVCursor &at, uint t,
                           uint col) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (t < s.seqlen) {
        kv_elements<4>(s.head, at, col, s.cols, a);
    }
    if (t + 1 < s.seqlen) {
        KVCursor second = at;
        kv_advance(s.head, second, 1);
        kv_elements<4>(s.head, second, col, s.cols, b);
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
// the pair of rows it holds, built from both rows (no shuffles: rows are fetched one by one). The
// thread's first row is located once per tile (one division by page_rows), its later rows by
// kv_advance.
template <uint ROWS, uint DP, bool PAIRED = false, typename T, typename Tile>
inline void load_tile(Tile tile, thread CacheStream<T, ROWS, DP> &s, uint first,
                      constant FlashAttentionParams &p, uint tid) {
    typedef typename CacheStream<T, ROWS, DP>::Geometry S;
    static_assert(!PAIRED || (PairedRows<T, DP>::ON != 0 && ROWS % 2 == 0 && S::STEP % 2 == 0),
                  "paired tiles need whole row pairs of a 2-byte type (and an even STEP: the parity stays)");
    if (s.row >= ROWS) {
        return;
    }
    // Paired, the thread's rows are the first rows of pairs (r - r % 2).
    KVCursor at = kv_cursor(s.head, first + s.row - (PAIRED ? s.row % 2 : 0));
    FA_UNROLL
    for (uint k = 0; k < S::PASSES; ++k) {
        const uint r = s.row + k * S::STEP;
        if (r < ROWS) {
            const uint t = first + r;
            if (PAIRED) {
                tile[r][s.chunk] = kv_pair_chunk(s, at, t - r % 2, r % 2 * (DP / 2) + s.chunk * 4);
            } else {
                tile[r][s.chunk] = s.cols_inside && t < s.seqlen
                                       ? kv_chunk(s.head, at, s.chunk, s.cols, p.scalar_copies != 0)
                                       : uint4(0);
            }
            if (k + 1 < S::PASSES) {
                kv_advance(s.head, at, S::STEP);
            }
        }
    }
}

// The E * BITS bits of elements [col, col + E) of a packed row (col a multiple of E) as float,
// w = scale * q + bias: loaded once, in one load of 1, 2 or 4 bytes or in whole words (rows are
// only word-aligned), and unpacked in registers. At E = 1 and 4 bits two lanes share a byte:
// each loads it and takes its half. No integer-to-float convert (MLX's quantized matvec uses the
// same bits, ml-explore/mlx kernels/quantized.h, facts only): q in a half's low mantissa bits
// under the exponent of 1024 (0x6400) is the half 1024 + q, and one half2 subtraction of 1024
// gives q exactly for two elements (a whole word yields two per mask, those 16 bits apart), so
// w is the same fma(scale, q, bias) as with a convert.
template <uint E, uint BITS>
inline void kv_dequantize(device const uint *words, uint col, float scale, float bias, thread float *x) {
    constexpr uint TOTAL = E * BITS;
    constexpr uint WORDS = (TOTAL + 31) / 32;
    constexpr uint MASK = (1u << BITS) - 1u;
    constexpr uint PER_HALF = 16 / BITS;  // elements per 16 bits of a word
    uint w[WORDS];
    if (TOTAL >= 32) {
        FA_DEVICE_READ(words + col * BITS / 32, TOTAL / 8);
        FA_UNROLL
        for (uint i = 0; i < WORDS; ++i) {
            w[i] = words[col * BITS / 32 + i];
        }
        FA_UNROLL
        for (uint i = 0; i < WORDS; ++i) {
            FA_UNROLL
            for (uint e = 0; e < PER_HALF; ++e) {
                // Elements e and e + PER_HALF of word i.
                const half2 q = as_type<half2>(((w[i] >> (e * BITS)) & (MASK | MASK << 16)) | 0x64006400u) -
                                half2(half(1024.0f));
                x[i * 2 * PER_HALF + e] = fma(scale, float(q.x), bias);
                x[i * 2 * PER_HALF + e + PER_HALF] = fma(scale, float(q.y), bias);
            }
        }
        return;
    }
    if (TOTAL == 16) {
        device const ushort *halves = (device const ushort *)words + col * BITS / 16;
        FA_DEVICE_READ(halves, 2);
        w[0] = halves[0];
    } else {
        device const uchar *bytes = (device const uchar *)words + col * BITS / 8;
        FA_DEVICE_READ(bytes, 1);
        w[0] = uint(bytes[0]) >> (col * BITS % 8);
    }
    FA_UNROLL
    for (uint e = 0; e < E; ++e) {
        const half q = as_type<half>(ushort(((w[0] >> (e * BITS)) & MASK) | 0x6400u)) - half(1024.0f);
        x[e] = fma(scale, float(q), bias);
    }
}

// The magic-number dequantization of word pairs that the MMA decode's lanes and the tiled kernels'
// chunk copies share (flash_attention_decode_mma.h has the layout of a lane's quarter).

// Where a lane's quarter of a row puts its elements: fragment f's pair (e = 0, 1) of the lane's
// DP / 4 columns is word f / FPW's elements f % FPW and f % FPW + FPW (16 bits apart).
template <uint DP, uint BITS>
struct DecodeMMALayout {
    enum : uint {
        FRAGMENTS = DP / 8,       // fragments across head_dim
        COLS = DP / 4,            // columns of a row per lane
        WORDS = COLS * BITS / 32, // their words
        EPW = 32 / BITS,          // elements per word
        FPW = EPW / 2,            // fragments per word
    };

    // The column of fragment f's element e in the quarter starting at col0.
    static inline uint column(uint col0, uint f, uint e) { return col0 + EPW * (f / FPW) + f % FPW + e * FPW; }
};

// Whether a cache of T folds 1024 into the bias: its scales have at most 11 significant bits, so
// scale x (1024 + q) is an exact float; a float cache's are wider, and it subtracts 1024 first.
template <typename T>
struct DecodeMMAFold {
    enum : bool { value = sizeof(T) == 2 };
};

// Fragment f's pair of a lane's dequantized quarter into x, from its words: sb's (scale, bias) for
// elements in place, (scale / 16, bias) for a 4-bit word's odd nibbles (16 q); with the fold,
// the biases are bias - 1024 scale and bias - 64 scale and multiply 1024 + q and 1024 + 16 q
// (exact halves) as they are.
template <uint DP, uint BITS, typename T>
inline void decode_mma_pair(thread const uint *w, uint f, thread const float *sb, thread float *x) {
    typedef DecodeMMALayout<DP, BITS> L;
    const uint word = w[f / L::FPW];
    const uint j = f % L::FPW;
    uint bits;
    if (BITS == 8) {
        bits = (j == 0 ? word : word >> 8) & 0x00ff00ffu;
    } else {
        const uint shifted = j < 2 ? word : word >> 8;
        bits = shifted & (j % 2 == 0 ? 0x000f000fu : 0x00f000f0u);
    }
    const half2 h = as_type<half2>(bits | 0x64006400u);
    const uint at = BITS == 4 && j % 2 == 1 ? 2 : 0;
    float e0 = float(h.x);
    float e1 = float(h.y);
    if (!DecodeMMAFold<T>::value) {
        e0 -= 1024.0f;
        e1 -= 1024.0f;
    }
    x[0] = fma(sb[at], e0, sb[at + 1]);
    x[1] = fma(sb[at], e1, sb[at + 1]);
}

// A group's (scale, bias) as decode_mma_pair takes them: sb = scale, bias; scale / 16, bias for a
// 4-bit word's odd nibbles; with the fold, the biases are bias - 1024 scale and bias - 64 scale.
template <typename T>
FA_ALWAYS_INLINE void decode_mma_fold(float scale, float bias, thread float *sb) {
    const bool fold = DecodeMMAFold<T>::value;
    sb[0] = scale;
    sb[1] = fold ? fma(-1024.0f, scale, bias) : bias;
    sb[2] = scale * 0.0625f;
    sb[3] = fold ? fma(-64.0f, scale, bias) : bias;
}

// The decode kernel's rows of a cache (DeviceDecodeRows in flash_attention_decode.h has the
// contract): a key slot's keys first, first + step, ... The key's block is found once for K and V
// and the table read only when a key enters another block: the row within the block advances by
// the step and wraps by subtraction, so the key loop divides nothing. A quantized
// row's scales and biases are loaded once per (row, group), by lane g for group g, and handed to
// the lanes of the group by one shuffle.
template <typename T>
struct CacheDecodeRows {
    KVCacheHead<T> k;
    KVCacheHead<T> v;
    uint block;  // paged: the key's entry of the table row; contiguous: 0
    uint r;      // the key's row within that block (contiguous: the key)
    ulong k_row; // the key's kv_row in k and v, and of its scales and biases
    ulong v_row;
    ulong k_scale_row;
    ulong v_scale_row;
    uint k_groups;      // quantized: groups of a K row and of a V row
    uint v_groups;
    ushort group_lane;  // the lane that loads the scale and bias of this lane's group
    uint step;          // keys from one of the slot's keys to its next
    ulong k_step;       // step rows of k, v and their scales (within a block)
    ulong v_step;
    ulong k_scale_step;
    ulong v_scale_step;

    // The rows of (block, r): a table read and the multiplies, once per block.
    inline void locate() {
        const uint page = k.page_rows == 0 ? 0 : kv_page(k.table, k.max_blocks, k.num_blocks, block);
        k_row = ulong(page) * k.block_stride + ulong(r) * k.row_stride;
        v_row = ulong(page) * v.block_stride + ulong(r) * v.row_stride;
        k_scale_row = ulong(page) * k.scale_block_stride + ulong(r) * k.scale_row_stride;
        v_scale_row = ulong(page) * v.scale_block_stride + ulong(r) * v.scale_row_stride;
    }

    template <uint DP>
    inline void load(constant FlashAttentionParams &p, uint lane, bool scalar, thread float *kf,
                     thread float *vf) const {
        typedef DecodeLane<T, DP> L;
        const uint col0 = lane * L::E;
        if (k.bits == 0) {
            const DecodeSlice<L::WORDS> kw = load_slice<T, DP>(k.data + k_row, col0, p.head_dim, scalar);
            const DecodeSlice<L::WORDS> vw = load_slice<T, DP>(v.data + v_row, col0, p.head_dim_v, scalar);
            FA_UNROLL
            for (uint e = 0; e < L::E; ++e) {
                kf[e] = slice_element<T>(kw, e);
                vf[e] = slice_element<T>(vw, e);
            }
            return;
        }
        float4 sb = float4(0.0f);  // (K scale, K bias, V scale, V bias) of group `lane`
        if (lane < k_groups) {
            FA_DEVICE_READ(k.scales + k_scale_row + lane, sizeof(T));
            FA_DEVICE_READ(k.biases + k_scale_row + lane, sizeof(T));
            sb.x = float(k.scales[k_scale_row + lane]);
            sb.y = float(k.biases[k_scale_row + lane]);
        }
        if (lane < v_groups) {
            FA_DEVICE_READ(v.scales + v_scale_row + lane, sizeof(T));
            FA_DEVICE_READ(v.biases + v_scale_row + lane, sizeof(T));
            sb.z = float(v.scales[v_scale_row + lane]);
            sb.w = float(v.biases[v_scale_row + lane]);
        }
        sb = simd_shuffle(sb, group_lane);
        FA_UNROLL
        for (uint e = 0; e < L::E; ++e) {
            kf[e] = 0.0f;
            vf[e] = 0.0f;
        }
        // A slice lies wholly inside or outside head_dim (E and the group size are powers of
        // two, E <= 32 <= group size, head_dim a multiple of the group size).
        device const uint *kw = (device const uint *)k.data + k_row;
        device const uint *vw = (device const uint *)v.data + v_row;
        if (k.bits == 8) {
            if (col0 < p.head_dim) {
                kv_dequantize<L::E, 8>(kw, col0, sb.x, sb.y, kf);
            }
            if (col0 < p.head_dim_v) {
                kv_dequantize<L::E, 8>(vw, col0, sb.z, sb.w, vf);
            }
        } else {
            if (col0 < p.head_dim) {
                kv_dequantize<L::E, 4>(kw, col0, sb.x, sb.y, kf);
            }
            if (col0 < p.head_dim_v) {
                kv_dequantize<L::E, 4>(vw, col0, sb.z, sb.w, vf);
            }
        }
    }

    inline void next() {
        r += step;
        if (k.page_rows != 0 && r >= k.page_rows) {
            while (r >= k.page_rows) {
                r -= k.page_rows;
                ++block;
            }
            locate();
            return;
        }
        k_row += k_step;
        v_row += v_step;
        k_scale_row += k_scale_step;
        v_scale_row += v_scale_step;
    }
};

// The K/V source of the forward kernels for a cache, element by element (the decode kernel's for
// every kind; the tiled kernels' for unquantized paged caches off 16-byte boundaries): streams over
// batch element b's KV head.
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
    inline KVTiles<CacheStream<T, ROWS, DP>, CacheStream<T, ROWS, DP>>
    tiles(constant FlashAttentionParams &p, uint b, uint kv_head, uint first, uint tid) const {
        return kv_tiles(cache_stream<T, ROWS, DP>(kv_cache_head(p, k, k_scales, k_biases, table, p.k, b, kv_head,
                                                                p.head_dim),
                                                  p.seqlen_k, p.head_dim, tid),
                        cache_stream<T, ROWS, DP>(kv_cache_head(p, v, v_scales, v_biases, table, p.v, b, kv_head,
                                                                p.head_dim_v),
                                                  p.seqlen_k, p.head_dim_v, tid));
    }
};

// The decode kernel's rows of batch element b's KV head from key `first` by `step`, for the lane
// whose slice starts at column col0.
template <typename T>
inline CacheDecodeRows<T> decode_rows(CacheKV<T> kv, constant FlashAttentionParams &p, uint b,
                                      uint kv_head, uint first, uint col0, uint step) {
    CacheDecodeRows<T> r;
    r.k = kv_cache_head(p, kv.k, kv.k_scales, kv.k_biases, kv.table, p.k, b, kv_head, p.head_dim);
    r.v = kv_cache_head(p, kv.v, kv.v_scales, kv.v_biases, kv.table, p.v, b, kv_head, p.head_dim_v);
    r.block = r.k.page_rows == 0 ? 0 : first / r.k.page_rows;
    r.r = first - r.block * r.k.page_rows;
    r.k_groups = p.head_dim / r.k.group_size;
    r.v_groups = p.head_dim_v / r.v.group_size;
    r.group_lane = ushort(col0 / r.k.group_size);
    r.step = step;
    r.k_step = ulong(step) * r.k.row_stride;
    r.v_step = ulong(step) * r.v.row_stride;
    r.k_scale_step = ulong(step) * r.k.scale_row_stride;
    r.v_scale_step = ulong(step) * r.v.scale_row_stride;
    r.locate();
    return r;
}

// One 16-byte tile chunk (V elements from column col, a multiple of V, of one group) of a packed
// row dequantized. 2-byte tiles: the MMA decode's word pairs with 1024 folded into the bias
// (decode_mma_pair on a "quarter" of V columns: one mask, one or, an fma per element, no
// int-to-float convert, no subtraction); float tiles: kv_dequantize's elements.
template <typename T, uint BITS, uint PER_WORD = TileWords<T>::PER_WORD>
struct QuantChunk {
    static FA_ALWAYS_INLINE uint4 load(device const uint *words, uint col, float scale, float bias) {
        constexpr uint V = FA_CHUNK_BYTES / sizeof(T);
        float x[V];
        kv_dequantize<V, BITS>(words, col, scale, bias, x);
        uint4 out;
        FA_UNROLL
        for (uint e = 0; e < V; ++e) {
            out[e] = TileWords<T>::bits(T(x[e]));
        }
        return out;
    }
};

template <typename T, uint BITS>
struct QuantChunk<T, BITS, 2> {
    static FA_ALWAYS_INLINE uint4 load(device const uint *words, uint col, float scale, float bias) {
        constexpr uint V = FA_CHUNK_BYTES / sizeof(T);
        typedef DecodeMMALayout<4 * V, BITS> L;  // its quarter of a row: V columns
        uint w[L::WORDS];
        FA_DEVICE_READ(words + col * BITS / 32, L::WORDS * 4);
        FA_UNROLL
        for (uint i = 0; i < L::WORDS; ++i) {
            w[i] = words[col * BITS / 32 + i];
        }
        float sb[4];
        decode_mma_fold<T>(scale, bias, sb);
        float y[V];
        FA_UNROLL
        for (uint f = 0; f < V / 2; ++f) {
            float x[2];
            decode_mma_pair<4 * V, BITS, T>(w, f, sb, x);
            y[L::column(0, f, 0)] = x[0];
            y[L::column(0, f, 1)] = x[1];
        }
        uint4 out;
        FA_UNROLL
        for (uint i = 0; i < 4; ++i) {
            out[i] = TileWords<T>::bits(T(y[2 * i])) | (TileWords<T>::bits(T(y[2 * i + 1])) << 16);
        }
        return out;
    }
};

// The tiled kernels' chunks of a quantized cache (BITS 8 or 4, contiguous or paged; KVPages below
// finds the rows): each thread's 16-byte chunk of a row dequantized from its words as the decode
// kernel's lanes do (kv_dequantize: one or two word loads, no int-to-float convert), so the chunk
// copies (copy_chunks, paired K included) stage it as they stage an unquantized one. Quantized
// rows are only word-aligned, which these loads need.
template <typename T, uint PASSES, uint BITS>
struct QuantChunks {
    device const uint *words[PASSES];  // pass k's row
    ulong group[PASSES];               // its entry of scales and biases for the chunk's columns
    device const T *scales;
    device const T *biases;
    uint col;                          // the chunk's first column

    FA_ALWAYS_INLINE uint4 load(uint k) const {
        FA_DEVICE_READ(scales + group[k], sizeof(T));
        FA_DEVICE_READ(biases + group[k], sizeof(T));
        return QuantChunk<T, BITS>::load(words[k], col, float(scales[group[k]]), float(biases[group[k]]));
    }
};

// A thread's row of one pass in the next key tile of a paged or quantized cache, for K and V at
// once: both caches are addressed through the same block table (K and V of a row share its block
// and row within it), so the row's table entry is read, clamped and multiplied out once for both.
struct KVPairCursor {
    uint block;   // the row's entry of the table row (paged; contiguous: 0)
    uint r;       // its row within that block (contiguous: the row)
    ulong k_row;  // its offset in K's data and in V's (units of data; quantized, the offsets in
    ulong v_row;  // scales and biases are these >> word_group_shift)
};

// How a cursor moves by one tile of ROWS rows, worked out once per launch (the one division of
// ROWS by page_rows): ROWS = blocks x page_rows + rows; within a block its offsets grow by ROWS
// rows of K and V.
struct KVTileStep {
    ulong k;
    ulong v;
    uint rows;    // ROWS % page_rows (contiguous: ROWS)
    uint blocks;  // ROWS / page_rows (contiguous: 0); a wrapped row's block moves by blocks + 1
    uint within;  // a moved cursor is still in its block while its row is below this: page_rows
                  // where blocks is 0, else 0 (contiguous: every row)
};

template <uint ROWS, typename T>
inline KVTileStep kv_tile_step(thread const KVCacheHead<T> &k, thread const KVCacheHead<T> &v) {
    KVTileStep s;
    s.k = ulong(ROWS) * k.row_stride;
    s.v = ulong(ROWS) * v.row_stride;
    s.blocks = k.page_rows == 0 ? 0 : ROWS / k.page_rows;
    s.rows = ROWS - s.blocks * k.page_rows;
    s.within = k.page_rows == 0 ? 0xffffffffu : (s.blocks == 0 ? k.page_rows : 0);
    return s;
}

// The cursor's offsets from its (block, r): one table read (clamped, kv_page) and the multiplies.
// Only a quantized cache may be contiguous (page_rows 0) here.
template <bool QUANTIZED, typename T>
FA_ALWAYS_INLINE void kv_pair_seek(thread const KVCacheHead<T> &k, thread const KVCacheHead<T> &v,
                                   thread KVPairCursor &at) {
    const ulong page = QUANTIZED && k.page_rows == 0 ? 0 : kv_page(k.table, k.max_blocks, k.num_blocks, at.block);
    at.k_row = page * k.block_stride + ulong(at.r) * k.row_stride;
    at.v_row = page * v.block_stride + ulong(at.r) * v.row_stride;
}

// The cursor moved on by one tile: within its block by adding the steps; else into the block
// `blocks` or `blocks` + 1 on (its row, below page_rows before, is below 2 page_rows after adding
// `rows`: one subtraction wraps it) and kv_pair_seek. No division, no loop.
template <bool QUANTIZED, typename T>
FA_ALWAYS_INLINE void kv_pair_next(thread const KVCacheHead<T> &k, thread const KVCacheHead<T> &v,
                                   thread const KVTileStep &step, thread KVPairCursor &at) {
    at.r += step.rows;
    if (at.r < step.within) {
        at.k_row += step.k;
        at.v_row += step.v;
        return;
    }
    const bool wrap = at.r >= k.page_rows;
    at.r = wrap ? at.r - k.page_rows : at.r;
    at.block += wrap ? step.blocks + 1 : step.blocks;
    kv_pair_seek<QUANTIZED>(k, v, at);
}

// The tiled kernels' K and V tiles of a paged cache on 16-byte boundaries (BITS 0, scalar_copies 0)
// or of a quantized one (BITS 8 or 4, contiguous or paged): each thread's chunk of every pass
// copied by the dense forward's 16-byte chunk copy (copy_chunks, paired K included), dequantized in
// registers when quantized (QuantChunks). The rows are found once per SIMD-group, not per pass
// and thread: lane l keeps the cursor of tile row l % ROWS (ROWS <= 32), shared by K and V, and a
// thread takes each pass's row offsets from the lane of that row by a shuffle, so a tile runs one
// cursor step per thread (and at most one block crossing: its table read and multiplies) however
// many passes the copy makes. A cursor is located once per launch (a division by page_rows) and
// moved ROWS rows per tile (kv_pair_next: within a block two 64-bit adds).
template <typename T, uint ROWS, uint DP, uint BITS>
struct KVPages {
    typedef T element;
    typedef TileStream<T, ROWS, DP> Geometry;
    Geometry ks;             // the thread's (row, chunk) and K's bounds (its pointers unused)
    Geometry vs;             // the same rows, V's bounds (head_dim_v)
    KVCacheHead<T> k;
    KVCacheHead<T> v;
    KVTileStep step;         // ROWS rows
    KVPairCursor at;         // tile row lane % ROWS of the next tile
};

// The cursor at row t: the one division, t / page_rows (paged caches), once per launch and pass.
template <bool QUANTIZED, typename T>
FA_ALWAYS_INLINE void kv_pair_locate(thread const KVCacheHead<T> &k, thread const KVCacheHead<T> &v, uint t,
                                     thread KVPairCursor &at) {
    at.block = k.page_rows == 0 ? 0 : t / k.page_rows;
    at.r = t - at.block * k.page_rows;
    kv_pair_seek<QUANTIZED>(k, v, at);
}

// (Built by aggregate initialization and field stores, no assignment of structs: clang's OpenCL
// C++ gives an assignment operator a generic `this`, whose address-space cast would keep the
// whole source in memory, its fields reloaded after every call of the key loop.)
template <typename T, uint ROWS, uint DP, uint BITS>
FA_ALWAYS_INLINE KVPages<T, ROWS, DP, BITS> kv_pages(KVCacheHead<T> k, KVCacheHead<T> v, uint first,
                                                     constant FlashAttentionParams &p, uint tid) {
    typedef TileStream<T, ROWS, DP> S;
    KVPages<T, ROWS, DP, BITS> s = {tile_stream<T, ROWS, DP>(k.data, first, p.seqlen_k, 0, p.head_dim, tid),
                                    tile_stream<T, ROWS, DP>(v.data, first, p.seqlen_k, 0, p.head_dim_v, tid),
                                    k, v, kv_tile_step<ROWS>(k, v)};
    static_assert(ROWS <= 32 && (ROWS & (ROWS - 1)) == 0, "a SIMD-group's lanes hold the tile's rows");
    kv_pair_locate<BITS != 0>(k, v, first + tid % 32 % ROWS, s.at);
    return s;
}

// Where a thread's chunks of a tile lie for one cache head, given its passes' rows (and scale rows):
// 16-byte chunks (TileChunks) or, quantized, chunks dequantized from their words (QuantChunks).
template <typename T, uint PASSES, uint BITS>
struct PageChunks {
    typedef QuantChunks<T, PASSES, BITS> type;
    static FA_ALWAYS_INLINE type at(thread const KVCacheHead<T> &c, uint chunk, thread const ulong *rows) {
        type from;
        from.scales = c.scales;
        from.biases = c.biases;
        from.col = chunk * (FA_CHUNK_BYTES / sizeof(T));
        FA_UNROLL
        for (uint i = 0; i < PASSES; ++i) {
            from.words[i] = (device const uint *)c.data + rows[i];
            from.group[i] = (rows[i] >> c.word_group_shift) + (from.col >> c.group_shift);
        }
        return from;
    }
};

template <typename T, uint PASSES>
struct PageChunks<T, PASSES, 0> {
    typedef TileChunks<PASSES> type;
    static FA_ALWAYS_INLINE type at(thread const KVCacheHead<T> &c, uint chunk, thread const ulong *rows) {
        type from;
        FA_UNROLL
        for (uint i = 0; i < PASSES; ++i) {
            from.at[i] = (device const uint4 *)(c.data + rows[i]) + chunk;
        }
        return from;
    }
};

// One side's tile (K with VALUES false, V with it true) from the rows the cursors hold.
template <uint ROWS, uint DP, bool PAIRED, bool VALUES, typename T, uint BITS, typename Tile>
FA_ALWAYS_INLINE void load_pages(Tile tile, thread KVPages<T, ROWS, DP, BITS> &s,
                                 thread TileStream<T, ROWS, DP> &side, thread const KVCacheHead<T> &cache,
                                 uint first) {
    typedef TileStream<T, ROWS, DP> S;
    constexpr uint PASSES = S::PASSES;
    // Every lane shuffles (uniform control flow); an idle thread's or a pass past the tile's rows
    // reads some row's offsets and copies nothing.
    const uint2 own = as_type<uint2>(VALUES ? s.at.v_row : s.at.k_row);
    ulong rows[PASSES];
    FA_UNROLL
    for (uint i = 0; i < PASSES; ++i) {
        rows[i] = as_type<ulong>(simd_shuffle(own, ushort((side.row + i * S::STEP) % ROWS)));
    }
    copy_chunks<ROWS, DP, PAIRED>(tile, side, PageChunks<T, PASSES, BITS>::at(cache, side.chunk, rows), first);
}

template <uint ROWS, uint DP, bool PAIRED, typename T, uint BITS, typename Tile>
FA_ALWAYS_INLINE void load_keys(Tile tile, thread KVPages<T, ROWS, DP, BITS> &s, uint first,
                                constant FlashAttentionParams &p, uint tid) {
    load_pages<ROWS, DP, PAIRED, false>(tile, s, s.ks, s.k, first);
}

template <uint ROWS, uint DP, typename T, uint BITS, typename Tile>
FA_ALWAYS_INLINE void load_values(Tile tile, thread KVPages<T, ROWS, DP, BITS> &s, uint first,
                                  constant FlashAttentionParams &p, uint tid) {
    load_pages<ROWS, DP, false, true>(tile, s, s.vs, s.v, first);
}

// The cursor moved on to the tile after the one just loaded.
template <typename T, uint ROWS, uint DP, uint BITS>
FA_ALWAYS_INLINE void next_tile(thread KVPages<T, ROWS, DP, BITS> &s) {
    kv_pair_next<BITS != 0>(s.k, s.v, s.step, s.at);
}

// The K/V source of the tiled kernels for an unquantized paged cache on 16-byte boundaries (BITS
// 0) or a cache quantized to BITS bits, contiguous or paged.
template <typename T, uint BITS>
struct PagedKV {
    device const T *k;
    device const T *v;
    device const int *table;
    device const T *k_scales;
    device const T *k_biases;
    device const T *v_scales;
    device const T *v_biases;

    template <uint ROWS, uint DP>
    FA_ALWAYS_INLINE KVPages<T, ROWS, DP, BITS> tiles(constant FlashAttentionParams &p, uint b, uint kv_head,
                                                      uint first, uint tid) const {
        return kv_pages<T, ROWS, DP, BITS>(
            kv_cache_head(p, k, k_scales, k_biases, table, p.k, b, kv_head, p.head_dim),
            kv_cache_head(p, v, v_scales, v_biases, table, p.v, b, kv_head, p.head_dim_v), first, p, tid);
    }
};

// The cache of the KV-cache forward kernels (flash_attention_kernels.h), from their buffers.
#define FA_KV_CACHE_SOURCE(T) CacheKV<T>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}

// How the tiled KV-cache kernels read a launch's cache, decided once per launch so that each kind's
// key loop holds only its own copy (FA_WITH_CACHE_SOURCE instantiates the loop per kind): an
// unquantized contiguous cache is a plain strided tensor (DeviceKV: the dense forward's copy,
// scalar_copies included); an unquantized paged one on 16-byte boundaries takes PagedKV's chunk
// copy; a quantized one PagedKV's dequantizing chunk copy, per width; unquantized paged ones off
// 16-byte boundaries CacheKV's element copy.
enum KVCacheKind : uint {
    FA_KV_CACHE_STRIDED,
    FA_KV_CACHE_PAGED_CHUNKS,
    FA_KV_CACHE_QUANTIZED_8,
    FA_KV_CACHE_QUANTIZED_4,
    FA_KV_CACHE_ELEMENTS
};

inline uint kv_cache_kind(constant FlashAttentionParams &p) {
    if (p.kv_bits != 0) {
        return p.kv_bits == 8 ? FA_KV_CACHE_QUANTIZED_8 : FA_KV_CACHE_QUANTIZED_4;
    }
    if (p.kv_page_rows == 0) {
        return FA_KV_CACHE_STRIDED;
    }
    return p.scalar_copies == 0 ? FA_KV_CACHE_PAGED_CHUNKS : FA_KV_CACHE_ELEMENTS;
}

// Calls CALL(source) with the K/V source of the launch's cache kind (kv_cache_kind of P), in a
// KV-cache kernel body (its buffers k, v, kv_table, k_scales ... in scope): one call, so one key
// loop, per kind.
#define FA_WITH_CACHE_SOURCE(T, P, CALL)                                                           \
    switch (kv_cache_kind(P)) {                                                                    \
    case FA_KV_CACHE_STRIDED:                                                                      \
        CALL((DeviceKV<T>{k, v}));                                                                 \
        break;                                                                                     \
    case FA_KV_CACHE_PAGED_CHUNKS:                                                                 \
        CALL((PagedKV<T, 0>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}));             \
        break;                                                                                     \
    case FA_KV_CACHE_QUANTIZED_8:                                                                  \
        CALL((PagedKV<T, 8>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}));             \
        break;                                                                                     \
    case FA_KV_CACHE_QUANTIZED_4:                                                                  \
        CALL((PagedKV<T, 4>{k, v, kv_table, k_scales, k_biases, v_scales, v_biases}));             \
        break;                                                                                     \
    default:                                                                                       \
        CALL(FA_KV_CACHE_SOURCE(T));                                                               \
    }

#endif
