#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <memory>
#include <vector>

#include "net/base/error.h"
#include "train/config.h"
#include "train/model.h"
#include "train/nn.h"
#include "train/rng.h"

namespace qring::train {
namespace {

std::vector<double> random_vec(size_t n, uint64_t seed, double scale = 1.0) {
  Rng r(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = scale * r.normal();
  return v;
}

std::vector<int32_t> random_labels(int n, int classes, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> v(n);
  for (auto& y : v) y = static_cast<int32_t>(r.below(classes));
  return v;
}

// Central differences on every parameter (or every `stride`-th) against forward_backward.
void gradient_check(Network<double>& net, int batch, uint64_t seed, size_t stride = 1) {
  const auto x = random_vec(static_cast<size_t>(net.input_shape().size() * batch), seed);
  const auto y = random_labels(batch, net.num_classes(), seed + 1);
  net.init(seed + 2);
  // Non-zero biases so that their gradients flow through every path.
  for (size_t i = 0; i < net.num_params(); ++i) net.params()[i] += 0.01 * std::sin(i * 0.7);
  net.forward_backward(x.data(), y.data(), batch);
  const std::vector<double> analytic(net.grads(), net.grads() + net.num_params());
  const double eps = 1e-6;
  size_t checked = 0;
  double worst = 0;
  for (size_t i = 0; i < net.num_params(); i += stride) {
    double& p = net.params()[i];
    const double saved = p;
    p = saved + eps;
    const double lp = net.evaluate(x.data(), y.data(), batch).loss_sum / batch;
    p = saved - eps;
    const double lm = net.evaluate(x.data(), y.data(), batch).loss_sum / batch;
    p = saved;
    const double numeric = (lp - lm) / (2 * eps);
    const double err = std::abs(numeric - analytic[i]) / std::max(1e-3, std::abs(numeric));
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-5) << "param " << i << ": analytic " << analytic[i] << " numeric " << numeric;
    ++checked;
  }
  EXPECT_GT(checked, 10u);
  ::testing::Test::RecordProperty("worst_relative_error", std::to_string(worst));
}

TEST(GradCheck, DenseReluSoftmax) {
  ModelSection m;
  m.type = "mlp";
  m.hidden = {7, 5};
  auto net = build_network<double>(m, {1, 3, 4}, 4);
  EXPECT_EQ(net->num_params(), (12u * 7 + 7) + (7 * 5 + 5) + (5 * 4 + 4));
  gradient_check(*net, 6, 10);
}

TEST(GradCheck, ConvReluPoolFlattenDense3x3) {
  ModelSection m;
  m.type = "cnn";
  m.conv_channels = {3, 4};  // second conv has 3 input channels: checks col2im / dx paths
  m.conv_kernel = 3;
  m.hidden = {6};
  auto net = build_network<double>(m, {1, 8, 8}, 5);
  gradient_check(*net, 3, 20);
}

TEST(GradCheck, ConvOddSizes5x5AndMultiChannelInput) {
  ModelSection m;
  m.type = "cnn";
  m.conv_channels = {2, 3};
  m.conv_kernel = 5;
  m.hidden = {};
  auto net = build_network<double>(m, {2, 7, 9}, 3);  // 7x9 -> pool 3x4 -> pool 1x2
  gradient_check(*net, 2, 30);
}

TEST(GradCheck, ValidPadding5x5) {
  ModelSection m;
  m.type = "cnn";
  m.conv_channels = {2, 3};
  m.conv_kernel = 5;
  m.conv_padding = "valid";
  m.hidden = {4};
  auto net = build_network<double>(m, {2, 16, 18}, 3);  // 12x14 -> 6x7 -> 2x3 -> 1x1
  ASSERT_EQ(net->layers()[0]->out_shape().h, 12);
  ASSERT_EQ(net->layers()[0]->out_shape().w, 14);
  gradient_check(*net, 2, 50);
}

TEST(GradCheck, KernelWiderThanImage) {
  ModelSection m;
  m.type = "cnn";
  m.conv_channels = {2, 2};
  m.conv_kernel = 7;  // the second conv sees a 2x2 image: most taps are padding
  m.hidden = {};
  auto net = build_network<double>(m, {1, 5, 4}, 3);
  gradient_check(*net, 2, 40);
}

TEST(Softmax, StableForHugeLogits) {
  Mat<double> z(3, 2);
  z << 1000, -1000, 0, 0, -1000, 1000;
  const int32_t y[2] = {0, 2};
  Mat<double> d;
  int64_t correct = 0;
  const double loss = softmax_cross_entropy<double>(z, y, &d, &correct);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, 0.0, 1e-12);
  EXPECT_EQ(correct, 2);
  EXPECT_TRUE(d.allFinite());
  Mat<float> zf(2, 1);
  zf << 200.f, 0.f;
  const int32_t wrong[1] = {1};
  const double lf = softmax_cross_entropy<float>(zf, wrong, nullptr, nullptr);
  EXPECT_NEAR(lf, 200.0, 1e-3);  // log-sum-exp without overflow
}

// Direct convolution (PyTorch semantics, zero padding `pad`) as an independent reference.
void check_direct_convolution(Shape in, int cout, int k, int pad) {
  const int batch = 2, ho = in.h + 2 * pad - k + 1, wo = in.w + 2 * pad - k + 1;
  Conv2d<double> conv(in, cout, k, pad);
  ASSERT_EQ(conv.out_shape().h, ho);
  ASSERT_EQ(conv.out_shape().w, wo);
  std::vector<double> params = random_vec(conv.num_params(), 3), grads(conv.num_params());
  conv.bind(params.data(), grads.data());
  const auto xs = random_vec(static_cast<size_t>(in.size() * batch), 4);  // (b, c, y, x)
  Mat<double> x(batch * in.h * in.w, in.c), y;
  for (int b = 0; b < batch; ++b)
    for (int c = 0; c < in.c; ++c)
      for (int s = 0; s < in.h * in.w; ++s)
        x(b * in.h * in.w + s, c) = xs[(b * in.c + c) * in.h * in.w + s];
  conv.forward(x, y, batch);
  ASSERT_EQ(y.rows(), batch * ho * wo);
  ASSERT_EQ(y.cols(), cout);
  const double* w = params.data();  // [cout][cin][ky][kx]
  const double* bias = w + cout * in.c * k * k;
  for (int b = 0; b < batch; ++b)
    for (int o = 0; o < cout; ++o)
      for (int yy = 0; yy < ho; ++yy)
        for (int xx = 0; xx < wo; ++xx) {
          double acc = bias[o];
          for (int c = 0; c < in.c; ++c)
            for (int ky = 0; ky < k; ++ky)
              for (int kx = 0; kx < k; ++kx) {
                const int sy = yy + ky - pad, sx = xx + kx - pad;
                if (sy < 0 || sy >= in.h || sx < 0 || sx >= in.w) continue;
                acc += w[((o * in.c + c) * k + ky) * k + kx] *
                       xs[((b * in.c + c) * in.h + sy) * in.w + sx];
              }
          EXPECT_NEAR(y(b * ho * wo + yy * wo + xx, o), acc, 1e-12);
        }
}

TEST(Conv2d, MatchesDirectConvolution) {
  check_direct_convolution({2, 5, 6}, 3, 3, 1);
  check_direct_convolution({3, 4, 7}, 2, 5, 2);
  check_direct_convolution({1, 3, 2}, 2, 7, 3);  // kernel wider than the image
  check_direct_convolution({2, 9, 7}, 3, 5, 0);  // valid: 5x3 outputs
  check_direct_convolution({1, 6, 6}, 2, 4, 0);  // even kernel, valid
  check_direct_convolution({2, 5, 5}, 2, 3, 2);  // more padding than "same"
  EXPECT_THROW(Conv2d<float>({1, 4, 4}, 2, 5, 0), UsageError);  // no output
}

TEST(MaxPool2, PicksWindowMaxAndRoutesGradient) {
  MaxPool2<double> pool({1, 4, 4});
  Mat<double> x(16, 1), y, dx;
  for (int i = 0; i < 16; ++i) x(i, 0) = (i * 7) % 16;  // a permutation of 0..15
  pool.forward(x, y, 1);
  ASSERT_EQ(y.rows(), 4);
  for (int py = 0; py < 2; ++py)
    for (int px = 0; px < 2; ++px) {
      double m = -1;
      for (int dy = 0; dy < 2; ++dy)
        for (int dxx = 0; dxx < 2; ++dxx) m = std::max(m, x((2 * py + dy) * 4 + 2 * px + dxx, 0));
      EXPECT_EQ(y(py * 2 + px, 0), m);
    }
  Mat<double> g = Mat<double>::Constant(4, 1, 1.0);
  pool.backward(x, y, g, &dx, 1);
  EXPECT_EQ(dx.sum(), 4.0);
  for (int i = 0; i < 16; ++i) {
    if (dx(i, 0) != 0) {  // the gradient lands on window maxima only
      EXPECT_TRUE((y.array() == x(i, 0)).any()) << "gradient at non-max input " << i;
    }
  }
}

// Float pooling (vectorized on AVX-512 builds) picks the same values and routes the gradient
// to the same inputs as the double one, ties included: the first maximum in the window order
// (top left, top right, bottom left, bottom right). Odd widths, an odd height (the scalar
// path) and rows wider than one vector of windows.
TEST(MaxPool2, FloatPicksTheSameMaximaAndTiesAsDouble) {
  const Shape shapes[] = {{3, 24, 24}, {5, 8, 8}, {2, 6, 7}, {2, 5, 4}, {1, 2, 34}, {2, 4, 66}};
  Rng rng(5);
  for (const Shape& s : shapes) {
    const int batch = 3;
    MaxPool2<float> pf(s);
    MaxPool2<double> pd(s);
    const int64_t n = int64_t{batch} * s.h * s.w;
    Mat<float> xf(n, s.c), yf, dxf;
    Mat<double> xd(n, s.c), yd, dxd;
    for (int64_t i = 0; i < xf.size(); ++i) {  // few distinct values: many ties
      const double v = double(rng.next_u64() % 5) - 1.0;
      xf.data()[i] = float(v);
      xd.data()[i] = v;
    }
    pf.forward(xf, yf, batch);
    pd.forward(xd, yd, batch);
    ASSERT_EQ(yf.rows(), yd.rows());
    Mat<float> gf(yf.rows(), yf.cols());
    Mat<double> gd(yd.rows(), yd.cols());
    for (int64_t i = 0; i < gf.size(); ++i) gf.data()[i] = float(gd.data()[i] = double(i + 1));
    pf.backward(xf, yf, gf, &dxf, batch);
    pd.backward(xd, yd, gd, &dxd, batch);
    for (int64_t i = 0; i < yf.size(); ++i)
      ASSERT_EQ(double(yf.data()[i]), yd.data()[i])
          << "output " << i << " of " << s.c << "x" << s.h << "x" << s.w;
    for (int64_t i = 0; i < dxf.size(); ++i)
      ASSERT_EQ(double(dxf.data()[i]), dxd.data()[i])
          << "gradient routed differently at input " << i << " of " << s.c << "x" << s.h << "x"
          << s.w;
  }
}

TEST(Model, ShapesAndContiguousBuffers) {
  ModelSection mlp;
  mlp.type = "mlp";
  mlp.hidden = {512, 256};
  auto m = make_model(mlp, 1);
  EXPECT_EQ(m->num_params(), 784u * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  ModelSection cnn;
  cnn.type = "cnn";
  cnn.conv_channels = {16, 32};
  cnn.conv_kernel = 3;
  cnn.hidden = {128};
  auto c = make_model(cnn, 1);
  EXPECT_EQ(c->num_params(), (9u * 16 + 16) + (144 * 32 + 32) + (1568 * 128 + 128) + 1290);
  EXPECT_EQ(c->grads() + 0, c->grads());
  ModelSection bad = cnn;
  bad.conv_channels = {4, 4, 4, 4, 4};
  EXPECT_THROW(build_network<float>(bad), ConfigError);
  // PyTorch's reference CNN: conv5x5 32 -> pool -> conv5x5 64 -> pool -> dense 128 -> 10,
  // valid: 28 -> 24 -> 12 -> 8 -> 4.
  ModelSection torch = cnn;
  torch.conv_channels = {32, 64};
  torch.conv_kernel = 5;
  torch.conv_padding = "valid";
  auto t = make_model(torch, 1);
  EXPECT_EQ(t->num_params(), (25u * 32 + 32) + (800 * 64 + 64) + (1024 * 128 + 128) + 1290);
  EXPECT_EQ(t->layers()[3]->out_shape().h, 8);  // conv, pool, relu, conv
  ModelSection shrink = torch;
  shrink.conv_channels = {4, 4, 4};  // 24 -> 12 -> 8 -> 4 -> 0
  EXPECT_THROW(build_network<float>(shrink), ConfigError);
}

TEST(Model, InitIsDeterministicAndHeScaled) {
  ModelSection mlp;
  mlp.hidden = {300};
  auto a = make_model(mlp, 5), b = make_model(mlp, 5), c = make_model(mlp, 6);
  std::vector<float> pa(a->params(), a->params() + a->num_params());
  EXPECT_EQ(pa, std::vector<float>(b->params(), b->params() + b->num_params()));
  EXPECT_NE(pa, std::vector<float>(c->params(), c->params() + c->num_params()));
  double sq = 0;
  for (size_t i = 0; i < 784 * 300; ++i) sq += double{pa[i]} * pa[i];
  EXPECT_NEAR(sq / (784 * 300), 2.0 / 784, 0.05 * 2.0 / 784);
  for (size_t i = 784 * 300; i < 784 * 300 + 300; ++i) EXPECT_EQ(pa[i], 0.0f);  // biases
}

TEST(Model, FloatMatchesDoubleNetwork) {
  ModelSection cnn;
  cnn.type = "cnn";
  cnn.conv_channels = {4, 8};
  cnn.hidden = {16};
  auto f = build_network<float>(cnn);
  auto d = build_network<double>(cnn);
  f->init(3);
  d->init(3);
  const int batch = 4;
  const auto xd = random_vec(784 * batch, 9);
  const std::vector<float> xf(xd.begin(), xd.end());
  const auto y = random_labels(batch, 10, 8);
  const double lf = f->forward_backward(xf.data(), y.data(), batch);
  const double ld = d->forward_backward(xd.data(), y.data(), batch);
  EXPECT_NEAR(lf, ld, 1e-4 * std::abs(ld));
  double num = 0, den = 0;
  for (size_t i = 0; i < d->num_params(); ++i) {
    num += std::pow(f->grads()[i] - d->grads()[i], 2);
    den += std::pow(d->grads()[i], 2);
  }
  EXPECT_LT(std::sqrt(num / den), 1e-4);
  // Evaluation agrees with the training forward pass, and predict with evaluate.
  EvalResult r = f->evaluate(xf.data(), y.data(), batch);
  EXPECT_NEAR(r.loss_sum / batch, lf, 1e-6);
  std::vector<int32_t> pred(batch);
  f->predict(xf.data(), batch, pred.data());
  int64_t right = 0;
  for (int i = 0; i < batch; ++i) right += pred[i] == y[i];
  EXPECT_EQ(right, r.correct);
}

TEST(Model, BatchSizeCanChange) {
  ModelSection cnn;
  cnn.type = "cnn";
  cnn.conv_channels = {4};
  cnn.hidden = {};
  auto net = build_network<double>(cnn);
  net->init(1);
  const auto x = random_vec(784 * 5, 2);
  const auto y = random_labels(5, 10, 3);
  // The loss of 5 samples is the mean of the losses of 2 + 3 samples evaluated separately.
  const double l5 = net->evaluate(x.data(), y.data(), 5).loss_sum;
  const double l2 = net->evaluate(x.data(), y.data(), 2).loss_sum;
  const double l3 = net->evaluate(x.data() + 2 * 784, y.data() + 2, 3).loss_sum;
  EXPECT_NEAR(l5, l2 + l3, 1e-9);
  EXPECT_THROW(net->evaluate(x.data(), y.data(), 0), UsageError);
}

// Splitting a batch into per-thread lanes changes only the summation order of the gradient.
TEST(Model, ThreadLanesMatchOneThreadAndAreDeterministic) {
  ModelSection cnn;
  cnn.type = "cnn";
  cnn.conv_channels = {4, 8};
  cnn.hidden = {32};
  auto net = build_network<float>(cnn);
  net->init(4);
  const int batch = 64;
  const auto xd = random_vec(784 * batch, 5);
  const std::vector<float> x(xd.begin(), xd.end());
  const auto y = random_labels(batch, 10, 6);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  EXPECT_EQ(net->lanes_for(batch), 1);
  const double l1 = net->forward_backward(x.data(), y.data(), batch);
  const std::vector<float> g1(net->grads(), net->grads() + net->num_params());
  const EvalResult e1 = net->evaluate(x.data(), y.data(), batch);
  omp_set_num_threads(4);
  EXPECT_EQ(net->lanes_for(batch), 4);
  EXPECT_EQ(net->lanes_for(40), 2);  // at least kMinLaneBatch samples per lane
  const double l4 = net->forward_backward(x.data(), y.data(), batch);
  const std::vector<float> g4(net->grads(), net->grads() + net->num_params());
  const EvalResult e4 = net->evaluate(x.data(), y.data(), batch);
  net->forward_backward(x.data(), y.data(), batch);
  const std::vector<float> g4again(net->grads(), net->grads() + net->num_params());
  omp_set_num_threads(saved);
  EXPECT_NEAR(l1, l4, 1e-5 * std::abs(l1));
  double num = 0, den = 0;
  for (size_t i = 0; i < g1.size(); ++i) {
    num += std::pow(double{g1[i]} - g4[i], 2);
    den += std::pow(double{g1[i]}, 2);
  }
  EXPECT_GT(den, 0.0);
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  EXPECT_EQ(g4, g4again);
  EXPECT_EQ(e1.correct, e4.correct);
  EXPECT_NEAR(e1.loss_sum, e4.loss_sum, 1e-4);
}

}  // namespace
}  // namespace qring::train
