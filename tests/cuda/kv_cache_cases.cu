// KV-cache cases of the CUDA check build (issue 24), run by the harness after the varlen cases so
// that the sanitizer steps of tests/cuda/gpu_check.sh run them too. A case fills a cache from seeded
// rows, contiguous or paged (pages handed out in shuffled order through a block table, spare
// blocks between them), of the dtype or in mx.quantize's affine format (4 or 8 bits), and runs
// the KV-cache kernels (fa_cuda_kvcache_forward): decode (1 query row), spec (4 rows: 16 packed
// rows where the group is 4; decode where it is 2), tiled split (12 rows) and dense (20 rows),
// bottom-right causal. Each run's out and lse go to the dump for
// judge.py (a quantized cache's keys and values as float64, dequantized exactly: NAME.k_exact,
// NAME.v_exact); an unquantized paged cache must also give bit for bit what the plain kernels give
// on the same rows laid out contiguously (fa_cuda_forward_split, fa_cuda_forward: the same kernel
// code apart from the addressing). The wrong-table case sends table entries outside
// [0, kv_num_blocks) and seqlen_k past the table: it passes when every launch succeeds (memcheck,
// run over the harness by gpu_check.sh, must report no access outside the cache).
#include "kv_cache_cases.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device_array.h"
#include "dtype_bits.h"
#include "kernels.h"

namespace {

struct KVCacheCase {
    const char *name;
    DType dtype;
    int batch, heads, kv_heads, head_dim, seqlen_k;
    int page;  // rows per block; 0: contiguous
    int bits;  // 0, 4 or 8
    int group;
    bool wrong;  // table entries out of range and seqlen_k past the table
};

// Deterministic uniform values in [0, 1).
struct Random {
    uint32_t state;
    float next() {
        state = state * 1664525u + 1013904223u;
        return float(state >> 8) / float(1u << 24);
    }
};

// One cache tensor (K or V) on the host: the device bytes of its data (elements or words), scales
// and biases, and its logical rows (B, Hkv, seqlen_k, head_dim) exactly, in float64.
struct HostCache {
    std::vector<unsigned char> data, scales, biases;
    std::vector<double> exact;
};

// The cache's geometry: rows per sequence (contiguous) or per block, blocks and the table.
struct Geometry {
    int rows, max_blocks, blocks;
    std::vector<int> table;  // (batch, max_blocks); empty when contiguous
};

Geometry geometry(const KVCacheCase &c, Random *random) {
    Geometry g;
    if (c.page == 0) {
        g.rows = c.seqlen_k + 3;
        g.max_blocks = 1;
        g.blocks = c.batch;
        return g;
    }
    g.rows = c.page;
    g.max_blocks = (c.seqlen_k + c.page - 1) / c.page;
    g.blocks = c.batch * g.max_blocks + 3;
    std::vector<int> order(g.blocks);
    for (int i = 0; i < g.blocks; ++i) {
        order[i] = i;
    }
    for (int i = g.blocks - 1; i > 0; --i) {
        std::swap(order[i], order[int(random->next() * float(i + 1)) % (i + 1)]);
    }
    g.table.assign(order.begin(), order.begin() + c.batch * g.max_blocks);
    return g;
}

// Units (elements or words) per row, and the strides of a cache tensor: block (or sequence) n at
// n * batch, KV head h at h * head, row r at r * seq.
size_t units(const KVCacheCase &c) { return c.bits == 0 ? size_t(c.head_dim) : size_t(c.head_dim) * c.bits / 32; }

FlashAttentionStrides cache_strides(const KVCacheCase &c, const Geometry &g) {
    const uint64_t u = units(c);
    return FlashAttentionStrides{uint64_t(c.kv_heads) * g.rows * u, uint64_t(g.rows) * u, u};
}

// Fills a cache tensor: row t of sequence b at block table[b][t / page], row t % page.
HostCache fill(const KVCacheCase &c, const Geometry &g, Random *random) {
    const size_t u = units(c), groups = c.bits == 0 ? 0 : size_t(c.head_dim / c.group);
    const size_t slots = size_t(g.blocks) * c.kv_heads * g.rows;
    const size_t size = dtype_size(c.dtype);
    HostCache h;
    h.data.assign(slots * u * (c.bits == 0 ? size : 4), 0);
    h.scales.assign(slots * groups * size, 0);
    h.biases.assign(slots * groups * size, 0);
    h.exact.assign(size_t(c.batch) * c.kv_heads * c.seqlen_k * c.head_dim, 0.0);
    for (int b = 0; b < c.batch; ++b) {
        for (int kh = 0; kh < c.kv_heads; ++kh) {
            for (int t = 0; t < c.seqlen_k; ++t) {
                const int block = c.page == 0 ? b : g.table[size_t(b) * g.max_blocks + t / c.page];
                const size_t slot = (size_t(block) * c.kv_heads + kh) * g.rows + (c.page == 0 ? t : t % c.page);
                double *row = &h.exact[((size_t(b) * c.kv_heads + kh) * c.seqlen_k + t) * c.head_dim];
                if (c.bits == 0) {
                    for (int d = 0; d < c.head_dim; ++d) {
                        unsigned char *at = &h.data[(slot * u + d) * size];
                        encode(c.dtype, random->next() * 4.0f - 2.0f, at);
                        row[d] = decode(c.dtype, at);
                    }
                    continue;
                }
                for (size_t gi = 0; gi < groups; ++gi) {
                    unsigned char *scale = &h.scales[(slot * groups + gi) * size];
                    unsigned char *bias = &h.biases[(slot * groups + gi) * size];
                    encode(c.dtype, (0.5f + random->next()) * 4.0f / float(1 << c.bits), scale);
                    encode(c.dtype, random->next() * 2.0f - 2.0f, bias);
                    for (int e = 0; e < c.group; ++e) {
                        const int d = int(gi) * c.group + e;
                        const uint32_t q = uint32_t(random->next() * float(1 << c.bits)) & ((1u << c.bits) - 1u);
                        uint32_t word;
                        unsigned char *at = &h.data[(slot * u + size_t(d) * c.bits / 32) * 4];
                        std::memcpy(&word, at, 4);
                        word |= q << (d * c.bits % 32);
                        std::memcpy(at, &word, 4);
                        row[d] = double(decode(c.dtype, scale)) * double(q) + double(decode(c.dtype, bias));
                    }
                }
            }
        }
    }
    return h;
}

std::unique_ptr<DeviceArray<unsigned char>> device_bytes(const std::vector<unsigned char> &host) {
    auto array = std::make_unique<DeviceArray<unsigned char>>(host.size());
    array->upload(host);
    return array;
}

// The logical rows of the dtype, contiguous (B, Hkv, seqlen_k, head_dim), as device bytes.
std::vector<unsigned char> contiguous_bytes(const KVCacheCase &c, const std::vector<double> &exact) {
    std::vector<unsigned char> bytes(exact.size() * dtype_size(c.dtype));
    for (size_t i = 0; i < exact.size(); ++i) {
        encode(c.dtype, float(exact[i]), &bytes[i * dtype_size(c.dtype)]);
    }
    return bytes;
}

// One run: `rows` query rows through the decode, spec, tiled split or dense kernel.
struct Run {
    const char *kernel;
    int rows;
    bool split;
};
const Run kRuns[] = {{"decode", 1, true}, {"spec", 4, true}, {"split", 12, true}, {"dense", 20, false}};

FlashAttentionParams problem(const KVCacheCase &c, const Geometry &g, int rows) {
    FlashAttentionParams p{};
    const uint64_t d = uint64_t(c.head_dim);
    p.q = p.dq = FlashAttentionStrides{uint64_t(c.heads) * rows * d, uint64_t(rows) * d, d};
    p.out = p.dout = p.q;
    p.k = p.v = cache_strides(c, g);
    p.batch = c.batch;
    p.num_heads = c.heads;
    p.num_kv_heads = c.kv_heads;
    p.seqlen_q = rows;
    p.seqlen_k = c.wrong ? g.max_blocks * g.rows + 37 : c.seqlen_k;
    p.head_dim = p.head_dim_v = c.head_dim;
    p.window_left = -1;
    p.window_right = 0;
    p.softmax_scale = 1.0f / std::sqrt(float(c.head_dim));
    p.mask_type = FA_MASK_NONE;
    p.kv_chunks = 1;
    p.kv_chunk_keys = p.seqlen_k;
    p.kv_page_rows = c.page;
    p.kv_max_blocks = g.max_blocks;
    p.kv_num_blocks = g.blocks;
    p.kv_bits = c.bits;
    p.kv_group_size = c.bits == 0 ? 0 : c.group;
    return p;
}

// Runs one case; returns its failures (0: passed) and prints a line per run.
int run(const KVCacheCase &c, const Dump &dump, int *run_count) {
    Random random{uint32_t(std::strlen(c.name)) * 2654435761u + 7};
    Geometry g = geometry(c, &random);
    const HostCache k = fill(c, g, &random), v = fill(c, g, &random);
    if (c.wrong) {
        for (size_t i = 0; i < g.table.size(); ++i) {
            g.table[i] = i % 3 == 0 ? -7 - int(i) : i % 3 == 1 ? g.blocks + int(i) : INT_MAX - int(i);
        }
    }
    const int dtype = c.dtype == DType::f16 ? FA_DTYPE_F16 : c.dtype == DType::bf16 ? FA_DTYPE_BF16 : FA_DTYPE_F32;
    const auto k_data = device_bytes(k.data), v_data = device_bytes(v.data);
    const auto k_scales = device_bytes(k.scales), k_biases = device_bytes(k.biases);
    const auto v_scales = device_bytes(v.scales), v_biases = device_bytes(v.biases);
    DeviceArray<int> table(std::max<size_t>(g.table.size(), 1));
    if (!g.table.empty()) {
        table.upload(g.table);
    }
    FaCudaKVCache cache;
    cache.block_table = g.table.empty() ? nullptr : table.get();
    if (c.bits != 0) {
        cache.k_scales = k_scales->get();
        cache.k_biases = k_biases->get();
        cache.v_scales = v_scales->get();
        cache.v_biases = v_biases->get();
    }
    int failures = 0;
    for (const Run &r : kRuns) {
        ++*run_count;
        const std::string name = std::string(c.name) + "_" + r.kernel;
        FlashAttentionParams p = problem(c, g, r.rows);
        if (r.split && !fa_cuda_split_keys(&p, dtype, 3)) {
            throw CudaFailure{name + ": no bucket"};
        }
        const size_t out_elements = size_t(c.batch) * c.heads * r.rows * c.head_dim;
        const size_t lse_elements = size_t(c.batch) * c.heads * r.rows;
        std::vector<float> q(out_elements);
        std::vector<unsigned char> q_bytes(out_elements * dtype_size(c.dtype));
        for (size_t i = 0; i < q.size(); ++i) {
            encode(c.dtype, random.next() * 4.0f - 2.0f, &q_bytes[i * dtype_size(c.dtype)]);
            q[i] = decode(c.dtype, &q_bytes[i * dtype_size(c.dtype)]);
        }
        const auto q_device = device_bytes(q_bytes);
        DeviceArray<unsigned char> out(out_elements * dtype_size(c.dtype));
        DeviceArray<float> lse(lse_elements);
        DeviceArray<float> partial_out(lse_elements * p.kv_chunks * c.head_dim), partial_lse(lse_elements * p.kv_chunks * 2);
        out.fill_bytes(0xff);
        check(fa_cuda_kvcache_forward(p, dtype, cache, q_device->get(), k_data->get(), v_data->get(), out.get(),
                                      lse.get(), r.split ? partial_out.get() : nullptr,
                                      r.split ? partial_lse.get() : nullptr),
              "kvcache forward launch");
        check(cudaDeviceSynchronize(), "kvcache forward");
        if (c.wrong) {
            std::printf("ok   %-44s launches succeeded (memcheck judges the accesses)\n", name.c_str());
            continue;
        }
        std::vector<float> ours(out_elements);
        const std::vector<unsigned char> out_bytes = out.download();
        for (size_t i = 0; i < ours.size(); ++i) {
            ours[i] = decode(c.dtype, &out_bytes[i * dtype_size(c.dtype)]);
        }
        const std::vector<float> ours_lse = lse.download();
        bool same = true;
        if (c.bits == 0 && c.page != 0) {
            // The plain kernels on the same rows, contiguous (B, Hkv, seqlen_k, head_dim).
            const auto k_plain = device_bytes(contiguous_bytes(c, k.exact));
            const auto v_plain = device_bytes(contiguous_bytes(c, v.exact));
            FlashAttentionParams d = p;
            const uint64_t dim = uint64_t(c.head_dim);
            d.k = d.v = d.dk = d.dv = FlashAttentionStrides{uint64_t(c.kv_heads) * c.seqlen_k * dim,
                                                            uint64_t(c.seqlen_k) * dim, dim};
            d.kv_page_rows = d.kv_max_blocks = d.kv_num_blocks = 0;
            DeviceArray<unsigned char> plain(out_elements * dtype_size(c.dtype));
            DeviceArray<float> plain_lse(lse_elements);
            check(r.split ? fa_cuda_forward_split(d, dtype, q_device->get(), k_plain->get(), v_plain->get(),
                                                  plain.get(), plain_lse.get(), partial_out.get(), partial_lse.get())
                          : fa_cuda_forward(d, dtype, q_device->get(), k_plain->get(), v_plain->get(), plain.get(),
                                            plain_lse.get()),
                  "plain forward launch");
            check(cudaDeviceSynchronize(), "plain forward");
            const std::vector<float> want_lse = plain_lse.download();
            same = plain.download() == out_bytes &&
                   std::memcmp(want_lse.data(), ours_lse.data(), want_lse.size() * sizeof(float)) == 0;
        }
        AttentionShape shape{c.batch, c.heads, c.kv_heads, r.rows, c.seqlen_k, c.head_dim, c.head_dim, true,
                             p.softmax_scale, c.dtype};
        AttentionInputs in;
        in.q = q;
        in.dout.assign(out_elements, 0.0f);
        if (c.bits == 0) {
            in.k.assign(k.exact.begin(), k.exact.end());
            in.v.assign(v.exact.begin(), v.exact.end());
        }
        const bool dumped = dump.write(name, shape, in, {{"out", &ours}, {"lse", &ours_lse}}) &&
                            (c.bits == 0 || (dump.exact(name + ".k_exact", k.exact) &&
                                             dump.exact(name + ".v_exact", v.exact)));
        const bool passed = same && dumped;
        failures += passed ? 0 : 1;
        std::printf("%-4s %-44s%s%s\n", passed ? "ok" : "FAIL", name.c_str(),
                    c.bits == 0 && c.page != 0 ? (same ? " bit-identical to the plain kernel" : " DIFFERS FROM THE PLAIN KERNEL")
                                               : "",
                    dumped ? "" : " NOT-DUMPED");
    }
    return failures;
}

const std::vector<KVCacheCase> &cases() {
    static const std::vector<KVCacheCase> all = {
        {"kvcache_f16_h8x2_d64_k77_paged16", DType::f16, 2, 8, 2, 64, 77, 16, 0, 0, false},
        {"kvcache_bf16_h4x1_d128_k150_q8_g64_paged16", DType::bf16, 1, 4, 1, 128, 150, 16, 8, 64, false},
        {"kvcache_f16_h8x2_d64_k90_q4_g32_contiguous", DType::f16, 2, 8, 2, 64, 90, 0, 4, 32, false},
        // Odd pages: the two rows of a paired tile chunk may lie in different blocks.
        {"kvcache_f16_h4x2_d128_k61_q8_g128_paged5", DType::f16, 1, 4, 2, 128, 61, 5, 8, 128, false},
        {"kvcache_f32_h4x2_d32_k40_q4_g32_paged3", DType::f32, 2, 4, 2, 32, 40, 3, 4, 32, false},
        {"kvcache_f16_wrong_table", DType::f16, 2, 4, 2, 64, 50, 16, 4, 64, true},
    };
    return all;
}

}  // namespace

int run_kv_cache_cases(const std::string &filter, const Dump &dump, int *run_count) {
    int failures = 0;
    for (const KVCacheCase &c : cases()) {
        if (std::string(c.name).find(filter) != std::string::npos) {
            failures += run(c, dump, run_count);
        }
    }
    return failures;
}
