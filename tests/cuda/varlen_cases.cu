// Variable-length batches on the CUDA build (issue 22), run by the harness after its grid so that
// the sanitizer steps of tests/cuda/gpu_check.sh run them too. A case packs sequences of the lengths
// below (0 and 1 among them) into one tensor, runs the varlen forward and backward
// (fa_cuda_varlen_*), and compares every sequence bit for bit with the dense kernels on that
// sequence alone (fa_cuda_forward and fa_cuda_backward, which the grid checks against the float64
// reference under the accuracy rule): the same kernel code must give the same bits. Rows of a
// sequence without keys must hold out 0, lse -inf (the sink with sinks) and dq 0; keys of a
// sequence without queries dk = dv = 0. The wrong-table case sends tables that are negative,
// decreasing and past the totals: it passes when every launch succeeds (memcheck, run over the
// harness by gpu_check.sh, must report no access outside the tensors).
#include "varlen_cases.h"

#include <cuda_runtime.h>

#include <algorithm>
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

struct VarlenCase {
    const char *name;
    DType dtype;
    unsigned heads, kv_heads, head_dim, head_dim_v;
    std::vector<int> lengths_q, lengths_k;
    bool causal;
    int window_left, window_right;
    float softcap;
    bool alibi_per_sequence, sinks;
    std::vector<int> wrong_q, wrong_k;  // tables sent instead of the lengths' (the wrong-table case)
};

std::vector<int> cumulative(const std::vector<int> &lengths) {
    std::vector<int> table(1, 0);
    for (int length : lengths) {
        table.push_back(table.back() + length);
    }
    return table;
}

// Deterministic values in [-2, 2), rounded to the dtype, as bytes.
std::vector<unsigned char> random_bytes(DType dtype, size_t elements, unsigned seed) {
    std::vector<unsigned char> bytes(elements * dtype_size(dtype));
    uint32_t state = seed * 2654435761u + 1;
    for (size_t i = 0; i < elements; ++i) {
        state = state * 1664525u + 1013904223u;
        encode(dtype, float(state >> 8) / float(1u << 24) * 4.0f - 2.0f, &bytes[i * dtype_size(dtype)]);
    }
    return bytes;
}

template <typename T>
std::unique_ptr<DeviceArray<T>> device_copy(const std::vector<T> &host) {
    auto array = std::make_unique<DeviceArray<T>>(host.size());
    array->upload(host);
    return array;
}

// A packed (rows, heads, dim) tensor's strides: heads * dim per row, dim per head.
FlashAttentionStrides packed(unsigned rows, unsigned heads, unsigned dim) {
    return FlashAttentionStrides{uint64_t(rows > 0 ? rows : 1) * heads * dim, dim, uint64_t(heads) * dim};
}

FlashAttentionParams problem(const VarlenCase &c, unsigned rows_q, unsigned rows_k) {
    FlashAttentionParams p{};
    p.q = p.dq = packed(rows_q, c.heads, c.head_dim);
    p.out = p.dout = packed(rows_q, c.heads, c.head_dim_v);
    p.k = p.dk = packed(rows_k, c.kv_heads, c.head_dim);
    p.v = p.dv = packed(rows_k, c.kv_heads, c.head_dim_v);
    p.batch = 1;
    p.num_heads = c.heads;
    p.num_kv_heads = c.kv_heads;
    p.seqlen_q = rows_q;
    p.seqlen_k = rows_k;
    p.head_dim = c.head_dim;
    p.head_dim_v = c.head_dim_v;
    p.causal = c.causal ? 1 : 0;
    p.window_left = c.window_left;
    p.window_right = c.causal ? 0 : c.window_right;
    p.softmax_scale = 1.0f / std::sqrt(float(c.head_dim));
    p.softcap = c.softcap;
    p.mask_type = FA_MASK_NONE;
    p.has_alibi = c.alibi_per_sequence ? 1 : 0;
    p.has_sinks = c.sinks ? 1 : 0;
    p.kv_chunks = 1;
    p.kv_chunk_keys = rows_k;
    return p;
}

// Bytes [first, first + count) of a device buffer.
std::vector<unsigned char> bytes_of(const DeviceArray<unsigned char> &array, size_t first, size_t count) {
    return array.download(first, count);
}

struct Packed {
    std::unique_ptr<DeviceArray<unsigned char>> q, k, v, dout, out, dq, dk, dv;
    std::unique_ptr<DeviceArray<float>> lse, delta, residual, alibi, sinks, dsinks;
};

// Runs one case; returns its mismatch count (0: passed) and prints its line.
int run(const VarlenCase &c) {
    const bool wrong = !c.wrong_q.empty();
    const std::vector<int> cu_q = wrong ? c.wrong_q : cumulative(c.lengths_q);
    const std::vector<int> cu_k = wrong ? c.wrong_k : cumulative(c.lengths_k);
    const std::vector<int> true_q = cumulative(c.lengths_q), true_k = cumulative(c.lengths_k);
    const unsigned sequences = unsigned(c.lengths_q.size());
    const unsigned tq = unsigned(true_q.back()), tk = unsigned(true_k.back());
    const size_t size = dtype_size(c.dtype);
    const int dtype = int(c.dtype);
    Packed t;
    t.q = device_copy(random_bytes(c.dtype, size_t(tq) * c.heads * c.head_dim, 1));
    t.k = device_copy(random_bytes(c.dtype, size_t(tk) * c.kv_heads * c.head_dim, 2));
    t.v = device_copy(random_bytes(c.dtype, size_t(tk) * c.kv_heads * c.head_dim_v, 3));
    t.dout = device_copy(random_bytes(c.dtype, size_t(tq) * c.heads * c.head_dim_v, 4));
    t.out = std::make_unique<DeviceArray<unsigned char>>(size_t(tq) * c.heads * c.head_dim_v * size);
    t.dq = std::make_unique<DeviceArray<unsigned char>>(size_t(tq) * c.heads * c.head_dim * size);
    t.dk = std::make_unique<DeviceArray<unsigned char>>(size_t(tk) * c.kv_heads * c.head_dim * size);
    t.dv = std::make_unique<DeviceArray<unsigned char>>(size_t(tk) * c.kv_heads * c.head_dim_v * size);
    for (auto *output : {t.out.get(), t.dq.get(), t.dk.get(), t.dv.get()}) {
        output->fill_bytes(0xff);
    }
    t.lse = std::make_unique<DeviceArray<float>>(size_t(c.heads) * tq);
    t.delta = std::make_unique<DeviceArray<float>>(size_t(c.heads) * tq);
    t.residual = std::make_unique<DeviceArray<float>>(size_t(c.heads) * tq);
    t.dsinks = std::make_unique<DeviceArray<float>>(c.heads);
    std::vector<float> slopes(size_t(sequences) * c.heads), sink_logits(c.heads);
    for (size_t i = 0; i < slopes.size(); ++i) {
        slopes[i] = 0.05f + 0.02f * float(i % 17);
    }
    for (unsigned h = 0; h < c.heads; ++h) {
        sink_logits[h] = 0.25f * float(h) - 0.5f;
    }
    t.alibi = device_copy(slopes);
    t.sinks = device_copy(sink_logits);
    auto cu_q_device = device_copy(cu_q), cu_k_device = device_copy(cu_k);
    DeviceArray<unsigned char> table((sequences + 1) * sizeof(FlashAttentionParams));
    FlashAttentionParams p = problem(c, tq, tk);
    p.sequences = sequences;
    p.alibi_batch_stride = c.alibi_per_sequence ? c.heads : 0;
    FaCudaVarlen varlen;
    varlen.cu_seqlens_q = cu_q_device->get();
    varlen.cu_seqlens_k = cu_k_device->get();
    varlen.table = reinterpret_cast<FlashAttentionParams *>(table.get());
    for (unsigned b = 0; b < sequences; ++b) {
        varlen.max_seqlen_q = std::max(varlen.max_seqlen_q, unsigned(c.lengths_q[b]));
        varlen.max_seqlen_k = std::max(varlen.max_seqlen_k, unsigned(c.lengths_k[b]));
    }
    FaCudaScoreInputs inputs;
    inputs.alibi = c.alibi_per_sequence ? t.alibi->get() : nullptr;
    inputs.sinks = c.sinks ? t.sinks->get() : nullptr;
    check(fa_cuda_varlen_forward(p, dtype, varlen, t.q->get(), t.k->get(), t.v->get(), t.out->get(),
                                 t.lse->get(), inputs),
          "varlen forward launch");
    check(cudaDeviceSynchronize(), "varlen forward");
    check(fa_cuda_varlen_backward(p, dtype, varlen, t.dout->get(), t.q->get(), t.k->get(), t.v->get(),
                                  t.out->get(), t.lse->get(), t.delta->get(), t.residual->get(),
                                  t.dq->get(), t.dk->get(), t.dv->get(), inputs, t.dsinks->get()),
          "varlen backward launch");
    check(cudaDeviceSynchronize(), "varlen backward");
    if (wrong) {
        std::printf("ok   %-44s launches succeeded (memcheck judges the accesses)\n", c.name);
        return 0;
    }
    int mismatches = 0;
    const std::vector<float> lse = t.lse->download();
    const size_t row_q = size_t(c.heads) * c.head_dim * size, row_out = size_t(c.heads) * c.head_dim_v * size;
    const size_t row_k = size_t(c.kv_heads) * c.head_dim * size, row_v = size_t(c.kv_heads) * c.head_dim_v * size;
    for (unsigned b = 0; b < sequences; ++b) {
        const unsigned lq = unsigned(c.lengths_q[b]), lk = unsigned(c.lengths_k[b]);
        const size_t q0 = size_t(true_q[b]), k0 = size_t(true_k[b]);
        const auto zero = [](const std::vector<unsigned char> &bytes) {
            for (unsigned char byte : bytes) {
                if (byte != 0) {
                    return false;
                }
            }
            return true;
        };
        if (lq == 0 || lk == 0) {
            bool ok = true;
            if (lq == 0) {  // keys without queries: no gradient
                ok = zero(bytes_of(*t.dk, k0 * row_k, lk * row_k)) && zero(bytes_of(*t.dv, k0 * row_v, lk * row_v));
            }
            if (lk == 0) {  // queries without keys: out 0, lse -inf (the sink), dq 0
                ok = ok && zero(bytes_of(*t.out, q0 * row_out, lq * row_out)) &&
                     zero(bytes_of(*t.dq, q0 * row_q, lq * row_q));
                for (unsigned h = 0; h < c.heads; ++h) {
                    for (unsigned i = 0; i < lq; ++i) {
                        ok = ok && lse[size_t(h) * tq + q0 + i] == (c.sinks ? sink_logits[h] : -INFINITY);
                    }
                }
            }
            mismatches += ok ? 0 : 1;
            continue;
        }
        // The sequence alone: its rows of the packed tensors, a dense one-entry problem.
        FlashAttentionParams d = problem(c, lq, lk);
        d.q.batch = d.dq.batch = p.q.batch;  // strides of the packed tensors
        d.out.batch = d.dout.batch = p.out.batch;
        d.k.batch = d.dk.batch = p.k.batch;
        d.v.batch = d.dv.batch = p.v.batch;
        FaCudaScoreInputs seq_inputs = inputs;
        if (c.alibi_per_sequence) {
            seq_inputs.alibi = t.alibi->get() + size_t(b) * c.heads;
        }
        DeviceArray<unsigned char> out(size_t(lq) * row_out), dq(size_t(lq) * row_q), dk(size_t(lk) * row_k),
            dv(size_t(lk) * row_v);
        DeviceArray<float> dense_lse(size_t(c.heads) * lq), delta(size_t(c.heads) * lq),
            residual(size_t(c.heads) * lq), dsinks(c.heads);
        check(fa_cuda_forward(d, dtype, t.q->get() + q0 * row_q, t.k->get() + k0 * row_k,
                              t.v->get() + k0 * row_v, out.get(), dense_lse.get(), seq_inputs),
              "dense forward launch");
        check(cudaDeviceSynchronize(), "dense forward");
        bool ok = out.download() == bytes_of(*t.out, q0 * row_out, lq * row_out);
        const std::vector<float> alone = dense_lse.download();
        std::vector<float> given(alone.size());
        for (unsigned h = 0; h < c.heads; ++h) {
            for (unsigned i = 0; i < lq; ++i) {
                given[size_t(h) * lq + i] = lse[size_t(h) * tq + q0 + i];
                ok = ok && std::memcmp(&alone[size_t(h) * lq + i], &given[size_t(h) * lq + i], 4) == 0;
            }
        }
        // Backward on the varlen pass's out and lse: the same kernels, the same bits.
        dense_lse.upload(given);
        check(fa_cuda_backward(d, dtype, t.dout->get() + q0 * row_out, t.q->get() + q0 * row_q,
                               t.k->get() + k0 * row_k, t.v->get() + k0 * row_v, t.out->get() + q0 * row_out,
                               dense_lse.get(), delta.get(), residual.get(), dq.get(), dk.get(), dv.get(),
                               seq_inputs, dsinks.get()),
              "dense backward launch");
        check(cudaDeviceSynchronize(), "dense backward");
        ok = ok && dq.download() == bytes_of(*t.dq, q0 * row_q, lq * row_q);
        ok = ok && dk.download() == bytes_of(*t.dk, k0 * row_k, lk * row_k);
        ok = ok && dv.download() == bytes_of(*t.dv, k0 * row_v, lk * row_v);
        if (!ok) {
            std::printf("     %s: sequence %u (%u rows, %u keys) differs from the dense call\n", c.name, b, lq, lk);
        }
        mismatches += ok ? 0 : 1;
    }
    std::printf("%-4s %-44s %u sequences, %d differ from the dense call per sequence\n",
                mismatches == 0 ? "ok" : "FAIL", c.name, sequences, mismatches);
    return mismatches;
}

const std::vector<VarlenCase> &cases() {
    static const std::vector<VarlenCase> all = {
        {"varlen_f16_h4x2_d64_causal", DType::f16, 4, 2, 64, 64, {0, 1, 17, 40, 9}, {3, 0, 17, 33, 12},
         true, -1, -1, 0.0f, false, false, {}, {}},
        {"varlen_bf16_h4x1_d32_v48_window_softcap_sinks", DType::bf16, 4, 1, 32, 48, {12, 0, 33, 1},
         {20, 5, 30, 0}, false, 8, 4, 20.0f, false, true, {}, {}},
        {"varlen_f32_h2x2_d40_alibi_per_sequence", DType::f32, 2, 2, 40, 40, {25, 3, 0, 16}, {25, 7, 9, 16},
         false, -1, -1, 0.0f, true, false, {}, {}},
        // Lengths give the tensors' sizes; the tables sent are wrong.
        {"varlen_f16_wrong_table", DType::f16, 2, 1, 32, 32, {5, 15, 4}, {7, 10, 7}, true, -1, -1, 0.0f,
         false, true, {0, -50, 900, 3}, {2147483647, 2, -2147483647 - 1, 24}},
    };
    return all;
}

}  // namespace

int run_varlen_cases(const std::string &filter, int *run_count) {
    int mismatches = 0;
    for (const VarlenCase &c : cases()) {
        if (std::string(c.name).find(filter) == std::string::npos) {
            continue;
        }
        ++*run_count;
        mismatches += run(c) == 0 ? 0 : 1;
    }
    return mismatches;
}
