#include "train/nn.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "net/base/error.h"
#include "net/base/out_of_memory.h"
#include "train/conv_direct.h"
#include "train/kernels.h"

namespace qring::train {
namespace {

void he_init(float* w, size_t n, int64_t fan_in, Rng& rng) {
  const double std = std::sqrt(2.0 / static_cast<double>(fan_in));
  for (size_t i = 0; i < n; ++i) w[i] = static_cast<float>(std * rng.normal());
}
void he_init(double* w, size_t n, int64_t fan_in, Rng& rng) {
  const double std = std::sqrt(2.0 / static_cast<double>(fan_in));
  // Rounded through float so float and double networks start from the same values.
  for (size_t i = 0; i < n; ++i) w[i] = static_cast<float>(std * rng.normal());
}

// d[r * dstep + i] (+)= s[r * sstep + i] for i < n, r < rows: the row copies of im2col and
// the row sums of col2im. Rows are short (the output width: 8 or 24 in PyTorch's CNN), so
// the common widths get a fixed-length body the compiler turns into a few vector moves.
template <bool kAdd, int N, class T>
void rows_fixed(T* d, int64_t dstep, const T* s, int64_t sstep, int rows) {
  for (int r = 0; r < rows; ++r, d += dstep, s += sstep)
    for (int i = 0; i < N; ++i) {
      if constexpr (kAdd) d[i] += s[i];
      else d[i] = s[i];
    }
}

template <bool kAdd, class T>
void rows_op(T* d, int64_t dstep, const T* s, int64_t sstep, int rows, int n) {
  switch (n) {
    case 4: return rows_fixed<kAdd, 4>(d, dstep, s, sstep, rows);
    case 7: return rows_fixed<kAdd, 7>(d, dstep, s, sstep, rows);
    case 8: return rows_fixed<kAdd, 8>(d, dstep, s, sstep, rows);
    case 12: return rows_fixed<kAdd, 12>(d, dstep, s, sstep, rows);
    case 14: return rows_fixed<kAdd, 14>(d, dstep, s, sstep, rows);
    case 16: return rows_fixed<kAdd, 16>(d, dstep, s, sstep, rows);
    case 24: return rows_fixed<kAdd, 24>(d, dstep, s, sstep, rows);
    case 28: return rows_fixed<kAdd, 28>(d, dstep, s, sstep, rows);
    default:
      for (int r = 0; r < rows; ++r, d += dstep, s += sstep)
        for (int i = 0; i < n; ++i) {
          if constexpr (kAdd) d[i] += s[i];
          else d[i] = s[i];
        }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------- Dense --

template <class T>
std::string Dense<T>::describe() const {
  return fmt::format("dense {}->{}", in_, out_);
}

template <class T>
void Dense<T>::init(Rng& rng) {
  he_init(p_, static_cast<size_t>(in_ * out_), in_, rng);
  std::fill(p_ + in_ * out_, p_ + in_ * out_ + out_, T(0));
}

// W is [out][in] row-major, i.e. the column-major in x out matrix W^T.
template <class T>
void Dense<T>::forward(const Mat<T>& x, Mat<T>& y, int batch) {
  const T* b = p_ + out_ * in_;
  y.resize(out_, batch);
  for (int j = 0; j < batch; ++j) std::copy_n(b, out_, y.data() + j * out_);
  gemm(true, false, out_, batch, in_, p_, in_, x.data(), in_, y.data(), out_, true);
}

template <class T>
void Dense<T>::backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) {
  // dW^T (in x out) = x dy^T; db = the row sums of dy; dx = W^T dy.
  gemm(false, true, in_, out_, batch, x.data(), in_, dy.data(), out_, g_, in_, false);
  row_sums(dy.data(), out_, batch, out_, g_ + out_ * in_);
  if (dx != nullptr) {
    dx->resize(in_, batch);
    gemm(false, false, in_, batch, out_, p_, in_, dy.data(), out_, dx->data(), in_, false);
  }
}

// ----------------------------------------------------------------------------------- Relu --

template <class T>
void Relu<T>::forward(const Mat<T>& x, Mat<T>& y, int batch) {
  y.resize(x.rows(), x.cols());
  y.array() = x.array().max(T(0));
}

template <class T>
void Relu<T>::backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) {
  if (dx == nullptr) return;
  dx->resize(x.rows(), x.cols());
  dx->array() = dy.array() * (y.array() > T(0)).template cast<T>();
}

// --------------------------------------------------------------------------------- Conv2d --

template <class T>
Conv2d<T>::Conv2d(Shape in, int out_channels, int kernel, int pad)
    : in_(in),
      cout_(out_channels),
      k_(kernel),
      pad_(pad),
      ho_(in.h + 2 * pad - kernel + 1),
      wo_(in.w + 2 * pad - kernel + 1),
      kk_(int64_t{in.c} * kernel * kernel) {
  if (kernel < 1 || pad < 0 || ho_ < 1 || wo_ < 1 || out_channels < 1)
    throw UsageError(fmt::format("Conv2d: a {}x{} kernel with padding {} on a {}x{} input leaves "
                                 "no output",
                                 kernel, kernel, pad, in.h, in.w));
}

template <class T>
std::string Conv2d<T>::describe() const {
  return fmt::format("conv {}x{} {}->{} on {}x{}{}", k_, k_, in_.c, cout_, in_.h, in_.w,
                     pad_ == 0 ? " valid" : pad_ * 2 + 1 == k_ ? "" : fmt::format(" pad {}", pad_));
}

template <class T>
void Conv2d<T>::init(Rng& rng) {
  he_init(p_, static_cast<size_t>(kk_ * cout_), kk_, rng);
  std::fill(p_ + kk_ * cout_, p_ + kk_ * cout_ + cout_, T(0));
}

// Row r = (ci, ky, kx) of the unfolded input holds, for every output pixel (b, oy, ox), the
// input value at (b, ci, oy + ky - pad, ox + kx - pad), or 0 outside the image.
template <class T>
void Conv2d<T>::im2col(const Mat<T>& x, int batch) {
  const int h = in_.h, w = in_.w, k = k_, ho = ho_, wo = wo_;
  const int64_t hw = int64_t{h} * w, n_in = batch * hw;
  const int64_t hwo = int64_t{ho} * wo, n = batch * hwo;
  cols_.resize(n, kk_);
  for (int64_t r = 0; r < kk_; ++r) {
    const int ci = static_cast<int>(r / (k * k));
    const int ky = static_cast<int>(r / k % k) - pad_;
    const int kx = static_cast<int>(r % k) - pad_;
    // Output columns [x0, x1) read input columns [x0 + kx, x1 + kx); the rest is padding.
    const int x0 = std::clamp(-kx, 0, wo), x1 = std::clamp(w - kx, x0, wo);
    T* dst = cols_.data() + r * n;
    const T* src = x.data() + ci * n_in;
    // Output rows [y0, y1) read input rows [y0 + ky, y1 + ky); the others are padding.
    const int y0 = std::clamp(-ky, 0, ho), y1 = std::clamp(h - ky, y0, ho);
    for (int b = 0; b < batch; ++b) {
      T* d = dst + b * hwo;
      std::fill(d, d + int64_t{y0} * wo, T(0));
      std::fill(d + int64_t{y1} * wo, d + hwo, T(0));
      if (y1 == y0) continue;
      const T* s = src + b * hw + int64_t{y0 + ky} * w;  // input row y0 + ky
      if (x0 == 0 && x1 == wo) {  // no padding columns in these rows (so kx >= 0)
        rows_op<false>(d + int64_t{y0} * wo, wo, s + kx, w, y1 - y0, wo);
        continue;
      }
      for (int yy = y0; yy < y1; ++yy) {
        T* dr = d + int64_t{yy} * wo;
        const T* sr = s + int64_t{yy - y0} * w;
        for (int xx = 0; xx < x0; ++xx) dr[xx] = T(0);
        for (int xx = x0; xx < x1; ++xx) dr[xx] = sr[xx + kx];
        for (int xx = x1; xx < wo; ++xx) dr[xx] = T(0);
      }
    }
  }
}

// The adjoint of im2col: every unfolded gradient value is added to the input pixel it was
// read from, in row order r = 0, 1, ... (a fixed summation order).
template <class T>
void Conv2d<T>::col2im(Mat<T>& dx, int batch, int b0, int b1) const {
  const int h = in_.h, w = in_.w, k = k_, ho = ho_, wo = wo_;
  const int64_t hw = int64_t{h} * w, n_in = batch * hw;
  const int64_t hwo = int64_t{ho} * wo, n = int64_t{b1 - b0} * hwo;
  for (int ci = 0; ci < in_.c; ++ci) {
    T* dst = dx.data() + ci * n_in + b0 * hw;
    for (int r = ci * k * k; r < (ci + 1) * k * k; ++r) {
      const int ky = r / k % k - pad_;
      const int kx = r % k - pad_;
      const int x0 = std::clamp(-kx, 0, wo), x1 = std::clamp(w - kx, x0, wo);
      const T* src = dcols_.data() + int64_t{r} * n;
      const int y0 = std::clamp(-ky, 0, ho), y1 = std::clamp(h - ky, y0, ho);
      if (y1 == y0) continue;
      for (int b = 0; b < b1 - b0; ++b) {
        const T* s = src + b * hwo + int64_t{y0} * wo;
        T* d = dst + b * hw + int64_t{y0 + ky} * w;  // input row y0 + ky
        if (x0 == 0 && x1 == wo) {
          rows_op<true>(d + kx, w, s, wo, y1 - y0, wo);
          continue;
        }
        for (int yy = y0; yy < y1; ++yy) {
          const T* sr = s + int64_t{yy - y0} * wo;
          T* dr = d + int64_t{yy - y0} * w;
          for (int xx = x0; xx < x1; ++xx) dr[xx + kx] += sr[xx];
        }
      }
    }
  }
}

template <class T>
bool Conv2d<T>::direct() const {
  return std::is_same_v<T, float> && direct_conv_available();
}

template <class T>
ConvGeometry Conv2d<T>::direct_geometry() const {
  return {in_.c, in_.h + 2 * pad_, in_.w + 2 * pad_, cout_, k_};
}

// Calls f(offset in the input's layout, offset in the padded copy's) for every row of every
// channel plane of `batch` samples: the padded copy's interior.
template <class T>
template <class F>
void Conv2d<T>::interior_rows(int batch, F f) const {
  const int h = in_.h, w = in_.w, hp = h + 2 * pad_, wp = w + 2 * pad_;
  const int64_t plane = int64_t{batch} * hp * wp, n_in = int64_t{batch} * h * w;
  for (int c = 0; c < in_.c; ++c)
    for (int b = 0; b < batch; ++b)
      for (int yy = 0; yy < h; ++yy)
        f(c * n_in + (int64_t{b} * h + yy) * w,
          c * plane + (int64_t{b} * hp + yy + pad_) * wp + pad_);
}

template <class T>
const T* Conv2d<T>::direct_input(const Mat<T>& x, int batch) {
  if (pad_ == 0) return x.data();
  const ConvGeometry g = direct_geometry();
  xpad_.assign(static_cast<size_t>(int64_t{batch} * g.h * g.w * in_.c), T(0));
  interior_rows(batch,
                [&](int64_t u, int64_t p) { std::copy_n(x.data() + u, in_.w, xpad_.data() + p); });
  return xpad_.data();
}

template <class T>
void Conv2d<T>::forward(const Mat<T>& x, Mat<T>& y, int batch) {
  const T* b = p_ + kk_ * cout_;
  if constexpr (std::is_same_v<T, float>) {
    if (direct()) {
      const float* xs = direct_input(x, batch);
      const ConvGeometry g = direct_geometry();
      const int64_t n = int64_t{batch} * ho_ * wo_;
      y.resize(n, cout_);
      conv_forward_direct(g, batch, xs, int64_t{batch} * g.h * g.w, p_, b, y.data(), n, ws_);
      return;
    }
  }
  im2col(x, batch);
  const int64_t n = cols_.rows();
  y.resize(n, cout_);
  for (int c = 0; c < cout_; ++c) std::fill_n(y.data() + c * n, n, b[c]);
  gemm(false, false, n, cout_, kk_, cols_.data(), n, p_, kk_, y.data(), n, true);
}

template <class T>
void Conv2d<T>::backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx,
                         int batch) {
  const int64_t n = dy.rows();
  // dwt = cols^T dy; db[c] = the sum of dy's column c; dcols = dy wt^T.
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (direct()) {  // on the input forward() saw (xpad_ still holds its padded copy)
      const ConvGeometry g = direct_geometry();
      const int64_t plane = int64_t{batch} * g.h * g.w;
      conv_weight_grad_direct(g, batch, pad_ == 0 ? x.data() : xpad_.data(), plane, dy.data(), n,
                              g_, ws_);
      if (dx != nullptr) {
        dx->resize(int64_t{batch} * in_.h * in_.w, in_.c);
        if (pad_ == 0) {
          conv_input_grad_direct(g, batch, dy.data(), n, p_, dx->data(), plane, ws_);
        } else {  // into the padded shape (xpad_ is free again), then its interior
          xpad_.resize(static_cast<size_t>(plane * in_.c));
          conv_input_grad_direct(g, batch, dy.data(), n, p_, xpad_.data(), plane, ws_);
          interior_rows(batch, [&](int64_t u, int64_t p) {
            std::copy_n(xpad_.data() + p, in_.w, dx->data() + u);
          });
        }
      }
      done = true;
    }
  }
  if (!done) gemm(true, false, kk_, cout_, n, cols_.data(), n, dy.data(), n, g_, kk_, false);
  for (int c = 0; c < cout_; ++c) g_[kk_ * cout_ + c] = fixed_order_sum(dy.data() + c * n, n);
  if (!done && dx != nullptr) {
    // dcols = dy wt^T and its col2im, a chunk of samples at a time: the chunk's dcols (about
    // 512 KiB) is still in the cache when col2im reads it. The chunk size depends on the
    // layer's shape only, so the results are as deterministic as with one chunk.
    const int64_t hwo = int64_t{ho_} * wo_;
    const int chunk = static_cast<int>(std::clamp<int64_t>((int64_t{1} << 17) / (hwo * kk_), 1, batch));
    dx->setZero(int64_t{batch} * in_.h * in_.w, in_.c);
    for (int b0 = 0; b0 < batch; b0 += chunk) {
      const int b1 = std::min(batch, b0 + chunk);
      const int64_t rows = (b1 - b0) * hwo;
      dcols_.resize(rows, kk_);
      gemm(false, true, rows, kk_, cout_, dy.data() + b0 * hwo, n, p_, kk_, dcols_.data(), rows,
           false);
      col2im(*dx, batch, b0, b1);
    }
  }
}

// ------------------------------------------------------------------------------- MaxPool2 --

#if defined(__AVX512F__)
namespace {
// MaxPool2's forward pass in float for even heights (the windows' row pairs are then every
// pair of rows of a channel plane, one after another): 16 windows at a time, the same
// candidates in the same order with the same strict comparison as the scalar loop, so the same
// values and the same argmax.
void maxpool2_forward_avx512(const float* src, float* dst, int32_t* am, int64_t row_pairs, int w) {
  const int w2 = w / 2;
  // Lane i takes element 2 i (and 2 i + 1) of the 32 read; 2 i is also window i's column.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t r = 0; r < row_pairs; ++r) {
    const float* top = src + r * 2 * w;
    const float* bottom = top + w;
    for (int x0 = 0; x0 < w2; x0 += 16) {
      const int nx = std::min(16, w2 - x0);
      const int lo_n = std::min(16, 2 * nx), hi_n = 2 * nx - lo_n;
      const __mmask16 lo = static_cast<__mmask16>((1u << lo_n) - 1);
      const __mmask16 hi = static_cast<__mmask16>((1u << hi_n) - 1);
      const __mmask16 out = static_cast<__mmask16>((1u << nx) - 1);
      const __m512 t0 = _mm512_maskz_loadu_ps(lo, top + 2 * x0);
      const __m512 t1 = _mm512_maskz_loadu_ps(hi, top + 2 * x0 + 16);
      const __m512 b0 = _mm512_maskz_loadu_ps(lo, bottom + 2 * x0);
      const __m512 b1 = _mm512_maskz_loadu_ps(hi, bottom + 2 * x0 + 16);
      const __m512 c[4] = {
          _mm512_permutex2var_ps(t0, even, t1), _mm512_permutex2var_ps(t0, odd, t1),
          _mm512_permutex2var_ps(b0, even, b1), _mm512_permutex2var_ps(b0, odd, b1)};
      const __m512i base =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(r * 2 * w + 2 * x0)), even);
      const __m512i off[4] = {base, _mm512_add_epi32(base, _mm512_set1_epi32(1)),
                              _mm512_add_epi32(base, _mm512_set1_epi32(w)),
                              _mm512_add_epi32(base, _mm512_set1_epi32(w + 1))};
      __m512 best = c[0];
      __m512i arg = off[0];
      for (int i = 1; i < 4; ++i) {
        const __mmask16 gt = _mm512_cmp_ps_mask(c[i], best, _CMP_GT_OQ);
        best = _mm512_mask_blend_ps(gt, best, c[i]);
        arg = _mm512_mask_blend_epi32(gt, arg, off[i]);
      }
      _mm512_mask_storeu_ps(dst + r * w2 + x0, out, best);
      _mm512_mask_storeu_epi32(am + r * w2 + x0, out, arg);
    }
  }
}
}  // namespace
#endif

template <class T>
void MaxPool2<T>::forward(const Mat<T>& x, Mat<T>& y, int batch) {
  const int h = in_.h, w = in_.w, h2 = h / 2, w2 = w / 2;
  const int64_t hw = int64_t{h} * w, hw2 = int64_t{h2} * w2, n2 = batch * hw2;
  y.resize(n2, in_.c);
  argmax_.resize(static_cast<size_t>(n2 * in_.c));
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (h % 2 == 0 && w2 > 0) {
      for (int c = 0; c < in_.c; ++c)
        maxpool2_forward_avx512(x.data() + c * x.rows(), y.data() + c * n2, argmax_.data() + c * n2,
                                int64_t{batch} * h2, w);
      return;
    }
  }
#endif
  for (int c = 0; c < in_.c; ++c) {
    const T* src = x.data() + c * x.rows();
    T* dst = y.data() + c * n2;
    int32_t* am = argmax_.data() + c * n2;
    for (int b = 0; b < batch; ++b) {
      for (int yy = 0; yy < h2; ++yy) {
        for (int xx = 0; xx < w2; ++xx) {
          int64_t best = b * hw + int64_t{2 * yy} * w + 2 * xx;
          const int64_t cand[3] = {best + 1, best + w, best + w + 1};
          for (int64_t q : cand)
            if (src[q] > src[best]) best = q;
          const int64_t o = b * hw2 + int64_t{yy} * w2 + xx;
          dst[o] = src[best];
          am[o] = static_cast<int32_t>(best);
        }
      }
    }
  }
}

template <class T>
void MaxPool2<T>::backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx,
                           int batch) {
  if (dx == nullptr) return;
  const int64_t n2 = dy.rows();
  const int h = in_.h, w = in_.w, h2 = h / 2, w2 = w / 2;
  if (h % 2 != 0 || w % 2 != 0) {  // rows or columns outside every window get zero
    dx->setZero(x.rows(), x.cols());
    for (int c = 0; c < in_.c; ++c) {
      const T* src = dy.data() + c * n2;
      T* dst = dx->data() + c * x.rows();
      const int32_t* am = argmax_.data() + c * n2;
      for (int64_t o = 0; o < n2; ++o) dst[am[o]] = src[o];
    }
    return;
  }
  // Windows tile the input: write each window once (zeros, then the max's gradient) instead
  // of clearing the whole buffer in a separate pass.
  dx->resize(x.rows(), x.cols());
  const int64_t hw = int64_t{h} * w;
  for (int c = 0; c < in_.c; ++c) {
    const T* src = dy.data() + c * n2;
    T* dst = dx->data() + c * x.rows();
    const int32_t* am = argmax_.data() + c * n2;
    for (int b = 0; b < batch; ++b) {
      for (int yy = 0; yy < h2; ++yy) {
        T* row = dst + b * hw + int64_t{2 * yy} * w;
        std::fill(row, row + 2 * w, T(0));
        const int64_t o = (int64_t{b} * h2 + yy) * w2;
        for (int xx = 0; xx < w2; ++xx) dst[am[o + xx]] = src[o + xx];
      }
    }
  }
}

// -------------------------------------------------------------------------------- Flatten --

template <class T>
void Flatten<T>::forward(const Mat<T>& x, Mat<T>& y, int batch) {
  const int64_t hw = int64_t{in_.h} * in_.w;
  y.resize(in_.size(), batch);
  for (int b = 0; b < batch; ++b)
    for (int c = 0; c < in_.c; ++c)
      std::copy_n(x.data() + c * x.rows() + b * hw, hw, y.data() + b * y.rows() + c * hw);
}

template <class T>
void Flatten<T>::backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx,
                          int batch) {
  if (dx == nullptr) return;
  const int64_t hw = int64_t{in_.h} * in_.w;
  dx->resize(x.rows(), x.cols());
  for (int b = 0; b < batch; ++b)
    for (int c = 0; c < in_.c; ++c)
      std::copy_n(dy.data() + b * dy.rows() + c * hw, hw, dx->data() + c * dx->rows() + b * hw);
}

// ------------------------------------------------------------------- softmax cross-entropy --

template <class T>
double softmax_cross_entropy(const Mat<T>& logits, const int32_t* labels, Mat<T>* dlogits,
                             int64_t* correct, T grad_scale) {
  const int64_t classes = logits.rows(), batch = logits.cols();
  if (dlogits != nullptr) dlogits->resize(classes, batch);
  const T inv_batch = grad_scale != T(0) ? grad_scale : T(1) / static_cast<T>(batch);
  double loss = 0.0;
  int64_t right = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const T* z = logits.data() + b * classes;
    int64_t arg = 0;
    for (int64_t c = 1; c < classes; ++c)
      if (z[c] > z[arg]) arg = c;
    const T m = z[arg];
    T sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(z[c] - m);
    const int32_t y = labels[b];
    loss += static_cast<double>(std::log(sum) - (z[y] - m));
    right += (arg == y);
    if (dlogits != nullptr) {
      T* d = dlogits->data() + b * classes;
      const T inv_sum = T(1) / sum;
      for (int64_t c = 0; c < classes; ++c) d[c] = std::exp(z[c] - m) * inv_sum * inv_batch;
      d[y] -= inv_batch;
    }
  }
  if (correct != nullptr) *correct += right;
  return loss;
}

// -------------------------------------------------------------------------------- Network --

template <class T>
void Network<T>::add(std::unique_ptr<Layer<T>> layer) {
  if (finalized_) throw UsageError("Network::add after finalize");
  layers_.push_back(std::move(layer));
}

template <class T>
void Network<T>::finalize() {
  if (finalized_) throw UsageError("Network::finalize called twice");
  if (layers_.empty()) throw UsageError("Network::finalize: no layers");
  if (current_shape().size() != classes_) {
    throw UsageError(fmt::format("Network: last layer has {} outputs, expected {} classes",
                                 current_shape().size(), classes_));
  }
  size_t total = 0;
  for (const auto& l : layers_) total += l->num_params();
  allocating(fmt::format("the model's {} parameters and their gradients", total),
             (2 * total + kSpareGrads) * sizeof(T), [&] {
               params_.assign(total, T(0));
               // Two spare elements after the gradients: the trainer puts the batch loss and
               // its stop flag there, so that they travel with the gradient in one all-reduce
               // without a copy.
               grads_.assign(total + kSpareGrads, T(0));
             });
  size_t off = 0;
  for (auto& l : layers_) {
    l->bind(params_.data() + off, grads_.data() + off);
    off += l->num_params();
  }
  auto lane = std::make_unique<Lane>();
  for (auto& l : layers_) lane->layers.push_back(l.get());
  lane->acts.resize(layers_.size() + 1);
  lane->dacts.resize(layers_.size() + 1);
  lanes_.push_back(std::move(lane));
  finalized_ = true;
}

template <class T>
void Network<T>::ensure_lanes(int n) {
  while (static_cast<int>(lanes_.size()) < n) {
    auto lane = std::make_unique<Lane>();
    lane->grads.assign(params_.size(), T(0));  // aligned like grads_: see AlignedVector
    size_t off = 0;
    for (const auto& l : layers_) {
      lane->owned.push_back(l->clone());
      lane->owned.back()->bind(params_.data() + off, lane->grads.data() + off);
      lane->layers.push_back(lane->owned.back().get());
      off += l->num_params();
    }
    lane->acts.resize(layers_.size() + 1);
    lane->dacts.resize(layers_.size() + 1);
    lanes_.push_back(std::move(lane));
  }
}

template <class T>
int Network<T>::lanes_for(int batch) const {
  return std::max(1, std::min(omp_get_max_threads(), batch / kMinLaneBatch));
}

template <class T>
std::string Network<T>::describe() const {
  std::string s;
  for (const auto& l : layers_) s += (s.empty() ? "" : ", ") + l->describe();
  return fmt::format("{} ({} parameters)", s, params_.size());
}

template <class T>
void Network<T>::init(uint64_t seed) {
  Rng rng(derive_seed(seed, 0x1417));
  for (auto& l : layers_) l->init(rng);
}

template <class T>
void Network<T>::check_batch(int batch) const {
  if (!finalized_) throw UsageError("Network used before finalize");
  if (batch < 1) throw UsageError(fmt::format("Network: batch {} < 1", batch));
}

template <class T>
const Mat<T>& Network<T>::forward_lane(Lane& lane, const T* x, int batch) {
  const int64_t hw = int64_t{input_.h} * input_.w;
  Mat<T>& in = lane.acts[0];
  if (lane.layers[0]->spatial_input()) {
    in.resize(batch * hw, input_.c);
    for (int b = 0; b < batch; ++b)  // sample-contiguous (b, c, y, x) to (c, b, y, x)
      for (int c = 0; c < input_.c; ++c)
        std::copy_n(x + (int64_t{b} * input_.c + c) * hw, hw, in.data() + c * in.rows() + b * hw);
  } else {
    in.resize(input_.size(), batch);
    std::copy_n(x, input_.size() * batch, in.data());
  }
  for (size_t i = 0; i < lane.layers.size(); ++i)
    lane.layers[i]->forward(lane.acts[i], lane.acts[i + 1], batch);
  return lane.acts.back();
}

template <class T>
double Network<T>::forward_backward(const T* x, const int32_t* labels, int batch) {
  check_batch(batch);
  const int nl = lanes_for(batch);
  ensure_lanes(nl);
  const int64_t in = input_.size();
  const int64_t n = static_cast<int64_t>(params_.size());
  const T scale = T(1) / static_cast<T>(batch);
#pragma omp parallel num_threads(nl)
  {
#pragma omp for schedule(static, 1)
    for (int k = 0; k < nl; ++k) {
      Lane& lane = *lanes_[k];
      const int b0 = static_cast<int>(int64_t{batch} * k / nl);
      const int b1 = static_cast<int>(int64_t{batch} * (k + 1) / nl);
      const Mat<T>& logits = forward_lane(lane, x + b0 * in, b1 - b0);
      lane.loss = softmax_cross_entropy<T>(logits, labels + b0, &lane.dacts.back(), nullptr, scale);
      for (size_t i = lane.layers.size(); i-- > 0;) {
        lane.layers[i]->backward(lane.acts[i], lane.acts[i + 1], lane.dacts[i + 1],
                                 i > 0 ? &lane.dacts[i] : nullptr, b1 - b0);
      }
    }
    if (nl > 1) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        T s = grads_[i];
        for (int k = 1; k < nl; ++k) s += lanes_[k]->grads[i];
        grads_[i] = s;
      }
    }
  }
  double loss = 0;
  for (int k = 0; k < nl; ++k) loss += lanes_[k]->loss;
  return loss / batch;
}

template <class T>
EvalResult Network<T>::evaluate(const T* x, const int32_t* labels, int batch) {
  check_batch(batch);
  const int nl = lanes_for(batch);
  ensure_lanes(nl);
  const int64_t in = input_.size();
#pragma omp parallel for num_threads(nl) schedule(static, 1)
  for (int k = 0; k < nl; ++k) {
    Lane& lane = *lanes_[k];
    const int b0 = static_cast<int>(int64_t{batch} * k / nl);
    const int b1 = static_cast<int>(int64_t{batch} * (k + 1) / nl);
    lane.correct = 0;
    lane.loss = softmax_cross_entropy<T>(forward_lane(lane, x + b0 * in, b1 - b0), labels + b0,
                                         nullptr, &lane.correct);
  }
  EvalResult r;
  for (int k = 0; k < nl; ++k) {
    r.loss_sum += lanes_[k]->loss;
    r.correct += lanes_[k]->correct;
  }
  r.count = batch;
  return r;
}

template <class T>
void Network<T>::predict(const T* x, int batch, int32_t* out) {
  check_batch(batch);
  const Mat<T>& logits = forward_lane(*lanes_[0], x, batch);
  for (int b = 0; b < batch; ++b) {
    Eigen::Index arg = 0;
    logits.col(b).maxCoeff(&arg);
    out[b] = static_cast<int32_t>(arg);
  }
}

template class Dense<float>;
template class Dense<double>;
template class Relu<float>;
template class Relu<double>;
template class Conv2d<float>;
template class Conv2d<double>;
template class MaxPool2<float>;
template class MaxPool2<double>;
template class Flatten<float>;
template class Flatten<double>;
template class Network<float>;
template class Network<double>;
template double softmax_cross_entropy<float>(const Mat<float>&, const int32_t*, Mat<float>*,
                                             int64_t*, float);
template double softmax_cross_entropy<double>(const Mat<double>&, const int32_t*, Mat<double>*,
                                              int64_t*, double);

}  // namespace qring::train
