// The start of both CUDA split kernels (cuda_lane_split.cu, cuda_mma_split.cu; pasted in by
// kernels/sources.py): the per-call scalars of `meta` (rows, L, split_tokens, window,
// first_key, row_chunks, scale bits; then context lengths), this block's split, KV head,
// row chunk, sequence and token range, the thread's lane and warp, and the split's block-table
// entries staged in shared memory (no barrier: the body syncs before reading them). The body
// defines LOG2E first.
  const int rows_total = meta[0];
  const int num_queries = meta[1];
  const int split_tokens = meta[2];
  const int window = meta[3];
  const int first_key = meta[4];
  const int row_chunks = meta[5];
  float qscale = __int_as_float(meta[6]) * LOG2E;

  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int head = blockIdx.y / row_chunks;
  const int chunk = blockIdx.y % row_chunks;
  const int batch = blockIdx.z;
  const int num_kv_heads = kc_shape[1];
  const int table_width = block_tables_shape[1];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  const int context = meta[7 + batch];
  const int start = first_key + split * split_tokens;
  const int stop = min(context, start + split_tokens);

  // this split's block-table entries, so page addresses never wait on a global load
  __shared__ int sh_table[TABLE_CAP];
  const int first_block = start / BLOCK_SIZE;
  for (int e = threadIdx.x; first_block + e <= (stop - 1) / BLOCK_SIZE && e < TABLE_CAP; e += NUM_WARPS * 32)
    sh_table[e] = block_tables[batch * table_width + first_block + e];
