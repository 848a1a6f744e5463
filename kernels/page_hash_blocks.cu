// Pass 1 of kernels/page_hash.py: what each whole 1024-byte block of each row adds to each
// of the eight accumulators (kernels/xxh3.cuh kvstore_xxh3_block), one thread per (row,
// block, lane), all in parallel. Output sums [n * BLOCKS * 8] uint64, row-major by (row,
// block, lane); entries past a row's own whole blocks are left as they are (pass 2 never
// reads them). Template: ROW (bytes from one row's start to the next), BLOCKS (whole
// blocks of a full row: (ROW - 1) / 1024).
  const long t = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long n = lengths_shape[0];
  const int lane = static_cast<int>(t & 7);
  const long block = (t >> 3) % BLOCKS;
  const long row = (t >> 3) / BLOCKS;
  if (row < n) {
    const kvstore_u64 len = static_cast<kvstore_u64>(lengths[row]);
    if (len >= KVSTORE_XXH3_MIN_NBYTES && len <= ROW && block < static_cast<long>(kvstore_xxh3_blocks(len))) {
      const unsigned char* at = reinterpret_cast<const unsigned char*>(rows) + row * static_cast<long>(ROW)
                                + block * KVSTORE_XXH3_BLOCK_NBYTES;
      sums[t] = kvstore_xxh3_block(at, lane);
    }
  }
