// The query prologue of the lane-group split kernels (cuda_lane_split.cu and
// metal_split.metal; kernels/sources.py pastes it in): this block's grouped query rows, the
// lane's DPL head-dim values of each, rotated if ROTATE, scaled into the log2 domain, with
// their sums (packed keys score as scale * (q . codes) + offset * sum(q)).
// The body provides D, DPL, GW, ROWS, ROTATE, chunk, context, num_queries, batch, head,
// num_kv_heads, rows_total, sub, queries, signs and qscale (scale * log2(e), times
// rsqrt(D) when ROTATE); the backend header KV_UNROLL (an unroll pragma, or nothing) and
// KV_SHUFFLE_XOR(value, lane_mask).
// Declares q[ROWS][DPL], q_sum[ROWS] and q_pos[ROWS] (each row's position in its sequence).
  float q[ROWS][DPL];
  float q_sum[ROWS];
  int q_pos[ROWS];
  const int row0 = chunk * ROWS;
  KV_UNROLL
  for (int i = 0; i < ROWS; ++i) {
    const int r = row0 + i;
    q_pos[i] = context - num_queries + (r % num_queries);
    const size_t at = ((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + sub * DPL;
    KV_UNROLL
    for (int d = 0; d < DPL; ++d) q[i][d] = (r < rows_total) ? static_cast<float>(queries[at + d]) : 0.f;
    if (ROTATE) {
      // x @ diag(s) @ H: signs, then a fast Walsh-Hadamard transform (in registers for
      // strides < DPL, across the lane group with shuffles above)
      KV_UNROLL
      for (int d = 0; d < DPL; ++d) q[i][d] *= signs[sub * DPL + d];
      KV_UNROLL
      for (int h = 1; h < DPL; h <<= 1)
        KV_UNROLL
        for (int d = 0; d < DPL; ++d)
          if ((d & h) == 0) { const float a = q[i][d], b = q[i][d + h]; q[i][d] = a + b; q[i][d + h] = a - b; }
      KV_UNROLL
      for (int h = 1; h < GW; h <<= 1)
        KV_UNROLL
        for (int d = 0; d < DPL; ++d) {
          const float other = KV_SHUFFLE_XOR(q[i][d], h);
          q[i][d] = (sub & h) ? other - q[i][d] : q[i][d] + other;
        }
    }
    q_sum[i] = 0.f;
    KV_UNROLL
    for (int d = 0; d < DPL; ++d) { q[i][d] *= qscale; q_sum[i] += q[i][d]; }
  }
