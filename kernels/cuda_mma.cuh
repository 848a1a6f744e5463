// Header of the tensor-core split kernel (cuda_mma_split.cu): the mma, fp16 pair
// unpacking of 4- and 8-bit codes, cp.async copies, dequantization.
#include "cuda_common.cuh"
#define KV_UNROLL_PARTS _Pragma("unroll")  // split_epilogue.h: unroll over the warps

__device__ __forceinline__ void kv_mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int kv_h2u(__half2 h) { return *reinterpret_cast<unsigned int*>(&h); }
__device__ __forceinline__ __half2 kv_u2h(unsigned int u) { return *reinterpret_cast<__half2*>(&u); }
__device__ __forceinline__ unsigned int kv_pack(float lo, float hi) { return kv_h2u(__floats2half2_rn(lo, hi)); }

// N 32-bit words from a 4*N-byte aligned address (read-only path)
template <int N>
__device__ __forceinline__ void kv_words(unsigned int* w, const uint8_t* __restrict__ src) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 r = __ldg(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = r.x; w[4 * i + 1] = r.y; w[4 * i + 2] = r.z; w[4 * i + 3] = r.w;
    }
  } else if constexpr (N == 2) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(src)); w[0] = r.x; w[1] = r.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
  }
}

// Key pairs: pair h of a lane's key chunk, as the fp16 pair (1024 + code_lo, 1024 + code_hi).
// 4 bits: nibble i of a word is element i; pair h = elements (8(h/4) + h%4, that + 4).
// 8 bits: pair h = elements (2h, 2h + 1).
template <int BITS>
__device__ __forceinline__ int kv_key_pair_dim(int h, int e) {
  if constexpr (BITS == 4) return 8 * (h >> 2) + (h & 3) + 4 * e;
  else return 2 * h + e;
}
// 4 bits, odd h: the nibble is taken in place (bits 4-7 of each half), so the pair holds
// 1024 + 16 * code and dequantizes with scale / 16 (kv_sixteenth): one shift per two pairs.
// (x & MASK) | 0x64006400 as one lop3 (the compiler emits an and and an or for the C form)
template <unsigned int MASK>
__device__ __forceinline__ unsigned int kv_bias_codes(unsigned int x) {
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "n"(MASK), "n"(0x64006400u));
  return r;
}
// 2^x (MUFU.EX2; -inf -> 0), independent of the JIT's fast-math setting
__device__ __forceinline__ float kv_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

template <int BITS>
__device__ __forceinline__ unsigned int kv_key_pair(const unsigned int* w, int h) {
  if constexpr (BITS == 4) {
    const unsigned int x = (h & 2) ? w[h >> 2] >> 8 : w[h >> 2];
    return (h & 1) ? kv_bias_codes<0x00F000F0u>(x) : kv_bias_codes<0x000F000Fu>(x);
  } else {
    return __byte_perm(w[h >> 1], 0x64646464u, (h & 1) ? 0x4342 : 0x4140);
  }
}
__device__ __forceinline__ __half2 kv_sixteenth(__half2 scale) { return __hmul2(scale, __float2half2_rn(0.0625f)); }

// Value pairs: the same head dim of two tokens a, b as (1024 + code_a, 1024 + code_b)
// (4 bits, odd dims: 1024 + 16 * code); the CV dims of a lane's value chunk come out in order.
template <int BITS, int CV>
__device__ __forceinline__ void kv_value_pairs(unsigned int (&out)[CV], const unsigned int* wa, const unsigned int* wb) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int w = 0; w < CV / 8; ++w) {
      const unsigned int lo = __byte_perm(wa[w], wb[w], 0x5410);
      const unsigned int hi = __byte_perm(wa[w], wb[w], 0x7632);
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // odd e: 1024 + 16 * code, as for keys
        const unsigned int a = (e & 2) ? lo >> 8 : lo, b = (e & 2) ? hi >> 8 : hi;
        out[8 * w + e] = (e & 1) ? kv_bias_codes<0x00F000F0u>(a) : kv_bias_codes<0x000F000Fu>(a);
        out[8 * w + 4 + e] = (e & 1) ? kv_bias_codes<0x00F000F0u>(b) : kv_bias_codes<0x000F000Fu>(b);
      }
    }
  } else {
#pragma unroll
    for (int w = 0; w < CV / 4; ++w) {
      const unsigned int y0 = __byte_perm(wa[w], wb[w], 0x5140);
      const unsigned int y1 = __byte_perm(wa[w], wb[w], 0x7362);
      out[4 * w] = __byte_perm(y0, 0x64646464u, 0x4140);
      out[4 * w + 1] = __byte_perm(y0, 0x64646464u, 0x4342);
      out[4 * w + 2] = __byte_perm(y1, 0x64646464u, 0x4140);
      out[4 * w + 3] = __byte_perm(y1, 0x64646464u, 0x4342);
    }
  }
}

// cp.async (sm_80+): 16 bytes global -> shared, of which `valid` are read and the rest zeroed
__device__ __forceinline__ void kv_cp16(void* dst, const void* src, int valid) {
  const unsigned int to = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid));
}
// the same, all 16 bytes, to a shared-window address
__device__ __forceinline__ void kv_cp16_full(unsigned int to, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src));
}
__device__ __forceinline__ void kv_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void kv_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// N 32-bit words from shared memory (16-byte aligned for N >= 4)
template <int N>
__device__ __forceinline__ void kv_words_shared(unsigned int* w, const uint8_t* src) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 r = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = r.x; w[4 * i + 1] = r.y; w[4 * i + 2] = r.z; w[4 * i + 3] = r.w;
    }
  } else if constexpr (N == 2) {
    const uint2 r = *reinterpret_cast<const uint2*>(src); w[0] = r.x; w[1] = r.y;
  } else {
    w[0] = *reinterpret_cast<const unsigned int*>(src);
  }
}

// (1024 + code) pair -> code * scale + offset, per half (scale/offset pairs as half2)
__device__ __forceinline__ unsigned int kv_dequant(unsigned int biased, __half2 scale, __half2 offset) {
  return kv_h2u(__hfma2(__hsub2(kv_u2h(biased), kv_u2h(0x64006400u)), scale, offset));  // 1024 is 0x6400
}

// Native pages (cuda_mma_native_split.cu): 16-bit K/V straight into the mma.
// m16n8k16 with bf16 operands (fp32 accumulate)
__device__ __forceinline__ void kv_mma_bf16(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i;
// register i gets, per lane, row lane/4, columns 2(lane%4), 2(lane%4)+1 of matrix i (.trans:
// rows 2(lane%4), 2(lane%4)+1 of column lane/4)
__device__ __forceinline__ void kv_ldsm_x4(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void kv_ldsm_x4_trans(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// the pair and the mma of a page's element type, chosen by overload on a pointer to it
__device__ __forceinline__ unsigned int kv_pack_like(const __half*, float lo, float hi) { return kv_pack(lo, hi); }
__device__ __forceinline__ unsigned int kv_pack_like(const __nv_bfloat16*, float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&h);
}
__device__ __forceinline__ void kv_mma_like(const __half*, float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  kv_mma(c, a, b0, b1);
}
__device__ __forceinline__ void kv_mma_like(const __nv_bfloat16*, float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  kv_mma_bf16(c, a, b0, b1);
}
