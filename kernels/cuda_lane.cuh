// Header of the lane-group split kernel (cuda_lane_split.cu) and the merge kernel
// (cuda_merge.cu): the raw page data a lane holds per token, and code unpacking.
#include "cuda_common.cuh"
#define KV_UNROLL_PARTS  // split_epilogue.h: the lane groups' loops stay rolled

// Page data of UNROLL tokens for one lane, kept raw (as loaded) so that the loads issued
// for the next step never wait; turned into floats only where the math uses them.
template <int U, int DPL, int D, typename T>
struct NativeRaw {
  static constexpr int WORDS = DPL * sizeof(T) / 16;
  uint4 k[U][WORDS], v[U][WORDS];
  __device__ __forceinline__ void load(int u, const T* __restrict__ kc, const T* __restrict__ vc,
                                       size_t at, int sub) {
    const uint4* kp = reinterpret_cast<const uint4*>(kc + at * D + sub * DPL);
    const uint4* vp = reinterpret_cast<const uint4*>(vc + at * D + sub * DPL);
#pragma unroll
    for (int w = 0; w < WORDS; ++w) { k[u][w] = __ldg(kp + w); v[u][w] = __ldg(vp + w); }
  }
  __device__ __forceinline__ void clear(int u) {
#pragma unroll
    for (int w = 0; w < WORDS; ++w) { k[u][w] = make_uint4(0, 0, 0, 0); v[u][w] = make_uint4(0, 0, 0, 0); }
  }
  __device__ __forceinline__ float key(int u, int d) const {
    return static_cast<float>(reinterpret_cast<const T*>(k[u])[d]);
  }
  __device__ __forceinline__ float score(int u, float dot, float q_sum) const { return dot; }
  static constexpr bool AFFINE = false;
  __device__ __forceinline__ float value(int u, int d) const {
    return static_cast<float>(reinterpret_cast<const T*>(v[u])[d]);
  }
  __device__ __forceinline__ float value_scale(int u) const { return 1.f; }
  __device__ __forceinline__ float value_offset(int u) const { return 0.f; }
};

// Codes of BITS bits: element 2j in the low nibble of byte j for 4 bits, so nibble i of a
// 32-bit word is element i. DPL dims of one lane lie in one quantization group.
// Integer codes become floats without I2F (a quarter-rate instruction): the code is placed
// in the mantissa of 2^23 (0x4B000000) and 2^23 is subtracted, exactly.
template <int BITS>
__device__ __forceinline__ float kv_code(const unsigned int* w, int i) {
  constexpr int PER = 32 / BITS;
  unsigned int bits;
  if constexpr (BITS == 8) {
    bits = __byte_perm(w[i / PER], 0x4B000000u, (i % PER) | 0x7440);
  } else {
    bits = ((w[i / PER] >> (BITS * (i % PER))) & ((1u << BITS) - 1u)) | 0x4B000000u;
  }
  return __int_as_float(bits) - 8388608.f;
}

template <int N>
__device__ __forceinline__ void kv_load_words(unsigned int* w, const uint8_t* __restrict__ src) {
  if constexpr (N == 4) {
    uint4 r = __ldg(reinterpret_cast<const uint4*>(src)); w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
  } else if constexpr (N == 2) {
    uint2 r = __ldg(reinterpret_cast<const uint2*>(src)); w[0] = r.x; w[1] = r.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
  }
}

template <int U, int DPL, int D, int KB, int VB, int G>
struct PackedRaw {
  static constexpr int KW = DPL * KB / 32, VW = DPL * VB / 32;
  unsigned int k[U][KW], v[U][VW];
  float ks[U], ko[U], vs[U], vo[U];
  __device__ __forceinline__ void load(int u, const uint8_t* __restrict__ kc, const float* __restrict__ ksp,
                                       const float* __restrict__ kop, const uint8_t* __restrict__ vc,
                                       const float* __restrict__ vsp, const float* __restrict__ vop,
                                       size_t at, int sub) {
    kv_load_words<KW>(k[u], kc + at * (D * KB / 8) + sub * (DPL * KB / 8));
    kv_load_words<VW>(v[u], vc + at * (D * VB / 8) + sub * (DPL * VB / 8));
    const size_t g = at * (D / G) + (sub * DPL) / G;
    ks[u] = __ldg(ksp + g); ko[u] = __ldg(kop + g); vs[u] = __ldg(vsp + g); vo[u] = __ldg(vop + g);
  }
  __device__ __forceinline__ void clear(int u) {
#pragma unroll
    for (int w = 0; w < KW; ++w) k[u][w] = 0u;
#pragma unroll
    for (int w = 0; w < VW; ++w) v[u][w] = 0u;
    ks[u] = 0.f; ko[u] = 0.f; vs[u] = 0.f; vo[u] = 0.f;
  }
  __device__ __forceinline__ float key(int u, int d) const { return kv_code<KB>(k[u], d); }
  // q . (code * scale + offset) = scale * (q . code) + offset * sum(q)
  __device__ __forceinline__ float score(int u, float dot, float q_sum) const {
    return fmaf(ks[u], dot, ko[u] * q_sum);
  }
  // p * (code * scale + offset) = (p * scale) * code + p * offset: the offset term is one
  // number per token and row, accumulated apart from the head_dim values
  static constexpr bool AFFINE = true;
  __device__ __forceinline__ float value(int u, int d) const { return kv_code<VB>(v[u], d); }
  __device__ __forceinline__ float value_scale(int u) const { return vs[u]; }
  __device__ __forceinline__ float value_offset(int u) const { return vo[u]; }
};
