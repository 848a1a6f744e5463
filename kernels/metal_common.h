// Header of the Metal split kernel (metal_split.metal): code unpacking.
template <int BITS>
inline float kv_code(uint word, int i) {
  constexpr int PER = 32 / BITS;
  return float((word >> (BITS * (i % PER))) & ((1u << BITS) - 1u));
}
