// Variable-length batches (FlashAttention's flash_attn_varlen_func): sequences packed along the
// rows of q (total_q rows) and of k and v (total_k rows), sequence b being query rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]); lse, delta
// and the lse residual are [num_heads][total_q]. Every pass starts with
// flash_attention_varlen_sequences, which turns the two tables into one FlashAttentionParams per
// sequence; the other kernels run over (blocks of max_seqlen rows, heads, sequences) and, in their
// prologue, take their sequence's struct (sequence_params), leave when their block starts past the
// sequence's end, and move their pointers to the sequence's first row: the kernel bodies then see
// an ordinary one-entry problem with that sequence's lengths (causal and the window bottom-right
// per sequence, as FlashAttention).
//
// The tables are not trusted: each value is clamped to [0, total] and to at least the values before
// it, so a wrong table gives disjoint sequences inside the tensors (wrong numbers, rows left
// unwritten), never an access out of bounds or two threadgroups writing one row.
#ifndef FLASH_ATTENTION_VARLEN_H
#define FLASH_ATTENTION_VARLEN_H

#include "flash_attention_blocks.h"

// Threads of flash_attention_varlen_sequences: one threadgroup, each thread a contiguous range of
// sequences.
#define FA_VARLEN_THREADS FA_THREADS_PER_THREADGROUP

// The struct a threadgroup of sequence `b` works with: the host's for a dense problem, else
// sequence b's entry of the table bound in the host's place (its entry 0 is the host's struct).
// `params` is the kernel's buffer argument, a pointer to an array of unknown length (never a
// reference to one struct read past its end, which Metal may preload as just that struct).
inline constant FlashAttentionParams &sequence_params(constant FlashAttentionParams *params, uint b) {
    return params[0].sequences == 0 ? params[0] : params[1 + b];
}

// Whether a threadgroup whose block starts at row `first` has nothing to do: past the end of its
// sequence's `rows` (only in a varlen pass, whose grid covers max_seqlen rows).
inline bool block_past_end(uint first, uint rows) {
    return first >= rows;
}

// The threadgroup position the kernel bodies see: batch entry 0 of the packed problem in a varlen
// pass (the pointers already start at the sequence), the grid's own otherwise.
inline uint3 sequence_tgid(constant FlashAttentionParams &p, uint3 tgid) {
    uint3 position = tgid;
    position.z = p.sequences == 0 ? tgid.z : 0u;
    return position;
}

// The ALiBi slopes of the threadgroup's sequence: row b of a [sequences][num_heads] table (the
// host's alibi_batch_stride), or the shared [num_heads] row.
inline device const float *sequence_alibi(constant FlashAttentionParams &p, device const float *alibi,
                                          uint b) {
    return p.sequences == 0 ? alibi : alibi + ulong(b) * p.alibi_batch_stride;
}

// cu_seqlens[i] clamped to [0, limit].
inline uint clamped_boundary(device const int *cu_seqlens, uint i, uint limit) {
    return clamp_index(long(cu_seqlens[i]), long(limit));
}

// dst = src word by word: MSL has no implicit copy of a struct between the constant and device
// address spaces (tests/static/check_address_spaces.py enforces that), and this follows any new field.
inline void copy_params(device FlashAttentionParams &dst, constant FlashAttentionParams &src) {
    static_assert(sizeof(FlashAttentionParams) % 4 == 0, "FlashAttentionParams is whole 32-bit words");
    device uint *to = reinterpret_cast<device uint *>(&dst);
    constant uint *from = reinterpret_cast<constant uint *>(&src);
    for (uint i = 0; i < sizeof(FlashAttentionParams) / 4; ++i) {
        to[i] = from[i];
    }
}

struct VarlenSequencesStorage {
    uint max_q[FA_VARLEN_THREADS];
    uint max_k[FA_VARLEN_THREADS];
};

// Writes the sequence table: entry 0 the host's struct, entry 1 + b sequence b's. Sequence b spans
// [s_b, s_{b+1}) with s_i = max over j <= i of cu_seqlens[j] clamped to [0, total] (the same for
// keys): thread t first takes the maximum of its range's boundaries, then starts from the maximum
// of the ranges before it.
template <typename Storage>
inline void varlen_sequences(device const int *cu_q, device const int *cu_k,
                             device FlashAttentionParams *table, constant FlashAttentionParams &p,
                             Storage tg, uint tid) {
    const uint per_thread = (p.sequences + FA_VARLEN_THREADS - 1) / FA_VARLEN_THREADS;
    const uint first = min(tid * per_thread, p.sequences);
    const uint end = min(first + per_thread, p.sequences);
    uint max_q = 0;
    uint max_k = 0;
    for (uint b = first; b < end; ++b) {
        max_q = max(max_q, clamped_boundary(cu_q, b, p.seqlen_q));
        max_k = max(max_k, clamped_boundary(cu_k, b, p.seqlen_k));
    }
    tg->max_q[tid] = max_q;
    tg->max_k[tid] = max_k;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint q0 = 0;
    uint k0 = 0;
    for (uint t = 0; t < tid; ++t) {
        q0 = max(q0, tg->max_q[t]);
        k0 = max(k0, tg->max_k[t]);
    }
    if (tid == 0) {
        copy_params(table[0], p);
    }
    for (uint b = first; b < end; ++b) {
        q0 = max(q0, clamped_boundary(cu_q, b, p.seqlen_q));
        k0 = max(k0, clamped_boundary(cu_k, b, p.seqlen_k));
        const uint q_end = max(q0, clamped_boundary(cu_q, b + 1, p.seqlen_q));
        const uint k_end = max(k0, clamped_boundary(cu_k, b + 1, p.seqlen_k));
        device FlashAttentionParams &s = table[1 + b];
        copy_params(s, p);
        s.seqlen_q = q_end - q0;
        s.seqlen_k = k_end - k0;
        s.kv_chunk_keys = k_end - k0;
        s.seq_q0 = q0;
        s.seq_k0 = k0;
        s.lse_rows = p.seqlen_q;
        s.dropout_stream0 = p.dropout_stream0 + b * p.dropout_heads;
    }
}

#endif
