// The 8x8 fragment layer of the kernels: simdgroup_float8x8 values, the lane mapping Apple GPUs
// use for them, loads from threadgroup tiles (flash_attention_loader.h), and reductions over a
// fragment row. Every loop over fragments has a constant trip count and is fully unrolled.
//
// Every fragment holds float32 (MLX's steel attention does the same: half elements are converted
// as they are read from threadgroup memory), so each simdgroup_multiply_accumulate has one element
// type and accumulates in float32. A lane reads and writes its own two elements through
// thread_elements(): element loads are per lane, never collective, and need no alignment.
//
// Lane mapping (design.md; MLX steel mma.h, metal-flash-attention): with q = lane / 4, a lane holds
// (row, col) and (row, col + 1) where row = (q & 4) + (lane / 2) % 4 and col = (q & 2) * 2 +
// (lane % 2) * 2. The four lanes of a row are l, l ^ 1, l ^ 8 and l ^ 9.

// Where a lane's two elements of every 8x8 fragment lie: (row, col) and (row, col + 1).
struct FragmentCoord {
    uint row;
    uint col;
};

inline FragmentCoord fragment_coord(uint lane) {
    const uint q = lane / 4;
    FragmentCoord at;
    at.row = (q & 4) + (lane / 2) % 4;
    at.col = (q & 2) * 2 + (lane % 2) * 2;
    return at;
}

// N fragments side by side: an 8 x 8N block of one SIMD-group (a struct, so kernels pass it by
// reference and index it only with loop counters that unroll).
template <uint N>
struct Fragments {
    simdgroup_float8x8 f[N];
};

template <uint N>
inline void clear(thread Fragments<N> &x) {
    FA_UNROLL
    for (uint j = 0; j < N; ++j) {
        x.f[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
}

// f = tile[row0, row0 + 8) x [8 fcol, 8 fcol + 8), as float: the lane's pair is one 32-bit word of
// a tile of 2-byte T, read as one load. `Tile` is a threadgroup tile of elements of type T
// (flash_attention_loader.h; a template parameter: see metal_stdlib of the CPU engine for why).
// The column comes as a fragment index so that the lane's chunk and word are the fragment's chunk
// plus lane-only terms (no division per fragment).
template <typename T, typename Tile>
inline void load_fragment(thread simdgroup_float8x8 &f, Tile tile, uint row0, uint fcol,
                          FragmentCoord at) {
    typedef TileWords<T> W;
    const uint row = row0 + at.row;
    const uint chunk = fcol * (8 / W::PER_CHUNK) + at.col / W::PER_CHUNK;
    const uint w = (at.col % W::PER_CHUNK) / W::PER_WORD;
    const uint lo = tile[row][chunk][w];
    f.thread_elements()[0] = W::element(lo, 0);
    f.thread_elements()[1] =
        W::PER_WORD == 2 ? W::element(lo, 1) : W::element(tile[row][chunk][w + 1], 0);
}

// f = the transpose of tile[row0, row0 + 8) x [col0, col0 + 8), as float.
template <typename T, typename Tile>
inline void load_fragment_transposed(thread simdgroup_float8x8 &f, Tile tile, uint row0,
                                     uint col0, FragmentCoord at) {
    f.thread_elements()[0] = tile_element<T>(tile, row0 + at.col, col0 + at.row);
    f.thread_elements()[1] = tile_element<T>(tile, row0 + at.col + 1, col0 + at.row);
}

// f = the transpose of rows [row0, row0 + 8) x columns [8 fcol, 8 fcol + 8) of a DP-wide tile of
// 2-byte T in the paired layout (PairedRows, flash_attention_loader.h): the lane's pair, (row0 +
// at.col, c) and the row after, is one 32-bit word.
template <typename T, uint DP, typename Tile>
inline void load_fragment_paired(thread simdgroup_float8x8 &f, Tile tile, uint row0, uint fcol,
                                 FragmentCoord at) {
    typedef TileWords<T> W;
    // Fragments of columns per tile row (a guard for the row-major instances, which never call).
    constexpr uint HALF = DP >= 16 ? DP / 16 : 1;
    const uint row = row0 + at.col + fcol / HALF;
    const uint chunk = fcol % HALF * 2 + at.row / 4;
    const uint pair = tile[row][chunk][at.row % 4];
    f.thread_elements()[0] = W::element(pair, 0);
    f.thread_elements()[1] = W::element(pair, 1);
}

// The maximum and the sum of x over the four lanes that hold one fragment row.
inline float row_max(float x) {
    x = max(x, simd_shuffle_xor(x, ushort(1)));
    return max(x, simd_shuffle_xor(x, ushort(8)));
}

inline float row_sum(float x) {
    x += simd_shuffle_xor(x, ushort(1));
    return x + simd_shuffle_xor(x, ushort(8));
}

// Head_dim slices. A SIMD-group that owns an 8-row group and one of SLICES slices of head_dim
// holds products over its slice only; these two steps sum them over the slices of its row group.
// The sum runs in slice order, so every SIMD-group of a row group ends with the same values.
// Between the two calls the caller places a threadgroup barrier (all threads reach it).
template <uint N, typename Partials>
inline void store_partial(thread Fragments<N> &x, Partials partials, uint sgid, FragmentCoord at) {
    FA_UNROLL
    for (uint j = 0; j < N; ++j) {
        partials[sgid][at.row][j * 8 + at.col] = x.f[j].thread_elements()[0];
        partials[sgid][at.row][j * 8 + at.col + 1] = x.f[j].thread_elements()[1];
    }
}

template <uint N, uint SLICES, typename Partials>
inline void sum_partials(thread Fragments<N> &x, Partials partials, uint first_sgid,
                         FragmentCoord at) {
    FA_UNROLL
    for (uint j = 0; j < N; ++j) {
        FA_UNROLL
        for (uint e = 0; e < 2; ++e) {
            float sum = 0.0f;
            FA_UNROLL
            for (uint w = 0; w < SLICES; ++w) {
                sum += partials[first_sgid + w][at.row][j * 8 + at.col + e];
            }
            x.f[j].thread_elements()[e] = sum;
        }
    }
}
