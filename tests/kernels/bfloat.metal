// Test kernels for the bfloat type (MSL 3.1): conversions, arithmetic, math, vectors, matrices.
#include <metal_stdlib>
using namespace metal;

// Thread i rounds in[i] to bfloat and widens the result back to float.
kernel void bfloat_round(device const float *in [[buffer(0)]],
                         device bfloat *rounded [[buffer(1)]],
                         device float *widened [[buffer(2)]],
                         uint i [[thread_position_in_grid]]) {
    rounded[i] = bfloat(in[i]);
    widened[i] = float(rounded[i]);
}

// Thread i widens the 256 bfloat encodings i * 256 .. i * 256 + 255 to float.
kernel void bfloat_widen_all(device float *out [[buffer(0)]],
                             uint i [[thread_position_in_grid]]) {
    for (uint j = 0; j < 256; ++j) {
        const uint bits = i * 256 + j;
        out[bits] = float(as_type<bfloat>(ushort(bits)));
    }
}

// Arithmetic, math functions and vectors; the expected values are in BFloatTests.swift.
kernel void bfloat_arithmetic(device float *out [[buffer(0)]]) {
    const bfloat one = bfloat(1.0f);
    out[0] = one + bfloat(0x1p-8f);                 // tie: rounds to even 1
    out[1] = one + bfloat(0x3p-8f);                 // tie: rounds up to 1 + 2^-6
    out[2] = bfloat(3.0f) * 0.1f;                   // a float operand gives float
    out[3] = bfloat(3.0f) / bfloat(10.0f);          // bfloat / bfloat rounds to bfloat
    out[4] = exp(one);
    out[5] = sqrt(bfloat(2.0f));
    out[6] = max(bfloat(-2.0f), bfloat(0.5f));
    out[7] = abs(bfloat(-3.0f));
    const bfloat inf = bfloat(INFINITY);
    const bool classified = isnan(bfloat(NAN)) && isinf(inf) && !isfinite(-inf);
    out[8] = classified ? 1.0f : 0.0f;
    out[9] = half(bfloat(0x1.02p0f)) == half(0x1.02p0f) ? 1.0f : 0.0f;
    bfloat acc = one;
    acc += 0x1p-8f;                                 // compound assignment rounds to bfloat
    out[10] = acc;
    out[11] = -bfloat(0.0f);
    out[12] = bfloat(2.0f) * 3;                     // an integer operand gives bfloat
    out[13] = fma(bfloat(1.5f), bfloat(1.5f), bfloat(0x3p-7f)); // tie to even
    const bfloat4 v = bfloat4(1.0f, 2.0f, 3.0f, 4.0f) * bfloat4(0.5f) + bfloat4(one);
    const float4 w = float4(v) + float4(exp(bfloat4(0.0f)));
    out[14] = w.x;
    out[15] = w.y;
    out[16] = w.z;
    out[17] = w.w;
    const bfloat2 p = bfloat2(bfloat(0x1.fep127f), bfloat(-0x1p-133f));
    out[18] = p.x;
    out[19] = p.y;
    out[20] = float(sizeof(bfloat) + 10 * sizeof(bfloat2) + 100 * sizeof(bfloat4));
}

// d = a * b + c for 8x8 row-major bfloat a, b and float c, d.
kernel void matrix_multiply_bfloat(device const bfloat *a [[buffer(0)]],
                                   device const bfloat *b [[buffer(1)]],
                                   device const float *c [[buffer(2)]],
                                   device float *d [[buffer(3)]]) {
    simdgroup_bfloat8x8 ma, mb;
    simdgroup_float8x8 mc, md;
    simdgroup_load(ma, a);
    simdgroup_load(mb, b);
    simdgroup_load(mc, c);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_store(md, d);
}
