// The tensor-op emulation of metal_tensor_ops.h checked on the GPU: the CPU engine's tensor-op
// test kernels (tests/kernels/tensor_ops.metal, compiled as CUDA like the attention kernels)
// against the expectations of tests/swift/MSLEngineTests/TensorOpsTests.swift (the documented
// float32 accumulation order bit for bit, relaxed-precision truncation, loads past extents 0 and
// clipped stores, index functions under the M5 and the permuted layout, the planted M5 layout
// assumption caught by the permuted one), results that do not depend on the layout where the
// code does not, and the three faults (a missing lane, lanes at two run calls with two
// descriptors, an index past get_capacity()), each in a child process because a trap leaves the
// CUDA context unusable; a fault's report is device printf output before the trap.
//
// --write FILE writes the outputs in the format of tests/cuda/tensor_ops_engine.txt, the CPU
// engine's outputs of the same runs (TensorOpsTests.testEngineOutputsAreTheCommittedOnes);
// tests/cuda/tensor_ops_compare.py compares the two bit for bit. The inputs are defined the same
// way in both places (exact formulas, no library functions).
//
// Prints one line per check and "cuda-tensor-ops: N checks, M mismatches"; exits 1 on any
// mismatch or CUDA error.
#include "metal_cuda.h"
#include "tensor_ops.metal"
#include "metal_cuda_end.h"

#include <cuda_runtime.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device_array.h"
#include "tensor_ops_inputs.h"

namespace {

// The MSL kernels take thread_index_in_simdgroup as a parameter; every launch is 32 threads.
__global__ void launch_tensor_matmul_half(const half *a, const half *bt, const float *c, float *d) {
    tensor_matmul_half(a, bt, c, d);
}
__global__ void launch_tensor_matmul_float(const float *a, const float *b, float *exact,
                                           float *relaxed) {
    tensor_matmul_float(a, b, exact, relaxed);
}
__global__ void launch_tensor_layout_by_index(const half *a, const half *b, float *d) {
    tensor_layout_by_index(a, b, d);
}
__global__ void launch_tensor_layout_assumed(const half *a, const half *b, float *d) {
    tensor_layout_assumed(a, b, d, threadIdx.x % 32);
}
__global__ void launch_tensor_bounds(const half *a, const half *b, float *d) {
    tensor_bounds(a, b, d);
}
__global__ void launch_tensor_run_on_tensors(const half *a, const half *b, float *d) {
    tensor_run_on_tensors(a, b, d);
}
__global__ void launch_tensor_missing_lane(const half *a, float *d) {
    tensor_missing_lane(a, d, threadIdx.x % 32);
}
__global__ void launch_tensor_divergent_descriptor(float *d) {
    tensor_divergent_descriptor(d, threadIdx.x % 32);
}
__global__ void launch_tensor_capacity_overrun(float *d) { tensor_capacity_overrun(d); }

using namespace tensor_ops_inputs;

// ---- Running the kernels

struct HalfInputs {
    DeviceArray<uint16_t> a{256}, b{512};
    HalfInputs() {
        a.upload(half_a());
        b.upload(half_b());
    }
    const half *pa() const { return reinterpret_cast<const half *>(a.get()); }
    const half *pb() const { return reinterpret_cast<const half *>(b.get()); }
};

void finish(const char *what) {
    check(cudaGetLastError(), what);
    check(cudaDeviceSynchronize(), what);
}

// Runs every cross-check kernel under `layout` ("m5" or "permuted"); outputs named
// kernel.layout[.buffer].
std::vector<Output> run_all(const char *layout) {
    check(fa_cuda::select_tensor_layout(layout), "select_tensor_layout");
    const std::string suffix = std::string(".") + layout;
    std::vector<Output> out;
    HalfInputs in;
    {
        DeviceArray<uint16_t> dbt(512);
        DeviceArray<float> dc(512), dd(512);
        dbt.upload(half_bt());
        dc.upload(accumulator_c());
        dd.fill_bytes(0);
        launch_tensor_matmul_half<<<1, 32>>>(in.pa(), reinterpret_cast<const half *>(dbt.get()),
                                             dc.get(), dd.get());
        finish("tensor_matmul_half");
        out.push_back({"tensor_matmul_half" + suffix, dd.download()});
    }
    {
        DeviceArray<float> da(256), db(512), exact(512), relaxed(512);
        da.upload(float_a());
        db.upload(float_b());
        exact.fill_bytes(0);
        relaxed.fill_bytes(0);
        launch_tensor_matmul_float<<<1, 32>>>(da.get(), db.get(), exact.get(), relaxed.get());
        finish("tensor_matmul_float");
        out.push_back({"tensor_matmul_float" + suffix + ".exact", exact.download()});
        out.push_back({"tensor_matmul_float" + suffix + ".relaxed", relaxed.download()});
    }
    const std::vector<float> minus_one(512, -1.0f);
    auto three = [&](const char *name, void (*kernel)(const half *, const half *, float *)) {
        DeviceArray<float> dd(512);
        dd.upload(minus_one);
        kernel<<<1, 32>>>(in.pa(), in.pb(), dd.get());
        finish(name);
        out.push_back({name + suffix, dd.download()});
    };
    three("tensor_layout_by_index", launch_tensor_layout_by_index);
    three("tensor_layout_assumed", launch_tensor_layout_assumed);
    three("tensor_bounds", launch_tensor_bounds);
    three("tensor_run_on_tensors", launch_tensor_run_on_tensors);
    return out;
}

const std::vector<float> &output_named(const std::vector<Output> &outputs,
                                       const std::string &name) {
    for (const Output &o : outputs) {
        if (o.name == name) return o.values;
    }
    throw CudaFailure{"no output " + name};
}

// ---- Checks

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

// The first element whose bits differ ("" when none).
std::string bitwise(const std::vector<float> &got, const std::vector<float> &want) {
    for (size_t i = 0; i < want.size(); ++i) {
        if (i >= got.size() || std::memcmp(&got[i], &want[i], 4) != 0) {
            char text[160];
            std::snprintf(text, sizeof text, "element %zu: got %.9g, expected %.9g", i,
                          i < got.size() ? double(got[i]) : NAN, double(want[i]));
            return text;
        }
    }
    return "";
}

void check_results(const std::vector<Output> &m5, const std::vector<Output> &permuted,
                   Report *report) {
    const std::vector<float> a = widen(half_a()), b = widen(half_b());
    const std::vector<float> zero(512, 0.0f), minus_one(512, -1.0f);
    const std::vector<float> product = ordered(a, b, zero, 16, 32);
    report->add("tensor_matmul_half: d = a * bt^T + c in the documented order",
                bitwise(output_named(m5, "tensor_matmul_half.m5"),
                        ordered(a, b, accumulator_c(), 16, 32)));
    const std::vector<float> fa = float_a(), fb = float_b();
    report->add("tensor_matmul_float: float operands exact without relaxed_precision",
                bitwise(output_named(m5, "tensor_matmul_float.m5.exact"),
                        ordered(fa, fb, zero, 16, 32)));
    std::vector<float> ta(fa), tb(fb);
    for (float &x : ta) x = truncated(x);
    for (float &x : tb) x = truncated(x);
    report->add("tensor_matmul_float: relaxed_precision truncates to 10 mantissa bits",
                bitwise(output_named(m5, "tensor_matmul_float.m5.relaxed"),
                        ordered(ta, tb, zero, 16, 32)));
    report->add("tensor_layout_by_index under the M5 layout",
                bitwise(output_named(m5, "tensor_layout_by_index.m5"), product));
    report->add("tensor_layout_by_index under the permuted layout",
                bitwise(output_named(permuted, "tensor_layout_by_index.permuted"), product));
    report->add("tensor_layout_assumed (planted M5 assumption) passes under M5",
                bitwise(output_named(m5, "tensor_layout_assumed.m5"), product));
    const std::vector<float> &assumed = output_named(permuted, "tensor_layout_assumed.permuted");
    int wrong = 0;
    for (int i = 0; i < 512; ++i) wrong += assumed[i] != product[i];
    report->add("tensor_layout_assumed is caught by the permuted layout",
                wrong > 256 ? "" : std::to_string(wrong) + " of 512 elements wrong, want > 256");
    std::vector<float> bounds(minus_one);
    for (int i = 0; i < 10; ++i) {
        for (int j = 0; j < 20; ++j) {
            float acc = 0;
            for (int q = 0; q < 12; ++q) acc = std::fma(a[i * 16 + q], b[q * 32 + j], acc);
            bounds[(i + 6) * 32 + j + 12] = acc;
        }
    }
    report->add("tensor_bounds: loads past extents read 0, stores clip",
                bitwise(output_named(m5, "tensor_bounds.m5"), bounds));
    report->add("tensor_run_on_tensors: tensor operands and destination",
                bitwise(output_named(m5, "tensor_run_on_tensors.m5"),
                        ordered(a, b, minus_one, 16, 32)));
    std::string independent;
    for (const char *name : {"tensor_matmul_half", "tensor_matmul_float.exact",
                             "tensor_matmul_float.relaxed", "tensor_bounds",
                             "tensor_run_on_tensors"}) {
        std::string base(name), rest;
        const size_t dot = base.find('.');
        if (dot != std::string::npos) {
            rest = base.substr(dot);
            base = base.substr(0, dot);
        }
        const std::string failure = bitwise(output_named(permuted, base + ".permuted" + rest),
                                            output_named(m5, base + ".m5" + rest));
        if (!failure.empty() && independent.empty()) {
            independent = std::string(name) + " " + failure;
        }
    }
    report->add("load/store code gives the same bits under both layouts", independent);
}

// ---- Faults, each in a child process (this program with --fault NAME).

int run_fault(const std::string &name) {
    try {
        DeviceArray<float> dd(512);
        HalfInputs in;
        if (name == "missing_lane") {
            launch_tensor_missing_lane<<<1, 32>>>(in.pa(), dd.get());
        } else if (name == "divergent_descriptor") {
            launch_tensor_divergent_descriptor<<<1, 32>>>(dd.get());
        } else if (name == "capacity_overrun") {
            launch_tensor_capacity_overrun<<<1, 32>>>(dd.get());
        } else {
            std::fprintf(stderr, "unknown fault %s\n", name.c_str());
            return 2;
        }
        finish(name.c_str());
    } catch (const CudaFailure &failure) {
        std::printf("fault-run: %s\n", failure.message.c_str());
        return 3;
    }
    std::printf("fault-run: the launch succeeded\n");
    return 0;
}

// Runs `program --fault name` (60 s limit) and checks that it failed with every text of `want`.
void check_fault(const char *program, const char *name, const std::vector<std::string> &want,
                 Report *report) {
    const std::string command =
        std::string("timeout 60 '") + program + "' --fault " + name + " 2>&1";
    FILE *pipe = popen(command.c_str(), "r");
    std::string text;
    if (pipe != nullptr) {
        char buffer[512];
        while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) text += buffer;
    }
    const int status = pipe != nullptr ? pclose(pipe) : -1;
    std::string failure;
    if (status == -1 || !WIFEXITED(status)) {
        failure = "the child did not exit normally";
    } else if (WEXITSTATUS(status) == 124) {
        failure = "the child hung (timeout after 60 s)";
    } else if (WEXITSTATUS(status) != 3) {
        failure = "the child exited with status " + std::to_string(WEXITSTATUS(status)) +
                  " (3: the launch failed, as it must)";
    }
    for (const std::string &w : want) {
        if (failure.empty() && text.find(w) == std::string::npos) {
            failure = "no '" + w + "' in the report";
        }
    }
    if (!failure.empty()) failure += "; output: " + text;
    else std::printf("%s", text.c_str());
    report->add(std::string("fault reported: ") + name, failure);
}

}  // namespace

int main(int argc, char **argv) {
    if (argc == 3 && std::strcmp(argv[1], "--fault") == 0) return run_fault(argv[2]);
    const char *write_path = nullptr;
    if (argc == 3 && std::strcmp(argv[1], "--write") == 0) {
        write_path = argv[2];
    } else if (argc != 1) {
        std::fprintf(stderr, "usage: %s [--write FILE]\n", argv[0]);
        return 2;
    }
    Report report;
    try {
        const std::vector<Output> m5 = run_all("m5"), permuted = run_all("permuted");
        check_results(m5, permuted, &report);
        if (write_path != nullptr) {
            std::vector<Output> all(m5), written;
            all.insert(all.end(), permuted.begin(), permuted.end());
            for (const std::string &name : engine_file_names()) {
                written.push_back({name, output_named(all, name)});
            }
            const char *comment = "tests/cuda/tensor_ops_check.cu --write: the CUDA build's outputs";
            if (!write_outputs(write_path, comment, written)) {
                throw CudaFailure{std::string("cannot write ") + write_path};
            }
        }
    } catch (const CudaFailure &failure) {
        std::printf("FAIL CUDA error: %s\n", failure.message.c_str());
        ++report.mismatches;
    }
    check_fault(argv[0], "missing_lane",
                {"matmul2d::run at", "tensor_ops.metal:", "31 of the SIMD-group's 32 lanes",
                 "lane 31 did not"},
                &report);
    // Each half of the warp sees only itself; the half that traps first may end the launch before
    // the other prints, so one site is named for sure (the engine names both).
    check_fault(argv[0], "divergent_descriptor",
                {"matmul2d::run at", "tensor_ops.metal:", "16 of the SIMD-group's 32 lanes"},
                &report);
    check_fault(argv[0], "capacity_overrun", {"past get_capacity() 16"}, &report);
    std::printf("cuda-tensor-ops: %d checks, %d mismatches\n", report.checks, report.mismatches);
    return report.mismatches == 0 ? 0 : 1;
}
