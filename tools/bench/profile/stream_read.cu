// A plain streaming read of every page plane through mx.fast.cuda_kernel: the bandwidth
// floor of this launch path (h200_profile.py). Inputs a, d: code planes; b, c, e, f: scales.
  const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned int acc = 0;
  const uint4* pa = reinterpret_cast<const uint4*>(a);
  const uint4* pd = reinterpret_cast<const uint4*>(d);
  const size_t na = a_shape[0] * a_shape[1] * a_shape[2] * a_shape[3] / 16;
  const size_t nd = d_shape[0] * d_shape[1] * d_shape[2] * d_shape[3] / 16;
  for (size_t i = tid; i < na; i += stride) { uint4 r = __ldg(pa + i); acc ^= r.x ^ r.y ^ r.z ^ r.w; }
  for (size_t i = tid; i < nd; i += stride) { uint4 r = __ldg(pd + i); acc ^= r.x ^ r.y ^ r.z ^ r.w; }
  const float4* fb = reinterpret_cast<const float4*>(b);
  const float4* fc = reinterpret_cast<const float4*>(c);
  const float4* fe = reinterpret_cast<const float4*>(e);
  const float4* ff = reinterpret_cast<const float4*>(f);
  const size_t nb = b_shape[0] * b_shape[1] * b_shape[2] * b_shape[3] / 4;
  float facc = 0.f;
  for (size_t i = tid; i < nb; i += stride) {
    float4 x = __ldg(fb + i), y = __ldg(fc + i), z = __ldg(fe + i), w = __ldg(ff + i);
    facc += x.x + y.y + z.z + w.w;
  }
  if (acc == 0x12345678u && facc == 1.2345f) out[0] = 1.f;
  if (tid == 0) out[1] = 0.f;
