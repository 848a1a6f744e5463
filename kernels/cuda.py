"""The CUDA kernels of direct paged attention (mx.fast.cuda_kernel, JIT-compiled by NVRTC).

Two launches per call (the algorithm is in kernels/direct.py's docstring):
  split kernel   grid (splits, Hkv * row_chunks, B), NUM_WARPS warps per block. Each block
                 reads its split's tokens through the block table once for up to
                 ROWS_PER_BLOCK grouped query rows and writes a partial (max, sum, output).
  merge kernel   grid (B * Hq * L), Dv threads: log-sum-exp merge of the split partials and
                 the optional sink, cast to the output dtype.

Lane layout: a "lane group" of D / DPL lanes owns one token at a time, each lane DPL
head_dim values (DPL = 16: 8-byte loads of 4-bit codes, 16 bytes of 8-bit codes, 32 bytes
of bf16). A warp holds 32 / (D / DPL) lane groups; each keeps its own online softmax, and
the groups of a block are merged through shared memory at the end. Per step a lane group
takes UNROLL consecutive tokens; the raw page words of step n+1 are requested before the
math of step n (software pipelining) and the block table of the split is staged in shared
memory. Partial scores are reduced over the lane group with a transposed butterfly (GW - 1
shuffles for GW * C values). Scores live in the log2 domain (queries carry scale *
log2(e)), so exp2f is the only transcendental; integer codes become floats through the
2^23 mantissa trick instead of the quarter-rate I2F instruction.

Measured on the H200 (docs/kernels.md): correct on the whole test table; for packed pages
it is bound by instruction issue and registers (about 8 warps per SM), not by memory.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import direct

HEADER = r"""
#define KV_NEG_INF (-cuda::std::numeric_limits<float>::infinity())

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
"""

# The split kernel body. Per-call scalars arrive in one int32 array `meta` (one host->device
# transfer per call): rows, L, split_tokens, window, first_key, row_chunks, scale (float
# bits), then the B context lengths. {raw} / {load} are filled per layout kind.
SPLIT_BODY = r"""
  constexpr int GW = D / DPL;            // lanes per lane group
  constexpr int GPW = 32 / GW;           // lane groups per warp
  constexpr int WARP_TOKENS = GPW * UNROLL;
  constexpr int STEP = NUM_WARPS * WARP_TOKENS;
  constexpr int NGROUPS = NUM_WARPS * GPW;
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr int N = UNROLL * ROWS;       // partial scores per lane per step
  constexpr bool XPOSE = GW > 1 && N % GW == 0;
  using Raw = {raw};
  __shared__ float sh_s[NGROUPS][XPOSE ? N : 1];

  const int rows_total = meta[0];
  const int num_queries = meta[1];
  const int split_tokens = meta[2];
  const int window = meta[3];
  const int first_key = meta[4];
  const int row_chunks = meta[5];
  float qscale = __int_as_float(meta[6]) * LOG2E;

  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int head = blockIdx.y / row_chunks;
  const int chunk = blockIdx.y % row_chunks;
  const int batch = blockIdx.z;
  const int num_kv_heads = kc_shape[1];
  const int table_width = block_tables_shape[1];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % GW;
  const int group = warp * GPW + lane / GW;

  const int context = meta[7 + batch];
  const int start = first_key + split * split_tokens;
  const int stop = min(context, start + split_tokens);

  // this split's block-table entries, so page addresses never wait on a global load
  __shared__ int sh_table[TABLE_CAP];
  const int first_block = start / BLOCK_SIZE;
  for (int e = threadIdx.x; first_block + e <= (stop - 1) / BLOCK_SIZE && e < TABLE_CAP; e += NUM_WARPS * 32)
    sh_table[e] = block_tables[batch * table_width + first_block + e];
  __syncthreads();

  // queries of this block's rows, this lane's DPL dims, rotated if ROTATE, log2 domain
  float q[ROWS][DPL];
  float q_sum[ROWS];
  int q_pos[ROWS];
  const int row0 = chunk * ROWS;
  if (ROTATE) qscale *= rsqrtf((float)D);
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = row0 + i;
    q_pos[i] = context - num_queries + (r % num_queries);
    const size_t at = ((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + sub * DPL;
#pragma unroll
    for (int d = 0; d < DPL; ++d) q[i][d] = (r < rows_total) ? static_cast<float>(queries[at + d]) : 0.f;
    if (ROTATE) {
      // x @ diag(s) @ H: signs, then a fast Walsh-Hadamard transform (in registers for
      // strides < DPL, across the lane group with shuffles above)
#pragma unroll
      for (int d = 0; d < DPL; ++d) q[i][d] *= signs[sub * DPL + d];
#pragma unroll
      for (int h = 1; h < DPL; h <<= 1)
#pragma unroll
        for (int d = 0; d < DPL; ++d)
          if ((d & h) == 0) { const float a = q[i][d], b = q[i][d + h]; q[i][d] = a + b; q[i][d + h] = a - b; }
#pragma unroll
      for (int h = 1; h < GW; h <<= 1)
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          const float other = __shfl_xor_sync(0xffffffffu, q[i][d], h);
          q[i][d] = (sub & h) ? other - q[i][d] : q[i][d] + other;
        }
    }
    q_sum[i] = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) { q[i][d] *= qscale; q_sum[i] += q[i][d]; }
  }

  float m[ROWS], l[ROWS], acc[ROWS][DPL], value_offsets[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    m[i] = KV_NEG_INF; l[i] = 0.f; value_offsets[i] = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[i][d] = 0.f;
  }

  // software pipeline: the raw pages of step n+1 are requested before step n's math
  Raw cur, nxt;
  int base = start + warp * WARP_TOKENS;
#define KV_FETCH(RAW, BASE)                                                              \
  _Pragma("unroll") for (int u = 0; u < UNROLL; ++u) {                                   \
    const int j = (BASE) + (lane / GW) * UNROLL + u;                                     \
    if (j < stop) {                                                                      \
      const int e = j / BLOCK_SIZE - first_block;                                        \
      const int block = e < TABLE_CAP ? sh_table[e]                                      \
                                      : block_tables[batch * table_width + j / BLOCK_SIZE]; \
      const size_t at = ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE); \
      RAW.load(u, {load_args}, at, sub);                                                 \
    } else {                                                                             \
      RAW.clear(u);                                                                      \
    }                                                                                    \
  }
  KV_FETCH(cur, base)
  for (; base < stop; base += STEP) {
    KV_FETCH(nxt, base + STEP)
    const int t0 = base + (lane / GW) * UNROLL;
    float s[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        float dot = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) dot = fmaf(q[i][d], cur.key(u, d), dot);
        s[u][i] = cur.score(u, dot, q_sum[i]);
      }
    }
    // reduce the partial dots over the lane group
    if constexpr (XPOSE) {
      // transposed butterfly: each level halves the values a lane carries, so GW - 1
      // shuffles reduce N = GW * C values; lane `sub` ends with values C*sub .. C*sub+C-1,
      // which the lane group then shares through shared memory
      float x[N];
#pragma unroll
      for (int e = 0; e < N; ++e) x[e] = s[e / ROWS][e % ROWS];
#pragma unroll
      for (int o = GW / 2, n = N; o >= 1; o >>= 1, n >>= 1) {
        const bool upper = (sub & o) != 0;
#pragma unroll
        for (int k = 0; k < n / 2; ++k) {
          const float send = upper ? x[k] : x[k + n / 2];
          const float keep = upper ? x[k + n / 2] : x[k];
          x[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < N / GW; ++k) sh_s[group][(N / GW) * sub + k] = x[k];
      __syncwarp();
#pragma unroll
      for (int e = 0; e < N; ++e) s[e / ROWS][e % ROWS] = sh_s[group][e];
    } else {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
          for (int o = GW / 2; o > 0; o >>= 1) s[u][i] += __shfl_xor_sync(0xffffffffu, s[u][i], o);
    }
    // mask, then the online-softmax update over UNROLL tokens at once
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      float chunk_max = m[i];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int j = t0 + u;
        bool visible = j < stop;
        if (CAUSAL) visible = visible && j <= q_pos[i];
        if (WINDOWED) visible = visible && j > q_pos[i] - window;
        s[u][i] = visible ? s[u][i] : KV_NEG_INF;
        chunk_max = fmaxf(chunk_max, s[u][i]);
      }
      if (chunk_max == KV_NEG_INF) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) s[u][i] = 0.f;
        continue;
      }
      const float correction = exp2f(m[i] - chunk_max);
      m[i] = chunk_max;
      l[i] *= correction;
      value_offsets[i] *= correction;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[i][d] *= correction;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u][i] = exp2f(s[u][i] - chunk_max);
        l[i] += s[u][i];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float weight[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        weight[i] = Raw::AFFINE ? s[u][i] * cur.value_scale(u) : s[u][i];
        if (Raw::AFFINE) value_offsets[i] = fmaf(s[u][i], cur.value_offset(u), value_offsets[i]);
      }
#pragma unroll
      for (int d = 0; d < DPL; ++d) {
        const float value = cur.value(u, d);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc[i][d] = fmaf(weight[i], value, acc[i][d]);
      }
    }
    cur = nxt;
  }
#undef KV_FETCH

  // merge the lane groups of this block through shared memory
  __shared__ float sh_m[NGROUPS][ROWS];
  __shared__ float sh_l[NGROUPS][ROWS];
  __shared__ float sh_acc[NGROUPS][ROWS][D];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
#pragma unroll
    for (int d = 0; d < DPL; ++d) sh_acc[group][i][sub * DPL + d] = acc[i][d] + value_offsets[i];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ROWS * D; e += NUM_WARPS * 32) {
    const int i = e / D;
    const int d = e % D;
    const int r = row0 + i;
    if (r >= rows_total) continue;
    float best = KV_NEG_INF;
    for (int g = 0; g < NGROUPS; ++g) best = fmaxf(best, sh_m[g][i]);
    float total = 0.f, out = 0.f;
    if (best != KV_NEG_INF) {
      for (int g = 0; g < NGROUPS; ++g) {
        const float w = exp2f(sh_m[g][i] - best);
        total += w * sh_l[g][i];
        out += w * sh_acc[g][i][d];
      }
    }
    const size_t flat = (size_t)(batch * num_kv_heads + head) * rows_total + r;
    part_o[(flat * num_splits + split) * D + d] = out;
    if (d == 0) {
      part_ml[(flat * num_splits + split) * 2] = best;
      part_ml[(flat * num_splits + split) * 2 + 1] = total;
    }
  }
"""

NATIVE = dict(raw="NativeRaw<UNROLL, DPL, D, KvT>", load_args="kc, vc")
PACKED = dict(raw="PackedRaw<UNROLL, DPL, D, K_BITS, V_BITS, GROUP>", load_args="kc, ks, ko, vc, vs, vo")


def split_source(packed: bool) -> str:
    source = SPLIT_BODY
    for key, text in (PACKED if packed else NATIVE).items():
        source = source.replace("{" + key + "}", text)
    return source


MERGE_BODY = r"""
  // one block of D threads per output row. The split maxima and weights are reduced by the
  // whole block first, so the pass over part_o is a loop of independent loads (the serial
  // per-thread loops this replaces waited on one global load per split, ~10 us at 33 splits)
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr int CAP = 1024;  // split weights kept in shared memory; later ones are recomputed
  __shared__ float sh_w[CAP];
  __shared__ float sh_red[D];
  const int flat = blockIdx.x;
  const int d = threadIdx.x;
  const int num_splits = part_ml_shape[1];
  const float* ml = part_ml + (size_t)flat * num_splits * 2;
  auto block_reduce = [&](float x, bool take_max) -> float {
    if constexpr (D % 32 == 0) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, o);
        x = take_max ? fmaxf(x, y) : x + y;
      }
      if ((d & 31) == 0) sh_red[d >> 5] = x;
      __syncthreads();
      x = sh_red[0];
      for (int w = 1; w < D / 32; ++w) x = take_max ? fmaxf(x, sh_red[w]) : x + sh_red[w];
    } else {
      sh_red[d] = x;
      __syncthreads();
      x = sh_red[0];
      for (int w = 1; w < D; ++w) x = take_max ? fmaxf(x, sh_red[w]) : x + sh_red[w];
    }
    __syncthreads();  // sh_red is written again by the next reduction
    return x;
  };
  float sink = KV_NEG_INF;
  if (HAS_SINKS) {
    const int head = (flat / meta[1]) % sinks_shape[0];
    sink = sinks[head] * LOG2E;
  }
  float best = sink;
  for (int s = d; s < num_splits; s += D) best = fmaxf(best, ml[2 * s]);
  best = block_reduce(best, true);
  auto weight = [&](float ms) { return ms == KV_NEG_INF ? 0.f : exp2f(ms - best); };
  float total = 0.f;
  for (int s = d; s < num_splits; s += D) {
    const float w = weight(ml[2 * s]);
    if (s < CAP) sh_w[s] = w;
    total += w * ml[2 * s + 1];
  }
  total = block_reduce(total, false);  // its barrier also publishes sh_w
  if (HAS_SINKS) total += exp2f(sink - best);
  const float* po = part_o + (size_t)flat * num_splits * D + d;
  float out = 0.f;
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) out += (s < CAP ? sh_w[s] : weight(ml[2 * s])) * po[(size_t)s * D];
  result[(size_t)flat * D + d] = static_cast<OutT>(out / total);
"""

_KERNELS: dict[tuple, object] = {}


def _split_kernel(packed: bool):
    key = ("split", packed)
    if key not in _KERNELS:
        planes = ["kc", "ks", "ko", "vc", "vs", "vo"] if packed else ["kc", "vc"]
        inputs = ["queries", "signs", *planes, "block_tables", "meta"]
        body = split_source(packed)
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"kvstore_paged_split_{'packed' if packed else 'native'}",
            input_names=inputs,
            output_names=["part_o", "part_ml"],
            source=body,
            header=HEADER,
        )
    return _KERNELS[key]


def _merge_kernel():
    if "merge" not in _KERNELS:
        _KERNELS["merge"] = mx.fast.cuda_kernel(
            name="kvstore_paged_merge",
            input_names=["part_o", "part_ml", "sinks", "meta"],
            output_names=["result"],
            source=MERGE_BODY,
            header=HEADER,
        )
    return _KERNELS["merge"]


def launch(plan: direct.LaunchPlan) -> mx.array:
    """Run the split and merge kernels of one planned call; returns [B, Hq, L, Dv]."""
    if plan.kernel == "mma":
        from kernels import cuda_mma

        return direct.run_split_merge(plan, cuda_mma.split_kernel(plan.shared_memory), _merge_kernel())
    return direct.run_split_merge(plan, _split_kernel(plan.packed), _merge_kernel())
