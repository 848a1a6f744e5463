// The Metal merge kernel: the log-sum-exp merge of a row's split partials and its sink.
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float NEG_INF = -INFINITY;
  const int flat = threadgroup_position_in_grid.x;
  const int d = thread_index_in_threadgroup;
  const int num_splits = part_ml_shape[1];
  float best = NEG_INF;
  for (int s = 0; s < num_splits; ++s) best = metal::max(best, part_ml[(flat * num_splits + s) * 2]);
  float sink = NEG_INF;
  if (HAS_SINKS) {
    const int head = (flat / meta[1]) % sinks_shape[0];
    sink = sinks[head] * LOG2E;
    best = metal::max(best, sink);
  }
  float total = HAS_SINKS ? metal::exp2(sink - best) : 0.f;
  float out = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float ms = part_ml[(flat * num_splits + s) * 2];
    if (ms == NEG_INF) continue;
    const float w = metal::exp2(ms - best);
    total += w * part_ml[(flat * num_splits + s) * 2 + 1];
    out += w * part_o[((size_t)flat * num_splits + s) * D + d];
  }
  result[(size_t)flat * D + d] = static_cast<OutT>(out / total);
