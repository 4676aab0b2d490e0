// MSL function constants for the CPU engine (MSL specification, "Function Constants"):
// `constant T name [[function_constant(index)]]` is a program-scope value fixed when Metal builds a
// pipeline. C++ cannot give a namespace-scope constant a value per dispatch, so kernels declare one
// with MSL_FUNCTION_CONSTANT(index, type, name) instead (on Metal that macro does not exist and the
// source uses the MSL declaration: see Shaders/flash_attention_features.h). The declared object
// converts to its type by asking the engine for the running dispatch's value
// (msl_engine_dispatch_specialized) on a worker's first read, and from the worker's cache of the
// dispatch's constants after that; a read the dispatch did not provide is an error, never a
// default. Types: bool and uint (the engine models no others).
#ifndef MSL_FUNCTION_CONSTANT_H
#define MSL_FUNCTION_CONSTANT_H

#include "msl_engine.h"
#include "msl_runtime.hpp"
#include "msl_vector_types.h"

namespace metal {

template <typename T> struct function_constant_type;
template <> struct function_constant_type<bool> {
    static constexpr uint32_t value = MSL_ENGINE_CONSTANT_BOOL;
};
template <> struct function_constant_type<uint> {
    static constexpr uint32_t value = MSL_ENGINE_CONSTANT_UINT;
};

/// Function constant `Index` of type T: reads the running dispatch's value, from the worker's
/// cache once this worker has read it (msl_runtime.hpp, constant_cache).
template <typename T, uint32_t Index> struct function_constant {
    const char *name;
    operator T() const {
        constexpr uint32_t type = function_constant_type<T>::value;
        if constexpr (Index < msl_engine::runtime::cached_constants) {
            const msl_engine::runtime::constant_cache &cache = msl_engine_constant_cache;
            if ((cache.known[type] >> Index) & 1u) return T(cache.value[Index]);
        }
        return T(msl_engine::runtime::function_constant(Index, type, name));
    }
};

} // namespace metal

#define MSL_FUNCTION_CONSTANT(INDEX, TYPE, NAME)                                                   \
    static const ::metal::function_constant<TYPE, INDEX> NAME{#NAME};

#endif
