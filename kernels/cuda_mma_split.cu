// The tensor-core split kernel for packed pages (kernels/cuda_mma.py compiles it; direct.py
// plans its launch): mma.sync m16n8k16, fp16 in, fp32 accumulate; 16 tokens per warp step.
//
// Template: D, ROWS16, NUM_WARPS, BLOCK_SIZE, K_BITS, V_BITS, GROUP, CAUSAL, WINDOWED, ROTATE,
// TABLE_CAP, ASYNC + STAGES (cp.async rings of raw page bytes in shared memory, for
// BLOCK_SIZE % 16 == 0), SUB (16-token steps per warp iteration; STAGES is a multiple), PROBE
// (0; profiling cuts, tools/bench/profile/h200_profile.py), PIPE (prefetch the next step's raw
// words; off where they would not fit in registers), RAW (codes into the mma; see below),
// QSEP and SMEM (the shared-memory layout; direct._mma_shared_layout). meta as the lane-group
// kernel's (cuda_lane_split.cu), with first_key rounded down to a multiple of 16 and
// split_tokens a multiple of 16 (direct.py plans it).
//
// Layout of one step (one warp, tokens T0..T0+15; lane = 4 * gid + tig):
//   S = Q K^T    m16n8k16, M = 16 query rows (rows past the chunk's are zero), N = 8 tokens,
//                K = 16 head dims per k-step, D/16 k-steps, two n-tiles (tokens T0+gid and
//                T0+8+gid). The head dim is permuted: lane tig owns the contiguous quarter
//                [tig*D/4, (tig+1)*D/4) of every key it loads (one 16-byte load for k4 at
//                D=128); the query fragments use the same permutation, so q . k is unchanged.
//   P            online softmax in the log2 domain on the S fragments (row gid, tokens
//                2tig, 2tig+1 of each n-tile); the max is reduced over the 4 lanes of a row;
//                the rescale of the accumulators runs only when some row's max grew.
//   O^T = V^T P^T  m16n8k16, M = 16 head dims, N = 8 query rows, K = the 16 tokens: the S
//                fragments are the P^T operand as they are. Lane gid owns head dims
//                [gid*D/8, (gid+1)*D/8) of tokens 2tig, 2tig+1, 2tig+8, 2tig+9, packed in pairs
//                of tokens per register (prmt); no dequantized tile is ever stored.
//   Page bytes   with BLOCK_SIZE % 16 == 0 each warp stages the raw bytes of its next steps
//                (codes and the four scale planes) in a shared-memory ring with cp.async (a
//                whole step is a fixed set of 16-byte pieces per lane; a split's last step
//                zero-fills bytes past the context), and with per-pair dequantization takes two
//                steps per iteration (one row-max reduction per 32 tokens); without rings it
//                prefetches one step in registers. The rings' first copies are issued before
//                the query prologue (the Hadamard rotation of the queries, 7 block barriers)
//                where the queries have shared memory of their own (QSEP); rings deeper than
//                48 KB of static shared memory allow live in dynamic shared memory (SMEM).
//
// Raw codes (RAW; direct.raw_codes_serve: the rings, head dim <= 128, a lane's share of a
// group whole words): the mma takes the codes as they come out of lop3/prmt, and the scale and
// offset are applied per quantization group outside it: key pairs pay neither hsub2 nor
// hfma2, value pairs one hsub2. Per group and step that costs a few FFMAs and one extra mma:
//   keys     the head dim is permuted so that each k-step lies in one group; per group g an
//            accumulator starts at -1024 * sum(q) (what the 1024 of every code adds; odd 4-bit
//            pairs are 16x codes, their queries are divided by 16), and per token
//            s = sum_g scale_g * acc_g + offset_g * sum_g(q).
//   values   each O^T m-tile lies in one group; the codes are centered with one hsub2 (c - 8,
//            16 (c - 8) or c - 128) so the fp32 accumulators stay near the size of the result,
//            the probabilities are scaled per group (P * scale_g) for the B operand, and a
//            second mma per group adds (offset_g + center * scale_g) * P.
// The 1024 bias is not left in the value accumulators: over a split of thousands of tokens
// the output (a small average of many values) was lost to fp32 rounding
// (tests/kernels/test_attention.py::test_long_splits_keep_relative_precision).
//
// Precision: queries (scaled, rotated), dequantized keys and values (raw: centered codes) and
// probabilities are fp16 (11-bit significand); products accumulate in fp32. Hence the kernel
// serves fp16 and bf16 queries only; float32 queries keep the fp32 lane-group kernel
// (tolerance 2e-4). Dequantized K/V must fit fp16 (|x| < 65504).
  constexpr int RM = ROWS16 ? 16 : 8;      // query rows of this block
  constexpr int KSTEPS = D / 16;           // k-steps of S; m-tiles of O^T
  constexpr int C = D / 4;                 // key dims per lane (tig)
  constexpr int CV = D / 8;                // value dims per lane (gid)
  constexpr int KW = C * K_BITS / 32;      // key words per token per lane
  constexpr int VW = CV * V_BITS / 32;     // value words per token per lane
  constexpr int GROUPS = D / GROUP;        // scale/offset entries per token
  constexpr int KG = C > GROUP ? C / GROUP : 1;
  constexpr int VG = CV > GROUP ? CV / GROUP : 1;
  // RAW: the mma takes the codes as they are (1024 + code, or 1024 + 16 * code) and the
  // scale and offset are applied per quantization group outside it (see the module doc)
  constexpr int KSG = GROUP >= 16 ? GROUP / 16 : 1;  // RAW: k-steps (and O^T m-tiles) per group
  constexpr int KWG = GROUP * K_BITS / 128;      // RAW: key words per token, lane and group
  constexpr int VWG = GROUP * V_BITS / 256;      // RAW: value words per token, lane and group
  constexpr int RG = RAW ? GROUPS : 1;           // per-group accumulators (1 unless RAW)
  constexpr float LOG2E = 1.4426950408889634f;
  if (PROBE == 1) return;  // profiling: the launch alone

#include "split_prologue.cuh"
  const int gid = lane >> 2;
  const int tig = lane & 3;

  // Shared memory: one region used in turn by the per-warp rings of raw page bytes (ASYNC
  // main loop) and the warps' partial outputs (epilogue); the queries (prologue, float32:
  // signs, fast Walsh-Hadamard transform, scale) get their own space after it when QSEP, so
  // the rings' first copies are issued before the prologue and their latency overlaps it,
  // else they overlay the region. SMEM > 0: the region is the kernel's dynamic shared memory
  // of SMEM bytes (direct._build_mma_plan sizes it; rings deeper than 48 KB of static memory).
  constexpr int KROW = D * K_BITS / 8, VROW = D * V_BITS / 8, SROW = GROUPS * 4;  // bytes per token
  constexpr int SLOT = 16 * (KROW + VROW + 4 * SROW);  // one warp step: 16 tokens of every plane
  constexpr int RING = ASYNC ? NUM_WARPS * STAGES * SLOT : 0;
  constexpr int QBYTES = RM * D * 4, OBYTES = NUM_WARPS * RM * D * 4;
  constexpr int MAIN = RING > OBYTES ? RING : OBYTES;
  constexpr int SHARED = QSEP ? MAIN + QBYTES : (MAIN > QBYTES ? MAIN : QBYTES);
  static_assert(!QSEP || ASYNC, "separate query space is for the rings");
  static_assert(SMEM == 0 || SMEM >= SHARED, "dynamic shared memory is smaller than the layout");
  __shared__ __align__(16) uint8_t sh_static[SMEM ? 16 : SHARED];
  extern __shared__ __align__(16) uint8_t sh_dynamic[];
  uint8_t* const sh_raw = SMEM ? sh_dynamic : sh_static;
  float (*sh_q)[D] = reinterpret_cast<float (*)[D]>(sh_raw + (QSEP ? MAIN : 0));
  const int row0 = chunk * RM;
  for (int e = threadIdx.x; e < RM * D; e += NUM_WARPS * 32) {
    const int i = e / D, d = e % D, r = row0 + i;
    float x = 0.f;
    if (r < rows_total)
      x = static_cast<float>(queries[((size_t)(batch * num_kv_heads + head) * rows_total + r) * D + d]);
    sh_q[i][d] = ROTATE ? x * signs[d] : x;
  }
  __syncthreads();

  // raw page words of one step: keys of tokens gid, 8 + gid (this lane's quarter of the
  // head dims), values of tokens 2tig, 2tig+1, 2tig+8, 2tig+9 (this lane's eighth)
  struct Raw {
    unsigned int k[2][KW];
    float ks[2][KG], ko[2][KG];
    unsigned int v[4][VW];
    float vs[4][VG], vo[4][VG];
  };
  auto page_at = [&](int j) -> size_t {
    const int e = static_cast<int>(static_cast<unsigned int>(j) / BLOCK_SIZE) - first_block;  // j >= 0
    const int block = e < TABLE_CAP ? sh_table[e] : block_tables[batch * table_width + j / BLOCK_SIZE];
    return ((size_t)block * num_kv_heads + head) * BLOCK_SIZE + (j % BLOCK_SIZE);
  };
  auto fetch = [&](Raw& raw, int t0) {
    size_t base = 0;
    if constexpr (BLOCK_SIZE % 16 == 0) base = page_at(t0);  // t0 is 16-aligned: one block
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = min(t0 + gid + 8 * i, stop - 1);
      const size_t at = BLOCK_SIZE % 16 == 0 ? base + (j - t0) : page_at(j);
      kv_words<KW>(raw.k[i], kc + at * (D * K_BITS / 8) + tig * (C * K_BITS / 8));
#pragma unroll
      for (int g = 0; g < KG; ++g) {
        raw.ks[i][g] = __ldg(ks + at * GROUPS + (tig * C) / GROUP + g);
        raw.ko[i][g] = __ldg(ko + at * GROUPS + (tig * C) / GROUP + g);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = min(t0 + 2 * tig + (i & 1) + 8 * (i >> 1), stop - 1);
      const size_t at = BLOCK_SIZE % 16 == 0 ? base + (j - t0) : page_at(j);
      kv_words<VW>(raw.v[i], vc + at * (D * V_BITS / 8) + gid * (CV * V_BITS / 8));
#pragma unroll
      for (int g = 0; g < VG; ++g) {
        raw.vs[i][g] = __ldg(vs + at * GROUPS + (gid * CV) / GROUP + g);
        raw.vo[i][g] = __ldg(vo + at * GROUPS + (gid * CV) / GROUP + g);
      }
    }
  };
  // ASYNC: this warp's ring of STAGES slots; slot layout [kc 16*KROW | vc 16*VROW | ks | ko |
  // vs | vo, 16*SROW each]. A step's 16 tokens lie in one block (BLOCK_SIZE % 16 == 0), so
  // each plane's run is contiguous in global memory; bytes of tokens >= stop are zero-filled
  // (zero codes and scales dequantize to 0, never to a NaN from an unwritten slot)
  uint8_t* ring = sh_raw + warp * (ASYNC ? STAGES * SLOT : 0);
  // A whole step (16 live tokens) is KROW + VROW + 16 * GROUPS pieces of 16 bytes; lane l
  // copies pieces l, l + 32, ... of each run, so its sources are fixed offsets from the
  // step's page: codes at 16 * l (+ 512 r), scale piece p = l + 32 r of plane p / (4 * GROUPS)
  // at 16 * (p % (4 * GROUPS)); in the slot, piece p of the scale planes lands at 16 * p.
  constexpr int SPIECES = 16 * GROUPS;
  constexpr int SPL = (SPIECES + 31) / 32;
  const unsigned int ring_s = static_cast<unsigned int>(__cvta_generic_to_shared(ring));
  const uint8_t* s_from[SPL];
#pragma unroll
  for (int r = 0; r < SPL; ++r) {
    const int piece = min(lane + 32 * r, SPIECES - 1), plane = piece / (4 * GROUPS);
    const float* base = plane == 0 ? ks : plane == 1 ? ko : plane == 2 ? vs : vo;
    s_from[r] = reinterpret_cast<const uint8_t*>(base) + 16 * (piece % (4 * GROUPS));
  }
  auto issue = [&](int slot, int t) {
    const size_t at = page_at(min(t, stop - 1));  // a step past the end: its bytes are all zero-filled
    const int live = stop - t;  // tokens of this step that exist (<= 0: none)
    if (live >= 16) {  // every step but a split's last
      const unsigned int to = ring_s + slot * SLOT + 16 * lane;
      const uint8_t* k = kc + at * KROW + 16 * lane;
      const uint8_t* v = vc + at * VROW + 16 * lane;
#pragma unroll
      for (int r = 0; r < KROW / 32; ++r) kv_cp16_full(to + 512 * r, k + 512 * r);
#pragma unroll
      for (int r = 0; r < VROW / 32; ++r) kv_cp16_full(to + 16 * KROW + 512 * r, v + 512 * r);
#pragma unroll
      for (int r = 0; r < SPL; ++r)
        if (SPIECES % 32 == 0 || lane + 32 * r < SPIECES)
          kv_cp16_full(to + 16 * (KROW + VROW) + 512 * r, s_from[r] + at * SROW);
      return;
    }
    uint8_t* dst = ring + slot * SLOT;
    // one plane's run of 16 tokens: ROW bytes per token, 16-byte pieces spread over the lanes,
    // the bytes of tokens past the context zero-filled
    auto copy_run = [&](uint8_t* to, const uint8_t* from, int row) {
      for (int c = lane; c < row; c += 32) {  // row = 16 * ROW / 16 pieces
        const int valid = min(16, max(0, live * row - 16 * c));
        kv_cp16(to + 16 * c, valid > 0 ? from + 16 * c : from, valid);
      }
    };
    copy_run(dst, kc + at * KROW, KROW);
    copy_run(dst + 16 * KROW, vc + at * VROW, VROW);
    copy_run(dst + 16 * (KROW + VROW), reinterpret_cast<const uint8_t*>(ks + at * GROUPS), SROW);
    copy_run(dst + 16 * (KROW + VROW + SROW), reinterpret_cast<const uint8_t*>(ko + at * GROUPS), SROW);
    copy_run(dst + 16 * (KROW + VROW + 2 * SROW), reinterpret_cast<const uint8_t*>(vs + at * GROUPS), SROW);
    copy_run(dst + 16 * (KROW + VROW + 3 * SROW), reinterpret_cast<const uint8_t*>(vo + at * GROUPS), SROW);
  };
  auto load_slot = [&](Raw& raw, int slot) {
    const uint8_t* base = ring + slot * SLOT;
    const float* sks = reinterpret_cast<const float*>(base + 16 * (KROW + VROW));
    const float* sko = sks + 16 * GROUPS;
    const float* svs = sko + 16 * GROUPS;
    const float* svo = svs + 16 * GROUPS;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = gid + 8 * i;
      if constexpr (RAW) {
#pragma unroll
        for (int g = 0; g < GROUPS; ++g)
          kv_words_shared<KWG>(raw.k[i] + g * KWG, base + j * KROW + (g * GROUP + tig * (GROUP / 4)) * K_BITS / 8);
        continue;
      }
      kv_words_shared<KW>(raw.k[i], base + j * KROW + tig * (C * K_BITS / 8));
#pragma unroll
      for (int g = 0; g < KG; ++g) {
        raw.ks[i][g] = sks[j * GROUPS + (tig * C) / GROUP + g];
        raw.ko[i][g] = sko[j * GROUPS + (tig * C) / GROUP + g];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 2 * tig + (i & 1) + 8 * (i >> 1);
      if constexpr (RAW) {
#pragma unroll
        for (int g = 0; g < GROUPS; ++g)
          kv_words_shared<VWG>(raw.v[i] + g * VWG, base + 16 * KROW + j * VROW + (g * GROUP + gid * (GROUP / 8)) * V_BITS / 8);
        continue;
      }
      kv_words_shared<VW>(raw.v[i], base + 16 * KROW + j * VROW + gid * (CV * V_BITS / 8));
#pragma unroll
      for (int g = 0; g < VG; ++g) {
        raw.vs[i][g] = svs[j * GROUPS + (gid * CV) / GROUP + g];
        raw.vo[i][g] = svo[j * GROUPS + (gid * CV) / GROUP + g];
      }
    }
  };

  // A warp iteration covers STEPS_PER_ITER consecutive 16-token steps (2 with the rings): their
  // score chains are independent, and the row max is reduced once per iteration.
  constexpr int STEPS_PER_ITER = ASYNC ? SUB : 1;  // the register path takes one step at a time
  constexpr int SPAN = 16 * STEPS_PER_ITER;           // tokens per warp iteration
  constexpr int ITER = NUM_WARPS * SPAN;   // tokens per block iteration
  constexpr int AHEAD = ASYNC ? STAGES / STEPS_PER_ITER - 1 : 0;  // iterations in flight beyond this one
  Raw cur[STEPS_PER_ITER], nxt;
  int t0 = start + warp * SPAN;
  auto issue_iteration = [&](int iteration, int t) {
#pragma unroll
    for (int u = 0; u < STEPS_PER_ITER; ++u) issue(static_cast<unsigned int>(iteration * STEPS_PER_ITER + u) % STAGES, t + 16 * u);
  };
  // the first AHEAD iterations' copies (ASYNC), or the first step's words
  auto prime = [&]() {
    if constexpr (ASYNC) {
#pragma unroll
      for (int ahead = 0; ahead < AHEAD; ++ahead) {
        if (t0 + ahead * ITER < stop) issue_iteration(ahead, t0 + ahead * ITER);
        kv_cp_commit();
      }
    } else {
      if (t0 < stop) fetch(cur[0], t0);
    }
  };
  if constexpr (QSEP) prime();  // sh_table is in place (the barrier above)
  if (ROTATE) {
    qscale *= rsqrtf((float)D);
#pragma unroll 1
    for (int h = 1; h < D; h <<= 1) {
      for (int e = threadIdx.x; e < RM * D / 2; e += NUM_WARPS * 32) {
        const int i = e / (D / 2), k = e % (D / 2);
        const int j = (k / h) * 2 * h + (k % h);
        const float a = sh_q[i][j], b = sh_q[i][j + h];
        sh_q[i][j] = a + b;
        sh_q[i][j + h] = a - b;
      }
      __syncthreads();
    }
  }

  // query fragments (A of S = Q K^T), head dims permuted as this lane's key pairs: lane tig
  // owns the quarter [tig*C, (tig+1)*C) of the head, or with RAW the quarter
  // [g*GROUP + tig*GROUP/4, ..) of each group g, k-steps g*KSG .. g*KSG + KSG - 1 lying in
  // group g. With RAW and 4-bit keys the odd pairs (b1) hold 1024 + 16 * code, so their
  // queries are divided by 16 (exact in fp16).
  unsigned int qa[KSTEPS][4];
  constexpr float ODD_Q = (RAW && K_BITS == 4) ? 0.0625f : 1.f;
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int base = RAW ? (ks / KSG) * GROUP + tig * (GROUP / 4) : tig * C;
      const int h = RAW ? 2 * (ks % KSG) + s : 2 * ks + s;
      const int d0 = base + kv_key_pair_dim<K_BITS>(h, 0);
      const int d1 = base + kv_key_pair_dim<K_BITS>(h, 1);
      const float f = (s ? ODD_Q : 1.f) * qscale;
      qa[ks][2 * s] = kv_pack(sh_q[gid][d0] * f, sh_q[gid][d1] * f);
      qa[ks][2 * s + 1] = ROWS16 ? kv_pack(sh_q[gid + 8][d0] * f, sh_q[gid + 8][d1] * f) : 0u;
    }
  }
  // RAW: per group g and row (gid, gid + 8): kbias = -(what the mma adds for the 1024 of every
  // code) = -1024 * sum of the fp16 queries as the mma sees them (the accumulators start
  // there), qsum = sum of the queries each code stands for (times the group's offset)
  float kbias[RG][2], qsum[RG][2];
#pragma unroll
  for (int g = 0; g < RG; ++g)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float b = 0.f, q = 0.f;
#pragma unroll
      for (int j = 0; j < (RAW ? KSG : 0); ++j)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const float2 x = __half22float2(kv_u2h(qa[g * KSG + j][2 * s + r]));
          b += x.x + x.y;
          q += (s ? 1.f / ODD_Q : 1.f) * (x.x + x.y);
        }
      b += __shfl_xor_sync(0xffffffffu, b, 1);
      b += __shfl_xor_sync(0xffffffffu, b, 2);
      q += __shfl_xor_sync(0xffffffffu, q, 1);
      q += __shfl_xor_sync(0xffffffffu, q, 2);
      kbias[g][r] = -1024.f * b;
      qsum[g][r] = q;
    }
  if constexpr (!QSEP) {
    __syncthreads();  // sh_q is read; the rings may overwrite it
    prime();
  }

  // positions of the rows this lane scores: gid (and gid + 8)
  int q_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) q_pos[i] = context - num_queries + ((row0 + gid + 8 * i) % num_queries);

  float m[2] = {KV_NEG_INF, KV_NEG_INF};
  float l[2] = {0.f, 0.f};
  float o[ROWS16 ? 2 : 1][KSTEPS][4];
  // RAW: per group, the sum of P * (offset + center * scale) (voff), in the layout of O^T
  // (every row of the tile the same)
  float voff[ROWS16 ? 2 : 1][RG][4];
#pragma unroll
  for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
#pragma unroll
    for (int t = 0; t < KSTEPS; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[n][t][c] = 0.f;
#pragma unroll
    for (int g = 0; g < RG; ++g)
#pragma unroll
      for (int c = 0; c < 4; ++c) voff[n][g][c] = 0.f;
  }

  // the register path's next step (the rings need nothing here): the prefetched words, or a
  // fetch now; at the end of every iteration, the profiling cut's included
  auto advance = [&]() {
    if constexpr (!ASYNC) {
      if (PIPE) cur[0] = nxt;
      else if (t0 + ITER < stop) fetch(cur[0], t0 + ITER);
    }
  };
  unsigned int probe_sink = 0;
  for (int iteration = 0; t0 < stop; t0 += ITER, ++iteration) {
    if constexpr (ASYNC) {
      // the slots refilled here were read in the previous iteration: every lane is past them
      __syncwarp();
      if (t0 + AHEAD * ITER < stop) issue_iteration(iteration + AHEAD, t0 + AHEAD * ITER);
      kv_cp_commit();
      kv_cp_wait<AHEAD>();
      __syncwarp();
#pragma unroll
      for (int u = 0; u < STEPS_PER_ITER; ++u) load_slot(cur[u], static_cast<unsigned int>(iteration * STEPS_PER_ITER + u) % STAGES);
    } else if (PIPE && t0 + ITER < stop) {
      fetch(nxt, t0 + ITER);
    }
    if (PROBE == 2) {  // profiling: page reads only
#pragma unroll
      for (int u = 0; u < STEPS_PER_ITER; ++u) {
#pragma unroll
        for (int i = 0; i < 2; ++i) probe_sink ^= cur[u].k[i][0] ^ (RAW ? 0u : __float_as_uint(cur[u].ks[i][0]) ^ __float_as_uint(cur[u].ko[i][0]));
#pragma unroll
        for (int i = 0; i < 4; ++i) probe_sink ^= cur[u].v[i][0] ^ (RAW ? 0u : __float_as_uint(cur[u].vs[i][0]) ^ __float_as_uint(cur[u].vo[i][0]));
      }
      advance();
      continue;
    }

    // RAW: the four scale planes of sub-step u's slot ([token][group] floats each)
    auto scales = [&](int u) -> const float* {
      return reinterpret_cast<const float*>(ring + (static_cast<unsigned int>(iteration * STEPS_PER_ITER + u) % STAGES) * SLOT + 16 * (KROW + VROW));
    };
    // S = Q K^T: sub-step u, n-tile i holds tokens t0 + 16u + 8i + n
    float s[STEPS_PER_ITER][2][4];
#pragma unroll
    for (int u = 0; u < STEPS_PER_ITER; ++u)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if constexpr (RAW) {
          // acc[g] = sum over group g of q * code, started at kbias; then per token
          // s = sum_g scale_g * acc[g] + offset_g * qsum_g
          float acc[RG][4];
#pragma unroll
          for (int g = 0; g < RG; ++g) {
            acc[g][0] = acc[g][1] = kbias[g][0];
            acc[g][2] = acc[g][3] = kbias[g][1];
#pragma unroll
            for (int j = 0; j < KSG; ++j)
              kv_mma(acc[g], qa[g * KSG + j], kv_key_pair<K_BITS>(cur[u].k[i] + g * KWG, 2 * j),
                     kv_key_pair<K_BITS>(cur[u].k[i] + g * KWG, 2 * j + 1));
          }
          const float* sks = scales(u);
          const float* sko = sks + 16 * GROUPS;
#pragma unroll
          for (int c = 0; c < (ROWS16 ? 4 : 2); ++c) {
            const int j = 8 * i + 2 * tig + (c & 1);
            float x = 0.f;
#pragma unroll
            for (int g = 0; g < RG; ++g) x = fmaf(sks[j * GROUPS + g], acc[g][c], fmaf(sko[j * GROUPS + g], qsum[g][c >> 1], x));
            s[u][i][c] = x;
          }
          continue;
        }
        __half2 scale2[KG], scale16[KG], offset2[KG];
#pragma unroll
        for (int g = 0; g < KG; ++g) {
          scale2[g] = __float2half2_rn(cur[u].ks[i][g]);
          scale16[g] = K_BITS == 4 ? kv_sixteenth(scale2[g]) : scale2[g];
          offset2[g] = __float2half2_rn(cur[u].ko[i][g]);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) s[u][i][c] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          const int g0 = KG > 1 ? kv_key_pair_dim<K_BITS>(2 * ks, 0) / GROUP : 0;
          const int g1 = KG > 1 ? kv_key_pair_dim<K_BITS>(2 * ks + 1, 0) / GROUP : 0;
          const unsigned int b0 = kv_dequant(kv_key_pair<K_BITS>(cur[u].k[i], 2 * ks), scale2[g0], offset2[g0]);
          const unsigned int b1 = kv_dequant(kv_key_pair<K_BITS>(cur[u].k[i], 2 * ks + 1), scale16[g1], offset2[g1]);
          kv_mma(s[u][i], qa[ks], b0, b1);
        }
      }

    // mask; online softmax per row (row gid: s[.][.][0..1], row gid + 8: s[.][.][2..3])
    bool grew = false;
    float corr[2] = {1.f, 1.f};
    const bool whole = !CAUSAL && !WINDOWED && t0 + SPAN <= stop;  // nothing to mask (warp-uniform)
#pragma unroll
    for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
      float tile_max = KV_NEG_INF;
#pragma unroll
      for (int u = 0; u < STEPS_PER_ITER; ++u)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& x = s[u][i][2 * r + c];
            if (!whole) {
              const int j = t0 + 16 * u + 8 * i + 2 * tig + c;
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
      for (int u = 0; u < STEPS_PER_ITER; ++u)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& x = s[u][i][2 * r + c];
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
#pragma unroll
        for (int g = 0; g < (RAW ? RG : 0); ++g) {
          voff[n][g][0] *= c_lo; voff[n][g][1] *= c_hi; voff[n][g][2] *= c_lo; voff[n][g][3] *= c_hi;
        }
      }
    }

    // O^T += V^T P^T per sub-step: P^T fragments are the S fragments (tokens 2tig, 2tig+1 | +8)
#pragma unroll
    for (int u = 0; u < STEPS_PER_ITER; ++u) {
      unsigned int p[2][2];
#pragma unroll
      for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
        p[n][0] = kv_pack(s[u][0][2 * n], s[u][0][2 * n + 1]);
        p[n][1] = kv_pack(s[u][1][2 * n], s[u][1][2 * n + 1]);
      }
      if constexpr (RAW) {
        // per group g: O^T += (codes - center)^T (P * scale_g)^T and voff += (offset_g + center *
        // scale_g) P, center = 8 (4 bits; odd dims' codes are 16x) or 128 (8 bits). Centered
        // codes keep the fp32 accumulators near the size of the result: with the codes' 1024
        // bias left in and subtracted at the end, a 32K-token split lost the output to rounding
        // (docs/kernels.md)
        const float* svs = scales(u) + 32 * GROUPS;
        const float* svo = svs + 16 * GROUPS;
        const int j0 = 2 * tig, j1 = 2 * tig + 8;
#pragma unroll
        for (int g = 0; g < RG; ++g) {
          const float s0 = svs[j0 * GROUPS + g], s1 = svs[(j0 + 1) * GROUPS + g];
          const float s2 = svs[j1 * GROUPS + g], s3 = svs[(j1 + 1) * GROUPS + g];
          unsigned int pg[2][2];
#pragma unroll
          for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
            pg[n][0] = kv_pack(s[u][0][2 * n] * s0, s[u][0][2 * n + 1] * s1);
            pg[n][1] = kv_pack(s[u][1][2 * n] * s2, s[u][1][2 * n + 1] * s3);
          }
          constexpr float CENTER = V_BITS == 4 ? 8.f : 128.f;
          const unsigned int ox = kv_pack(fmaf(CENTER, s0, svo[j0 * GROUPS + g]), fmaf(CENTER, s1, svo[(j0 + 1) * GROUPS + g]));
          const unsigned int oy = kv_pack(fmaf(CENTER, s2, svo[j1 * GROUPS + g]), fmaf(CENTER, s3, svo[(j1 + 1) * GROUPS + g]));
          const unsigned int oa[4] = {ox, ox, oy, oy};
          unsigned int vp[2][GROUP / 8];
#pragma unroll
          for (int pair = 0; pair < 2; ++pair)
            kv_value_pairs<V_BITS, GROUP / 8>(vp[pair], cur[u].v[2 * pair] + g * VWG, cur[u].v[2 * pair + 1] + g * VWG);
          // centered: 4 bits, even dims 1024 + c - 1032 = c - 8, odd dims 1024 + 16c - 1152 =
          // 16 (c - 8); 8 bits 1024 + c - 1152 = c - 128 (all exact in fp16)
#pragma unroll
          for (int pair = 0; pair < 2; ++pair)
#pragma unroll
            for (int k = 0; k < GROUP / 8; ++k)
              vp[pair][k] = kv_h2u(__hsub2(kv_u2h(vp[pair][k]), kv_u2h(V_BITS == 4 && k % 2 == 0 ? 0x64086408u : 0x64806480u)));
#pragma unroll
          for (int j = 0; j < KSG; ++j) {
            const unsigned int va[4] = {vp[0][2 * j], vp[0][2 * j + 1], vp[1][2 * j], vp[1][2 * j + 1]};
#pragma unroll
            for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) kv_mma(o[n][g * KSG + j], va, pg[n][0], pg[n][1]);
          }
#pragma unroll
          for (int n = 0; n < (ROWS16 ? 2 : 1); ++n) {
            kv_mma(voff[n][g], oa, p[n][0], p[n][1]);
          }
        }
        continue;
      }
      unsigned int va[KSTEPS][4];
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        // pair 0 = tokens 2tig, 2tig+1 -> a0a1 (dim 2t of the chunk), a2a3 (dim 2t + 1);
        // pair 1 = tokens 2tig+8, 2tig+9 -> a4a5, a6a7
        unsigned int vpairs[CV];
        kv_value_pairs<V_BITS, CV>(vpairs, cur[u].v[2 * pair], cur[u].v[2 * pair + 1]);
        __half2 scale2[VG], scale16[VG], offset2[VG];
#pragma unroll
        for (int g = 0; g < VG; ++g) {
          scale2[g] = __floats2half2_rn(cur[u].vs[2 * pair][g], cur[u].vs[2 * pair + 1][g]);
          scale16[g] = V_BITS == 4 ? kv_sixteenth(scale2[g]) : scale2[g];
          offset2[g] = __floats2half2_rn(cur[u].vo[2 * pair][g], cur[u].vo[2 * pair + 1][g]);
        }
#pragma unroll
        for (int t = 0; t < KSTEPS; ++t) {  // chunk dims 2t (even: scale) and 2t + 1 (odd: scale16)
          va[t][2 * pair] = kv_dequant(vpairs[2 * t], scale2[(2 * t) * VG / CV], offset2[(2 * t) * VG / CV]);
          va[t][2 * pair + 1] = kv_dequant(vpairs[2 * t + 1], scale16[(2 * t + 1) * VG / CV],
                                           offset2[(2 * t + 1) * VG / CV]);
        }
      }
#pragma unroll
      for (int n = 0; n < (ROWS16 ? 2 : 1); ++n)
#pragma unroll
        for (int t = 0; t < KSTEPS; ++t) kv_mma(o[n][t], va[t], p[n][0], p[n][1]);
    }
    advance();
  }
  if constexpr (ASYNC) kv_cp_wait<0>();

  if (PROBE == 2) { if (probe_sink == 0x9E3779B9u) part_o[0] = 1.f; return; }

  // merge the warps of this block through shared memory; O^T element (dim, row):
  // o[n][t][0] = (gid*CV + 2t, 8n + 2tig), [1] = (.., 8n + 2tig + 1), [2]/[3] = dim + 1
  constexpr int PARTS = NUM_WARPS, PART_ROWS = RM;
  __shared__ float sh_m[PARTS][PART_ROWS];
  __shared__ float sh_l[PARTS][PART_ROWS];
  float (*sh_acc)[RM][D] = reinterpret_cast<float (*)[RM][D]>(sh_raw);
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
    for (int t = 0; t < KSTEPS; ++t) {
      if constexpr (RAW) {  // O^T rows: dims g*GROUP + gid*GROUP/8 + 2j (+1); odd dims were 16x (4 bits)
        const int g = t / KSG, d = g * GROUP + gid * (GROUP / 8) + 2 * (t % KSG);
        constexpr float INV = V_BITS == 4 ? 0.0625f : 1.f;
#pragma unroll
        for (int c = 0; c < 4; ++c)
          sh_acc[warp][8 * n + 2 * tig + (c & 1)][d + (c >> 1)] = fmaf(o[n][t][c], (c >> 1) ? INV : 1.f, voff[n][g][c]);
        continue;
      }
      const int d = gid * CV + 2 * t;
      sh_acc[warp][8 * n + 2 * tig][d] = o[n][t][0];
      sh_acc[warp][8 * n + 2 * tig + 1][d] = o[n][t][1];
      sh_acc[warp][8 * n + 2 * tig][d + 1] = o[n][t][2];
      sh_acc[warp][8 * n + 2 * tig + 1][d + 1] = o[n][t][3];
    }
  __syncthreads();
#include "split_epilogue.h"
