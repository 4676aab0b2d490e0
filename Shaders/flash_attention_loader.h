// The loader layer of the kernels: threadgroup tiles stored as rows of 16-byte chunks, and the
// copy of blocks of rows from device memory into them.
//
// A tile copy moves 16 bytes per load and per store (8 half or bfloat elements, 4 float), as MLX's
// steel block loader does (`BlockLoaderT`, ml-explore/mlx steel/attn/loader.h; facts only): each
// thread owns one fixed (row, chunk) of the tile, computed once per kernel (TileStream), and every
// tile moves its pointer by one addition. Bounds are checked only on a tile that crosses the end of
// the rows (the last key tile, the last query block); columns past head_dim, which lie in whole
// chunks on this path, are a per-thread predicate computed once.
//
// The 16-byte path needs every row of the tensor to start at a 16-byte boundary: the host sets
// FlashAttentionParams.scalar_copies when a tensor's address, a stride or a head_dim is not a
// multiple of 16 bytes (an in-place view such as x[..., 1:65]), and every copy of that call takes
// the checked scalar path (load_rows) instead, chosen per call, never per element.
#ifndef FLASH_ATTENTION_LOADER_H
#define FLASH_ATTENTION_LOADER_H

#include "flash_attention_params.h"

// Fully unrolls the loop that follows (a constant trip count): the fragments of a simdgroup_matrix
// array stay in registers, as in MLX's steel attention (STEEL_PRAGMA_UNROLL). The CUDA check build
// defines its own spelling.
#ifndef FA_UNROLL
#define FA_UNROLL _Pragma("clang loop unroll(full)")
#endif

// Inlines a function into its caller whatever its size: the per-tile steps of the key loops
// (forward_tile, the products), so that what does not change from tile to tile (a lane's fragment
// addresses) is computed once, before the loop. MLX's steel attention marks its functions so
// (METAL_FUNC, which Apple's <metal_stdlib> defines as an always-inline function).
#ifndef FA_ALWAYS_INLINE
#define FA_ALWAYS_INLINE inline __attribute__((__always_inline__))
#endif

// Counts a device load of BYTES bytes at ADDRESS where the host counts them per buffer (the CPU
// engine's profile: MSL_COUNT_DEVICE_READ); nothing elsewhere. The tile copies and the decode
// kernel's slice loads call it, so q, k, v, out and dout reads are counted.
#if defined(MSL_COUNT_DEVICE_READ)
#define FA_DEVICE_READ(ADDRESS, BYTES) MSL_COUNT_DEVICE_READ(ADDRESS, BYTES)
#else
#define FA_DEVICE_READ(ADDRESS, BYTES)
#endif

// A threadgroup tile is an array of rows of 16-byte chunks (uint4), each row DP elements of type
// T plus FA_TILE_PAD padding elements, little-endian: element c of a row is 16-bit half c % 2 of
// word c / 2 of the row (2-byte T) or word c (float). Copies move whole chunks; fragments read
// 32-bit words and take their elements with as_type (no address-space cast is needed anywhere,
// which the CPU engine's `threadgroup` could not spell).
#define FA_ROW_CHUNKS(T, DP) (((DP) + FA_TILE_PAD) * sizeof(T) / FA_CHUNK_BYTES)

// How elements of type T sit in the 32-bit words of a tile: PER_WORD of them (PER_CHUNK in a
// 16-byte chunk), `bits` the word of one element (in the low bits), `element(w, i)` element i of
// word w as float.
template <typename T>
struct TileWords;

template <>
struct TileWords<half> {
    enum : uint { PER_WORD = 2, PER_CHUNK = FA_CHUNK_BYTES / 2 };
    static inline uint bits(half x) { return uint(as_type<ushort>(x)); }
    static inline float element(uint w, uint i) { return float(as_type<half2>(w)[i]); }
};

template <>
struct TileWords<float> {
    enum : uint { PER_WORD = 1, PER_CHUNK = FA_CHUNK_BYTES / 4 };
    static inline uint bits(float x) { return as_type<uint>(x); }
    static inline float element(uint w, uint i) { return as_type<float>(w); }
};

#if !defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)
template <>
struct TileWords<bfloat> {
    enum : uint { PER_WORD = 2, PER_CHUNK = FA_CHUNK_BYTES / 2 };
    static inline uint bits(bfloat x) { return uint(as_type<ushort>(x)); }
    static inline float element(uint w, uint i) { return float(as_type<bfloat>(ushort(w >> (16 * i)))); }
};
#endif

// Word `w` of row `row` of a tile.
template <typename Tile>
inline uint tile_word(Tile tile, uint row, uint w) {
    return tile[row][w / 4][w % 4];
}

// Element (row, col) of a tile of T, as float.
template <typename T, typename Tile>
inline float tile_element(Tile tile, uint row, uint col) {
    typedef TileWords<T> W;
    return W::element(tile_word(tile, row, col / W::PER_WORD), col % W::PER_WORD);
}

// Copies rows [first, first + ROWS) of a [seqlen][cols] matrix of T whose rows lie `stride`
// elements apart (src points at its row 0) into the tile, zero past seqlen and past cols, element
// by element with every bound checked: the path of a call whose tensors are not 16-byte aligned.
// Each thread writes whole words (threads never share one); the threadgroup's threads share the
// copy (thread `tid` of FA_THREADS_PER_THREADGROUP). PAIRED: in the paired layout (PairedRows).
template <uint ROWS, uint DP, bool PAIRED = false, typename T, typename Tile>
inline void load_rows(Tile tile, device const T *src, uint first, uint seqlen, ulong stride,
                      uint cols, uint tid) {
    constexpr uint PER_WORD = TileWords<T>::PER_WORD;
    constexpr uint WORDS = ROWS * DP / PER_WORD;
    FA_UNROLL
    for (uint k = 0; k < (WORDS + FA_THREADS_PER_THREADGROUP - 1) / FA_THREADS_PER_THREADGROUP; ++k) {
        const uint e = tid + k * FA_THREADS_PER_THREADGROUP;
        if (WORDS % FA_THREADS_PER_THREADGROUP == 0 || e < WORDS) {
            const uint r = e / (DP / PER_WORD);
            const uint w = e % (DP / PER_WORD);
            uint bits = 0;
            FA_UNROLL
            for (uint i = 0; i < PER_WORD; ++i) {
                // Word w of tile row r holds elements (r, w * PER_WORD + i); paired, element
                // (r - r % 2 + i, r % 2 * DP / 2 + w).
                const ulong row = ulong(first) + (PAIRED ? r - r % 2 + i : r);
                const uint d = PAIRED ? r % 2 * (DP / 2) + w : w * PER_WORD + i;
                if (row < seqlen && d < cols) {
                    FA_DEVICE_READ(src + row * stride + d, sizeof(T));
                    bits |= TileWords<T>::bits(src[row * stride + d]) << (16 * i);
                }
            }
            tile[r][w / 4][w % 4] = bits;
        }
    }
}

// The paired layout of a tile of 2-byte T, for a matrix that the products read only transposed
// (K in the forward, V in dQ): rows 2i and 2i + 1 share tile rows 2i and 2i + 1, column c of both
// in one 32-bit word (row 2i in the low half), columns below DP / 2 in tile row 2i and the rest in
// tile row 2i + 1. A lane's pair of a transposed fragment, (r, c) and (r + 1, c) with r even, is
// then one word (load_fragment_paired) instead of two elements of two rows. MLX's steel attention
// stores K transposed for the same reason (its K loader writes the tile with the column stride;
// ml-explore/mlx steel/attn/kernels/steel_attention.h, facts only); pairs keep the copy's 16-byte
// stores. The copy pairs a thread's chunk with the same chunk of the next (or previous) row, which
// thread tid ^ CHUNKS of its SIMD-group holds (two SIMD shuffles per chunk), so it needs a
// power-of-two CHUNKS below 32: head_dim 32, 64 and 128 buckets; the others stay row-major.
template <typename T, uint DP>
struct PairedRows {
    enum : uint {
        CHUNKS = DP * sizeof(T) / FA_CHUNK_BYTES,
        ON = sizeof(T) == 2 && CHUNKS < 32 && (CHUNKS & (CHUNKS - 1)) == 0,
        // The template argument of the products that read such a tile: its width, 0 if row-major.
        WIDTH = ON ? DP : 0,
    };
};

// One thread's part of copying tiles of ROWS rows of a [seqlen][cols] matrix, DP columns wide
// (cols <= DP), one tile after the other. The CHUNKS chunks of a row are spread over the threads:
// thread t copies chunk t % CHUNKS of rows t / CHUNKS + k * STEP (k < PASSES); threads past
// STEP * CHUNKS copy nothing. `next` points at the thread's first chunk of the next tile.
template <typename T, uint ROWS, uint DP>
struct TileStream {
    typedef T element;
    // (An enum: MSL wants a static data member in the constant address space, the engine not.)
    enum : uint {
        V = FA_CHUNK_BYTES / sizeof(T),
        CHUNKS = DP / V,
        STEP = FA_THREADS_PER_THREADGROUP / CHUNKS,
        PASSES = (ROWS + STEP - 1) / STEP,
        // 1: every thread's rows lie inside the tile, so an interior tile needs no row test.
        EXACT = ROWS % STEP == 0 && FA_THREADS_PER_THREADGROUP % CHUNKS == 0,
    };

    device const uint4 *next;
    device const T *src;  // row 0 of the matrix (the scalar path)
    ulong stride;         // elements between rows
    ulong pass_step;      // chunks between a thread's rows of one tile
    ulong tile_step;      // chunks between tiles
    uint seqlen;
    uint cols;
    uint row;             // the thread's first row in a tile (ROWS or more: none)
    uint chunk;           // its chunk of that row
    bool cols_inside;     // the chunk holds columns below cols (else it is zero)
};

static_assert(sizeof(uint4) == FA_CHUNK_BYTES, "a chunk is one uint4");

// A stream over the matrix at `src` (row 0) whose first tile starts at row `first`. The only
// 64-bit multiplies of a copy are here, once per matrix.
template <typename T, uint ROWS, uint DP>
inline TileStream<T, ROWS, DP> tile_stream(device const T *src, uint first, uint seqlen,
                                           ulong stride, uint cols, uint tid) {
    typedef TileStream<T, ROWS, DP> S;
    static_assert(DP % S::V == 0 && S::CHUNKS <= FA_THREADS_PER_THREADGROUP,
                  "a tile row must split into at most one chunk per thread");
    S s;
    const bool copies = tid < S::STEP * S::CHUNKS;
    s.row = copies ? tid / S::CHUNKS : ROWS;
    s.chunk = tid % S::CHUNKS;
    s.src = src;
    s.stride = stride;
    s.seqlen = seqlen;
    s.cols = cols;
    s.cols_inside = s.chunk * S::V < cols;
    s.pass_step = ulong(S::STEP) * (stride / S::V);
    s.tile_step = ulong(ROWS) * (stride / S::V);
    s.next = (device const uint4 *)(src + ulong(first + (copies ? s.row : 0)) * stride) + s.chunk;
    return s;
}

// Moves the stream to the matrix at `src` (row 0), its next tile starting at row `first`.
template <typename T, uint ROWS, uint DP>
inline void seek(thread TileStream<T, ROWS, DP> &s, device const T *src, uint first) {
    s.src = src;
    s.next = (device const uint4 *)(src + ulong(first + (s.row < ROWS ? s.row : 0)) * s.stride) +
             s.chunk;
}

// Where a thread's chunks of one tile lie in device memory: pass k's at at[k]. A TileStream's are
// pass_step apart (strided_chunks); a paged cache's each in its row's block
// (flash_attention_kv_cache.h). The chunk copies below take each chunk from `load(k)` of such a
// source (a quantized cache's source dequantizes it there), so every kind copies alike.
template <uint PASSES>
struct TileChunks {
    device const uint4 *at[PASSES];

    inline uint4 load(uint k) const {
        FA_DEVICE_READ(at[k], FA_CHUNK_BYTES);
        return *at[k];
    }
};

// The chunks of the stream's tile whose first chunk is `from`: by additions, no multiply.
template <typename T, uint ROWS, uint DP>
inline TileChunks<TileStream<T, ROWS, DP>::PASSES> strided_chunks(thread const TileStream<T, ROWS, DP> &s,
                                                                  device const uint4 *from) {
    TileChunks<TileStream<T, ROWS, DP>::PASSES> c;
    FA_UNROLL
    for (uint k = 0; k < TileStream<T, ROWS, DP>::PASSES; ++k) {
        c.at[k] = from;
        from += s.pass_step;
    }
    return c;
}

// Copies rows [first, first + ROWS) into `tile` in the paired layout (PairedRows): the thread's
// chunk of row r and the same chunk of row r ^ 1, interleaved, give the chunk that it stores; the
// partner thread (tid ^ CHUNKS) stores the other half. Every lane reaches the shuffles.
template <uint ROWS, uint DP, typename T, typename Tile, typename Chunks>
FA_ALWAYS_INLINE void copy_paired(Tile tile, thread const TileStream<T, ROWS, DP> &s, Chunks from, uint first) {
    typedef TileStream<T, ROWS, DP> S;
    // Instantiated for every stream (C++14 has no `if constexpr`); copy_tile asserts the layout.
    constexpr uint HALF = S::CHUNKS > 1 ? S::CHUNKS / 2 : 1;
    const bool interior = first + ROWS <= s.seqlen;
    const uint rows_inside = s.seqlen > first ? s.seqlen - first : 0;
    // Read once: the shuffles are calls, after which the stream's fields would be read again.
    const uint row = s.row;
    const bool cols_inside = s.cols_inside;
    const bool odd = (row & 1) != 0;
    // The thread's chunk of the pair's two tile rows (STEP is even: the parity stays).
    const uint half_row = row - (row & 1) + s.chunk / HALF;
    const uint out_chunk = 2 * (s.chunk % HALF) + (row & 1);
    FA_UNROLL
    for (uint k = 0; k < S::PASSES; ++k) {
        uint4 own = uint4(0);
        if (cols_inside && (interior || row + k * S::STEP < rows_inside)) {
            own = from.load(k);
        }
        // The even row's thread stores columns 0-3 of the chunk, the odd row's columns 4-7: each
        // sends the partner the two words it lacks.
        const uint in0 = simd_shuffle_xor(odd ? own.x : own.z, ushort(S::CHUNKS));
        const uint in1 = simd_shuffle_xor(odd ? own.y : own.w, ushort(S::CHUNKS));
        const uint lo0 = odd ? in0 : own.x;
        const uint lo1 = odd ? in1 : own.y;
        const uint hi0 = odd ? own.z : in0;
        const uint hi1 = odd ? own.w : in1;
        uint4 pair;
        pair.x = (lo0 & 0xffffu) | (hi0 << 16);
        pair.y = (lo0 >> 16) | (hi0 & 0xffff0000u);
        pair.z = (lo1 & 0xffffu) | (hi1 << 16);
        pair.w = (lo1 >> 16) | (hi1 & 0xffff0000u);
        tile[half_row + k * S::STEP][out_chunk] = pair;
    }
}

// Copies rows [first, first + ROWS) into `tile` by 16-byte chunks, the thread's from `from` (in the
// paired layout when PAIRED); s gives the thread's (row, chunk) and the bounds.
template <uint ROWS, uint DP, bool PAIRED, typename T, typename Tile, typename Chunks>
FA_ALWAYS_INLINE void copy_chunks(Tile tile, thread const TileStream<T, ROWS, DP> &s, Chunks from, uint first) {
    typedef TileStream<T, ROWS, DP> S;
    static_assert(!PAIRED || (PairedRows<T, DP>::ON != 0 && S::EXACT != 0 && ROWS % 2 == 0),
                  "paired tiles need whole row pairs and a power-of-two chunk count below 32");
    if (PAIRED) {
        copy_paired(tile, s, from, first);
        return;
    }
    const uint4 zero = uint4(0);
    if (S::EXACT != 0 && first + ROWS <= s.seqlen) {
        // An interior tile: no row test.
        if (s.cols_inside) {
            FA_UNROLL
            for (uint k = 0; k < S::PASSES; ++k) {
                tile[s.row + k * S::STEP][s.chunk] = from.load(k);
            }
        } else {
            FA_UNROLL
            for (uint k = 0; k < S::PASSES; ++k) {
                tile[s.row + k * S::STEP][s.chunk] = zero;
            }
        }
        return;
    }
    // The tile crosses the end of the rows (or the bucket's chunks leave some threads idle).
    const uint rows_inside = s.seqlen > first ? s.seqlen - first : 0;
    FA_UNROLL
    for (uint k = 0; k < S::PASSES; ++k) {
        const uint r = s.row + k * S::STEP;
        if (r < ROWS) {
            if (s.cols_inside && r < rows_inside) {
                tile[r][s.chunk] = from.load(k);
            } else {
                tile[r][s.chunk] = zero;
            }
        }
    }
}

// Copies rows [first, first + ROWS) into `tile`, the thread's chunks starting at `from` (in the
// paired layout when PAIRED): by chunks, or element by element where the call's rows are not on
// 16-byte boundaries (scalar_copies). Always inlined, as load_tile: a stream handed to an
// out-of-line copy would keep the key loop's whole K/V source in memory, its fields reloaded after
// every call in the loop.
template <uint ROWS, uint DP, bool PAIRED, typename T, typename Tile>
FA_ALWAYS_INLINE void copy_tile(Tile tile, thread const TileStream<T, ROWS, DP> &s, device const uint4 *from,
                                uint first, constant FlashAttentionParams &p, uint tid) {
    if (p.scalar_copies != 0) {
        load_rows<ROWS, DP, PAIRED>(tile, s.src, first, s.seqlen, s.stride, s.cols, tid);
        return;
    }
    copy_chunks<ROWS, DP, PAIRED>(tile, s, strided_chunks(s, from), first);
}

// Copies the stream's next tile, rows [first, first + ROWS), into `tile` (in the paired layout
// when PAIRED) and advances the stream to the tile after it. Every thread of the threadgroup calls
// it with the same `first`: the first row of the previous call plus ROWS (or the `first` of
// tile_stream or seek).
template <uint ROWS, uint DP, bool PAIRED = false, typename T, typename Tile>
FA_ALWAYS_INLINE void load_tile(Tile tile, thread TileStream<T, ROWS, DP> &s, uint first,
                                constant FlashAttentionParams &p, uint tid) {
    device const uint4 *from = s.next;
    s.next += s.tile_step;
    copy_tile<ROWS, DP, PAIRED>(tile, s, from, first, p, tid);
}

// The K and V tiles of a key loop (forward_tile), from one source per launch: load_keys and
// load_values copy the next key tile's K and V, and next_tile moves the source on to the tile after
// it (for two streams, which move themselves as they load, a no-op). A paged cache's source
// (KVPages, flash_attention_kv_cache.h) finds each row's page once for K and V.
template <typename KS, typename VS>
struct KVTiles {
    typedef typename KS::element element;
    KS k;
    VS v;
};

template <typename KS, typename VS>
FA_ALWAYS_INLINE KVTiles<KS, VS> kv_tiles(KS k, VS v) {
    KVTiles<KS, VS> s = {k, v};
    return s;
}

template <uint ROWS, uint DP, bool PAIRED, typename KS, typename VS, typename Tile>
FA_ALWAYS_INLINE void load_keys(Tile tile, thread KVTiles<KS, VS> &s, uint first,
                                constant FlashAttentionParams &p, uint tid) {
    load_tile<ROWS, DP, PAIRED>(tile, s.k, first, p, tid);
}

template <uint ROWS, uint DP, typename KS, typename VS, typename Tile>
FA_ALWAYS_INLINE void load_values(Tile tile, thread KVTiles<KS, VS> &s, uint first,
                                  constant FlashAttentionParams &p, uint tid) {
    load_tile<ROWS, DP>(tile, s.v, first, p, tid);
}

template <typename KS, typename VS>
FA_ALWAYS_INLINE void next_tile(thread KVTiles<KS, VS> &) {}

// Copies the tile that the last load_tile of the stream copied (rows [first, first + ROWS)) again.
template <uint ROWS, uint DP, typename T, typename Tile>
inline void reload_tile(Tile tile, thread const TileStream<T, ROWS, DP> &s, uint first,
                        constant FlashAttentionParams &p, uint tid) {
    copy_tile<ROWS, DP, false>(tile, s, s.next - s.tile_step, first, p, tid);
}

#endif
