// 64-bit offsets on a tensor of more than 2^32 elements (issue 5: "a tensor of more than 2^32
// elements is either right or rejected"): the kernels of Shaders/flash_attention.metal (CUDA build,
// the catalogue's launch table) on q, out, dout and dq of 2^32 + 640 elements each, checked row by
// row, under the library's plan: tests/cuda/cases.py plan large exports it (fa_plan_create on the
// host) and writes CASES_FOLDER/large_offsets_f16_d128_k16.case, whose dispatches run here as
// replay.cu runs them (case_file.h); only the inputs are made here, on the device.
//
// Shape (grid.large_offsets_case; checked against the case file's views): batch 1, one head, one
// KV head, head_dim 128, seqlen_k 16, seqlen_q 2^25 + 5, causal off, softmax_scale 1/sqrt(128).
// Row 2^25 starts at element 2^32, so every row from there on needs an offset above 32 bits; the
// last threadgroup holds only those 5 rows. q, out, dout and dq take 8.6 GB each as float16 (34.4
// GB of device memory in all).
//
// q and dout are filled on the device by a hash of the 64-bit element index (so two rows 2^25
// apart differ), k and v on the host. out, lse, the delta and lse residual workspaces and dq are
// poisoned with NaN before the run, so a row a kernel never writes fails. Forward, then the
// backward's delta, lse residual (0 on every row here: |lse| < 256) and dQ dispatches on the
// forward's out and lse: the plan's dispatches but dK/dV's, which is not run: each key's gradient
// sums over all 33.5 M query rows, so its reference would need every row on the host, and the one
// threadgroup that owns the 16 keys would walk all of q.
//
// Only sampled rows come back to the host: rows 0..3; around 2^30 and 2^31 elements (32-bit byte
// and signed-int boundaries); 2^25 - 2 .. 2^25 + 4 around the 2^32-element boundary (the last
// rows); a few seeded random rows. Their q and dout rows are read back from the device and, with
// the GPU's out, lse and dq of those rows, written into a dump folder (dump.h) as one problem of
// the sampled rows (causal off: rows are independent given k and v), which tests/cuda/judge.py
// judges with the Python package's reference and accuracy rule (bound = factor * max|base - ref|
// over the sampled rows together; lse per row). A 32-bit write offset of row 2^25 + i lands in
// row i: row i then holds another row's result and row 2^25 + i keeps its NaN poison, both caught.
//
// Usage: large_offsets CASES_FOLDER DUMP_FOLDER. Prints "large-offsets: N rows dumped, M failures (q
// elements E > 2^32)"; exits 1 on a CUDA error (including too little device memory), a case file
// that is not this problem's, or a failed dump.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "case_file.h"
#include "device_array.h"
#include "dtype_bits.h"
#include "dump.h"

namespace {

constexpr uint32_t kHeadDim = 128;
constexpr uint32_t kSeqlenK = 16;
constexpr uint32_t kBoundaryRow = 1u << 25;  // first row at element 2^32 (2^25 * 128)
constexpr uint32_t kSeqlenQ = kBoundaryRow + 5;
constexpr size_t kQElements = size_t(kSeqlenQ) * kHeadDim;
constexpr size_t kKvElements = size_t(kSeqlenK) * kHeadDim;
constexpr uint64_t kQSeed = 1, kDoutSeed = 2, kKSeed = 3, kVSeed = 4;
constexpr char kCaseName[] = "large_offsets_f16_d128_k16";  // grid.large_offsets_case, and the dump's
static_assert(kQElements > (size_t(1) << 32), "the test needs more than 2^32 elements");


// SplitMix64 (Steele, Lea, Flood 2014): a full-avalanche hash of the 64-bit index, so values of
// elements 2^32 apart are unrelated.
__host__ __device__ uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// The value of element `index` of the tensor seeded `seed`: uniform on [-2, 2) in steps of 2^-14
// (callers round it to float16).
__host__ __device__ float hashed_value(uint64_t seed, uint64_t index) {
    const uint64_t bits = splitmix64(index ^ (seed << 56)) >> 48;
    return -2.0f + float(bits) * (4.0f / 65536.0f);
}

// Fills x[0, n) with hashed_value(seed, i) as float16 bits; grid-stride over 64-bit indices.
__global__ void fill_hashed(uint16_t *x, uint64_t n, uint64_t seed) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = __half_as_ushort(__float2half_rn(hashed_value(seed, i)));
    }
}

void fill_on_device(unsigned char *x, uint64_t n, uint64_t seed) {
    fill_hashed<<<4096, 256>>>(reinterpret_cast<uint16_t *>(x), n, seed);
    check(cudaGetLastError(), "fill launch");
}

// k and v are small: filled on the host, scaled to [-1, 1), rounded to float16.
std::vector<float> host_values(size_t n, uint64_t seed) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) {
        x[i] = round_to_half(0.5f * hashed_value(seed, i));
    }
    return x;
}

std::vector<uint16_t> to_half_bits(const std::vector<float> &x) {
    std::vector<uint16_t> bits(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        bits[i] = float_to_half_bits(x[i]);
    }
    return bits;
}

std::vector<float> from_half_bits(const std::vector<uint16_t> &bits) {
    std::vector<float> x(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) {
        x[i] = half_bits_to_float(bits[i]);
    }
    return x;
}

// The query rows to check, ascending and unique.
std::vector<uint32_t> sampled_rows() {
    std::set<uint32_t> rows = {0, 1, 2, 3};
    for (uint32_t boundary : {1u << 23, 1u << 24}) {  // 2^30 and 2^31 elements
        rows.insert(boundary - 1);
        rows.insert(boundary);
    }
    for (uint32_t row = kBoundaryRow - 2; row < kSeqlenQ; ++row) {
        rows.insert(row);
    }
    std::mt19937_64 random(20261130);
    std::uniform_int_distribution<uint32_t> any_row(0, kSeqlenQ - 1);
    for (int i = 0; i < 8; ++i) {
        rows.insert(any_row(random));
    }
    return std::vector<uint32_t>(rows.begin(), rows.end());
}

template <typename T>
void append(std::vector<T> *all, const std::vector<T> &part) {
    all->insert(all->end(), part.begin(), part.end());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Throws unless view `name` of the case is the contiguous float16 (1, 1, rows, kHeadDim) tensor at
// the start of its buffer, as this program fills and reads it.
void expect_rows(const Case &c, const char *name, uint32_t rows) {
    const Output &o = output_named(c, name);
    const bool contiguous = o.offset == 0 && o.dtype == 0 && o.dims[0] == 1 && o.dims[1] == 1 &&
                            o.dims[2] == rows && o.dims[3] == kHeadDim && o.strides[2] == kHeadDim &&
                            o.strides[3] == 1;
    if (!contiguous) {
        throw CudaFailure{c.name + ": view " + name + " is not the float16 (1, 1, " + std::to_string(rows) +
                          ", 128) tensor this program makes"};
    }
}

// `count` bytes from `offset` of device memory `at`.
std::vector<unsigned char> bytes_at(const unsigned char *at, size_t offset, size_t count) {
    std::vector<unsigned char> host(count);
    check(cudaMemcpy(host.data(), at + offset, count, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
    return host;
}

// Row `row` (kHeadDim float16 elements) of the contiguous tensor at `at`, as floats.
std::vector<float> row_of(const unsigned char *at, uint32_t row) {
    const std::vector<unsigned char> bytes = bytes_at(at, size_t(row) * kHeadDim * 2, kHeadDim * 2);
    std::vector<uint16_t> bits(kHeadDim);
    std::memcpy(bits.data(), bytes.data(), bytes.size());
    return from_half_bits(bits);
}

// Runs the case's dispatches and dumps the sampled rows into `folder` (dump.h) for judge.py (a
// CUDA error, a case file of another problem or a failed dump throws).
void run(const std::string &cases, const std::string &folder, int *rows_dumped) {
    const Case c = load(cases, kCaseName);
    for (const char *name : {"q", "dout", "out", "dq"}) {
        expect_rows(c, name, kSeqlenQ);
    }
    expect_rows(c, "k", kSeqlenK);
    expect_rows(c, "v", kSeqlenK);
    const Output &lse_view = output_named(c, "lse");
    if (lse_view.dtype != 2 || lse_view.elements() != kSeqlenQ || lse_view.strides[2] != 1) {
        throw CudaFailure{c.name + ": view lse is not float32 [seqlen_q]"};
    }
    int index = 0;
    cudaDeviceProp prop;
    check(cudaGetDevice(&index), "cudaGetDevice");
    check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
    size_t free_bytes = 0, total_bytes = 0;
    check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    size_t needed = 0;
    for (const Buffer &b : c.buffers) {
        needed += b.bytes;
    }
    std::printf("device: %s (sm_%d%d), %.1f GB free; needs %.1f GB\n", prop.name, prop.major,
                prop.minor, free_bytes / 1e9, needed / 1e9);
    if (free_bytes < needed) {
        throw CudaFailure{"not enough free device memory for the 2^32-element tensors"};
    }

    // The case's buffers: q, dout (hashed on the device) and k, v (host values) made here, the
    // outputs and workspaces poisoned with NaN.
    std::vector<std::unique_ptr<DeviceArray<unsigned char>>> device;
    std::vector<unsigned char *> addresses;
    for (const Buffer &b : c.buffers) {
        device.push_back(std::make_unique<DeviceArray<unsigned char>>(b.bytes));
        addresses.push_back(device.back()->get());
        if (b.kind == kOutput || b.kind == kWorkspace) {
            device.back()->fill_bytes(0xff);
        } else if (b.kind == kInput) {
            device.back()->upload(b.data);
        }
    }
    const auto address = [&](const char *name) { return addresses[output_named(c, name).buffer]; };
    const std::vector<float> k_host = host_values(kKvElements, kKSeed),
                             v_host = host_values(kKvElements, kVSeed);
    check(cudaMemcpy(address("k"), to_half_bits(k_host).data(), kKvElements * 2, cudaMemcpyHostToDevice), "k");
    check(cudaMemcpy(address("v"), to_half_bits(v_host).data(), kKvElements * 2, cudaMemcpyHostToDevice), "v");
    auto start = std::chrono::steady_clock::now();
    fill_on_device(address("q"), kQElements, kQSeed);
    fill_on_device(address("dout"), kQElements, kDoutSeed);
    check(cudaDeviceSynchronize(), "fill");
    std::printf("filled q and dout, poisoned the outputs and workspaces: %.2f s\n", seconds_since(start));

    std::vector<std::unique_ptr<DeviceArray<unsigned char>>> params;
    for (const Dispatch &d : c.dispatches) {
        if (d.kernel.rfind("flash_attention_backward_dkv_", 0) == 0) {
            continue;  // dK/dV: see the top of this file
        }
        start = std::chrono::steady_clock::now();
        launch(d, addresses, &params);
        check(cudaDeviceSynchronize(), d.kernel.c_str());
        std::printf("%s: %.2f s\n", d.kernel.c_str(), seconds_since(start));
    }

    // The sampled rows make one problem with the same k and v (causal off: rows are independent),
    // dumped for judge.py.
    const std::vector<uint32_t> rows = sampled_rows();
    // The scale as grid.py computes it (float32 of the double 1/sqrt(128)), the plan's.
    const AttentionShape sampled{1, 1, 1, int(rows.size()), int(kSeqlenK), int(kHeadDim), int(kHeadDim),
                                 false, float(1.0 / std::sqrt(double(kHeadDim))), DType::f16};
    AttentionInputs in;
    in.k = k_host;
    in.v = v_host;
    std::vector<float> sampled_out, sampled_dq, sampled_lse;
    for (uint32_t row : rows) {
        append(&in.q, row_of(address("q"), row));
        append(&in.dout, row_of(address("dout"), row));
        append(&sampled_out, row_of(address("out"), row));
        append(&sampled_dq, row_of(address("dq"), row));
        float lse = 0;
        const std::vector<unsigned char> bytes = bytes_at(address("lse"), lse_view.at(row) * 4, 4);
        std::memcpy(&lse, bytes.data(), 4);
        sampled_lse.push_back(lse);
    }
    std::remove((folder + "/cases.txt").c_str());
    if (!Dump(folder).write(kCaseName, sampled, in,
                            {{"out", &sampled_out}, {"lse", &sampled_lse}, {"dq", &sampled_dq}})) {
        throw CudaFailure{"cannot write the dump into " + folder};
    }
    *rows_dumped = int(rows.size());
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s CASES_FOLDER DUMP_FOLDER (needs about 35 GB of device memory)\n",
                     argv[0]);
        return 2;
    }
    int rows = 0;
    int failures = 0;
    try {
        run(argv[1], argv[2], &rows);
    } catch (const CudaFailure &failure) {
        std::printf("FAIL CUDA error: %s\n", failure.message.c_str());
        failures = 1;
    }
    std::printf("large-offsets: %d rows dumped, %d failures (q elements %zu > 2^32)\n", rows,
                failures, kQElements);
    return failures == 0 ? 0 : 1;
}
