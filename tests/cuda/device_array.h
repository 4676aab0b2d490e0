// CUDA error checking and device memory for the check programs (replay.cu, large_offsets.cu, matrix_check.cu).
#ifndef FA_GPU_DEVICE_ARRAY_H
#define FA_GPU_DEVICE_ARRAY_H

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

// A CUDA failure: the message names the call. After an error like an illegal address the
// context is unusable, so the programs stop at the first one.
struct CudaFailure {
    std::string message;
};

inline void check(cudaError_t status, const char *what) {
    if (status != cudaSuccess) {
        throw CudaFailure{std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                          cudaGetErrorString(status) + ")"};
    }
}

// Device memory for `count` elements of T, freed on scope exit (also when a check throws).
template <typename T>
class DeviceArray {
public:
    explicit DeviceArray(size_t count) : count_(count) {
        check(cudaMalloc(&data_, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc");
    }
    ~DeviceArray() { cudaFree(data_); }
    DeviceArray(const DeviceArray &) = delete;
    DeviceArray &operator=(const DeviceArray &) = delete;

    T *get() const { return data_; }
    void upload(const std::vector<T> &host) {
        check(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy to device");
    }
    // Elements [first, first + count) back to the host.
    std::vector<T> download(size_t first, size_t count) const {
        std::vector<T> host(count);
        check(cudaMemcpy(host.data(), data_ + first, count * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy to host");
        return host;
    }
    std::vector<T> download() const { return download(0, count_); }
    // Sets every byte to `byte`. Outputs get 0xff (NaN in float16 and float32) or 0x7f (NaN in
    // float16, 3.4e38 in float32) before a run: an element a kernel forgets to write fails the
    // rule, and differs between two runs.
    void fill_bytes(unsigned char byte) {
        check(cudaMemset(data_, byte, count_ * sizeof(T)), "cudaMemset");
    }

private:
    T *data_ = nullptr;
    size_t count_;
};

#endif
