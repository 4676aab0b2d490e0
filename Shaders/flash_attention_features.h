// The score features of a call (flash_attention_params.h, FA_FUNCTION_CONSTANTS: mask type,
// softcap, ALiBi, sinks, dropout), read by the kernels only through the functions below. They are function
// constants, fixed when a kernel's pipeline is built, so every test of them folds away and a kernel
// compiled for "no features" has none of their code. The parameter struct still carries the
// feature's data (softcap's value, the mask strides); `p` stays in the signatures for that reason
// and so that call sites read the same whichever way a host supplies the constants:
// - Metal: `constant T name [[function_constant(index)]]`, each without a default, so a pipeline
//   whose kernel reads one that MTLFunctionConstantValues did not set fails to build (a constant
//   is optional only where is_function_constant_defined() tests it; none is).
// - Hosts that cannot set function constants (PyTorch's compile_shader) define
//   FA_FUNCTION_CONSTANTS_PREDEFINED and every constant as `constant T name = value;` before
//   this source (the library writes that prelude: functionConstantPrelude in Specialization.swift).
// - The CPU engine, the CUDA check build and the address-space check declare a constant through
//   their <metal_stdlib>'s MSL_FUNCTION_CONSTANT(index, type, name): a per-dispatch value that is
//   an error to read when the dispatch did not set it (the clang check: an external constant).
#ifndef FLASH_ATTENTION_FEATURES_H
#define FLASH_ATTENTION_FEATURES_H

#include "flash_attention_params.h"
#include "flash_attention_philox.h"

#if defined(FA_FUNCTION_CONSTANTS_PREDEFINED)
#elif defined(MSL_FUNCTION_CONSTANT)
#define FA_DECLARE_FUNCTION_CONSTANT(INDEX, TYPE, NAME, VALUE) MSL_FUNCTION_CONSTANT(INDEX, TYPE, NAME)
FA_FUNCTION_CONSTANTS(FA_DECLARE_FUNCTION_CONSTANT)
#undef FA_DECLARE_FUNCTION_CONSTANT
#else
#define FA_DECLARE_FUNCTION_CONSTANT(INDEX, TYPE, NAME, VALUE) \
    constant TYPE NAME [[function_constant(INDEX)]];
FA_FUNCTION_CONSTANTS(FA_DECLARE_FUNCTION_CONSTANT)
#undef FA_DECLARE_FUNCTION_CONSTANT
#endif

inline uint mask_type_of(constant FlashAttentionParams &p) { return fa_mask_type; }

// `b ? true : false`, not `b`: clang (21) emits the value of a program-scope `constant bool` with an
// initializer (the PREDEFINED prelude) as a load that LLVM does not fold, and the dead feature code
// would stay; a condition it folds itself.
inline bool softcap_on(constant FlashAttentionParams &p) { return fa_has_softcap ? true : false; }

inline bool alibi_on(constant FlashAttentionParams &p) { return fa_has_alibi ? true : false; }

inline bool sinks_on(constant FlashAttentionParams &p) { return fa_has_sinks ? true : false; }

inline bool dropout_on(constant FlashAttentionParams &p) { return fa_has_dropout ? true : false; }

// The Philox stream of (batch entry b, query head h) as the kernel sees them (FlashAttentionParams).
inline uint dropout_stream(constant FlashAttentionParams &p, uint b, uint h) {
    return p.dropout_stream0 + b * p.dropout_heads + h;
}

// What P at (row, key) of `stream` is multiplied by: 0 where dropped, dropout_scale where kept
// (flash_attention_philox.h).
inline float dropout_factor(constant FlashAttentionParams &p, uint stream, uint row, uint key) {
    const FaPhiloxBlock w = fa_dropout_words(p.dropout_seed, p.dropout_offset, stream, row, key / 4);
    return fa_philox_word(w, key % 4) >= p.dropout_threshold ? p.dropout_scale : 0.0f;
}

// The factors of keys `key` and `key + 1` of one row (a lane's two elements of an 8x8 fragment).
struct DropoutFactors {
    float first;
    float second;
};

// One Philox call where both keys lie in one group of four (key % 4 != 3, so always for an even
// key), a second one otherwise.
inline DropoutFactors dropout_factors(constant FlashAttentionParams &p, uint stream, uint row, uint key) {
    const FaPhiloxBlock w = fa_dropout_words(p.dropout_seed, p.dropout_offset, stream, row, key / 4);
    const uint e = key % 4;
    const uint next = e == 3 ? fa_dropout_words(p.dropout_seed, p.dropout_offset, stream, row, key / 4 + 1).x0
                             : fa_philox_word(w, e + 1);
    DropoutFactors f;
    f.first = fa_philox_word(w, e) >= p.dropout_threshold ? p.dropout_scale : 0.0f;
    f.second = next >= p.dropout_threshold ? p.dropout_scale : 0.0f;
    return f;
}

// Both factors 1: what the gradient kernels multiply by without dropout (folds away).
inline DropoutFactors no_dropout() {
    DropoutFactors f;
    f.first = 1.0f;
    f.second = 1.0f;
    return f;
}

#endif
