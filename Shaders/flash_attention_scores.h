// Exponentials and scores: exp_of, the modifiers of a row's scores (softmax_scale, softcap, ALiBi,
// attn_mask, the window) and the probabilities the backward recomputes.
#ifndef FLASH_ATTENTION_SCORES_H
#define FLASH_ATTENTION_SCORES_H

#include "flash_attention_blocks.h"

// ---- exponentials ----------------------------------------------------------------------------

// log2(e) as a float pair hi + lo (hi the float nearest, lo the rest).
#define FA_LOG2E_HI 1.44269502162933349609375f
#define FA_LOG2E_LO 1.925963033500011079e-8f

// exp(x) as exp2 of x * log2(e), the product in two terms. Scores, running maxima and lse stay in
// natural units and only differences x = score - max (<= 0) go to base 2: a product with a rounded
// log2(e) would put the same relative error on every score of a row (a bias float32 gradients
// see), and a finite score beyond FLT_MAX / log2(e) (Hugging Face's float32-minimum masks) would
// overflow in base 2.
inline float exp_of(float x) {
    return precise::exp2(fma(x, FA_LOG2E_HI, x * FA_LOG2E_LO));
}

// ---- scores ----------------------------------------------------------------------------------

// What shapes one lane's scores besides q . k: softmax_scale (read once, not per score), the ALiBi
// slope of its row's head, where its row of attn_mask starts (flash_attention_params.h: FA_MASK_*)
// and the keys its row sees.
struct RowModifiers {
    float scale;
    float slope;
    ulong mask_row;
    KeyRange keys;  // the keys the row sees through the window (visible_keys)
};

inline RowModifiers row_modifiers(constant FlashAttentionParams &p, device const float *alibi,
                                  uint b, uint h, uint row) {
    RowModifiers m;
    m.scale = p.softmax_scale;
    m.slope = alibi_on(p) ? alibi[ulong(b) * p.alibi_batch_stride + h] : 0.0f;
    m.mask_row = head_offset(p.mask, b, h) + ulong(row) * p.mask.seq;
    m.keys = visible_keys(p, row);
    return m;
}

// Whether `key` is one of `keys` (a row's window, visible_keys).
inline bool in_window(KeyRange keys, uint key) {
    return key >= keys.first && key < keys.end;
}

// The window test of a lane's keys key0 + c of one tile, c = 8j + e (a constant once unrolled): one
// add and one unsigned compare per key, (key0 - first) + c < end - first, the same answer as
// in_window; every key passes in a tile that needs no element mask (`checked` false).
struct TileWindow {
    uint base;
    uint width;

    inline bool visible(uint c) const { return base + c < width; }
};

inline TileWindow tile_window(KeyRange keys, uint key0, bool checked) {
    TileWindow w;
    w.base = checked ? key0 - keys.first : 0u;
    w.width = !checked ? 0xffffffffu : (keys.end > keys.first ? keys.end - keys.first : 0u);
    return w;
}

// The score of (row, key) from its raw product q . k: softcap(softmax_scale * raw),
// minus slope * |row + seqlen_k - seqlen_q - key|, plus the additive mask; -inf where the pair is
// hidden (not `visible` through the window, as the caller tests on every tile that needs element
// masks, or by a boolean mask). *t receives tanh(softmax_scale * raw / softcap) for the softcap
// backward.
template <typename T>
inline float score(constant FlashAttentionParams &p, device const uchar *mask, float raw,
                    uint row, uint key, RowModifiers m, bool visible, thread float &t) {
    t = 0.0f;
    if (!visible) {
        return -INFINITY;
    }
    // (The mask's index is formed inside each mask branch: none of it on the path without a mask.)
    if (mask_type_of(p) == FA_MASK_BOOL && mask[m.mask_row + key] == 0) {
        return -INFINITY;
    }
    float x = raw * m.scale;
    if (softcap_on(p)) {
        t = precise::tanh(x / p.softcap);
        x = p.softcap * t;
    }
    if (alibi_on(p)) {
        x -= m.slope * abs(float(long(row) + long(p.seqlen_k) - long(p.seqlen_q) - long(key)));
    }
    // An additive -inf hides its key even where the score is NaN or +inf (NaN q, overflow).
    if (mask_type_of(p) == FA_MASK_ADDITIVE) {
        const float a = float(((device const T *)mask)[m.mask_row + key]);
        x = a == -INFINITY ? a : x + a;
    } else if (mask_type_of(p) == FA_MASK_ADDITIVE_F32) {
        const float a = ((device const float *)mask)[m.mask_row + key];
        x = a == -INFINITY ? a : x + a;
    }
    return x;
}

// dS with respect to softmax_scale * q . k from dS with respect to the final score: the softcap
// multiplies it by d(c tanh(x / c))/dx = 1 - tanh^2.
inline float through_softcap(constant FlashAttentionParams &p, float ds, float t) {
    return softcap_on(p) ? ds * (1.0f - t * t) : ds;
}

// P = exp((score - lse) - residual) (backward_lse_residual); 0 for a hidden pair (whose score is
// -inf, also when the row's lse is -inf).
inline float probability(float score, float lse, float residual) {
    return score == -INFINITY ? 0.0f : exp_of((score - lse) - residual);
}

// The lse a backward row works with: +inf for -inf, so that every P and the sink's weight of that
// row are exp(-inf) = 0 and its gradient is zero (the forward gives -inf only to rows without
// visible keys); NaN for NaN and +inf (a row with a NaN or +inf score), so that every gradient the
// row touches is NaN, as PyTorch's and MLX's, whatever out holds (no lse is refused); finite values
// as given.
inline float backward_row_lse(float lse) {
    return isinf(lse) ? (lse < 0.0f ? INFINITY : NAN) : lse;
}

#endif
