// Merging attention results over disjoint key sets: the log-sum-exp combine behind split-KV
// decoding, ring attention and fa_merge_attention. Included after <metal_stdlib> and
// `using namespace metal` (flash_attention.metal).
//
// Math (FlashAttention-2, Dao 2023, the rescaling of its online softmax; Flash-Decoding): a part
// computed over key set K_i has out_i = sum_{j in K_i} exp(s_j - lse_i) v_j and
// lse_i = log sum_{j in K_i} exp(s_j). Over the union of the key sets:
//   m = max_i lse_i,  w_i = exp(lse_i - m),  lse = m + log(sum_i w_i),
//   out = sum_i w_i out_i / sum_i w_i.
// A part that saw no key (lse_i = -inf) has weight 0 and its out_i is never read; a row whose
// parts are all empty gets out = 0 and lse = -inf. -inf is compared, never subtracted from -inf,
// so no NaN arises from empty parts. Non-finite inputs (docs/semantics.md, "Non-finite values"):
// a NaN lse makes out and lse NaN; a +inf lse (a row with a +inf score) makes lse +inf and out
// NaN (softmax_shift).
#ifndef FLASH_ATTENTION_MERGE_H
#define FLASH_ATTENTION_MERGE_H

#include "flash_attention_blocks.h"

// The shift subtracted from lse values or scores before exp: the largest one m, or 0 where m is
// infinite: -inf (nothing seen yet) keeps every exp at 0, and +inf gives the +inf part the weight
// exp(+inf) = +inf, so that the sum and lse are +inf and out is inf * 0 = NaN, where
// exp(inf - inf) would make the lse NaN. Finite m is returned unchanged.
inline float softmax_shift(float m) {
    return isinf(m) ? 0.0f : m;
}

// The weight of a part relative to the shift m (softmax_shift of the largest lse of the parts
// being merged): exp(lse - m), and exactly 0 for an empty part (lse = -inf), whatever m is.
inline float merge_weight(float part_lse, float max_lse) {
    return part_lse == -INFINITY ? 0.0f : precise::exp(part_lse - max_lse);
}

// The merged lse from the shift m and the sum of the weights: m + log(sum), or -inf when every
// part is empty (sum 0); NaN or +inf where the sum is.
inline float merged_lse(float max_lse, float weight_sum) {
    return weight_sum == 0.0f ? -INFINITY : max_lse + precise::log(weight_sum);
}

// Adds one part's element to a merge accumulator. A zero weight (an empty part, or one whose
// share underflows) leaves the accumulator as it is, so an empty part's out may hold anything,
// NaN included (a split-KV chunk without keys need not write its partial output).
inline float merge_accumulate(float acc, float weight, float part_out) {
    return weight != 0.0f ? fma(weight, part_out, acc) : acc;
}

// 1 / sum of the weights, 0 for a row whose parts are all empty (its accumulator is 0).
inline float merge_normalizer(float weight_sum) {
    return weight_sum == 0.0f ? 0.0f : 1.0f / weight_sum;
}

// flash_attention_merge_<dtype>: out, lse = the merge of (out_a, lse_a) and (out_b, lse_b),
// contiguous rows of head_dim elements of T (half, bfloat or float; the sums in float32, out rounded
// to T once) and their float32 lse, for p (batch, num_heads, seqlen_q, head_dim; the other fields
// are not read). Grid (ceil(seqlen_q / FA_MERGE_ROWS_PER_THREADGROUP), num_heads, batch),
// threadgroups of FA_MERGE_ROWS_PER_THREADGROUP * FA_MERGE_THREADS_PER_ROW threads; the threads of
// a row stride over head_dim, so consecutive threads touch consecutive elements. No barriers, no
// SIMD-group functions: every thread's work is independent.
template <typename T>
inline void attention_merge(device const T *out_a, device const float *lse_a,
                            device const T *out_b, device const float *lse_b,
                            device T *out, device float *lse,
                            constant FlashAttentionParams &p, uint3 tgid, uint tid) {
    const uint row = tgid.x * FA_MERGE_ROWS_PER_THREADGROUP + tid / FA_MERGE_THREADS_PER_ROW;
    if (row >= p.seqlen_q) {
        return;
    }
    const ulong r = row_index(tgid.z, p.num_heads, tgid.y, p.seqlen_q, row);
    const float la = lse_a[r];
    const float lb = lse_b[r];
    const float m = softmax_shift(max(la, lb));
    const float wa = merge_weight(la, m);
    const float wb = merge_weight(lb, m);
    const float sum = wa + wb;
    const float scale = merge_normalizer(sum);
    const ulong start = r * p.head_dim;
    for (uint d = tid % FA_MERGE_THREADS_PER_ROW; d < p.head_dim; d += FA_MERGE_THREADS_PER_ROW) {
        float acc = merge_accumulate(0.0f, wa, float(out_a[start + d]));
        acc = merge_accumulate(acc, wb, float(out_b[start + d]));
        out[start + d] = T(acc * scale);
    }
    if (tid % FA_MERGE_THREADS_PER_ROW == 0) {
        lse[r] = merged_lse(m, sum);
    }
}

#endif
