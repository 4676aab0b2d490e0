/*
 * Purpose-written MSL test kernels (the .metal files of tests/kernels) that pin the CPU engine's semantics:
 * barriers, threadgroup memory, SIMD-group functions, SIMD-group matrices, limits, divergence.
 */
#ifndef MSL_ENGINE_TEST_KERNELS_H
#define MSL_ENGINE_TEST_KERNELS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Registers the test kernels with the engine (idempotent, thread-safe). */
void msl_engine_test_kernels_register(void);

#ifdef __cplusplus
}
#endif

#endif
