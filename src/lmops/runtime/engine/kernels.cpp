// lmops' kernels for the compiled CPU decode graph (kernels.py builds them where the CPU has
// AVX2 and FMA, and says when they are used); float32, 8 floats a vector.
//
// lmops::small_linear(x, w) = x @ w.T for a few rows of x: the graph's projections. A decode
// step reads every weight once and does little arithmetic with it, so what counts is how fast
// w streams in. Each block of 4 rows of w is read from memory once and kept in L1 while every
// row of x passes over it, 2 rows of x at a time (8 accumulators in registers); inductor's
// loop for the same product streams w once a row of x.
//
// lmops::decode_attention(q, k, v, mask, scale): the graph's attention, in one call a layer
// where it was two batched products through MKL (its generic code on AMD CPUs) and a softmax.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

// softmax(q k^T * scale + mask) v for each batch t and row: q (BH, R, D), k and v (BH, N, D),
// mask (B, R, N), batch t's at t % B (BH = heads x B: the heads of one sequence share its
// mask); D a multiple of 8.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && mask.dim() == 3 && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && q.size(2) % 8 == 0 && mask.size(1) == q.size(1) &&
                  mask.size(2) == k.size(1) && mask.size(0) > 0 && q.size(0) % mask.size(0) == 0,
              "decode_attention: q (BH, R, D), k and v (BH, N, D), mask (B, R, N), B dividing BH, D % 8 == 0; got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", mask.sizes());
  for (const at::Tensor* t : {&q, &k, &v, &mask})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_cpu(), "decode_attention: float32 CPU tensors only");
  const int64_t BH = q.size(0), R = q.size(1), D = q.size(2), N = k.size(1), B = mask.size(0);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), mc = mask.contiguous();
  at::Tensor y = at::empty({BH, R, D}, qc.options());
  if (y.numel() == 0) return y;
  const float *qp = qc.const_data_ptr<float>(), *kp = kc.const_data_ptr<float>(), *vp = vc.const_data_ptr<float>();
  const float* mp = mc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  using Vec = at::vec::Vectorized<float>;
  const __m256i whole = tail_mask(8);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(R * N), inv(R);
    for (int64_t t = begin; t < end; ++t) {
      const float *qt = qp + t * R * D, *kt = kp + t * N * D, *vt = vp + t * N * D, *mt = mp + (t % B) * R * N;
      float* pt = p.data();
      // Scores: small_linear's tiles, the keys as w's rows.
      int64_t n = 0;
      for (; n + kRowsOfW <= N; n += kRowsOfW) {
        int64_t r = 0;
        for (; r + 2 <= R; r += 2) tile<2>(qt, kt, pt, N, D, r, n, whole);
        if (r < R) tile<1>(qt, kt, pt, N, D, r, n, whole);
      }
      for (; n < N; ++n) single_row_of_w(qt, kt, pt, R, N, D, n, whole);
      // Softmax of each row, scaled and masked; its 1/sum is applied to the outputs.
      for (int64_t r = 0; r < R; ++r) {
        float* row = pt + r * N;
        const float* m = mt + r * N;
        int64_t i = 0;
        Vec top(-INFINITY);
        for (; i + Vec::size() <= N; i += Vec::size()) {
          const Vec s = Vec::loadu(row + i) * Vec(static_cast<float>(scale)) + Vec::loadu(m + i);
          s.store(row + i);
          top = at::vec::maximum(top, s);
        }
        float most = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
        for (; i < N; ++i) most = std::max(most, row[i] = row[i] * static_cast<float>(scale) + m[i]);
        Vec total(0.f);
        for (i = 0; i + Vec::size() <= N; i += Vec::size()) {
          const Vec e = (Vec::loadu(row + i) - Vec(most)).exp();  // Sleef, as inductor's softmax
          e.store(row + i);
          total = total + e;
        }
        float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
        for (; i < N; ++i) sum += row[i] = std::exp(row[i] - most);
        inv[r] = 1.f / sum;
      }
      // Outputs: rows 2 at a time, 32 of D at a time in registers, sharing v's loads.
      float* yt = yp + t * R * D;
      for (int64_t d = 0; d < D; d += 32) {
        const int chunks = static_cast<int>(std::min<int64_t>(4, (D - d) / 8));
        for (int64_t r = 0; r < R; r += 2) {
          const bool two = r + 1 < R;
          const float *pa = pt + r * N, *pb = two ? pa + N : pa;
          __m256 a[4] = {}, b[4] = {};
          for (int64_t i = 0; i < N; ++i) {
            const __m256 wa = _mm256_set1_ps(pa[i]), wb = _mm256_set1_ps(pb[i]);
            const float* vi = vt + i * D + d;
            for (int c = 0; c < chunks; ++c) {
              const __m256 vv = _mm256_loadu_ps(vi + 8 * c);
              a[c] = _mm256_fmadd_ps(wa, vv, a[c]);
              b[c] = _mm256_fmadd_ps(wb, vv, b[c]);
            }
          }
          for (int c = 0; c < chunks; ++c) {
            _mm256_storeu_ps(yt + r * D + d + 8 * c, _mm256_mul_ps(a[c], _mm256_set1_ps(inv[r])));
            if (two) _mm256_storeu_ps(yt + (r + 1) * D + d + 8 * c, _mm256_mul_ps(b[c], _mm256_set1_ps(inv[r + 1])));
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(lmops, m) {
  m.def("small_linear(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(lmops, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("decode_attention", &decode_attention);
}
