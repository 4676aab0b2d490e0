// The decode forward: at most FA_SPLIT_MAX_QUERY_ROWS query rows per head over a KV cache, bound by
// memory bandwidth. Shaped like MLX's `sdpa_vector` (ml-explore/mlx, kernels/sdpa_vector.h; facts
// only, no code): every lane holds a contiguous slice of head_dim and reads it straight from device
// memory with the widest aligned vector loads, the SIMD-groups take the keys in turn, and nothing
// is staged in threadgroup memory in the key loop (no barrier there). Unlike sdpa_vector, one
// threadgroup serves the packed rows of a whole GQA group (as the split-KV forward packs them:
// index g * seqlen_q + i), so each K/V element is read once per chunk of keys and block of rows.
//
//   threadgroup (chunk x row block, KV head, batch), FA_SIMDGROUPS SIMD-groups; the block's live
//   rows take the instance of RI = 1, 2, 4 or FA_DECODE_ROWS(DP) rows that holds them:
//     each lane loads its slice of the RI q rows (as float)
//     per iteration, SIMD-group s takes N = FA_DECODE_KEYS(RI, E) keys (slot n: s + 4n + 4N i):
//       load the lane's K and V slices of the N keys (a KV cache's: paged, dequantized in registers)
//       N x RI partial dot products, reduce-scattered over the lanes (reduce_scatter): each lane
//       ends with one (key, row) product, scores it and runs that row's online softmax over the N
//       keys (m, l in the lanes that hold the row); every lane rescales its output slices once and
//       adds each key's V slice with the weight broadcast from the lane that holds it
//     the SIMD-groups' (m, l, o) meet in threadgroup memory once (one barrier) and merge in
//     SIMD-group order; the chunk's normalised output and lse go to partial_out / partial_lse,
//     which forward_combine (flash_attention_forward.h) merges over the chunks with the sink.
//
// Sums run in a fixed order (lanes by a fixed exchange pattern, keys in order per slot, slots in
// order, SIMD-groups 0..3, chunks 0..n): results are bit-identical from run to run.
#ifndef FLASH_ATTENTION_DECODE_H
#define FLASH_ATTENTION_DECODE_H

#include "flash_attention_forward.h"

// How one lane holds a row of a bucket DP wide: E elements of T, the smallest power of two that
// covers DP / 32 and fills at least one 32-bit word; LANES lanes hold columns (the others hold
// zeros). The slice is read in PIECES loads of PIECE bytes (at most FA_CHUNK_BYTES, the widest
// aligned load), e.g. 8 bytes at head_dim 128 in half, 16 in float.
template <typename T, uint DP>
struct DecodeLane {
    enum : uint {
        SPAN = (DP + 31) / 32,
        POW2 = SPAN <= 1 ? 1 : SPAN <= 2 ? 2 : SPAN <= 4 ? 4 : SPAN <= 8 ? 8 : SPAN <= 16 ? 16 : 32,
        E = POW2 * sizeof(T) < 4 ? 4 / sizeof(T) : POW2,
        BYTES = E * sizeof(T),
        PIECE = BYTES < FA_CHUNK_BYTES ? BYTES : FA_CHUNK_BYTES,
        PIECES = BYTES / PIECE,
        WORDS = BYTES / 4,
        LANES = DP / E,
    };
};

// One lane's slice of a row, as the 32-bit words it was loaded in (TileWords<T> reads them).
template <uint WORDS>
struct DecodeSlice {
    uint w[WORDS];
};

// A load of BYTES bytes as one vector of words.
template <uint BYTES>
struct DecodePiece;

template <>
struct DecodePiece<4> {
    typedef uint type;
    static inline void put(type x, thread uint *w) { w[0] = x; }
};

template <>
struct DecodePiece<8> {
    typedef uint2 type;
    static inline void put(type x, thread uint *w) {
        w[0] = x.x;
        w[1] = x.y;
    }
};

template <>
struct DecodePiece<16> {
    typedef uint4 type;
    static inline void put(type x, thread uint *w) {
        w[0] = x.x;
        w[1] = x.y;
        w[2] = x.z;
        w[3] = x.w;
    }
};

// Loads the lane's slice, columns [col0, col0 + E), of the row at `row` (`cols` wide; zero past
// cols). The vector path needs what the host's scalar_copies = 0 promises (rows and head_dims on
// 16-byte boundaries), which also puts each piece wholly inside or outside cols; otherwise every
// element is loaded and checked alone.
template <typename T, uint DP>
inline DecodeSlice<DecodeLane<T, DP>::WORDS> load_slice(device const T *row, uint col0, uint cols,
                                                        bool scalar) {
    typedef DecodeLane<T, DP> L;
    typedef DecodePiece<L::PIECE> P;
    constexpr uint PER_PIECE = L::PIECE / sizeof(T);
    DecodeSlice<L::WORDS> s;
    if (!scalar) {
        FA_UNROLL
        for (uint i = 0; i < L::PIECES; ++i) {
            const uint c = col0 + i * PER_PIECE;
            typename P::type x = typename P::type(0);
            if (c < cols) {
                FA_DEVICE_READ(row + c, L::PIECE);
                x = *(device const typename P::type *)(row + c);
            }
            P::put(x, s.w + i * (L::PIECE / 4));
        }
        return s;
    }
    constexpr uint PER_WORD = TileWords<T>::PER_WORD;
    FA_UNROLL
    for (uint w = 0; w < L::WORDS; ++w) {
        uint bits = 0;
        FA_UNROLL
        for (uint i = 0; i < PER_WORD; ++i) {
            const uint d = col0 + w * PER_WORD + i;
            if (d < cols) {
                FA_DEVICE_READ(row + d, sizeof(T));
                bits |= TileWords<T>::bits(row[d]) << (16 * i);
            }
        }
        s.w[w] = bits;
    }
    return s;
}

// Element i of a slice, as float.
template <typename T, uint WORDS>
inline float slice_element(thread const DecodeSlice<WORDS> &s, uint i) {
    typedef TileWords<T> W;
    return W::element(s.w[i / W::PER_WORD], i % W::PER_WORD);
}

// The K/V rows one key slot of a SIMD-group of the decode kernel walks: keys first, first + step,
// ... A K/V source gives them through decode_rows(kv, p, b, kv_head, first, col0, step) (plain tensors
// here; a KV cache's in flash_attention_kv_cache.h): `load` fills the lane's slice of the current
// key's K and V as float, `next` moves to the SIMD-group's next key. The only place the decode
// kernel addresses K and V. The key loop moves by whole steps (a 64-bit add), never multiplying
// per key.
template <typename T>
struct DeviceDecodeRows {
    device const T *k;  // the current key's rows
    device const T *v;
    ulong k_step;       // elements from one of the SIMD-group's keys to its next
    ulong v_step;

    template <uint DP>
    inline void load(constant FlashAttentionParams &p, uint lane, bool scalar, thread float *kf,
                     thread float *vf) const {
        typedef DecodeLane<T, DP> L;
        const DecodeSlice<L::WORDS> kw = load_slice<T, DP>(k, lane * L::E, p.head_dim, scalar);
        const DecodeSlice<L::WORDS> vw = load_slice<T, DP>(v, lane * L::E, p.head_dim_v, scalar);
        FA_UNROLL
        for (uint e = 0; e < L::E; ++e) {
            kf[e] = slice_element<T>(kw, e);
            vf[e] = slice_element<T>(vw, e);
        }
    }

    inline void next() {
        k += k_step;
        v += v_step;
    }
};

template <typename T>
inline DeviceDecodeRows<T> decode_rows(DeviceKV<T> kv, constant FlashAttentionParams &p, uint b,
                                       uint kv_head, uint first, uint col0, uint step) {
    DeviceDecodeRows<T> r;
    r.k = kv.k + head_offset(p.k, b, kv_head) + ulong(first) * p.k.seq;
    r.v = kv.v + head_offset(p.v, b, kv_head) + ulong(first) * p.v.seq;
    r.k_step = ulong(step) * p.k.seq;
    r.v_step = ulong(step) * p.v.seq;
    return r;
}

// log2 of a power of two up to 32, at compile time.
template <uint X>
struct DecodeLog2 {
    enum : uint { value = X <= 1 ? 0 : X <= 2 ? 1 : X <= 4 ? 2 : X <= 8 ? 3 : X <= 16 ? 4 : 5 };
};

// The lane-transposed reduce-scatter of M partial sums (a power of two, 2 to 32) over the
// SIMD-group: step k exchanges half of the values still held with lane ^ (16 >> k), the upper
// lane keeping the upper half, so after log2(M) steps each lane holds one value, index
// decode_value(lane); the remaining steps add the partners' sums. Every lane holding an index holds
// the same bits (its sums pair the same terms in the same order, and a + b == b + a). Shuffles:
// M - 1 + 5 - log2(M), against 5 per value for a simd_sum each.
template <uint M>
inline float reduce_scatter(thread float *x, uint lane) {
    constexpr uint STEPS = DecodeLog2<M>::value;
    FA_UNROLL
    for (uint k = 0; k < STEPS; ++k) {
        const uint width = M >> (k + 1);
        const ushort offset = ushort(16u >> k);
        const bool upper = (lane & offset) != 0;
        FA_UNROLL
        for (uint i = 0; i < width; ++i) {
            const float send = upper ? x[i] : x[i + width];
            const float keep = upper ? x[i + width] : x[i];
            x[i] = keep + simd_shuffle_xor(send, offset);
        }
    }
    float sum = x[0];
    FA_UNROLL
    for (uint k = STEPS; k < 5; ++k) {
        sum += simd_shuffle_xor(sum, ushort(16u >> k));
    }
    return sum;
}

// The index of the value reduce_scatter<M> leaves in `lane`, and the lowest lane holding index v.
template <uint M>
inline uint decode_value(uint lane) {
    return (lane >> (5 - DecodeLog2<M>::value)) & (M - 1);
}

template <uint M>
inline ushort decode_owner(uint v) {
    return ushort(v << (5 - DecodeLog2<M>::value));
}

// Each SIMD-group's online-softmax state of the block's rows, merged once after the key loop.
template <uint DP>
struct DecodeStorage {
    float o[FA_SIMDGROUPS][FA_DECODE_ROWS(DP)][DP];
    float m[FA_SIMDGROUPS][FA_DECODE_ROWS(DP)];
    float l[FA_SIMDGROUPS][FA_DECODE_ROWS(DP)];
};

// One SIMD-group's keys of the chunk for the first RI rows of the block (live of them real; RI is
// 1, 2, 4 or FA_DECODE_ROWS(DP)): each lane keeps its slice of every row's q and output, and
// after the reduce-scatter of the FA_DECODE_KEYS x RI dot products, the running max m and sum l
// of the one (key, row) value it holds (decode_value); the SIMD-group's state goes to tg for
// the merge.
template <uint DP, uint RI, typename T, typename KV, typename Storage>
inline void decode_block(device const T *q, KV kv, device const uchar *mask, device const float *alibi,
                         constant FlashAttentionParams &p, PackedRows rows, uint live, uint b,
                         uint kv_head, uint key_begin, uint key_end, Storage tg, uint sgid, uint lane) {
    typedef DecodeLane<T, DP> L;
    constexpr uint N = FA_DECODE_KEYS(RI, L::E);
    constexpr uint M = N * RI;
    static_assert(M <= 32 && (M & (M - 1)) == 0, "one value per lane at most, a power of two");
    const uint col0 = lane * L::E;
    const bool scalar = p.scalar_copies != 0;

    float qs[RI][L::E];
    float o[RI][L::E];
    FA_UNROLL
    for (uint r = 0; r < RI; ++r) {
        const uint packed = rows.first + (r < live ? r : 0);
        const uint h = packed_head(p, rows, kv_head, packed);
        const DecodeSlice<L::WORDS> s = load_slice<T, DP>(
            q + head_offset(p.q, b, h) + ulong(packed % p.seqlen_q) * p.q.seq, col0,
            r < live ? p.head_dim : 0, scalar);
        FA_UNROLL
        for (uint e = 0; e < L::E; ++e) {
            qs[r][e] = slice_element<T>(s, e);
            o[r][e] = 0.0f;
        }
    }
    // The (key slot, row) this lane scores: value n * RI + r of the reduce-scatter.
    const uint own_v = decode_value<M>(lane);
    const uint own_n = own_v / RI;
    const uint own_r = own_v % RI;
    const bool own_live = own_r < live;
    const uint own_packed = rows.first + (own_live ? own_r : 0);
    const uint own_row = own_live ? own_packed % p.seqlen_q : p.seqlen_q;  // seqlen_q sees no key
    const RowModifiers mods = row_modifiers(p, alibi, b, packed_head(p, rows, kv_head, own_packed), own_row);
    float m = -INFINITY;  // the sink joins once, in the combine
    float l = 0.0f;

    // Slot n walks keys key_begin + sgid + n * FA_SIMDGROUPS, stepping FA_SIMDGROUPS * N.
    typedef decltype(decode_rows(kv, p, b, kv_head, key_begin, col0, 0)) Rows;
    Rows kvr[N];
    FA_UNROLL
    for (uint n = 0; n < N; ++n) {
        kvr[n] = decode_rows(kv, p, b, kv_head, key_begin + sgid + n * FA_SIMDGROUPS, col0, N * FA_SIMDGROUPS);
    }
    for (uint j = key_begin + sgid; j < key_end; j += N * FA_SIMDGROUPS) {
        float kf[N][L::E];
        float vf[N][L::E];
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            if (j + n * FA_SIMDGROUPS < key_end) {  // the same for the whole SIMD-group
                kvr[n].template load<DP>(p, lane, scalar, kf[n], vf[n]);
            } else {
                FA_UNROLL
                for (uint e = 0; e < L::E; ++e) {
                    kf[n][e] = 0.0f;
                    vf[n][e] = 0.0f;
                }
            }
            kvr[n].next();
        }
        float dot[M];
        FA_UNROLL
        for (uint n = 0; n < N; ++n) {
            FA_UNROLL
            for (uint r = 0; r < RI; ++r) {
                float d = 0.0f;
                FA_UNROLL
                for (uint e = 0; e < L::E; ++e) {
                    d = fma(qs[r][e], kf[n][e], d);
                }
                dot[n * RI + r] = d;
            }
        }
        const float raw = reduce_scatter<M>(dot, lane);

        // The online softmax of the lane's (key, row), once per iteration for the N keys: the
        // row's max over them (its other keys' lanes differ in the top bits), one correction.
        const uint key = j + own_n * FA_SIMDGROUPS;
        float s = -INFINITY;
        if (own_live && key < key_end) {
            float t;
            s = score<T>(p, mask, raw, own_row, key, mods, in_window(mods.keys, key), t);
        }
        float top = s;
        FA_UNROLL
        for (uint n = 1; n < N; n *= 2) {
            top = max(top, simd_shuffle_xor(top, decode_owner<M>(n * RI)));
        }
        const float m_next = max(m, top);
        // While a row has seen no key, m_next is -inf: subtracting 0 keeps exp at 0
        // (softmax_shift: +inf gives l +inf, not NaN).
        const float m_base = softmax_shift(m_next);
        const float correction = exp_of(m - m_base);
        const float pe = exp_of(s - m_base);
        float pe_sum = pe;
        FA_UNROLL
        for (uint n = 1; n < N; n *= 2) {
            pe_sum += simd_shuffle_xor(pe_sum, decode_owner<M>(n * RI));
        }
        l = fma(l, correction, pe_sum);
        m = m_next;

        // Every lane's output slice of each row: rescaled once, then each key's weight from the
        // lane that holds it.
        FA_UNROLL
        for (uint r = 0; r < RI; ++r) {
            const float c = simd_shuffle(correction, decode_owner<M>(r));
            FA_UNROLL
            for (uint e = 0; e < L::E; ++e) {
                o[r][e] *= c;
            }
            FA_UNROLL
            for (uint n = 0; n < N; ++n) {
                const float w = simd_shuffle(pe, decode_owner<M>(n * RI + r));
                FA_UNROLL
                for (uint e = 0; e < L::E; ++e) {
                    o[r][e] = fma(w, vf[n][e], o[r][e]);
                }
            }
        }
    }

    FA_UNROLL
    for (uint r = 0; r < RI; ++r) {
        if (lane < L::LANES) {
            FA_UNROLL
            for (uint e = 0; e < L::E; ++e) {
                tg->o[sgid][r][col0 + e] = o[r][e];
            }
        }
    }
    if (lane == decode_owner<M>(own_r)) {  // slot 0's lowest lane of each row
        tg->m[sgid][own_r] = m;
        tg->l[sgid][own_r] = l;
    }
}

// The MMA decode of a block's rows where the K/V source has one (flash_attention_decode_mma.h:
// quantized caches, found by argument-dependent lookup); false: the vector instance runs.
template <uint DP, typename T, typename KV, typename Storage>
inline bool decode_rows_mma(device const T *, KV, device const uchar *, device const float *,
                            constant FlashAttentionParams &, PackedRows, uint, uint, uint, uint, uint, Storage, uint,
                            uint) {
    return false;
}

// One chunk of keys for one block of FA_DECODE_ROWS(DP) packed rows: threadgroups (row blocks x
// chunks, KV heads, batch), x = chunk * row_blocks + row block, as the split-KV forward. Writes the
// chunk's normalised output and lse of each row (partial_index). MMA: the MMA decode's instance
// (the forward_decode_mma_kvcache kernel), which takes every block by decode_rows_mma where it
// serves the launch and the 8-row vector instance where not.
template <uint DP, bool MMA = false, typename T, typename KV, typename Storage>
inline void attention_forward_decode(device const T *q, KV kv, device const uchar *mask,
                                     device const float *alibi, device float *partial_out,
                                     device float *partial_lse, constant FlashAttentionParams &p,
                                     Storage tg, uint3 tgid, uint sgid, uint lane) {
    typedef DecodeLane<T, DP> L;
    constexpr uint R = FA_DECODE_ROWS(DP);
    static_assert(sizeof(DecodeStorage<DP>) == FA_DECODE_THREADGROUP_BYTES(DP),
                  "the host sizes the decode threadgroup by FA_DECODE_THREADGROUP_BYTES");
    static_assert(DP <= FA_DECODE_MAX_HEAD_DIM, "a decode instance above FA_DECODE_MAX_HEAD_DIM");
    static_assert(2 * R * L::E <= FA_MAX_ACCUMULATOR_FLOATS,
                  "q and output floats per lane above the budget (flash_attention_params.h)");
    const uint b = tgid.z;
    const uint kv_head = tgid.y;
    const uint group = p.num_heads / p.num_kv_heads;
    const uint row_blocks = (group * p.seqlen_q + R - 1) / R;
    const uint x = tgid.x + p.block_offset;
    const uint chunk = x / row_blocks;
    const PackedRows rows = packed_rows<R>(p, x % row_blocks);
    const uint live = min(R, rows.count - rows.first);  // rows of the block that exist

    // The chunk's keys that some row of the block sees through the window.
    const uint chunk_begin = chunk * p.kv_chunk_keys;
    const uint key_begin = max(chunk_begin, key_range(p, rows.i_min).first);
    const uint key_end = min(chunk_begin + p.kv_chunk_keys, key_range(p, rows.i_max).end);
    // The instance sized to the live rows (the same for the whole threadgroup).
    if (MMA) {
        if (!decode_rows_mma<DP>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid,
                                 lane)) {
            decode_block<DP, R>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
        }
    } else if (live <= 1) {
        decode_block<DP, 1>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
    } else if (live <= 2) {
        decode_block<DP, 2>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
    } else if (live <= 4) {
        decode_block<DP, 4>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
    } else {
        decode_block<DP, R>(q, kv, mask, alibi, p, rows, live, b, kv_head, key_begin, key_end, tg, sgid, lane);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = sgid * 32 + lane; e < R * DP; e += FA_THREADS_PER_THREADGROUP) {
        const uint r = e / DP;
        const uint d = e % DP;
        if (r < live && d < p.head_dim_v) {
            float top = -INFINITY;
            for (uint g = 0; g < FA_SIMDGROUPS; ++g) {
                top = max(top, tg->m[g][r]);
            }
            const float base = softmax_shift(top);
            float total = 0.0f;
            float acc = 0.0f;
            for (uint g = 0; g < FA_SIMDGROUPS; ++g) {
                const float w = exp_of(tg->m[g][r] - base);
                total = fma(tg->l[g][r], w, total);
                acc = fma(tg->o[g][r][d], w, acc);
            }
            const ulong index = partial_index(p, rows, b, kv_head, rows.first + r, chunk);
            // (total NaN, from a NaN score, must reach partial_out: never taken for an empty row.)
            partial_out[index * p.head_dim_v + d] = total == 0.0f ? 0.0f : acc / total;
            if (d == 0) {
                store_partial_lse(partial_lse, index, top, total);
            }
        }
    }
}

#endif
