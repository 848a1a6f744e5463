// Gather and dequantize packed pages for prefill (kernels/prefill.py): one launch reads the
// blocks a table names from the six planes of kernels/layout.py and writes keys
// [1, H, n * BS, DK] and values [1, H, n * BS, DV] in OT, in token order. The MLX-ops
// reference is kernels/paging.py's gather_pages (kernels/quant.py's dequantize); this is
// the same arithmetic op for op, each rounded on its own (__fmul_rn, __fadd_rn: no fused
// multiply-add), then one cast, so the output equals the reference's bit for bit:
//   x = code * scale + offset   (float32), then OT
// Template parameters: K_BITS, V_BITS, GROUP, DK, DV, KW, VW (code bytes per row), H, BS,
// OT. One thread per code byte of the keys, then of the values; block_ids is [n] int32.
  const long t = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int n = block_ids_shape[0];
  const long k_threads = static_cast<long>(n) * H * BS * KW;
  const long v_threads = static_cast<long>(n) * H * BS * VW;
  if (t < k_threads) {
    kvstore_dequantize_byte<K_BITS, GROUP, KW, DK, H, BS, OT>(t, n, block_ids, kc, ks, ko, keys);
  } else if (t < k_threads + v_threads) {
    kvstore_dequantize_byte<V_BITS, GROUP, VW, DV, H, BS, OT>(t - k_threads, n, block_ids, vc, vs, vo, values);
  }
