// Case grids and seeded inputs (see cases.h).
#include "cases.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

namespace {

constexpr DType f16 = DType::f16, bf16 = DType::bf16, f32 = DType::f32;

// What a case changes from the defaults: head_dim_v (0: head_dim), softmax_scale (0: the library
// default 1/sqrt(head_dim)), the layout and the score modifiers.
struct Extra {
    int head_dim_v = 0;
    float scale = 0.0f;
    Layout layout = Layout::bhsd;
    ScoreOptions options = {};
};

const char *mask_name(MaskKind kind) {
    switch (kind) {
        case MaskKind::boolean:
            return "mbool";
        case MaskKind::additive:
            return "madd";
        case MaskKind::additive_f32:
            return "maddf32";
        case MaskKind::none:
            break;
    }
    return "";
}

// The modifiers' part of a case name: _w<left>.<right> (n: unbounded), _cap<softcap>,
// _<mask kind>.<b|1><h|1> (per batch or broadcast, per head or broadcast), _alibi (per head) or
// _alibib (per batch and head), _sinks.
std::string options_name(const ScoreOptions &o) {
    std::string name;
    char part[64];
    if (o.window_left >= 0 || o.window_right >= 0) {
        auto side = [](int w) { return w < 0 ? std::string("n") : std::to_string(w); };
        name += "_w" + side(o.window_left) + "." + side(o.window_right);
    }
    if (o.softcap > 0.0f) {
        std::snprintf(part, sizeof part, "_cap%g", double(o.softcap));
        name += part;
    }
    if (o.mask != MaskKind::none) {
        name += std::string("_") + mask_name(o.mask) + "." + (o.mask_per_batch ? "b" : "1") +
                (o.mask_per_head ? "h" : "1");
    }
    if (o.alibi) {
        name += o.alibi_per_batch ? "_alibib" : "_alibi";
    }
    if (o.sinks) {
        name += "_sinks";
    }
    return name;
}

TestCase make_case(DType dtype, int head_dim, int batch, int heads, int kv_heads, int seqlen_q,
                   int seqlen_k, bool causal, Extra extra = {}) {
    const int head_dim_v = extra.head_dim_v != 0 ? extra.head_dim_v : head_dim;
    std::string name = dtype_name(dtype);
    char part[128];
    std::snprintf(part, sizeof part, "_d%d", head_dim);
    name += part;
    if (head_dim_v != head_dim) {
        std::snprintf(part, sizeof part, "v%d", head_dim_v);
        name += part;
    }
    std::snprintf(part, sizeof part, "_b%d_h%dx%d_q%d_k%d_%s", batch, heads, kv_heads, seqlen_q,
                  seqlen_k, causal ? "causal" : "full");
    name += part;
    if (extra.scale != 0.0f) {
        std::snprintf(part, sizeof part, "_s%g", double(extra.scale));
        name += part;
    }
    name += options_name(extra.options);
    if (extra.layout != Layout::bhsd) {
        name += std::string("_") + layout_name(extra.layout);
    }
    const float softmax_scale =
        extra.scale != 0.0f ? extra.scale : float(1.0 / std::sqrt(double(head_dim)));
    return TestCase{name,
                    AttentionShape{batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                   head_dim_v, causal, softmax_scale, dtype, extra.options},
                    extra.layout};
}

// A case whose additive mask hides keys with float32's lowest finite value.
TestCase with_finite_mask_min(TestCase c) {
    c.name += "_min";
    c.mask_hide = -std::numeric_limits<float>::max();
    return c;
}

Extra v(int head_dim_v, Layout layout = Layout::bhsd) { return Extra{head_dim_v, 0.0f, layout}; }
Extra scaled(float scale) { return Extra{0, scale, Layout::bhsd}; }
Extra laid(Layout layout) { return Extra{0, 0.0f, layout}; }

// Builders of score modifiers: mods().window(16, 0).sinks() ...
struct Mods {
    Extra extra;
    Mods &window(int left, int right) {
        extra.options.window_left = left;
        extra.options.window_right = right;
        return *this;
    }
    Mods &softcap(float cap) {
        extra.options.softcap = cap;
        return *this;
    }
    Mods &mask(MaskKind kind, bool per_batch, bool per_head) {
        extra.options.mask = kind;
        extra.options.mask_per_batch = per_batch;
        extra.options.mask_per_head = per_head;
        return *this;
    }
    Mods &alibi(bool per_batch = false) {
        extra.options.alibi = true;
        extra.options.alibi_per_batch = per_batch;
        return *this;
    }
    Mods &sinks() {
        extra.options.sinks = true;
        return *this;
    }
    Mods &scale(float s) {
        extra.scale = s;
        return *this;
    }
    Mods &layout(Layout l) {
        extra.layout = l;
        return *this;
    }
    Mods &head_dim_v(int d) {
        extra.head_dim_v = d;
        return *this;
    }
    operator Extra() const { return extra; }
};
Mods mods() { return Mods{}; }

constexpr MaskKind mbool = MaskKind::boolean, madd = MaskKind::additive,
                   maddf32 = MaskKind::additive_f32;

constexpr Layout bshd = Layout::bshd, qkv = Layout::qkv, gapped = Layout::gapped;

// splitmix64: a small, well-mixed generator whose output is the same on every platform.
struct SplitMix64 {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    double uniform_open() {  // (0, 1): never 0, so log() below stays finite
        return (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    }
};

uint64_t fnv1a(const std::string &text) {
    uint64_t hash = 0xcbf29ce484222325ull;
    for (unsigned char c : text) {
        hash = (hash ^ c) * 0x100000001b3ull;
    }
    return hash;
}

// Box-Muller: standard normal values rounded to the dtype.
std::vector<float> normal(SplitMix64 &rng, size_t count, DType dtype) {
    const double two_pi = 6.283185307179586;
    std::vector<float> values(count);
    for (size_t i = 0; i < count; i += 2) {
        const double radius = std::sqrt(-2.0 * std::log(rng.uniform_open()));
        const double angle = two_pi * rng.uniform_open();
        values[i] = round_to(dtype, float(radius * std::cos(angle)));
        if (i + 1 < count) {
            values[i + 1] = round_to(dtype, float(radius * std::sin(angle)));
        }
    }
    return values;
}

}  // namespace

const char *layout_name(Layout layout) {
    switch (layout) {
        case Layout::bhsd:
            return "bhsd";
        case Layout::bshd:
            return "bshd";
        case Layout::qkv:
            return "qkv";
        case Layout::gapped:
            return "gapped";
    }
    return "?";
}

std::vector<TestCase> full_grid() {
    std::vector<TestCase> cases;
    // float16: every bucket of FA_HEAD_DIM_BUCKETS, every kind of shape.
    for (int d : {1, 3, 32, 40, 59, 64, 80, 96, 104, 128, 160, 192, 200, 256, 300, 512, 576}) {
        cases.push_back(make_case(f16, d, 2, 3, 3, 100, 100, false));
        cases.push_back(make_case(f16, d, 2, 3, 3, 100, 100, true));  // where the seed kernels hung
        cases.push_back(make_case(f16, d, 1, 8, 2, 33, 77, true));    // GQA 8/2, Nq < Nk
        cases.push_back(make_case(f16, d, 2, 4, 1, 77, 33, true));    // MQA, 44 empty rows per head
        cases.push_back(make_case(f16, d, 2, 4, 1, 77, 33, false));
        cases.push_back(make_case(f16, d, 2, 2, 2, 1, 129, true));    // decode: sees every key
    }
    cases.push_back(make_case(f16, 16, 1, 1, 1, 1, 1, false));
    cases.push_back(make_case(f16, 64, 1, 2, 2, 257, 257, true));
    cases.push_back(make_case(f16, 128, 1, 2, 1, 200, 131, false));
    cases.push_back(make_case(f16, 256, 1, 1, 1, 65, 300, true));
    cases.push_back(make_case(f16, 72, 2, 6, 3, 31, 31, true, scaled(0.5f)));
    cases.push_back(make_case(f16, 64, 1, 2, 2, 63, 65, false, scaled(-0.3f)));
    cases.push_back(make_case(f16, 32, 2, 4, 2, 130, 97, true, scaled(2.0f)));

    // bfloat16 (the same table as float16): one head_dim per bucket and the edges.
    for (int d : {1, 40, 64, 96, 128, 160, 200, 256, 512, 576}) {
        cases.push_back(make_case(bf16, d, 2, 3, 3, 100, 100, true));
        cases.push_back(make_case(bf16, d, 1, 8, 2, 33, 77, true));
        cases.push_back(make_case(bf16, d, 2, 4, 1, 77, 33, true));
        cases.push_back(make_case(bf16, d, 2, 2, 2, 1, 129, true));
    }
    cases.push_back(make_case(bf16, 64, 1, 2, 2, 63, 65, false, scaled(-0.3f)));

    // float32 (FA_HEAD_DIM_BUCKETS_F32: smaller tiles; at 256 the backward kernels share one tile
    // buffer): every bucket, dense and causal.
    for (int d : {3, 40, 64, 96, 104, 128, 160, 192, 200, 256}) {
        cases.push_back(make_case(f32, d, 2, 3, 3, 100, 100, false));
        cases.push_back(make_case(f32, d, 2, 3, 3, 100, 100, true));
        cases.push_back(make_case(f32, d, 1, 8, 2, 33, 77, true));
        cases.push_back(make_case(f32, d, 2, 4, 1, 77, 33, true));
        cases.push_back(make_case(f32, d, 2, 2, 2, 1, 129, true));
    }
    cases.push_back(make_case(f32, 64, 1, 2, 2, 257, 257, true));
    cases.push_back(make_case(f32, 128, 1, 2, 1, 200, 131, false));
    cases.push_back(make_case(f32, 256, 1, 1, 1, 65, 300, true));
    cases.push_back(make_case(f32, 32, 2, 4, 2, 130, 97, true, scaled(2.0f)));

    // Short queries that the split-KV forward also runs: GQA rows packed per KV head across heads,
    // a row block spanning heads, two row blocks, causal rows seeing different numbers of keys.
    for (DType t : {f16, bf16, f32}) {
        cases.push_back(make_case(t, 64, 2, 8, 2, 3, 300, true));
        cases.push_back(make_case(t, 128, 1, 4, 1, 8, 200, false));
        cases.push_back(make_case(t, 256, 1, 6, 2, 5, 90, true));
        cases.push_back(make_case(t, 32, 1, 16, 2, 7, 150, true));
    }

    // Strided layouts, read and written in place.
    cases.push_back(make_case(f16, 64, 1, 8, 2, 33, 77, true, laid(bshd)));
    cases.push_back(make_case(f16, 40, 2, 4, 1, 77, 33, true, laid(gapped)));
    cases.push_back(make_case(f16, 64, 2, 4, 4, 100, 100, true, laid(qkv)));
    cases.push_back(make_case(f16, 128, 2, 8, 2, 65, 65, false, laid(qkv)));   // GQA packed
    cases.push_back(make_case(f16, 64, 2, 8, 2, 3, 300, true, laid(bshd)));    // split-KV
    cases.push_back(make_case(bf16, 128, 2, 3, 3, 100, 100, true, laid(bshd)));
    cases.push_back(make_case(bf16, 200, 1, 8, 2, 33, 77, true, laid(gapped)));
    cases.push_back(make_case(bf16, 96, 1, 8, 2, 65, 65, true, laid(qkv)));
    cases.push_back(make_case(f32, 256, 2, 4, 1, 77, 33, true, laid(bshd)));
    cases.push_back(make_case(f32, 96, 2, 3, 3, 100, 100, true, laid(gapped)));
    cases.push_back(make_case(f32, 32, 2, 3, 3, 50, 50, false, laid(qkv)));
    cases.push_back(make_case(f32, 256, 1, 2, 2, 40, 40, true, laid(qkv)));
    cases.push_back(make_case(f32, 128, 1, 4, 1, 8, 200, false, laid(gapped)));  // split-KV

    // head_dim_v != head_dim: DeepSeek's MLA pair 192/128 in every dtype and layout kind, v wider
    // and narrower than q/k, across buckets (the bucket is that of the larger of the two).
    for (DType t : {f16, bf16, f32}) {
        cases.push_back(make_case(t, 192, 2, 3, 3, 100, 100, true, v(128)));
        cases.push_back(make_case(t, 192, 1, 8, 2, 33, 77, true, v(128)));
        cases.push_back(make_case(t, 192, 2, 4, 1, 77, 33, false, v(128)));
        cases.push_back(make_case(t, 192, 1, 8, 2, 3, 300, true, v(128)));  // split-KV
        cases.push_back(make_case(t, 192, 1, 4, 2, 65, 65, true, v(128, bshd)));
    }
    cases.push_back(make_case(f16, 64, 2, 3, 3, 100, 100, true, v(128)));
    cases.push_back(make_case(f16, 128, 1, 8, 2, 33, 77, true, v(64)));
    cases.push_back(make_case(f16, 3, 2, 4, 1, 77, 33, true, v(40)));
    cases.push_back(make_case(f16, 256, 1, 2, 2, 50, 70, false, v(1)));
    cases.push_back(make_case(f16, 1, 1, 2, 2, 70, 50, true, v(256, gapped)));
    cases.push_back(make_case(bf16, 40, 2, 3, 3, 100, 100, true, v(3)));
    cases.push_back(make_case(bf16, 100, 1, 8, 2, 33, 77, true, v(200, bshd)));
    cases.push_back(make_case(bf16, 256, 2, 2, 2, 1, 129, true, v(64)));  // decode, split-KV
    cases.push_back(make_case(f32, 32, 2, 3, 3, 100, 100, true, v(96)));
    cases.push_back(make_case(f32, 128, 1, 8, 2, 33, 77, true, v(40)));
    cases.push_back(make_case(f32, 256, 2, 4, 1, 77, 33, true, v(192)));
    cases.push_back(make_case(f32, 64, 2, 2, 2, 1, 129, true, v(256, bshd)));  // decode, split-KV
    // DeepSeek's MLA decode with absorbed weights, 576/512 (the 576 bucket; float16 and bfloat16
    // only: float32 stops at 256): prefill GQA, decode over one latent KV head (split-KV), bshd.
    for (DType t : {f16, bf16}) {
        cases.push_back(make_case(t, 576, 1, 8, 2, 33, 77, true, v(512)));
        cases.push_back(make_case(t, 576, 2, 16, 1, 1, 300, true, v(512)));  // split-KV
        cases.push_back(make_case(t, 576, 1, 4, 1, 20, 40, false, v(512, bshd)));
    }
    cases.push_back(make_case(bf16, 512, 1, 4, 1, 5, 200, true, v(256)));  // split-KV, d512

    // Score modifiers (issue 15) in every dtype.
    for (DType t : {f16, bf16, f32}) {
        // Sliding windows: a causal window of 512 over 2048 keys (tiles outside it skipped), a
        // symmetric one with GQA, one side only, and windows that leave rows empty (seqlen_q >
        // seqlen_k: rows i < 41 see no key with right 3).
        cases.push_back(make_case(t, 64, 1, 2, 1, 2048, 2048, true, mods().window(512, -1)));
        cases.push_back(make_case(t, 40, 1, 8, 2, 33, 77, false, mods().window(8, 8)));
        cases.push_back(make_case(t, 96, 2, 3, 3, 100, 100, false, mods().window(20, -1)));
        cases.push_back(make_case(t, 64, 2, 3, 3, 100, 100, false, mods().window(-1, 4)));
        cases.push_back(make_case(t, 32, 2, 4, 1, 77, 33, false, mods().window(5, 3)));
        cases.push_back(make_case(t, 128, 2, 4, 1, 77, 33, true, mods().window(0, -1)));
        // Softcap: saturating (scale 0.5, cap 5) and Gemma 2's 30; with a window.
        cases.push_back(make_case(t, 64, 2, 4, 4, 65, 90, true, mods().softcap(5).scale(0.5f)));
        cases.push_back(make_case(t, 128, 1, 8, 2, 100, 100, false, mods().softcap(30)));
        cases.push_back(make_case(t, 256, 1, 4, 2, 60, 60, true, mods().softcap(20).window(16, 0)));
        // ALiBi per head and per batch.
        cases.push_back(make_case(t, 64, 2, 8, 2, 100, 100, true, mods().alibi()));
        cases.push_back(make_case(t, 128, 2, 4, 1, 50, 120, false, mods().alibi(true)));
        // Sinks (and dsinks), with empty causal rows (lse = sink there) and with GQA.
        cases.push_back(make_case(t, 64, 2, 4, 2, 100, 100, true, mods().sinks()));
        cases.push_back(make_case(t, 32, 2, 4, 1, 77, 33, true, mods().sinks()));
        cases.push_back(make_case(t, 192, 1, 8, 2, 33, 77, false, mods().sinks()));
        // Boolean masks: full, broadcast over batch and heads, per batch only, per head only.
        cases.push_back(make_case(t, 64, 2, 4, 2, 60, 80, false, mods().mask(mbool, true, true)));
        cases.push_back(make_case(t, 32, 2, 3, 3, 100, 100, true, mods().mask(mbool, false, false)));
        cases.push_back(make_case(t, 96, 2, 4, 1, 77, 33, false, mods().mask(mbool, true, false)));
        cases.push_back(make_case(t, 160, 1, 4, 2, 40, 90, true, mods().mask(mbool, false, true)));
        // Additive masks in the dtype and in float32, broadcast and full.
        cases.push_back(make_case(t, 64, 2, 4, 1, 70, 70, false, mods().mask(madd, false, true)));
        cases.push_back(make_case(t, 128, 2, 4, 2, 65, 100, true, mods().mask(madd, true, true)));
        cases.push_back(make_case(t, 40, 2, 3, 3, 100, 100, false, mods().mask(maddf32, false, false)));
        cases.push_back(make_case(t, 256, 2, 2, 1, 45, 70, false, mods().mask(maddf32, true, false)));
        cases.push_back(with_finite_mask_min(
            make_case(t, 64, 2, 4, 2, 50, 90, false, mods().mask(maddf32, true, true))));
        // The backward's lse residual: rows whose |lse| >= 256. Whole rows at float32's lowest
        // value (their lse rounds to the row max; the residual restores log(l)); with sinks such a
        // row's lse is the sink's, so only the scores' scale makes |lse| huge there (softmax_scale
        // 30: most rows' max above 256, the residual their lse's rounding).
        cases.push_back(with_finite_mask_min(
            make_case(t, 128, 1, 4, 2, 40, 70, true, mods().mask(maddf32, false, true).sinks())));
        cases.push_back(make_case(t, 32, 2, 4, 2, 50, 60, true, mods().sinks().scale(30.0f)));
        // Everything at once.
        cases.push_back(make_case(t, 128, 2, 8, 2, 90, 130, true,
                                  mods().window(40, -1).softcap(30).mask(mbool, true, false)
                                      .alibi(true).sinks()));
        cases.push_back(make_case(t, 64, 1, 4, 4, 100, 100, false,
                                  mods().window(30, 10).softcap(10).mask(madd, false, true)
                                      .alibi().sinks()));
        // Decode over a long cache: the split-KV forward too (seqlen_q <= 8, >= 512 keys).
        cases.push_back(make_case(t, 64, 2, 8, 2, 4, 600, true,
                                  mods().window(256, -1).alibi().sinks()));
        cases.push_back(make_case(t, 128, 1, 4, 1, 1, 700, false,
                                  mods().softcap(30).mask(madd, true, true)));
        cases.push_back(make_case(t, 256, 2, 6, 2, 8, 512, true, mods().mask(mbool, true, false).sinks()));
        cases.push_back(make_case(t, 32, 1, 16, 2, 7, 520, false, mods().window(100, 50).softcap(5)
                                      .mask(maddf32, false, true)));
        // 16 rows over a cache (speculative decoding): the tiled split kernel.
        cases.push_back(make_case(t, 64, 1, 8, 2, 16, 600, true, mods().alibi().sinks()));
        // Strided layouts with a mask (gapped: the mask's rows have gaps too) and sinks.
        cases.push_back(make_case(t, 64, 2, 4, 2, 60, 70, true,
                                  mods().mask(madd, true, true).sinks().layout(gapped)));
        cases.push_back(make_case(t, 64, 2, 4, 2, 65, 65, false,
                                  mods().window(10, 10).alibi(true).layout(qkv)));
        cases.push_back(make_case(t, 128, 1, 8, 2, 5, 300, true,
                                  mods().mask(mbool, false, true).sinks().layout(bshd)));
    }
    // Every modifier at once at head_dim 512 (prefill) and in MLA's 576/512 decode.
    for (DType t : {f16, bf16}) {
        cases.push_back(make_case(t, 512, 1, 4, 2, 40, 60, true,
                                  mods().window(20, -1).softcap(30).mask(madd, true, true)
                                      .alibi(true).sinks()));
        cases.push_back(make_case(t, 576, 1, 8, 1, 2, 600, true,
                                  mods().window(300, -1).mask(mbool, true, false).sinks().layout(bshd)
                                      .head_dim_v(512)));
    }
    return cases;
}

std::vector<TestCase> small_grid() {
    return {
        // float16
        make_case(f16, 1, 2, 2, 2, 37, 37, false),    make_case(f16, 3, 2, 3, 3, 100, 100, true),
        make_case(f16, 32, 2, 4, 1, 77, 33, true),    make_case(f16, 40, 1, 8, 2, 33, 77, true),
        make_case(f16, 64, 2, 2, 2, 1, 99, true),     make_case(f16, 72, 1, 6, 3, 31, 31, true,
                                                                scaled(0.5f)),
        make_case(f16, 96, 1, 4, 2, 50, 17, true),    make_case(f16, 128, 2, 3, 3, 100, 100, true),
        make_case(f16, 160, 1, 4, 2, 40, 90, true),   make_case(f16, 200, 2, 2, 2, 1, 100, true),
        make_case(f16, 256, 2, 2, 2, 45, 70, true),   make_case(f16, 256, 1, 6, 2, 5, 90, true),
        // bfloat16
        make_case(bf16, 32, 1, 2, 2, 1, 64, true),    make_case(bf16, 64, 1, 4, 1, 65, 64, true),
        make_case(bf16, 104, 2, 2, 1, 17, 50, false), make_case(bf16, 128, 1, 8, 2, 70, 45, true),
        make_case(bf16, 192, 1, 4, 4, 50, 20, true),  make_case(bf16, 256, 1, 4, 1, 100, 33, true),
        // float32, float32 at 256 (shared tile buffers) with GQA, MQA and split-KV
        make_case(f32, 3, 2, 2, 2, 37, 37, false),    make_case(f32, 32, 2, 4, 1, 77, 33, true),
        make_case(f32, 64, 2, 2, 2, 1, 99, true),     make_case(f32, 96, 1, 4, 2, 50, 17, true),
        make_case(f32, 128, 1, 2, 2, 65, 65, false),  make_case(f32, 192, 2, 2, 2, 33, 33, false),
        make_case(f32, 256, 2, 2, 2, 45, 70, true),   make_case(f32, 256, 1, 4, 1, 100, 33, true),
        make_case(f32, 256, 1, 6, 2, 5, 90, true),
        // strided layouts
        make_case(f16, 64, 1, 8, 2, 33, 77, true, laid(bshd)),
        make_case(bf16, 128, 1, 8, 2, 65, 65, true, laid(qkv)),
        make_case(f32, 40, 2, 4, 1, 77, 33, true, laid(gapped)),
        // head_dim_v != head_dim
        make_case(f16, 192, 1, 8, 2, 33, 77, true, v(128)),
        make_case(bf16, 192, 1, 4, 2, 50, 50, true, v(128, bshd)),
        make_case(f32, 192, 1, 8, 2, 3, 100, true, v(128)),
        make_case(f16, 64, 2, 2, 1, 40, 90, false, v(256)),
        // head_dim 512 (8 rows, 4 head_dim slices, shared backward tiles) and MLA's 576/512 decode
        make_case(f16, 512, 1, 4, 2, 40, 70, true),
        make_case(bf16, 576, 1, 8, 1, 1, 100, true, v(512)),
        // score modifiers: windows (rows left empty), softcap, ALiBi, sinks and dsinks, masks,
        // all at once, split-KV with modifiers
        make_case(f16, 64, 2, 4, 1, 77, 33, false, mods().window(5, 3)),
        make_case(bf16, 128, 1, 4, 2, 100, 100, true, mods().window(16, -1).softcap(5).scale(0.5f)),
        make_case(f32, 64, 2, 4, 1, 50, 90, false, mods().alibi(true)),
        make_case(f16, 32, 2, 4, 2, 77, 33, true, mods().sinks()),
        make_case(bf16, 64, 2, 4, 2, 60, 80, false, mods().mask(mbool, true, true)),
        make_case(f16, 96, 2, 4, 1, 70, 70, false, mods().mask(madd, false, true).layout(gapped)),
        make_case(f32, 256, 2, 2, 2, 45, 70, true,
                  mods().window(20, -1).softcap(30).mask(maddf32, true, false).alibi().sinks()),
        make_case(f16, 64, 2, 8, 2, 4, 100, true, mods().window(40, -1).mask(mbool, false, true)
                                                   .alibi().sinks()),
        // the backward's lse residual recomputing rows (|lse| >= 256): whole rows at float32's
        // lowest value; sinks with scores scaled past 256
        with_finite_mask_min(make_case(f16, 128, 1, 4, 2, 40, 70, true,
                                       mods().mask(maddf32, false, true))),
        make_case(bf16, 32, 2, 4, 2, 50, 60, true, mods().sinks().scale(30.0f)),
    };
}

AttentionInputs random_inputs(const TestCase &test_case) {
    SplitMix64 rng{fnv1a(test_case.name)};
    const AttentionShape &s = test_case.shape;
    AttentionInputs in;
    in.q = normal(rng, s.q_elements(), s.dtype);
    in.k = normal(rng, s.k_elements(), s.dtype);
    in.v = normal(rng, s.v_elements(), s.dtype);
    in.dout = normal(rng, s.out_elements(), s.dtype);
    const ScoreOptions &o = s.options;
    if (o.mask != MaskKind::none) {
        const DType mask_dtype = o.mask == MaskKind::additive ? s.dtype : DType::f32;
        in.mask = normal(rng, s.mask_elements(), mask_dtype);
        for (int mb = 0; mb < s.mask_batches(); ++mb) {
            for (int mh = 0; mh < s.mask_heads(); ++mh) {
                const int empty_row = s.seqlen_q >= 4 ? (1 + mb + 2 * mh) % s.seqlen_q : -1;
                for (int i = 0; i < s.seqlen_q; ++i) {
                    for (int j = 0; j < s.seqlen_k; ++j) {
                        float &m = in.mask[mask_index(s, mb, mh, i, j)];
                        const double draw = rng.uniform_open();
                        if (o.mask == MaskKind::boolean) {
                            m = i != empty_row && draw < 0.75 ? 1.0f : 0.0f;
                        } else if (i == empty_row || draw < 0.2) {
                            m = test_case.mask_hide;
                        }
                    }
                }
            }
        }
    }
    for (int b = 0; b < s.alibi_batches() && o.alibi; ++b) {
        for (int h = 0; h < s.num_heads; ++h) {
            in.alibi.push_back(
                float(std::exp2(-8.0 * (h + 1) / s.num_heads) * (1.0 + 0.25 * b)));
        }
    }
    if (o.sinks) {
        in.sinks = normal(rng, size_t(s.num_heads), DType::f32);
        for (float &sink : in.sinks) {
            sink += 1.0f;
        }
    }
    return in;
}
