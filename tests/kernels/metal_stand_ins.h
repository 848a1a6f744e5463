// Stand-ins for the Metal Shading Language names the Metal kernels use, so that a C++
// compiler can check the translation units MLX would hand the Metal compiler
// (tests/kernels/metal_syntax.py builds them, tests/kernels/test_metal_syntax.py runs it).
//
// What this checks: syntax, declared names, types, template instantiation with the plans'
// real template values. What it cannot: address spaces (device/threadgroup/constant vanish),
// attributes (ignored), Metal-only restrictions (no recursion, no function pointers), and
// numerics. The functions are templates over one T where Metal's are generic, so mixed
// argument types (min(int, uint), max(float, half)) fail here as they would there.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 { uint x, y, z; };

// half and bfloat: storage types with implicit conversion to and from float, as in Metal
template <int Tag>
struct StandInFloat {
  float value;
  StandInFloat() = default;
  StandInFloat(float v) : value(v) {}
  operator float() const { return value; }
};
typedef StandInFloat<16> half;
typedef half float16_t;
typedef StandInFloat<17> bfloat16_t;

namespace metal {
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T fma(T a, T b, T c) { return a * b + c; }
inline float exp2(float x) { return std::exp2(x); }
inline float rsqrt(float x) { return 1.f / std::sqrt(x); }

template <typename T> T simd_shuffle_xor(T data, ushort mask) { (void)mask; return data; }
template <typename T> T simd_sum(T data) { return data; }
template <typename T> T simd_max(T data) { return data; }

template <typename T, typename U>
T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T out;
  std::memcpy(&out, &x, sizeof(T));
  return out;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
}  // namespace metal

using namespace metal;
