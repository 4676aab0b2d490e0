// Metal Shading Language math functions for C++17 (MSL specification section 6.5 "Math
// Functions", 6.2 "Common Functions", 6.4 "Integer Functions"): float, half and bfloat scalars,
// vectors element-wise, the fast:: and precise:: forms, clamp, select, as_type, and the MSL
// constants.
//
// No <cmath>: the functions use clang builtins, so `exp(x)` in a kernel finds only metal::exp and
// never competes with ::exp(double) through `using namespace metal`. half and bfloat functions
// evaluate in float and round the result to half or bfloat. fast:: and precise:: forms compute
// the precise result (the CPU has no approximate variants); kernels must stay correct under
// either on a GPU.
#ifndef MSL_MATH_H
#define MSL_MATH_H

#include "msl_vector_types.h"

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_huge_valf())
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 0x1.fffffep127f
#endif
#ifndef FLT_MAX
#define FLT_MAX 0x1.fffffep127f
#endif
#ifndef FLT_MIN
#define FLT_MIN 0x1p-126f
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 0x1p-23f
#endif
#ifndef HALF_MAX
#define HALF_MAX (metal::half(65504.0f))
#endif
#ifndef M_LOG2E_F
#define M_LOG2E_F 1.44269504088896340736f
#endif
#ifndef M_LN2_F
#define M_LN2_F 0.69314718055994530942f
#endif

namespace metal {

// One-argument float functions: float, half and bfloat scalars, and vectors of them, element-wise.
#define MSL_UNARY(NAME, EXPR)                                                                      \
    inline float NAME(float x) { return EXPR; }                                                    \
    inline half NAME(half h) {                                                                     \
        const float x = float(h);                                                                  \
        return half(EXPR);                                                                         \
    }                                                                                              \
    inline bfloat NAME(bfloat b) {                                                                 \
        const float x = float(b);                                                                  \
        return bfloat(EXPR);                                                                       \
    }                                                                                              \
    template <class T, int N> vec<T, N> NAME(const vec<T, N> &v) {                                 \
        vec<T, N> r;                                                                               \
        for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                                            \
        return r;                                                                                  \
    }
MSL_UNARY(exp, __builtin_expf(x))
MSL_UNARY(exp2, __builtin_exp2f(x))
MSL_UNARY(exp10, __builtin_powf(10.0f, x))
MSL_UNARY(log, __builtin_logf(x))
MSL_UNARY(log2, __builtin_log2f(x))
MSL_UNARY(log10, __builtin_log10f(x))
MSL_UNARY(sqrt, __builtin_sqrtf(x))
MSL_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
MSL_UNARY(fabs, __builtin_fabsf(x))
MSL_UNARY(floor, __builtin_floorf(x))
MSL_UNARY(ceil, __builtin_ceilf(x))
MSL_UNARY(trunc, __builtin_truncf(x))
MSL_UNARY(round, __builtin_roundf(x))
MSL_UNARY(rint, __builtin_rintf(x))
MSL_UNARY(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MSL_UNARY(sin, __builtin_sinf(x))
MSL_UNARY(cos, __builtin_cosf(x))
MSL_UNARY(tan, __builtin_tanf(x))
MSL_UNARY(tanh, __builtin_tanhf(x))
#undef MSL_UNARY

// Two-argument float functions. max/min follow fmax/fmin: a NaN argument yields the other one.
#define MSL_BINARY(NAME, EXPR)                                                                     \
    inline float NAME(float x, float y) { return EXPR; }                                           \
    inline half NAME(half hx, half hy) {                                                           \
        const float x = float(hx), y = float(hy);                                                  \
        return half(EXPR);                                                                         \
    }                                                                                              \
    inline bfloat NAME(bfloat bx, bfloat by) {                                                     \
        const float x = float(bx), y = float(by);                                                  \
        return bfloat(EXPR);                                                                       \
    }                                                                                              \
    template <class T, int N> vec<T, N> NAME(const vec<T, N> &a, const vec<T, N> &b) {             \
        vec<T, N> r;                                                                               \
        for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i]);                                      \
        return r;                                                                                  \
    }                                                                                              \
    template <class T, int N> vec<T, N> NAME(const vec<T, N> &a, detail::same_t<T> s) {            \
        return NAME(a, vec<T, N>(s));                                                              \
    }
MSL_BINARY(max, __builtin_fmaxf(x, y))
MSL_BINARY(min, __builtin_fminf(x, y))
MSL_BINARY(fmax, __builtin_fmaxf(x, y))
MSL_BINARY(fmin, __builtin_fminf(x, y))
MSL_BINARY(pow, __builtin_powf(x, y))
MSL_BINARY(powr, __builtin_powf(x, y))
MSL_BINARY(fmod, __builtin_fmodf(x, y))
MSL_BINARY(copysign, __builtin_copysignf(x, y))
MSL_BINARY(step, x <= y ? 1.0f : 0.0f)
#undef MSL_BINARY

/// Fused multiply-add a * b + c with one rounding (MSL fma).
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) {
    return bfloat(__builtin_fmaf(float(a), float(b), float(c)));
}
template <class T, int N> vec<T, N> fma(const vec<T, N> &a, const vec<T, N> &b, const vec<T, N> &c) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
    return r;
}

/// Linear blend x + (y - x) * a (MSL mix).
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline half mix(half x, half y, half a) { return half(mix(float(x), float(y), float(a))); }
inline bfloat mix(bfloat x, bfloat y, bfloat a) { return bfloat(mix(float(x), float(y), float(a))); }

// Integer max, min, abs (MSL integer functions).
#define MSL_INTEGER(T)                                                                             \
    inline T max(T a, T b) { return a > b ? a : b; }                                               \
    inline T min(T a, T b) { return a < b ? a : b; }
MSL_INTEGER(char)
MSL_INTEGER(uchar)
MSL_INTEGER(short)
MSL_INTEGER(ushort)
MSL_INTEGER(int)
MSL_INTEGER(uint)
MSL_INTEGER(long)
MSL_INTEGER(ulong)
#undef MSL_INTEGER

/// Absolute value: fabs for floating point, |x| for integers.
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half(__builtin_fabsf(float(x))); }
inline bfloat abs(bfloat x) { return bfloat::from_bits((unsigned short)(x.bits & 0x7fffu)); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline short abs(short x) { return short(x < 0 ? -x : x); }
inline long abs(long x) { return x < 0 ? -x : x; }
template <class T, int N> vec<T, N> abs(const vec<T, N> &v) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
    return r;
}

/// min(max(x, lo), hi) for any scalar or vector type with max/min (MSL clamp).
template <class T> T clamp(T x, detail::same_t<T> lo, detail::same_t<T> hi) {
    return min(max(x, lo), hi);
}
/// x clamped to [0, 1] (MSL saturate).
template <class T> T saturate(T x) { return clamp(x, T(0), T(1)); }

/// c ? b : a, element-wise for vectors (MSL select).
template <class T> T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> vec<T, N> select(const vec<T, N> &a, const vec<T, N> &b, const vec<bool, N> &c) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
    return r;
}

/// Classification (MSL relational functions).
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isinf(bfloat x) { return __builtin_isinf(float(x)); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isnan(bfloat x) { return __builtin_isnan(float(x)); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool isfinite(bfloat x) { return __builtin_isfinite(float(x)); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(bfloat x) { return (x.bits & 0x8000u) != 0; }

/// Reinterprets the bits of a value as another type of the same size (MSL as_type).
template <class To, class From> To as_type(const From &from) {
    static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
    To to;
    __builtin_memcpy(&to, &from, sizeof(To));
    return to;
}

/// Dot product of two vectors (MSL dot).
template <class T, int N> T dot(const vec<T, N> &a, const vec<T, N> &b) {
    T s = T(0);
    for (int i = 0; i < N; ++i) s += a[i] * b[i];
    return s;
}

// The fast:: and precise:: namespaces name the same functions (see the header comment).
#define MSL_MATH_NAMES(NS)                                                                         \
    namespace NS {                                                                                 \
    using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2;  \
    using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::fabs; using metal::abs;\
    using metal::floor; using metal::ceil; using metal::trunc; using metal::round;                 \
    using metal::rint; using metal::fract; using metal::sin; using metal::cos; using metal::tan;   \
    using metal::tanh; using metal::max; using metal::min; using metal::fmax; using metal::fmin;   \
    using metal::pow; using metal::powr; using metal::fmod; using metal::fma; using metal::clamp;  \
    using metal::divide;                                                                           \
    }
/// x / y (MSL divide; its fast:: form may be approximate on a GPU).
inline float divide(float x, float y) { return x / y; }
MSL_MATH_NAMES(fast)
MSL_MATH_NAMES(precise)
#undef MSL_MATH_NAMES

} // namespace metal

#endif
