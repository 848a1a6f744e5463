// The lane-group split kernel (kernels/cuda.py compiles it; direct.py plans its launch).
// A template: cuda.py fills two placeholders in braces per layout kind, raw (the Raw
// page-data type of cuda_lane.cuh) and load_args (the plane arguments of Raw::load).
// Template parameters: D, DPL, ROWS, UNROLL, NUM_WARPS, BLOCK_SIZE, K_BITS, V_BITS, GROUP,
// CAUSAL, WINDOWED, ROTATE, TABLE_CAP (and KvT for native pages). Per-call scalars arrive
// in one int32 array `meta` (one host->device transfer per call): rows, L, split_tokens,
// window, first_key, row_chunks, scale (float bits), then the B context lengths.
//
// Lane layout: a "lane group" of D / DPL lanes owns one token at a time, each lane DPL
// head_dim values (DPL = 16: 8-byte loads of 4-bit codes, 16 bytes of 8-bit codes, 32 bytes
// of bf16). A warp holds 32 / (D / DPL) lane groups; each keeps its own online softmax, and
// the groups of a block are merged through shared memory at the end. Per step a lane group
// takes UNROLL consecutive tokens; the raw page words of step n+1 are requested before the
// math of step n (software pipelining) and the block table of the split is staged in shared
// memory. Partial scores are reduced over the lane group with a transposed butterfly (GW - 1
// shuffles for GW * C values). Scores live in the log2 domain (queries carry scale *
// log2(e)), so exp2f is the only transcendental; integer codes become floats through the
// 2^23 mantissa trick instead of the quarter-rate I2F instruction.
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

#include "split_prologue.cuh"
  __syncthreads();
  const int sub = lane % GW;
  const int group = warp * GPW + lane / GW;

  // queries of this block's rows, this lane's DPL dims, rotated if ROTATE, log2 domain
  if (ROTATE) qscale *= rsqrtf((float)D);
#include "split_queries.h"

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
#include "split_softmax.h"
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
  constexpr int PARTS = NGROUPS, PART_ROWS = ROWS;
  __shared__ float sh_m[PARTS][PART_ROWS];
  __shared__ float sh_l[PARTS][PART_ROWS];
  __shared__ float sh_acc[PARTS][PART_ROWS][D];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
#pragma unroll
    for (int d = 0; d < DPL; ++d) sh_acc[group][i][sub * DPL + d] = acc[i][d] + value_offsets[i];
  }
  __syncthreads();
#include "split_epilogue.h"
