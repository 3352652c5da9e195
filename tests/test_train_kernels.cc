// train/kernels.h: products against a naive reference, and the property resume and replicas
// rely on: the same inputs give the same bits wherever the buffers are.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cstring>
#include <vector>

#include "train/kernels.h"
#include "train/nn.h"
#include "train/rng.h"

namespace qring::train {
namespace {

template <class T>
std::vector<T> random_vec(size_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(r.normal());
  return v;
}

template <class T>
bool same_bits(const T* a, const T* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(T)) == 0;
}

// C = op(A) op(B) in double, column-major.
std::vector<double> naive(bool ta, bool tb, int m, int n, int k, const std::vector<double>& a,
                          int lda, const std::vector<double>& b, int ldb) {
  std::vector<double> c(size_t(m) * n, 0.0);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double s = 0;
      for (int p = 0; p < k; ++p)
        s += (ta ? a[size_t(i) * lda + p] : a[size_t(p) * lda + i]) *
             (tb ? b[size_t(p) * ldb + j] : b[size_t(j) * ldb + p]);
      c[size_t(j) * m + i] = s;
    }
  return c;
}

TEST(Kernels, GemmMatchesNaiveProductForEveryTransposeAndAccumulates) {
  const int m = 37, n = 23, k = 51;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const int lda = (ta ? k : m) + 3, ldb = (tb ? n : k) + 2, ldc = m + 1;
    const auto ad = random_vec<double>(size_t(lda) * (ta ? m : k), 1 + t);
    const auto bd = random_vec<double>(size_t(ldb) * (tb ? k : n), 11 + t);
    const auto want = naive(ta, tb, m, n, k, ad, lda, bd, ldb);
    const std::vector<float> af(ad.begin(), ad.end()), bf(bd.begin(), bd.end());
    std::vector<float> cf(size_t(ldc) * n, 7.0f);
    std::vector<double> cd(size_t(ldc) * n, 7.0);
    gemm(ta, tb, m, n, k, af.data(), lda, bf.data(), ldb, cf.data(), ldc, false);
    gemm(ta, tb, m, n, k, ad.data(), lda, bd.data(), ldb, cd.data(), ldc, false);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const double w = want[size_t(j) * m + i];
        EXPECT_NEAR(cf[size_t(j) * ldc + i], w, 1e-4 * (1 + std::abs(w))) << t << " " << i << "," << j;
        EXPECT_NEAR(cd[size_t(j) * ldc + i], w, 1e-10 * (1 + std::abs(w)));
      }
    // The padding rows between columns are not touched.
    for (int j = 0; j < n; ++j) EXPECT_EQ(cf[size_t(j) * ldc + m], 7.0f);
    // Accumulating adds the product to what C holds.
    gemm(ta, tb, m, n, k, af.data(), lda, bf.data(), ldb, cf.data(), ldc, true);
    gemm(ta, tb, m, n, k, ad.data(), lda, bd.data(), ldb, cd.data(), ldc, true);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const double w = 2 * want[size_t(j) * m + i];
        EXPECT_NEAR(cf[size_t(j) * ldc + i], w, 2e-4 * (1 + std::abs(w)));
        EXPECT_NEAR(cd[size_t(j) * ldc + i], w, 2e-10 * (1 + std::abs(w)));
      }
  }
}

// The cause of issue 17's resume failure: with 64-byte vectors, Eigen's reductions gave other
// bits for a destination that was not 64-byte aligned. Every kernel here is run on copies of
// its inputs and outputs shifted by 0..15 floats; the results must be bit-identical.
TEST(Kernels, ResultsDoNotDependOnBufferAlignment) {
  // Shapes of the MLP and CNN layers (batch 32 lanes), and odd ones.
  struct Case {
    bool ta, tb;
    int m, n, k;
  };
  const Case cases[] = {{true, false, 256, 32, 784},  {false, true, 784, 256, 32},
                        {false, false, 784, 32, 256}, {false, false, 18432, 32, 25},
                        {true, false, 800, 64, 2048}, {false, true, 2048, 800, 64},
                        {false, false, 7, 3, 5},      {true, true, 33, 17, 65}};
  for (const Case& c : cases) {
    const int lda = c.ta ? c.k : c.m, ldb = c.tb ? c.n : c.k;
    const size_t na = size_t(lda) * (c.ta ? c.m : c.k), nb = size_t(ldb) * (c.tb ? c.k : c.n),
                 nc = size_t(c.m) * c.n;
    const auto a = random_vec<float>(na, 3), b = random_vec<float>(nb, 4),
               c0 = random_vec<float>(nc, 5);
    std::vector<float> ref;
    for (int off = 0; off < 16; ++off) {
      AlignedVector<float> A(na + 16), B(nb + 16), C(nc + 16);
      std::copy(a.begin(), a.end(), A.begin() + off);
      std::copy(b.begin(), b.end(), B.begin() + (15 - off));
      std::copy(c0.begin(), c0.end(), C.begin() + (off * 7) % 16);
      float* cp = C.data() + (off * 7) % 16;
      gemm(c.ta, c.tb, c.m, c.n, c.k, A.data() + off, lda, B.data() + (15 - off), ldb, cp, c.m,
           true);
      if (off == 0) ref.assign(cp, cp + nc);
      EXPECT_TRUE(same_bits(cp, ref.data(), nc))
          << "gemm " << c.m << "x" << c.n << "x" << c.k << " at offset " << off;
    }
  }
  const int rows = 128, cols = 64;
  const auto x = random_vec<float>(size_t(rows) * cols + 4000, 6);
  std::vector<float> ref_rows, ref_sum;
  for (int off = 0; off < 16; ++off) {
    AlignedVector<float> X(x.size() + 16), out(rows + 16);
    std::copy(x.begin(), x.end(), X.begin() + off);
    row_sums(X.data() + off, rows, cols, rows, out.data() + (off * 5) % 16);
    const float* o = out.data() + (off * 5) % 16;
    const float s = fixed_order_sum(X.data() + off, int64_t(x.size()) - 3);
    if (off == 0) {
      ref_rows.assign(o, o + rows);
      ref_sum = {s};
    }
    EXPECT_TRUE(same_bits(o, ref_rows.data(), rows)) << "row_sums at offset " << off;
    EXPECT_TRUE(same_bits(&s, ref_sum.data(), 1)) << "fixed_order_sum at offset " << off;
  }
}

TEST(Kernels, SumsAreExactOnIntegersAndInTheirOrder) {
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 17);
  double want = 0;
  for (float v : x) want += v;
  EXPECT_EQ(fixed_order_sum(x.data(), int64_t(x.size())), float(want));
  EXPECT_EQ(fixed_order_sum(x.data(), 0), 0.0f);
  EXPECT_EQ(fixed_order_sum(x.data() + 1, 5), 1.0f + 2 + 3 + 4 + 5);
  // Column-major 3 x 2: row sums over the columns.
  const double m[6] = {1, 2, 3, 10, 20, 30};
  double out[3];
  row_sums(m, 3, 2, 3, out);
  EXPECT_EQ(out[0], 11);
  EXPECT_EQ(out[1], 22);
  EXPECT_EQ(out[2], 33);
}

TEST(Kernels, IsaNamesTheVectorUnitsAndTheBlas) {
  const std::string& isa = kernel_isa();
  EXPECT_THAT(isa, ::testing::HasSubstr("vector "));
  EXPECT_THAT(isa, ::testing::HasSubstr("blas OpenBLAS"));
#if defined(__AVX512F__)
  EXPECT_THAT(isa, ::testing::HasSubstr("avx512f"));
#endif
  EXPECT_EQ(&isa, &kernel_isa());  // computed once
}

}  // namespace
}  // namespace qring::train
