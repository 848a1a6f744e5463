// The Metal split kernel (kernels/metal.py compiles it): the plain form of
// cuda_lane_split.cu. A template: metal.py fills two placeholders in braces, load_k and
// load_v, per layout kind from metal_loads.metal. Template parameters and meta as cuda_lane_split.cu's.
// The query prologue, the online-softmax step and the epilogue are the CUDA kernel's own
// text (split_queries.h, split_softmax.h, split_epilogue.h); what differs is the loads (one
// token per lane group per unrolled step, no software pipelining, no staged block table)
// and the score reduction (a plain butterfly).
// What the shared files need of a backend; defined in the body, since MLX adds the
// thread_index_in_threadgroup attribute only where the body names it.
#define KV_NEG_INF (-INFINITY)
#define KV_THREAD thread_index_in_threadgroup
#define KV_MAX metal::max
#define KV_EXP2 metal::exp2
#define KV_UNROLL
#define KV_UNROLL_PARTS
#define KV_SHUFFLE_XOR(value, lane_mask) simd_shuffle_xor((value), ushort(lane_mask))
  constexpr int GW = D / DPL;
  constexpr int GPW = 32 / GW;
  constexpr int WARP_TOKENS = GPW * UNROLL;
  constexpr int NGROUPS = NUM_WARPS * GPW;
  constexpr float LOG2E = 1.4426950408889634f;

  const int rows_total = meta[0];
  const int num_queries = meta[1];
  const int split_tokens = meta[2];
  const int window = meta[3];
  const int first_key = meta[4];
  const int row_chunks = meta[5];
  float qscale = as_type<float>(meta[6]) * LOG2E;

  const int split = threadgroup_position_in_grid.x;
  const int num_splits = threadgroups_per_grid.x;
  const int head = threadgroup_position_in_grid.y / row_chunks;
  const int chunk = threadgroup_position_in_grid.y % row_chunks;
  const int batch = threadgroup_position_in_grid.z;
  const int num_kv_heads = kc_shape[1];
  const int table_width = block_tables_shape[1];

  const int lane = thread_index_in_simdgroup;
  const int warp = simdgroup_index_in_threadgroup;
  const int sub = lane % GW;
  const int group = warp * GPW + lane / GW;

  const int context = meta[7 + batch];
  const int start = first_key + split * split_tokens;
  const int stop = min(context, start + split_tokens);

  if (ROTATE) qscale *= metal::rsqrt(float(D));
#include "split_queries.h"

  float m[ROWS], l[ROWS], acc[ROWS][DPL], value_offsets[ROWS];
  for (int i = 0; i < ROWS; ++i) {
    m[i] = KV_NEG_INF; l[i] = 0.f; value_offsets[i] = 0.f;
    for (int d = 0; d < DPL; ++d) acc[i][d] = 0.f;
  }

  for (int base = start + warp * WARP_TOKENS; base < stop; base += NUM_WARPS * WARP_TOKENS) {
    const int t0 = base + (lane / GW) * UNROLL;
    float s[UNROLL][ROWS];
    size_t at[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u;
      const int block = j < stop ? block_tables[batch * table_width + j / BLOCK_SIZE] : 0;
      at[u] = ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE);
      float kv[DPL];
      float k_scale = 1.f, k_offset = 0.f;
      if (j < stop) {
        {load_k}
      } else {
        for (int d = 0; d < DPL; ++d) kv[d] = 0.f;
      }
      for (int i = 0; i < ROWS; ++i) {
        float dot = 0.f;
        for (int d = 0; d < DPL; ++d) dot = metal::fma(q[i][d], kv[d], dot);
        s[u][i] = metal::fma(k_scale, dot, k_offset * q_sum[i]);
      }
    }
    for (int u = 0; u < UNROLL; ++u)
      for (int i = 0; i < ROWS; ++i)
        for (int o = GW / 2; o > 0; o >>= 1) s[u][i] += simd_shuffle_xor(s[u][i], ushort(o));
#include "split_softmax.h"
    for (int u = 0; u < UNROLL; ++u) {
      if (t0 + u >= stop) continue;
      float kv[DPL];
      float v_scale = 1.f, v_offset = 0.f;
      {load_v}
      // values are scale * code + offset: the offset's weight is kept apart, as in CUDA
      float weight[ROWS];
      for (int i = 0; i < ROWS; ++i) {
        weight[i] = s[u][i] * v_scale;
        value_offsets[i] = metal::fma(s[u][i], v_offset, value_offsets[i]);
      }
      for (int d = 0; d < DPL; ++d)
        for (int i = 0; i < ROWS; ++i) acc[i][d] = metal::fma(weight[i], kv[d], acc[i][d]);
    }
  }

  constexpr int PARTS = NGROUPS, PART_ROWS = ROWS;
  threadgroup float sh_m[PARTS][PART_ROWS];
  threadgroup float sh_l[PARTS][PART_ROWS];
  threadgroup float sh_acc[PARTS][PART_ROWS][D];
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
    for (int d = 0; d < DPL; ++d) sh_acc[group][i][sub * DPL + d] = acc[i][d] + value_offsets[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#include "split_epilogue.h"
