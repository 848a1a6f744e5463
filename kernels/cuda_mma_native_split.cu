// The tensor-core split kernel for native (unquantized, unrotated) fp16/bf16 pages
// (kernels/cuda_mma.py compiles it; direct._build_native_mma_plan plans it). Same plan,
// partial layout and merge as the other split kernels; what differs from cuda_mma_split.cu is
// that the page elements go into the mma as they are stored: no unpacking, no scales.
//
// Template: D, ROWS16, NUM_WARPS, BLOCK_SIZE (a multiple of 16), CAUSAL, WINDOWED, TABLE_CAP,
// STAGES (cp.async ring depth, >= 2), KvT (the pages' and the queries' element type), SMEM
// (dynamic shared bytes: the rings, then the warps' partial outputs). meta as the other split
// kernels', first_key and split_tokens multiples of 16.
//
// One warp step: 16 tokens (T0..T0+15) of this KV head; lane = 4 * gid + tig.
//   Ring         each warp stages its next STAGES - 1 steps of raw K and V bytes in shared
//                memory with cp.async (16 tokens of a block are one contiguous run per plane;
//                each lane copies fixed 16-byte pieces; tokens past the context are zero-filled,
//                so a stale slot never feeds a NaN into the mma). A token's row of D elements is
//                D/8 16-byte chunks, stored at chunk ^ (token & 7): the 8 rows of one ldmatrix
//                matrix then fall in 8 different bank quads (no conflicts).
//   S = Q K^T    m16n8k16, M = 16 query rows (rows past the chunk's are zero), N = 8 tokens per
//                n-tile (two), K = 16 head dims per k-step. The query fragments are loaded once
//                from global memory in the standard layout (unscaled: the queries are the
//                pages' type, so they enter exactly); the B fragments come from ldmatrix on the
//                ring, whose row-per-token layout is already the mma's column-major B. The
//                scale (times log2 e) is applied to the fp32 scores.
//   P            online softmax in the log2 domain on the S fragments, as cuda_mma_split.cu.
//   O^T = V^T P^T  m16n8k16, M = 16 head dims, N = 8 query rows, K = the 16 tokens: the A
//                fragments (two tokens of one dim per register) are ldmatrix.trans of the V
//                ring; the S fragments, rounded to KvT, are P^T as they are.
// Precision: products of KvT values accumulate in fp32; the probabilities are rounded to KvT
// for the second mma (bf16: 8-bit significand, as a bf16 SDPA's own P).
  constexpr int RM = ROWS16 ? 16 : 8;   // query rows of this block
  constexpr int KSTEPS = D / 16;        // k-steps of S; m-tiles of O^T
  constexpr int CH = D / 8;             // 16-byte chunks per token row
  constexpr int ROWB = D * 2;           // bytes per token row (16-bit elements)
  constexpr int RUN = 16 * ROWB;        // one plane's bytes per step
  constexpr int SLOT = 2 * RUN;         // a step's K then V
  constexpr int PIECES = RUN / 16 / 32; // 16-byte pieces per lane per plane and step
  constexpr int RING = NUM_WARPS * STAGES * SLOT;
  constexpr int OBYTES = NUM_WARPS * RM * D * 4;
  constexpr int AHEAD = STAGES - 1;     // steps in flight beyond the current one
  constexpr int ITER = NUM_WARPS * 16;  // tokens per block iteration
  constexpr float LOG2E = 1.4426950408889634f;
  static_assert(BLOCK_SIZE % 16 == 0, "a step's 16 tokens lie in one block");
  static_assert(STAGES >= 2, "the ring needs a slot beyond the current step");
  static_assert(sizeof(KvT) == 2, "16-bit pages");
  static_assert(CH <= 32 && 32 % CH == 0 && PIECES >= 1, "head dim 64, 128 or 256");
  static_assert(SMEM >= RING && SMEM >= OBYTES, "dynamic shared memory is smaller than the layout");

#include "split_prologue.cuh"
  const int gid = lane >> 2;
  const int tig = lane & 3;
  extern __shared__ __align__(16) uint8_t sh_dynamic[];
  const int row0 = chunk * RM;
  __syncthreads();  // sh_table is in place

  // query fragments (A of S), standard layout: qa[ks] = rows (gid, gid + 8) x dims
  // (16ks + 2tig, +1) and (16ks + 8 + 2tig, +1); rows past the chunk's are zero
  unsigned int qa[KSTEPS][4];
  {
    const unsigned int* q32 = reinterpret_cast<const unsigned int*>(queries);
    const size_t qrow = (size_t)(batch * num_kv_heads + head) * rows_total;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + gid + 8 * r;
      const bool live = (r == 0 || ROWS16) && row < rows_total;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int s = 0; s < 2; ++s)
          qa[ks][2 * s + r] = live ? __ldg(q32 + ((qrow + row) * D + 16 * ks + 8 * s + 2 * tig) / 2) : 0u;
    }
  }

  auto page_at = [&](int j) -> size_t {
    const int e = static_cast<int>(static_cast<unsigned int>(j) / BLOCK_SIZE) - first_block;  // j >= 0
    const int block = e < TABLE_CAP ? sh_table[e] : block_tables[batch * table_width + j / BLOCK_SIZE];
    return ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE);
  };
  // this warp's ring; lane's pieces p = lane + 32 i of each plane's run: token p / CH, chunk
  // lane % CH, stored at token * ROWB + 16 * (chunk ^ (token & 7))
  uint8_t* const ring = sh_dynamic + warp * STAGES * SLOT;
  const unsigned int ring_s = static_cast<unsigned int>(__cvta_generic_to_shared(ring));
  auto piece_to = [&](int i) -> int {
    const int p = lane + 32 * i, token = p / CH;
    return token * ROWB + 16 * ((p % CH) ^ (token & 7));
  };
  auto issue = [&](int slot, int t) {
    const size_t at = page_at(t);
    const int live = stop - t;  // tokens of this step that exist (>= 1)
    const uint8_t* k = reinterpret_cast<const uint8_t*>(kc + at * D) + 16 * lane;
    const uint8_t* v = reinterpret_cast<const uint8_t*>(vc + at * D) + 16 * lane;
    const unsigned int to = ring_s + slot * SLOT;
    if (live >= 16) {
#pragma unroll
      for (int i = 0; i < PIECES; ++i) {
        kv_cp16_full(to + piece_to(i), k + 512 * i);
        kv_cp16_full(to + RUN + piece_to(i), v + 512 * i);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
      const bool valid = (lane + 32 * i) / CH < live;
      kv_cp16(ring + slot * SLOT + piece_to(i), valid ? k + 512 * i : k, valid ? 16 : 0);
      kv_cp16(ring + slot * SLOT + RUN + piece_to(i), valid ? v + 512 * i : v, valid ? 16 : 0);
    }
  };

  // ldmatrix row addresses (byte offsets in a slot). K, n-tile i, k-steps 2j, 2j + 1: lane l
  // gives token 8i + (l & 7), chunk 4j + (l >> 3): registers b0, b1 of k-step 2j, then of 2j + 1.
  // V, m-tile t: token (l & 7) + 8 (l >> 4), chunk 2t + ((l >> 3) & 1), transposed: registers
  // a0a1, a2a3, a4a5, a6a7 of O^T's A operand.
  const int lrow = lane & 7;
  auto k_at = [&](int i, int j) -> int { return (8 * i + lrow) * ROWB + 16 * ((4 * j + (lane >> 3)) ^ lrow); };
  auto v_at = [&](int t) -> int {
    return RUN + (lrow + 8 * (lane >> 4)) * ROWB + 16 * ((2 * t + ((lane >> 3) & 1)) ^ lrow);
  };

  int q_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) q_pos[i] = context - num_queries + ((row0 + gid + 8 * i) % num_queries);

  float m[2] = {KV_NEG_INF, KV_NEG_INF};
  float l[2] = {0.f, 0.f};
  float o[ROWS16 ? 2 : 1][KSTEPS][4];
#pragma unroll
  for (int n = 0; n < (ROWS16 ? 2 : 1); ++n)
#pragma unroll
    for (int t = 0; t < KSTEPS; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[n][t][c] = 0.f;

  int t0 = start + warp * 16;
#pragma unroll
  for (int ahead = 0; ahead < AHEAD; ++ahead) {
    if (t0 + ahead * ITER < stop) issue(ahead, t0 + ahead * ITER);
    kv_cp_commit();
  }

  for (int iteration = 0; t0 < stop; t0 += ITER, ++iteration) {
    __syncwarp();  // the slot refilled here was read in the previous iteration
    if (t0 + AHEAD * ITER < stop) issue(static_cast<unsigned int>(iteration + AHEAD) % STAGES, t0 + AHEAD * ITER);
    kv_cp_commit();
    kv_cp_wait<AHEAD>();
    __syncwarp();
    const unsigned int slot = ring_s + (static_cast<unsigned int>(iteration) % STAGES) * SLOT;

    // S = Q K^T: n-tile i holds tokens t0 + 8i + n; two accumulator chains per tile (even
    // and odd k-steps) for the mma pipeline's latency
    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float even[4] = {0.f, 0.f, 0.f, 0.f}, odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < KSTEPS / 2; ++j) {
        unsigned int b[4];
        kv_ldsm_x4(b, slot + k_at(i, j));
        kv_mma_like(kc, even, qa[2 * j], b[0], b[1]);
        kv_mma_like(kc, odd, qa[2 * j + 1], b[2], b[3]);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] = (even[c] + odd[c]) * qscale;
    }

    // mask; online softmax per row (row gid: s[.][0..1], row gid + 8: s[.][2..3])
    bool grew = false;
    float corr[2] = {1.f, 1.f};
    const bool whole = !CAUSAL && !WINDOWED && t0 + 16 <= stop;  // nothing to mask (warp-uniform)
#pragma unroll
    for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
      float tile_max = KV_NEG_INF;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[i][2 * r + c];
          if (!whole) {
            const int j = t0 + 8 * i + 2 * tig + c;
            bool visible = j < stop;
            if (CAUSAL) visible = visible && j <= q_pos[r];
            if (WINDOWED) visible = visible && j > q_pos[r] - window;
            x = visible ? x : KV_NEG_INF;
          }
          tile_max = fmaxf(tile_max, x);
        }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      if (tile_max > m[r]) {
        corr[r] = kv_exp2(m[r] - tile_max);
        m[r] = tile_max;
        grew = true;
      }
      const float shift = m[r] == KV_NEG_INF ? 0.f : m[r];
      l[r] *= corr[r];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[i][2 * r + c];
          x = kv_exp2(x - shift);
          l[r] += x;
        }
    }
    if (__any_sync(0xffffffffu, grew)) {
      // O^T holds rows 2tig, 2tig+1 (and 8 + those): their corrections live in the lanes
      // whose gid is that row
#pragma unroll
      for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
        const float c_lo = __shfl_sync(0xffffffffu, corr[n], 8 * tig);
        const float c_hi = __shfl_sync(0xffffffffu, corr[n], 8 * tig + 4);
#pragma unroll
        for (int t = 0; t < KSTEPS; ++t) {
          o[n][t][0] *= c_lo; o[n][t][1] *= c_hi; o[n][t][2] *= c_lo; o[n][t][3] *= c_hi;
        }
      }
    }

    // O^T += V^T P^T: the P^T fragments are the S fragments (tokens 2tig, 2tig+1 | +8)
    unsigned int p[2][2];
#pragma unroll
    for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
      p[n][0] = kv_pack_like(kc, s[0][2 * n], s[0][2 * n + 1]);
      p[n][1] = kv_pack_like(kc, s[1][2 * n], s[1][2 * n + 1]);
    }
#pragma unroll
    for (int t = 0; t < KSTEPS; ++t) {
      unsigned int a[4];
      kv_ldsm_x4_trans(a, slot + v_at(t));
#pragma unroll
      for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) kv_mma_like(kc, o[n][t], a, p[n][0], p[n][1]);
    }
  }
  kv_cp_wait<0>();

  // merge the warps of this block through shared memory; O^T element (dim, row):
  // o[n][t][0] = (16t + gid, 8n + 2tig), [1] = (.., 8n + 2tig + 1), [2]/[3] = dim + 8
  constexpr int PARTS = NUM_WARPS, PART_ROWS = RM;
  __shared__ float sh_m[PARTS][PART_ROWS];
  __shared__ float sh_l[PARTS][PART_ROWS];
  float (*sh_acc)[RM][D] = reinterpret_cast<float (*)[RM][D]>(sh_dynamic);
  __syncthreads();  // every warp is done with its ring (sh_acc overlays it)
#pragma unroll
  for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
    float total = l[r];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    if (tig == 0) { sh_m[warp][gid + 8 * r] = m[r]; sh_l[warp][gid + 8 * r] = total; }
  }
#pragma unroll
  for (int n = 0; n < (ROWS16 ? 2 : 1); ++n)
#pragma unroll
    for (int t = 0; t < KSTEPS; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) sh_acc[warp][8 * n + 2 * tig + (c & 1)][16 * t + gid + 8 * (c >> 1)] = o[n][t][c];
  __syncthreads();
#include "split_epilogue.h"
