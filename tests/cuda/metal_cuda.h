// CUDA compatibility header: lets the unmodified Metal Shading Language kernels of Shaders/ compile
// as CUDA C++ (nvcc -x cu), so the same source runs on an NVIDIA GPU under compute-sanitizer.
// MSL and CUDA share the execution model (threadgroup = block, threadgroup memory = shared memory,
// SIMD-group = 32-lane warp); only spellings differ, and this header maps them.
//
// One word cannot be a macro: CUDA's __device__ expands to __location__(device), so defining
// `device` would break every CUDA declaration after it. tests/cuda/gpu_check.sh therefore rewrites the
// MSL address-space word `device` to `fa_device` in a copy of the sources (sed 's/\bdevice\b/...')
// before compiling; the files in Shaders/ stay untouched.
//
// MSL kernels receive their built-ins (threadgroup_position_in_grid, thread_index_in_threadgroup,
// simdgroup_index_in_threadgroup, thread_index_in_simdgroup) as parameters, which a CUDA
// __global__ function cannot. So `kernel` becomes __device__ and tests/cuda/kernel_table.h generates
// thin __global__ launchers passing blockIdx, threadIdx.x, threadIdx.x / 32 and threadIdx.x % 32.
// Attributes such as [[buffer(0)]] are unknown to nvcc and ignored (C++11 [dcl.attr.grammar]).
//
// Vector names (float2, half2, ulong2, ...) are macros for metal::vec types while the MSL source is
// compiled: CUDA declares its own ::float2 and ::half2, which `using namespace metal` would make
// ambiguous. SIMD-group functions and simdgroup_matrix are warp shuffles with Apple's lane mapping
// (see the section below); Metal 4's tensor ops (matmul2d, cooperative tensors) are emulated in
// metal_tensor_ops.h, included below.
//
// Include this header first (the .metal file does so through <metal_stdlib>, see include/), and
// include metal_cuda_end.h after the Metal source: the keyword macros below must not leak into
// other code.
#ifndef FA_METAL_CUDA_H
#define FA_METAL_CUDA_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
// MSL's float constants (Metal Shading Language specification, "Math Functions").
#ifndef M_LOG2E_F
#define M_LOG2E_F 1.44269504088896340736f
#endif
#ifndef M_LN2_F
#define M_LN2_F 0.69314718055994530942f
#endif

// MSL scalar names. cuda_fp16.h already declares `typedef __half half`; MSL 3.1's `bfloat` is
// cuda_bf16.h's __nv_bfloat16. Both convert from float with round-to-nearest-even (__float2half,
// __float2bfloat16, like Metal and the CPU engine; matrix_check.cu checks both) and widen to float
// exactly; the kernels do all arithmetic in float. __nv_bfloat16 also converts from integers,
// which MSL's bfloat does not: this build accepts bfloat(0) where Metal would not. The integer
// names match glibc's typedefs.
typedef __nv_bfloat16 bfloat;
static_assert(sizeof(bfloat) == 2, "MSL bfloat is 16-bit");
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8, "MSL ulong is 64-bit");
static_assert(sizeof(long) == 8, "MSL long is 64-bit");

namespace metal {

// Metal's memory-flag argument of barriers. __syncthreads orders shared and global memory for
// the block, a superset of every flag, so the value only has to exist.
enum class mem_flags : unsigned {
    mem_none = 0,
    mem_device = 1,
    mem_threadgroup = 2,
    mem_texture = 4,
};

// Every thread of the threadgroup (block) waits here; CUDA, like MSL, requires all of them to
// reach the same barrier, and compute-sanitizer synccheck reports those that do not.
__device__ __forceinline__ void threadgroup_barrier(mem_flags) { __syncthreads(); }

// Lanes of one SIMD-group (warp) reconverge; Metal's simdgroup_barrier.
__device__ __forceinline__ void simdgroup_barrier(mem_flags) { __syncwarp(); }

// Float math: min, max, exp, exp2, log, log2, fma, sqrt, rsqrt, abs of float (and min/max of
// unsigned int) already exist in CUDA device code under the MSL names, so none are declared here
// (a second overload in namespace metal would make every call ambiguous).

// MSL's fast:: and precise:: variants; both map to CUDA's accurate functions, so results do not
// depend on which one a kernel picks.
namespace fast {
__device__ __forceinline__ float exp(float x) { return expf(x); }
__device__ __forceinline__ float exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float log(float x) { return logf(x); }
__device__ __forceinline__ float log2(float x) { return log2f(x); }
__device__ __forceinline__ float rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
}  // namespace fast
namespace precise {
using fast::exp;
using fast::exp2;
using fast::log;
using fast::log2;
using fast::rsqrt;
using fast::tanh;
}  // namespace precise

// ---- Vectors (MSL specification, section 2): vec<T, 2> and vec<T, 4> with members x, y (z, w),
// element indexing, element-wise arithmetic with vectors and scalars, and explicit element
// conversion (float2(h) for a half2 h). Aligned to their size like Metal's.
namespace detail {
// Blocks template argument deduction, so `v * 2.0` converts the scalar to the element type.
template <class T> struct identity { typedef T type; };
template <class T> using same_t = typename identity<T>::type;
}  // namespace detail

template <class T, int N> struct vec;

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
    T x, y;
    vec() = default;
    __device__ __forceinline__ vec(T s) : x(s), y(s) {}
    __device__ __forceinline__ vec(T x_, T y_) : x(x_), y(y_) {}
    template <class U>
    __device__ __forceinline__ explicit vec(const vec<U, 2> &o) : x(T(o.x)), y(T(o.y)) {}
    __device__ __forceinline__ T &operator[](unsigned i) { return (&x)[i]; }
    __device__ __forceinline__ const T &operator[](unsigned i) const { return (&x)[i]; }
};

template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
    T x, y, z, w;
    vec() = default;
    __device__ __forceinline__ vec(T s) : x(s), y(s), z(s), w(s) {}
    __device__ __forceinline__ vec(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}
    __device__ __forceinline__ vec(const vec<T, 2> &xy, const vec<T, 2> &zw)
        : x(xy.x), y(xy.y), z(zw.x), w(zw.y) {}
    template <class U>
    __device__ __forceinline__ explicit vec(const vec<U, 4> &o)
        : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
    __device__ __forceinline__ T &operator[](unsigned i) { return (&x)[i]; }
    __device__ __forceinline__ const T &operator[](unsigned i) const { return (&x)[i]; }
};

#define FA_VEC_BINARY(OP)                                                                         \
    template <class T, int N>                                                                     \
    __device__ __forceinline__ vec<T, N> operator OP(const vec<T, N> &a, const vec<T, N> &b) {    \
        vec<T, N> r;                                                                              \
        for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                       \
        return r;                                                                                 \
    }                                                                                             \
    template <class T, int N>                                                                     \
    __device__ __forceinline__ vec<T, N> operator OP(const vec<T, N> &a, detail::same_t<T> s) {   \
        return a OP vec<T, N>(s);                                                                 \
    }                                                                                             \
    template <class T, int N>                                                                     \
    __device__ __forceinline__ vec<T, N> operator OP(detail::same_t<T> s, const vec<T, N> &b) {   \
        return vec<T, N>(s) OP b;                                                                 \
    }                                                                                             \
    template <class T, int N>                                                                     \
    __device__ __forceinline__ vec<T, N> &operator OP##=(vec<T, N> &a, const vec<T, N> &b) {      \
        return a = a OP b;                                                                        \
    }                                                                                             \
    template <class T, int N>                                                                     \
    __device__ __forceinline__ vec<T, N> &operator OP##=(vec<T, N> &a, detail::same_t<T> s) {     \
        return a = a OP vec<T, N>(s);                                                             \
    }
FA_VEC_BINARY(+)
FA_VEC_BINARY(-)
FA_VEC_BINARY(*)
FA_VEC_BINARY(/)
#undef FA_VEC_BINARY

template <class T, int N> __device__ __forceinline__ vec<T, N> operator-(const vec<T, N> &a) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
    return r;
}

// The MSL names, spelled fa_<name> here and mapped by macros at the end of this header (see the
// file comment).
#define FA_VEC_ALIASES(T, NAME)                                                                   \
    typedef vec<T, 2> fa_##NAME##2;                                                               \
    typedef vec<T, 4> fa_##NAME##4;
FA_VEC_ALIASES(float, float)
FA_VEC_ALIASES(half, half)
FA_VEC_ALIASES(bfloat, bfloat)
FA_VEC_ALIASES(int, int)
FA_VEC_ALIASES(uint, uint)
FA_VEC_ALIASES(ushort, ushort)
FA_VEC_ALIASES(ulong, ulong)
#undef FA_VEC_ALIASES

// ---- SIMD-group functions: a SIMD-group is a 32-lane warp. Every call uses the full mask, so all
// 32 lanes must reach it together (the kernels' rule too); a call that some lanes skip is undefined
// behaviour in CUDA, the kind of misuse compute-sanitizer synccheck looks for.
namespace simd_detail {
constexpr unsigned kAllLanes = 0xffffffffu;

// The lane index of the calling thread (PTX %laneid), independent of how the block is shaped;
// the simulated warp's lane on the host (host_warp/cuda_runtime.h, FA_HOST_WARP).
__device__ __forceinline__ unsigned lane_id() {
#ifdef FA_HOST_WARP
    return fa_host_warp::lane_index;
#else
    unsigned lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
#endif
}

// Scalars go through one warp shuffle, vectors element by element. Kind: 0 index, 1 xor, 2 down,
// 3 up.
template <int Kind, class T> __device__ __forceinline__ T shuffle(T v, unsigned arg) {
    if (Kind == 0) return __shfl_sync(kAllLanes, v, arg);
    if (Kind == 1) return __shfl_xor_sync(kAllLanes, v, arg);
    if (Kind == 2) return __shfl_down_sync(kAllLanes, v, arg);
    return __shfl_up_sync(kAllLanes, v, arg);
}
template <int Kind, class T, int N>
__device__ __forceinline__ vec<T, N> shuffle(vec<T, N> v, unsigned arg) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = shuffle<Kind>(v[i], arg);
    return r;
}

// Butterfly all-reduce: after each xor step lanes l and l ^ m hold op(a, b) and op(b, a), equal
// for a commutative op, so every lane ends with the same bits.
template <class T, class Op> __device__ __forceinline__ T reduce(T v, Op op) {
    for (unsigned m = 16; m > 0; m /= 2) v = op(v, shuffle<1>(v, m));
    return v;
}
}  // namespace simd_detail

// simd_shuffle(v, i): lane i's value; simd_shuffle_xor(v, m): lane (l ^ m)'s value;
// simd_shuffle_down/up(v, d): lane l + d's (l - d's) value, the own value where that lane does not
// exist (MSL and CUDA agree); simd_broadcast(v, i): lane i's value, i uniform.
template <class T> __device__ __forceinline__ T simd_shuffle(T v, ushort lane) {
    return simd_detail::shuffle<0>(v, lane);
}
template <class T> __device__ __forceinline__ T simd_shuffle_xor(T v, ushort mask) {
    return simd_detail::shuffle<1>(v, mask);
}
template <class T> __device__ __forceinline__ T simd_shuffle_down(T v, ushort delta) {
    return simd_detail::shuffle<2>(v, delta);
}
template <class T> __device__ __forceinline__ T simd_shuffle_up(T v, ushort delta) {
    return simd_detail::shuffle<3>(v, delta);
}
template <class T> __device__ __forceinline__ T simd_broadcast(T v, ushort lane) {
    return simd_detail::shuffle<0>(v, lane);
}
template <class T> __device__ __forceinline__ T simd_sum(T v) {
    return simd_detail::reduce(v, [](T a, T b) { return T(a + b); });
}
template <class T> __device__ __forceinline__ T simd_max(T v) {
    return simd_detail::reduce(v, [](T a, T b) { return max(a, b); });
}
template <class T> __device__ __forceinline__ T simd_min(T v) {
    return simd_detail::reduce(v, [](T a, T b) { return min(a, b); });
}

// ---- SIMD-group matrices (MSL specification 6.7): simdgroup_matrix<T, 8, 8> distributed over the
// 32 lanes with Apple's mapping, the one the CPU engine models (Sources/MSLEngine/msl/
// msl_simdgroup_matrix.h; design.md): with q = lane / 4, lane l holds row (q & 4) + (l / 2) % 4 and
// columns (q & 2) * 2 + (l % 2) * 2 and the one after, as its thread_elements(). In bits:
// l = r2 c2 r1 r0 c1 for row r2 r1 r0 and column c2 c1 c0.
namespace matrix_detail {
__host__ __device__ constexpr unsigned row_of_lane(unsigned l) {
    return ((l / 4) & 4) + (l / 2) % 4;
}
__host__ __device__ constexpr unsigned column_of_lane(unsigned l) {
    return ((l / 4) & 2) * 2 + (l % 2) * 2;
}
// The lane that holds element (row, column): the inverse of the two functions above.
__host__ __device__ constexpr unsigned lane_of(unsigned row, unsigned column) {
    return ((row & 4) << 2) | ((column & 4) << 1) | ((row & 3) << 1) | ((column & 2) >> 1);
}
__host__ __device__ constexpr bool lane_of_inverts_the_mapping() {
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned r = row_of_lane(l), c = column_of_lane(l);
        if (c % 2 != 0 || lane_of(r, c) != l || lane_of(r, c + 1) != l) return false;
    }
    return true;
}
static_assert(lane_of_inverts_the_mapping(), "lane_of must invert Apple's lane mapping");

// Memory index of element e (0 or 1) of lane l's pair, as the engine's element_index: origin is
// (column, row); element (r, c) lives at (origin.y + r) * elements_per_row + origin.x + c, or, with
// transpose, at (origin.x + c) * elements_per_row + origin.y + r.
__device__ __forceinline__ ulong element_index(unsigned l, unsigned e, ulong elements_per_row,
                                               vec<ulong, 2> origin, bool transpose) {
    const ulong r = row_of_lane(l), c = column_of_lane(l) + e;
    return transpose ? (origin.x + c) * elements_per_row + origin.y + r
                     : (origin.y + r) * elements_per_row + origin.x + c;
}
}  // namespace matrix_detail

// An 8x8 matrix of the SIMD-group; each lane's variable holds that lane's two elements.
template <class T, int Cols, int Rows> struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "the CUDA check build supports 8x8 simdgroup matrices");
    vec<T, 2> elements;

    simdgroup_matrix() = default;
    // A diagonal matrix with `diagonal` on the diagonal and zero elsewhere (MSL constructor).
    __device__ __forceinline__ explicit simdgroup_matrix(T diagonal) {
        const unsigned l = simd_detail::lane_id();
        const unsigned r = matrix_detail::row_of_lane(l), c = matrix_detail::column_of_lane(l);
        elements = vec<T, 2>(r == c ? diagonal : T(0), r == c + 1 ? diagonal : T(0));
    }
    // This lane's elements (row, column) and (row, column + 1).
    __device__ __forceinline__ vec<T, 2> &thread_elements() { return elements; }
    __device__ __forceinline__ const vec<T, 2> &thread_elements() const { return elements; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
__device__ __forceinline__ simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.elements = vec<T, 2>(value);
    return m;
}

// Loads and stores are collective like CUDA's wmma::load_matrix_sync: the lanes meet (__syncwarp)
// before each lane moves its own two elements, as the engine's rendezvous does.
template <class T, int Cols, int Rows>
__device__ __forceinline__ void simdgroup_load(simdgroup_matrix<T, Cols, Rows> &d, const T *src,
                                               ulong elements_per_row = Cols,
                                               vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                                               bool transpose_matrix = false) {
    __syncwarp();
    const unsigned l = simd_detail::lane_id();
    for (unsigned e = 0; e < 2; ++e) {
        d.elements[e] = src[matrix_detail::element_index(l, e, elements_per_row, matrix_origin,
                                                         transpose_matrix)];
    }
}

template <class T, int Cols, int Rows>
__device__ __forceinline__ void simdgroup_store(const simdgroup_matrix<T, Cols, Rows> &a, T *dst,
                                                ulong elements_per_row = Cols,
                                                vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                                                bool transpose_matrix = false) {
    __syncwarp();
    const unsigned l = simd_detail::lane_id();
    for (unsigned e = 0; e < 2; ++e) {
        dst[matrix_detail::element_index(l, e, elements_per_row, matrix_origin,
                                         transpose_matrix)] = a.elements[e];
    }
}

// d = a * b + c, the engine's arithmetic: element (i, j) starts from c(i, j) in float and adds
// a(i, k) * b(k, j) for k = 0..7 by fused multiply-add, then rounds once to d's type. Lane l
// fetches row i of a and columns j, j + 1 of b from their owners with warp shuffles. d may alias
// an input.
template <class TD, class TA, class TB, class TC>
__device__ __forceinline__ void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8> &d,
                                                              const simdgroup_matrix<TA, 8, 8> &a,
                                                              const simdgroup_matrix<TB, 8, 8> &b,
                                                              const simdgroup_matrix<TC, 8, 8> &c) {
    using simd_detail::kAllLanes;
    const unsigned l = simd_detail::lane_id();
    const unsigned row = matrix_detail::row_of_lane(l), column = matrix_detail::column_of_lane(l);
    const float a0 = float(a.elements[0]), a1 = float(a.elements[1]);
    const float b0 = float(b.elements[0]), b1 = float(b.elements[1]);
    float acc0 = float(c.elements[0]), acc1 = float(c.elements[1]);
#pragma unroll
    for (unsigned k = 0; k < 8; ++k) {
        // Every lane shuffles the same element index (k % 2), read from the owner of (row, k).
        const float a_k =
            __shfl_sync(kAllLanes, k % 2 == 0 ? a0 : a1, matrix_detail::lane_of(row, k));
        const unsigned b_owner = matrix_detail::lane_of(k, column);
        const float b_k0 = __shfl_sync(kAllLanes, b0, b_owner);
        const float b_k1 = __shfl_sync(kAllLanes, b1, b_owner);
        acc0 = fmaf(a_k, b_k0, acc0);
        acc1 = fmaf(a_k, b_k1, acc1);
    }
    d.elements = vec<TD, 2>(TD(acc0), TD(acc1));
}

// d = a * b.
template <class TD, class TA, class TB>
__device__ __forceinline__ void simdgroup_multiply(simdgroup_matrix<TD, 8, 8> &d,
                                                   const simdgroup_matrix<TA, 8, 8> &a,
                                                   const simdgroup_matrix<TB, 8, 8> &b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

// ---- Function constants (MSL `constant T name [[function_constant(index)]]`, fixed when Metal
// builds a pipeline): the kernels declare each with MSL_FUNCTION_CONSTANT(index, type, name)
// (Shaders/flash_attention_features.h), here a value per launch. The host copies a launch's values
// into function_constants (cudaMemcpyToSymbol, ordered with the launches on the default stream)
// before it launches; a read of a constant the launch did not set, or set with another type,
// traps, so the launch fails as Metal refuses to build such a pipeline. Types: bool and uint.
constexpr unsigned kMaxFunctionConstants = 32;

struct function_constant_values {
    unsigned set;  // bit i: constant i has a value
    unsigned char type[kMaxFunctionConstants];
    unsigned value[kMaxFunctionConstants];  // a bool's is 0 or 1
};

template <class T> struct function_constant_type;
template <> struct function_constant_type<bool> { static constexpr unsigned char value = 0; };
template <> struct function_constant_type<unsigned> { static constexpr unsigned char value = 1; };

static __constant__ function_constant_values function_constants;

template <class T, unsigned Index> struct function_constant {
    static_assert(Index < kMaxFunctionConstants, "function constant index out of range");
    __device__ __forceinline__ operator T() const {
        if (((function_constants.set >> Index) & 1u) == 0 ||
            function_constants.type[Index] != function_constant_type<T>::value) {
            printf("function constant %u is read, but the launch does not set it with this type\n", Index);
            __trap();
        }
        return T(function_constants.value[Index]);
    }
};

// Reinterprets the bits of a value as another type of the same size (MSL as_type).
template <class To, class From>
__device__ __forceinline__ To as_type(const From &from) {
    static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
}

}  // namespace metal

// Metal 4 tensor ops (matmul2d, cooperative tensors), before the keyword macros below.
#include "metal_tensor_ops.h"

// The kernels' full unroll of a loop with a constant trip count (FA_UNROLL) is left to nvcc's own
// measure here: this build checks correctness, not speed, and forcing every such loop open made
// compiling the kernels several times slower on the H200 (docs/verification.md, issue 21).
#define FA_UNROLL
// Likewise the forced inlining of the kernels' per-tile steps (FA_ALWAYS_INLINE) is left to nvcc,
// which inlines __device__ functions by its own measure.
#define FA_ALWAYS_INLINE inline

#define MSL_FUNCTION_CONSTANT(INDEX, TYPE, NAME) \
    static __device__ const metal::function_constant<TYPE, INDEX> NAME{};

// Address spaces and function qualifiers. `constant` and `thread` carry no meaning in CUDA's
// generic address space; `threadgroup` variables are block-shared; kernels become device
// functions called by the launchers. Helper functions in MSL have no qualifier, but in CUDA an
// unqualified function is host-only, hence `inline` -> `__device__ inline`.
#define kernel __device__
#define threadgroup __shared__
#define constant
#define thread
#define fa_device
#define inline __device__ inline
#define float2 fa_float2
#define float4 fa_float4
#define half2 fa_half2
#define half4 fa_half4
#define bfloat2 fa_bfloat2
#define bfloat4 fa_bfloat4
#define int2 fa_int2
#define int4 fa_int4
#define uint2 fa_uint2
#define uint4 fa_uint4
#define ushort2 fa_ushort2
#define ushort4 fa_ushort4
#define ulong2 fa_ulong2
#define ulong4 fa_ulong4

#endif
