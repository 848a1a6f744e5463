"""The Metal kernels of direct paged attention (mx.fast.metal_kernel), for Apple GPUs.

The same algorithm, launch plan and partial layout as kernels/cuda.py (see
kernels/direct.py): a split kernel writing per-split (max, sum, output) partials in the
log2 domain, and a merge kernel. This port keeps the plain form of the CUDA kernel: one
shuffle reduction per score (simd_shuffle_xor), no software pipelining, no shared-memory
block table. It has not run here (no Apple GPU on the build machine or the H200 host);
tests/kernels/test_attention.py runs it against the reference where Metal exists and skips
with a stated reason elsewhere.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import direct

HEADER = r"""
template <int BITS>
inline float kv_code(uint word, int i) {
  constexpr int PER = 32 / BITS;
  return float((word >> (BITS * (i % PER))) & ((1u << BITS) - 1u));
}
"""

SPLIT_BODY = r"""
  constexpr int GW = D / DPL;
  constexpr int GPW = 32 / GW;
  constexpr int WARP_TOKENS = GPW * UNROLL;
  constexpr int NGROUPS = NUM_WARPS * GPW;
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float NEG_INF = -INFINITY;

  const int rows_total = meta[0];
  const int num_queries = meta[1];
  const int split_tokens = meta[2];
  const int window = meta[3];
  const int first_key = meta[4];
  const int row_chunks = meta[5];
  float qscale = as_type<float>(meta[6]) * LOG2E;

  const int split = threadgroup_position_in_grid.x;
  const int num_splits = threadgroups_per_grid.x;
  const int head = threadgroup_position_in_grid.y / row_chunks;
  const int chunk = threadgroup_position_in_grid.y % row_chunks;
  const int batch = threadgroup_position_in_grid.z;
  const int num_kv_heads = kc_shape[1];
  const int table_width = block_tables_shape[1];

  const int lane = thread_index_in_simdgroup;
  const int warp = simdgroup_index_in_threadgroup;
  const int sub = lane % GW;
  const int group = warp * GPW + lane / GW;

  const int context = meta[7 + batch];
  const int start = first_key + split * split_tokens;
  const int stop = min(context, start + split_tokens);

  float q[ROWS][DPL];
  float q_sum[ROWS];
  int q_pos[ROWS];
  const int row0 = chunk * ROWS;
  if (ROTATE) qscale *= metal::rsqrt(float(D));
  for (int i = 0; i < ROWS; ++i) {
    const int r = row0 + i;
    q_pos[i] = context - num_queries + (r % num_queries);
    const size_t at = ((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + sub * DPL;
    for (int d = 0; d < DPL; ++d) q[i][d] = (r < rows_total) ? float(queries[at + d]) : 0.f;
    if (ROTATE) {
      for (int d = 0; d < DPL; ++d) q[i][d] *= signs[sub * DPL + d];
      for (int h = 1; h < DPL; h <<= 1)
        for (int d = 0; d < DPL; ++d)
          if ((d & h) == 0) { float a = q[i][d], b = q[i][d + h]; q[i][d] = a + b; q[i][d + h] = a - b; }
      for (int h = 1; h < GW; h <<= 1)
        for (int d = 0; d < DPL; ++d) {
          float other = simd_shuffle_xor(q[i][d], ushort(h));
          q[i][d] = (sub & h) ? other - q[i][d] : q[i][d] + other;
        }
    }
    q_sum[i] = 0.f;
    for (int d = 0; d < DPL; ++d) { q[i][d] *= qscale; q_sum[i] += q[i][d]; }
  }

  float m[ROWS], l[ROWS], acc[ROWS][DPL];
  for (int i = 0; i < ROWS; ++i) {
    m[i] = NEG_INF; l[i] = 0.f;
    for (int d = 0; d < DPL; ++d) acc[i][d] = 0.f;
  }

  for (int base = start + warp * WARP_TOKENS; base < stop; base += NUM_WARPS * WARP_TOKENS) {
    const int t0 = base + (lane / GW) * UNROLL;
    float s[UNROLL][ROWS];
    size_t at[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u;
      const int block = j < stop ? block_tables[batch * table_width + j / BLOCK_SIZE] : 0;
      at[u] = ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE);
      float kv[DPL];
      float k_scale = 1.f, k_offset = 0.f;
      if (j < stop) {
        {load_k}
      } else {
        for (int d = 0; d < DPL; ++d) kv[d] = 0.f;
      }
      for (int i = 0; i < ROWS; ++i) {
        float dot = 0.f;
        for (int d = 0; d < DPL; ++d) dot = metal::fma(q[i][d], kv[d], dot);
        s[u][i] = metal::fma(k_scale, dot, k_offset * q_sum[i]);
      }
    }
    for (int u = 0; u < UNROLL; ++u)
      for (int i = 0; i < ROWS; ++i)
        for (int o = GW / 2; o > 0; o >>= 1) s[u][i] += simd_shuffle_xor(s[u][i], ushort(o));
    for (int i = 0; i < ROWS; ++i) {
      float chunk_max = m[i];
      for (int u = 0; u < UNROLL; ++u) {
        const int j = t0 + u;
        bool visible = j < stop;
        if (CAUSAL) visible = visible && j <= q_pos[i];
        if (WINDOWED) visible = visible && j > q_pos[i] - window;
        s[u][i] = visible ? s[u][i] : NEG_INF;
        chunk_max = metal::max(chunk_max, s[u][i]);
      }
      if (chunk_max == NEG_INF) {
        for (int u = 0; u < UNROLL; ++u) s[u][i] = 0.f;
        continue;
      }
      const float correction = metal::exp2(m[i] - chunk_max);
      m[i] = chunk_max;
      l[i] *= correction;
      for (int d = 0; d < DPL; ++d) acc[i][d] *= correction;
      for (int u = 0; u < UNROLL; ++u) {
        s[u][i] = metal::exp2(s[u][i] - chunk_max);
        l[i] += s[u][i];
      }
    }
    for (int u = 0; u < UNROLL; ++u) {
      if (t0 + u >= stop) continue;
      float kv[DPL];
      float v_scale = 1.f, v_offset = 0.f;
      {load_v}
      for (int d = 0; d < DPL; ++d) {
        const float value = metal::fma(kv[d], v_scale, v_offset);
        for (int i = 0; i < ROWS; ++i) acc[i][d] = metal::fma(s[u][i], value, acc[i][d]);
      }
    }
  }

  threadgroup float sh_m[NGROUPS][ROWS];
  threadgroup float sh_l[NGROUPS][ROWS];
  threadgroup float sh_acc[NGROUPS][ROWS][D];
  for (int i = 0; i < ROWS; ++i) {
    if (sub == 0) { sh_m[group][i] = m[i]; sh_l[group][i] = l[i]; }
    for (int d = 0; d < DPL; ++d) sh_acc[group][i][sub * DPL + d] = acc[i][d];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = thread_index_in_threadgroup; e < ROWS * D; e += NUM_WARPS * 32) {
    const int i = e / D;
    const int d = e % D;
    const int r = row0 + i;
    if (r >= rows_total) continue;
    float best = NEG_INF;
    for (int g = 0; g < NGROUPS; ++g) best = metal::max(best, sh_m[g][i]);
    float total = 0.f, out = 0.f;
    if (best != NEG_INF) {
      for (int g = 0; g < NGROUPS; ++g) {
        const float w = metal::exp2(sh_m[g][i] - best);
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

LOAD_NATIVE_K = "for (int d = 0; d < DPL; ++d) kv[d] = float(kc[at[u] * D + sub * DPL + d]);"
LOAD_NATIVE_V = "for (int d = 0; d < DPL; ++d) kv[d] = float(vc[at[u] * D + sub * DPL + d]);"
LOAD_PACKED_K = (
    "device const uint* words = (device const uint*)(kc + at[u] * (D * K_BITS / 8) + sub * (DPL * K_BITS / 8));"
    " for (int d = 0; d < DPL; ++d) kv[d] = kv_code<K_BITS>(words[d / (32 / K_BITS)], d);"
    " k_scale = ks[at[u] * (D / GROUP) + (sub * DPL) / GROUP];"
    " k_offset = ko[at[u] * (D / GROUP) + (sub * DPL) / GROUP];"
)
LOAD_PACKED_V = (
    "device const uint* words = (device const uint*)(vc + at[u] * (D * V_BITS / 8) + sub * (DPL * V_BITS / 8));"
    " for (int d = 0; d < DPL; ++d) kv[d] = kv_code<V_BITS>(words[d / (32 / V_BITS)], d);"
    " v_scale = vs[at[u] * (D / GROUP) + (sub * DPL) / GROUP];"
    " v_offset = vo[at[u] * (D / GROUP) + (sub * DPL) / GROUP];"
)

MERGE_BODY = r"""
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
"""

_KERNELS: dict[tuple, object] = {}


def split_source(packed: bool) -> str:
    load_k, load_v = (LOAD_PACKED_K, LOAD_PACKED_V) if packed else (LOAD_NATIVE_K, LOAD_NATIVE_V)
    return SPLIT_BODY.replace("{load_k}", load_k).replace("{load_v}", load_v)


def _split_kernel(packed: bool):
    key = ("split", packed)
    if key not in _KERNELS:
        planes = ["kc", "ks", "ko", "vc", "vs", "vo"] if packed else ["kc", "vc"]
        _KERNELS[key] = mx.fast.metal_kernel(
            name=f"kvstore_paged_split_{'packed' if packed else 'native'}",
            input_names=["queries", "signs", *planes, "block_tables", "meta"],
            output_names=["part_o", "part_ml"],
            source=split_source(packed),
            header=HEADER,
        )
    return _KERNELS[key]


def _merge_kernel():
    if "merge" not in _KERNELS:
        _KERNELS["merge"] = mx.fast.metal_kernel(
            name="kvstore_paged_merge",
            input_names=["part_o", "part_ml", "sinks", "meta"],
            output_names=["result"],
            source=MERGE_BODY,
        )
    return _KERNELS["merge"]


def launch(plan: direct.LaunchPlan) -> mx.array:
    """Run the split and merge kernels of one planned call; returns [B, Hq, L, Dv]."""
    return direct.run_split_merge(plan, _split_kernel(plan.packed), _merge_kernel())
