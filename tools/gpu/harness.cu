// CUDA accuracy harness for the kernels of Shaders/flash_attention.metal (see kernels.cu).
//
// For every case of the grid (cases.cpp): seeded float16 inputs, forward then backward on the GPU
// (three dispatches: delta, dQ, dK/dV, on the out and lse the forward returned), and for short
// queries (at most FA_SPLIT_MAX_QUERY_ROWS rows) the split-KV forward as well, compared with the
// float64 reference under the accuracy rule with the float16 baseline (reference.cpp,
// accuracy.cpp); rows that see no key must give out 0, lse -inf and dq 0; a second run with
// differently poisoned output buffers must be bit-identical (determinism, and no output element
// left unwritten).
//
// Usage: harness [--small] [--case SUBSTRING] [--once] [--bench] [--help]
//   --small   the 26-case sanitizer grid instead of the full one
//   --case S  only cases whose name contains S (e.g. d40_, causal, h8x2)
//   --once    one GPU run per case (no determinism rerun; for the slow sanitizer tools), the
//             workspaces (delta, split-KV partials) not poisoned (for initcheck)
//   --bench   instead of the grid, time forward and backward on larger shapes (no checks)
// Prints one line per case and "cuda-accuracy: N cases, M mismatches"; exits 1 on any mismatch or
// CUDA error, 2 on bad arguments.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "accuracy.h"
#include "device_array.h"
#include "cases.h"
#include "kernels.h"

namespace {

struct Options {
    bool small = false;
    bool repeat = true;
    bool bench = false;
    std::string filter;
};

// split_out and split_lse: the split-KV forward's results, empty when the case does not take it.
struct GpuResult {
    std::vector<uint16_t> out, dq, dk, dv, split_out;
    std::vector<float> lse, split_lse;

    bool operator==(const GpuResult &o) const {
        return out == o.out && dq == o.dq && dk == o.dk && dv == o.dv &&
               split_out == o.split_out && same_bits(lse, o.lse) &&
               same_bits(split_lse, o.split_lse);
    }
    static bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    }
};

FlashAttentionParams params_of(const AttentionShape &s) {
    FlashAttentionParams p;
    p.batch = fa_u32(s.batch);
    p.num_heads = fa_u32(s.num_heads);
    p.num_kv_heads = fa_u32(s.num_kv_heads);
    p.seqlen_q = fa_u32(s.seqlen_q);
    p.seqlen_k = fa_u32(s.seqlen_k);
    p.head_dim = fa_u32(s.head_dim);
    p.causal = s.causal ? 1u : 0u;
    p.softmax_scale = s.softmax_scale;
    p.kv_chunks = 1;  // the dense kernels' values, as the Metal plan sets them
    p.kv_chunk_keys = p.seqlen_k;
    return p;
}

// Chunks the harness splits the keys into for the split-KV forward: at least two and, on most
// shapes, a shorter last one.
constexpr unsigned kSplitChunks = 3;

// The parameters of the split-KV forward when the Metal plan could take it for this shape (at
// most FA_SPLIT_MAX_QUERY_ROWS query rows) and the keys make at least two chunks; false otherwise.
bool split_params(const FlashAttentionParams &dense, FlashAttentionParams *split) {
    *split = dense;
    return dense.seqlen_q <= FA_SPLIT_MAX_QUERY_ROWS && fa_cuda_split_keys(split, kSplitChunks) &&
           split->kv_chunks >= 2;
}

// Forward, then backward (delta, dQ, dK/dV) on the forward's out and lse, with outputs pre-filled
// with `poison`; then, for a short query (split_params), the split-KV forward into outputs of its
// own. The workspaces (delta, partial_out, partial_lse) get the poison too when `poison_workspace`
// (a kernel reading an element that no kernel wrote then fails the rule); without it, they stay
// as cudaMalloc returns them, so that initcheck reports such a read.
GpuResult run_on_gpu(const AttentionShape &s, const AttentionInputs &in, unsigned char poison,
                     bool poison_workspace) {
    const FlashAttentionParams p = params_of(s);
    DeviceArray<uint16_t> q(s.q_elements()), k(s.kv_elements()), v(s.kv_elements()),
        dout(s.q_elements()), out(s.q_elements()), dq(s.q_elements()), dk(s.kv_elements()),
        dv(s.kv_elements());
    DeviceArray<float> lse(s.lse_elements()), delta(fa_cuda_delta_elements(p));
    q.upload(in.q);
    k.upload(in.k);
    v.upload(in.v);
    dout.upload(in.dout);
    out.fill_bytes(poison);
    lse.fill_bytes(poison);
    dq.fill_bytes(poison);
    dk.fill_bytes(poison);
    dv.fill_bytes(poison);
    if (poison_workspace) {
        delta.fill_bytes(poison);
    }
    check(fa_cuda_forward(p, q.get(), k.get(), v.get(), out.get(), lse.get()), "forward launch");
    check(cudaDeviceSynchronize(), "forward");
    check(fa_cuda_backward(p, dout.get(), q.get(), k.get(), v.get(), out.get(), lse.get(),
                           delta.get(), dq.get(), dk.get(), dv.get()),
          "backward launch");
    check(cudaDeviceSynchronize(), "backward");
    GpuResult result{out.download(), dq.download(), dk.download(), dv.download(), {},
                     lse.download(), {}};
    FlashAttentionParams sp;
    if (split_params(p, &sp)) {
        const size_t partials = s.lse_elements() * sp.kv_chunks;
        DeviceArray<float> partial_out(partials * s.head_dim), partial_lse(partials);
        if (poison_workspace) {
            partial_out.fill_bytes(poison);
            partial_lse.fill_bytes(poison);
        }
        out.fill_bytes(poison);
        lse.fill_bytes(poison);
        check(fa_cuda_forward_split(sp, q.get(), k.get(), v.get(), out.get(), lse.get(),
                                    partial_out.get(), partial_lse.get()),
              "split forward launch");
        check(cudaDeviceSynchronize(), "split forward");
        result.split_out = out.download();
        result.split_lse = lse.download();
    }
    return result;
}

// The closest any case came to the bounds of the rule: the largest ratio error / base error for
// out and for the gradients, and the largest lse relative error, each with its case.
struct Margins {
    double out_ratio = 0.0, grad_ratio = 0.0, lse_error = 0.0;
    std::string out_case, grad_case, lse_case;

    void add(const std::string &name, const Metric &m) {
        const bool is_out = m.name.rfind("out", 0) == 0;  // out and out(split)
        if (m.name.rfind("lse", 0) == 0) {
            keep(m.error, name, &lse_error, &lse_case);
        } else if (m.base_error > 0) {
            keep(m.error / m.base_error, name, is_out ? &out_ratio : &grad_ratio,
                 is_out ? &out_case : &grad_case);
        }
    }
    static void keep(double value, const std::string &name, double *worst, std::string *where) {
        if (value > *worst) {
            *worst = value;
            *where = name;
        }
    }
};

// Runs and judges one case; prints its line, records its margins and returns whether it passed.
bool run_case(const TestCase &c, const Options &options, Margins *margins) {
    const AttentionInputs in = random_inputs(c);
    // --once is the sanitizer run: workspaces stay unwritten for initcheck (see run_on_gpu).
    const GpuResult gpu = run_on_gpu(c.shape, in, 0xff, options.repeat);
    const bool deterministic = !options.repeat || run_on_gpu(c.shape, in, 0x7f, true) == gpu;
    const ReferenceResult ref = reference_attention(c.shape, in);
    const BaseResult base = base_attention(c.shape, in);
    std::vector<Metric> metrics = {
        tensor_metric("out", gpu.out, base.out, ref.out, kOutFactor),
        lse_metric(gpu.lse, ref.lse),
        tensor_metric("dq", gpu.dq, base.dq, ref.dq, kGradFactor),
        tensor_metric("dk", gpu.dk, base.dk, ref.dk, kGradFactor),
        tensor_metric("dv", gpu.dv, base.dv, ref.dv, kGradFactor),
    };
    int empty_rows = 0;
    bool empty_ok = empty_rows_correct(c.shape, gpu.out, gpu.lse, gpu.dq, &empty_rows);
    if (!gpu.split_out.empty()) {
        metrics.push_back(tensor_metric("out(split)", gpu.split_out, base.out, ref.out, kOutFactor));
        metrics.push_back(lse_metric(gpu.split_lse, ref.lse));
        metrics.back().name = "lse(split)";
        int split_empty_rows = 0;
        empty_ok = empty_ok && empty_rows_correct(c.shape, gpu.split_out, gpu.split_lse, gpu.dq,
                                                  &split_empty_rows);
    }
    bool passed = empty_ok && deterministic;
    std::string detail;
    char text[160];
    for (const Metric &m : metrics) {
        passed = passed && m.passed();
        margins->add(c.name, m);
        if (m.name.rfind("lse", 0) == 0) {
            std::snprintf(text, sizeof text, " %s %.1e%s", m.name.c_str(), m.error,
                          m.passed() ? "" : "(FAIL)");
        } else {
            // error / base error, and the ratio the rule bounds (2 for out, 3 for gradients).
            std::snprintf(text, sizeof text, " %s %.2e/%.2e=%.2f%s", m.name.c_str(), m.error,
                          m.base_error, m.base_error > 0 ? m.error / m.base_error : 0.0,
                          m.passed() ? "" : "(FAIL)");
        }
        detail += text;
    }
    std::snprintf(text, sizeof text, " empty %d%s%s", empty_rows, empty_ok ? "" : "(FAIL)",
                  !options.repeat ? "" : deterministic ? " deterministic" : " NONDETERMINISTIC");
    detail += text;
    std::printf("%-4s %-36s%s\n", passed ? "ok" : "FAIL", c.name.c_str(), detail.c_str());
    std::fflush(stdout);
    return passed;
}

// Times forward and backward (median of 5 after a warm-up) on shapes of real models.
void run_bench() {
    struct Shape {
        int batch, heads, seqlen, head_dim;
        bool causal;
    };
    const Shape shapes[] = {{4, 16, 1024, 64, false},  {4, 16, 1024, 64, true},
                            {4, 16, 2048, 128, false}, {4, 16, 2048, 128, true},
                            {2, 8, 2048, 256, true}};
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    for (const Shape &b : shapes) {
        const AttentionShape s{b.batch, b.heads, b.heads, b.seqlen, b.seqlen, b.head_dim,
                               b.causal, 0.125f};
        DeviceArray<uint16_t> q(s.q_elements()), k(s.kv_elements()), v(s.kv_elements()),
            dout(s.q_elements()), out(s.q_elements()), dq(s.q_elements()), dk(s.kv_elements()),
            dv(s.kv_elements());
        const FlashAttentionParams p = params_of(s);
        DeviceArray<float> lse(s.lse_elements()), delta(fa_cuda_delta_elements(p));
        // Bytes 0x20 make every half 0x2020, about 0.008: finite inputs, which is all timing needs.
        for (DeviceArray<uint16_t> *a : {&q, &k, &v, &dout}) {
            a->fill_bytes(0x20);
        }
        float times[2][5];
        for (int rep = -1; rep < 5; ++rep) {
            for (int pass = 0; pass < 2; ++pass) {
                check(cudaEventRecord(start), "cudaEventRecord");
                if (pass == 0) {
                    check(fa_cuda_forward(p, q.get(), k.get(), v.get(), out.get(), lse.get()),
                          "forward launch");
                } else {
                    check(fa_cuda_backward(p, dout.get(), q.get(), k.get(), v.get(), out.get(),
                                           lse.get(), delta.get(), dq.get(), dk.get(), dv.get()),
                          "backward launch");
                }
                check(cudaEventRecord(stop), "cudaEventRecord");
                check(cudaEventSynchronize(stop), "bench");
                if (rep >= 0) {
                    check(cudaEventElapsedTime(&times[pass][rep], start, stop), "elapsed");
                }
            }
        }
        // FlashAttention's convention: forward 4*B*H*N*N*D flops (half when causal),
        // backward 2.5 times the forward.
        const double forward_flops = 4.0 * b.batch * b.heads * double(b.seqlen) * b.seqlen *
                                     b.head_dim / (b.causal ? 2.0 : 1.0);
        double ms[2];
        for (int pass = 0; pass < 2; ++pass) {
            std::sort(times[pass], times[pass] + 5);
            ms[pass] = times[pass][2];
        }
        std::printf("bench d%d b%d h%d n%d %-6s forward %8.2f ms %6.2f TFLOP/s  backward %8.2f ms "
                    "%6.2f TFLOP/s\n",
                    b.head_dim, b.batch, b.heads, b.seqlen, b.causal ? "causal" : "full", ms[0],
                    forward_flops / (ms[0] * 1e9), ms[1], 2.5 * forward_flops / (ms[1] * 1e9));
        std::fflush(stdout);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
}

bool parse(int argc, char **argv, Options *options) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--small") {
            options->small = true;
        } else if (arg == "--once") {
            options->repeat = false;
        } else if (arg == "--bench") {
            options->bench = true;
        } else if (arg == "--case" && i + 1 < argc) {
            options->filter = argv[++i];
        } else if (arg == "--help") {
            std::printf("usage: harness [--small] [--case SUBSTRING] [--once] [--bench]\n"
                        "  --small   the 26-case sanitizer grid instead of the full one\n"
                        "  --case S  only cases whose name contains S\n"
                        "  --once    no determinism rerun, workspaces not poisoned\n"
                        "  --bench   time larger shapes instead of checking\n");
            std::exit(0);
        } else {
            std::fprintf(stderr,
                         "harness: unknown argument '%s'\n"
                         "usage: harness [--small] [--case SUBSTRING] [--once] [--bench] [--help]\n",
                         arg.c_str());
            return false;
        }
    }
    return true;
}

void print_device() {
    int index = 0;
    cudaDeviceProp prop;
    int runtime = 0, driver = 0;
    check(cudaGetDevice(&index), "cudaGetDevice");
    check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
    check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
    check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    std::printf("device: %s (sm_%d%d), CUDA runtime %d.%d, driver %d.%d\n", prop.name, prop.major,
                prop.minor, runtime / 1000, runtime % 1000 / 10, driver / 1000,
                driver % 1000 / 10);
}

}  // namespace

int main(int argc, char **argv) {
    Options options;
    if (!parse(argc, argv, &options)) {
        return 2;
    }
    if (options.bench) {
        try {
            print_device();
            run_bench();
        } catch (const CudaFailure &failure) {
            std::printf("bench: CUDA error: %s\n", failure.message.c_str());
            return 1;
        }
        return 0;
    }
    std::vector<TestCase> cases = options.small ? small_grid() : full_grid();
    cases.erase(std::remove_if(cases.begin(), cases.end(),
                               [&](const TestCase &c) {
                                   return c.name.find(options.filter) == std::string::npos;
                               }),
                cases.end());
    if (cases.empty()) {
        std::fprintf(stderr, "harness: no case name contains '%s'\n", options.filter.c_str());
        return 2;
    }
    int run = 0;
    int mismatches = 0;
    Margins margins;
    try {
        print_device();
        for (const TestCase &c : cases) {
            ++run;
            mismatches += run_case(c, options, &margins) ? 0 : 1;
        }
        std::printf("worst ratio to base: out %.2f (%s; bound 2), gradients %.2f (%s; bound 3); "
                    "worst lse relative error %.1e (%s; bound 1e-4)\n",
                    margins.out_ratio, margins.out_case.c_str(), margins.grad_ratio,
                    margins.grad_case.c_str(), margins.lse_error, margins.lse_case.c_str());
        std::printf("cuda-accuracy: %d cases, %d mismatches\n", run, mismatches);
    } catch (const CudaFailure &failure) {
        std::printf("FAIL %-36s CUDA error: %s\n", run > 0 ? cases[run - 1].name.c_str() : "-",
                    failure.message.c_str());
        std::printf("cuda-accuracy: %d cases, %d mismatches (stopped at a CUDA error)\n", run,
                    mismatches + 1);
        return 1;
    }
    return mismatches == 0 ? 0 : 1;
}
