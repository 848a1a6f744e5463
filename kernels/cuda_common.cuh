// Definitions every CUDA kernel of this package shares (included by cuda_lane.cuh and
// cuda_mma.cuh); the KV_* macros are what split_epilogue.h, split_queries.h and
// split_softmax.h need of a backend.
#define KV_NEG_INF (-cuda::std::numeric_limits<float>::infinity())
#define KV_THREAD threadIdx.x
#define KV_MAX fmaxf
#define KV_EXP2 exp2f
#define KV_UNROLL _Pragma("unroll")
#define KV_SHUFFLE_XOR(value, lane_mask) __shfl_xor_sync(0xffffffffu, (value), (lane_mask))
