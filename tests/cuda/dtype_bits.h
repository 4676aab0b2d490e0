// The element types of the kernels on the host, bit-exact and without CUDA headers, so the host
// code (dump.h, the checks' host sides) needs no CUDA header for them:
// IEEE 754 binary16 (half) and bfloat16 (bfloat: the upper 16 bits of a binary32) <-> binary32.
// Rounding is round-to-nearest-even, as in Metal, the CPU engine, CUDA (__float2half_rn,
// __float2bfloat16_rn) and NumPy / ml_dtypes (astype(float16), astype(bfloat16)).
#ifndef FA_GPU_DTYPE_BITS_H
#define FA_GPU_DTYPE_BITS_H

#include <cstddef>
#include <cstdint>
#include <cstring>

// The float value of binary16 bits `h` (exact: every half is a float).
inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
        std::memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    } else if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Rounds `f` to binary16 bits (nearest, ties to even; overflow -> infinity; NaN stays NaN).
inline uint16_t float_to_half_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    const uint32_t exponent = (x >> 23) & 0xffu;
    const uint32_t mantissa = x & 0x7fffffu;
    if (exponent == 0xff) {
        return uint16_t(sign | 0x7c00u | (mantissa != 0 ? 0x200u : 0u));
    }
    const int half_exponent = int(exponent) - 127 + 15;
    if (half_exponent >= 0x1f) {
        return uint16_t(sign | 0x7c00u);
    }
    if (half_exponent <= 0) {
        // Subnormal result: the 24-bit significand in units of 2^-24 is significand >> shift.
        const int shift = 14 - half_exponent;
        if (shift > 24) {
            return sign;  // below half of the smallest subnormal
        }
        const uint32_t significand = mantissa | 0x800000u;
        uint32_t q = significand >> shift;
        const uint32_t rest = significand & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (q & 1u))) {
            ++q;  // may carry into the smallest normal, whose encoding is the next integer
        }
        return uint16_t(sign | q);
    }
    uint32_t h = (uint32_t(half_exponent) << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) {
        ++h;  // a carry out of the mantissa steps the exponent, up to infinity: still correct
    }
    return uint16_t(sign | h);
}

// Rounds a float to the nearest half and returns it as float: one float16 rounding step.
inline float round_to_half(float f) { return half_bits_to_float(float_to_half_bits(f)); }

// The float value of bfloat16 bits `b` (exact).
inline float bfloat_bits_to_float(uint16_t b) {
    const uint32_t bits = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Rounds `f` to bfloat16 bits (nearest, ties to even; overflow -> infinity; NaN stays a quiet NaN).
inline uint16_t float_to_bfloat_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return uint16_t((x >> 16) | 0x40u);
    }
    // Adding 0x7fff, plus 1 when the kept part is odd, carries into bit 16 exactly when the
    // dropped half is above the midpoint, or at it with an odd kept part.
    x += 0x7fffu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}

inline float round_to_bfloat(float f) { return bfloat_bits_to_float(float_to_bfloat_bits(f)); }

// The kernels' element types (FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F32 in the same order).
enum class DType { f16, bf16, f32 };

// The kernel name suffix: "f16", "bf16", "f32".
inline const char *dtype_name(DType t) {
    return t == DType::f16 ? "f16" : t == DType::bf16 ? "bf16" : "f32";
}

inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// One rounding of `f` to the dtype, as float (float32: f itself).
inline float round_to(DType t, float f) {
    return t == DType::f16 ? round_to_half(f) : t == DType::bf16 ? round_to_bfloat(f) : f;
}

// Stores `f` rounded to the dtype at `dst` (dtype_size(t) bytes), and reads it back.
inline void encode(DType t, float f, void *dst) {
    if (t == DType::f32) {
        std::memcpy(dst, &f, 4);
        return;
    }
    const uint16_t bits = t == DType::f16 ? float_to_half_bits(f) : float_to_bfloat_bits(f);
    std::memcpy(dst, &bits, 2);
}

inline float decode(DType t, const void *src) {
    if (t == DType::f32) {
        float f;
        std::memcpy(&f, src, 4);
        return f;
    }
    uint16_t bits;
    std::memcpy(&bits, src, 2);
    return t == DType::f16 ? half_bits_to_float(bits) : bfloat_bits_to_float(bits);
}

#endif
