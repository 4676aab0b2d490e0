// The cross-check runs of the tensor-op test kernels (tests/kernels/tensor_ops.metal), host side:
// their inputs, as TensorOpsTests and TensorOpsEngineOutputTests define them (halfA, halfB, the c
// of the half product; float operands in [0.5, 1) with every mantissa bit drawn from a
// multiplicative hash: exact formulas, no library functions, so every side makes the same bits),
// the documented accumulation order, and the output format of tests/cuda/tensor_ops_engine.txt.
// Used by tensor_ops_check.cu (the GPU) and host_warp/tensor_ops_host.cpp (a simulated warp).
#ifndef FA_TENSOR_OPS_INPUTS_H
#define FA_TENSOR_OPS_INPUTS_H

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dtype_bits.h"

namespace tensor_ops_inputs {

inline std::vector<uint16_t> half_a() {
    std::vector<uint16_t> v(256);
    for (int i = 0; i < 256; ++i) v[i] = float_to_half_bits(float((i * 7) % 23) * 0.125f - 1.375f);
    return v;
}
inline std::vector<uint16_t> half_b() {
    std::vector<uint16_t> v(512);
    for (int i = 0; i < 512; ++i) v[i] = float_to_half_bits(float((i * 5) % 19) * 0.0625f - 0.5f);
    return v;
}
// half_b transposed (32x16): what tensor_matmul_half takes as its right operand.
inline std::vector<uint16_t> half_bt() {
    const std::vector<uint16_t> b = half_b();
    std::vector<uint16_t> bt(512);
    for (int e = 0; e < 512; ++e) bt[e] = b[(e % 16) * 32 + e / 16];
    return bt;
}
inline std::vector<float> accumulator_c() {
    std::vector<float> v(512);
    for (int i = 0; i < 512; ++i) v[i] = float(i % 11) * 0.5f - 2;
    return v;
}
inline std::vector<float> hashed_floats(int count, uint32_t multiplier) {
    std::vector<float> v(count);
    for (int i = 0; i < count; ++i) {
        const uint32_t bits = 0x3f000000u | ((uint32_t(i) * multiplier) >> 9);
        std::memcpy(&v[i], &bits, 4);
    }
    return v;
}
inline std::vector<float> float_a() { return hashed_floats(256, 2654435761u); }
inline std::vector<float> float_b() { return hashed_floats(512, 2246822519u); }

inline std::vector<float> widen(const std::vector<uint16_t> &h) {
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); ++i) v[i] = half_bits_to_float(h[i]);
    return v;
}

inline float truncated(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits &= ~0x1fffu;
    std::memcpy(&x, &bits, 4);
    return x;
}

// The documented order (TensorOpsTests.ordered): start from c, add a[i][k] * b[k][j] for k
// ascending, one fused multiply-add each; a is rows x k, b is k x n, row-major.
inline std::vector<float> ordered(const std::vector<float> &a, const std::vector<float> &b,
                                  const std::vector<float> &c, int k, int n) {
    std::vector<float> d(c.size());
    for (size_t e = 0; e < c.size(); ++e) {
        const size_t i = e / n, j = e % n;
        float acc = c[e];
        for (int q = 0; q < k; ++q) acc = std::fma(a[i * k + q], b[q * n + j], acc);
        d[e] = acc;
    }
    return d;
}

// One output of a run, named kernel.layout[.buffer].
struct Output {
    std::string name;
    std::vector<float> values;
};

// The names of the engine file's outputs: every run under the M5 layout, then the two layout
// kernels under the permuted one.
inline std::vector<std::string> engine_file_names() {
    return {"tensor_matmul_half.m5",     "tensor_matmul_float.m5.exact",
            "tensor_matmul_float.m5.relaxed", "tensor_layout_by_index.m5",
            "tensor_layout_assumed.m5",  "tensor_bounds.m5",
            "tensor_run_on_tensors.m5",  "tensor_layout_by_index.permuted",
            "tensor_layout_assumed.permuted"};
}

// Writes `outputs` in tensor_ops_engine.txt's format (lines of "name first" and 32 float32 bit
// patterns in hex, '#' comments); false when the file cannot be written.
inline bool write_outputs(const char *path, const char *comment,
                          const std::vector<Output> &outputs) {
    FILE *f = std::fopen(path, "w");
    if (f == nullptr) return false;
    std::fprintf(f, "# %s\n", comment);
    for (const Output &o : outputs) {
        for (size_t first = 0; first < o.values.size(); first += 32) {
            std::fprintf(f, "%s %zu", o.name.c_str(), first);
            for (size_t i = first; i < first + 32 && i < o.values.size(); ++i) {
                uint32_t bits;
                std::memcpy(&bits, &o.values[i], 4);
                std::fprintf(f, " %08x", bits);
            }
            std::fprintf(f, "\n");
        }
    }
    return std::fclose(f) == 0;
}

}  // namespace tensor_ops_inputs

#endif
