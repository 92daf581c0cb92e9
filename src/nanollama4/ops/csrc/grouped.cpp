// Grouped matrix products for a mixture of experts on the CPU, float32 (and bf16 further down: AVX512_BF16),
// rows sorted by expert.
//
// torch's products are built for large matrices: for an expert that sees a handful of rows, MKL spends
// its time packing the weight and both cores synchronise on every product, so an MoE layer with many
// experts ran several times slower than a dense layer of the same active size. Here each core takes
// an equal share of a call's work in whole experts (no synchronisation inside a call; a group that
// straddles two shares is cut between them), and
// every product runs through register-tiled loops that read each weight element once per six rows.
// On the AMD EPYC we develop on they also beat torch's fp32 products on large groups, about 2x
// (measured 2026-11-29, see git history of benchmarks/RESULTS.md). Written with GCC/Clang vector
// extensions (GCC >= 12 for the shuffles), which compile to AVX-512, AVX2 or NEON as the flags allow.
//
// Three products per call, matching a linear layer's forward and its two gradients, for groups g whose
// rows are consecutive (counts[g] rows each):
//   forward  y_g  = x_g  @ w_g      (x: A x K, w: G x K x N, y: A x N)
//   input    dx_g = dy_g @ w_g^T    (dy: A x N, dx: A x K)
//   weight   dw_g = x_g^T @ dy_g    (dw: G x K x N; zero for a group with no rows)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11  // the bf16 code needs #pragma GCC target
#define NANOLLAMA4_BF16 1
#endif
#endif

#include "vec.h"

namespace {

// A store that bypasses the caches where the CPU has them (AVX-512) and p is aligned, for weight
// gradients: the optimizer reads them only after the whole backward, and a cached store first reads
// each line from memory (in the fp32 MoE step that read made the weight gradients ~1.3 ms slower than
// on memory the previous call had just freed). `fence()` orders them after each piece.
inline void store_stream(float* p, vec v) {
#if defined(__AVX512F__)
  if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) {
    _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
    return;
  }
#endif
  store(p, v);
}

inline void fence() {  // (the bf16 code streams its gradients whatever the build flags)
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// y[R rows, V vectors] = x[R rows, :K] @ w[:K, V vectors]: the weight slice is read once for R rows.
template <int R, int V>
void tile_xw(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  vec acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(w + k * ldw + v * kLanes);
    // 16 weight rows ahead: in the forward a tile's first pass over a strip reads the weight from memory in
    // training (after the optimizer's pass), with a 2 KiB stride the hardware prefetcher does not follow far
    // enough (the input gradient's panels are in cache already: there it costs an instruction)
    if (k + 16 < K)
      for (int v = 0; v < V; ++v) __builtin_prefetch(w + (k + 16) * ldw + v * kLanes, 0, 3);
    for (int r = 0; r < R; ++r) {
      float a = x[r * ldx + k];
      for (int v = 0; v < V; ++v) acc[r][v] += a * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(y + r * ldy + v * kLanes, acc[r][v]);
}

template <int V>
void rows_xw(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
             int64_t K) {
  for (int64_t r = 0; r < rows; r += 6) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(6, rows - r)) {
      case 6: tile_xw<6, V>(xr, ldx, w, ldw, yr, ldy, K); break;
      case 5: tile_xw<5, V>(xr, ldx, w, ldw, yr, ldy, K); break;
      case 4: tile_xw<4, V>(xr, ldx, w, ldw, yr, ldy, K); break;
      case 3: tile_xw<3, V>(xr, ldx, w, ldw, yr, ldy, K); break;
      case 2: tile_xw<2, V>(xr, ldx, w, ldw, yr, ldy, K); break;
      default: tile_xw<1, V>(xr, ldx, w, ldw, yr, ldy, K); break;
    }
  }
}

// Forward of one small group: x (m x K) @ w (K x N).
void small_xw(int64_t m, const float* x, const float* w, float* y, int64_t K, int64_t N) {
  int64_t n = 0;
  for (; n + 4 * kLanes <= N; n += 4 * kLanes) rows_xw<4>(m, x, K, w + n, N, y + n, N, K);
  for (; n + kLanes <= N; n += kLanes) rows_xw<1>(m, x, K, w + n, N, y + n, N, K);
  for (; n < N; ++n)  // the last N % 16 columns
    for (int64_t r = 0; r < m; ++r) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[k * N + n];
      y[r * N + n] = s;
    }
}

// dx[R rows, C columns] = dy[R rows, :N] @ w[C rows, :N]^T: C weight rows are read once for R rows.
template <int R, int C>
void tile_dx(const float* dy, const float* w, float* dx, int64_t K, int64_t N) {
  vec acc[R][C] = {};
  const int64_t vector_end = N - N % kLanes;
  for (int64_t n = 0; n < vector_end; n += kLanes) {
    vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + c * N + n);
    for (int r = 0; r < R; ++r) {
      vec g = load(dy + r * N + n);
      for (int c = 0; c < C; ++c) acc[r][c] += g * wv[c];
    }
  }
  if constexpr (R == 4 && C == 4) {
    if (vector_end == N) {  // the common case: all 16 sums at once
      float sums[16];
      store(sums, hsum16(acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[1][0], acc[1][1], acc[1][2], acc[1][3],
                         acc[2][0], acc[2][1], acc[2][2], acc[2][3], acc[3][0], acc[3][1], acc[3][2], acc[3][3]));
      for (int r = 0; r < 4; ++r) std::memcpy(dx + r * K, sums + 4 * r, 4 * sizeof(float));
      return;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t n = vector_end; n < N; ++n) s += dy[r * N + n] * w[c * N + n];
      dx[r * K + c] = s;
    }
}

template <int C>
void rows_dx(int64_t rows, const float* dy, const float* w, float* dx, int64_t K, int64_t N) {
  for (int64_t r = 0; r < rows; r += 4) {
    const float* g = dy + r * N;
    float* o = dx + r * K;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: tile_dx<4, C>(g, w, o, K, N); break;
      case 3: tile_dx<3, C>(g, w, o, K, N); break;
      case 2: tile_dx<2, C>(g, w, o, K, N); break;
      default: tile_dx<1, C>(g, w, o, K, N); break;
    }
  }
}

// A 16 x 16 transpose in registers (v[i] becomes column i): four rounds, each exchanging one bit of the
// row index with the same bit of the column index between pairs of rows, with the halving shuffles of
// the butterfly above (without its adds).
template <int D>
inline void exchange(vec& a, vec& b) {
  vec lo, hi;
  if constexpr (D == 8) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    hi = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (D == 4) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  } else if constexpr (D == 2) {
    lo = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    hi = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  } else {
    lo = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    hi = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  a = lo;
  b = hi;
}

template <int D>
inline void exchange_round(vec* v) {
  for (int i = 0; i < kLanes; ++i)
    if (!(i & D)) exchange<D>(v[i], v[i + D]);
}

inline void transpose16(vec* v) {
  exchange_round<8>(v); exchange_round<4>(v); exchange_round<2>(v); exchange_round<1>(v);
}

// Rows [0, width) of w (row stride N) transposed into panel (N x width): panel[n * width + j] = w[j * N + n].
// width is a multiple of 16.
void pack_transposed(const float* w, int64_t N, int64_t width, float* panel) {
  const int64_t vector_end = N - N % kLanes;
  for (int64_t j = 0; j < width; j += kLanes) {
    for (int64_t n = 0; n < vector_end; n += kLanes) {
      vec v[kLanes];
      for (int i = 0; i < kLanes; ++i) v[i] = load(w + (j + i) * N + n);
      transpose16(v);
      for (int i = 0; i < kLanes; ++i) store(panel + (n + i) * width + j, v[i]);
    }
    for (int64_t n = vector_end; n < N; ++n)
      for (int64_t i = j; i < j + kLanes; ++i) panel[n * width + i] = w[i * N + n];
  }
}

// The input gradient as dot products along whole rows, for columns [k0, K) of dx: w's rows too long for a
// panel, and the last K % 16 rows after the panels. Rows are taken kChunk at a time, so that a chunk's
// output gradient stays in cache while every weight row passes over it (unchunked, a large group's dy
// was re-read from L3 once per four weight rows).
void dot_dx(int64_t m, const float* dy, const float* w, float* dx, int64_t K, int64_t N, int64_t k0 = 0) {
  constexpr int64_t kChunk = 64;
  for (int64_t r = 0; r < m; r += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, m - r);
    const float* g = dy + r * N;
    float* o = dx + r * K;
    int64_t k = k0;
    for (; k + 4 <= K; k += 4) rows_dx<4>(rows, g, w + k * N, o + k, K, N);
    for (; k < K; ++k) rows_dx<1>(rows, g, w + k * N, o + k, K, N);
  }
}

constexpr int64_t kPanelColumns = 4 * kLanes;  // a panel holds 64 rows of w, as the forward's tiles 64 columns
constexpr int64_t kMaxPanelRows = 2048;  // a panel's N rows of 64 floats: 512 KiB, half of a Zen 4 core's L2

// Input gradient of one small group: dy (m x N) @ w (K x N)^T. Every 64 rows of w (then the 16, 32 or 48
// left) are transposed into a panel in the core's cache and multiplied like the forward (tile_xw): dot
// products along rows need a horizontal sum per output, which at N = 128 halved the rate
// (measured 2026-12-01, see git history of benchmarks/RESULTS.md), and reading w once, in order, for
// the panel also fetches a cold weight at the memory's streaming rate. The last K % 16 rows of w, and w
// longer than a panel holds, take dot products.
void small_dx(int64_t m, const float* dy, const float* w, float* dx, int64_t K, int64_t N) {
  if (m == 0) return;
  if (N > kMaxPanelRows) return dot_dx(m, dy, w, dx, K, N);
  thread_local std::vector<float> panel;
  panel.resize(N * kPanelColumns);
  int64_t k = 0;
  for (; k + kPanelColumns <= K; k += kPanelColumns) {
    pack_transposed(w + k * N, N, kPanelColumns, panel.data());
    rows_xw<4>(m, dy, N, panel.data(), kPanelColumns, dx + k, K, N);
  }
  const int64_t rest = (K - k) / kLanes * kLanes;
  if (rest > 0) {
    pack_transposed(w + k * N, N, rest, panel.data());
    switch (rest / kLanes) {
      case 3: rows_xw<3>(m, dy, N, panel.data(), rest, dx + k, K, N); break;
      case 2: rows_xw<2>(m, dy, N, panel.data(), rest, dx + k, K, N); break;
      default: rows_xw<1>(m, dy, N, panel.data(), rest, dx + k, K, N); break;
    }
    k += rest;
  }
  if (k < K) dot_dx(m, dy, w, dx, K, N, k);
}

// dw[C rows, V vectors] = x[:m, C columns]^T @ dy[:m, V vectors]: each output element is written once.
template <int C, int V>
void tile_dw(int64_t m, const float* x, int64_t ldx, const float* dy, int64_t N, float* dw) {
  vec acc[C][V] = {};
  for (int64_t r = 0; r < m; ++r) {
    vec g[V];
    for (int v = 0; v < V; ++v) g[v] = load(dy + r * N + v * kLanes);
    for (int c = 0; c < C; ++c) {
      float a = x[r * ldx + c];
      for (int v = 0; v < V; ++v) acc[c][v] += a * g[v];
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) store_stream(dw + c * N + v * kLanes, acc[c][v]);
}

template <int V>
void cols_dw(int64_t c, int64_t m, const float* x, int64_t ldx, const float* dy, int64_t N, float* dw) {
  switch (c) {
    case 6: tile_dw<6, V>(m, x, ldx, dy, N, dw); break;
    case 5: tile_dw<5, V>(m, x, ldx, dy, N, dw); break;
    case 4: tile_dw<4, V>(m, x, ldx, dy, N, dw); break;
    case 3: tile_dw<3, V>(m, x, ldx, dy, N, dw); break;
    case 2: tile_dw<2, V>(m, x, ldx, dy, N, dw); break;
    default: tile_dw<1, V>(m, x, ldx, dy, N, dw); break;
  }
}

// Weight gradient of one small group, K of its weight's rows: x (m x K, row stride ldx)^T @ dy (m x N).
void small_dw(int64_t m, const float* x, const float* dy, float* dw, int64_t ldx, int64_t K, int64_t N) {
  const int64_t vector_end = N - N % kLanes;
  for (int64_t k = 0; k < K; k += 6) {
    const int64_t c = std::min<int64_t>(6, K - k);
    int64_t n = 0;
    for (; n + 4 * kLanes <= vector_end; n += 4 * kLanes) cols_dw<4>(c, m, x + k, ldx, dy + n, N, dw + k * N + n);
    for (; n < vector_end; n += kLanes) cols_dw<1>(c, m, x + k, ldx, dy + n, N, dw + k * N + n);
    for (; n < N; ++n)  // the last N % 16 columns
      for (int64_t j = k; j < k + c; ++j) {
        float s = 0;
        for (int64_t r = 0; r < m; ++r) s += x[r * ldx + j] * dy[r * N + n];
        dw[j * N + n] = s;
      }
  }
}

// A piece of work: group g, and a range [lo, hi) of its rows (products with the group's rows as
// output rows) or of its weight's rows (the weight gradient).
struct Piece {
  int64_t g, lo, hi;
};

// Share the groups' work between the cores in equal parts of cost and run body(piece) for every piece,
// each core taking one contiguous run: whole groups (a core then streams a weight once), with a group
// cut where a core's share ends, at a multiple of `align` of its span (rows, or weight rows). (Cutting
// only groups bigger than a share left the demo's uneven groups, 2 to 1,181 rows, split 58:42.)
template <typename Span, typename Cost, typename Body>
void per_core(int64_t G, const Span& span, const Cost& cost, int64_t align, const Body& body) {
  const int64_t cores = std::max<int64_t>(1, at::get_num_threads());
  std::vector<double> costs(G);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) total += costs[g] = cost(g, span(g));
  std::vector<std::vector<Piece>> shares(cores);
  const auto share_end = [&](int64_t core) { return total * static_cast<double>(core + 1) / cores; };
  int64_t t = 0;
  double done = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = span(g);
    while (t + 1 < cores && done >= share_end(t)) ++t;
    if (n == 0) {  // one empty piece (the weight gradient of a group without rows is still zeroed)
      shares[t].push_back({g, 0, 0});
      done += costs[g];
      continue;
    }
    const double per_unit = costs[g] / n;
    for (int64_t lo = 0; lo < n;) {
      int64_t hi = n;
      if (t + 1 < cores && done + per_unit * (n - lo) > share_end(t)) {  // this core's share ends inside
        const double fits = (share_end(t) - done) / per_unit;
        hi = std::min(n, lo + static_cast<int64_t>(std::llround(fits / align)) * align);
      }
      if (hi > lo) {
        shares[t].push_back({g, lo, hi});
        done += per_unit * (hi - lo);
        lo = hi;
      }
      if (lo < n) ++t;  // the share is full: the rest of the group goes to the next core
    }
  }
  at::parallel_for(0, cores, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t c = t0; c < t1; ++c)
      for (const Piece& piece : shares[c]) body(piece);
  });
}

void check(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor with ", dim, " dimensions");
}

// The first row of each group, checking that counts fit the rows.
std::vector<int64_t> group_starts(const at::Tensor& counts, int64_t groups, int64_t rows) {
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                  counts.size(0) == groups && counts.is_contiguous(),
              "counts must be a contiguous int64 CPU vector with one entry per group");
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> start(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(c[g] >= 0, "counts must not be negative");
    start[g + 1] = start[g] + c[g];
  }
  TORCH_CHECK(start[groups] == rows, "counts must add up to the number of rows");
  return start;
}

// Row products: out_g = a_g @ (w_g or w_g^T), each output row from its own input row, so a large group
// is sliced by rows. `tile(m, a, w_g, out, K, N)` is small_xw (a: A x K) or small_dx (a: A x N).
// They read and write raw float pointers only, so they run the same under any grad mode.
template <typename Tile>
at::Tensor row_products(const at::Tensor& a, const at::Tensor& w, const at::Tensor& counts, bool transposed,
                        int64_t align, Tile tile) {
  check(a, 2, transposed ? "dy" : "x"); check(w, 3, "w");
  const int64_t G = w.size(0), K = w.size(1), N = w.size(2);
  const int64_t in = transposed ? N : K, out = transposed ? K : N;
  TORCH_CHECK(a.size(1) == in, transposed ? "dy must be A x N for w G x K x N" : "x must be A x K for w G x K x N");
  const auto start = group_starts(counts, G, a.size(0));
  auto y = at::empty({a.size(0), out}, a.options());
  const float *pa = a.data_ptr<float>(), *pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  per_core(
      G, [&](int64_t g) { return start[g + 1] - start[g]; },
      [&](int64_t, int64_t m) { return m > 0 ? (m + 4.0) * K * N : 0.0; }, align,
      [&](const Piece& p) {
        const int64_t row = start[p.g] + p.lo;
        tile(p.hi - p.lo, pa + row * in, pw + p.g * K * N, py + row * out, K, N);
      });
  return y;
}

// ---------------------------------------------------------------------------------------------- bfloat16
// The same three products for bf16 rows, on AVX512_BF16's dot-product instruction (vdpbf16ps: 16 float
// lanes, each += a[2i] * b[2i] + a[2i+1] * b[2i+1]), accumulating in float32. Every operand therefore
// comes in pairs along the summed index:
//   forward  y = x @ w:   x's rows are already pairs along k; each 64-column panel of w is packed
//                          into (k / 2, n, 2) order in the core's cache (`pack_panel`, which also casts
//                          float32 master weights);
//   input    dx = dy @ w^T: both dy's rows and w's rows run along n, so this one sums whole rows
//                          (dot products, then one butterfly of horizontal sums per 4 x 4 tile);
//   weight   dw = x^T @ dy: the sum runs over rows, so each group's x and dy are re-packed into pairs of
//                          rows first; dw is summed in float32 and written in the weights' dtype.
// The group loop, the slicing and the per-core split are the float32 ones. Compiled for AVX512_BF16
// whatever the build flags (`#pragma GCC target`), and used only when the CPU reports it (`bf16_supported`).
#ifdef NANOLLAMA4_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

using bf16 = uint16_t;
// Packed operands are stored in panels of this many columns, each panel's rows consecutive, so that a
// tile streams through contiguous memory (row strides of 4 KiB made every row of a tile fall into the
// same cache sets).
constexpr int64_t kPanel = 4 * kLanes;

inline __m512bh load_pairs(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh broadcast_pair(const void* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}
inline void store_bf16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }

// y[R rows, V vectors] = x[R rows, :2 K2] @ w, from one panel of w's packing: K2 pair rows of V vectors.
template <int R, int V>
void tile_xw_bf16(const bf16* x, int64_t ldx, const bf16* wp, bf16* y, int64_t ldy, int64_t K2) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_pairs(wp + (p * V + v) * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = broadcast_pair(x + r * ldx + 2 * p);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_bf16(y + r * ldy + v * kLanes, acc[r][v]);
}

template <int V>
void rows_xw_bf16(int64_t rows, const bf16* x, int64_t ldx, const bf16* wp, bf16* y, int64_t ldy, int64_t K2) {
  for (int64_t r = 0; r < rows; r += 6) {
    const bf16* xr = x + r * ldx;
    bf16* yr = y + r * ldy;
    switch (std::min<int64_t>(6, rows - r)) {
      case 6: tile_xw_bf16<6, V>(xr, ldx, wp, yr, ldy, K2); break;
      case 5: tile_xw_bf16<5, V>(xr, ldx, wp, yr, ldy, K2); break;
      case 4: tile_xw_bf16<4, V>(xr, ldx, wp, yr, ldy, K2); break;
      case 3: tile_xw_bf16<3, V>(xr, ldx, wp, yr, ldy, K2); break;
      case 2: tile_xw_bf16<2, V>(xr, ldx, wp, yr, ldy, K2); break;
      default: tile_xw_bf16<1, V>(xr, ldx, wp, yr, ldy, K2); break;
    }
  }
}

// 16 weights of a row as bf16: cast from float32 (round to nearest even), or loaded as they are.
inline __m256i row_bf16(const float* w) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w)); }
inline __m256i row_bf16(const bf16* w) { return _mm256_loadu_si256((const __m256i*)w); }

// Columns [n, n + width) of w (K x N, float32 or bf16) as bf16 pairs of rows: panel[p][j] holds w[2p][n + j]
// (low half) and w[2p + 1][n + j]. A core packs each panel of a group's weight into its cache once and
// runs every row tile of its piece over it, so no packed copy of the weights is ever written to memory.
template <typename T>
void pack_panel(const T* w, int64_t K, int64_t N, int64_t n, int64_t width, bf16* panel) {
  for (int64_t p = 0; p < K / 2; ++p)
    for (int64_t j = 0; j < width; j += kLanes) {
      const __m256i l = row_bf16(w + 2 * p * N + n + j), h = row_bf16(w + (2 * p + 1) * N + n + j);
      const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(l), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm512_storeu_si512(panel + (p * width + j) * 2, pairs);
    }
}

// Forward of one group: x (m x K) @ w (K x N), N a multiple of 16, one packed panel of kPanel columns at a time.
template <typename T>
void small_xw_bf16(int64_t m, const bf16* x, const T* w, bf16* y, int64_t K, int64_t N) {
  if (m == 0) return;
  thread_local std::vector<bf16> panel;
  panel.resize(K * kPanel);
  for (int64_t n = 0; n < N; n += kPanel) {
    const int64_t width = std::min<int64_t>(kPanel, N - n);
    pack_panel(w, K, N, n, width, panel.data());
    switch (width / kLanes) {
      case 4: rows_xw_bf16<4>(m, x, K, panel.data(), y + n, N, K / 2); break;
      case 3: rows_xw_bf16<3>(m, x, K, panel.data(), y + n, N, K / 2); break;
      case 2: rows_xw_bf16<2>(m, x, K, panel.data(), y + n, N, K / 2); break;
      default: rows_xw_bf16<1>(m, x, K, panel.data(), y + n, N, K / 2); break;
    }
  }
}

// dx[R rows, C columns] = dy[R rows, :N] @ w[C rows, :N]^T, N a multiple of 32.
template <int R, int C>
void tile_dx_bf16(const bf16* dy, const bf16* w, bf16* dx, int64_t K, int64_t N) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t n = 0; n < N; n += 2 * kLanes) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_pairs(w + c * N + n);
    for (int r = 0; r < R; ++r) {
      const __m512bh g = load_pairs(dy + r * N + n);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], g, wv[c]);
    }
  }
  if constexpr (R == 4 && C == 4) {
    bf16 sums[16];
    store_bf16(sums, (__m512)hsum16((vec)acc[0][0], (vec)acc[0][1], (vec)acc[0][2], (vec)acc[0][3],
                                    (vec)acc[1][0], (vec)acc[1][1], (vec)acc[1][2], (vec)acc[1][3],
                                    (vec)acc[2][0], (vec)acc[2][1], (vec)acc[2][2], (vec)acc[2][3],
                                    (vec)acc[3][0], (vec)acc[3][1], (vec)acc[3][2], (vec)acc[3][3]));
    for (int r = 0; r < 4; ++r) std::memcpy(dx + r * K, sums + 4 * r, 4 * sizeof(bf16));
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dx[r * K + c] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][c])).x;
  }
}

template <int C>
void rows_dx_bf16(int64_t rows, const bf16* dy, const bf16* w, bf16* dx, int64_t K, int64_t N) {
  for (int64_t r = 0; r < rows; r += 4) {
    const bf16* g = dy + r * N;
    bf16* o = dx + r * K;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: tile_dx_bf16<4, C>(g, w, o, K, N); break;
      case 3: tile_dx_bf16<3, C>(g, w, o, K, N); break;
      case 2: tile_dx_bf16<2, C>(g, w, o, K, N); break;
      default: tile_dx_bf16<1, C>(g, w, o, K, N); break;
    }
  }
}

// Input gradient of one group: dy (m x N) @ w (K x N)^T, in chunks of rows that stay in cache. float32
// weights are cast into a scratch bf16 copy of this group's weight first (the size of one expert, so in
// cache for the models here; never a copy of all the experts).
void small_dx_bf16(int64_t m, const bf16* dy, const float* w32, bf16* dx, int64_t K, int64_t N);
void small_dx_bf16(int64_t m, const bf16* dy, const bf16* w, bf16* dx, int64_t K, int64_t N) {
  constexpr int64_t kChunk = 64;
  for (int64_t r = 0; r < m; r += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, m - r);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) rows_dx_bf16<4>(rows, dy + r * N, w + k * N, dx + r * K + k, K, N);
    for (; k < K; ++k) rows_dx_bf16<1>(rows, dy + r * N, w + k * N, dx + r * K + k, K, N);
  }
}

void small_dx_bf16(int64_t m, const bf16* dy, const float* w32, bf16* dx, int64_t K, int64_t N) {
  if (m == 0) return;
  std::vector<bf16> w(K * N);  // scratch, freed after the piece
  for (int64_t i = 0; i < K * N; i += kLanes) _mm256_storeu_si256((__m256i*)(w.data() + i), row_bf16(w32 + i));
  small_dx_bf16(m, dy, w.data(), dx, K, N);
}

// dw[C rows, V vectors] = sum over row pairs p of x's pair p (column c) times dy's pair p (one panel of V
// vectors per pair), summed in float32 and stored as float32 or bf16 (Out).
inline void store_sum(float* p, __m512 v) { store_stream(p, reinterpret_cast<vec>(v)); }
inline void store_sum(bf16* p, __m512 v) {  // streamed too, where aligned (fence() after each piece)
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  if ((reinterpret_cast<uintptr_t>(p) & 31) == 0)
    _mm256_stream_si256((__m256i*)p, h);
  else
    _mm256_storeu_si256((__m256i*)p, h);
}

template <int C, int V, typename Out>
void tile_dw_bf16(int64_t pairs, const int32_t* xp, int64_t ldx, const int32_t* dyp, int64_t N, Out* dw) {
  __m512 acc[C][V];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) acc[c][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh g[V];
    for (int v = 0; v < V; ++v) g[v] = load_pairs(dyp + (p * V + v) * kLanes);
    for (int c = 0; c < C; ++c) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[p * ldx + c]);
      for (int v = 0; v < V; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], a, g[v]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) store_sum(dw + c * N + v * kLanes, acc[c][v]);
}

template <int V, typename Out>
void cols_dw_bf16(int64_t c, int64_t pairs, const int32_t* xp, int64_t ldx, const int32_t* dyp, int64_t N,
                  Out* dw) {
  switch (c) {
    case 6: tile_dw_bf16<6, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
    case 5: tile_dw_bf16<5, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
    case 4: tile_dw_bf16<4, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
    case 3: tile_dw_bf16<3, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
    case 2: tile_dw_bf16<2, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
    default: tile_dw_bf16<1, V, Out>(pairs, xp, ldx, dyp, N, dw); break;
  }
}

// Weight gradient of one group, K of its weight's rows, from its row pairs: xp (pairs x ldx) and dyp
// (pairs x N, in panels of kPanel columns).
template <typename Out>
void small_dw_bf16(int64_t pairs, const int32_t* xp, const int32_t* dyp, Out* dw, int64_t ldx, int64_t K,
                   int64_t N) {
  for (int64_t k = 0; k < K; k += 6) {
    const int64_t c = std::min<int64_t>(6, K - k);
    for (int64_t n = 0; n < N; n += kPanel) {
      const int32_t* panel = dyp + n * pairs;
      Out* out = dw + k * N + n;
      switch (std::min<int64_t>(kPanel, N - n) / kLanes) {
        case 4: cols_dw_bf16<4>(c, pairs, xp + k, ldx, panel, N, out); break;
        case 3: cols_dw_bf16<3>(c, pairs, xp + k, ldx, panel, N, out); break;
        case 2: cols_dw_bf16<2>(c, pairs, xp + k, ldx, panel, N, out); break;
        default: cols_dw_bf16<1>(c, pairs, xp + k, ldx, panel, N, out); break;
      }
    }
  }
}

// Rows 2p and 2p + 1 of a (rows x W), interleaved: pair p of column j holds a[2p][j] (low half) and
// a[2p+1][j] (high half); an odd last row is paired with zeros. `paneled`: stored in panels of kPanel
// columns (panel of column j at j * pairs, then pair p at p * width), else as a (pairs x W) matrix.
void pair_rows(const bf16* a, int64_t rows, int64_t W, int32_t* out, bool paneled) {
  const int64_t pairs = (rows + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* lo = a + 2 * p * W;
    const bool has_hi = 2 * p + 1 < rows;
    for (int64_t j = 0; j < W; j += kLanes) {
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(lo + j)));
      const __m512i h = has_hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(lo + W + j)))
                               : _mm512_setzero_si512();
      const int64_t panel = j - j % kPanel, width = std::min<int64_t>(kPanel, W - panel);
      int32_t* o = paneled ? out + panel * pairs + p * width + j % kPanel : out + p * W + j;
      _mm512_storeu_si512(o, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
    }
  }
}

void check_bf16(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dim && t.is_contiguous(),
              name, " must be a contiguous bfloat16 CPU tensor with ", dim, " dimensions");
}

// The SwiGLU activation between the two products, on rows h = [gate | up] of float32 or bf16, computed
// in float32: two passes (forward, backward) where torch's elementwise operators take five (silu, the
// product; silu's gradient and two products). (Compiled with the bf16 code, and used where it runs.)
inline __m512 load_bf16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// e^x, to float32 rounding for |x| <= 87: x = n ln 2 + r with |r| <= ln 2 / 2, a degree-7 Taylor polynomial
// for e^r (relative error below 1e-8 there) and a scaling by 2^n. x is clamped to [-87, 88] first (so
// silu(-100) is ~1e-36 instead of ~4e-42, and a NaN x gives e^-87: the activation's products with x
// still carry the NaN on).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts, for an exact r
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline __m512 sigmoid_ps(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

const bf16* bf16_data(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>()); }
bf16* bf16_data(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); }

#pragma GCC pop_options
#endif  // NANOLLAMA4_BF16

}  // namespace

at::Tensor forward(at::Tensor x, at::Tensor w, at::Tensor counts) {
  return row_products(x, w, counts, false, 6, small_xw);
}

at::Tensor input_grad(at::Tensor dy, at::Tensor w, at::Tensor counts) {
  return row_products(dy, w, counts, true, 12, small_dx);  // 6-row tiles (4 on the dot products)
}

at::Tensor weight_grad(at::Tensor x, at::Tensor dy, at::Tensor counts) {
  check(x, 2, "x"); check(dy, 2, "dy");
  TORCH_CHECK(counts.dim() == 1, "counts must be a vector with one entry per group");
  const int64_t G = counts.size(0), K = x.size(1), N = dy.size(1);
  TORCH_CHECK(x.size(0) == dy.size(0), "x and dy must have the same rows");
  const auto start = group_starts(counts, G, x.size(0));
  auto dw = at::empty({G, K, N}, x.options());
  const float *px = x.data_ptr<float>(), *pg = dy.data_ptr<float>();
  float* pw = dw.data_ptr<float>();
  // Pieces are ranges of the weight's K rows: each reads all of the group's rows, writes its own slice.
  per_core(
      G, [&](int64_t) { return K; },
      [&](int64_t g, int64_t) { return (start[g + 1] - start[g] + 4.0) * K * N; }, 6,
      [&](const Piece& p) {
        const int64_t m = start[p.g + 1] - start[p.g], rows = p.hi - p.lo;
        float* out = pw + (p.g * K + p.lo) * N;
        if (m == 0) {
          std::fill(out, out + rows * N, 0.0f);
        } else {
          small_dw(m, px + start[p.g] * K + p.lo, pg + start[p.g] * N, out, K, rows, N);
          fence();
        }
      });
  return dw;
}

#ifdef NANOLLAMA4_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace {

// The weights of the bf16 products: float32 (masters under autocast) or bf16, read as they are.
void check_weights(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w must be a contiguous float32 or bfloat16 CPU tensor with 3 dimensions");
}

// Row products of bf16 rows, as `row_products` does them for float32: out_g = a_g @ (w_g or w_g^T) for w
// float32 or bf16; `tile(m, a, w_g, out, K, N)` is small_xw_bf16 (a: A x K) or small_dx_bf16 (a: A x N).
template <typename Tile>
at::Tensor row_products_bf16(const at::Tensor& a, const at::Tensor& w, const at::Tensor& counts, bool transposed,
                             int64_t align, Tile tile) {
  const int64_t G = w.size(0), K = w.size(1), N = w.size(2);
  const int64_t in = transposed ? N : K, out = transposed ? K : N;
  const auto start = group_starts(counts, G, a.size(0));
  auto y = at::empty({a.size(0), out}, a.options());
  const bf16* pa = bf16_data(a);
  bf16* py = bf16_data(y);
  const auto run = [&](const auto* pw) {
    per_core(
        G, [&](int64_t g) { return start[g + 1] - start[g]; },
        [&](int64_t, int64_t m) { return m > 0 ? (m + 4.0) * K * N : 0.0; }, align,
        [&](const Piece& p) {
          const int64_t row = start[p.g] + p.lo;
          tile(p.hi - p.lo, pa + row * in, pw + p.g * K * N, py + row * out, K, N);
        });
  };
  if (w.scalar_type() == at::kFloat)
    run(w.data_ptr<float>());
  else
    run(bf16_data(w));
  return y;
}

at::Tensor forward_bf16_avx512(at::Tensor x, at::Tensor w, at::Tensor counts) {
  check_bf16(x, 2, "x"); check_weights(w);
  TORCH_CHECK(x.size(1) == w.size(1) && w.size(1) % 2 == 0 && w.size(2) % kLanes == 0,
              "x must be A x K for w G x K x N, K even and N a multiple of 16");
  return row_products_bf16(x, w, counts, false, 6, [](int64_t m, const bf16* a, const auto* wg, bf16* o, int64_t K,
                                                      int64_t N) { small_xw_bf16(m, a, wg, o, K, N); });
}

at::Tensor input_grad_bf16_avx512(at::Tensor dy, at::Tensor w, at::Tensor counts) {
  check_bf16(dy, 2, "dy"); check_weights(w);
  TORCH_CHECK(dy.size(1) == w.size(2) && w.size(2) % (2 * kLanes) == 0,
              "dy must be A x N for w G x K x N, N a multiple of 32");
  return row_products_bf16(dy, w, counts, true, 4, [](int64_t m, const bf16* a, const auto* wg, bf16* o, int64_t K,
                                                      int64_t N) { small_dx_bf16(m, a, wg, o, K, N); });
}

// Out: the gradient's dtype (float for float32 master weights, bf16 for bf16 ones).
template <typename Out>
void weight_grad_into(const bf16* px, const bf16* pg, const std::vector<int64_t>& start, int64_t G, int64_t K,
                      int64_t N, Out* pw) {
  std::vector<int64_t> pair_start(G + 1, 0);  // each group's first row pair
  for (int64_t g = 0; g < G; ++g) pair_start[g + 1] = pair_start[g] + (start[g + 1] - start[g] + 1) / 2;
  auto xp = at::empty({pair_start[G] * K}, at::kInt), dyp = at::empty({pair_start[G] * N}, at::kInt);
  int32_t *pxp = xp.data_ptr<int32_t>(), *pdyp = dyp.data_ptr<int32_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t m = start[g + 1] - start[g];
      pair_rows(px + start[g] * K, m, K, pxp + pair_start[g] * K, false);
      pair_rows(pg + start[g] * N, m, N, pdyp + pair_start[g] * N, true);
    }
  });
  // Pieces are ranges of the weight's K rows: each reads all of the group's row pairs, writes its own slice.
  per_core(
      G, [&](int64_t) { return K; },
      [&](int64_t g, int64_t) { return (start[g + 1] - start[g] + 4.0) * K * N; }, 6,
      [&](const Piece& p) {
        const int64_t pairs = pair_start[p.g + 1] - pair_start[p.g], rows = p.hi - p.lo;
        Out* out = pw + (p.g * K + p.lo) * N;
        if (pairs == 0) {
          std::fill(out, out + rows * N, Out(0));
        } else {
          small_dw_bf16(pairs, pxp + pair_start[p.g] * K + p.lo, pdyp + pair_start[p.g] * N, out, K, rows, N);
          fence();
        }
      });
}

at::Tensor weight_grad_bf16_avx512(at::Tensor x, at::Tensor dy, at::Tensor counts, bool bf16_out) {
  check_bf16(x, 2, "x"); check_bf16(dy, 2, "dy");
  TORCH_CHECK(counts.dim() == 1, "counts must be a vector with one entry per group");
  const int64_t G = counts.size(0), K = x.size(1), N = dy.size(1);
  TORCH_CHECK(x.size(0) == dy.size(0), "x and dy must have the same rows");
  TORCH_CHECK(K % kLanes == 0 && N % kLanes == 0, "bf16 weight gradients need K and N multiples of 16");
  const auto start = group_starts(counts, G, x.size(0));
  auto dw = at::empty({G, K, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (bf16_out)
    weight_grad_into(bf16_data(x), bf16_data(dy), start, G, K, N, bf16_data(dw));
  else
    weight_grad_into(bf16_data(x), bf16_data(dy), start, G, K, N, dw.data_ptr<float>());
  return dw;
}

inline __m512 load_any(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_any(const bf16* p) { return load_bf16(p); }
inline void store_any(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_any(bf16* p, __m512 v) { store_bf16(p, v); }

template <typename T>
void swiglu_rows(const T* h, int64_t A, int64_t H, T* act) {
  at::parallel_for(0, A, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < H; j += kLanes) {
        const __m512 g = load_any(h + r * 2 * H + j), u = load_any(h + r * 2 * H + H + j);
        store_any(act + r * H + j, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid_ps(g)), u));
      }
  });
}

template <typename T>
void swiglu_grad_rows(const T* d_act, const T* h, int64_t A, int64_t H, T* dh) {
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, A, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < H; j += kLanes) {
        const __m512 g = load_any(h + r * 2 * H + j), u = load_any(h + r * 2 * H + H + j);
        const __m512 d = load_any(d_act + r * H + j), sg = sigmoid_ps(g);
        const __m512 slope = _mm512_mul_ps(sg, _mm512_fmadd_ps(g, _mm512_sub_ps(one, sg), one));
        store_any(dh + r * 2 * H + j, _mm512_mul_ps(_mm512_mul_ps(d, u), slope));
        store_any(dh + r * 2 * H + H + j, _mm512_mul_ps(d, _mm512_mul_ps(g, sg)));
      }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a contiguous float32 or bfloat16 CPU matrix");
}

// act = silu(gate) * up for h = [gate | up] (A x 2H) -> (A x H), float32 or bf16, computed in float32.
at::Tensor swiglu_avx512(at::Tensor h) {
  check_rows(h, "h");
  const int64_t A = h.size(0), H = h.size(1) / 2;
  TORCH_CHECK(h.size(1) % (2 * kLanes) == 0, "h's width must be a multiple of 32");
  auto act = at::empty({A, H}, h.options());
  if (h.scalar_type() == at::kFloat)
    swiglu_rows(h.data_ptr<float>(), A, H, act.data_ptr<float>());
  else
    swiglu_rows(bf16_data(h), A, H, bf16_data(act));
  return act;
}

// The gradient of h = [gate | up] from that of act: d gate = d act * up * s (1 + gate (1 - s)) with
// s = sigmoid(gate), d up = d act * silu(gate).
at::Tensor swiglu_grad_avx512(at::Tensor d_act, at::Tensor h) {
  check_rows(d_act, "d_act"); check_rows(h, "h");
  const int64_t A = h.size(0), H = h.size(1) / 2;
  TORCH_CHECK(h.size(1) % (2 * kLanes) == 0 && d_act.size(0) == A && d_act.size(1) == H &&
                  d_act.scalar_type() == h.scalar_type(),
              "d_act must be A x H for h A x 2H, H a multiple of 16, both of one dtype");
  auto dh = at::empty_like(h);
  if (h.scalar_type() == at::kFloat)
    swiglu_grad_rows(d_act.data_ptr<float>(), h.data_ptr<float>(), A, H, dh.data_ptr<float>());
  else
    swiglu_grad_rows(bf16_data(d_act), bf16_data(h), A, H, bf16_data(dh));
  return dh;
}

}  // namespace
#pragma GCC pop_options
#endif  // NANOLLAMA4_BF16

bool bf16_supported() {
#ifdef NANOLLAMA4_BF16
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#ifdef NANOLLAMA4_BF16
// The entry points check the CPU first (in code compiled for any x86), so that a call on a CPU without
// AVX512_BF16 raises instead of stopping on an illegal instruction.
void require_bf16_cpu() {
  TORCH_CHECK(bf16_supported(), "the bf16 products need a CPU with AVX512_BF16 (kernels.bf16_available())");
}
at::Tensor forward_bf16(at::Tensor x, at::Tensor w, at::Tensor counts) {
  require_bf16_cpu();
  return forward_bf16_avx512(x, w, counts);
}
at::Tensor input_grad_bf16(at::Tensor dy, at::Tensor w, at::Tensor counts) {
  require_bf16_cpu();
  return input_grad_bf16_avx512(dy, w, counts);
}
at::Tensor weight_grad_bf16(at::Tensor x, at::Tensor dy, at::Tensor counts, bool bf16_out) {
  require_bf16_cpu();
  return weight_grad_bf16_avx512(x, dy, counts, bf16_out);
}
at::Tensor swiglu(at::Tensor h) {
  require_bf16_cpu();
  return swiglu_avx512(h);
}
at::Tensor swiglu_grad(at::Tensor d_act, at::Tensor h) {
  require_bf16_cpu();
  return swiglu_grad_avx512(d_act, h);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Like torch's own operators, these let other Python threads run while they compute.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("forward", &forward, "y_g = x_g @ w_g for consecutive row groups", release());
  m.def("input_grad", &input_grad, "dx_g = dy_g @ w_g^T for consecutive row groups", release());
  m.def("weight_grad", &weight_grad, "dw_g = x_g^T @ dy_g for consecutive row groups", release());
  m.def("bf16_supported", &bf16_supported, "whether this CPU runs the bf16 products (AVX512_BF16)");
#ifdef NANOLLAMA4_BF16
  m.def("forward_bf16", &forward_bf16, "bf16 y_g = x_g @ w_g, w float32 or bf16", release());
  m.def("input_grad_bf16", &input_grad_bf16, "bf16 dx_g = dy_g @ w_g^T, w float32 or bf16", release());
  m.def("swiglu", &swiglu, "silu(gate) * up for rows [gate | up], float32 or bf16", release());
  m.def("swiglu_grad", &swiglu_grad, "the gradient of [gate | up] from that of silu(gate) * up", release());
  m.def("weight_grad_bf16", &weight_grad_bf16, "dw_g = x_g^T @ dy_g from bf16 rows, summed in float32 and "
        "returned as float32 or (bf16_out) bf16", release());
#endif
}
