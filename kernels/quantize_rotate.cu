// Quantize-on-write with the key rotation inside (opt-in: KVSTORE_QUANTIZE_ROTATION=kernel,
// kernels/quantize.py). As kernels/quantize.cu, but the keys come unrotated and each key row
// is rotated by its thread: signs, then a fast Walsh-Hadamard transform in registers, then
// 1/sqrt(DK) (R = diag(signs) H / sqrt(d), kernels/hadamard.py). That drops the float32 cast
// and the matmul the reference launches before quantizing; the sums are taken in another
// order than the matmul's, so rotated values differ from the reference's by float32
// rounding and a code may differ by one step at a rounding boundary (the test's tolerance).
// Template parameters: K_BITS, V_BITS, GROUP, DK, DV, NDIM, KT, VT.
// Threads: one per key row (rotation + its DK / GROUP groups), then one per value group.
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  constexpr int KG = DK / GROUP;
  constexpr int VG = DV / GROUP;
  int rows = 1;
#pragma unroll
  for (int i = 0; i < NDIM - 1; ++i) rows *= keys_shape[i];
  if (t < rows) {
    float x[DK];
    const KT* src = keys + (size_t)t * DK;
#pragma unroll
    for (int i = 0; i < DK; ++i) x[i] = static_cast<float>(src[i]) * signs[i];
#pragma unroll
    for (int h = 1; h < DK; h <<= 1) {
#pragma unroll
      for (int i = 0; i < DK; i += 2 * h) {
#pragma unroll
        for (int j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
    const float norm = __fdiv_rn(1.f, sqrtf(static_cast<float>(DK)));
#pragma unroll
    for (int i = 0; i < DK; ++i) x[i] *= norm;
#pragma unroll
    for (int g = 0; g < KG; ++g)
      kvstore_quantize_group<K_BITS, GROUP>(x + g * GROUP,
                                            k_codes + (size_t)t * (DK * K_BITS / 8) + g * (GROUP * K_BITS / 8),
                                            k_scales + (size_t)t * KG + g, k_offsets + (size_t)t * KG + g);
  } else if (t < rows + rows * VG) {
    const int u = t - rows;
    const int row = u / VG, g = u % VG;
    kvstore_quantize_group<V_BITS, GROUP>(values + (size_t)row * DV + g * GROUP,
                                          v_codes + (size_t)row * (DV * V_BITS / 8) + g * (GROUP * V_BITS / 8),
                                          v_scales + (size_t)row * VG + g, v_offsets + (size_t)row * VG + g);
  }
