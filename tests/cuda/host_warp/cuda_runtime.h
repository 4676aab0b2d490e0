// A simulated warp for running the CUDA check's emulation code on the host (no nvcc, no GPU):
// the CUDA spellings metal_cuda.h and metal_tensor_ops.h use, where a "warp" is 32 fibers
// (ucontext) on one thread, run in turn (run_warp), and every warp-synchronous intrinsic is a
// rendezvous of all 32: lane l yields to lane l + 1, and lane 31 back to lane 0, so every lane
// has arrived before any goes on. Deterministic, and as fast on a loaded machine as on an idle one.
// What it cannot show: divergence (every lane reaches every intrinsic, which the rendezvous needs;
// __activemask() is all lanes), and the GPU's own arithmetic (the host's float, fma and _Float16 /
// __bf16 conversions, all IEEE round-to-nearest-even as CUDA's are).
// tests/python/kernels/test_cuda_tensor_ops_on_host.py builds tensor_ops_host.cpp with it
// (-DFA_HOST_WARP); the GPU run stays tests/cuda/gpu_check.sh's.
#ifndef FA_HOST_WARP_CUDA_RUNTIME_H
#define FA_HOST_WARP_CUDA_RUNTIME_H

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#define __device__
#define __host__
#define __global__
#define __shared__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;

namespace fa_host_warp {

inline unsigned lane_index = 0;

// The 32 lanes' fibers, their exchange slots, and the context run_warp returns to.
struct Warp {
    static constexpr size_t stack_bytes = 256 << 10;
    ucontext_t lanes[32], caller;
    std::unique_ptr<char[]> stacks[32];
    uint64_t slots[32] = {};
    void (*body)(void *, unsigned) = nullptr;
    void *closure = nullptr;
};
inline Warp *current = nullptr;

// Every lane has arrived here before any returns (the lanes run in turn, 0 to 31).
inline void rendezvous() {
    const unsigned from = lane_index, to = (from + 1) & 31;
    lane_index = to;
    swapcontext(&current->lanes[from], &current->lanes[to]);
}

template <class T> uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "a simulated shuffle moves at most 64 bits");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// Every lane publishes `v`; returns lane src's (each lane its own src).
template <class T> T exchange(T v, unsigned src) {
    current->slots[lane_index] = bits_of(v);
    rendezvous();
    const T got = from_bits<T>(current->slots[src & 31]);
    rendezvous();
    return got;
}

inline void lane_entry() {
    const unsigned lane = lane_index;
    current->body(current->closure, lane);
    // Lanes end in turn too: the last one returns to run_warp.
    if (lane == 31) {
        setcontext(&current->caller);
    }
    lane_index = lane + 1;
    setcontext(&current->lanes[lane + 1]);
}

// Runs body(lane) on the 32 fibers of one simulated warp (a block of 32 threads).
template <class Body> void run_warp(Body body) {
    Warp warp;
    warp.closure = &body;
    warp.body = [](void *closure, unsigned lane) { (*static_cast<Body *>(closure))(lane); };
    current = &warp;
    for (unsigned l = 0; l < 32; ++l) {
        warp.stacks[l].reset(new char[Warp::stack_bytes]);
        getcontext(&warp.lanes[l]);
        warp.lanes[l].uc_stack.ss_sp = warp.stacks[l].get();
        warp.lanes[l].uc_stack.ss_size = Warp::stack_bytes;
        warp.lanes[l].uc_link = nullptr;
        makecontext(&warp.lanes[l], lane_entry, 0);
    }
    lane_index = 0;
    swapcontext(&warp.caller, &warp.lanes[0]);
    current = nullptr;
}

}  // namespace fa_host_warp

inline unsigned __activemask() { return 0xffffffffu; }
inline void __syncwarp(unsigned = 0xffffffffu) { fa_host_warp::rendezvous(); }
inline void __syncthreads() { fa_host_warp::rendezvous(); }
template <class T> T __shfl_sync(unsigned, T v, int src, int = 32) {
    return fa_host_warp::exchange(v, unsigned(src));
}
template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return fa_host_warp::exchange(v, fa_host_warp::lane_index ^ unsigned(mask));
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    const unsigned l = fa_host_warp::lane_index;
    return fa_host_warp::exchange(v, l + d < 32 ? l + d : l);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
    const unsigned l = fa_host_warp::lane_index;
    return fa_host_warp::exchange(v, l >= d ? l - d : l);
}
// The lanes whose `v` equals this lane's.
template <class T> unsigned __match_any_sync(unsigned, T v) {
    using namespace fa_host_warp;
    current->slots[lane_index] = bits_of(v);
    rendezvous();
    unsigned same = 0;
    for (unsigned l = 0; l < 32; ++l) same |= unsigned(current->slots[l] == bits_of(v)) << l;
    rendezvous();
    return same;
}
template <class T> unsigned __match_all_sync(unsigned mask, T v, int *pred) {
    *pred = __match_any_sync(mask, v) == 0xffffffffu;
    return *pred ? mask : 0;
}
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
[[noreturn]] inline void __trap() { std::abort(); }
inline float __uint_as_float(unsigned u) { return fa_host_warp::from_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return unsigned(fa_host_warp::bits_of(f)); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }

template <class T> cudaError_t cudaMemcpyToSymbol(T &symbol, const void *src, size_t count) {
    std::memcpy(&symbol, src, count);
    return cudaSuccess;
}

#endif
