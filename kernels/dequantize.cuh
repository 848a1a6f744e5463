// The per-byte step of kernels/dequantize.cu (see its head comment for the arithmetic).
// t: this thread's byte of the half, in output order (byte w of token tok of table entry j
// of head h, w fastest); the codes of one packed plane [N, H, BS, W] and its scales and
// offsets [N, H, BS, D / GROUP] float32; out [H, n * BS, D].
template <int BITS, int GROUP, int W, int D, int H, int BS, typename OT>
__device__ inline void kvstore_dequantize_byte(long t, int n, const int* block_ids,
                                               const unsigned char* codes, const float* scales,
                                               const float* offsets, OT* out) {
  constexpr int PER_BYTE = 8 / BITS;
  constexpr int GROUPS = D / GROUP;
  const int w = static_cast<int>(t % W);
  long r = t / W;
  const int tok = static_cast<int>(r % BS);
  r /= BS;
  const int j = static_cast<int>(r % n);
  const int h = static_cast<int>(r / n);
  const long row = (static_cast<long>(block_ids[j]) * H + h) * BS + tok;  // source token row
  const unsigned int byte = codes[row * W + w];
  const int g = (w * PER_BYTE) / GROUP;
  const float scale = scales[row * GROUPS + g];
  const float offset = offsets[row * GROUPS + g];
  OT* dst = out + ((static_cast<long>(h) * n + j) * BS + tok) * D + w * PER_BYTE;
  if constexpr (BITS == 8) {
    dst[0] = static_cast<OT>(__fadd_rn(__fmul_rn(static_cast<float>(byte), scale), offset));
  } else {
    dst[0] = static_cast<OT>(__fadd_rn(__fmul_rn(static_cast<float>(byte & 15u), scale), offset));
    dst[1] = static_cast<OT>(__fadd_rn(__fmul_rn(static_cast<float>(byte >> 4), scale), offset));
  }
}
