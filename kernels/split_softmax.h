// One step of the lane-group split kernels' online softmax (cuda_lane_split.cu and
// metal_split.metal; kernels/sources.py pastes it in): mask the step's UNROLL scores per
// query row by context, causality and window, then fold them into the row's running
// (max m, sum l, output acc, value offsets) in the log2 domain; s[u][i] ends as the
// token's weight (0 where masked). A row that has seen nothing keeps max -inf.
// The body provides UNROLL, ROWS, DPL, CAUSAL, WINDOWED, s[UNROLL][ROWS], t0 (the lane
// group's first token of the step), stop, window, q_pos, m, l, acc, value_offsets; the
// backend header KV_UNROLL, KV_NEG_INF, KV_MAX and KV_EXP2.
  KV_UNROLL
  for (int i = 0; i < ROWS; ++i) {
    float chunk_max = m[i];
    KV_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u;
      bool visible = j < stop;
      if (CAUSAL) visible = visible && j <= q_pos[i];
      if (WINDOWED) visible = visible && j > q_pos[i] - window;
      s[u][i] = visible ? s[u][i] : KV_NEG_INF;
      chunk_max = KV_MAX(chunk_max, s[u][i]);
    }
    if (chunk_max == KV_NEG_INF) {
      KV_UNROLL
      for (int u = 0; u < UNROLL; ++u) s[u][i] = 0.f;
      continue;
    }
    const float correction = KV_EXP2(m[i] - chunk_max);
    m[i] = chunk_max;
    l[i] *= correction;
    value_offsets[i] *= correction;
    KV_UNROLL
    for (int d = 0; d < DPL; ++d) acc[i][d] *= correction;
    KV_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      s[u][i] = KV_EXP2(s[u][i] - chunk_max);
      l[i] += s[u][i];
    }
  }
