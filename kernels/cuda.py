"""The CUDA kernels of direct paged attention (mx.fast.cuda_kernel, JIT-compiled by NVRTC).

Two launches per call (the algorithm is in kernels/direct.py's docstring):
  split kernel   grid (splits, Hkv * row_chunks, B), NUM_WARPS warps per block. Each block
                 reads its split's tokens through the block table once for up to ROWS_PER_BLOCK
                 grouped query rows and writes a partial (max, sum, output) per row.
  merge kernel   grid (B * Hq * L), Dv threads: log-sum-exp merge of the split partials and
                 the optional sink, cast to the output dtype.

Lane layout: a "lane group" of D/16 lanes owns one token at a time, each lane 16 head_dim
values (16-byte loads for 8-bit codes, 8-byte for 4-bit, 32 bytes for bf16). A warp holds
32/(D/16) lane groups; each lane group keeps its own online-softmax state and the groups
of a block are merged through shared memory at the end. Scores live in the log2 domain
(queries carry scale * log2(e)), so exp2f is the only transcendental.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import direct

HEADER = r"""
#define KV_NEG_INF (-cuda::std::numeric_limits<float>::infinity())

template <typename T>
__device__ __forceinline__ void kv_load16(const T* __restrict__ src, float* dst) {
  constexpr int WORDS = 16 * sizeof(T) / 16;
  uint4 raw[WORDS];
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < WORDS; ++i) raw[i] = __ldg(s + i);
  const T* vals = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>(vals[i]);
}

// 16 codes of BITS bits (element 2j in the low nibble of byte j for 4 bits) -> floats.
template <int BITS>
__device__ __forceinline__ void kv_codes16(const uint8_t* __restrict__ src, float* dst) {
  if constexpr (BITS == 8) {
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>((w[i / 4] >> (8 * (i % 4))) & 0xFFu);
  } else {
    uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
    unsigned int w[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>((w[i / 8] >> (4 * (i % 8))) & 0xFu);
  }
}
"""

# The split kernel body. {load_k} / {load_v} fill kv[16] (values) for token row `at`
# (flat index into the [blocks, Hkv, block_size] token rows) and set k_scale/k_offset.
SPLIT_BODY = r"""
  constexpr int GW = D / 16;             // lanes per lane group
  constexpr int GPW = 32 / GW;           // lane groups per warp
  constexpr int WARP_TOKENS = GPW * UNROLL;
  constexpr int NGROUPS = NUM_WARPS * GPW;
  constexpr float LOG2E = 1.4426950408889634f;

  const int rows_total = params[0];
  const int num_queries = params[1];
  const int split_tokens = params[2];
  const int window = params[3];
  const int first_key = params[4];
  const int row_chunks = params[5];
  const float qscale = fparams[0] * LOG2E;

  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int head = blockIdx.y / row_chunks;
  const int chunk = blockIdx.y % row_chunks;
  const int batch = blockIdx.z;
  const int num_kv_heads = KV_HEADS_OF;
  const int table_width = block_tables_shape[1];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % GW;
  const int group = warp * GPW + lane / GW;

  const int context = lens[batch];
  const int start = first_key + split * split_tokens;
  const int stop = min(context, start + split_tokens);

  // queries of this block's rows, this lane's 16 dims, in the log2 domain
  float q[ROWS][16];
  float q_sum[ROWS];
  int q_pos[ROWS];
  const int row0 = chunk * ROWS;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = row0 + i;
    q_sum[i] = 0.f;
    q_pos[i] = context - num_queries + (r % num_queries);
    if (r < rows_total) {
      kv_load16(queries + ((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + sub * 16, q[i]);
    } else {
#pragma unroll
      for (int d = 0; d < 16; ++d) q[i][d] = 0.f;
    }
#pragma unroll
    for (int d = 0; d < 16; ++d) { q[i][d] *= qscale; q_sum[i] += q[i][d]; }
  }

  float m[ROWS], l[ROWS], acc[ROWS][16];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    m[i] = KV_NEG_INF; l[i] = 0.f;
#pragma unroll
    for (int d = 0; d < 16; ++d) acc[i][d] = 0.f;
  }

  for (int base = start + warp * WARP_TOKENS; base < stop; base += NUM_WARPS * WARP_TOKENS) {
    const int t0 = base + (lane / GW) * UNROLL;
    float s[UNROLL][ROWS];
    size_t at[UNROLL];
    bool live[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u;
      live[u] = j < stop;
      const int block = live[u] ? block_tables[batch * table_width + j / BLOCK_SIZE] : 0;
      at[u] = ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kv[16];
      float k_scale = 1.f, k_offset = 0.f;
      if (live[u]) {
        {load_k}
      } else {
#pragma unroll
        for (int d = 0; d < 16; ++d) kv[d] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        float dot = 0.f;
#pragma unroll
        for (int d = 0; d < 16; ++d) dot = fmaf(q[i][d], kv[d], dot);
        s[u][i] = fmaf(k_scale, dot, k_offset * q_sum[i]);
      }
    }
    // reduce the partial dots over the lane group
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int o = GW / 2; o > 0; o >>= 1) s[u][i] += __shfl_xor_sync(0xffffffffu, s[u][i], o);
    // mask, then the online-softmax update over UNROLL tokens at once
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      float chunk_max = m[i];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int j = t0 + u;
        bool visible = live[u];
        if (CAUSAL) visible = visible && j <= q_pos[i];
        if (WINDOWED) visible = visible && j > q_pos[i] - window;
        s[u][i] = visible ? s[u][i] : KV_NEG_INF;
        chunk_max = fmaxf(chunk_max, s[u][i]);
      }
      if (chunk_max == KV_NEG_INF) continue;
      const float correction = exp2f(m[i] - chunk_max);
      m[i] = chunk_max;
      l[i] *= correction;
#pragma unroll
      for (int d = 0; d < 16; ++d) acc[i][d] *= correction;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u][i] = exp2f(s[u][i] - chunk_max);
        l[i] += s[u][i];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (!live[u]) continue;
      float kv[16];
      float v_scale = 1.f, v_offset = 0.f;
      {load_v}
#pragma unroll
      for (int d = 0; d < 16; ++d) {
        const float value = fmaf(kv[d], v_scale, v_offset);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
          const float p = (m[i] == KV_NEG_INF) ? 0.f : s[u][i];
          acc[i][d] = fmaf(p, value, acc[i][d]);
        }
      }
    }
  }

  // merge the lane groups of this block through shared memory
  __shared__ float sh_m[NGROUPS][ROWS];
  __shared__ float sh_l[NGROUPS][ROWS];
  __shared__ float sh_acc[NGROUPS][ROWS][D];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
#pragma unroll
    for (int d = 0; d < 16; ++d) sh_acc[group][i][sub * 16 + d] = acc[i][d];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ROWS * D; e += NUM_WARPS * 32) {
    const int i = e / D;
    const int d = e % D;
    const int r = row0 + i;
    if (r >= rows_total) continue;
    float best = KV_NEG_INF;
    for (int g = 0; g < NGROUPS; ++g) best = fmaxf(best, sh_m[g][i]);
    float total = 0.f, out = 0.f;
    if (best != KV_NEG_INF) {
      for (int g = 0; g < NGROUPS; ++g) {
        const float w = exp2f(sh_m[g][i] - best);
        total += w * sh_l[g][i];
        out += w * sh_acc[g][i][d];
      }
    }
    const size_t flat = (size_t)(batch * num_kv_heads + head) * rows_total + r;
    part_o[(flat * num_splits + split) * D + d] = out;
    if (d == 0) {
      part_ml[(flat * num_splits + split) * 2] = best;
      part_ml[(flat * num_splits + split) * 2 + 1] = total;
    }
  }
"""

LOAD_NATIVE_K = "kv_load16(kc + at[u] * D + sub * 16, kv);"
LOAD_NATIVE_V = "kv_load16(vc + at[u] * D + sub * 16, kv);"
LOAD_PACKED_K = (
    "kv_codes16<K_BITS>(kc + at[u] * (D * K_BITS / 8) + sub * (16 * K_BITS / 8), kv);"
    " k_scale = ks[at[u] * (D / GROUP) + (sub * 16) / GROUP];"
    " k_offset = ko[at[u] * (D / GROUP) + (sub * 16) / GROUP];"
)
LOAD_PACKED_V = (
    "kv_codes16<V_BITS>(vc + at[u] * (D * V_BITS / 8) + sub * (16 * V_BITS / 8), kv);"
    " v_scale = vs[at[u] * (D / GROUP) + (sub * 16) / GROUP];"
    " v_offset = vo[at[u] * (D / GROUP) + (sub * 16) / GROUP];"
)

MERGE_BODY = r"""
  constexpr float LOG2E = 1.4426950408889634f;
  const int flat = blockIdx.x;
  const int d = threadIdx.x;
  const int num_splits = part_ml_shape[1];
  float best = KV_NEG_INF;
  for (int s = 0; s < num_splits; ++s) best = fmaxf(best, part_ml[(flat * num_splits + s) * 2]);
  float sink = KV_NEG_INF;
  if (HAS_SINKS) {
    const int head = (flat / params[1]) % sinks_shape[0];
    sink = static_cast<float>(sinks[head]) * LOG2E;
    best = fmaxf(best, sink);
  }
  float total = HAS_SINKS ? exp2f(sink - best) : 0.f;
  float out = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float ms = part_ml[(flat * num_splits + s) * 2];
    if (ms == KV_NEG_INF) continue;
    const float w = exp2f(ms - best);
    total += w * part_ml[(flat * num_splits + s) * 2 + 1];
    out += w * part_o[((size_t)flat * num_splits + s) * D + d];
  }
  result[(size_t)flat * D + d] = static_cast<OutT>(out / total);
"""

_KERNELS: dict[tuple, object] = {}


def _split_kernel(packed: bool):
    key = ("split", packed)
    if key not in _KERNELS:
        if packed:
            inputs = ["queries", "kc", "ks", "ko", "vc", "vs", "vo", "block_tables", "lens", "params", "fparams"]
            body = SPLIT_BODY.replace("{load_k}", LOAD_PACKED_K).replace("{load_v}", LOAD_PACKED_V)
        else:
            inputs = ["queries", "kc", "vc", "block_tables", "lens", "params", "fparams"]
            body = SPLIT_BODY.replace("{load_k}", LOAD_NATIVE_K).replace("{load_v}", LOAD_NATIVE_V)
        body = body.replace("KV_HEADS_OF", "kc_shape[1]")
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"kvstore_paged_split_{'packed' if packed else 'native'}",
            input_names=inputs,
            output_names=["part_o", "part_ml"],
            source=body,
            header=HEADER,
        )
    return _KERNELS[key]


def _merge_kernel():
    if "merge" not in _KERNELS:
        _KERNELS["merge"] = mx.fast.cuda_kernel(
            name="kvstore_paged_merge",
            input_names=["part_o", "part_ml", "sinks", "params"],
            output_names=["result"],
            source=MERGE_BODY,
            header=HEADER,
        )
    return _KERNELS["merge"]


def launch(plan: direct.LaunchPlan) -> mx.array:
    """Run the split and merge kernels of one planned call; returns [B, Hq, L, Dv]."""
    split = _split_kernel(plan.packed)
    part_o, part_ml = split(
        inputs=plan.split_inputs,
        template=plan.split_template,
        grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
        threadgroup=(plan.threads, 1, 1),
        output_shapes=[plan.partial_shape + (plan.head_dim,), plan.partial_shape + (2,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (result,) = _merge_kernel()(
        inputs=[part_o, part_ml, plan.sinks, plan.params],
        template=plan.merge_template,
        grid=(plan.partial_shape[0] * plan.head_dim, 1, 1),
        threadgroup=(plan.head_dim, 1, 1),
        output_shapes=[plan.output_shape],
        output_dtypes=[plan.output_dtype],
    )
    return result
