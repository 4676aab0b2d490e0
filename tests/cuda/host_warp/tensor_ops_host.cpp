// The CUDA check's tensor-op emulation (metal_tensor_ops.h through metal_cuda.h) run on the host,
// on a simulated warp (cuda_runtime.h beside this file): the cross-check runs of
// tests/kernels/tensor_ops.metal that tensor_ops_check.cu makes on a GPU, written in
// tests/cuda/tensor_ops_engine.txt's format for tensor_ops_compare.py. It shows, without a GPU,
// that the CUDA emulation's logic (gather by shuffles, layouts, bounds, truncation, accumulation
// order) gives the CPU engine's bits; the GPU's own intrinsics and divergence are gpu_check.sh's.
//
// Build (tests/python/kernels/test_cuda_tensor_ops_on_host.py does): clang++ -std=c++17
// -Wno-deprecated-declarations -DFA_HOST_WARP -Itests/cuda/host_warp -Itests/cuda/include -Itests/cuda -I<tensor_ops.metal
// with `device` renamed fa_device> tests/cuda/host_warp/tensor_ops_host.cpp
// Usage: tensor_ops_host OUTPUT.txt
#include "metal_cuda.h"
#include "tensor_ops.metal"
#include "metal_cuda_end.h"

#include <string>
#include <vector>

#include "tensor_ops_inputs.h"

using namespace tensor_ops_inputs;

namespace {

const half *as_half(const std::vector<uint16_t> &v) {
    return reinterpret_cast<const half *>(v.data());
}

// Every cross-check run under `layout`, named as tensor_ops_check.cu names them.
std::vector<Output> run_all(const char *layout) {
    fa_cuda::select_tensor_layout(layout);
    const std::string suffix = std::string(".") + layout;
    const std::vector<uint16_t> a = half_a(), b = half_b(), bt = half_bt();
    const std::vector<float> c = accumulator_c(), fa = float_a(), fb = float_b();
    std::vector<Output> out;
    std::vector<float> d(512, 0.0f), exact(512, 0.0f), relaxed(512, 0.0f);
    fa_host_warp::run_warp([&](unsigned) {
        tensor_matmul_half(as_half(a), as_half(bt), c.data(), d.data());
    });
    out.push_back({"tensor_matmul_half" + suffix, d});
    fa_host_warp::run_warp([&](unsigned) {
        tensor_matmul_float(fa.data(), fb.data(), exact.data(), relaxed.data());
    });
    out.push_back({"tensor_matmul_float" + suffix + ".exact", exact});
    out.push_back({"tensor_matmul_float" + suffix + ".relaxed", relaxed});
    const auto three = [&](const char *name, auto kernel) {
        std::vector<float> result(512, -1.0f);
        fa_host_warp::run_warp(
            [&](unsigned lane) { kernel(as_half(a), as_half(b), result.data(), lane); });
        out.push_back({name + suffix, result});
    };
    three("tensor_layout_by_index", [](const half *x, const half *y, float *z, unsigned) {
        tensor_layout_by_index(x, y, z);
    });
    three("tensor_layout_assumed", [](const half *x, const half *y, float *z, unsigned lane) {
        tensor_layout_assumed(x, y, z, lane);
    });
    three("tensor_bounds", [](const half *x, const half *y, float *z, unsigned) {
        tensor_bounds(x, y, z);
    });
    three("tensor_run_on_tensors", [](const half *x, const half *y, float *z, unsigned) {
        tensor_run_on_tensors(x, y, z);
    });
    return out;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s OUTPUT.txt\n", argv[0]);
        return 2;
    }
    std::vector<Output> all = run_all("m5"), permuted = run_all("permuted"), written;
    all.insert(all.end(), permuted.begin(), permuted.end());
    for (const std::string &name : engine_file_names()) {
        for (const Output &o : all) {
            if (o.name == name) written.push_back(o);
        }
    }
    const char *comment =
        "tests/cuda/host_warp/tensor_ops_host.cpp: the CUDA emulation on a simulated warp";
    if (!write_outputs(argv[1], comment, written)) {
        std::fprintf(stderr, "tensor_ops_host: cannot write %s\n", argv[1]);
        return 1;
    }
    std::printf("tensor_ops_host: %zu outputs written to %s\n", written.size(), argv[1]);
    return 0;
}
