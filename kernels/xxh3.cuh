// XXH3-128 (seed 0, the default secret) of byte strings longer than 240 bytes, the checksum
// every page record of the store carries (docs/format.md: big-endian high then low 64 bits,
// as python-xxhash's xxh3_128_digest prints it). Written from the XXH3 specification
// (xxHash's doc/xxhash_spec.md; the constants are the specification's), for
// kernels/page_hash.py, so that a GPU hashes pages it already holds instead of the host
// hashing them before the transfer.
//
// The algorithm for len > 240 ("hashLong"): eight 64-bit accumulators; the input is cut
// into 1024-byte blocks of 16 stripes of 64 bytes. Each stripe adds, to accumulator i,
// word i^1 of the stripe and lo32(k) * hi32(k) for k = word i ^ secret word (stripe * 8 + i);
// after each whole block every accumulator is scrambled on its own; the last partial block,
// then the input's last 64 bytes (secret offset 121) are accumulated, and the eight are
// merged twice (secret offsets 11 and 117) into the low and high halves. Lanes never read
// each other's accumulators before the merge, and additions mod 2^64 commute, so a lane is
// a function of the input alone (kvstore_xxh3_lane), and what a block adds to it does not
// depend on the accumulator (kvstore_xxh3_block): only the scrambles are serial.
//
// Compiles as CUDA (NVRTC: __CUDACC__ is defined) and as plain C++ (tests/kernels/
// test_page_hash.py builds it with the host compiler and compares it with python-xxhash,
// tolerance 0, on a machine without a GPU).
#pragma once

#ifdef __CUDACC__
#define KVSTORE_XXH3_FN __device__ __forceinline__
#define KVSTORE_XXH3_TABLE __device__ const
#else
#define KVSTORE_XXH3_FN static inline
#define KVSTORE_XXH3_TABLE static const
#endif

typedef unsigned long long kvstore_u64;

// The default secret (192 bytes), XXH3_kSecret of the specification.
alignas(8) KVSTORE_XXH3_TABLE unsigned char kvstore_xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define KVSTORE_XXH3_PRIME32_1 0x9E3779B1ULL
#define KVSTORE_XXH3_PRIME64_1 0x9E3779B185EBCA87ULL
#define KVSTORE_XXH3_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define KVSTORE_XXH3_PRIME_MX1 0x165667919E3779F9ULL
#define KVSTORE_XXH3_BLOCK_NBYTES 1024  // 16 stripes of 64 bytes: (192 - 64) / 8 stripes per block
#define KVSTORE_XXH3_MIN_NBYTES 241     // below this XXH3 takes its short-input paths, not here

// A little-endian 64-bit word at any byte address (the input's last stripe need not be
// aligned; the secret's merge and last-stripe offsets are not).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_read64(const unsigned char* p) {
  if ((reinterpret_cast<unsigned long long>(p) & 7) == 0) {
    return *reinterpret_cast<const kvstore_u64*>(p);  // both targets are little-endian
  }
  kvstore_u64 word = 0;
  for (int b = 7; b >= 0; --b) word = (word << 8) | p[b];
  return word;
}

// The accumulators' starting values, lane by lane (XXH3_INIT_ACC).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_init(int lane) {
  switch (lane) {
    case 0: return 0xC2B2AE3DULL;  // PRIME32_3
    case 1: return KVSTORE_XXH3_PRIME64_1;
    case 2: return KVSTORE_XXH3_PRIME64_2;
    case 3: return 0x165667B19E3779F9ULL;  // PRIME64_3
    case 4: return 0x85EBCA77C2B2AE63ULL;  // PRIME64_4
    case 5: return 0x85EBCA77ULL;          // PRIME32_2
    case 6: return 0x27D4EB2F165667C5ULL;  // PRIME64_5
    default: return KVSTORE_XXH3_PRIME32_1;
  }
}

// One stripe (64 bytes at p, the secret from byte `secret_at`) into accumulator `lane`.
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_stripe(kvstore_u64 acc, const unsigned char* p,
                                                int secret_at, int lane) {
  const kvstore_u64 own = kvstore_xxh3_read64(p + 8 * lane);
  const kvstore_u64 swapped = kvstore_xxh3_read64(p + 8 * (lane ^ 1));
  const kvstore_u64 key = own ^ kvstore_xxh3_read64(kvstore_xxh3_secret + secret_at + 8 * lane);
  return acc + swapped + (key & 0xFFFFFFFFULL) * (key >> 32);
}

// What one whole 1024-byte block adds to accumulator `lane`: its 16 stripes' terms, summed
// (they never read the accumulator, so blocks can be summed in parallel, page_hash.cu).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_block(const unsigned char* block, int lane) {
  kvstore_u64 sum = 0;
#ifdef __CUDACC__
#pragma unroll
#endif
  for (int s = 0; s < 16; ++s) sum = kvstore_xxh3_stripe(sum, block + 64 * s, 8 * s, lane);
  return sum;
}

// The scramble after each whole block (secret bytes 128.., one word per lane).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_scramble(kvstore_u64 acc, int lane) {
  const kvstore_u64 key = kvstore_xxh3_read64(kvstore_xxh3_secret + 128 + 8 * lane);
  return ((acc ^ (acc >> 47)) ^ key) * KVSTORE_XXH3_PRIME32_1;
}

// Whole blocks of an input of `len` bytes (the last block, whole or not, is the tail's).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_blocks(kvstore_u64 len) {
  return (len - 1) / KVSTORE_XXH3_BLOCK_NBYTES;
}

// After the whole blocks: the last block's stripes, then the input's last 64 bytes.
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_tail(kvstore_u64 acc, const unsigned char* input,
                                              kvstore_u64 len, int lane) {
  const kvstore_u64 blocks = kvstore_xxh3_blocks(len);
  const unsigned char* last_block = input + blocks * KVSTORE_XXH3_BLOCK_NBYTES;
  const int stripes = static_cast<int>(((len - 1) - blocks * KVSTORE_XXH3_BLOCK_NBYTES) / 64);
  for (int s = 0; s < stripes; ++s) acc = kvstore_xxh3_stripe(acc, last_block + 64 * s, 8 * s, lane);
  return kvstore_xxh3_stripe(acc, input + len - 64, 192 - 64 - 7, lane);
}

// Accumulator `lane` after the whole input (len >= KVSTORE_XXH3_MIN_NBYTES): the serial
// form of what page_hash.cu computes in two passes.
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_lane(const unsigned char* input, kvstore_u64 len, int lane) {
  kvstore_u64 acc = kvstore_xxh3_init(lane);
  const kvstore_u64 blocks = kvstore_xxh3_blocks(len);
  for (kvstore_u64 n = 0; n < blocks; ++n) {
    acc = kvstore_xxh3_scramble(acc + kvstore_xxh3_block(input + n * KVSTORE_XXH3_BLOCK_NBYTES, lane), lane);
  }
  return kvstore_xxh3_tail(acc, input, len, lane);
}

// The low 64 bits of a * b xor the high 64 bits (XXH3_mul128_fold64).
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_fold(kvstore_u64 a, kvstore_u64 b) {
#ifdef __CUDACC__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  return static_cast<kvstore_u64>(product) ^ static_cast<kvstore_u64>(product >> 64);
#endif
}

// XXH3_mergeAccs: the eight accumulators, with the secret from byte `secret_at`.
KVSTORE_XXH3_FN kvstore_u64 kvstore_xxh3_merge(const kvstore_u64* acc, int secret_at, kvstore_u64 start) {
  kvstore_u64 h = start;
  for (int i = 0; i < 4; ++i) {
    const unsigned char* key = kvstore_xxh3_secret + secret_at + 16 * i;
    h += kvstore_xxh3_fold(acc[2 * i] ^ kvstore_xxh3_read64(key), acc[2 * i + 1] ^ kvstore_xxh3_read64(key + 8));
  }
  h ^= h >> 37;
  h *= KVSTORE_XXH3_PRIME_MX1;
  return h ^ (h >> 32);
}

// (high, low) of the 128-bit hash from the eight accumulators of an input of `len` bytes.
KVSTORE_XXH3_FN void kvstore_xxh3_finish(const kvstore_u64* acc, kvstore_u64 len,
                                         kvstore_u64* high, kvstore_u64* low) {
  *low = kvstore_xxh3_merge(acc, 11, len * KVSTORE_XXH3_PRIME64_1);
  *high = kvstore_xxh3_merge(acc, 192 - 64 - 11, ~(len * KVSTORE_XXH3_PRIME64_2));
}
