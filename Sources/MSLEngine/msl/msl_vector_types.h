// Metal Shading Language scalar and vector types for C++17: half, bfloat, uint, ushort, ulong, and
// vec<T, N> with the float2..4, half2..4, bfloat2..4, int2..4, uint2..4, ushort2..4 (and more)
// aliases.
//
// Source of the semantics: Metal Shading Language Specification, section 2 (data types). Vectors
// have members x, y, z, w, element indexing, element-wise arithmetic and comparison with vectors
// and scalars, and the MSL alignment (a 3-element vector is sized and aligned like 4 elements).
// Swizzles (v.xy, v.zyx) are not provided: write the constructor instead (float2(v.x, v.y)).
//
// This header holds no address-space macros, so C++ engine code (the kernel registry) can use
// these types; <metal_stdlib> adds the MSL keywords.
#ifndef MSL_VECTOR_TYPES_H
#define MSL_VECTOR_TYPES_H

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wshadow"

namespace metal {

/// IEEE 754 binary16, Metal's `half`. Arithmetic follows the C++ rules for _Float16 (on x86-64
/// without native FP16 clang evaluates in float and rounds on assignment; Apple GPUs round each
/// operation to half), so half-precision results can differ from a GPU in the last bit.
typedef _Float16 half;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
/// 64-bit unsigned like Metal's ulong (unsigned long is 64-bit on the LP64 targets we support).
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8 && sizeof(long) == 8, "MSL long/ulong are 64-bit");

namespace detail {
/// Blocks template argument deduction, so `float2 * 2.0` converts the scalar to the element type.
template <class T> struct identity { typedef T type; };
template <class T> using same_t = typename identity<T>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };

/// The bfloat bits nearest to x, ties to even (IEEE 754 roundTiesToEven): adding 0x7fff plus
/// the lowest kept bit carries into the kept bits exactly when the dropped half is above the
/// tie, or at the tie with an odd kept part; the carry turns values past the largest bfloat into
/// infinity. A NaN keeps its sign and top payload bits and becomes quiet.
constexpr unsigned short bfloat_bits_nearest(float x) {
    const unsigned u = __builtin_bit_cast(unsigned, x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
} // namespace detail

/// bfloat16 ("brain float"), Metal's `bfloat` (MSL 3.1): 1 sign bit, 8 exponent bits (float's
/// range), 7 stored significand bits, stored as the top 16 bits of the float with the same
/// value. To float is exact; from float rounds to nearest, ties to even (subnormals kept, NaN
/// stays NaN and becomes quiet, past the largest finite bfloat 0x1.fep127 gives infinity).
/// Arithmetic of two bfloats evaluates in float and rounds the result to bfloat (like the
/// engine's half); with a float (or half) operand the bfloat converts to float and the result is
/// float, with an integer operand the result is bfloat. Other types convert through float, so an
/// integer above 2^24 is rounded twice.
struct bfloat {
    /// The encoding (engine only: MSL kernels read it with as_type<ushort>).
    unsigned short bits;

    bfloat() = default;
    constexpr bfloat(float x) : bits(detail::bfloat_bits_nearest(x)) {}
    constexpr operator float() const { return __builtin_bit_cast(float, unsigned(bits) << 16); }
    /// The bfloat whose encoding is `b` (no rounding).
    static constexpr bfloat from_bits(unsigned short b) {
        bfloat r{};
        r.bits = b;
        return r;
    }
};
static_assert(sizeof(bfloat) == 2 && alignof(bfloat) == 2, "bfloat is 16-bit like Metal's");

namespace detail {
/// How a scalar of type T meets a bfloat in arithmetic: `kind` 1 floating point (the result is
/// `promoted`), 2 integer (the result is bfloat); 0 (other types) takes no part.
template <class T> struct bfloat_operand { static constexpr int kind = 0; };
template <class P> struct bfloat_floating_operand {
    static constexpr int kind = 1;
    typedef P promoted;
};
template <> struct bfloat_operand<float> : bfloat_floating_operand<float> {};
template <> struct bfloat_operand<_Float16> : bfloat_floating_operand<float> {};
template <> struct bfloat_operand<double> : bfloat_floating_operand<double> {};
template <> struct bfloat_operand<int> { static constexpr int kind = 2; };
template <> struct bfloat_operand<unsigned> { static constexpr int kind = 2; };
template <> struct bfloat_operand<short> { static constexpr int kind = 2; };
template <> struct bfloat_operand<unsigned short> { static constexpr int kind = 2; };
template <> struct bfloat_operand<long> { static constexpr int kind = 2; };
template <> struct bfloat_operand<unsigned long> { static constexpr int kind = 2; };
template <class T> using bfloat_promoted = typename bfloat_operand<T>::promoted;
template <class T, class R>
using if_integer = typename enable_if<bfloat_operand<T>::kind == 2, R>::type;
template <class T, class R>
using if_number = typename enable_if<bfloat_operand<T>::kind != 0, R>::type;
} // namespace detail

#define MSL_BFLOAT_ARITHMETIC(OP)                                                                  \
    constexpr bfloat operator OP(bfloat a, bfloat b) { return bfloat(float(a) OP float(b)); }      \
    template <class T> constexpr detail::bfloat_promoted<T> operator OP(bfloat a, T b) {           \
        return detail::bfloat_promoted<T>(float(a)) OP detail::bfloat_promoted<T>(b);              \
    }                                                                                              \
    template <class T> constexpr detail::bfloat_promoted<T> operator OP(T a, bfloat b) {           \
        return detail::bfloat_promoted<T>(a) OP detail::bfloat_promoted<T>(float(b));              \
    }                                                                                              \
    template <class T> constexpr auto operator OP(bfloat a, T b)->detail::if_integer<T, bfloat> {  \
        return bfloat(float(a) OP float(b));                                                       \
    }                                                                                              \
    template <class T> constexpr auto operator OP(T a, bfloat b)->detail::if_integer<T, bfloat> {  \
        return bfloat(float(a) OP float(b));                                                       \
    }                                                                                              \
    constexpr bfloat &operator OP##=(bfloat &a, bfloat b) { return a = a OP b; }                   \
    template <class T>                                                                             \
    constexpr auto operator OP##=(bfloat &a, T b)->detail::if_number<T, bfloat &> {                \
        return a = bfloat(float(a) OP float(b));                                                   \
    }
MSL_BFLOAT_ARITHMETIC(+)
MSL_BFLOAT_ARITHMETIC(-)
MSL_BFLOAT_ARITHMETIC(*)
MSL_BFLOAT_ARITHMETIC(/)
#undef MSL_BFLOAT_ARITHMETIC

#define MSL_BFLOAT_COMPARE(OP)                                                                     \
    constexpr bool operator OP(bfloat a, bfloat b) { return float(a) OP float(b); }                \
    template <class T> constexpr auto operator OP(bfloat a, T b)->detail::if_number<T, bool> {     \
        return float(a) OP b;                                                                      \
    }                                                                                              \
    template <class T> constexpr auto operator OP(T a, bfloat b)->detail::if_number<T, bool> {     \
        return a OP float(b);                                                                      \
    }
MSL_BFLOAT_COMPARE(==)
MSL_BFLOAT_COMPARE(!=)
MSL_BFLOAT_COMPARE(<)
MSL_BFLOAT_COMPARE(<=)
MSL_BFLOAT_COMPARE(>)
MSL_BFLOAT_COMPARE(>=)
#undef MSL_BFLOAT_COMPARE

/// Negation flips the sign bit (exact, also for zero, infinity and NaN).
constexpr bfloat operator-(bfloat a) { return bfloat::from_bits((unsigned short)(a.bits ^ 0x8000u)); }
constexpr bfloat operator+(bfloat a) { return a; }

template <class T, int N> struct vec;

/// Two-element vector (MSL float2, half2, ...), aligned to its size like Metal's.
template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
    T x, y;
    vec() = default;
    constexpr vec(T s) : x(s), y(s) {}
    constexpr vec(T x_, T y_) : x(x_), y(y_) {}
    template <class U> constexpr explicit vec(const vec<U, 2> &o) : x(T(o.x)), y(T(o.y)) {}
    T &operator[](unsigned i) { return (&x)[i]; }
    const T &operator[](unsigned i) const { return (&x)[i]; }
};

/// Three-element vector; occupies and aligns like four elements, as in Metal (float3 is 16 bytes).
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
    T x, y, z;
    vec() = default;
    constexpr vec(T s) : x(s), y(s), z(s) {}
    constexpr vec(T x_, T y_, T z_) : x(x_), y(y_), z(z_) {}
    constexpr vec(const vec<T, 2> &xy, T z_) : x(xy.x), y(xy.y), z(z_) {}
    constexpr vec(T x_, const vec<T, 2> &yz) : x(x_), y(yz.x), z(yz.y) {}
    template <class U> constexpr explicit vec(const vec<U, 3> &o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
    T &operator[](unsigned i) { return (&x)[i]; }
    const T &operator[](unsigned i) const { return (&x)[i]; }
};

/// Four-element vector, aligned to its size.
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
    T x, y, z, w;
    vec() = default;
    constexpr vec(T s) : x(s), y(s), z(s), w(s) {}
    constexpr vec(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}
    constexpr vec(const vec<T, 2> &xy, const vec<T, 2> &zw) : x(xy.x), y(xy.y), z(zw.x), w(zw.y) {}
    constexpr vec(const vec<T, 2> &xy, T z_, T w_) : x(xy.x), y(xy.y), z(z_), w(w_) {}
    constexpr vec(T x_, const vec<T, 2> &yz, T w_) : x(x_), y(yz.x), z(yz.y), w(w_) {}
    constexpr vec(T x_, T y_, const vec<T, 2> &zw) : x(x_), y(y_), z(zw.x), w(zw.y) {}
    constexpr vec(const vec<T, 3> &xyz, T w_) : x(xyz.x), y(xyz.y), z(xyz.z), w(w_) {}
    constexpr vec(T x_, const vec<T, 3> &yzw) : x(x_), y(yzw.x), z(yzw.y), w(yzw.z) {}
    template <class U>
    constexpr explicit vec(const vec<U, 4> &o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
    T &operator[](unsigned i) { return (&x)[i]; }
    const T &operator[](unsigned i) const { return (&x)[i]; }
};

// Element-wise operators: vector op vector, vector op scalar, scalar op vector.
#define MSL_VEC_BINARY(OP)                                                                         \
    template <class T, int N> vec<T, N> operator OP(const vec<T, N> &a, const vec<T, N> &b) {      \
        vec<T, N> r;                                                                               \
        for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                       \
        return r;                                                                                  \
    }                                                                                              \
    template <class T, int N> vec<T, N> operator OP(const vec<T, N> &a, detail::same_t<T> s) {     \
        return a OP vec<T, N>(s);                                                                  \
    }                                                                                              \
    template <class T, int N> vec<T, N> operator OP(detail::same_t<T> s, const vec<T, N> &b) {     \
        return vec<T, N>(s) OP b;                                                                  \
    }                                                                                              \
    template <class T, int N> vec<T, N> &operator OP##=(vec<T, N> &a, const vec<T, N> &b) {        \
        return a = a OP b;                                                                         \
    }                                                                                              \
    template <class T, int N> vec<T, N> &operator OP##=(vec<T, N> &a, detail::same_t<T> s) {       \
        return a = a OP vec<T, N>(s);                                                              \
    }
MSL_VEC_BINARY(+)
MSL_VEC_BINARY(-)
MSL_VEC_BINARY(*)
MSL_VEC_BINARY(/)
MSL_VEC_BINARY(%)
MSL_VEC_BINARY(&)
MSL_VEC_BINARY(|)
MSL_VEC_BINARY(^)
MSL_VEC_BINARY(<<)
MSL_VEC_BINARY(>>)
#undef MSL_VEC_BINARY

template <class T, int N> vec<T, N> operator-(const vec<T, N> &a) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
    return r;
}
template <class T, int N> vec<T, N> operator+(const vec<T, N> &a) { return a; }
template <class T, int N> vec<T, N> operator~(const vec<T, N> &a) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = T(~a[i]);
    return r;
}

// Element-wise comparisons give bool vectors, as in MSL.
#define MSL_VEC_COMPARE(OP)                                                                        \
    template <class T, int N> vec<bool, N> operator OP(const vec<T, N> &a, const vec<T, N> &b) {   \
        vec<bool, N> r;                                                                            \
        for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                          \
        return r;                                                                                  \
    }                                                                                              \
    template <class T, int N> vec<bool, N> operator OP(const vec<T, N> &a, detail::same_t<T> s) {  \
        return a OP vec<T, N>(s);                                                                  \
    }                                                                                              \
    template <class T, int N> vec<bool, N> operator OP(detail::same_t<T> s, const vec<T, N> &b) {  \
        return vec<T, N>(s) OP b;                                                                  \
    }
MSL_VEC_COMPARE(==)
MSL_VEC_COMPARE(!=)
MSL_VEC_COMPARE(<)
MSL_VEC_COMPARE(<=)
MSL_VEC_COMPARE(>)
MSL_VEC_COMPARE(>=)
#undef MSL_VEC_COMPARE

template <int N> vec<bool, N> operator!(const vec<bool, N> &a) {
    vec<bool, N> r;
    for (int i = 0; i < N; ++i) r[i] = !a[i];
    return r;
}
template <int N> vec<bool, N> operator&&(const vec<bool, N> &a, const vec<bool, N> &b) {
    vec<bool, N> r;
    for (int i = 0; i < N; ++i) r[i] = a[i] && b[i];
    return r;
}
template <int N> vec<bool, N> operator||(const vec<bool, N> &a, const vec<bool, N> &b) {
    vec<bool, N> r;
    for (int i = 0; i < N; ++i) r[i] = a[i] || b[i];
    return r;
}

/// True when every element of a bool vector is true (MSL all()).
inline bool all(bool b) { return b; }
template <int N> bool all(const vec<bool, N> &a) {
    for (int i = 0; i < N; ++i)
        if (!a[i]) return false;
    return true;
}
/// True when some element of a bool vector is true (MSL any()).
inline bool any(bool b) { return b; }
template <int N> bool any(const vec<bool, N> &a) {
    for (int i = 0; i < N; ++i)
        if (a[i]) return true;
    return false;
}

#define MSL_VEC_ALIASES(T, NAME)                                                                   \
    typedef vec<T, 2> NAME##2;                                                                     \
    typedef vec<T, 3> NAME##3;                                                                     \
    typedef vec<T, 4> NAME##4;
MSL_VEC_ALIASES(float, float)
MSL_VEC_ALIASES(half, half)
MSL_VEC_ALIASES(bfloat, bfloat)
MSL_VEC_ALIASES(int, int)
MSL_VEC_ALIASES(uint, uint)
MSL_VEC_ALIASES(short, short)
MSL_VEC_ALIASES(ushort, ushort)
MSL_VEC_ALIASES(char, char)
MSL_VEC_ALIASES(uchar, uchar)
MSL_VEC_ALIASES(long, long)
MSL_VEC_ALIASES(ulong, ulong)
MSL_VEC_ALIASES(bool, bool)
#undef MSL_VEC_ALIASES

} // namespace metal

#pragma clang diagnostic pop

#endif
