// The plan-fed CUDA check's case files (NAME.case, written by tests/cuda/cases.py; the format is in
// its docstring): reading one, and launching its dispatches through the catalogue's launch table
// (launch_table.h). Shared by replay.cu and large_offsets.cu.
#ifndef FA_GPU_CASE_FILE_H
#define FA_GPU_CASE_FILE_H

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "device_array.h"
#include "launch_table.h"

inline constexpr char kMagic[] = "FACASE2\n";

// kDevice: filled on the device by the program that runs the case (large_offsets.cu's inputs).
enum Kind : uint32_t { kInput = 0, kOutput = 1, kWorkspace = 2, kDevice = 3 };

struct Buffer {
    std::string name;
    uint64_t bytes = 0;
    uint32_t kind = kInput;
    std::vector<unsigned char> data;  // inputs only
};

struct Binding {
    uint32_t index, buffer;
    uint64_t offset;
};

struct Dispatch {
    std::string kernel;
    uint32_t groups[3], threads[3];
    std::vector<FaCudaConstant> constants;
    uint32_t params_index;
    std::vector<unsigned char> params;  // empty: a binding at params_index holds the struct
    std::vector<Binding> bindings;
};

struct Output {
    std::string name;
    uint32_t buffer, dtype;
    uint64_t offset;
    uint32_t dims[4];
    uint64_t strides[4];

    size_t elements() const { return size_t(dims[0]) * dims[1] * dims[2] * dims[3]; }
    size_t element_size() const { return dtype == 2 ? 4 : 2; }
    // Element index of logical element n (row-major over dims).
    size_t at(size_t n) const {
        size_t index = offset;
        for (int axis = 3; axis >= 0; --axis) {
            index += (n % dims[axis]) * strides[axis];
            n /= dims[axis];
        }
        return index;
    }
};

struct Case {
    std::string name;
    std::vector<Buffer> buffers;
    std::vector<Dispatch> dispatches;
    std::vector<Output> outputs;
};

class Reader {
public:
    explicit Reader(const std::string &path) : in_(path, std::ios::binary), path_(path) {}
    template <typename T>
    T get() {
        T value{};
        read(&value, sizeof value);
        return value;
    }
    std::string text() {
        std::string value(get<uint32_t>(), '\0');
        read(value.data(), value.size());
        return value;
    }
    void read(void *to, size_t bytes) {
        if (!in_.read(static_cast<char *>(to), std::streamsize(bytes))) {
            throw CudaFailure{"cannot read " + path_ + " (truncated or missing)"};
        }
    }

private:
    std::ifstream in_;
    std::string path_;
};

inline Case load(const std::string &folder, const std::string &name) {
    Reader r(folder + "/" + name + ".case");
    char magic[sizeof kMagic - 1];
    r.read(magic, sizeof magic);
    if (std::memcmp(magic, kMagic, sizeof magic) != 0) {
        throw CudaFailure{name + ".case is not a case file (" + kMagic + ")"};
    }
    Case c;
    c.name = name;
    c.buffers.resize(r.get<uint32_t>());
    for (Buffer &b : c.buffers) {
        b.name = r.text();
        b.bytes = r.get<uint64_t>();
        b.kind = r.get<uint32_t>();
        if (b.kind > kDevice) {
            throw CudaFailure{name + ": buffer " + b.name + " has an unknown kind"};
        }
        if (b.kind == kInput) {
            b.data.resize(b.bytes);
            r.read(b.data.data(), b.bytes);
        }
    }
    c.dispatches.resize(r.get<uint32_t>());
    for (Dispatch &d : c.dispatches) {
        d.kernel = r.text();
        r.read(d.groups, sizeof d.groups);
        r.read(d.threads, sizeof d.threads);
        d.constants.resize(r.get<uint32_t>());
        for (FaCudaConstant &k : d.constants) {
            k.index = r.get<uint32_t>();
            k.type = r.get<uint32_t>();
            k.value = r.get<uint32_t>();
        }
        d.params_index = r.get<uint32_t>();
        d.params.resize(r.get<uint32_t>());
        r.read(d.params.data(), d.params.size());
        if (!d.params.empty() && d.params.size() != sizeof(FlashAttentionParams)) {
            throw CudaFailure{name + ": " + d.kernel + " has " + std::to_string(d.params.size()) +
                              " parameter bytes, FlashAttentionParams " +
                              std::to_string(sizeof(FlashAttentionParams))};
        }
        bool params_bound = false;
        d.bindings.resize(r.get<uint32_t>());
        for (Binding &b : d.bindings) {
            b.index = r.get<uint32_t>();
            b.buffer = r.get<uint32_t>();
            b.offset = r.get<uint64_t>();
            if (b.index >= FA_CUDA_MAX_BUFFERS || b.buffer >= c.buffers.size() ||
                b.offset > c.buffers[b.buffer].bytes) {
                throw CudaFailure{name + ": " + d.kernel + " has a binding outside the case's buffers"};
            }
            params_bound = params_bound || b.index == d.params_index;
        }
        if (d.params_index >= FA_CUDA_MAX_BUFFERS || params_bound == !d.params.empty()) {
            throw CudaFailure{name + ": " + d.kernel + " must have either parameter bytes or a buffer at " +
                              "its params index " + std::to_string(d.params_index)};
        }
    }
    c.outputs.resize(r.get<uint32_t>());
    for (Output &o : c.outputs) {
        o.name = r.text();
        o.buffer = r.get<uint32_t>();
        o.offset = r.get<uint64_t>();
        o.dtype = r.get<uint32_t>();
        r.read(o.dims, sizeof o.dims);
        r.read(o.strides, sizeof o.strides);
        if (o.buffer >= c.buffers.size() || o.dtype > 2 ||
            (o.elements() > 0 && (o.at(o.elements() - 1) + 1) * o.element_size() > c.buffers[o.buffer].bytes)) {
            throw CudaFailure{name + ": output " + o.name + " outside its buffer"};
        }
    }
    return c;
}

// The index of the buffer named `name`, or of the output (view) named `name`; throws naming it.
inline size_t buffer_named(const Case &c, const std::string &name) {
    for (size_t i = 0; i < c.buffers.size(); ++i) {
        if (c.buffers[i].name == name) {
            return i;
        }
    }
    throw CudaFailure{c.name + " has no buffer " + name};
}
inline const Output &output_named(const Case &c, const std::string &name) {
    for (const Output &o : c.outputs) {
        if (o.name == name) {
            return o;
        }
    }
    throw CudaFailure{c.name + " has no output " + name};
}

// Launches dispatch `d` with buffer b at device address buffers[b]: its parameter bytes copied
// into device memory of their own (kept alive in `params` until the dispatches have run; the CUDA
// build binds constant buffers as device pointers), every binding at its buffer plus offset, the
// plan's function constants (launch_table.h). Throws CudaFailure on a launch error.
inline void launch(const Dispatch &d, const std::vector<unsigned char *> &buffers,
                   std::vector<std::unique_ptr<DeviceArray<unsigned char>>> *params) {
    FaCudaBuffers slots;
    for (const Binding &b : d.bindings) {
        slots.at[b.index] = buffers[b.buffer] + b.offset;
    }
    if (!d.params.empty()) {
        params->push_back(std::make_unique<DeviceArray<unsigned char>>(d.params.size()));
        params->back()->upload(d.params);
        slots.at[d.params_index] = params->back()->get();
    }
    check(fa_cuda_launch(d.kernel.c_str(), dim3(d.groups[0], d.groups[1], d.groups[2]),
                         dim3(d.threads[0], d.threads[1], d.threads[2]), slots, d.constants.data(),
                         d.constants.size()),
          d.kernel.c_str());
}

#endif
