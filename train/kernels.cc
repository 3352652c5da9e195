#include "train/kernels.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Core>
#include <mutex>

#include "train/conv_direct.h"

namespace qring::train {
namespace {

// BLAS runs on the calling thread only (see kernels.h). openblas_set_num_threads also sets
// the OpenMP thread count in OpenBLAS's OpenMP build, so the caller's count is put back.
void blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int threads = omp_get_max_threads();
    openblas_set_num_threads(1);
    omp_set_num_threads(threads);
  });
}

std::string vector_isa() {
  std::string s;
#if defined(__AVX512F__)
  s = "avx512f";
#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
  s += "+bw+dq+vl";
#endif
#elif defined(__AVX2__)
  s = "avx2";
#elif defined(__AVX__)
  s = "avx";
#elif defined(__SSE4_2__)
  s = "sse4.2";
#elif defined(__SSE2__)
  s = "sse2";
#else
  s = "scalar";
#endif
#if defined(__FMA__)
  s += "+fma";
#endif
  return s;
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  blas_single_threaded();
  cblas_sgemm(CblasColMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blasint(m), blasint(n), blasint(k), 1.0f, a,
              blasint(lda), b, blasint(ldb), accumulate ? 1.0f : 0.0f, c, blasint(ldc));
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a,
          int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  using M = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic>;
  using S = Eigen::OuterStride<>;
  Eigen::Map<const M, 0, S> A(a, trans_a ? k : m, trans_a ? m : k, S(lda));
  Eigen::Map<const M, 0, S> B(b, trans_b ? n : k, trans_b ? k : n, S(ldb));
  Eigen::Map<M, 0, S> C(c, m, n, S(ldc));
  if (!accumulate) C.setZero();
  if (trans_a && trans_b) C.noalias() += A.transpose() * B.transpose();
  else if (trans_a) C.noalias() += A.transpose() * B;
  else if (trans_b) C.noalias() += A * B.transpose();
  else C.noalias() += A * B;
}

template <class T>
void row_sums(const T* x, int64_t rows, int64_t cols, int64_t ld, T* out) {
  for (int64_t i = 0; i < rows; ++i) out[i] = T(0);
  for (int64_t j = 0; j < cols; ++j) {
    const T* col = x + j * ld;
    for (int64_t i = 0; i < rows; ++i) out[i] += col[i];
  }
}

template <class T>
T fixed_order_sum(const T* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  T s = acc[0];
  for (; i < n; ++i) s += x[i];
  return s;
}

const std::string& kernel_isa() {
  static const std::string isa = [] {
    std::string blas = openblas_get_config();
    const std::string core = openblas_get_corename();
    if (blas.find(core) == std::string::npos) blas += " " + core;
    return fmt::format("vector {} (Eigen {}), conv {}, blas {}", vector_isa(),
                       Eigen::SimdInstructionSetsInUse(),
                       direct_conv_available() ? "direct" : "im2col", blas);
  }();
  return isa;
}

template void row_sums<float>(const float*, int64_t, int64_t, int64_t, float*);
template void row_sums<double>(const double*, int64_t, int64_t, int64_t, double*);
template float fixed_order_sum<float>(const float*, int64_t);
template double fixed_order_sum<double>(const double*, int64_t);

}  // namespace qring::train
