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

// Fully unrolls the loop that follows (a constant trip count): the fragments of a simdgroup_matrix
// array stay in registers, as in MLX's steel attention (STEEL_PRAGMA_UNROLL). The CUDA check build
// defines its own spelling.
#ifndef FA_UNROLL
#define FA_UNROLL _Pragma("clang loop unroll(full)")
#endif

// A threadgroup tile is an array of rows of 16-byte chunks (uint4), each row DP elements of type
// T plus FA_TILE_PAD padding elements, little-endian: element c of a row is 16-bit half c % 2 of
// word c / 2 of the row (2-byte T) or word c (float). Copies move whole chunks; fragments read
// 32-bit words and take their elements with as_type (no address-space cast is needed anywhere,
// which the CPU engine's `threadgroup` could not spell).
#define FA_ROW_CHUNKS(T, DP) (((DP) + FA_TILE_PAD) * sizeof(T) / FA_CHUNK_BYTES)

// How elements of type T sit in the 32-bit words of a tile: PER_WORD of them, `bits` the word of
// one element (in the low bits), `element(w, i)` element i of word w as float.
template <typename T>
struct TileWords;

template <>
struct TileWords<half> {
    enum : uint { PER_WORD = 2 };
    static inline uint bits(half x) { return uint(as_type<ushort>(x)); }
    static inline float element(uint w, uint i) { return float(as_type<half2>(w)[i]); }
};

template <>
struct TileWords<float> {
    enum : uint { PER_WORD = 1 };
    static inline uint bits(float x) { return as_type<uint>(x); }
    static inline float element(uint w, uint i) { return as_type<float>(w); }
};

#if !defined(__METAL_VERSION__) || defined(__HAVE_BFLOAT__)
template <>
struct TileWords<bfloat> {
    enum : uint { PER_WORD = 2 };
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

// Elements (row, col) and (row, col + 1) of a tile of T, col even, as float: into lo and hi (for
// 2-byte T both from one word).
template <typename T, typename Tile>
inline void tile_pair(Tile tile, uint row, uint col, thread float &lo, thread float &hi) {
    typedef TileWords<T> W;
    const uint w = tile_word(tile, row, col / W::PER_WORD);
    lo = W::element(w, 0);
    hi = W::PER_WORD == 2 ? W::element(w, 1) : W::element(tile_word(tile, row, col + 1), 0);
}

// Copies rows [first, first + ROWS) of a [seqlen][cols] matrix of T whose rows lie `stride`
// elements apart (src points at its row 0) into the tile, zero past seqlen and past cols, element
// by element with every bound checked: the path of a call whose tensors are not 16-byte aligned.
// Each thread writes whole words (threads never share one); the threadgroup's threads share the
// copy (thread `tid` of FA_THREADS_PER_THREADGROUP).
template <uint ROWS, uint DP, typename T, typename Tile>
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
            const ulong row = ulong(first) + r;
            uint bits = 0;
            FA_UNROLL
            for (uint i = 0; i < PER_WORD; ++i) {
                const uint d = w * PER_WORD + i;
                if (row < seqlen && d < cols) {
                    bits |= TileWords<T>::bits(src[row * stride + d]) << (16 * i);
                }
            }
            tile[r][w / 4][w % 4] = bits;
        }
    }
}

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

// Copies rows [first, first + ROWS) into `tile`, the thread's chunks starting at `from`.
template <uint ROWS, uint DP, typename T, typename Tile>
inline void copy_tile(Tile tile, thread const TileStream<T, ROWS, DP> &s,
                      device const uint4 *from, uint first, constant FlashAttentionParams &p,
                      uint tid) {
    typedef TileStream<T, ROWS, DP> S;
    if (p.scalar_copies != 0) {
        load_rows<ROWS, DP>(tile, s.src, first, s.seqlen, s.stride, s.cols, tid);
        return;
    }
    const uint4 zero = uint4(0);
    if (S::EXACT != 0 && first + ROWS <= s.seqlen) {
        // An interior tile: no row test.
        if (s.cols_inside) {
            FA_UNROLL
            for (uint k = 0; k < S::PASSES; ++k) {
                tile[s.row + k * S::STEP][s.chunk] = *from;
                from += s.pass_step;
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
                tile[r][s.chunk] = *from;
            } else {
                tile[r][s.chunk] = zero;
            }
        }
        from += s.pass_step;
    }
}

// Copies the stream's next tile, rows [first, first + ROWS), into `tile` and advances the stream
// to the tile after it. Every thread of the threadgroup calls it with the same `first`: the first
// row of the previous call plus ROWS (or the `first` of tile_stream or seek).
template <uint ROWS, uint DP, typename T, typename Tile>
inline void load_tile(Tile tile, thread TileStream<T, ROWS, DP> &s, uint first,
                      constant FlashAttentionParams &p, uint tid) {
    device const uint4 *from = s.next;
    s.next += s.tile_step;
    copy_tile(tile, s, from, first, p, tid);
}

// Copies the tile that the last load_tile of the stream copied (rows [first, first + ROWS)) again.
template <uint ROWS, uint DP, typename T, typename Tile>
inline void reload_tile(Tile tile, thread const TileStream<T, ROWS, DP> &s, uint first,
                        constant FlashAttentionParams &p, uint tid) {
    copy_tile(tile, s, s.next - s.tile_step, first, p, tid);
}
