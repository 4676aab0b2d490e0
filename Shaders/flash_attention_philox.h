// Attention dropout's random bits: Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel Random
// Numbers: As Easy as 1, 2, 3", SC 2011; the Random123 library's constants and round function), a
// counter-based generator: its output is a pure function of a 128-bit counter and a 64-bit key, so
// every element of the dropout mask is computed where it is used, by any kernel, tiling, head-dim
// bucket or backend, with the same bits, and the backward regenerates the forward's mask instead
// of storing it. Known answers: Random123's tests/kat_vectors (tests/python/test_dropout.py).
//
// Plain C/C++ over the fixed-width types of flash_attention_params.h: included by the kernels
// (Metal, the CPU engine, the CUDA check build) and usable from C. The bit-exact Python twin is
// python/flash_attention_metal/philox.py.
//
// The mask of element (batch b, query head h, query row i, key j) of a call with seed and offset
// (both 64-bit; varlen: b the sequence, i and j counted from the sequence's first row and key):
//   key     = (seed mod 2^32, seed >> 32)
//   counter = (c0, c1, c2, c3) with c0 + 2^32 c1 = (offset + j / 4) mod 2^64, c2 = i,
//             c3 = (b * num_heads + h) mod 2^32
//   u       = word j mod 4 of Philox-4x32-10(counter, key)
//   kept    = u >= dropout_threshold, = min(round(p 2^32), 2^32 - 1) of the float32 dropout_p p
//             (rounded in float64), so P(dropped) = dropout_threshold / 2^32
// so one Philox call gives four neighbouring keys of a row, and a row's mask depends only on these
// indices. Kept probabilities are multiplied by dropout_scale = 1 / (1 - p) (float32).
#ifndef FLASH_ATTENTION_PHILOX_H
#define FLASH_ATTENTION_PHILOX_H

#include "flash_attention_params.h"

#define FA_PHILOX_M0 0xD2511F53u
#define FA_PHILOX_M1 0xCD9E8D57u
#define FA_PHILOX_W0 0x9E3779B9u  // the key schedule's increments (golden ratio, sqrt(3) - 1)
#define FA_PHILOX_W1 0xBB67AE85u
#define FA_PHILOX_ROUNDS 10

// Four 32-bit words: a counter or an output block.
typedef struct FaPhiloxBlock {
    fa_u32 x0;
    fa_u32 x1;
    fa_u32 x2;
    fa_u32 x3;
} FaPhiloxBlock;

// The high 32 bits of the 64-bit product a * b (MSL has it as one instruction).
inline fa_u32 fa_philox_mulhi(fa_u32 a, fa_u32 b) {
#if defined(__METAL_VERSION__)
    return mulhi(a, b);
#else
    return (fa_u32)(((fa_u64)a * (fa_u64)b) >> 32);
#endif
}

// Philox-4x32-10 of `counter` under key (k0, k1): ten rounds, the key bumped between rounds.
inline FaPhiloxBlock fa_philox4x32_10(FaPhiloxBlock c, fa_u32 k0, fa_u32 k1) {
    for (int r = 0; r < FA_PHILOX_ROUNDS; ++r) {
        if (r > 0) {
            k0 += FA_PHILOX_W0;
            k1 += FA_PHILOX_W1;
        }
        const fa_u32 hi0 = fa_philox_mulhi(FA_PHILOX_M0, c.x0);
        const fa_u32 lo0 = FA_PHILOX_M0 * c.x0;
        const fa_u32 hi1 = fa_philox_mulhi(FA_PHILOX_M1, c.x2);
        const fa_u32 lo1 = FA_PHILOX_M1 * c.x2;
        FaPhiloxBlock next;
        next.x0 = hi1 ^ c.x1 ^ k0;
        next.x1 = lo1;
        next.x2 = hi0 ^ c.x3 ^ k1;
        next.x3 = lo0;
        c = next;
    }
    return c;
}

// The dropout words of keys [4 g, 4 g + 4) of row `row` of (batch, head) `stream` (b * num_heads
// + h), the mapping above.
inline FaPhiloxBlock fa_dropout_words(fa_u64 seed, fa_u64 offset, fa_u32 stream, fa_u32 row,
                                      fa_u32 g) {
    const fa_u64 position = offset + (fa_u64)g;
    FaPhiloxBlock counter;
    counter.x0 = (fa_u32)position;
    counter.x1 = (fa_u32)(position >> 32);
    counter.x2 = row;
    counter.x3 = stream;
    return fa_philox4x32_10(counter, (fa_u32)seed, (fa_u32)(seed >> 32));
}

// Word e (0 ... 3) of a block.
inline fa_u32 fa_philox_word(FaPhiloxBlock w, fa_u32 e) {
    return e == 0 ? w.x0 : e == 1 ? w.x1 : e == 2 ? w.x2 : w.x3;
}

#endif
