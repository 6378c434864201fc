// torch.ops.lmops.small_linear(x, w) = x @ w.T for a few float32 rows of x: the compiled
// decode graph's projections (kernels.py says when it is built and used).
//
// A decode step reads every weight once and does little arithmetic with it, so what counts
// is how fast w streams in. Each block of 4 rows of w is read from memory once and kept in
// L1 while every row of x passes over it, 2 rows of x at a time (8 accumulators in
// registers); inductor's loop for the same product streams w once a row of x.
// AVX2 and FMA (kernels.py builds this only where the CPU has both), 8 floats a vector.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

constexpr int64_t kRowsOfW = 4;

// The lanes of the last, partial vector of a row of K floats (all lanes if K % 8 == 0).
__m256i tail_mask(int64_t K) {
  const int64_t left = K % 8 == 0 ? 8 : K % 8;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

float sum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The 4 sums of a0..a3, in order.
__m128 sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Rows r..r+RX-1 of x against rows n..n+3 of w, into y.
template <int RX>
void tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t r, int64_t n, __m256i mask) {
  const float* wn = w + n * K;
  __m256 acc[RX][kRowsOfW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < kRowsOfW; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m256 q[kRowsOfW];
    for (int j = 0; j < kRowsOfW; ++j) q[j] = load(wn + j * K + k);
    for (int i = 0; i < RX; ++i) {
      const __m256 v = load(x + (r + i) * K + k);
      for (int j = 0; j < kRowsOfW; ++j) acc[i][j] = _mm256_fmadd_ps(q[j], v, acc[i][j]);
    }
  };
  const int64_t last = (K - 1) / 8 * 8;  // the start of the last vector, whole or partial
  for (int64_t k = 0; k < last; k += 8) step(k, [](const float* p) { return _mm256_loadu_ps(p); });
  step(last, [mask](const float* p) { return _mm256_maskload_ps(p, mask); });
  for (int i = 0; i < RX; ++i) _mm_storeu_ps(y + (r + i) * N + n, sums(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}

// Every row of x against row n of w: the last N % 4 rows of w.
void single_row_of_w(const float* x, const float* w, float* y, int64_t R, int64_t N, int64_t K, int64_t n, __m256i mask) {
  const float* wn = w + n * K;
  const int64_t last = (K - 1) / 8 * 8;
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < last; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wn + k), _mm256_loadu_ps(xr + k), acc);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(wn + last, mask), _mm256_maskload_ps(xr + last, mask), acc);
    y[r * N + n] = sum(acc);
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) > 0,
              "small_linear: x (rows, K) and w (N, K), K > 0; got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_cpu() && w.is_cpu(),
              "small_linear: float32 CPU tensors only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t R = xc.size(0), N = wc.size(0), K = wc.size(1);
  at::Tensor y = at::empty({R, N}, xc.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const __m256i mask = tail_mask(K);
  // Blocks of w split between threads (16 blocks at least each: 64 rows of w).
  at::parallel_for(0, N / kRowsOfW, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t r = 0;
      for (; r + 2 <= R; r += 2) tile<2>(xp, wp, yp, N, K, r, b * kRowsOfW, mask);
      if (r < R) tile<1>(xp, wp, yp, N, K, r, b * kRowsOfW, mask);
    }
  });
  for (int64_t n = N / kRowsOfW * kRowsOfW; n < N; ++n) single_row_of_w(xp, wp, yp, R, N, K, n, mask);
  return y;
}

}  // namespace

TORCH_LIBRARY(lmops, m) { m.def("small_linear(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(lmops, CPU, m) { m.impl("small_linear", &small_linear); }
