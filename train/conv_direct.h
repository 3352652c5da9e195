// Direct float convolutions (issue 17): the forward pass, the weight gradient and the input
// gradient of a stride-1 convolution computed from the activations in place, without the
// unfolded (im2col) matrix and without the BLAS's packing of it, which together were a fifth
// of a PyTorch-CNN step
// (docs/benchmarks.md). Built with AVX-512 (a -march that has it,
// the default native build on such a CPU); elsewhere direct_conv_available() is false and Conv2d
// keeps im2col + GEMM.
//
// Layouts are Conv2d's (train/nn.h): activations channel-major, x[c][b][y][x]; outputs
// y[o][b][oy][ox]; weights w[o][r] with r = (ci * k + ky) * k + kx. The input is "valid"
// (no padding; Conv2d pads a copy first when it has padding).
//
// Determinism: each output is its bias plus the products summed over r = 0, 1, ... in order;
// each weight gradient is the products summed over the samples and output pixels in order.
// Nothing depends on alignment, so a resumed run and every replica get the same bits.
#pragma once

#include <cstdint>
#include <vector>

namespace qring::train {

struct ConvGeometry {
  int cin = 0, h = 0, w = 0;  // input planes (already padded)
  int cout = 0, k = 0;
  int ho() const { return h - k + 1; }
  int wo() const { return w - k + 1; }
  int64_t kk() const { return int64_t{cin} * k * k; }
};

bool direct_conv_available();

// What the kernels keep between calls (a layer owns one): a step allocates nothing once the
// shapes are stable.
struct ConvWorkspace {
  std::vector<float> values;   // transposed weights or gradients, accumulators
  std::vector<float> local;    // the input gradient's copy of a chunk of dy
  std::vector<int32_t> pixels; // input offset of each output pixel of a sample
  std::vector<int64_t> rows;   // input offset of each weight row (ci, ky, kx)
  std::vector<int64_t> base;   // the input gradient's dx row of each pixel of a chunk
};

// y[o][b][p] = bias[o] + sum over r of w[o][r] x[...]; x holds `batch` samples per channel
// plane (x_plane = batch * h * w floats apart), y likewise (y_plane = batch * ho * wo).
void conv_forward_direct(const ConvGeometry& g, int batch, const float* x, int64_t x_plane,
                         const float* weights, const float* bias, float* y, int64_t y_plane,
                         ConvWorkspace& ws);

// dw[o][r] = sum over samples b and output pixels p of dy[o][b][p] x[ci][b][p + (ky, kx)];
// dy_plane = batch * ho * wo floats between output channels.
void conv_weight_grad_direct(const ConvGeometry& g, int batch, const float* x, int64_t x_plane,
                             const float* dy, int64_t dy_plane, float* dw,
                             ConvWorkspace& ws);

// dx[ci][b][iy][ix] = the sum over the taps (ky, kx) whose output pixel exists of (the sum over
// o in order of dy[o][b][iy - ky][ix - kx] w[o][ci][ky][kx]), the taps added in an order fixed
// by the geometry; dx has the (padded) input's shape, dx_plane = batch * h * w floats between
// input channels.
void conv_input_grad_direct(const ConvGeometry& g, int batch, const float* dy, int64_t dy_plane,
                            const float* weights, float* dx, int64_t dx_plane,
                            ConvWorkspace& ws);

}  // namespace qring::train
