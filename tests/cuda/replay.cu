// Replays the library's exported plans on the GPU: the plan-fed CUDA check. Each case file
// (NAME.case, written by tests/cuda/cases.py; format there) holds the case's device buffers (the
// inputs' bytes, in the layout the plan's strides describe), every dispatch of its plans in order
// (forward, backward, and a split-KV forward) as fa_plan_create made them: kernel name,
// threadgroups, threads, function constants, parameter bytes (none where the plan binds a buffer,
// a varlen pass's sequence table, in their place) and the buffer and byte offset at each [[buffer]]
// index; and the output tensors to read back. This program knows nothing of attention: it
// allocates the buffers, poisons the outputs and workspaces, copies each dispatch's parameter
// bytes into device memory, launches each dispatch by name (launch_table.h: every instance of the
// kernel catalogue) and reads the outputs back.
//
// Checks here: no byte of an output buffer outside the output views may change, and a second run
// with other poison bytes must give bit-identical outputs (determinism, no element left
// unwritten). With --dump, each case's outputs go to DIR/NAME.<output> (float32, logical order)
// and its line (NAME.line) to DIR/cases.txt, dump.h's format, for judge.py; the inputs' files are
// cases.py's, in the cases folder (use it as DIR).
//
// Usage: replay CASES_FOLDER [--case SUBSTRING] [--once] [--dump DIR] [--name NAME]
//   --case S  only cases whose name contains S
//   --once    one run per case (no determinism rerun; for the slow sanitizer tools), workspaces
//             not poisoned (for initcheck)
//   --name N  the summary line's name (default cuda-replay)
// Prints one line per case and "NAME: N cases, M failures"; exits 1 on any failure or CUDA error,
// 2 on bad arguments. The tensor-op kernels take FLASH_ATTENTION_TENSOR_LAYOUT's cooperative-tensor
// layout (launch_table_tensor.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "case_file.h"
#include "device_array.h"
#include "dtype_bits.h"

namespace {

float decode_element(uint32_t dtype, const unsigned char *at) {
    return decode(dtype == 0 ? DType::f16 : dtype == 1 ? DType::bf16 : DType::f32, at);
}

struct Result {
    std::vector<std::vector<float>> outputs;
    size_t stray_writes = 0;
};

// One run: fresh buffers (inputs uploaded, outputs and workspaces poisoned), every dispatch in
// order, the outputs read back; stray_writes counts output-buffer bytes outside every output view
// that no longer hold the poison.
Result run(const Case &c, unsigned char poison, bool poison_workspaces) {
    std::vector<std::unique_ptr<DeviceArray<unsigned char>>> device;
    std::vector<unsigned char *> addresses;
    for (const Buffer &b : c.buffers) {
        if (b.kind == kDevice) {
            throw CudaFailure{c.name + ": buffer " + b.name + " is filled on the device by its own program"};
        }
        device.push_back(std::make_unique<DeviceArray<unsigned char>>(b.bytes));
        addresses.push_back(device.back()->get());
        if (b.kind == kInput) {
            device.back()->upload(b.data);
        } else if (b.kind == kOutput || poison_workspaces) {
            device.back()->fill_bytes(poison);
        }
    }
    std::vector<std::unique_ptr<DeviceArray<unsigned char>>> params;
    for (const Dispatch &d : c.dispatches) {
        launch(d, addresses, &params);
    }
    check(cudaDeviceSynchronize(), "the case's dispatches");
    Result result;
    std::vector<std::vector<bool>> covered(c.buffers.size());
    std::vector<std::vector<unsigned char>> images(c.buffers.size());
    for (const Output &o : c.outputs) {
        if (images[o.buffer].empty()) {
            images[o.buffer] = device[o.buffer]->download();
            covered[o.buffer].assign(c.buffers[o.buffer].bytes, false);
        }
        std::vector<float> values(o.elements());
        for (size_t n = 0; n < values.size(); ++n) {
            const size_t byte = o.at(n) * o.element_size();
            values[n] = decode_element(o.dtype, images[o.buffer].data() + byte);
            std::fill_n(covered[o.buffer].begin() + long(byte), o.element_size(), true);
        }
        result.outputs.push_back(std::move(values));
    }
    for (size_t b = 0; b < c.buffers.size(); ++b) {
        for (size_t byte = 0; byte < covered[b].size(); ++byte) {
            result.stray_writes += !covered[b][byte] && images[b][byte] != poison;
        }
    }
    return result;
}

bool same_bits(const std::vector<std::vector<float>> &a, const std::vector<std::vector<float>> &b) {
    if (a.size() != b.size()) {
        return false;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i].size() != b[i].size() ||
            std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
            return false;
        }
    }
    return true;
}

bool dump(const std::string &folder, const std::string &cases, const Case &c, const Result &r) {
    for (size_t i = 0; i < c.outputs.size(); ++i) {
        std::ofstream out(folder + "/" + c.name + "." + c.outputs[i].name, std::ios::binary);
        out.write(reinterpret_cast<const char *>(r.outputs[i].data()), std::streamsize(r.outputs[i].size() * 4));
        if (!out) {
            return false;
        }
    }
    std::ifstream line(cases + "/" + c.name + ".line");
    std::stringstream text;
    text << line.rdbuf();
    std::ofstream list(folder + "/cases.txt", std::ios::app);
    list << text.str();
    return bool(line) && bool(list);
}

int usage() {
    std::fprintf(stderr, "usage: replay CASES_FOLDER [--case SUBSTRING] [--once] [--dump DIR] [--name NAME]\n");
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        return usage();
    }
    const std::string folder = argv[1];
    std::string filter, dump_folder, summary = "cuda-replay";
    bool once = false;
    for (int i = 2; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--once") {
            once = true;
        } else if (arg == "--case" && i + 1 < argc) {
            filter = argv[++i];
        } else if (arg == "--dump" && i + 1 < argc) {
            dump_folder = argv[++i];
        } else if (arg == "--name" && i + 1 < argc) {
            summary = argv[++i];
        } else {
            return usage();
        }
    }
    std::ifstream list(folder + "/cases.list");
    if (!list) {
        std::fprintf(stderr, "replay: no %s/cases.list (write the cases with tests/cuda/cases.py)\n", folder.c_str());
        return 2;
    }
    int cases = 0, failures = 0;
    std::string name;
    while (std::getline(list, name)) {
        if (name.empty() || name.find(filter) == std::string::npos) {
            continue;
        }
        ++cases;
        try {
            const Case c = load(folder, name);
            const Result first = run(c, 0xff, !once);
            std::string problem;
            if (first.stray_writes != 0) {
                problem += " " + std::to_string(first.stray_writes) + " bytes written outside the outputs;";
            }
            if (!once && !same_bits(first.outputs, run(c, 0x7f, true).outputs)) {
                problem += " a second run differs (non-deterministic, or an element left unwritten);";
            }
            if (!dump_folder.empty() && !dump(dump_folder, folder, c, first)) {
                problem += " cannot write the dump;";
            }
            std::printf("%s %s (%zu dispatches)%s\n", problem.empty() ? "ok  " : "FAIL", name.c_str(),
                        c.dispatches.size(), problem.c_str());
            failures += !problem.empty();
        } catch (const CudaFailure &failure) {
            std::printf("FAIL %s: %s\n", name.c_str(), failure.message.c_str());
            std::printf("%s: %d cases, %d failures (stopped at a CUDA error)\n", summary.c_str(), cases,
                        failures + 1);
            return 1;
        }
    }
    std::printf("%s: %d cases, %d failures\n", summary.c_str(), cases, failures);
    return failures == 0 && cases > 0 ? 0 : 1;
}
