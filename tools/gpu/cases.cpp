// Case grids and seeded inputs (see cases.h).
#include "cases.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "half_bits.h"

namespace {

TestCase make_case(int head_dim, int batch, int heads, int kv_heads, int seqlen_q, int seqlen_k,
                   bool causal, float scale = 0.0f) {
    char name[128];
    std::snprintf(name, sizeof name, "d%d_b%d_h%dx%d_q%d_k%d_%s", head_dim, batch, heads, kv_heads,
                  seqlen_q, seqlen_k, causal ? "causal" : "full");
    std::string full_name = name;
    if (scale != 0.0f) {
        std::snprintf(name, sizeof name, "_s%g", double(scale));
        full_name += name;
    }
    // 0 selects the library default 1/sqrt(head_dim).
    const float softmax_scale = scale != 0.0f ? scale : float(1.0 / std::sqrt(double(head_dim)));
    return TestCase{full_name,
                    AttentionShape{batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal,
                                   softmax_scale}};
}

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

// Box-Muller: standard normal float16 values.
std::vector<uint16_t> normal_half(SplitMix64 &rng, size_t count) {
    const double two_pi = 6.283185307179586;
    std::vector<uint16_t> values(count);
    for (size_t i = 0; i < count; i += 2) {
        const double radius = std::sqrt(-2.0 * std::log(rng.uniform_open()));
        const double angle = two_pi * rng.uniform_open();
        values[i] = float_to_half_bits(float(radius * std::cos(angle)));
        if (i + 1 < count) {
            values[i + 1] = float_to_half_bits(float(radius * std::sin(angle)));
        }
    }
    return values;
}

}  // namespace

std::vector<TestCase> full_grid() {
    std::vector<TestCase> cases;
    for (int d : {1, 3, 32, 40, 59, 64, 80, 96, 104, 128, 160, 192, 200, 256}) {
        cases.push_back(make_case(d, 2, 3, 3, 100, 100, false));
        cases.push_back(make_case(d, 2, 3, 3, 100, 100, true));  // where the seed kernels hung
        cases.push_back(make_case(d, 1, 8, 2, 33, 77, true));    // GQA 8/2, seqlen_q < seqlen_k
        cases.push_back(make_case(d, 2, 4, 1, 77, 33, true));    // MQA, 44 empty rows per head
        cases.push_back(make_case(d, 2, 4, 1, 77, 33, false));
        cases.push_back(make_case(d, 2, 2, 2, 1, 129, true));    // decode: sees every key
    }
    cases.push_back(make_case(16, 1, 1, 1, 1, 1, false));
    cases.push_back(make_case(64, 1, 2, 2, 257, 257, true));
    cases.push_back(make_case(128, 1, 2, 1, 200, 131, false));
    cases.push_back(make_case(256, 1, 1, 1, 65, 300, true));
    cases.push_back(make_case(72, 2, 6, 3, 31, 31, true, 0.5f));
    cases.push_back(make_case(64, 1, 2, 2, 63, 65, false, -0.3f));
    cases.push_back(make_case(32, 2, 4, 2, 130, 97, true, 2.0f));
    // Short queries that the split-KV forward also runs: GQA rows packed per KV head across heads,
    // a row block spanning heads, two row blocks, causal rows seeing different numbers of keys.
    cases.push_back(make_case(64, 2, 8, 2, 3, 300, true));
    cases.push_back(make_case(128, 1, 4, 1, 8, 200, false));
    cases.push_back(make_case(256, 1, 6, 2, 5, 90, true));
    cases.push_back(make_case(32, 1, 16, 2, 7, 150, true));
    return cases;
}

std::vector<TestCase> small_grid() {
    return {
        make_case(1, 2, 2, 2, 37, 37, false),    make_case(3, 2, 3, 3, 100, 100, true),
        make_case(32, 2, 4, 1, 77, 33, true),    make_case(32, 1, 2, 2, 1, 64, true),
        make_case(40, 1, 8, 2, 33, 77, true),    make_case(59, 2, 3, 3, 100, 100, false),
        make_case(64, 2, 2, 2, 1, 99, true),     make_case(64, 1, 4, 1, 65, 64, true),
        make_case(80, 2, 2, 2, 65, 65, false),   make_case(72, 1, 6, 3, 31, 31, true, 0.5f),
        make_case(96, 1, 4, 2, 50, 17, true),    make_case(96, 2, 2, 2, 17, 50, false),
        make_case(104, 2, 2, 1, 17, 50, false),  make_case(128, 2, 3, 3, 100, 100, true),
        make_case(128, 1, 8, 2, 70, 45, true),   make_case(160, 1, 4, 2, 40, 90, true),
        make_case(160, 2, 2, 1, 90, 40, false),  make_case(192, 2, 2, 2, 33, 33, false),
        make_case(192, 1, 4, 4, 50, 20, true),   make_case(200, 1, 2, 1, 70, 45, true),
        make_case(200, 2, 2, 2, 1, 100, true),   make_case(256, 2, 2, 2, 45, 70, true),
        make_case(256, 1, 4, 1, 100, 33, true),  make_case(256, 2, 2, 2, 17, 17, false),
        make_case(64, 1, 8, 2, 3, 100, true),    make_case(256, 1, 6, 2, 5, 90, true),
    };
}

AttentionInputs random_inputs(const TestCase &test_case) {
    SplitMix64 rng{fnv1a(test_case.name)};
    const AttentionShape &s = test_case.shape;
    AttentionInputs in;
    in.q = normal_half(rng, s.q_elements());
    in.k = normal_half(rng, s.kv_elements());
    in.v = normal_half(rng, s.kv_elements());
    in.dout = normal_half(rng, s.q_elements());
    return in;
}
