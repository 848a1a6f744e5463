// Quantize-on-write for packed pages: one launch encodes a write's keys and values (every
// token and KV head of one layer) into the six planes of kernels/layout.py. The MLX-ops
// reference is kernels/quant.py's quantize; kernels/quantize.py launches this and holds the
// switch. Template parameters: K_BITS, V_BITS, GROUP, DK, DV, NDIM (the inputs' rank), KT, VT
// (the inputs' dtypes). Inputs are row-contiguous [..., DK] and [..., DV] with the same
// leading dims; outputs are the planes over the same rows (their shapes are the launcher's).
//
// One thread per (row, group), rows = kv_heads * tokens of the keys, then of the values.
// The arithmetic is the reference's, op for op in float32 with IEEE division (__fdiv_rn:
// NVRTC may be asked for fast math) and round-half-to-even (rintf), so the codes, scales and
// offsets equal the reference's bit for bit on the same input:
//   offset = min(x), scale = (max(x) - min(x)) / (2^bits - 1)
//   code   = clip(round((x - offset) / (scale > 0 ? scale : 1)), 0, 2^bits - 1)
// 4-bit codes pack element 2j into the low nibble of byte j.
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  constexpr int KG = DK / GROUP;
  constexpr int VG = DV / GROUP;
  int rows = 1;
#pragma unroll
  for (int i = 0; i < NDIM - 1; ++i) rows *= keys_shape[i];
  const int k_threads = rows * KG;
  const int v_threads = rows * VG;
  if (t < k_threads) {
    const int row = t / KG, g = t % KG;
    kvstore_quantize_group<K_BITS, GROUP>(keys + (size_t)row * DK + g * GROUP,
                                          k_codes + (size_t)row * (DK * K_BITS / 8) + g * (GROUP * K_BITS / 8),
                                          k_scales + (size_t)row * KG + g, k_offsets + (size_t)row * KG + g);
  } else if (t < k_threads + v_threads) {
    const int u = t - k_threads;
    const int row = u / VG, g = u % VG;
    kvstore_quantize_group<V_BITS, GROUP>(values + (size_t)row * DV + g * GROUP,
                                          v_codes + (size_t)row * (DV * V_BITS / 8) + g * (GROUP * V_BITS / 8),
                                          v_scales + (size_t)row * VG + g, v_offsets + (size_t)row * VG + g);
  }
