// CUDA accuracy harness for the kernels of Shaders/flash_attention.metal (see kernels.cu).
//
// For every case of the grid (cases.cpp): seeded inputs in the case's dtype (float16, bfloat16 or
// float32), placed on the device in the case's layout (layout.h: contiguous, bshd, slices of a
// packed qkv tensor, or rows with gaps; the kernels get the strides), forward then backward on the
// GPU on the out and lse the forward returned, in the Metal plan's four dispatches:
//   delta         D = rowsum(dout * out) into a float32 workspace;
//   lse residual  into a second float32 workspace: 0, except in rows whose |lse| >= 256, where
//                 float32 lse = max + log(sum) may have lost part of the log (a whole row masked
//                 with float32's lowest value: lse rounds to the max); a row block holding such a
//                 row runs the forward's scores and online softmax again (no V) and writes
//                 R = (max - lse) + log(sum), what lse lost;
//   dQ, dK/dV     with P = exp((S - lse) - R);
// and for short queries (at most FA_SPLIT_TILED_MAX_QUERY_ROWS rows) the split-KV forward as well
// (the decode kernel where FA_DECODE_SERVES the packed rows, the tiled one otherwise).
// Cases with score modifiers (issue 15: sliding window, softcap, ALiBi, sinks, boolean or additive
// attn_mask, broadcast or full) pass them through params and the optional input buffers (absent
// ones are null); with sinks the backward's dsinks dispatch runs too (last, with the same P).
// Here: no element of an output buffer outside the output tensors' views may change, and a second
// run with differently poisoned output buffers must be bit-identical (determinism, and no output
// element left unwritten). With --dump, each case's inputs and outputs go to a folder (dump.h)
// that tests/cuda/judge.py judges with the Python package's float64 reference and accuracy rule
// (the dtype's baseline; rows that see no key must give out 0, dq 0 and lse -inf, sinks[h] with
// sinks).
//
// Usage: harness [--small] [--case SUBSTRING] [--once] [--dump DIR] [--bench] [--help]
//   --small   the sanitizer grid instead of the full one
//   --case S  only cases whose name contains S (e.g. d40_, bf16_, causal, h8x2, v128, qkv)
//   --once    one GPU run per case (no determinism rerun; for the slow sanitizer tools), the
//             workspaces (delta, lse residual, split-KV partials) not poisoned (for initcheck)
//   --dump D  write the cases' inputs and outputs into folder D (dump.h) for judge.py
//   --bench   instead of the grid, time forward and backward on larger shapes (no checks)
// Prints one line per case and "cuda-harness: N cases, M failures"; exits 1 on any failure or CUDA
// error, 2 on bad arguments.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cases.h"
#include "device_array.h"
#include "dump.h"
#include "kernels.h"
#include "kv_cache_cases.h"
#include "layout.h"
#include "varlen_cases.h"

namespace {

struct Options {
    bool small = false;
    bool repeat = true;
    bool bench = false;
    std::string filter;
    std::string dump;  // folder for judge.py (empty: no dump)
};

// Tensors come back in the logical order of problem.h, as float values of the dtype. split_out
// and split_lse: the split-KV forward's results, empty when the case does not take it.
// stray_writes: elements of output buffers outside every output tensor's view that a kernel
// changed (must be 0).
struct GpuResult {
    std::vector<float> out, dq, dk, dv, split_out;
    std::vector<float> lse, split_lse, dsinks;
    size_t stray_writes = 0;

    bool operator==(const GpuResult &o) const {
        return same_bits(out, o.out) && same_bits(dq, o.dq) && same_bits(dk, o.dk) &&
               same_bits(dv, o.dv) && same_bits(split_out, o.split_out) && same_bits(lse, o.lse) &&
               same_bits(split_lse, o.split_lse) && same_bits(dsinks, o.dsinks);
    }
    // Bitwise (decoding a dtype to float is injective, so equal floats mean equal elements).
    static bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
        return a.size() == b.size() &&
               std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    }
};

int fa_dtype(DType dtype) {
    return dtype == DType::f16 ? FA_DTYPE_F16 : dtype == DType::bf16 ? FA_DTYPE_BF16 : FA_DTYPE_F32;
}

// Chunks the harness splits the keys into for the split-KV forward: at least two and, on most
// shapes, a shorter last one.
constexpr unsigned kSplitChunks = 3;

// The parameters of the split-KV forward when the Metal plan could take it for this shape (at
// most FA_SPLIT_TILED_MAX_QUERY_ROWS query rows: the decode kernel where FA_DECODE_SERVES the
// packed rows, the tiled one otherwise) and the keys make at least two chunks; false otherwise.
bool split_params(const FlashAttentionParams &dense, int dtype, FlashAttentionParams *split) {
    *split = dense;
    return dense.seqlen_q <= FA_SPLIT_TILED_MAX_QUERY_ROWS &&
           fa_cuda_split_keys(split, dtype, kSplitChunks) && split->kv_chunks >= 2;
}

// The device buffers of one case, laid out by layout.h.
class CaseBuffers {
public:
    CaseBuffers(const AttentionShape &shape, const DeviceLayout &layout, const MaskPlacement &mask)
        : shape_(shape), layout_(layout), mask_placement_(mask), size_(dtype_size(shape.dtype)) {
        for (size_t elements : layout.buffer_elements) {
            buffers_.push_back(std::make_unique<DeviceArray<unsigned char>>(elements * size_));
        }
        if (shape.options.mask != MaskKind::none) {
            mask_ = std::make_unique<DeviceArray<unsigned char>>(mask.elements *
                                                                 mask_element_size(shape));
        }
        if (shape.options.alibi) {
            alibi_ = std::make_unique<DeviceArray<float>>(shape.alibi_elements());
        }
        if (shape.options.sinks) {
            sinks_ = std::make_unique<DeviceArray<float>>(size_t(shape.num_heads));
        }
    }

    // The optional inputs (null where the case has none).
    FaCudaScoreInputs score_inputs() const {
        FaCudaScoreInputs x;
        x.mask = mask_ ? mask_->get() : nullptr;
        x.alibi = alibi_ ? alibi_->get() : nullptr;
        x.sinks = sinks_ ? sinks_->get() : nullptr;
        return x;
    }

    // Uploads the input tensors into buffers whose other bytes are 0xff (NaN in every dtype), so
    // that a kernel reading outside a view gets NaN.
    void upload_inputs(const AttentionInputs &in) {
        std::vector<std::vector<unsigned char>> images(buffers_.size());
        const std::pair<Role, const std::vector<float> *> inputs[] = {
            {kQ, &in.q}, {kK, &in.k}, {kV, &in.v}, {kDout, &in.dout}};
        for (const auto &input : inputs) {
            const Placement &where = layout_.tensors[input.first];
            std::vector<unsigned char> &image = images[size_t(where.buffer)];
            if (image.empty()) {
                image.assign(layout_.buffer_elements[size_t(where.buffer)] * size_, 0xff);
            }
            scatter(shape_, where, *input.second, &image);
        }
        for (size_t i = 0; i < images.size(); ++i) {
            if (!images[i].empty()) {
                buffers_[i]->upload(images[i]);
            }
        }
        if (mask_) {
            mask_->upload(mask_image(shape_, mask_placement_, in.mask));
        }
        if (alibi_) {
            alibi_->upload(in.alibi);
        }
        if (sinks_) {
            sinks_->upload(in.sinks);
        }
    }

    // Sets every byte of the buffers holding `roles` to `poison`.
    void poison(std::initializer_list<Role> roles, unsigned char poison) {
        for (Role role : roles) {
            buffers_[size_t(layout_.tensors[role].buffer)]->fill_bytes(poison);
        }
    }

    // The role's tensor in the logical order; adds to *stray the elements of its buffer outside
    // every view that no longer hold `poison` bytes (each buffer checked once per call of
    // `collect`).
    std::vector<float> download(Role role, unsigned char poison, size_t *stray) {
        const int buffer = layout_.tensors[role].buffer;
        const std::vector<unsigned char> image = buffers_[size_t(buffer)]->download();
        if (std::find(checked_.begin(), checked_.end(), buffer) == checked_.end()) {
            checked_.push_back(buffer);
            const std::vector<bool> mask = gaps(shape_, layout_, buffer);
            for (size_t e = 0; e < mask.size(); ++e) {
                if (mask[e] && std::any_of(image.begin() + long(e * size_),
                                           image.begin() + long((e + 1) * size_),
                                           [&](unsigned char byte) { return byte != poison; })) {
                    ++*stray;
                }
            }
        }
        return gather(shape_, layout_.tensors[role], image);
    }

    // Starts a new round of downloads (a buffer written again is checked again).
    void collect() { checked_.clear(); }

    void *operator[](Role role) const {
        const Placement &where = layout_.tensors[role];
        return buffers_[size_t(where.buffer)]->get() + where.offset * size_;
    }

private:
    const AttentionShape &shape_;
    const DeviceLayout &layout_;
    const MaskPlacement &mask_placement_;
    size_t size_;
    std::vector<std::unique_ptr<DeviceArray<unsigned char>>> buffers_;
    std::unique_ptr<DeviceArray<unsigned char>> mask_;
    std::unique_ptr<DeviceArray<float>> alibi_, sinks_;
    std::vector<int> checked_;
};

// Forward, then backward (delta, lse residual, dQ, dK/dV, and dsinks with sinks) on the forward's
// out and lse, with outputs pre-filled with `poison`; then, for a short query (split_params), the
// split-KV forward into the poisoned out again. The workspaces (delta, lse_residual, partial_out,
// partial_lse) get the poison too when
// `poison_workspace` (a kernel reading an element that no kernel wrote then fails the rule);
// without it, they stay as cudaMalloc returns them, so that initcheck reports such a read.
GpuResult run_on_gpu(const TestCase &c, const AttentionInputs &in, unsigned char poison,
                     bool poison_workspace) {
    const AttentionShape &s = c.shape;
    const DeviceLayout layout = place(s, c.layout);
    const MaskPlacement mask = place_mask(s, c.layout);
    const FlashAttentionParams p = params_of(s, layout, mask);
    const int dtype = fa_dtype(s.dtype);
    CaseBuffers t(s, layout, mask);
    const FaCudaScoreInputs extra = t.score_inputs();
    DeviceArray<float> lse(s.lse_elements()), delta(fa_cuda_delta_elements(p)),
        lse_residual(fa_cuda_delta_elements(p));
    DeviceArray<float> dsinks(s.options.sinks ? size_t(s.num_heads) : 0);
    t.upload_inputs(in);
    t.poison({kOut, kDq, kDk, kDv}, poison);
    lse.fill_bytes(poison);
    dsinks.fill_bytes(poison);
    if (poison_workspace) {
        delta.fill_bytes(poison);
        lse_residual.fill_bytes(poison);
    }
    check(fa_cuda_forward(p, dtype, t[kQ], t[kK], t[kV], t[kOut], lse.get(), extra),
          "forward launch");
    check(cudaDeviceSynchronize(), "forward");
    check(fa_cuda_backward(p, dtype, t[kDout], t[kQ], t[kK], t[kV], t[kOut], lse.get(),
                           delta.get(), lse_residual.get(), t[kDq], t[kDk], t[kDv], extra,
                           dsinks.get()),
          "backward launch");
    check(cudaDeviceSynchronize(), "backward");
    GpuResult result;
    result.out = t.download(kOut, poison, &result.stray_writes);
    result.dq = t.download(kDq, poison, &result.stray_writes);
    result.dk = t.download(kDk, poison, &result.stray_writes);
    result.dv = t.download(kDv, poison, &result.stray_writes);
    result.lse = lse.download();
    if (s.options.sinks) {
        result.dsinks = dsinks.download();
    }
    FlashAttentionParams sp;
    if (split_params(p, dtype, &sp)) {
        const size_t partials = s.lse_elements() * sp.kv_chunks;
        DeviceArray<float> partial_out(partials * size_t(s.head_dim_v)), partial_lse(2 * partials);
        if (poison_workspace) {
            partial_out.fill_bytes(poison);
            partial_lse.fill_bytes(poison);
        }
        t.poison({kOut}, poison);
        lse.fill_bytes(poison);
        check(fa_cuda_forward_split(sp, dtype, t[kQ], t[kK], t[kV], t[kOut], lse.get(),
                                    partial_out.get(), partial_lse.get(), extra),
              "split forward launch");
        check(cudaDeviceSynchronize(), "split forward");
        t.collect();
        result.split_out = t.download(kOut, poison, &result.stray_writes);
        result.split_lse = lse.download();
    }
    return result;
}

// Runs one case and checks what needs no reference: determinism and writes outside the views
// (a CUDA error throws); dumps its inputs and outputs for judge.py; prints its line and returns
// whether it passed.
bool run_case(const TestCase &c, const Options &options, const Dump &dump) {
    const AttentionInputs in = random_inputs(c);
    // --once is the sanitizer run: workspaces stay unwritten for initcheck (see run_on_gpu).
    const GpuResult gpu = run_on_gpu(c, in, 0xff, options.repeat);
    GpuResult again;
    if (options.repeat) {
        again = run_on_gpu(c, in, 0x7f, true);
    }
    const bool deterministic = !options.repeat || again == gpu;
    const size_t stray_writes = gpu.stray_writes + again.stray_writes;
    std::vector<std::pair<const char *, const std::vector<float> *>> outputs = {
        {"out", &gpu.out}, {"lse", &gpu.lse}, {"dq", &gpu.dq}, {"dk", &gpu.dk}, {"dv", &gpu.dv}};
    if (c.shape.options.sinks) {
        outputs.push_back({"dsinks", &gpu.dsinks});
    }
    if (!gpu.split_out.empty()) {
        outputs.push_back({"split_out", &gpu.split_out});
        outputs.push_back({"split_lse", &gpu.split_lse});
    }
    const bool dumped = dump.write(c.name, c.shape, in, outputs);
    const bool passed = deterministic && stray_writes == 0 && dumped;
    std::printf("%-4s %-44s%s%s", passed ? "ok" : "FAIL", c.name.c_str(),
                !options.repeat ? "" : deterministic ? " deterministic" : " NONDETERMINISTIC",
                dumped ? "" : " NOT-DUMPED");
    if (stray_writes != 0) {
        std::printf(" WRITES-OUTSIDE-VIEWS (%zu elements)", stray_writes);
    }
    std::printf("\n");
    std::fflush(stdout);
    return passed;
}

// A modifier setting of the bench: its label and options.
struct BenchModifier {
    const char *label;
    ScoreOptions options;
};

// The modifiers' inputs for the bench (deterministic patterns; timing needs no randomness): a
// boolean mask allowing 3 in 4 pairs, an additive one hiding 1 in 5 with -inf, ALiBi's standard
// slopes, sinks of 1.
void bench_modifier_inputs(const AttentionShape &s, AttentionInputs *in) {
    const ScoreOptions &o = s.options;
    in->mask.resize(s.mask_elements());
    for (size_t e = 0; e < in->mask.size(); ++e) {
        const size_t i = e / size_t(s.seqlen_k) % size_t(s.seqlen_q), j = e % size_t(s.seqlen_k);
        const bool hidden = (i * 7 + j * 3) % 5 == 0;
        in->mask[e] = o.mask == MaskKind::boolean ? (hidden ? 0.0f : 1.0f)
                      : hidden ? -std::numeric_limits<float>::infinity()
                               : float(int((i * j) % 7) - 3) * 0.125f;
    }
    for (int b = 0; b < s.alibi_batches() && o.alibi; ++b) {
        for (int h = 0; h < s.num_heads; ++h) {
            in->alibi.push_back(float(std::exp2(-8.0 * (h + 1) / s.num_heads)));
        }
    }
    in->sinks.assign(o.sinks ? size_t(s.num_heads) : 0, 1.0f);
}

// Times forward and backward (median of 5 after a warm-up) on shapes of real models, in every
// dtype, contiguous layout; then each score modifier (issue 15) in float16 on one shape, next to
// the same shape without it.
void run_bench() {
    struct Shape {
        int batch, heads, seqlen, head_dim, head_dim_v;
        bool causal;
        BenchModifier modifier;
    };
    auto opts = [](int left, float softcap, MaskKind mask, bool per_batch, bool alibi, bool sinks) {
        ScoreOptions o;
        o.window_left = left;
        o.softcap = softcap;
        o.mask = mask;
        o.mask_per_batch = per_batch;
        o.alibi = alibi;
        o.sinks = sinks;
        return o;
    };
    const BenchModifier none{"", ScoreOptions{}};
    const Shape shapes[] = {{4, 16, 1024, 64, 64, false, none},   {4, 16, 1024, 64, 64, true, none},
                            {4, 16, 2048, 128, 128, false, none}, {4, 16, 2048, 128, 128, true, none},
                            {2, 8, 2048, 256, 256, true, none},   {2, 16, 2048, 192, 128, true, none}};
    const MaskKind no_mask = MaskKind::none;
    const Shape modified[] = {
        {2, 16, 4096, 128, 128, true, none},
        {2, 16, 4096, 128, 128, true, {"window 512", opts(512, 0, no_mask, false, false, false)}},
        {4, 16, 2048, 128, 128, true, {"softcap 30", opts(-1, 30, no_mask, false, false, false)}},
        {4, 16, 2048, 128, 128, true, {"alibi", opts(-1, 0, no_mask, false, true, false)}},
        {4, 16, 2048, 128, 128, true, {"sinks", opts(-1, 0, no_mask, false, false, true)}},
        {4, 16, 2048, 128, 128, true,
         {"bool mask (1,1,N,N)", opts(-1, 0, MaskKind::boolean, false, false, false)}},
        {4, 16, 2048, 128, 128, true,
         {"bool mask (B,1,N,N)", opts(-1, 0, MaskKind::boolean, true, false, false)}},
        {4, 16, 2048, 128, 128, true,
         {"f16 add mask (B,1,N,N)", opts(-1, 0, MaskKind::additive, true, false, false)}},
        {4, 16, 2048, 128, 128, true,
         {"f32 add mask (B,1,N,N)", opts(-1, 0, MaskKind::additive_f32, true, false, false)}},
        {4, 16, 2048, 128, 128, true,
         {"all (window 512)", opts(512, 30, MaskKind::boolean, true, true, true)}},
    };
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    std::vector<std::pair<DType, Shape>> runs;
    for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
        for (const Shape &b : shapes) {
            runs.push_back({dtype, b});
        }
    }
    for (const Shape &b : modified) {
        runs.push_back({DType::f16, b});
    }
    for (const auto &run : runs) {
        const DType dtype = run.first;
        const Shape &b = run.second;
        {
            const AttentionShape s{b.batch,    b.heads,      b.heads,  b.seqlen, b.seqlen,
                                   b.head_dim, b.head_dim_v, b.causal, 0.125f,   dtype,
                                   b.modifier.options};
            const DeviceLayout layout = place(s, Layout::bhsd);
            const MaskPlacement mask = place_mask(s, Layout::bhsd);
            const FlashAttentionParams p = params_of(s, layout, mask);
            CaseBuffers t(s, layout, mask);
            const FaCudaScoreInputs extra = t.score_inputs();
            DeviceArray<float> lse(s.lse_elements()), delta(fa_cuda_delta_elements(p)),
                lse_residual(fa_cuda_delta_elements(p));
            DeviceArray<float> dsinks(size_t(s.num_heads));
            // Finite inputs in [-0.4, 0.4], which is all timing needs.
            AttentionInputs in;
            for (auto *x : {&in.q, &in.k, &in.v, &in.dout}) {
                const size_t n = x == &in.q ? s.q_elements() : x == &in.k ? s.k_elements()
                                 : x == &in.v ? s.v_elements() : s.out_elements();
                x->resize(n);
                for (size_t i = 0; i < n; ++i) {
                    (*x)[i] = float(int(i * 7919 % 17) - 8) * 0.05f;
                }
            }
            bench_modifier_inputs(s, &in);
            t.upload_inputs(in);
            const int fa = fa_dtype(dtype);
            float times[2][5];
            for (int rep = -1; rep < 5; ++rep) {
                for (int pass = 0; pass < 2; ++pass) {
                    check(cudaEventRecord(start), "cudaEventRecord");
                    if (pass == 0) {
                        check(fa_cuda_forward(p, fa, t[kQ], t[kK], t[kV], t[kOut], lse.get(),
                                              extra),
                              "forward launch");
                    } else {
                        check(fa_cuda_backward(p, fa, t[kDout], t[kQ], t[kK], t[kV], t[kOut],
                                               lse.get(), delta.get(), lse_residual.get(), t[kDq],
                                               t[kDk], t[kDv], extra, dsinks.get()),
                              "backward launch");
                    }
                    check(cudaEventRecord(stop), "cudaEventRecord");
                    check(cudaEventSynchronize(stop), "bench");
                    if (rep >= 0) {
                        check(cudaEventElapsedTime(&times[pass][rep], start, stop), "elapsed");
                    }
                }
            }
            // FlashAttention's convention: forward 2*B*H*N*N*(D + Dv) flops (4*B*H*N*N*D when
            // Dv = D; half when causal), backward 2.5 times the forward.
            const double forward_flops = 2.0 * b.batch * b.heads * double(b.seqlen) * b.seqlen *
                                         (b.head_dim + b.head_dim_v) / (b.causal ? 2.0 : 1.0);
            double ms[2];
            for (int pass = 0; pass < 2; ++pass) {
                std::sort(times[pass], times[pass] + 5);
                ms[pass] = times[pass][2];
            }
            char dims[32];
            std::snprintf(dims, sizeof dims, b.head_dim_v == b.head_dim ? "d%d" : "d%dv%d",
                          b.head_dim, b.head_dim_v);
            std::printf("bench %-4s %-8s b%d h%d n%d %-6s forward %8.2f ms %6.2f TFLOP/s  "
                        "backward %8.2f ms %6.2f TFLOP/s\n",
                        dtype_name(dtype), dims, b.batch, b.heads, b.seqlen,
                        b.causal ? "causal" : "full", ms[0], forward_flops / (ms[0] * 1e9), ms[1],
                        2.5 * forward_flops / (ms[1] * 1e9));
            if (b.modifier.label[0] != '\0') {
                std::printf("      ^ with %s (TFLOP/s counted as without it)\n", b.modifier.label);
            }
            std::fflush(stdout);
        }
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
        } else if (arg == "--dump" && i + 1 < argc) {
            options->dump = argv[++i];
        } else if (arg == "--help") {
            std::printf("usage: harness [--small] [--case SUBSTRING] [--once] [--dump DIR] [--bench]\n"
                        "  --small   the sanitizer grid instead of the full one\n"
                        "  --case S  only cases whose name contains S\n"
                        "  --dump D  write inputs and outputs into folder D for judge.py\n"
                        "  --once    no determinism rerun, workspaces not poisoned\n"
                        "  --bench   time larger shapes instead of checking\n");
            std::exit(0);
        } else {
            std::fprintf(stderr,
                         "harness: unknown argument '%s'\n"
                         "usage: harness [--small] [--case SUBSTRING] [--once] [--dump DIR] [--bench] "
                         "[--help]\n",
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
    const Dump dump(options.dump);
    if (dump.enabled()) {
        std::remove((options.dump + "/cases.txt").c_str());  // a fresh listing
    }
    int run = 0;
    int failures = 0;
    try {
        print_device();
        for (const TestCase &c : cases) {
            ++run;
            failures += run_case(c, options, dump) ? 0 : 1;
        }
        // Variable-length batches: each sequence against the dense kernels (varlen_cases.cu).
        failures += run_varlen_cases(options.filter, &run);
        // KV caches: paged, quantized, a wrong table (kv_cache_cases.cu).
        failures += run_kv_cache_cases(options.filter, dump, &run);
        std::printf("cuda-harness: %d cases, %d failures\n", run, failures);
    } catch (const CudaFailure &failure) {
        const bool in_grid = run > 0 && size_t(run) <= cases.size();
        std::printf("FAIL %-44s CUDA error: %s\n", in_grid ? cases[run - 1].name.c_str() : "-",
                    failure.message.c_str());
        std::printf("cuda-harness: %d cases, %d failures (stopped at a CUDA error)\n", run,
                    failures + 1);
        return 1;
    }
    return failures == 0 ? 0 : 1;
}
