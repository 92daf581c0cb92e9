// Grouped matrix products for a mixture of experts on the CPU, float32, rows sorted by expert.
//
// torch's products are built for large matrices: for an expert that sees a handful of rows, MKL spends
// its time packing the weight and both cores synchronise on every product, so an MoE layer with many
// experts ran several times slower than a dense layer of the same active size. Here each core takes
// whole experts (no synchronisation inside a call; a group larger than a core's share is sliced), and
// every product runs through register-tiled loops that read each weight element once per six rows.
// On the AMD EPYC we develop on they also beat torch's fp32 products on large groups, about 2x
// (benchmarks/RESULTS.md). Written with GCC/Clang vector extensions (GCC >= 12 for the shuffles),
// which compile to AVX-512, AVX2 or NEON as the flags allow.
//
// Three products per call, matching a linear layer's forward and its two gradients, for groups g whose
// rows are consecutive (counts[g] rows each):
//   forward  y_g  = x_g  @ w_g      (x: A x K, w: G x K x N, y: A x N)
//   input    dx_g = dy_g @ w_g^T    (dy: A x N, dx: A x K)
//   weight   dw_g = x_g^T @ dy_g    (dw: G x K x N; zero for a group with no rows)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // floats per vector (one AVX-512 register; two AVX2 ones)
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

typedef float half_vec __attribute__((vector_size(8 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(4 * sizeof(float))));
inline float hsum(vec v) {  // a tree of halvings: 4 shuffles and adds instead of 15 scalar adds
  half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The sums of 16 vectors, as one vector (lane j: the sum of a_j): a butterfly of halving shuffles,
// 45 operations where 16 separate reductions take ~80.
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

// y[R rows, V vectors] = x[R rows, :K] @ w[:K, V vectors]: the weight slice is read once for R rows.
template <int R, int V>
void tile_xw(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  vec acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(w + k * ldw + v * kLanes);
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

// Input gradient of one small group: dy (m x N) @ w (K x N)^T.
// Rows are taken kChunk at a time, so that a chunk's output gradient stays in cache while every weight
// row passes over it (unchunked, a large group's dy was re-read from L3 once per four weight rows).
void small_dx(int64_t m, const float* dy, const float* w, float* dx, int64_t K, int64_t N) {
  constexpr int64_t kChunk = 64;  // 3072 rows of 1024: 5.6 -> 4.3 ms
  for (int64_t r = 0; r < m; r += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, m - r);
    const float* g = dy + r * N;
    float* o = dx + r * K;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) rows_dx<4>(rows, g, w + k * N, o + k, K, N);
    for (; k < K; ++k) rows_dx<1>(rows, g, w + k * N, o + k, K, N);
  }
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
    for (int v = 0; v < V; ++v) store(dw + c * N + v * kLanes, acc[c][v]);
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

// Cut every group into pieces and run body(piece) for all of them, each core taking a contiguous run
// of pieces of about equal cost. Small groups stay whole (a core then streams a weight once); a group
// bigger than a core's fair share is cut into slices of `align`-multiples of `span` (rows or weight rows).
template <typename Span, typename Cost, typename Body>
void per_core(int64_t G, const Span& span, const Cost& cost, int64_t align, const Body& body) {
  const int64_t cores = std::max<int64_t>(1, at::get_num_threads());
  double total = 0;
  for (int64_t g = 0; g < G; ++g) total += cost(g, span(g));
  std::vector<Piece> pieces;
  std::vector<double> cumulative{0.0};
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = span(g);
    const double c = cost(g, n);
    if (n == 0) {  // one empty piece (the weight gradient of a group without rows is still zeroed)
      pieces.push_back({g, 0, 0});
      cumulative.push_back(cumulative.back() + c);
      continue;
    }
    int64_t parts = c > 0 ? static_cast<int64_t>(c * 2 * cores / total) : 1;  // ~2 slices per core at most
    parts = std::max<int64_t>(1, std::min(parts, n / align));
    const int64_t step = (n / parts + align - 1) / align * align;  // >= align >= 1
    for (int64_t lo = 0; lo < n; lo += step) {
      const int64_t hi = std::min(n, lo + step);
      pieces.push_back({g, lo, hi});
      cumulative.push_back(cumulative.back() + c * (hi - lo) / n);
    }
  }
  const int64_t P = static_cast<int64_t>(pieces.size());
  std::vector<int64_t> bound(cores + 1, P);
  bound[0] = 0;
  for (int64_t t = 1, p = 0; t < cores; ++t) {
    while (p < P && cumulative[p] * cores < cumulative[P] * t) ++p;
    bound[t] = p;
  }
  at::parallel_for(0, cores, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t p = bound[t]; p < bound[t + 1]; ++p) body(pieces[p]);
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
      [&](int64_t, int64_t m) { return (m + 4.0) * K * N; }, align,
      [&](const Piece& p) {
        const int64_t row = start[p.g] + p.lo;
        tile(p.hi - p.lo, pa + row * in, pw + p.g * K * N, py + row * out, K, N);
      });
  return y;
}

}  // namespace

at::Tensor forward(at::Tensor x, at::Tensor w, at::Tensor counts) {
  return row_products(x, w, counts, false, 6, small_xw);
}

at::Tensor input_grad(at::Tensor dy, at::Tensor w, at::Tensor counts) {
  return row_products(dy, w, counts, true, 4, small_dx);
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
        }
      });
  return dw;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Like torch's own operators, these let other Python threads run while they compute.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("forward", &forward, "y_g = x_g @ w_g for consecutive row groups", release());
  m.def("input_grad", &input_grad, "dx_g = dy_g @ w_g^T for consecutive row groups", release());
  m.def("weight_grad", &weight_grad, "dw_g = x_g^T @ dy_g for consecutive row groups", release());
}
