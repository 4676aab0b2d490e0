// Metal Shading Language synchronisation and SIMD-group functions for the CPU engine (MSL
// specification 6.9 "Synchronization and SIMD-group functions"): threadgroup_barrier,
// simdgroup_barrier, simd_shuffle, simd_shuffle_down/up/xor, simd_broadcast(_first), simd_sum,
// simd_product, simd_max, simd_min, simd_and/or/xor, simd_prefix_*_sum, simd_all, simd_any,
// simd_is_first.
//
// Every function takes two hidden trailing default arguments, the caller's line and file
// (__builtin_LINE/__builtin_FILE), so the engine can check that all threads meet at the same
// call site and name it in errors.
//
// Lane rules (32 lanes; "active" = lanes of the SIMD-group that exist and have not returned):
// - simd_shuffle(v, i): lane i's value; i must be 0..31 and active, else an error (MSL: undefined).
// - simd_shuffle_down(v, d): lane l + d's value; when l + d > 31 the lane keeps its own value (MSL).
//   Reading an inactive lane (past the end of a partial SIMD-group, or returned) is an error.
// - simd_shuffle_up(v, d): lane l - d's value; lanes l < d keep their own value. Same rule.
// - simd_shuffle_xor(v, m): lane l ^ m's value; l ^ m must be 0..31 and active.
// - simd_broadcast(v, i): lane i's value to every lane; i must be the same in every lane.
// - reductions and prefix sums run over the active lanes in lane order (deterministic; a GPU may
//   associate floating-point sums differently).
#ifndef MSL_SIMD_H
#define MSL_SIMD_H

#include "msl_math.h"
#include "msl_runtime.hpp"

namespace metal {

/// Memory scopes a barrier orders (MSL mem_flags). The engine runs the threads of a threadgroup
/// on one OS thread, so every barrier orders all memory.
enum class mem_flags : unsigned {
    mem_none = 0,
    mem_device = 1,
    mem_threadgroup = 2,
    mem_texture = 4,
    mem_threadgroup_imageblock = 8,
    mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
    return mem_flags(unsigned(a) | unsigned(b));
}

/// Waits until every thread of the threadgroup reaches this barrier (same call site).
inline void threadgroup_barrier(mem_flags, unsigned line = __builtin_LINE(),
                                const char *file = __builtin_FILE()) {
    msl_engine::runtime::threadgroup_barrier(file, line);
}

namespace simd_detail {

using msl_engine::simd_fault;
using msl_engine::simd_fault_kind;
using msl_engine::simd_slot;

inline bool active(uint32_t mask, uint32_t lane) { return lane < 32 && ((mask >> lane) & 1u) != 0; }

inline bool fail(simd_fault *fault, simd_fault_kind kind, uint32_t lane, uint32_t source) {
    fault->kind = kind;
    fault->lane = lane;
    fault->source = source;
    return false;
}

inline bool no_data(const simd_slot *, uint32_t, simd_fault *) { return true; }

// Source lane of lane l, or 32 + l for "keep your own value".
enum class shuffle_kind { index, down, up, xor_mask };

template <class T, shuffle_kind K>
bool shuffle(const simd_slot *s, uint32_t mask, simd_fault *fault) {
    for (uint32_t l = 0; l < 32; ++l) {
        if (!active(mask, l)) continue;
        const uint32_t a = s[l].arg;
        uint32_t src = 0;
        bool own = false;
        switch (K) {
        case shuffle_kind::index: src = a; break;
        case shuffle_kind::down: own = a > 31 - l; src = l + a; break;
        case shuffle_kind::up: own = a > l; src = l - a; break;
        case shuffle_kind::xor_mask: src = l ^ a; break;
        }
        if (own) {
            *static_cast<T *>(s[l].out) = *static_cast<const T *>(s[l].in);
            continue;
        }
        if (src > 31) return fail(fault, simd_fault_kind::invalid_lane, l, a);
        if (!active(mask, src)) return fail(fault, simd_fault_kind::inactive_source, l, src);
        *static_cast<T *>(s[l].out) = *static_cast<const T *>(s[src].in);
    }
    return true;
}

template <class T> bool broadcast(const simd_slot *s, uint32_t mask, simd_fault *fault) {
    const uint32_t first = uint32_t(__builtin_ctz(mask));
    const uint32_t src = s[first].arg;
    for (uint32_t l = 0; l < 32; ++l) {
        if (active(mask, l) && s[l].arg != src)
            return fail(fault, simd_fault_kind::nonuniform_lane, l, s[l].arg);
    }
    if (src > 31) return fail(fault, simd_fault_kind::invalid_lane, first, src);
    if (!active(mask, src)) return fail(fault, simd_fault_kind::inactive_source, first, src);
    for (uint32_t l = 0; l < 32; ++l) {
        if (active(mask, l)) *static_cast<T *>(s[l].out) = *static_cast<const T *>(s[src].in);
    }
    return true;
}

template <class T> bool broadcast_first(const simd_slot *s, uint32_t mask, simd_fault *) {
    const uint32_t first = uint32_t(__builtin_ctz(mask));
    for (uint32_t l = 0; l < 32; ++l) {
        if (active(mask, l)) *static_cast<T *>(s[l].out) = *static_cast<const T *>(s[first].in);
    }
    return true;
}

struct op_sum { template <class T> static T apply(T a, T b) { return a + b; } };
struct op_product { template <class T> static T apply(T a, T b) { return a * b; } };
struct op_max { template <class T> static T apply(T a, T b) { return metal::max(a, b); } };
struct op_min { template <class T> static T apply(T a, T b) { return metal::min(a, b); } };
struct op_and { template <class T> static T apply(T a, T b) { return a & b; } };
struct op_or { template <class T> static T apply(T a, T b) { return a | b; } };
struct op_xor { template <class T> static T apply(T a, T b) { return a ^ b; } };
struct op_all { static bool apply(bool a, bool b) { return a && b; } };
struct op_any { static bool apply(bool a, bool b) { return a || b; } };

// Reduction over the active lanes in lane order; every lane gets the result.
template <class T, class Op> bool reduce(const simd_slot *s, uint32_t mask, simd_fault *) {
    T acc = T();
    bool first = true;
    for (uint32_t l = 0; l < 32; ++l) {
        if (!active(mask, l)) continue;
        const T v = *static_cast<const T *>(s[l].in);
        acc = first ? v : T(Op::apply(acc, v));
        first = false;
    }
    for (uint32_t l = 0; l < 32; ++l) {
        if (active(mask, l)) *static_cast<T *>(s[l].out) = acc;
    }
    return true;
}

// Prefix sums over the active lanes in lane order.
template <class T, bool Inclusive> bool prefix_sum(const simd_slot *s, uint32_t mask, simd_fault *) {
    T acc = T(0);
    for (uint32_t l = 0; l < 32; ++l) {
        if (!active(mask, l)) continue;
        const T v = *static_cast<const T *>(s[l].in);
        if (Inclusive) acc = T(acc + v);
        *static_cast<T *>(s[l].out) = acc;
        if (!Inclusive) acc = T(acc + v);
    }
    return true;
}

inline bool is_first(const simd_slot *s, uint32_t mask, simd_fault *) {
    const uint32_t first = uint32_t(__builtin_ctz(mask));
    for (uint32_t l = 0; l < 32; ++l) {
        if (active(mask, l)) *static_cast<bool *>(s[l].out) = l == first;
    }
    return true;
}

template <class T>
T collective(const char *name, msl_engine::simd_combine_fn combine, const T &data, uint32_t arg,
             const char *file, unsigned line) {
    T result = data;
    msl_engine::runtime::simd_collective(name, combine, &data, &result, arg, file, line);
    return result;
}

} // namespace simd_detail

#define MSL_SIMD_SITE unsigned line = __builtin_LINE(), const char *file = __builtin_FILE()

/// Waits until every active lane of the SIMD-group reaches this call (MSL simdgroup_barrier).
inline void simdgroup_barrier(mem_flags, MSL_SIMD_SITE) {
    msl_engine::runtime::simd_collective("simdgroup_barrier", simd_detail::no_data, nullptr,
                                         nullptr, 0, file, line);
}

template <class T> T simd_shuffle(T data, ushort simd_lane_id, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_shuffle",
                                   simd_detail::shuffle<T, simd_detail::shuffle_kind::index>, data,
                                   simd_lane_id, file, line);
}
template <class T> T simd_shuffle_down(T data, ushort delta, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_shuffle_down",
                                   simd_detail::shuffle<T, simd_detail::shuffle_kind::down>, data,
                                   delta, file, line);
}
template <class T> T simd_shuffle_up(T data, ushort delta, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_shuffle_up",
                                   simd_detail::shuffle<T, simd_detail::shuffle_kind::up>, data,
                                   delta, file, line);
}
template <class T> T simd_shuffle_xor(T data, ushort mask, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_shuffle_xor",
                                   simd_detail::shuffle<T, simd_detail::shuffle_kind::xor_mask>,
                                   data, mask, file, line);
}
template <class T> T simd_broadcast(T data, ushort broadcast_lane_id, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_broadcast", simd_detail::broadcast<T>, data,
                                   broadcast_lane_id, file, line);
}
template <class T> T simd_broadcast_first(T data, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_broadcast_first", simd_detail::broadcast_first<T>, data, 0,
                                   file, line);
}

#define MSL_SIMD_REDUCTION(NAME, OP)                                                               \
    template <class T> T NAME(T data, MSL_SIMD_SITE) {                                             \
        return simd_detail::collective(#NAME, simd_detail::reduce<T, simd_detail::OP>, data, 0,    \
                                       file, line);                                                \
    }
MSL_SIMD_REDUCTION(simd_sum, op_sum)
MSL_SIMD_REDUCTION(simd_product, op_product)
MSL_SIMD_REDUCTION(simd_max, op_max)
MSL_SIMD_REDUCTION(simd_min, op_min)
MSL_SIMD_REDUCTION(simd_and, op_and)
MSL_SIMD_REDUCTION(simd_or, op_or)
MSL_SIMD_REDUCTION(simd_xor, op_xor)
#undef MSL_SIMD_REDUCTION

template <class T> T simd_prefix_inclusive_sum(T data, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_prefix_inclusive_sum",
                                   simd_detail::prefix_sum<T, true>, data, 0, file, line);
}
template <class T> T simd_prefix_exclusive_sum(T data, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_prefix_exclusive_sum",
                                   simd_detail::prefix_sum<T, false>, data, 0, file, line);
}
/// True in every active lane when the condition holds in all of them (MSL simd_all).
inline bool simd_all(bool expr, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_all", simd_detail::reduce<bool, simd_detail::op_all>,
                                   expr, 0, file, line);
}
/// True in every active lane when the condition holds in one of them (MSL simd_any).
inline bool simd_any(bool expr, MSL_SIMD_SITE) {
    return simd_detail::collective("simd_any", simd_detail::reduce<bool, simd_detail::op_any>,
                                   expr, 0, file, line);
}
/// True in the lowest active lane only (MSL simd_is_first).
inline bool simd_is_first(MSL_SIMD_SITE) {
    return simd_detail::collective("simd_is_first", simd_detail::is_first, false, 0, file, line);
}

} // namespace metal

#endif
