// The block layer of the kernels: where rows live in device memory, which (query, key) pairs are
// visible and which tiles need an element mask (the copies of tiles: flash_attention_loader.h).
//
// Masks (bottom-right aligned, as FlashAttention >= 2.1, MLX and PyTorch's lower-right causal):
// query i sees key j iff j < seqlen_k and i + shift - window_left <= j <= i + shift + window_right
// with shift = seqlen_k - seqlen_q (a side at -1 is unbounded; causal is window_right = 0), and a
// boolean attn_mask, where given, allows it.
#ifndef FLASH_ATTENTION_BLOCKS_H
#define FLASH_ATTENTION_BLOCKS_H

#include "flash_attention_features.h"

// Element offset of row 0 of head `head` of batch `b` in a tensor laid out by `s` (64-bit:
// tensors may span more than 2^32 elements).
inline ulong head_offset(constant FlashAttentionStrides &s, uint b, uint head) {
    return ulong(b) * s.batch + ulong(head) * s.head;
}

// Index of row `row` of head `head` of batch `b` in a [batch][heads][seqlen] tensor (lse, delta).
inline ulong row_index(uint b, uint heads, uint head, uint seqlen, uint row) {
    return (ulong(b) * heads + head) * seqlen + row;
}

// Index of query row `row` of head `head` of batch `b` in lse, delta and the lse residual:
// [batch][num_heads][seqlen_q], or in a varlen sequence's struct [num_heads][lse_rows] (the caller's
// pointer then starts at the sequence's first row, b is 0).
inline ulong lse_index(constant FlashAttentionParams &p, uint b, uint head, uint row) {
    return row_index(b, p.num_heads, head, p.sequences == 0 ? p.seqlen_q : p.lse_rows, row);
}

// x clamped to [0, limit].
inline uint clamp_index(long x, long limit) {
    return uint(x < 0 ? 0 : (x > limit ? limit : x));
}

// The keys [first, end) query row `row` sees through the window (empty when end <= first).
struct KeyRange {
    uint first;
    uint end;
};

inline KeyRange key_range(constant FlashAttentionParams &p, uint row) {
    const long centre = long(row) + long(p.seqlen_k) - long(p.seqlen_q);
    const long first = p.window_left < 0 ? 0 : centre - p.window_left;
    const long end = p.window_right < 0 ? long(p.seqlen_k) : centre + p.window_right + 1;
    KeyRange r;
    r.first = clamp_index(first, p.seqlen_k);
    r.end = clamp_index(end, p.seqlen_k);
    return r;
}

// The query rows [first, end) that see some key of [key0, key0 + keys) through the window. Both
// bounds of a row's key range grow with the row, so these rows are contiguous.
inline KeyRange row_range(constant FlashAttentionParams &p, uint key0, uint keys) {
    const long shift = long(p.seqlen_k) - long(p.seqlen_q);
    const long first = p.window_right < 0 ? 0 : long(key0) - shift - p.window_right;
    const long end = p.window_left < 0 ? long(p.seqlen_q) : long(key0) + keys - shift + p.window_left;
    KeyRange r;
    r.first = clamp_index(first, p.seqlen_q);
    r.end = clamp_index(end, p.seqlen_q);
    return r;
}

// The keys query `row` sees through the window; none for a row past the end (keys past the end
// are outside every range). A boolean attn_mask is applied separately.
inline KeyRange visible_keys(constant FlashAttentionParams &p, uint row) {
    KeyRange r = key_range(p, row);
    if (row >= p.seqlen_q) {
        r.end = r.first;
    }
    return r;
}

// Whether every pair of rows [row0, row0 + rows) x keys [key0, key0 + keys) exists, lies in the
// window and is not subject to a boolean mask: then the tile needs no element mask. The same for
// every thread of a threadgroup.
// unmasked_keys gives, once per row block, the keys [first, end) whose tiles need none; a tile then
// needs none when it lies inside them (tile_unmasked).
inline KeyRange unmasked_keys(constant FlashAttentionParams &p, uint row0, uint rows) {
    KeyRange r;
    r.first = 0;
    r.end = 0;
    if (mask_type_of(p) == FA_MASK_BOOL || ulong(row0) + rows > p.seqlen_q) {
        return r;
    }
    // The first row has the smallest key range end, the last row the largest range start (both
    // clamped to seqlen_k).
    r.first = key_range(p, row0 + rows - 1).first;
    r.end = key_range(p, row0).end;
    return r;
}

inline bool tile_unmasked(KeyRange unmasked, uint key0, uint keys) {
    return key0 >= unmasked.first && key0 + keys <= unmasked.end;
}

inline bool tile_unmasked(constant FlashAttentionParams &p, uint row0, uint rows, uint key0,
                          uint keys) {
    return tile_unmasked(unmasked_keys(p, row0, rows), key0, keys);
}

// Fragments of 8 columns of a head_dim slice [col0, col0 + 8 * n) that hold columns below
// head_dim: the rest are zero padding, skipped by every product (same for the whole SIMD-group).
inline uint active_fragments(uint head_dim, uint col0, uint n) {
    const uint padded = (head_dim + 7) / 8 * 8;
    return padded <= col0 ? 0u : min(n, (padded - col0) / 8);
}

#endif
