// Layers and a sequential network on Eigen, templated on the scalar type: float for training,
// double for gradient checks against finite differences.
//
// Activation layouts (Eigen column-major matrices):
//   flat     F x B          one column per sample (Dense, the softmax head)
//   spatial  (B*H*W) x C    one column per channel, each a contiguous plane over
//                           (sample, row, col); convolution is im2col + one GEMM per batch
// The network input is B samples of H*W*C floats, sample-contiguous: for C = 1 that memory is
// both the flat (H*W x B) and the spatial (B*H*W x 1) matrix, so no transpose is needed.
//
// All parameters live in one contiguous buffer and all gradients in another of the same size;
// each layer owns a slice [offset, offset + num_params()) of both, weights first, then biases.
// Weights use PyTorch's order: Dense [out][in] (row-major), Conv [out][in][ky][kx].
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/conv_direct.h"
#include "train/rng.h"

namespace qring::train {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

// Buffers that Eigen reads through Maps are aligned like Eigen's own matrices
// (EIGEN_MAX_ALIGN_BYTES, 64 with AVX-512). Eigen's kernels pick their code path by pointer
// alignment, so malloc's 16-byte alignment would make results depend on where a buffer
// happened to land: the same run twice, or a resumed run, would not be bit-identical.
template <class T>
using AlignedVector = std::vector<T, Eigen::aligned_allocator<T>>;

struct Shape {
  int c = 1, h = 1, w = 1;
  int64_t size() const { return int64_t{c} * h * w; }
};

template <class T>
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string describe() const = 0;
  virtual Shape out_shape() const = 0;
  virtual bool spatial_input() const = 0;  // input layout: spatial or flat
  // A new layer of the same kind and shape: no parameters bound, no workspaces.
  virtual std::unique_ptr<Layer<T>> clone() const = 0;
  virtual size_t num_params() const { return 0; }
  virtual void bind(T* params, T* grads) {}
  virtual void init(Rng& rng) {}
  virtual void forward(const Mat<T>& x, Mat<T>& y, int batch) = 0;
  // Given dy = dLoss/dy, overwrites this layer's parameter gradients and, when dx is not null,
  // writes dx = dLoss/dx. x and y are the values of the last forward call.
  virtual void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx,
                        int batch) = 0;
};

// y = W x + b on flat activations.
template <class T>
class Dense : public Layer<T> {
 public:
  Dense(int64_t in, int64_t out) : in_(in), out_(out) {}
  std::unique_ptr<Layer<T>> clone() const override { return std::make_unique<Dense<T>>(in_, out_); }
  std::string describe() const override;
  Shape out_shape() const override { return {static_cast<int>(out_), 1, 1}; }
  bool spatial_input() const override { return false; }
  size_t num_params() const override { return static_cast<size_t>(out_ * in_ + out_); }
  void bind(T* p, T* g) override { p_ = p, g_ = g; }
  void init(Rng& rng) override;
  void forward(const Mat<T>& x, Mat<T>& y, int batch) override;
  void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) override;

 private:
  int64_t in_, out_;
  T* p_ = nullptr;
  T* g_ = nullptr;
};

// Elementwise max(x, 0); keeps the layout of its input.
template <class T>
class Relu : public Layer<T> {
 public:
  Relu(Shape s, bool spatial) : s_(s), spatial_(spatial) {}
  std::unique_ptr<Layer<T>> clone() const override {
    return std::make_unique<Relu<T>>(s_, spatial_);
  }
  std::string describe() const override { return "relu"; }
  Shape out_shape() const override { return s_; }
  bool spatial_input() const override { return spatial_; }
  void forward(const Mat<T>& x, Mat<T>& y, int batch) override;
  void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) override;

 private:
  Shape s_;
  bool spatial_;
};

// 2-D convolution, stride 1, `pad` zeros on every side, on spatial activations: the output is
// (H + 2 pad - k + 1) x (W + 2 pad - k + 1). pad = k / 2 with k odd is "same" padding (the
// output has the input's size), pad = 0 is "valid" (PyTorch's default, padding=0).
template <class T>
class Conv2d : public Layer<T> {
 public:
  // Throws UsageError when the output would be empty.
  Conv2d(Shape in, int out_channels, int kernel, int pad);
  Conv2d(Shape in, int out_channels, int kernel) : Conv2d(in, out_channels, kernel, kernel / 2) {}
  std::unique_ptr<Layer<T>> clone() const override {
    return std::make_unique<Conv2d<T>>(in_, cout_, k_, pad_);
  }
  std::string describe() const override;
  Shape out_shape() const override { return {cout_, ho_, wo_}; }
  bool spatial_input() const override { return true; }
  size_t num_params() const override { return static_cast<size_t>(kk_ * cout_ + cout_); }
  void bind(T* p, T* g) override { p_ = p, g_ = g; }
  void init(Rng& rng) override;
  void forward(const Mat<T>& x, Mat<T>& y, int batch) override;
  void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) override;

 private:
  void im2col(const Mat<T>& x, int batch);
  // Adds the unfolded gradient dcols_ of samples [b0, b1) into dx (zeroed by the caller).
  void col2im(Mat<T>& dx, int batch, int b0, int b1) const;
  Shape in_;
  int cout_, k_, pad_;
  int ho_, wo_;  // output rows and columns
  int64_t kk_;   // Cin * k * k
  T* p_ = nullptr;
  T* g_ = nullptr;
  // Float with AVX-512 (train/conv_direct.h): the forward pass and the weight gradient run
  // directly on the input (its zero-padded copy xpad_ when pad > 0), without cols_.
  bool direct() const;
  ConvGeometry direct_geometry() const;               // the (padded) input the kernels see
  const T* direct_input(const Mat<T>& x, int batch);  // x, or xpad_ filled from x
  template <class F>
  void interior_rows(int batch, F f) const;
  Mat<T> cols_;   // (B*Ho*Wo) x (Cin*k*k)
  Mat<T> dcols_;  // (chunk*Ho*Wo) x (Cin*k*k): the unfolded dx of a chunk of samples
  std::vector<T> xpad_;
  ConvWorkspace ws_;
};

// 2x2 max pooling, stride 2 (odd sizes are floored), on spatial activations.
template <class T>
class MaxPool2 : public Layer<T> {
 public:
  explicit MaxPool2(Shape in) : in_(in) {}
  std::unique_ptr<Layer<T>> clone() const override { return std::make_unique<MaxPool2<T>>(in_); }
  std::string describe() const override { return "maxpool2"; }
  Shape out_shape() const override { return {in_.c, in_.h / 2, in_.w / 2}; }
  bool spatial_input() const override { return true; }
  void forward(const Mat<T>& x, Mat<T>& y, int batch) override;
  void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) override;

 private:
  Shape in_;
  std::vector<int32_t> argmax_;  // per output element: row of the max within its channel
};

// Spatial (B*H*W) x C to flat (C*H*W) x B, feature order (c, y, x) as in PyTorch's flatten.
template <class T>
class Flatten : public Layer<T> {
 public:
  explicit Flatten(Shape in) : in_(in) {}
  std::unique_ptr<Layer<T>> clone() const override { return std::make_unique<Flatten<T>>(in_); }
  std::string describe() const override { return "flatten"; }
  Shape out_shape() const override { return {static_cast<int>(in_.size()), 1, 1}; }
  bool spatial_input() const override { return true; }
  void forward(const Mat<T>& x, Mat<T>& y, int batch) override;
  void backward(const Mat<T>& x, const Mat<T>& y, const Mat<T>& dy, Mat<T>* dx, int batch) override;

 private:
  Shape in_;
};

struct EvalResult {
  double loss_sum = 0.0;  // sum over samples of the cross-entropy
  int64_t correct = 0;
  int64_t count = 0;
};

// Numerically stable softmax cross-entropy on logits (classes x B). Returns the summed loss;
// if dlogits is not null, writes grad_scale * d(summed loss)/d(logits) =
// grad_scale * (softmax - onehot), grad_scale defaulting (0) to 1/B, the gradient of the mean.
// Counts correct argmax predictions into *correct when not null.
template <class T>
double softmax_cross_entropy(const Mat<T>& logits, const int32_t* labels, Mat<T>* dlogits,
                             int64_t* correct, T grad_scale = T(0));

// A sequential network ending in softmax cross-entropy.
//
// Threads: a batch is split into up to omp_get_max_threads() contiguous lanes of at least
// kMinLaneBatch samples; each lane runs forward and backward on its own copy of the layers
// (sharing the parameters, with its own gradient buffer and workspaces) in one OpenMP parallel
// region, and the lane gradients are summed in lane order. With one lane, Eigen's own GEMM
// threading applies. Results are deterministic for a given thread count and batch size.
template <class T>
class Network {
 public:
  static constexpr int kMinLaneBatch = 16;

  Network(Shape input, int num_classes) : input_(input), classes_(num_classes) {}
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  // Appends a layer (before finalize); its input shape must be the current output shape.
  void add(std::unique_ptr<Layer<T>> layer);
  // Allocates the parameter and gradient buffers and binds the layers to their slices.
  void finalize();

  Shape input_shape() const { return input_; }
  Shape current_shape() const { return layers_.empty() ? input_ : layers_.back()->out_shape(); }
  int num_classes() const { return classes_; }
  size_t num_params() const { return params_.size(); }
  T* params() { return params_.data(); }
  const T* params() const { return params_.data(); }
  // num_params() gradients, followed by kSpareGrads spare elements the caller may use.
  static constexpr size_t kSpareGrads = 2;
  T* grads() { return grads_.data(); }
  const T* grads() const { return grads_.data(); }
  const std::vector<std::unique_ptr<Layer<T>>>& layers() const { return layers_; }
  std::string describe() const;

  // He-normal weights (std = sqrt(2 / fan_in)), zero biases, from the seed alone.
  void init(uint64_t seed);

  // x: batch samples of input_shape().size() values each, sample-contiguous. Returns the mean
  // cross-entropy and overwrites grads() with its gradient.
  double forward_backward(const T* x, const int32_t* labels, int batch);
  // Forward only.
  EvalResult evaluate(const T* x, const int32_t* labels, int batch);
  void predict(const T* x, int batch, int32_t* out);

  // How many lanes a batch of this size is split into with the current thread count.
  int lanes_for(int batch) const;

 private:
  struct Lane {
    std::vector<Layer<T>*> layers;  // lane 0: layers_; others: owned below
    std::vector<std::unique_ptr<Layer<T>>> owned;
    AlignedVector<T> grads;     // lanes > 0 (lane 0 uses grads_)
    std::vector<Mat<T>> acts;   // acts[0] = input, acts[i+1] = output of layer i
    std::vector<Mat<T>> dacts;  // gradients of acts
    double loss = 0;
    int64_t correct = 0;
  };
  void check_batch(int batch) const;
  void ensure_lanes(int n);
  const Mat<T>& forward_lane(Lane& lane, const T* x, int batch);
  Shape input_;
  int classes_;
  bool finalized_ = false;
  std::vector<std::unique_ptr<Layer<T>>> layers_;
  AlignedVector<T> params_;
  AlignedVector<T> grads_;
  std::vector<std::unique_ptr<Lane>> lanes_;
};

extern template class Dense<float>;
extern template class Dense<double>;
extern template class Relu<float>;
extern template class Relu<double>;
extern template class Conv2d<float>;
extern template class Conv2d<double>;
extern template class MaxPool2<float>;
extern template class MaxPool2<double>;
extern template class Flatten<float>;
extern template class Flatten<double>;
extern template class Network<float>;
extern template class Network<double>;

}  // namespace qring::train
