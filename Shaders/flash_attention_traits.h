// The tile decisions of one head-dim bucket, in one type: KernelTraits<T, DP>, the rows each kernel
// owns and the rows of the tiles it streams (FA_HEAD_DIM_BUCKETS, FA_HEAD_DIM_BUCKETS_F32 in
// flash_attention_params.h), whether its streamed tiles share one buffer, its threadgroup storage
// (the catalogue's STORAGE of the bucket kernels), and the checks on storage, occupancy and
// registers that every bucket must pass.
#ifndef FLASH_ATTENTION_TRAITS_H
#define FLASH_ATTENTION_TRAITS_H

#include "flash_attention_backward.h"
#include "flash_attention_decode.h"

// One row of a bucket table: FLOAT32 selects FA_HEAD_DIM_BUCKETS_F32, else FA_HEAD_DIM_BUCKETS
// (half and bfloat).
template <bool FLOAT32, uint DP>
struct BucketTiles;

#define FA_BUCKET_TILES(FLOAT32, DP, FWD_BQ, FWD_BK, DQ_BQ, DQ_BK, DKV_BK, DKV_BQ)                 \
    template <>                                                                                    \
    struct BucketTiles<FLOAT32, DP> {                                                              \
        enum : uint {                                                                              \
            forward_block_q = FWD_BQ,                                                              \
            forward_block_k = FWD_BK,                                                              \
            dq_block_q = DQ_BQ,                                                                    \
            dq_block_k = DQ_BK,                                                                    \
            dkv_block_k = DKV_BK,                                                                  \
            dkv_block_q = DKV_BQ,                                                                  \
            has_decode = 0 FA_IF_DECODE(DP, +1),                                                   \
            has_decode_mma = 0 FA_IF_DECODE_MMA(DP, +1),                                           \
            spec_block_q = FA_SPEC_BLOCK_Q(FWD_BQ)                                                 \
        };                                                                                         \
    };
#define FA_BUCKET_TILES_2B(...) FA_BUCKET_TILES(false, __VA_ARGS__)
#define FA_BUCKET_TILES_F32(...) FA_BUCKET_TILES(true, __VA_ARGS__)
FA_HEAD_DIM_BUCKETS(FA_BUCKET_TILES_2B)
FA_HEAD_DIM_BUCKETS_F32(FA_BUCKET_TILES_F32)
#undef FA_BUCKET_TILES_2B
#undef FA_BUCKET_TILES_F32
#undef FA_BUCKET_TILES

// Whether a backward kernel's two streamed tiles must share one buffer to fit in 32 KiB.
#define FA_DQ_SHARED(T, DP, BQ, BK) (sizeof(BackwardQueryStorage<T, DP, BQ, BK, false>) > 32768)
#define FA_DKV_SHARED(T, DP, BK, BQ) (sizeof(BackwardKeyValueStorage<T, DP, BK, BQ, false>) > 32768)

// The bucket of head_dim_max DP for element type T (half, bfloat or float).
template <typename T, uint DP>
struct KernelTraits : BucketTiles<sizeof(T) == 4, DP> {
    typedef BucketTiles<sizeof(T) == 4, DP> Tiles;
    enum : uint {
        dq_shared = FA_DQ_SHARED(T, DP, Tiles::dq_block_q, Tiles::dq_block_k),
        dkv_shared = FA_DKV_SHARED(T, DP, Tiles::dkv_block_k, Tiles::dkv_block_q)
    };
    // Threadgroup storage per kernel (the forward's K/V sharing is decided inside ForwardStorage).
    typedef ForwardStorage<T, DP, Tiles::forward_block_q, Tiles::forward_block_k> forward_storage;
    typedef DecodeStorage<DP> decode_storage;
    typedef ForwardStorage<T, DP, Tiles::spec_block_q, Tiles::forward_block_k> spec_storage;
    typedef ForwardStorage<T, DP, Tiles::forward_block_q, Tiles::forward_block_k, false> lse_residual_storage;
    typedef BackwardQueryStorage<T, DP, Tiles::dq_block_q, Tiles::dq_block_k, dq_shared != 0> dq_storage;
    typedef BackwardKeyValueStorage<T, DP, Tiles::dkv_block_k, Tiles::dkv_block_q, dkv_shared != 0> dkv_storage;

    static_assert(sizeof(forward_storage) <= 32768 && sizeof(spec_storage) <= 32768 && sizeof(dq_storage) <= 32768 &&
                      sizeof(dkv_storage) <= 32768,
                  "threadgroup storage above 32 KiB");
    static_assert(sizeof(T) == 4 || DP > 128 ||
                      FA_CORE_THREADGROUP_BYTES / sizeof(forward_storage) >=
                          FA_FORWARD_MIN_THREADGROUPS_PER_CORE,
                  "forward threadgroups per core below the target (flash_attention_params.h)");
    static_assert(DP % (8 * FA_SLICES(Tiles::forward_block_q)) == 0 &&
                      DP % (8 * FA_SLICES(Tiles::spec_block_q)) == 0 &&
                      DP % (8 * FA_SLICES(Tiles::dq_block_q)) == 0 &&
                      DP % (8 * FA_SLICES(Tiles::dkv_block_k)) == 0 && Tiles::forward_block_k % 8 == 0 &&
                      Tiles::dq_block_k % 8 == 0 && Tiles::dkv_block_q % 8 == 0,
                  "blocks must split into 8x8 fragments");
    static_assert(DP <= (sizeof(T) == 4 ? FA_MAX_HEAD_DIM_F32 : FA_MAX_HEAD_DIM),
                  "a bucket above the dtype's largest head_dim (flash_attention_params.h)");
    static_assert(FA_ACCUMULATOR_FLOATS(DP, Tiles::forward_block_q) <= FA_MAX_ACCUMULATOR_FLOATS &&
                      FA_ACCUMULATOR_FLOATS(DP, Tiles::dq_block_q) <= FA_MAX_ACCUMULATOR_FLOATS &&
                      2 * FA_ACCUMULATOR_FLOATS(DP, Tiles::dkv_block_k) <= FA_MAX_ACCUMULATOR_FLOATS,
                  "accumulators per lane above the budget (flash_attention_params.h)");
    static_assert((Tiles::has_decode != 0) == (DP <= FA_DECODE_MAX_HEAD_DIM),
                  "FA_IF_DECODE_<DP> disagrees with FA_DECODE_MAX_HEAD_DIM");
    static_assert((Tiles::has_decode_mma != 0) == FA_DECODE_MMA_SERVES(DP, DP, DP, 8, 1),
                  "FA_IF_DECODE_MMA_<DP> disagrees with FA_DECODE_MMA_SERVES");
};

#endif
