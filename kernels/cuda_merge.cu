// The merge kernel of both CUDA split kernels: the log-sum-exp merge of a row's split
// partials and its sink, cast to OutT. Template parameters: D, HAS_SINKS, OutT.
  // one block of D threads per output row. The split maxima and weights are reduced by the
  // whole block first, so the pass over part_o is a loop of independent loads, not one
  // serial global load per split (docs/kernels.md)
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
