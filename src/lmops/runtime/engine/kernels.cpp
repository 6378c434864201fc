// lmops' kernels for the compiled CPU decode graph (kernels.py builds them where the CPU has
// AVX2 and FMA, and says when they are used); float32, 8 floats a vector.
//
// lmops::small_linear(x, w_blocks, n) = x @ w.T for a few rows of x: the graph's projections,
// against the weight w (n, K) packed as blocks of 16 of its rows, each block stored k-major
// (kernels.py's pack_weight: (blocks, K, 16)). A decode step reads every weight once and does
// little arithmetic with it, so what counts is how fast w streams in: a block is one
// contiguous run of memory that every register tile reads front to back, which the hardware
// prefetches well, read once for every 6 rows of x (from L1 after the first 6: a block is
// K x 64 bytes), the outputs in registers, no sums across a vector's lanes.
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

// The attention's scores are dot products of q's rows with k's rows (D floats, a multiple of 8):
// each block of 4 rows of k is read once while q's rows pass over it, 2 at a time.
constexpr int64_t kRowsOfK = 4;

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

// Rows r..r+RX-1 of q against rows n..n+3 of k, into s (N floats a row).
template <int RX>
void score_tile(const float* q, const float* k, float* s, int64_t N, int64_t D, int64_t r, int64_t n) {
  const float* kn = k + n * D;
  __m256 acc[RX][kRowsOfK];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < kRowsOfK; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[kRowsOfK];
    for (int j = 0; j < kRowsOfK; ++j) kv[j] = _mm256_loadu_ps(kn + j * D + d);
    for (int i = 0; i < RX; ++i) {
      const __m256 qv = _mm256_loadu_ps(q + (r + i) * D + d);
      for (int j = 0; j < kRowsOfK; ++j) acc[i][j] = _mm256_fmadd_ps(kv[j], qv, acc[i][j]);
    }
  }
  for (int i = 0; i < RX; ++i) _mm_storeu_ps(s + (r + i) * N + n, sums(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}

// Every row of q against row n of k: the last N % 4 rows of k.
void score_row(const float* q, const float* k, float* s, int64_t R, int64_t N, int64_t D, int64_t n) {
  const float* kn = k + n * D;
  for (int64_t r = 0; r < R; ++r) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(kn + d), _mm256_loadu_ps(q + r * D + d), acc);
    s[r * N + n] = sum(acc);
  }
}

constexpr int64_t kBlock = 16;  // columns of a packed weight's block, two vectors (kernels.py's BLOCK)

// Rows 0..RX-1 of x (K floats each) against a block (K x 16, k-major), into y (ldy floats a
// row). The block is read front to back once, whatever RX: one stream the prefetcher follows
// (strips of a wider block, read at a stride, stalled on every load). The k loop is split S
// ways, S partial sums of each output vector added at the end, so that at least 8
// multiply-adds are independent of each other (an FMA takes 4 cycles, 2 issue a cycle).
// (The loops are unrolled first, so the accumulators stay in registers: without it GCC
// kept them on the stack, a store a multiply-add, and 5 rows ran 1.7x slower.)
template <int RX, int S>
void block_tile(const float* x, int64_t K, const float* wb, float* y, int64_t ldy) {
  __m256 acc[S][RX][2];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < RX; ++i) acc[s][i][0] = acc[s][i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m256 w0 = _mm256_loadu_ps(wb + (k + s) * kBlock), w1 = _mm256_loadu_ps(wb + (k + s) * kBlock + 8);
#pragma GCC unroll 8
      for (int i = 0; i < RX; ++i) {
        const __m256 b = _mm256_broadcast_ss(x + i * K + k + s);
        acc[s][i][0] = _mm256_fmadd_ps(b, w0, acc[s][i][0]);
        acc[s][i][1] = _mm256_fmadd_ps(b, w1, acc[s][i][1]);
      }
    }
  }
  for (; k < K; ++k) {  // the last K % S
    const __m256 w0 = _mm256_loadu_ps(wb + k * kBlock), w1 = _mm256_loadu_ps(wb + k * kBlock + 8);
#pragma GCC unroll 8
    for (int i = 0; i < RX; ++i) {
      const __m256 b = _mm256_broadcast_ss(x + i * K + k);
      acc[0][i][0] = _mm256_fmadd_ps(b, w0, acc[0][i][0]);
      acc[0][i][1] = _mm256_fmadd_ps(b, w1, acc[0][i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RX; ++i) {
#pragma GCC unroll 8
    for (int s = 1; s < S; ++s) {
      acc[0][i][0] = _mm256_add_ps(acc[0][i][0], acc[s][i][0]);
      acc[0][i][1] = _mm256_add_ps(acc[0][i][1], acc[s][i][1]);
    }
    _mm256_storeu_ps(y + i * ldy, acc[0][i][0]);
    _mm256_storeu_ps(y + i * ldy + 8, acc[0][i][1]);
  }
}

// One row of x against 4 consecutive whole blocks (64 columns), into y: a broadcast of x for
// 8 multiply-adds, 4 streams each read front to back (a single row's product is all loads: one
// block at a time, its 16 columns took a broadcast for every 2).
void row_quad_tile(const float* x, int64_t K, const float* wb, float* y) {
  const float* w[4] = {wb, wb + K * kBlock, wb + 2 * K * kBlock, wb + 3 * K * kBlock};
  __m256 acc[4][2];
#pragma GCC unroll 8
  for (int q = 0; q < 4; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b = _mm256_broadcast_ss(x + k);
#pragma GCC unroll 8
    for (int q = 0; q < 4; ++q) {
      acc[q][0] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w[q] + k * kBlock), acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w[q] + k * kBlock + 8), acc[q][1]);
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_ps(y + q * kBlock, acc[q][0]);
    _mm256_storeu_ps(y + q * kBlock + 8, acc[q][1]);
  }
}

// Every row of x against one block, up to 6 rows at a time (the block stays in L1 for the
// next 6); the tiles keep 8 to 12 accumulators of the 16 registers.
void block_product(const float* x, int64_t R, int64_t K, const float* wb, float* y, int64_t ldy) {
  for (int64_t r = 0; r < R; r += 6) {
    const float* xr = x + r * K;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(6, R - r)) {
      case 1: block_tile<1, 4>(xr, K, wb, yr, ldy); break;
      case 2: block_tile<2, 2>(xr, K, wb, yr, ldy); break;
      case 3: block_tile<3, 2>(xr, K, wb, yr, ldy); break;
      case 4: block_tile<4, 1>(xr, K, wb, yr, ldy); break;
      case 5: block_tile<5, 1>(xr, K, wb, yr, ldy); break;
      default: block_tile<6, 1>(xr, K, wb, yr, ldy); break;
    }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w_blocks, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w_blocks.dim() == 3 && w_blocks.size(2) == kBlock && x.size(1) == w_blocks.size(1) &&
                  x.size(1) > 0 && n >= 0 && w_blocks.size(0) == (n + kBlock - 1) / kBlock,
              "small_linear: x (rows, K), K > 0, and w_blocks (ceil(n / 16), K, 16), n >= 0; got ", x.sizes(), ", ",
              w_blocks.sizes(), " and n ", n);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w_blocks.scalar_type() == at::kFloat && x.is_cpu() && w_blocks.is_cpu(),
              "small_linear: float32 CPU tensors only");
  const at::Tensor xc = x.contiguous(), wc = w_blocks.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), blocks = wc.size(0);
  at::Tensor y = at::empty({R, n}, xc.options());
  if (R == 0) return y;
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const int64_t whole = n / kBlock;  // blocks without padding
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    if (R == 1)
      for (; b + 4 <= std::min(end, whole); b += 4) row_quad_tile(xp, K, wp + b * K * kBlock, yp + b * kBlock);
    for (; b < end; ++b) {
      const int64_t width = std::min(kBlock, n - b * kBlock);
      if (width == kBlock) {
        block_product(xp, R, K, wp + b * K * kBlock, yp + b * kBlock, n);
        continue;
      }
      std::vector<float> part(R * kBlock);  // the last block's columns past n are padding
      block_product(xp, R, K, wp + b * K * kBlock, part.data(), kBlock);
      for (int64_t r = 0; r < R; ++r) std::copy_n(part.data() + r * kBlock, width, yp + r * n + b * kBlock);
    }
  });
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
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(R * N), inv(R);
    for (int64_t t = begin; t < end; ++t) {
      const float *qt = qp + t * R * D, *kt = kp + t * N * D, *vt = vp + t * N * D, *mt = mp + (t % B) * R * N;
      float* pt = p.data();
      // Scores.
      int64_t n = 0;
      for (; n + kRowsOfK <= N; n += kRowsOfK) {
        int64_t r = 0;
        for (; r + 2 <= R; r += 2) score_tile<2>(qt, kt, pt, N, D, r, n);
        if (r < R) score_tile<1>(qt, kt, pt, N, D, r, n);
      }
      for (; n < N; ++n) score_row(qt, kt, pt, R, N, D, n);
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
  m.def("small_linear(Tensor x, Tensor w_blocks, int n) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(lmops, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("decode_attention", &decode_attention);
}
