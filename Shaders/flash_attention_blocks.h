// The block layer of the kernels: where rows live in device memory, which (query, key) pairs are
// visible, which tiles need an element mask, and the copy of a block of rows from device memory
// into a threadgroup tile.
//
// Masks (bottom-right aligned, as FlashAttention >= 2.1, MLX and PyTorch's lower-right causal):
// query i sees key j iff j < seqlen_k and, when causal, j <= i + seqlen_k - seqlen_q.

// Element offset of row 0 of head `head` of batch `b` in a tensor laid out by `s` (64-bit:
// tensors may span more than 2^32 elements).
inline ulong head_offset(constant FlashAttentionStrides &s, uint b, uint head) {
    return ulong(b) * s.batch + ulong(head) * s.head;
}

// Index of row `row` of head `head` of batch `b` in a [batch][heads][seqlen] tensor (lse, delta).
inline ulong row_index(uint b, uint heads, uint head, uint seqlen, uint row) {
    return (ulong(b) * heads + head) * seqlen + row;
}

// Key j is visible to query i iff j <= i + causal_shift(p) (with causal masks).
inline long causal_shift(constant FlashAttentionParams &p) {
    return long(p.seqlen_k) - long(p.seqlen_q);
}

// Number of keys query row `row` sees: all of them, or with the causal mask the prefix
// j <= row + seqlen_k - seqlen_q (possibly empty).
inline uint visible_keys(constant FlashAttentionParams &p, uint row) {
    if (p.causal == 0) {
        return p.seqlen_k;
    }
    const long n = long(row) + causal_shift(p) + 1;
    return n <= 0 ? 0u : (n >= long(p.seqlen_k) ? p.seqlen_k : uint(n));
}

// First query row that sees key `key` (seqlen_q when none does). Rows see a prefix of the keys,
// so the rows seeing a key form a suffix.
inline uint first_row_seeing(constant FlashAttentionParams &p, uint key) {
    if (p.causal == 0) {
        return 0;
    }
    const long i = long(key) - causal_shift(p);
    return i <= 0 ? 0u : (i >= long(p.seqlen_q) ? p.seqlen_q : uint(i));
}

// Whether query `row` sees key `key`; rows and keys past the end see nothing.
inline bool is_visible(constant FlashAttentionParams &p, uint row, uint key) {
    return row < p.seqlen_q && key < p.seqlen_k &&
           (p.causal == 0 || long(key) <= long(row) + causal_shift(p));
}

// Whether every pair of rows [row0, row0 + rows) x keys [key0, key0 + keys) exists and is
// visible: then the tile needs no element mask. The same for every thread of a threadgroup.
inline bool tile_unmasked(constant FlashAttentionParams &p, uint row0, uint rows, uint key0,
                          uint keys) {
    if (ulong(row0) + rows > p.seqlen_q || ulong(key0) + keys > p.seqlen_k) {
        return false;
    }
    return p.causal == 0 || long(key0) + long(keys) - 1 <= long(row0) + causal_shift(p);
}

// Fragments of 8 columns of a head_dim slice [col0, col0 + 8 * n) that hold columns below
// head_dim: the rest are zero padding, skipped by every product (same for the whole SIMD-group).
inline uint active_fragments(uint head_dim, uint col0, uint n) {
    const uint padded = (head_dim + 7) / 8 * 8;
    return padded <= col0 ? 0u : min(n, (padded - col0) / 8);
}

// Copies rows [first, first + ROWS) of a [seqlen][cols] matrix whose rows lie `stride` elements
// apart (src points at its row 0) into tile[ROWS][>= DP], zero past seqlen and past cols. The
// threadgroup's threads share the copy (thread `tid` of FA_THREADS_PER_THREADGROUP).
template <uint ROWS, uint DP, typename T, typename Tile>
inline void load_rows(Tile tile, device const T *src, uint first, uint seqlen, ulong stride,
                      uint cols, uint tid) {
    for (uint e = tid; e < ROWS * DP; e += FA_THREADS_PER_THREADGROUP) {
        const uint r = e / DP;
        const uint d = e % DP;
        const ulong row = ulong(first) + r;
        tile[r][d] = (row < seqlen && d < cols) ? src[row * stride + d] : T(0.0f);
    }
}
