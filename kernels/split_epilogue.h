// The end of every split kernel (cuda_lane_split.cu, cuda_mma_split.cu, metal_split.metal;
// kernels/sources.py pastes it in where the body says #include "split_epilogue.h"): merge the
// PARTS online-softmax states of this block (its lane groups or warps) and write the split's
// partial (max, sum, output) per query row, log2 domain, for the merge kernel.
// The body provides:
//   PARTS, PART_ROWS   partial states per block, query rows per block (constexpr)
//   sh_m, sh_l         [PARTS][PART_ROWS] float in shared memory: each state's row max and sum
//   sh_acc             [PARTS][PART_ROWS][D] float in shared memory: each state's row output
//   row0, rows_total, batch, head, num_kv_heads, split, num_splits, part_o, part_ml
// and the backend header the macros KV_THREAD, KV_NEG_INF, KV_MAX, KV_EXP2 and
// KV_UNROLL_PARTS (the loops' unroll pragma, or nothing).
// part_o: [B * Hq * L, splits, D] float32; part_ml: [B * Hq * L, splits, 2] float32
  for (int e = KV_THREAD; e < PART_ROWS * D; e += NUM_WARPS * 32) {
    const int i = e / D;
    const int d = e % D;
    const int r = row0 + i;
    if (r >= rows_total) continue;
    float best = KV_NEG_INF;
    KV_UNROLL_PARTS
    for (int p = 0; p < PARTS; ++p) best = KV_MAX(best, sh_m[p][i]);
    float total = 0.f, out = 0.f;
    if (best != KV_NEG_INF) {
      KV_UNROLL_PARTS
      for (int p = 0; p < PARTS; ++p) {
        const float w = KV_EXP2(sh_m[p][i] - best);
        total += w * sh_l[p][i];
        out += w * sh_acc[p][i][d];
      }
    }
    const size_t flat = (size_t)(batch * num_kv_heads + head) * rows_total + r;
    part_o[(flat * num_splits + split) * D + d] = out;
    if (d == 0) {
      part_ml[(flat * num_splits + split) * 2] = best;
      part_ml[(flat * num_splits + split) * 2 + 1] = total;
    }
  }
