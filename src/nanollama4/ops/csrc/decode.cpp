// One decode step of the model in C++, float32, on the CPU: every row's newest token through every layer
// to its logits, in one call with the GIL released.
//
// A decode step of a small model reads a few megabytes of weights and does little arithmetic, so through
// torch's operators it is bound by their count: ~500 dispatches from Python for the demo's 4 layers
// (benchmarks/RESULTS.md, "The engine's decode step"). Here each layer is a handful of loops: RMSNorm,
// the q/k/v products, RoPE, QK-norm or the NoPE temperature, the cache write and attention over the
// row's visible slots, the output product, the router's top-k and the chosen experts' products, the
// shared expert. A step is bound by the bytes of weights it reads, so every product streams its weight
// from memory once, in the order it lies there, with the CPU's own vector width (vec.h's `wvec`): the
// (out, in) products parallelise over output columns (at::parallel_for, torch's threads), each thread
// reading whole weight rows; the routed experts' (in, out) matrices are split over their input rows
// (gate and up) and their hidden units (down), all chosen experts in one region each.
//
// The math is the model files' (model/: transformer.py, attention.py, moe.py, router.py), and ops/fastdecode.py
// describes the layers to this file and decides when it applies; its COMPUTES and NEEDLESS tables say, for
// each ModelConfig field, where this file computes it or why it need not, and a test fails on a field in
// neither. The plain engine path is the reference that tests compare it to. Layouts: nn.Linear weights
// are (out, in) ("linear"); the routed experts' gate_up (E, D, 2H) and down (E, H, D) are (in, out)
// ("matmul").
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// Weights and caches come as float32 or as bfloat16 (a model loaded with --dtype bfloat16): a bf16 value is
// the top half of a float32's bits, so reading one is a shift, and a bf16 step reads half the bytes. The
// arithmetic is float32 either way; what is written to a bf16 cache is rounded as torch rounds.
typedef uint16_t bf16;
typedef uint16_t hwvec __attribute__((vector_size(kWide * sizeof(uint16_t))));
typedef uint32_t uwvec __attribute__((vector_size(kWide * sizeof(uint32_t))));
inline float as_float(float x) { return x; }
inline float as_float(bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float x, float& out) { out = x; }
inline void from_float(float x, bf16& out) { out = c10::BFloat16(x).x; }  // to nearest even, as torch rounds
inline wvec wload(const bf16* p) {  // one widening load and a shift (GCC's generic widening takes five)
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  hwvec h;
  std::memcpy(&h, p, sizeof(h));
  const uwvec u = __builtin_convertvector(h, uwvec) << 16;
#endif
  wvec v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// 8-bit weights (`--dtype q8_0`): each matrix as (out, in) rows cut into blocks of 32 along the input, each
// block a float32 scale and 32 signed codes (36 bytes: 1.125 a weight, 0.28 of float32's), one stream in
// memory order (the routed experts' (in, out) matrices are packed transposed). As llama.cpp does for its
// Q8_0 products, the inputs of each product are rounded the same way (`QRows`), so a product of two blocks
// is one integer sum of 32 code products times the two scales: integer lanes do the work that converting
// every code to a float would (that conversion bound an earlier version at 0.62x llama.cpp's speed).
constexpr int64_t kQBlock = 32, kQBytes = 4 + kQBlock;  // (Q8 below shifts by 5: 32 a block)
struct Q8 {  // a position in a matrix of blocks, counted in weights, so that `W + n * K` reads as for floats
  const uint8_t* blocks;
  uint64_t at = 0;  // (unsigned: the block and the place in it are a shift and a mask)
  Q8 operator+(int64_t i) const { return {blocks, at + static_cast<uint64_t>(i)}; }
  const uint8_t* block() const { return blocks + (at >> 5) * kQBytes; }
  float scale() const { float s; std::memcpy(&s, block(), 4); return s; }
  const int8_t* codes() const { return reinterpret_cast<const int8_t*>(block() + 4 + (at & 31)); }
};

// Rows of float inputs rounded to 8 bits in blocks of 32: a block's scale is its largest magnitude / 127 and
// each value the nearest code (ties to even, as torch.round) of value / scale, as the weights are rounded.
struct QRows {
  std::vector<int8_t> codes;
  std::vector<float> scales;  // one a block
  int64_t K = 0;
  const int8_t* row(int64_t m) const { return codes.data() + m * K; }
  const float* row_scales(int64_t m) const { return scales.data() + m * (K / kQBlock); }
};
inline void quantize_rows(const float* x, int64_t M, int64_t K, QRows& q) {
  q.K = K;
  q.codes.resize(M * K);
  q.scales.resize(M * K / kQBlock);
  for (int64_t b = 0; b < M * K / kQBlock; ++b) {
    const float* v = x + b * kQBlock;
    float top = 0.f;
    for (int64_t i = 0; i < kQBlock; ++i) top = std::max(top, std::fabs(v[i]));
    const float d = top / 127.f;
    q.scales[b] = d;
    int8_t* c = q.codes.data() + b * kQBlock;
    for (int64_t i = 0; i < kQBlock; ++i)
      c[i] = d > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(v[i] / d), -127.f, 127.f)) : 0;
  }
}

// The products of 32 int8 pairs summed in 8 int32 lanes (as floats: exact, |sum| < 2^24). With AVX2, the
// sign trick: |a| as unsigned bytes times b carrying a's sign (maddubs: pairs into int16, no overflow as codes
// are within +-127), then pairs of those into int32.
typedef int8_t qvec __attribute__((vector_size(32)));
inline qvec qload(const int8_t* p) { qvec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline half_vec block_dot(qvec a_abs, qvec a, qvec b) {
#if defined(__AVX2__)
  __m256i ua, va, vb;
  std::memcpy(&ua, &a_abs, 32); std::memcpy(&va, &a, 32); std::memcpy(&vb, &b, 32);
  const __m256i pairs = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(vb, va));
  const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  half_vec out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
#else
  (void)a_abs;
  half_vec out{};
  for (int i = 0; i < 32; ++i) out[i / 4] += static_cast<float>(static_cast<int32_t>(a[i]) * b[i]);
  return out;
#endif
}
inline qvec qabs(qvec a) {
#if defined(__AVX2__)
  __m256i v;
  std::memcpy(&v, &a, 32);
  v = _mm256_sign_epi8(v, v);
  std::memcpy(&a, &v, 32);
  return a;
#else
  return a < 0 ? -a : a;
#endif
}

// R rows of rounded x times C rows of W over K (a multiple of 32), into y's R rows at C columns (stride N):
// per block, each row's codes and absolute values loaded once for the C weight rows, R * C accumulators of
// 8 lanes, each block's integer sums added in times the two scales.
template <int R, int C>
inline void q8_tile(const QRows& x, int64_t m, Q8 w, int64_t N, float* y) {
  const int64_t K = x.K;
  half_vec acc[R * C] = {};
  for (int64_t k = 0, blk = 0; k < K; k += kQBlock, ++blk) {
    qvec a[R], a_abs[R];
    float xs[R];
    for (int r = 0; r < R; ++r) {
      a[r] = qload(x.row(m + r) + k);
      a_abs[r] = qabs(a[r]);
      xs[r] = x.row_scales(m + r)[blk];
    }
    for (int c = 0; c < C; ++c) {
      const Q8 b = w + c * K + k;
      const qvec codes = qload(b.codes());
      __builtin_prefetch(b.block() + 8 * K / kQBlock * kQBytes);  // (the next 8 rows: see q8_columns)
      const float ws = b.scale();
      for (int r = 0; r < R; ++r) acc[r * C + c] += block_dot(a_abs[r], a[r], codes) * (xs[r] * ws);
    }
  }
  if constexpr (R * C == 8) {
    alignas(32) float out[8];
    const half_vec sums = hsum8_all(acc);
    std::memcpy(out, &sums, sizeof(out));
    for (int r = 0; r < R; ++r) std::memcpy(y + r * N, out + r * C, C * 4);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r * N + c] = hsum8(acc[r * C + c]);
  }
}

// Columns [n0, n1) (any) of y (M x N) = x @ W^T for x's rounded rows m0.. and 8-bit W (N x K), on the
// calling thread: 8 columns at a time, 4 rows at a time where there are 4 (each weight block read once for them).
// The tiles read 8 weight rows side by side, 8 short streams (a row of 768 inputs is 864 bytes) that the
// CPU's prefetcher barely starts on before they end; so each tile asks for the same place 8 rows on, the
// next tile's, as it reads: on a Zen 3 that took one token of a 494M MoE from 3.9 to 2.7-2.9 ms (2 threads).
inline void q8_columns(const QRows& x, int64_t m0, int64_t M, Q8 W, int64_t N, float* y, int64_t n0, int64_t n1) {
  const int64_t K = x.K;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int64_t c = 0; c < 8; c += 2) q8_tile<4, 2>(x, m0 + m, W + (n + c) * K, N, y + m * N + n + c);
    for (; m + 2 <= M; m += 2)
      for (int64_t c = 0; c < 8; c += 4) q8_tile<2, 4>(x, m0 + m, W + (n + c) * K, N, y + m * N + n + c);
    for (; m < M; ++m) q8_tile<1, 8>(x, m0 + m, W + n * K, N, y + m * N + n);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) q8_tile<1, 1>(x, m0 + m, W + n * K, N, y + m * N + n);
}

// Thread t's first column of n split into NT shares of whole groups of 8 (the last share ends at n).
inline int64_t share8(int64_t n, int64_t t, int64_t NT) { return t == NT ? n : n / 8 * t / NT * 8; }

constexpr int64_t kChunkBytes = 32 << 10;  // the least weight a thread's share of a product reads
constexpr int64_t kBlasRows = 32;  // from this many rows (a prompt) torch's products are faster than the tiles here
constexpr int64_t kHead = 64;  // the head width whose attention sums stay in registers

template <typename P>  // P: const float*, const bf16* or Q8
inline float dot(const float* a, P b, int64_t n) {
  wvec s0{}, s1{}, s2{}, s3{};
  int64_t i = 0;
  for (; i + 4 * kWide <= n; i += 4 * kWide) {
    s0 += wload(a + i) * wload(b + i);
    s1 += wload(a + i + kWide) * wload(b + i + kWide);
    s2 += wload(a + i + 2 * kWide) * wload(b + i + 2 * kWide);
    s3 += wload(a + i + 3 * kWide) * wload(b + i + 3 * kWide);
  }
  for (; i + kWide <= n; i += kWide) s0 += wload(a + i) * wload(b + i);
  float s = whsum((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) s += a[i] * as_float(b[i]);
  return s;
}

// R rows of x times C rows of W (R * C = kWide dot products over K, a multiple of kWide), finished together
// into y's R rows at C columns (stride N): kWide accumulators and R + C loads fit the registers.
template <int R, int C, typename P>
inline void linear_tile(const float* x, int64_t K, P w, int64_t N, float* y) {
  static_assert(R * C == kWide, "one vector of sums");
  wvec acc[kWide] = {};
  for (int64_t k = 0; k < K; k += kWide) {
    wvec a[R];
    for (int r = 0; r < R; ++r) a[r] = wload(x + r * K + k);
    for (int c = 0; c < C; ++c) {
      const wvec b = wload(w + c * K + k);
      if constexpr (!std::is_same_v<P, const float*>) __builtin_prefetch(&w[(c + kWide) * K + k]);
      for (int r = 0; r < R; ++r) acc[r * C + c] += a[r] * b;
    }
  }
  const wvec sums = whsum_all(acc);
  alignas(64) float out[kWide];
  wstore(out, sums);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * N, out + r * C, C * 4);
}

template <typename P>
struct Product {  // y (M x N) = x @ W^T for W (N x K)
  P W;
  int64_t N;
  float* y;
};

// Columns [n0, n1) of a product (a multiple of kWide each) for all M rows, on the calling thread.
template <typename P>
void product_columns(const float* x, int64_t M, int64_t K, const Product<P>& p, int64_t n0, int64_t n1) {
  constexpr int C4 = kWide / 4, C2 = kWide / 2;
  const int64_t N = p.N;
  for (; n0 < n1; n0 += kWide) {
    const P W = p.W + n0 * K;
    float* y = p.y + n0;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)  // 4 rows at a time: each weight row read once for the four
      for (int64_t c = 0; c < kWide; c += C4) linear_tile<4, C4>(x + m * K, K, W + c * K, N, y + m * N + c);
    for (; m + 2 <= M; m += 2)
      for (int64_t c = 0; c < kWide; c += C2) linear_tile<2, C2>(x + m * K, K, W + c * K, N, y + m * N + c);
    for (; m < M; ++m) linear_tile<1, kWide>(x + m * K, K, W, N, y + m * N);
  }
}

// Whether `linear` computes x (M x K) @ W^T (W: N x K) in tiles on its own threads (else torch's product
// or plain dot products): the shapes a fused region (`experts`) may split between its threads too.
inline bool tiled(int64_t M, int64_t K, int64_t N) { return M < kBlasRows && K % kWide == 0 && N % kWide == 0; }

// Every product of x (M x K) in `products` from 8-bit weights: x rounded once (`QRows`), then the products'
// groups of 8 columns split between torch's threads, as `linear` splits float32 ones.
inline void linear_q8(const float* x, int64_t M, int64_t K, std::initializer_list<Product<Q8>> products) {
  static thread_local QRows scratch;  // (the calling thread's: the lambda below reads it through `q`)
  QRows& q = scratch;
  quantize_rows(x, M, K, q);
  std::vector<int64_t> first{0};  // each product's first group of 8 columns
  for (const Product<Q8>& p : products) first.push_back(first.back() + (p.N + 7) / 8);
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (8 * K * kQBytes / kQBlock));
  at::parallel_for(0, first.back(), grain, [&](int64_t g0, int64_t g1) {
    for (size_t i = 0; i + 1 < first.size(); ++i) {
      const int64_t a = std::max(g0, first[i]), b = std::min(g1, first[i + 1]);
      const Product<Q8>& p = products.begin()[i];
      if (a < b) q8_columns(q, 0, M, p.W, p.N, p.y, (a - first[i]) * 8, std::min(p.N, (b - first[i]) * 8));
    }
  });
}

// Every product of x (M x K) in `products` (each y_i = x @ W_i^T): each thread takes whole output columns,
// reading each of its weight rows once for all M rows (from memory once, then from its L1 cache for each
// further tile of rows). Products of one input (q, k and v; gate and up) share one parallel region: a
// region costs microseconds to open and join, a tenth of a small model's whole step.
template <typename P>
void linear_float(const float* x, int64_t M, int64_t K, std::initializer_list<Product<P>> products) {
  if constexpr (std::is_same_v<P, const float*>) {  // (bf16 or int8 weights: the tiles; torch's bf16 products round x)
    if (M >= kBlasRows) {
      auto xt = at::from_blob(const_cast<float*>(x), {M, K});
      for (const Product<P>& p : products) {
        auto yt = at::from_blob(p.y, {M, p.N});
        at::mm_out(yt, xt, at::from_blob(const_cast<float*>(p.W), {p.N, K}).t());
      }
      return;
    }
  }
  bool all_tiled = true;
  std::vector<int64_t> first{0};  // each product's first group of kWide columns
  for (const Product<P>& p : products) {
    all_tiled = all_tiled && K % kWide == 0 && p.N % kWide == 0;  // (many rows of float32 went to torch above)
    first.push_back(first.back() + p.N / kWide);
  }
  if (all_tiled) {  // kWide columns at a time, their dot products finished together
    const int64_t grain = std::max<int64_t>(1, kChunkBytes / (kWide * K * 4));
    at::parallel_for(0, first.back(), grain, [&](int64_t g0, int64_t g1) {
      for (size_t i = 0; i + 1 < first.size(); ++i) {  // the groups of each product in [g0, g1)
        const int64_t a = std::max(g0, first[i]), b = std::min(g1, first[i + 1]);
        if (a < b) product_columns(x, M, K, products.begin()[i], (a - first[i]) * kWide, (b - first[i]) * kWide);
      }
    });
    return;
  }
  for (const Product<P>& p : products) {
    const int64_t grain = std::max<int64_t>(1, kChunkBytes / (K * 4));
    at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) p.y[m * p.N + n] = dot(x + m * K, p.W + n * K, K);
    });
  }
}

template <typename P>  // (float32 or bfloat16 weights: `linear_float`; 8-bit codes: `linear_q8`)
void linear(const float* x, int64_t M, int64_t K, std::initializer_list<Product<P>> products) {
  if constexpr (std::is_same_v<P, Q8>)
    linear_q8(x, M, K, products);
  else
    linear_float(x, M, K, products);
}

// y (N) += sum over k in [k0, k1) of a[k] * W[k, :] for W (K x N, rows contiguous): the rows of an (in, out)
// matrix streamed in their order, four at a time, into y (which stays in L1 for the widths here).
template <typename P>
void add_rows(const float* a, P W, int64_t N, int64_t k0, int64_t k1, float* y) {
  const int64_t vector_end = N - N % kWide;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const P w0 = W + k * N, w1 = w0 + N, w2 = w1 + N, w3 = w2 + N;
    const wvec a0 = wsplat(a[k]), a1 = wsplat(a[k + 1]), a2 = wsplat(a[k + 2]), a3 = wsplat(a[k + 3]);
    int64_t n = 0;
    for (; n < vector_end; n += kWide) {
      if constexpr (!std::is_same_v<P, const float*>) {
        __builtin_prefetch(&w0[n + 4 * N]); __builtin_prefetch(&w1[n + 4 * N]);
        __builtin_prefetch(&w2[n + 4 * N]); __builtin_prefetch(&w3[n + 4 * N]);
      }
      wstore(y + n, wload(y + n) + ((a0 * wload(w0 + n) + a1 * wload(w1 + n)) + (a2 * wload(w2 + n) + a3 * wload(w3 + n))));
    }
    for (; n < N; ++n)
      y[n] += (a[k] * as_float(w0[n]) + a[k + 1] * as_float(w1[n])) + (a[k + 2] * as_float(w2[n]) + a[k + 3] * as_float(w3[n]));
  }
  for (; k < k1; ++k) {
    const P w = W + k * N;
    const wvec ak = wsplat(a[k]);
    int64_t n = 0;
    for (; n < vector_end; n += kWide) wstore(y + n, wload(y + n) + ak * wload(w + n));
    for (; n < N; ++n) y[n] += a[k] * as_float(w[n]);
  }
}

constexpr int64_t kRowBlock = 8;  // input rows of an expert's matrix read once for all of its rows of x

// x / rms(x) * w over each row of n (w may be null: no gain), as F.rms_norm computes it
template <typename T>
void rms_norm(const float* x, const T* w, float eps, int64_t n, float* out) {
  const float scale = 1.f / std::sqrt(dot(x, x, n) / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w ? x[i] * scale * as_float(w[i]) : x[i] * scale;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// exp of kWide floats at once, to about 2 ulp: e^x = 2^n · e^r with n = round(x / ln 2) and |r| <= ln 2 / 2,
// e^r from its Taylor series to r^7 (error below 2^-26 there), 2^n put in the float's exponent bits.
// The scalar std::exp is a library call per value; SwiGLU takes one per hidden unit.
inline wvec vexp(wvec x) {
  x = x < -87.f ? wsplat(-87.f) : x;
  x = x > 88.f ? wsplat(88.f) : x;
  const wvec t = x * 1.44269504088896341f + 0.5f;
  wvec n = __builtin_convertvector(__builtin_convertvector(t, iwvec), wvec);
  n = n > t ? n - 1.f : n;  // floor(x / ln 2 + 1/2)
  const wvec r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  wvec p = wsplat(1.f / 5040);
  p = p * r + 1.f / 720; p = p * r + 1.f / 120; p = p * r + 1.f / 24; p = p * r + 1.f / 6;
  p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  const iwvec bits = (__builtin_convertvector(n, iwvec) + 127) << 23;
  wvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out[i] = silu(g[i]) * u[i] over n values (g and u may each be out)
inline void swiglu_rows(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kWide <= n; i += kWide) {
    const wvec a = wload(g + i);
    wstore(out + i, a / (1.f + vexp(-a)) * wload(u + i));
  }
  for (; i < n; ++i) out[i] = silu(g[i]) * u[i];
}

enum RouterKind { kSigmoid = 0, kSoftmaxChosen = 1, kSoftmaxAll = 2 };

struct Layer {
  // attention
  at::Tensor attn_norm, wq, wk, wv, wo;
  bool rope = false, qk_norm = false, temperature = false, window = false;
  int64_t chunk = 0;  // 0: no chunking
  float floor_scale = 1.f, attn_scale = 0.f;
  at::Tensor k_cache, v_cache, pos_cache;  // (R, S, KV, Dh), (R, S, KV, Dh), (R, S) int64
  // feed-forward: dense SwiGLU (gate, up, down as linears), or routed experts + an optional shared one
  at::Tensor ffn_norm, gate, up, down;
  bool moe = false;
  at::Tensor router, bias, gate_up, expert_down;
  int64_t router_kind = kSigmoid, top_k = 1;
  bool scales_input = true;
};

// T: the type of the cache, norms, embedding and router; W: how the matrices are read (the weights' pointer
// type: const T*, or Q8 for 8-bit codes).
template <typename T, typename W = const T*>
class DecodeStep {
 public:
  DecodeStep(at::Tensor embed, at::Tensor norm, at::Tensor head, at::Tensor rope_table, double eps,
             int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, std::vector<std::vector<at::Tensor>> tensors,
             std::vector<std::vector<int64_t>> ints, std::vector<std::vector<double>> floats)
      : embed_(embed), norm_(norm), head_(head), rope_(rope_table), eps_(static_cast<float>(eps)),
        H_(n_heads), KV_(n_kv_heads), Dh_(head_dim) {
    D_ = embed.size(1);
    V_ = head.size(0);
    TORCH_CHECK(tensors.size() == ints.size() && ints.size() == floats.size(), "one description per layer");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      const auto& n = ints[i];
      const auto& f = floats[i];
      TORCH_CHECK(n.size() == 10 && f.size() == 2, "layer description: 10 ints and 2 floats");
      Layer L;
      L.attn_norm = t.at(0); L.wq = t.at(1); L.wk = t.at(2); L.wv = t.at(3); L.wo = t.at(4);
      L.k_cache = t.at(5); L.v_cache = t.at(6); L.pos_cache = t.at(7); L.ffn_norm = t.at(8);
      L.rope = n[0]; L.qk_norm = n[1]; L.temperature = n[2]; L.chunk = n[3]; L.window = n[4]; L.moe = n[5];
      L.router_kind = n[7]; L.top_k = n[8]; L.scales_input = n[9];
      L.floor_scale = static_cast<float>(f[0]); L.attn_scale = static_cast<float>(f[1]);
      const bool dense_or_shared = !L.moe || n[6];
      size_t j = 9;
      if (L.moe) { L.router = t.at(j++); L.bias = t.at(j++); L.gate_up = t.at(j++); L.expert_down = t.at(j++); }
      if (dense_or_shared) { L.gate = t.at(j++); L.up = t.at(j++); L.down = t.at(j++); }
      for (const at::Tensor* w : {&L.attn_norm, &L.k_cache, &L.v_cache, &L.ffn_norm, &L.router, &L.bias})
        if (w->defined()) TORCH_CHECK(w->scalar_type() == kType && w->is_contiguous(), "one dtype, contiguous");
      for (const at::Tensor* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate_up, &L.expert_down, &L.gate, &L.up, &L.down})
        if (w->defined()) TORCH_CHECK(w->scalar_type() == kMatrixType && w->is_contiguous(), "matrices: one dtype, contiguous");
      TORCH_CHECK(L.pos_cache.scalar_type() == at::kLong && L.pos_cache.is_contiguous(), "int64 positions");
      layers_.push_back(std::move(L));
    }
  }

  // rows: each entry's cache row (default: entry i in row i); entries of one row must come in position order
  at::Tensor step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                  std::vector<int64_t> rows) {
    const int64_t B = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(B > 0 && static_cast<int64_t>(positions.size()) == B, "one position per token");
    if (rows.empty())
      for (int64_t b = 0; b < B; ++b) rows.push_back(b);
    TORCH_CHECK(static_cast<int64_t>(rows.size()) == B, "one row per token");
    const int64_t R = layers_.empty() ? 0 : layers_[0].k_cache.size(0);
    distinct_ = true;
    std::vector<int64_t> last(R, -1);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rows[b] >= 0 && rows[b] < R, "row out of range");
      if (last[rows[b]] >= 0) {
        distinct_ = false;
        TORCH_CHECK(positions[b] > last[rows[b]], "a row's tokens must come in position order");
      }
      last[rows[b]] = positions[b];
    }
    row_ = std::move(rows);
    const int64_t D = D_, QD = H_ * Dh_, KD = KV_ * Dh_;
    x_.assign(B * D, 0.f);
    h_.resize(B * D);
    q_.resize(B * QD); k_.resize(B * KD); v_.resize(B * KD); att_.resize(B * QD); y_.resize(B * D);
    const T* E = ptr(embed_);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tokens[b] >= 0 && tokens[b] < embed_.size(0), "token id out of range");
      TORCH_CHECK(positions[b] >= 0 && positions[b] < rope_.size(0), "position out of range");
      for (int64_t d = 0; d < D; ++d) x_[b * D + d] = as_float(E[tokens[b] * D + d]);
    }
    for (auto& L : layers_) {
      for (int64_t b = 0; b < B; ++b) rms_norm(&x_[b * D], ptr(L.attn_norm), eps_, D, &h_[b * D]);
      attention(L, B, positions);
      for (int64_t i = 0; i < B * D; ++i) x_[i] += y_[i];
      for (int64_t b = 0; b < B; ++b) rms_norm(&x_[b * D], ptr(L.ffn_norm), eps_, D, &h_[b * D]);
      std::fill(y_.begin(), y_.end(), 0.f);
      const bool shared_inside = L.moe && L.gate.defined() && (kQ8 || tiled(B, D, L.gate.size(0))) &&
                                 (kQ8 || tiled(B, L.gate.size(0), D));
      if (L.moe) experts(L, B, shared_inside);
      if (L.gate.defined() && !shared_inside) swiglu(L, B);
      for (int64_t i = 0; i < B * D; ++i) x_[i] += y_[i];
    }
    for (int64_t b = 0; b < B; ++b) rms_norm(&x_[b * D], ptr(norm_), eps_, D, &h_[b * D]);
    at::Tensor logits = at::empty({B, V_}, at::kFloat);
    linear<W>(h_.data(), B, D, {{wptr(head_), V_, logits.data_ptr<float>()}});
    return logits;
  }

 private:
  void attention(Layer& L, int64_t B, const std::vector<int64_t>& positions) {
    const int64_t D = D_, QD = H_ * Dh_, KD = KV_ * Dh_, half = Dh_ / 2, rep = H_ / KV_;
    linear<W>(h_.data(), B, D, {{wptr(L.wq), QD, q_.data()}, {wptr(L.wk), KD, k_.data()},
                             {wptr(L.wv), KD, v_.data()}});
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = positions[b];
      if (L.rope) {  // rotate each pair of every head (queries and keys), then the weightless QK-norm
        const float* cs = rope_.data_ptr<float>() + p * half * 2;
        auto rotate = [&](float* row, int64_t heads) {
          for (int64_t h = 0; h < heads; ++h) {
            float* r = row + h * Dh_;
            for (int64_t i = 0; i < half; ++i) {
              const float x0 = r[2 * i], x1 = r[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
              r[2 * i] = x0 * c - x1 * s;
              r[2 * i + 1] = x0 * s + x1 * c;
            }
            if (L.qk_norm) rms_norm<float>(r, nullptr, eps_, Dh_, r);
          }
        };
        rotate(&q_[b * QD], H_);
        rotate(&k_[b * KD], KV_);
      } else if (L.temperature) {
        const float t = 1.f + L.attn_scale * std::log1p(std::floor((static_cast<float>(p) + 1.f) / L.floor_scale));
        for (int64_t i = 0; i < QD; ++i) q_[b * QD + i] *= t;
      }
    }
    // each row attends to its slots that the mask allows (0 <= position <= p, in p's chunk when chunked)
    // and to its new key; a ring (chunked layer) is read before the new key overwrites its oldest slot
    const int64_t S = L.k_cache.size(1);
    T* kc = reinterpret_cast<T*>(L.k_cache.data_ptr());
    T* vc = reinterpret_cast<T*>(L.v_cache.data_ptr());
    kt_.resize(B * KD); vt_.resize(B * KD);  // the new keys and values as the cache holds them
    for (int64_t i = 0; i < B * KD; ++i) { from_float(k_[i], kt_[i]); from_float(v_[i], vt_[i]); }
    int64_t* pc = L.pos_cache.data_ptr<int64_t>();
    const float scale = 1.f / std::sqrt(static_cast<float>(Dh_));
    const int64_t reach = L.window ? S : 0;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, (L.window ? S : positions[b]) + 1);
    auto attend = [&](int64_t b, int64_t h, std::vector<const T*>& keys, std::vector<const T*>& values,
                      std::vector<float>& w) {
      const int64_t r = row_[b], g = h / rep, p = positions[b];
      const int64_t candidates = L.window ? reach : p;
      keys.clear(); values.clear();
      for (int64_t s = 0; s < candidates; ++s) {
        const int64_t kp = pc[r * S + s];
        if (kp < 0 || kp > p || (L.chunk && kp / L.chunk != p / L.chunk)) continue;
        keys.push_back(kc + ((r * S + s) * KV_ + g) * Dh_);
        values.push_back(vc + ((r * S + s) * KV_ + g) * Dh_);
      }
      keys.push_back(&kt_[b * KD + g * Dh_]);
      values.push_back(&vt_[b * KD + g * Dh_]);
      const float* q = &q_[b * QD + h * Dh_];
      const int64_t n = static_cast<int64_t>(keys.size());
      w.resize(n);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j] = dot(q, keys[j], Dh_) * scale);
      wvec sums{};
      int64_t j = 0;
      for (; j + kWide <= n; j += kWide) {  // the softmax's exponentials a vector at a time
        const wvec e = vexp(wload(&w[j]) - top);
        wstore(&w[j], e);
        sums += e;
      }
      float total = whsum(sums);
      for (; j < n; ++j) total += (w[j] = std::exp(w[j] - top));
      float* out = &att_[b * QD + h * Dh_];
      if (Dh_ == kHead) {  // a head of 64 (the demo's) in registers
        wvec o[kHead / kWide] = {};
        for (j = 0; j < n; ++j) {
          const wvec a = wsplat(w[j] / total);
          for (int64_t d = 0; d < kHead / kWide; ++d) o[d] += a * wload(values[j] + d * kWide);
        }
        for (int64_t d = 0; d < kHead / kWide; ++d) wstore(out + d * kWide, o[d]);
        return;
      }
      std::fill(out, out + Dh_, 0.f);
      for (j = 0; j < n; ++j) {
        const float a = w[j] / total;
        for (int64_t d = 0; d < Dh_; ++d) out[d] += a * as_float(values[j][d]);
      }
    };
    auto write = [&](int64_t b) {  // b's new key into its slot: the position, or its place in the ring
      const int64_t r = row_[b], p = positions[b], s = L.window ? p % S : p;
      TORCH_CHECK(s < S, "position past the cache");
      std::memcpy(kc + (r * S + s) * KD, &kt_[b * KD], KD * sizeof(T));
      std::memcpy(vc + (r * S + s) * KD, &vt_[b * KD], KD * sizeof(T));
      pc[r * S + s] = p;
    };
    const int64_t grain = std::max<int64_t>(1, 8192 / (longest * Dh_));
    if (distinct_) {  // rows of their own: every (row, head) at once, then the writes
      at::parallel_for(0, B * H_, grain, [&](int64_t i0, int64_t i1) {
        std::vector<const T*> keys, values;
        std::vector<float> w;
        for (int64_t i = i0; i < i1; ++i) attend(i / H_, i % H_, keys, values, w);
      });
      for (int64_t b = 0; b < B; ++b) write(b);
    } else {  // a prompt's tokens in one row: in order, each seeing the keys written before it
      for (int64_t b = 0; b < B; ++b) {
        at::parallel_for(0, H_, grain, [&](int64_t h0, int64_t h1) {
          std::vector<const T*> keys, values;
          std::vector<float> w;
          for (int64_t h = h0; h < h1; ++h) attend(b, h, keys, values, w);
        });
        write(b);
      }
    }
    linear<W>(att_.data(), B, QD, {{wptr(L.wo), D_, y_.data()}});
  }

  void swiglu(Layer& L, int64_t B) {  // the dense FFN or the shared expert, added into y_
    const int64_t F = L.gate.size(0);
    g_.resize(B * F); u_.resize(B * F); out_.resize(B * D_);
    linear<W>(h_.data(), B, D_, {{wptr(L.gate), F, g_.data()}, {wptr(L.up), F, u_.data()}});
    swiglu_rows(g_.data(), u_.data(), B * F, g_.data());
    linear<W>(g_.data(), B, F, {{wptr(L.down), D_, out_.data()}});
    for (int64_t i = 0; i < B * D_; ++i) y_[i] += out_[i];
  }

  // Each row's top-k experts and their weights (the router's kind), as lists of (row, weight) by expert.
  std::vector<std::vector<std::pair<int64_t, float>>> route(Layer& L, int64_t B) {
    const int64_t E = L.router.size(0), K = L.top_k;
    logits_.resize(B * E);
    linear(h_.data(), B, D_, {Product<const T*>{ptr(L.router), E, logits_.data()}});
    const T* bias = ptr(L.bias);
    std::vector<std::vector<std::pair<int64_t, float>>> rows(E);  // expert -> (row, weight)
    std::vector<int64_t> chosen(K);
    std::vector<float> choice(E);
    for (int64_t b = 0; b < B; ++b) {
      const float* l = &logits_[b * E];
      for (int64_t e = 0; e < E; ++e) choice[e] = l[e] + as_float(bias[e]);
      for (int64_t k = 0; k < K; ++k) {  // the k best choices, the lower index first on ties
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (std::find(chosen.begin(), chosen.begin() + k, e) == chosen.begin() + k &&
              (best < 0 || choice[e] > choice[best]))
            best = e;
        chosen[k] = best;
      }
      std::vector<float> weight(K);
      if (L.router_kind == kSigmoid) {
        for (int64_t k = 0; k < K; ++k) weight[k] = 1.f / (1.f + std::exp(-l[chosen[k]]));
      } else {
        float top = -std::numeric_limits<float>::infinity(), total = 0.f;
        const bool all = L.router_kind == kSoftmaxAll;
        for (int64_t e = 0; e < E; ++e)
          if (all || std::find(chosen.begin(), chosen.end(), e) != chosen.end()) top = std::max(top, l[e]);
        for (int64_t e = 0; e < E; ++e)
          if (all || std::find(chosen.begin(), chosen.end(), e) != chosen.end()) total += std::exp(l[e] - top);
        for (int64_t k = 0; k < K; ++k) weight[k] = std::exp(l[chosen[k]] - top) / total;
      }
      for (int64_t k = 0; k < K; ++k) rows[chosen[k]].push_back({b, weight[k]});
    }
    return rows;
  }

  // Every chosen expert's rows gathered as `slots` (scaled by their weights where the router scales the
  // input) into xe_; first[e]: expert e's first slot.
  void gather(Layer& L, const std::vector<std::vector<std::pair<int64_t, float>>>& rows, std::vector<int64_t>& first) {
    const int64_t E = static_cast<int64_t>(rows.size());
    first.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + static_cast<int64_t>(rows[e].size());
    xe_.resize(first[E] * D_);
    for (int64_t e = 0; e < E; ++e)
      for (size_t r = 0; r < rows[e].size(); ++r) {
        const float a = L.scales_input ? rows[e][r].second : 1.f;
        const float* src = &h_[rows[e][r].first * D_];
        float* dst = &xe_[(first[e] + r) * D_];
        for (int64_t d = 0; d < D_; ++d) dst[d] = src[d] * a;
      }
  }

  // Route each row, then each chosen expert on its rows, added into y_; with `shared`, the shared expert too,
  // its products split between the same two regions' threads (a region costs microseconds to open and join).
  void experts(Layer& L, int64_t B, bool shared) {
    if constexpr (kQ8)
      experts_q8(L, B, shared);
    else
      experts_float(L, B, shared);
  }

  // The routed experts' (in, out) matrices in float32 or bfloat16 (see below).
  void experts_float(Layer& L, int64_t B, bool shared) {
    const int64_t E = L.router.size(0), Hd = L.expert_down.size(1);
    const auto rows = route(L, B);
    // Every chosen expert's rows gathered (scaled by their weights where the router scales the input) as
    // `slots`, then two parallel regions over all chosen experts, each thread with its share of every one:
    // - gate and up: gate_up (D, 2H) is split over its input rows, so a thread streams whole rows of it,
    //   kRowBlock at a time for all of the expert's slots, into partial sums of its own;
    // - down: the hidden units are split, so a thread adds up its units' partial sums, takes their SwiGLU
    //   and streams their rows of down (H, D) into its own buffer of outputs.
    // No thread waits for another inside a region, and each weight is read once, in the order it lies. The
    // shared expert's (out, in) products are split over their output columns between the same threads.
    std::vector<int64_t> first;
    gather(L, rows, first);
    const int64_t slots = first[E], F = 2 * Hd;
    const int64_t NT = at::get_num_threads(), SF = shared ? L.gate.size(0) : 0;
    part_.assign(NT * slots * F, 0.f);
    if (shared) { g_.resize(B * SF); u_.resize(B * SF); out_.resize(B * D_); }
    const Product<W> shared_gate{shared ? wptr(L.gate) : W{}, SF, g_.data()};
    const Product<W> shared_up{shared ? wptr(L.up) : W{}, SF, u_.data()};
    const Product<W> shared_down{shared ? wptr(L.down) : W{}, D_, out_.data()};
    auto share = [NT](int64_t n, int64_t t) { return n / kWide * t / NT * kWide; };  // thread t's first column
    at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (shared) {
          product_columns(h_.data(), B, D_, shared_gate, share(SF, t), share(SF, t + 1));
          product_columns(h_.data(), B, D_, shared_up, share(SF, t), share(SF, t + 1));
        }
        const int64_t k0 = D_ * t / NT, k1 = D_ * (t + 1) / NT;
        for (int64_t e = 0; e < E; ++e) {
          const W gate_up = wptr(L.gate_up) + e * D_ * F;
          for (int64_t k = k0; k < k1; k += kRowBlock)
            for (int64_t s = first[e]; s < first[e + 1]; ++s)
              add_rows(&xe_[s * D_], gate_up, F, k, std::min(k + kRowBlock, k1), &part_[(t * slots + s) * F]);
        }
      }
    });
    if (shared) swiglu_rows(g_.data(), u_.data(), B * SF, g_.data());
    ye_.assign(NT * B * D_, 0.f);
    at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> act(F);
      for (int64_t t = t0; t < t1; ++t) {
        if (shared) product_columns(g_.data(), B, SF, shared_down, share(D_, t), share(D_, t + 1));
        const int64_t j0 = Hd * t / NT, j1 = Hd * (t + 1) / NT, width = j1 - j0;
        float* mine = &ye_[t * B * D_];
        for (int64_t e = 0; e < E; ++e) {
          const W down = wptr(L.expert_down) + e * Hd * D_;
          for (int64_t s = first[e]; s < first[e + 1]; ++s) {
            float* g = act.data();
            float* u = act.data() + width;
            std::fill(act.begin(), act.end(), 0.f);
            for (int64_t p = 0; p < NT; ++p) {  // the threads' partial sums, in thread order
              const float* sums = &part_[(p * slots + s) * F];
              for (int64_t j = 0; j < width; ++j) { g[j] += sums[j0 + j]; u[j] += sums[Hd + j0 + j]; }
            }
            swiglu_rows(g, u, width, g);
            const auto& [row, weight] = rows[e][s - first[e]];
            if (!L.scales_input)
              for (int64_t j = 0; j < width; ++j) g[j] *= weight;
            add_rows(g, down + j0 * D_, D_, 0, width, mine + row * D_);
          }
        }
      }
    });
    for (int64_t t = 0; t < NT; ++t)
      for (int64_t i = 0; i < B * D_; ++i) y_[i] += ye_[t * B * D_ + i];
    if (shared)
      for (int64_t i = 0; i < B * D_; ++i) y_[i] += out_[i];
  }

  // The routed experts from 8-bit codes, each packed (out, in): gate_up (E, 2H, D), down (E, D, H). Two
  // regions, each thread with its share of every chosen expert's output columns (and the shared expert's):
  // gate and up columns j and H + j with their SwiGLU, then down's. Each input is rounded once before its
  // region (the gathered rows, then the activations).
  void experts_q8(Layer& L, int64_t B, bool shared) {
    const int64_t E = L.router.size(0), F = L.gate_up.size(1), H = F / 2, D = D_;
    const auto rows = route(L, B);
    std::vector<int64_t> first;
    gather(L, rows, first);
    const int64_t slots = first[E], NT = at::get_num_threads(), SF = shared ? L.gate.size(0) : 0;
    quantize_rows(xe_.data(), slots, D, qx_);
    if (shared) {
      quantize_rows(h_.data(), B, D, qh_);
      g_.resize(B * SF); u_.resize(B * SF); out_.resize(B * D);
    }
    part_.resize(slots * F);  // each slot's gate and up
    act_.resize(slots * H);
    at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (shared) {
          const int64_t c0 = share8(SF, t, NT), c1 = share8(SF, t + 1, NT);
          q8_columns(qh_, 0, B, wptr(L.gate), SF, g_.data(), c0, c1);
          q8_columns(qh_, 0, B, wptr(L.up), SF, u_.data(), c0, c1);
        }
        const int64_t j0 = share8(H, t, NT), j1 = share8(H, t + 1, NT);
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = first[e + 1] - first[e];
          if (!n) continue;
          const Q8 gate_up = wptr(L.gate_up) + e * F * D;
          float* gu = &part_[first[e] * F];
          q8_columns(qx_, first[e], n, gate_up, F, gu, j0, j1);
          q8_columns(qx_, first[e], n, gate_up, F, gu, H + j0, H + j1);
          for (int64_t r = 0; r < n; ++r) {
            float* a = &act_[(first[e] + r) * H];
            swiglu_rows(gu + r * F + j0, gu + r * F + H + j0, j1 - j0, a + j0);
            if (!L.scales_input)
              for (int64_t j = j0; j < j1; ++j) a[j] *= rows[e][r].second;
          }
        }
      }
    });
    quantize_rows(act_.data(), slots, H, qa_);
    if (shared) {
      swiglu_rows(g_.data(), u_.data(), B * SF, g_.data());
      quantize_rows(g_.data(), B, SF, qg_);
    }
    ye_.resize(slots * D);
    at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c0 = share8(D, t, NT), c1 = share8(D, t + 1, NT);
        if (shared) q8_columns(qg_, 0, B, wptr(L.down), D, out_.data(), c0, c1);
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = first[e + 1] - first[e];
          if (n) q8_columns(qa_, first[e], n, wptr(L.expert_down) + e * D * H, D, &ye_[first[e] * D], c0, c1);
        }
      }
    });
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < first[e + 1] - first[e]; ++r) {
        const float* src = &ye_[(first[e] + r) * D];
        float* dst = &y_[rows[e][r].first * D];
        for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
      }
    if (shared)
      for (int64_t i = 0; i < B * D; ++i) y_[i] += out_[i];
  }

  static constexpr at::ScalarType kType = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  static constexpr bool kQ8 = std::is_same_v<W, Q8>;
  static constexpr at::ScalarType kMatrixType = kQ8 ? at::kByte : kType;
  static const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
  static W wptr(const at::Tensor& t) {
    if constexpr (std::is_same_v<W, Q8>)
      return Q8{t.data_ptr<uint8_t>()};
    else
      return reinterpret_cast<W>(t.data_ptr());
  }

  at::Tensor embed_, norm_, head_, rope_;
  float eps_;
  int64_t H_, KV_, Dh_, D_ = 0, V_ = 0;
  std::vector<Layer> layers_;
  std::vector<int64_t> row_;  // this step's entries' cache rows
  bool distinct_ = true;  // every entry in a row of its own
  // scratch, reused by every step (a step's buffers are sized by its rows)
  std::vector<float> x_, h_, q_, k_, v_, att_, y_, g_, u_, out_, logits_, xe_, ye_, part_, act_;
  QRows qx_, qh_, qa_, qg_;  // (8-bit steps: the experts' inputs rounded)
  std::vector<T> kt_, vt_;
};

}  // namespace

template <typename T, typename W = const T*>
void bind(py::module& m, const char* name) {
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<DecodeStep<T, W>>(m, name)
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t,
                    std::vector<std::vector<at::Tensor>>, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<double>>>())
      .def("step", &DecodeStep<T, W>::step, "logits (B, vocab) of each entry's token at its position, in its row",
           py::arg("tokens"), py::arg("positions"), py::arg("rows") = std::vector<int64_t>{}, release());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind<float>(m, "DecodeStep");
  bind<bf16>(m, "DecodeStepBF16");
  bind<float, Q8>(m, "DecodeStepQ8");
}
