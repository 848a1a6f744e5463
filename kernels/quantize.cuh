// The per-group step of kernels/quantize.cu (see its head comment for the arithmetic).
template <int BITS, int GROUP, typename T>
__device__ inline void kvstore_quantize_group(const T* x, unsigned char* codes, float* scale_out,
                                              float* offset_out) {
  constexpr float LEVELS = static_cast<float>((1 << BITS) - 1);
  float lo = static_cast<float>(x[0]);
  float hi = lo;
  for (int i = 1; i < GROUP; ++i) {
    const float v = static_cast<float>(x[i]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const float scale = __fdiv_rn(hi - lo, LEVELS);
  const float safe = scale > 0.f ? scale : 1.f;
  auto code = [&](int i) -> unsigned int {
    const float q = rintf(__fdiv_rn(static_cast<float>(x[i]) - lo, safe));
    return static_cast<unsigned int>(fminf(fmaxf(q, 0.f), LEVELS));
  };
  if constexpr (BITS == 8) {
    for (int i = 0; i < GROUP; ++i) codes[i] = static_cast<unsigned char>(code(i));
  } else {
    for (int i = 0; i < GROUP; i += 2) codes[i / 2] = static_cast<unsigned char>(code(i) | (code(i + 1) << 4));
  }
  *scale_out = scale;
  *offset_out = lo;
}
