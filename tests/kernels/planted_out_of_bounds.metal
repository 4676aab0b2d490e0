// A deliberate bug for the sanitizer check (tests/run_sanitized.sh): every thread reads the
// element `count` places after its own, so the last threads read past the end of `in`.
#include <metal_stdlib>
using namespace metal;

kernel void planted_out_of_bounds_read(device const float *in [[buffer(0)]],
                                       device float *out [[buffer(1)]],
                                       constant uint &count [[buffer(2)]],
                                       uint tid [[thread_position_in_grid]]) {
    out[tid] = in[tid + count];
}
