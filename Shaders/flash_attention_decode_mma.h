// The MMA decode over a quantized cache: the decode kernel's blocks of 1-8 packed rows over an
// 8-bit or 4-bit cache (docs/decode.md, "The MMA decode"). The vector decode's key loop grows with
// the rows (each row's dot products and output updates per lane and key); here a SIMD-group's key
// loop costs the same for 1-8 rows: Q in registers as 8x8 fragments, each iteration
// FA_DECODE_MMA_FRAGMENTS fragments of 8 keys whose K and V fragments every lane reads straight
// from device memory and dequantizes in registers, S^T = K Q^T and O += P V as simdgroup matrix
// products, no threadgroup memory and no barrier (as metal-flash-attention decodes on Apple9;
// facts only, no code).
//
//   SIMD-group s takes keys key_begin + 16s + 64i on (keys per iteration: 16):
//     lane (at.row, at.col) loads key at.row's quarter at.col / 2 of the K and V rows of each
//     fragment (DP / 4 columns: words of one quantization group, one scale and bias each), so each
//     fragment pair it holds is two elements of one word 16 bits apart: masked into a half's
//     mantissa under 1024's exponent (0x6400) it is the half pair 1024 + q, and one fma per
//     element with 1024 folded into the bias (scale * (1024 + q) + (bias - 1024 * scale), in
//     float: exact products for half and bfloat scales; a float cache subtracts 1024 first) gives
//     w without an int-to-float convert (K then rounded to half for a half cache's MMA, as the
//     tiled kernels stage it); a 4-bit word's odd nibbles stay in place
//     (16 q, the scale divided by 16), so a word of 8 elements costs one shift (MLX's quantized
//     matvec reads the same bits, ml-explore/mlx kernels/quantized.h).
//     The head_dim columns are permuted alike in K's fragments and Q's (a dot product's order of
//     terms, no other effect) and in V's and O's (undone when O is stored).
//     S^T (keys x rows) reaches S's lanes by two shuffles per element, the rows' online softmax
//     runs on S as the tiled forward's, and P V adds to O (float operands).
//   after the loop each SIMD-group's (m, l, O) goes to the decode kernel's merge (DecodeStorage).
//
// It serves caches quantized to 8 or 4 bits whose head_dim and head_dim_v are the bucket's DP, a
// power of two up to 128 (a lane's quarter of a row, DP / 4 columns, then lies in one group of at
// least 32): decode_mma_serves. Everything else keeps the vector instances.
#ifndef FLASH_ATTENTION_DECODE_MMA_H
#define FLASH_ATTENTION_DECODE_MMA_H

#include "flash_attention_kv_cache.h"

// The lane of an 8x8 fragment holding (row, col) (col even): fragment_coord's inverse.
inline ushort fragment_lane(uint row, uint col) {
    return ushort(((row & 4) << 2) | ((row & 3) << 1) | ((col & 4) << 1) | ((col & 2) >> 1));
}

// Whether the MMA decode serves this launch's cache (see the top of this file).
template <uint DP>
inline bool decode_mma_serves(constant FlashAttentionParams &p) {
    return p.kv_bits != 0 && p.head_dim == DP && p.head_dim_v == DP;
}

// Fragments of 8 keys per SIMD-group and iteration: the outputs are rescaled once per N.
#define FA_DECODE_MMA_FRAGMENTS 2

// A lane's quarter of its key's K or V row: the words, and the folded scales and biases (zeros,
// so every element 0, for a key past the chunk). The scale and bias of the quarter's group are
// read once per row, by the lane of the group's first quarter (`loads`), and reach the group's
// other lanes by a shuffle from `from`, as the vector decode hands them out.
template <uint DP, uint BITS>
struct DecodeMMAQuarter {
    uint w[DecodeMMALayout<DP, BITS>::WORDS];
    float sb[4];  // scale, bias; scale / 16, bias (folded: bias - 1024 scale, bias - 64 scale)
};

template <uint DP, uint BITS, typename T>
inline DecodeMMAQuarter<DP, BITS> decode_mma_quarter(device const uint *words, device const T *scale,
                                                      device const T *bias, bool valid, bool loads,
                                                      ushort from) {
    typedef DecodeMMALayout<DP, BITS> L;
    DecodeMMAQuarter<DP, BITS> x;
    FA_UNROLL
    for (uint i = 0; i < 4; ++i) {
        x.sb[i] = 0.0f;
    }
    FA_UNROLL
    for (uint i = 0; i < L::WORDS; ++i) {
        x.w[i] = 0u;
    }
    float sc = 0.0f;
    float bi = 0.0f;
    if (valid) {
        FA_DEVICE_READ(words, L::WORDS * 4);
        FA_UNROLL
        for (uint i = 0; i < L::WORDS; ++i) {
            x.w[i] = words[i];
        }
        if (loads) {
            FA_DEVICE_READ(scale, sizeof(T));
            FA_DEVICE_READ(bias, sizeof(T));
            sc = float(*scale);
            bi = float(*bias);
        }
    }
    sc = simd_shuffle(sc, from);
    bi = simd_shuffle(bi, from);
    decode_mma_fold<T>(sc, bi, x.sb);
    return x;
}

// A lane's key slot: its quarter of the K and V rows and their scale and bias as pointers, moved
// by whole steps (contiguous) or found again from the slot's cache rows when the key enters
// another block (paged: CacheDecodeRows, which reads the table once per block).
template <typename T, uint BITS>
struct DecodeMMASlot {
    CacheDecodeRows<T> at;
    device const uint *k;
    device const uint *v;
    device const T *k_scale;
    device const T *k_bias;
    device const T *v_scale;
    device const T *v_bias;

    inline void point(uint col0) {
        const uint word = col0 * BITS / 32;
        const uint group = col0 >> at.k.group_shift;
        k = (device const uint *)at.k.data + at.k_row + word;
        v = (device const uint *)at.v.data + at.v_row + word;
        k_scale = at.k.scales + at.k_scale_row + group;
        k_bias = at.k.biases + at.k_scale_row + group;
        v_scale = at.v.scales + at.v_scale_row + group;
        v_bias = at.v.biases + at.v_scale_row + group;
    }

    inline void next(uint col0) {
        if (at.k.page_rows != 0) {
            at.next();
            point(col0);
            return;
        }
        k += at.k_step;
        v += at.v_step;
        k_scale += at.k_scale_step;
        k_bias += at.k_scale_step;
        v_scale += at.v_scale_step;
        v_bias += at.v_scale_step;
    }
};

// One SIMD-group's keys of the chunk for the block's rows (live of them real), over a cache of
// BITS bits; its (m, l, O) go to tg for the decode kernel's merge.
template <uint DP, uint BITS, typename T, typename KV, typename Storage>
inline void decode_mma_block(device const T *q, KV kv, device const uchar *mask, device const float *alibi,
                             constant FlashAttentionParams &p, PackedRows rows, uint live, uint b,
                             uint kv_head, uint key_begin, uint key_end, Storage tg, uint sgid, uint lane) {
    typedef DecodeMMALayout<DP, BITS> L;
    typedef typename TileFragment<T>::type U;  // Q and K operands: half for half, else float
    constexpr uint F = L::FRAGMENTS;
    constexpr uint N = FA_DECODE_MMA_FRAGMENTS;
    constexpr uint STEP = 8 * N * FA_SIMDGROUPS;
    const FragmentCoord at = fragment_coord(lane);

    // Q^T's fragments (head_dim x rows): element (d, r) of fragment f is q[r][column(f, d)], the
    // column of the quarter d / 2 that K's lanes put at d.
    simdgroup_matrix<U, 8, 8> qt[F];
    FA_UNROLL
    for (uint e = 0; e < 2; ++e) {
        const uint r = at.col + e;
        const uint packed = rows.first + (r < live ? r : 0);
        device const T *row = q + head_offset(p.q, b, packed_head(p, rows, kv_head, packed)) +
                              ulong(packed % p.seqlen_q) * p.q.seq;
        FA_UNROLL
        for (uint f = 0; f < F; ++f) {
            const uint d = L::column(at.row / 2 * L::COLS, f, at.row % 2);
            float x = 0.0f;
            if (r < live) {
                FA_DEVICE_READ(row + d, sizeof(T));
                x = float(row[d]);
            }
            qt[f].thread_elements()[e] = U(x);
        }
    }
    simdgroup_float8x8 o[F];
    FA_UNROLL
    for (uint f = 0; f < F; ++f) {
        o[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    // The lane's row of S (at.row) and its modifiers.
    const bool own_live = at.row < live;
    const uint own_packed = rows.first + (own_live ? at.row : 0);
    const uint own_row = own_live ? own_packed % p.seqlen_q : p.seqlen_q;  // seqlen_q sees no key
    const RowModifiers mods = row_modifiers(p, alibi, b, packed_head(p, rows, kv_head, own_packed), own_row);
    // The keys of the chunk the row sees, as one unsigned compare per key (a dead row sees none).
    KeyRange seen = mods.keys;
    seen.end = min(seen.end, key_end);
    const uint seen_width = seen.end > seen.first ? seen.end - seen.first : 0u;
    float m = -INFINITY;  // the sink joins once, in the combine
    float l = 0.0f;

    // SIMD-group s takes keys key_begin + 8 N s + STEP i on; the lane loads key at.row of each of
    // the N fragments, its quarter col0 of the K and V rows.
    const uint col0 = at.col / 2 * L::COLS;
    DecodeMMASlot<T, BITS> slot[N];
    FA_UNROLL
    for (uint n = 0; n < N; ++n) {
        slot[n].at = decode_rows(kv, p, b, kv_head, key_begin + 8 * (N * sgid + n) + at.row, col0, STEP);
        slot[n].point(col0);
    }
    // The lane of the first quarter of this lane's group (groups of 32-128 columns hold whole
    // quarters of DP / 4 <= 32), which reads the group's scale and bias.
    const uint quarters = max((1u << slot[0].at.k.group_shift) / L::COLS, 1u);
    const uint first_quarter = at.col / 2 / quarters * quarters;
    const bool loads = first_quarter == at.col / 2;
    const ushort scale_lane = fragment_lane(at.row, first_quarter * 2);
    for (uint j0 = key_begin + 8 * N * sgid; j0 < key_end; j0 += STEP) {
        DecodeMMAQuarter<DP, BITS> kq[N];
        DecodeMMAQuarter<DP, BITS> vq[N];
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            const bool valid = j0 + 8 * n + at.row < key_end;
            kq[n] = decode_mma_quarter<DP, BITS>(slot[n].k, slot[n].k_scale, slot[n].k_bias, valid, loads,
                                                 scale_lane);
            vq[n] = decode_mma_quarter<DP, BITS>(slot[n].v, slot[n].v_scale, slot[n].v_bias, valid, loads,
                                                 scale_lane);
            slot[n].next(col0);
        }
        // S^T = K Q^T per fragment of keys, then S = (S^T)^T: the lane's (row at.row, key at.col +
        // e) from the lane holding (key, row).
        float s[N][2];
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            simdgroup_float8x8 st = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            FA_UNROLL
            for (uint f = 0; f < F; ++f) {
                float x[2];
                decode_mma_pair<DP, BITS, T>(kq[n].w, f, kq[n].sb, x);
                simdgroup_matrix<U, 8, 8> kf;
                kf.thread_elements()[0] = U(x[0]);
                kf.thread_elements()[1] = U(x[1]);
                simdgroup_multiply_accumulate(st, kf, qt[f], st);
            }
            const float st0 = st.thread_elements()[0];
            const float st1 = st.thread_elements()[1];
            FA_UNROLL
            for (uint e = 0; e < 2; ++e) {
                const ushort from = fragment_lane(at.col + e, at.row & 6u);
                const float a = simd_shuffle(st0, from);
                const float c = simd_shuffle(st1, from);
                const float raw = (at.row & 1u) != 0 ? c : a;
                const uint key = j0 + 8 * n + at.col + e;
                float t;
                s[n][e] = score<T>(p, mask, raw, own_row, key, mods, key - seen.first < seen_width, t);
            }
        }
        // The row's online softmax over the iteration's 8 N keys (the row's four lanes agree).
        float top = s[0][0];
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            top = max(top, max(s[n][0], s[n][1]));
        }
        const float m_next = max(m, row_max(top));
        const float m_base = softmax_shift(m_next);
        const float correction = exp_of(m - m_base);
        simdgroup_float8x8 pf[N];
        float sum = 0.0f;
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            FA_UNROLL
            for (uint e = 0; e < 2; ++e) {
                const float pe = exp_of(s[n][e] - m_base);
                pf[n].thread_elements()[e] = pe;
                sum += pe;
            }
        }
        l = fma(l, correction, row_sum(sum));
        m = m_next;
        FA_UNROLL
        for (uint f = 0; f < F; ++f) {
            o[f].thread_elements()[0] *= correction;
            o[f].thread_elements()[1] *= correction;
            FA_UNROLL
            for (uint n = 0; n < N; ++n) {
                float x[2];
                decode_mma_pair<DP, BITS, T>(vq[n].w, f, vq[n].sb, x);
                simdgroup_float8x8 vf;
                vf.thread_elements()[0] = x[0];
                vf.thread_elements()[1] = x[1];
                simdgroup_multiply_accumulate(o[f], pf[n], vf, o[f]);
            }
        }
    }

    FA_UNROLL
    for (uint f = 0; f < F; ++f) {
        FA_UNROLL
        for (uint e = 0; e < 2; ++e) {
            tg->o[sgid][at.row][L::column(col0, f, e)] = o[f].thread_elements()[e];
        }
    }
    if (at.col == 0) {  // one lane of each row
        tg->m[sgid][at.row] = m;
        tg->l[sgid][at.row] = l;
    }
}

// The MMA decode kernel's blocks: the MMA decode where it serves the launch (decode_mma_serves),
// by the cache's width; false where the vector instance must run (the host dispatches the kernel
// only where it serves: FA_DECODE_MMA_SERVES). Buckets the MMA decode cannot serve have no
// instance of it (DecodeMMA<DP, false>).
template <uint DP, bool SERVED = DP == 32 || DP == 64 || DP == 128>
struct DecodeMMA {
    template <typename T, typename Storage>
    static inline bool run(device const T *q, CacheKV<T> kv, device const uchar *mask, device const float *alibi,
                           constant FlashAttentionParams &p, PackedRows rows, uint live, uint b, uint kv_head,
                           uint key_begin, uint key_end, Storage tg, uint sgid, uint lane) {
        if (!decode_mma_serves<DP>(p)) {
            return false;
        }
        if (p.kv_bits == 8) {
            decode_mma_block<DP, 8>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
        } else {
            decode_mma_block<DP, 4>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
        }
        return true;
    }
};

template <uint DP>
struct DecodeMMA<DP, false> {
    template <typename T, typename Storage>
    static inline bool run(device const T *, CacheKV<T>, device const uchar *, device const float *,
                           constant FlashAttentionParams &, PackedRows, uint, uint, uint, uint, uint, Storage,
                           uint, uint) {
        return false;
    }
};

template <uint DP, typename T, typename Storage>
inline bool decode_rows_mma(device const T *q, CacheKV<T> kv, device const uchar *mask, device const float *alibi,
                            constant FlashAttentionParams &p, PackedRows rows, uint live, uint b, uint kv_head,
                            uint key_begin, uint key_end, Storage tg, uint sgid, uint lane) {
    return DecodeMMA<DP>::run(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
}

#endif
