// The Metal split kernel (kernels/metal.py compiles it): the plain form of
// cuda_lane_split.cu. A template: metal.py fills two placeholders in braces, load_k and
// load_v, per layout kind from metal_loads.metal. Template parameters and meta as cuda_lane_split.cu's.
  constexpr int GW = D / DPL;
  constexpr int GPW = 32 / GW;
  constexpr int WARP_TOKENS = GPW * UNROLL;
  constexpr int NGROUPS = NUM_WARPS * GPW;
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float NEG_INF = -INFINITY;

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

  float q[ROWS][DPL];
  float q_sum[ROWS];
  int q_pos[ROWS];
  const int row0 = chunk * ROWS;
  if (ROTATE) qscale *= metal::rsqrt(float(D));
  for (int i = 0; i < ROWS; ++i) {
    const int r = row0 + i;
    q_pos[i] = context - num_queries + (r % num_queries);
    const size_t at = ((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + sub * DPL;
    for (int d = 0; d < DPL; ++d) q[i][d] = (r < rows_total) ? float(queries[at + d]) : 0.f;
    if (ROTATE) {
      for (int d = 0; d < DPL; ++d) q[i][d] *= signs[sub * DPL + d];
      for (int h = 1; h < DPL; h <<= 1)
        for (int d = 0; d < DPL; ++d)
          if ((d & h) == 0) { float a = q[i][d], b = q[i][d + h]; q[i][d] = a + b; q[i][d + h] = a - b; }
      for (int h = 1; h < GW; h <<= 1)
        for (int d = 0; d < DPL; ++d) {
          float other = simd_shuffle_xor(q[i][d], ushort(h));
          q[i][d] = (sub & h) ? other - q[i][d] : q[i][d] + other;
        }
    }
    q_sum[i] = 0.f;
    for (int d = 0; d < DPL; ++d) { q[i][d] *= qscale; q_sum[i] += q[i][d]; }
  }

  float m[ROWS], l[ROWS], acc[ROWS][DPL];
  for (int i = 0; i < ROWS; ++i) {
    m[i] = NEG_INF; l[i] = 0.f;
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
    for (int i = 0; i < ROWS; ++i) {
      float chunk_max = m[i];
      for (int u = 0; u < UNROLL; ++u) {
        const int j = t0 + u;
        bool visible = j < stop;
        if (CAUSAL) visible = visible && j <= q_pos[i];
        if (WINDOWED) visible = visible && j > q_pos[i] - window;
        s[u][i] = visible ? s[u][i] : NEG_INF;
        chunk_max = metal::max(chunk_max, s[u][i]);
      }
      if (chunk_max == NEG_INF) {
        for (int u = 0; u < UNROLL; ++u) s[u][i] = 0.f;
        continue;
      }
      const float correction = metal::exp2(m[i] - chunk_max);
      m[i] = chunk_max;
      l[i] *= correction;
      for (int d = 0; d < DPL; ++d) acc[i][d] *= correction;
      for (int u = 0; u < UNROLL; ++u) {
        s[u][i] = metal::exp2(s[u][i] - chunk_max);
        l[i] += s[u][i];
      }
    }
    for (int u = 0; u < UNROLL; ++u) {
      if (t0 + u >= stop) continue;
      float kv[DPL];
      float v_scale = 1.f, v_offset = 0.f;
      {load_v}
      for (int d = 0; d < DPL; ++d) {
        const float value = metal::fma(kv[d], v_scale, v_offset);
        for (int i = 0; i < ROWS; ++i) acc[i][d] = metal::fma(s[u][i], value, acc[i][d]);
      }
    }
  }

  constexpr int PARTS = NGROUPS, PART_ROWS = ROWS;
  threadgroup float sh_m[PARTS][PART_ROWS];
  threadgroup float sh_l[PARTS][PART_ROWS];
  threadgroup float sh_acc[PARTS][PART_ROWS][D];
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
    for (int d = 0; d < DPL; ++d) sh_acc[group][i][sub * DPL + d] = acc[i][d];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
// what split_epilogue.h needs of a backend; defined in the body, since MLX adds the
// thread_index_in_threadgroup attribute only where the body names it
#define KV_NEG_INF (-INFINITY)
#define KV_THREAD thread_index_in_threadgroup
#define KV_MAX metal::max
#define KV_EXP2 metal::exp2
#define KV_UNROLL_PARTS
#include "split_epilogue.h"
