// The SIMD-group emulation of metal_cuda.h checked on the GPU before the attention kernels use it:
// the CPU engine's matrix test kernels (tests/kernels/matrix.metal, compiled as CUDA like the
// attention kernels) against the expectations of tests/swift/MSLEngineTests/MatrixTests.swift
// (products, Apple's lane mapping through thread_elements(), load/store at an origin and
// transposed, the diagonal constructor, make_filled_simdgroup_matrix), plus the SIMD-group
// functions the kernels use and the row reduction design.md describes (a row of a matrix is owned
// by lanes l, l ^ 1, l ^ 8, l ^ 9), and the conversions of half and bfloat (the element types of
// the kernels' tensors) against the host's (dtype_bits.h, which the dumps' conversions use).
// matrix_partial_group (a 16-lane SIMD-group) is not run: a
// CUDA warp shuffle with lanes missing is undefined, not a reported error.
//
// Prints one line per check and "cuda-matrix: N checks, M mismatches"; exits 1 on any mismatch or
// CUDA error.
#include "metal_cuda.h"
#include "matrix.metal"
#include "metal_cuda_end.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device_array.h"
#include "dtype_bits.h"

namespace {

// The MSL kernels take thread_index_in_simdgroup as a parameter; every launch is 1-D.
__global__ void launch_matrix_multiply_float(const float *a, const float *b, const float *c,
                                             float *d, float *elements) {
    matrix_multiply_float(a, b, c, d, elements, threadIdx.x % 32);
}

__global__ void launch_matrix_multiply_half(const half *a, const half *b, const half *c, half *d) {
    matrix_multiply_half(a, b, c, d);
}

__global__ void launch_matrix_layout(const float *src, float *dst) {
    matrix_layout(src, dst, threadIdx.x % 32);
}

constexpr int kSimdResults = 11;

// SIMD-group functions on v = (3 * tid + 1) / 2 (exact in float, so sums are exact too).
__global__ void simd_functions(float *out) {
    const unsigned tid = threadIdx.x, lane = tid % 32;
    const float v = float(3 * tid + 1) * 0.5f;
    float *r = out + tid * kSimdResults;
    r[0] = metal::simd_shuffle_xor(v, 1);
    r[1] = metal::simd_shuffle_xor(v, 8);
    r[2] = metal::simd_shuffle(v, (lane + 3) % 32);
    r[3] = metal::simd_broadcast(v, 9);
    r[4] = metal::simd_sum(v);
    r[5] = metal::simd_max(float(lane % 7) - v);
    r[6] = metal::simd_min(float(lane % 7) - v);
    r[7] = metal::simd_shuffle_down(v, 5);
    r[8] = metal::simd_shuffle_up(v, 3);
    const metal::vec<float, 2> pair = metal::simd_shuffle_xor(metal::vec<float, 2>(v, -v), 9);
    r[9] = pair.x;
    r[10] = pair[1];
}

// Row maxima of an 8x8 row-major matrix the way the attention kernels take them: the own pair of
// thread_elements(), then simd_shuffle_xor by 1 and by 8. Lane l writes its row's maximum to
// out[l].
__global__ void row_max(const float *m, float *out) {
    metal::simdgroup_float8x8 tile;
    metal::simdgroup_load(tile, m);
    float x = fmaxf(tile.thread_elements()[0], tile.thread_elements()[1]);
    x = fmaxf(x, metal::simd_shuffle_xor(x, 1));
    x = fmaxf(x, metal::simd_shuffle_xor(x, 8));
    out[threadIdx.x % 32] = x;
}

// Thread i rounds in[i] to half and to bfloat (MSL's conversions, as the kernels store outputs)
// and widens bfloat encoding i to float. The results are stored as whole 16-bit elements, as the
// kernels store them: nvcc 13.0.88 compiles a byte store of the low byte of a cvt.rn.f16.f32 (or
// .bf16) result for sm_90 into F2I.U8.F16 (a float-to-integer conversion), so a memcpy of the two
// bytes here stored a wrong low byte (seen on the H200; not in the kernels, which store 16 bits).
__global__ void convert(const float *in, size_t n, half *as_half, bfloat *as_bfloat,
                        float *widened) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        as_half[i] = half(in[i]);
        as_bfloat[i] = bfloat(in[i]);
    }
    if (i < 65536) {
        widened[i] = float(__ushort_as_bfloat16(static_cast<unsigned short>(i)));
    }
}

// Counts and prints one check.
struct Report {
    int checks = 0, mismatches = 0;

    void add(const std::string &name, const std::string &first_failure) {
        ++checks;
        if (first_failure.empty()) {
            std::printf("ok   %s\n", name.c_str());
        } else {
            ++mismatches;
            std::printf("FAIL %s: %s\n", name.c_str(), first_failure.c_str());
        }
    }
};

std::string mismatch(const char *what, int index, double got, double expected) {
    char text[160];
    std::snprintf(text, sizeof text, "%s %d: got %.9g, expected %.9g", what, index, got, expected);
    return text;
}

// MatrixTests.owner: the lane holding element (row, column) by Apple's mapping.
int owner(int row, int column) {
    for (int l = 0; l < 32; ++l) {
        if (((l / 4) & 4) + (l / 2) % 4 == row &&
            ((l / 4) & 2) * 2 + (l % 2) * 2 == column - column % 2) {
            return l;
        }
    }
    return -1;
}

// c + a * b for 8x8 row-major matrices, in double.
std::vector<double> product(const std::vector<double> &a, const std::vector<double> &b,
                            const std::vector<double> &c) {
    std::vector<double> d(64);
    for (int i = 0; i < 64; ++i) {
        double sum = 0;
        for (int k = 0; k < 8; ++k) sum += a[i / 8 * 8 + k] * b[k * 8 + i % 8];
        d[i] = c[i] + sum;
    }
    return d;
}

void check_multiply_float(Report *report) {
    std::vector<float> a(64), b(64), c(64);
    for (int i = 0; i < 64; ++i) {
        a[i] = float((i * 7) % 13) - 6;
        b[i] = float((i * 5) % 11) * 0.25f - 1;
        c[i] = float(i % 9) * 0.5f;
    }
    DeviceArray<float> da(64), db(64), dc(64), dd(64), delements(64);
    da.upload(a);
    db.upload(b);
    dc.upload(c);
    launch_matrix_multiply_float<<<1, 32>>>(da.get(), db.get(), dc.get(), dd.get(),
                                            delements.get());
    check(cudaGetLastError(), "matrix_multiply_float launch");
    check(cudaDeviceSynchronize(), "matrix_multiply_float");
    const std::vector<float> d = dd.download(), elements = delements.download();
    const std::vector<double> expected = product(std::vector<double>(a.begin(), a.end()),
                                                 std::vector<double>(b.begin(), b.end()),
                                                 std::vector<double>(c.begin(), c.end()));
    std::string failure;
    for (int i = 0; i < 64 && failure.empty(); ++i) {
        if (!(std::fabs(double(d[i]) - expected[i]) <= 1e-4)) {
            failure = mismatch("element", i, d[i], expected[i]);
        }
    }
    report->add("matrix_multiply_float: d = a * b + c", failure);
    failure.clear();
    for (int lane = 0; lane < 32 && failure.empty(); ++lane) {
        const int row = ((lane / 4) & 4) + (lane / 2) % 4;
        const int column = ((lane / 4) & 2) * 2 + (lane % 2) * 2;
        for (int e = 0; e < 2; ++e) {
            if (elements[lane * 2 + e] != a[row * 8 + column + e]) {
                failure = mismatch(e == 0 ? "first element of lane" : "second element of lane",
                                   lane, elements[lane * 2 + e], a[row * 8 + column + e]);
                break;
            }
        }
    }
    report->add("matrix_multiply_float: thread_elements() follow Apple's lane mapping", failure);
}

void check_multiply_half(Report *report) {
    std::vector<uint16_t> a(64), b(64), c(64);
    std::vector<double> ad(64), bd(64), cd(64);
    for (int i = 0; i < 64; ++i) {
        a[i] = float_to_half_bits(float((i * 3) % 7) * 0.5f - 1.5f);
        b[i] = float_to_half_bits(float((i * 5) % 9) * 0.25f - 1);
        c[i] = float_to_half_bits(float(i % 5) - 2);
        ad[i] = half_bits_to_float(a[i]);
        bd[i] = half_bits_to_float(b[i]);
        cd[i] = half_bits_to_float(c[i]);
    }
    DeviceArray<uint16_t> da(64), db(64), dc(64), dd(64);
    da.upload(a);
    db.upload(b);
    dc.upload(c);
    auto as_half = [](uint16_t *p) { return reinterpret_cast<half *>(p); };
    launch_matrix_multiply_half<<<1, 32>>>(as_half(da.get()), as_half(db.get()), as_half(dc.get()),
                                           as_half(dd.get()));
    check(cudaGetLastError(), "matrix_multiply_half launch");
    check(cudaDeviceSynchronize(), "matrix_multiply_half");
    const std::vector<uint16_t> d = dd.download();
    const std::vector<double> expected = product(ad, bd, cd);
    std::string failure;
    for (int i = 0; i < 64 && failure.empty(); ++i) {
        const float want = round_to_half(float(expected[i]));
        if (half_bits_to_float(d[i]) != want) {
            failure = mismatch("element", i, half_bits_to_float(d[i]), want);
        }
    }
    report->add("matrix_multiply_half: d = a * b + c rounded once to half", failure);
}

void check_layout(Report *report) {
    std::vector<float> src(256);
    for (int i = 0; i < 256; ++i) src[i] = float(i);
    DeviceArray<float> dsrc(256), ddst(256);
    dsrc.upload(src);
    ddst.upload(std::vector<float>(256, -1.0f));
    launch_matrix_layout<<<1, 32>>>(dsrc.get(), ddst.get());
    check(cudaGetLastError(), "matrix_layout launch");
    check(cudaDeviceSynchronize(), "matrix_layout");
    const std::vector<float> dst = ddst.download();
    std::string failure;
    for (int row = 0; row < 16 && failure.empty(); ++row) {
        for (int column = 0; column < 16; ++column) {
            float want = -1;  // untouched
            if (row >= 8 && column < 8) {
                // Transposed load at origin (x 8, y 0): element (r, c) = src[(8 + c) * 16 + r],
                // times the identity, times (lane + 1) of the lane that owns (r, c).
                const int r = row - 8, c = column;
                want = src[(8 + c) * 16 + r] * float(owner(r, c) + 1);
            } else if (row < 8 && column >= 8) {
                want = 2;  // make_filled_simdgroup_matrix
            }
            if (dst[row * 16 + column] != want) {
                failure = mismatch("element", row * 16 + column, dst[row * 16 + column], want);
                break;
            }
        }
    }
    report->add("matrix_layout: origin, transpose, identity, thread_elements() writes, filled",
                failure);
}

void check_simd_functions(Report *report) {
    const int threads = 64;  // two SIMD-groups: every function stays within its own
    DeviceArray<float> dout(threads * kSimdResults);
    simd_functions<<<1, threads>>>(dout.get());
    check(cudaGetLastError(), "simd_functions launch");
    check(cudaDeviceSynchronize(), "simd_functions");
    const std::vector<float> out = dout.download();
    auto value = [](int tid) { return float(3 * tid + 1) * 0.5f; };
    std::string failure;
    for (int tid = 0; tid < threads && failure.empty(); ++tid) {
        const int lane = tid % 32, first = tid - lane;
        float sum = 0, maximum = -INFINITY, minimum = INFINITY;
        for (int l = 0; l < 32; ++l) {
            sum += value(first + l);
            maximum = std::max(maximum, float(l % 7) - value(first + l));
            minimum = std::min(minimum, float(l % 7) - value(first + l));
        }
        const float expected[kSimdResults] = {
            value(first + (lane ^ 1)),
            value(first + (lane ^ 8)),
            value(first + (lane + 3) % 32),
            value(first + 9),
            sum,
            maximum,
            minimum,
            value(lane + 5 < 32 ? tid + 5 : tid),
            value(lane >= 3 ? tid - 3 : tid),
            value(first + (lane ^ 9)),
            -value(first + (lane ^ 9)),
        };
        for (int i = 0; i < kSimdResults; ++i) {
            if (out[tid * kSimdResults + i] != expected[i]) {
                char what[64];
                std::snprintf(what, sizeof what, "thread %d, result", tid);
                failure = mismatch(what, i, out[tid * kSimdResults + i], expected[i]);
                break;
            }
        }
    }
    report->add("simd_shuffle(_xor, _down, _up), simd_broadcast, simd_sum/max/min", failure);
}

// Equal bits, or both NaN (NaN payloads may differ).
bool same_element(float got, float want) {
    return std::memcmp(&got, &want, 4) == 0 || (std::isnan(got) && std::isnan(want));
}

// The first mismatch of a conversion and how many there are ("" when none).
struct ConversionMismatches {
    size_t count = 0;
    std::string first;

    void add(uint32_t input_bits, float got, float want) {
        if (count++ == 0) {
            float input;
            std::memcpy(&input, &input_bits, 4);
            char text[160];
            std::snprintf(text, sizeof text,
                          "input 0x%08x (%.9g): got %.9g, IEEE round-to-nearest-even %.9g",
                          input_bits, double(input), double(got), double(want));
            first = text;
        }
    }
    std::string failure(size_t inputs) const {
        return count == 0 ? "" : std::to_string(count) + " of " + std::to_string(inputs) +
                                     " inputs differ; first: " + first;
    }
};

// Every upper half of a float's bits with low halves 0, 0x7fff, 0x8000 (a tie for bfloat), 0x8001
// and 0xffff: ties, overflow to infinity, subnormals, NaN, for both 16-bit types.
void check_conversions(Report *report) {
    std::vector<uint32_t> inputs;
    for (uint32_t upper = 0; upper < 65536; ++upper) {
        for (uint32_t lower : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
            inputs.push_back(upper << 16 | lower);
        }
    }
    std::vector<float> in(inputs.size());
    std::memcpy(in.data(), inputs.data(), inputs.size() * 4);
    DeviceArray<float> din(in.size()), dwidened(65536);
    DeviceArray<uint16_t> dhalf(in.size()), dbfloat(in.size());
    din.upload(in);
    const unsigned blocks = unsigned((in.size() + 255) / 256);
    convert<<<blocks, 256>>>(din.get(), in.size(), reinterpret_cast<half *>(dhalf.get()),
                             reinterpret_cast<bfloat *>(dbfloat.get()), dwidened.get());
    check(cudaGetLastError(), "convert launch");
    check(cudaDeviceSynchronize(), "convert");
    const std::vector<uint16_t> halves = dhalf.download(), bfloats = dbfloat.download();
    const std::vector<float> widened = dwidened.download();
    ConversionMismatches half_mismatches, bfloat_mismatches;
    for (size_t i = 0; i < in.size(); ++i) {
        const float half_got = half_bits_to_float(halves[i]), half_want = round_to_half(in[i]);
        if (!same_element(half_got, half_want)) {
            half_mismatches.add(inputs[i], half_got, half_want);
        }
        const float bfloat_got = bfloat_bits_to_float(bfloats[i]);
        const float bfloat_want = round_to_bfloat(in[i]);
        if (!same_element(bfloat_got, bfloat_want)) {
            bfloat_mismatches.add(inputs[i], bfloat_got, bfloat_want);
        }
    }
    std::string widen_failure;
    for (uint32_t bits = 0; bits < 65536 && widen_failure.empty(); ++bits) {
        const float want = bfloat_bits_to_float(uint16_t(bits));
        if (!same_element(widened[bits], want)) {
            widen_failure = mismatch("encoding", int(bits), widened[bits], want);
        }
    }
    report->add("half(float): round to nearest even, as the host's rule",
                half_mismatches.failure(in.size()));
    report->add("bfloat(float): round to nearest even, as the host's rule",
                bfloat_mismatches.failure(in.size()));
    report->add("float(bfloat): exact for all 65536 encodings", widen_failure);
}

void check_row_max(Report *report) {
    std::vector<float> m(64);
    for (int i = 0; i < 64; ++i) m[i] = float((i * 29) % 64) - 20;
    DeviceArray<float> dm(64), dout(32);
    dm.upload(m);
    row_max<<<1, 32>>>(dm.get(), dout.get());
    check(cudaGetLastError(), "row_max launch");
    check(cudaDeviceSynchronize(), "row_max");
    const std::vector<float> out = dout.download();
    std::string failure;
    for (int lane = 0; lane < 32 && failure.empty(); ++lane) {
        const int row = ((lane / 4) & 4) + (lane / 2) % 4;
        const float want = *std::max_element(m.begin() + row * 8, m.begin() + row * 8 + 8);
        if (out[lane] != want) failure = mismatch("lane", lane, out[lane], want);
    }
    report->add("row max: own pair, then simd_shuffle_xor by 1 and 8", failure);
}

}  // namespace

int main(int argc, char **argv) {
    if (argc > 1) {
        std::fprintf(stderr, "usage: %s (no arguments)\n", argv[0]);
        return 2;
    }
    Report report;
    try {
        check_multiply_float(&report);
        check_multiply_half(&report);
        check_layout(&report);
        check_simd_functions(&report);
        check_row_max(&report);
        check_conversions(&report);
    } catch (const CudaFailure &failure) {
        std::printf("FAIL CUDA error: %s\n", failure.message.c_str());
        ++report.mismatches;
    }
    std::printf("cuda-matrix: %d checks, %d mismatches\n", report.checks, report.mismatches);
    return report.mismatches == 0 ? 0 : 1;
}
