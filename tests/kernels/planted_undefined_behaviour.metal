// A deliberate bug for the sanitizer check (tests/run_sanitized.sh): each thread adds `step` to
// its int element, which overflows (undefined behaviour) when the element is INT_MAX.
#include <metal_stdlib>
using namespace metal;

kernel void planted_signed_overflow(device const int *in [[buffer(0)]], device int *out [[buffer(1)]],
                                    constant int &step [[buffer(2)]],
                                    uint tid [[thread_position_in_grid]]) {
    out[tid] = in[tid] + step;
}
