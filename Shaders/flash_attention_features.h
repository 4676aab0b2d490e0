// The score features of a call (flash_attention_params.h, FA_FUNCTION_CONSTANTS: mask type,
// softcap, ALiBi, sinks), read by the kernels only through these four functions. They are function
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

#endif
