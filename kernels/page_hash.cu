// Pass 2 of kernels/page_hash.py: the xxh3-128 of each row's first lengths[i] bytes. Eight
// threads per row, one per accumulator lane of kernels/xxh3.cuh: each folds the sums pass 1
// computed for its lane (add, scramble, block after block: the only serial part of XXH3),
// then the row's last block and last stripe; lane 0 gathers the eight with warp shuffles (a
// row's eight threads are eight neighbouring lanes of one warp) and merges them.
// Output hashes [n, 2] uint64: (high, low). A row shorter than KVSTORE_XXH3_MIN_NBYTES gets
// (0, 0): XXH3 hashes such inputs another way, and the caller verifies those on the host.
// Template: ROW, BLOCKS as in page_hash_blocks.cu (sums: its output; one dummy element when
// BLOCKS is 0). Every thread reaches the shuffles (the grid is whole warps), so they name
// the full mask.
  const long t = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long n = lengths_shape[0];
  const long row = t >> 3;
  const int lane = static_cast<int>(t & 7);
  const kvstore_u64 len = row < n ? static_cast<kvstore_u64>(lengths[row]) : 0;
  const bool hashed = row < n && len >= KVSTORE_XXH3_MIN_NBYTES && len <= ROW;
  kvstore_u64 acc = 0;
  if (hashed) {
    acc = kvstore_xxh3_init(lane);
    const kvstore_u64 blocks = kvstore_xxh3_blocks(len);
    const kvstore_u64* mine = reinterpret_cast<const kvstore_u64*>(sums) + row * BLOCKS * 8 + lane;
#pragma unroll 8
    for (kvstore_u64 b = 0; b < blocks; ++b) acc = kvstore_xxh3_scramble(acc + mine[8 * b], lane);
    acc = kvstore_xxh3_tail(acc, reinterpret_cast<const unsigned char*>(rows) + row * static_cast<long>(ROW),
                            len, lane);
  }
  kvstore_u64 accs[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) accs[i] = __shfl_sync(0xffffffffu, acc, i, 8);
  if (row < n && lane == 0) {
    kvstore_u64 high = 0, low = 0;
    if (hashed) kvstore_xxh3_finish(accs, len, &high, &low);
    hashes[2 * row] = high;
    hashes[2 * row + 1] = low;
  }
