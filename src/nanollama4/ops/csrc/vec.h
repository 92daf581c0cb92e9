// The vectors both C++ files compute with: 16 floats in GCC/Clang vector extensions (one AVX-512 register,
// two AVX2 ones, four NEON ones, as the flags allow; GCC >= 12 for the shuffles), and their horizontal sums.
// Included by decode.cpp and grouped.cpp; kernels.py names a build by these bytes too.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;  // floats per vector
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float half_vec __attribute__((vector_size(8 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(4 * sizeof(float))));

inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }
inline vec splat(float a) { return vec{} + a; }

inline float hsum(vec v) {  // a tree of halvings: 4 shuffles and adds instead of 15 dependent scalar adds
  half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The sums of 16 vectors as one vector (lane j: the sum of a_j): a butterfly of halving shuffles, 45
// operations where 16 separate reductions take ~80.
inline vec pair_halves(vec a, vec b) {  // lanes 0-7: a's two halves added, 8-15: b's
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline vec pair_quarters(vec a, vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline vec pair_eighths(vec a, vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline vec pair_lanes(vec a, vec b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline vec hsum16(vec a0, vec a1, vec a2, vec a3, vec a4, vec a5, vec a6, vec a7, vec a8, vec a9, vec a10,
                  vec a11, vec a12, vec a13, vec a14, vec a15) {
  vec t0 = pair_halves(a0, a8), t1 = pair_halves(a1, a9), t2 = pair_halves(a2, a10), t3 = pair_halves(a3, a11);
  vec t4 = pair_halves(a4, a12), t5 = pair_halves(a5, a13), t6 = pair_halves(a6, a14), t7 = pair_halves(a7, a15);
  vec s0 = pair_quarters(t0, t4), s1 = pair_quarters(t1, t5), s2 = pair_quarters(t2, t6), s3 = pair_quarters(t3, t7);
  return pair_lanes(pair_eighths(s0, s2), pair_eighths(s1, s3));
}
inline vec hsum16(const vec* a) {
  return hsum16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]);
}

// The CPU's own register width ("wide" vectors): 16 floats with AVX-512, 8 otherwise. A 16-float `vec` on an
// AVX2 CPU is two registers that GCC often moves through the stack: a sum over memory written with it read
// 9 GB/s on a Zen 3 where the same loop with 8-float vectors read 29 (two cores). Loops bound by the bytes
// they read (decode.cpp) use these.
#if defined(__AVX512F__)
constexpr int64_t kWide = 16;
#else
constexpr int64_t kWide = 8;
#endif
typedef float wvec __attribute__((vector_size(kWide * sizeof(float))));
typedef int32_t iwvec __attribute__((vector_size(kWide * sizeof(int32_t))));

inline wvec wload(const float* p) { wvec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void wstore(float* p, wvec v) { std::memcpy(p, &v, sizeof(v)); }
inline wvec wsplat(float a) { return wvec{} + a; }

// The sums of 8 eight-float vectors as one (lane j: the sum of a[j]), by the same butterfly as hsum16's: the
// AVX2 width's `whsum_all`, and decode.cpp's 8-bit tiles' at any width.
inline half_vec halves8(half_vec a, half_vec b) {  // lanes 0-3: a's two halves added, 4-7: b's
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline half_vec quarters8(half_vec a, half_vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
inline half_vec lanes8(half_vec a, half_vec b) {
  return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
inline half_vec hsum8_all(const half_vec* a) {
  const half_vec t0 = halves8(a[0], a[4]), t1 = halves8(a[1], a[5]), t2 = halves8(a[2], a[6]), t3 = halves8(a[3], a[7]);
  return lanes8(quarters8(t0, t2), quarters8(t1, t3));
}
inline float hsum8(half_vec v) {
  quarter_vec q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

#if defined(__AVX512F__)
inline float whsum(wvec v) { return hsum(v); }
inline wvec whsum_all(const wvec* a) { return hsum16(a); }  // lane j: the sum of a[j]
#else
inline float whsum(wvec v) { return hsum8(v); }
inline wvec whsum_all(const wvec* a) { return hsum8_all(a); }
#endif

}  // namespace
