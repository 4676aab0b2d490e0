// The 8x8 fragment layer of the kernels: simdgroup_float8x8 values, the lane mapping Apple GPUs
// use for them, loads from threadgroup tiles (flash_attention_loader.h), and reductions over a
// fragment row. Every loop over fragments has a constant trip count and is fully unrolled.
//
// Accumulators and the products' register operands (P, dS) hold float32. The operands read from
// two tiles (Q K^T, dO V^T and their transposes: product_transposed in flash_attention_products.h) are
// fragments of TileFragment<T>: half for half tiles, so a lane's pair is one 32-bit word moved as
// it is, with no conversion, and the multiply-accumulate reads half operands into a float32
// accumulator; float for bfloat and float tiles (bfloat elements are converted as they are read).
// A product of two halves is exact in float32, so half operands give the very sums of float ones.
// The products of a float32 register operand and a tile (P V, dS K, P^T dO, dS^T Q) read the tile
// as float fragments: one element type on each side of every multiply that is not half x half.
// A lane reads and writes its own two elements through thread_elements(): element loads are per
// lane, never collective, and need no alignment.
//
// Half operands with a float accumulator in one simdgroup_multiply_accumulate compile with Apple's
// compiler and run on Apple7+ GPUs: llama.cpp's flash_attn_ext kernel multiplies simdgroup_half8x8
// Q and K fragments into a simdgroup_float8x8 (ggml-org/llama.cpp ggml/src/ggml-metal/
// ggml-metal.metal, FA_TYPES), and Dawn exposes this f16-input/f32-result configuration on Metal,
// tested for float32 accumulator precision on Apple M1 (dawn.googlesource.com commit ee1f8a3).
// The CPU engine and the CUDA check build convert every operand to float32 exactly and accumulate
// in float32 whatever the operand types (msl_simdgroup_matrix.h, tests/cuda/metal_cuda.h).
//
// Lane mapping (design.md; MLX steel mma.h, metal-flash-attention): with q = lane / 4, a lane holds
// (row, col) and (row, col + 1) where row = (q & 4) + (lane / 2) % 4 and col = (q & 2) * 2 +
// (lane % 2) * 2. The four lanes of a row are l, l ^ 1, l ^ 8 and l ^ 9.
#ifndef FLASH_ATTENTION_FRAGMENT_H
#define FLASH_ATTENTION_FRAGMENT_H

#include "flash_attention_loader.h"

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

// The element type of the fragments read from two tiles of T (see the top of this file).
template <typename T>
struct TileFragment {
    typedef float type;
};

template <>
struct TileFragment<half> {
    typedef half type;
};

// Sets the lane's pair of f from one 32-bit word of a tile of 2-byte T: a half fragment takes the
// word's bits as they are (through a reference to thread_elements(), as MLX's steel mma.h assigns
// a pair), a float fragment the two elements converted.
template <typename T>
inline void set_pair(thread simdgroup_half8x8 &f, uint word) {
    reinterpret_cast<thread half2 &>(f.thread_elements()) = as_type<half2>(word);
}

template <typename T>
inline void set_pair(thread simdgroup_float8x8 &f, uint word) {
    // Built in a register first, so that the two conversions can become one of a vector.
    float2 pair;
    pair[0] = TileWords<T>::element(word, 0);
    pair[1] = TileWords<T>::element(word, 1);
    reinterpret_cast<thread float2 &>(f.thread_elements()) = pair;
}

// f = tile[row0, row0 + 8) x [8 fcol, 8 fcol + 8), with elements of type U (float, or half for a
// half tile): the lane's pair is one 32-bit word of a tile of 2-byte T, read as one load. `Tile`
// is a threadgroup tile of elements of type T (flash_attention_loader.h; a template parameter: see
// metal_stdlib of the CPU engine for why). The column comes as a fragment index so that the lane's
// chunk and word are the fragment's chunk plus lane-only terms (no division per fragment).
template <typename T, typename U, typename Tile>
inline void load_fragment(thread simdgroup_matrix<U, 8, 8> &f, Tile tile, uint row0, uint fcol,
                          FragmentCoord at) {
    typedef TileWords<T> W;
    const uint row = row0 + at.row;
    const uint chunk = fcol * (8 / W::PER_CHUNK) + at.col / W::PER_CHUNK;
    const uint w = (at.col % W::PER_CHUNK) / W::PER_WORD;
    const uint lo = tile[row][chunk][w];
    if (W::PER_WORD == 2) {
        set_pair<T>(f, lo);
    } else {
        f.thread_elements()[0] = U(W::element(lo, 0));
        f.thread_elements()[1] = U(W::element(tile[row][chunk][w + 1], 0));
    }
}

// f = the transpose of tile[row0, row0 + 8) x [col0, col0 + 8), elements of type U as in
// load_fragment (a half element converted to float and back is the same half).
template <typename T, typename U, typename Tile>
inline void load_fragment_transposed(thread simdgroup_matrix<U, 8, 8> &f, Tile tile, uint row0,
                                     uint col0, FragmentCoord at) {
    f.thread_elements()[0] = U(tile_element<T>(tile, row0 + at.col, col0 + at.row));
    f.thread_elements()[1] = U(tile_element<T>(tile, row0 + at.col + 1, col0 + at.row));
}

// f = the transpose of rows [row0, row0 + 8) x columns [8 fcol, 8 fcol + 8) of a DP-wide tile of
// 2-byte T in the paired layout (PairedRows, flash_attention_loader.h): the lane's pair, (row0 +
// at.col, c) and the row after, is one 32-bit word.
template <typename T, uint DP, typename U, typename Tile>
inline void load_fragment_paired(thread simdgroup_matrix<U, 8, 8> &f, Tile tile, uint row0,
                                 uint fcol, FragmentCoord at) {
    // Fragments of columns per tile row (a guard for the row-major instances, which never call).
    constexpr uint HALF = DP >= 16 ? DP / 16 : 1;
    const uint row = row0 + at.col + fcol / HALF;
    const uint chunk = fcol % HALF * 2 + at.row / 4;
    set_pair<T>(f, tile[row][chunk][at.row % 4]);
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

#endif
