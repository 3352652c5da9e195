// train/kernels.h: products against a naive reference, and the property resume and replicas
// rely on: the same inputs give the same bits wherever the buffers are.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstring>
#include <vector>

#include "train/conv_direct.h"
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
  EXPECT_THAT(isa, ::testing::HasSubstr("conv direct"));
#else
  EXPECT_THAT(isa, ::testing::HasSubstr("conv im2col"));
#endif
  EXPECT_EQ(&isa, &kernel_isa());  // computed once
}

// Conv2d in float (the direct kernels where AVX-512 is built in, else im2col + GEMM) against
// Conv2d in double (always im2col + GEMM) with the same parameters: the output, the weight and
// bias gradients and the input gradient, for PyTorch's CNN layers, "same" padding, and output
// and input channel counts that are not a multiple of 16 (a partial vector, and groups of 4, 3,
// 2 and 1 vectors).
TEST(DirectConv, FloatConvolutionMatchesTheDoubleOneForwardAndBackward) {
  struct Case {
    Shape in;
    int cout, k, pad, batch;
  };
  const Case cases[] = {{{1, 28, 28}, 32, 5, 0, 3}, {{32, 12, 12}, 64, 5, 0, 2},
                        {{3, 9, 7}, 20, 3, 1, 3},   {{2, 6, 6}, 70, 3, 1, 2},
                        {{4, 5, 8}, 40, 2, 0, 1},   {{1, 4, 4}, 1, 3, 1, 2},
                        {{40, 5, 5}, 8, 3, 1, 2},   {{70, 4, 4}, 5, 3, 0, 1}};
  for (const Case& c : cases) {
    Conv2d<float> f(c.in, c.cout, c.k, c.pad);
    Conv2d<double> d(c.in, c.cout, c.k, c.pad);
    const size_t np = f.num_params();
    const auto pd = random_vec<double>(np, 21);
    std::vector<float> pf(pd.begin(), pd.end()), gf(np);
    std::vector<double> pdd(pf.begin(), pf.end()), gd(np);
    f.bind(pf.data(), gf.data());
    d.bind(pdd.data(), gd.data());
    const int64_t n_in = int64_t{c.batch} * c.in.h * c.in.w;
    const auto xv = random_vec<float>(size_t(n_in * c.in.c), 22);
    Mat<float> xf(n_in, c.in.c), yf, dyf, dxf;
    Mat<double> xd(n_in, c.in.c), yd, dyd, dxd;
    std::copy(xv.begin(), xv.end(), xf.data());
    std::copy(xv.begin(), xv.end(), xd.data());
    f.forward(xf, yf, c.batch);
    d.forward(xd, yd, c.batch);
    ASSERT_EQ(yf.rows(), yd.rows());
    ASSERT_EQ(yf.cols(), yd.cols());
    const auto dyv = random_vec<float>(size_t(yf.size()), 23);
    dyf.resize(yf.rows(), yf.cols());
    dyd.resize(yd.rows(), yd.cols());
    std::copy(dyv.begin(), dyv.end(), dyf.data());
    std::copy(dyv.begin(), dyv.end(), dyd.data());
    f.backward(xf, yf, dyf, &dxf, c.batch);
    d.backward(xd, yd, dyd, &dxd, c.batch);
    auto check = [&](const float* a, const double* b, int64_t len, const char* what) {
      double scale = 1e-30, worst = 0;
      for (int64_t i = 0; i < len; ++i) scale = std::max(scale, std::abs(b[i]));
      for (int64_t i = 0; i < len; ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
      EXPECT_LT(worst / scale, 2e-5) << what << " of " << f.describe() << ", batch " << c.batch;
    };
    check(yf.data(), yd.data(), yf.size(), "output");
    check(gf.data(), gd.data(), int64_t(np), "parameter gradient");
    check(dxf.data(), dxd.data(), dxf.size(), "input gradient");
  }
}

// The direct kernels' bits do not depend on where their buffers are.
TEST(DirectConv, ResultsDoNotDependOnBufferAlignment) {
  if (!direct_conv_available()) GTEST_SKIP() << "built without AVX-512: no direct kernels";
  const ConvGeometry g{3, 10, 9, 37, 3};
  const int batch = 2;
  const int64_t plane = int64_t{batch} * g.h * g.w, oplane = int64_t{batch} * g.ho() * g.wo();
  const auto x = random_vec<float>(size_t(plane * g.cin), 31);
  const auto w = random_vec<float>(size_t(g.kk() * g.cout + g.cout), 32);
  const auto dy = random_vec<float>(size_t(oplane * g.cout), 33);
  std::vector<float> ref_y, ref_dw, ref_dx;
  ConvWorkspace scratch;
  for (int off = 0; off < 16; ++off) {
    AlignedVector<float> X(x.size() + 16), W(w.size() + 16), DY(dy.size() + 16),
        Y(size_t(oplane * g.cout) + 16), DW(size_t(g.kk() * g.cout) + 16),
        DX(size_t(plane * g.cin) + 16);
    std::copy(x.begin(), x.end(), X.begin() + off);
    std::copy(w.begin(), w.end(), W.begin() + (15 - off));
    std::copy(dy.begin(), dy.end(), DY.begin() + (off * 7) % 16);
    float* y = Y.data() + (off * 5) % 16;
    float* dw = DW.data() + (off * 3) % 16;
    const float* wp = W.data() + (15 - off);
    conv_forward_direct(g, batch, X.data() + off, plane, wp, wp + g.kk() * g.cout, y, oplane,
                        scratch);
    conv_weight_grad_direct(g, batch, X.data() + off, plane, DY.data() + (off * 7) % 16, oplane, dw,
                            scratch);
    float* dx = DX.data() + (off * 11) % 16;
    conv_input_grad_direct(g, batch, DY.data() + (off * 7) % 16, oplane, wp, dx, plane, scratch);
    if (off == 0) {
      ref_y.assign(y, y + oplane * g.cout);
      ref_dw.assign(dw, dw + g.kk() * g.cout);
      ref_dx.assign(dx, dx + plane * g.cin);
    }
    EXPECT_TRUE(same_bits(dx, ref_dx.data(), ref_dx.size())) << "input gradient at offset " << off;
    EXPECT_TRUE(same_bits(y, ref_y.data(), ref_y.size())) << "forward at offset " << off;
    EXPECT_TRUE(same_bits(dw, ref_dw.data(), ref_dw.size())) << "weight gradient at offset " << off;
  }
}

}  // namespace
}  // namespace qring::train
