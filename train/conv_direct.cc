#include "train/conv_direct.h"

#include <algorithm>
#include <stdexcept>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace qring::train {

#if defined(__AVX512F__)

bool direct_conv_available() {
  return true;
}

namespace {

constexpr int kLanes = 16;

// Per output group of V vectors (16 channels each), the pixels (forward) or weight rows
// (gradient) a register tile covers: V * tile accumulators plus V operands and a broadcast
// stay within the 32 vector registers.
constexpr int tile_for(int v) {
  return v == 4 ? 6 : v == 3 ? 8 : v == 2 ? 12 : 24;
}

int64_t padded_out(int cout) {
  return int64_t{(cout + kLanes - 1) / kLanes} * kLanes;
}

// Offsets of input pixel (oy, ox) for each output pixel p = oy * wo + ox of one sample, and of
// each weight row r = (ci, ky, kx) within the input.
void offsets(const ConvGeometry& g, int64_t x_plane, std::vector<int32_t>& pofs,
             std::vector<int64_t>& rofs) {
  const int ho = g.ho(), wo = g.wo(), k = g.k;
  pofs.resize(size_t(ho) * size_t(wo));
  for (int oy = 0; oy < ho; ++oy)
    for (int ox = 0; ox < wo; ++ox) pofs[size_t(oy * wo + ox)] = oy * g.w + ox;
  rofs.resize(size_t(g.kk()));
  for (int ci = 0; ci < g.cin; ++ci)
    for (int ky = 0; ky < k; ++ky)
      for (int kx = 0; kx < k; ++kx)
        rofs[size_t((ci * k + ky) * k + kx)] = ci * x_plane + int64_t{ky} * g.w + kx;
}

// The register tile both passes share: for k = 0, 1, ... (in order), N broadcasts of
// x[koff[k] + joff[j]] times V vectors of row k of m (ld floats apart) added into acc[j].
template <int V, int N, class KOff, class JOff>
void accumulate_tile(__m512 (&acc)[N][V], const float* x, const KOff* koff, int64_t count,
                     const JOff* joff, const float* m, int64_t ld) {
  for (int64_t k = 0; k < count; ++k) {
    __m512 mv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) mv[v] = _mm512_loadu_ps(m + k * ld + v * kLanes);
    const float* xk = x + koff[k];
#pragma GCC unroll 24
    for (int j = 0; j < N; ++j) {
      const __m512 bx = _mm512_set1_ps(xk[joff[j]]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(bx, mv[v], acc[j][v]);
    }
  }
}

// Forward: P output pixels (input offsets pix[0..P)) of one sample by V * 16 channels.
// acc = bias, then for r = 0, 1, ...: acc += w_t[r] * x[r's offset + pixel's].
template <int V, int P>
void forward_tile(const float* xb, const int64_t* rofs, int64_t kk, const int32_t* pix,
                  const float* wt, int64_t ldw, const float* bias, float* out) {
  __m512 acc[P][V];
#pragma GCC unroll 24
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_loadu_ps(bias + v * kLanes);
  accumulate_tile<V, P>(acc, xb, rofs, kk, pix, wt, ldw);
#pragma GCC unroll 24
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (j * V + v) * kLanes, acc[j][v]);
}

template <int V>
void forward_group(const ConvGeometry& g, int batch, const float* x, int64_t x_plane,
                   const std::vector<int64_t>& rofs, const std::vector<int32_t>& pofs,
                   const float* wt, int64_t ldw, const float* bias, int o0, float* y,
                   int64_t y_plane) {
  constexpr int P = tile_for(V);
  const int hwo = g.ho() * g.wo(), hw = g.h * g.w;
  const int oc = std::min(g.cout - o0, V * kLanes);
  alignas(64) float out[P * V * kLanes];
  int32_t pix[P];
  for (int b = 0; b < batch; ++b) {
    const float* xb = x + int64_t{b} * hw;
    for (int p0 = 0; p0 < hwo; p0 += P) {
      const int np = std::min(P, hwo - p0);
      for (int j = 0; j < P; ++j) pix[j] = pofs[size_t(p0 + std::min(j, np - 1))];
      forward_tile<V, P>(xb, rofs.data(), g.kk(), pix, wt, ldw, bias, out);
      for (int o = 0; o < oc; ++o) {
        float* yo = y + (o0 + o) * y_plane + int64_t{b} * hwo + p0;
        for (int j = 0; j < np; ++j) yo[j] = out[j * V * kLanes + o];
      }
    }
  }
}

// Weight gradient: R weight rows (input offsets rows[0..R)) by V * 16 channels, over the
// output pixels of one sample: acc (in dwt) += dy_t[pixel] * x[pixel's offset + row's].
template <int V, int R>
void grad_tile(const float* xb, const int64_t* rows, const int32_t* pofs, int hwo, const float* dyt,
               int64_t ldd, float* const* dwt) {
  __m512 acc[R][V];
#pragma GCC unroll 24
  for (int j = 0; j < R; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_loadu_ps(dwt[j] + v * kLanes);
  accumulate_tile<V, R>(acc, xb, pofs, hwo, rows, dyt, ldd);
  // A row repeated to fill the tile (the last block) is stored twice with the same value.
#pragma GCC unroll 24
  for (int j = 0; j < R; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(dwt[j] + v * kLanes, acc[j][v]);
}

template <int V>
void grad_group(const ConvGeometry& g, int batch, const float* x, const std::vector<int64_t>& rofs,
                const std::vector<int32_t>& pofs, const float* dyt, int64_t ldd, float* dwt,
                int64_t ldw) {
  constexpr int R = tile_for(V);
  const int hwo = g.ho() * g.wo(), hw = g.h * g.w;
  const int64_t kk = g.kk();
  int64_t rows[R];
  float* dst[R];
  for (int b = 0; b < batch; ++b) {
    const float* xb = x + int64_t{b} * hw;
    const float* dyb = dyt + int64_t{b} * hwo * ldd;
    for (int64_t r0 = 0; r0 < kk; r0 += R) {
      for (int j = 0; j < R; ++j) {
        const int64_t r = std::min<int64_t>(r0 + j, kk - 1);
        rows[j] = rofs[size_t(r)];
        dst[j] = dwt + r * ldw;
      }
      grad_tile<V, R>(xb, rows, pofs.data(), hwo, dyb, ldd, dst);
    }
  }
}

// Input gradient, a tile of P output pixels (consecutive in the chunk's copy of dy, from q) by
// T taps by V * 16 input channels: acc[t][j] = sum over o in order of dy[o][q + j] w[tap t][o].
// Several taps share each broadcast of dy when the channels fill fewer than 3 vectors.
template <int V, int P, int T>
void input_grad_tile(const float* dy, int64_t ld_dy, int cout, const float* const* wtap,
                     int64_t ldc, int64_t q, __m512 (&acc)[T][P][V]) {
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 12
    for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[t][j][v] = _mm512_setzero_ps();
  for (int o = 0; o < cout; ++o) {
    __m512 wv[T][V];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) wv[t][v] = _mm512_loadu_ps(wtap[t] + o * ldc + v * kLanes);
    const float* d = dy + o * ld_dy + q;
#pragma GCC unroll 12
    for (int j = 0; j < P; ++j) {
      const __m512 bx = _mm512_set1_ps(d[j]);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[t][j][v] = _mm512_fmadd_ps(bx, wv[t][v], acc[t][j][v]);
    }
  }
}

// Taps [t0, t0 + T) over one chunk: every tile's sums added into the dx rows they belong to.
template <int V, int P, int T>
void input_grad_taps(const ConvGeometry& g, int t0, const float* local, int64_t ld_local, int64_t n,
                     const std::vector<int64_t>& base, const float* wt, int64_t ldc, float* dxt) {
  __m512 acc[T][P][V];
  const float* wtap[T];
  int64_t shift[T];
  for (int t = 0; t < T; ++t) {
    wtap[t] = wt + int64_t{t0 + t} * g.cout * ldc;
    shift[t] = int64_t{(t0 + t) / g.k} * g.w + (t0 + t) % g.k;
  }
  for (int64_t i0 = 0; i0 < n; i0 += P) {
    // The last tile ends at the chunk's end (it recomputes pixels of the one before, which it
    // does not add again); a chunk smaller than a tile reads the copy's zero padding.
    const int64_t start = n >= P ? std::min<int64_t>(i0, n - P) : 0;
    const int first = int(i0 - start), last = int(std::min<int64_t>(P, n - start));
    input_grad_tile<V, P, T>(local, ld_local, g.cout, wtap, ldc, start, acc);
    for (int t = 0; t < T; ++t)
      for (int j = first; j < last; ++j) {
        float* row = dxt + (base[size_t(start + j)] + shift[t]) * ldc;
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v)
          _mm512_storeu_ps(row + v * kLanes,
                           _mm512_add_ps(_mm512_loadu_ps(row + v * kLanes), acc[t][j][v]));
      }
  }
}

template <int V>
void input_grad_group(const ConvGeometry& g, int batch, const float* dy, int64_t dy_plane,
                      const float* wt, int64_t ldc, float* dxt, ConvWorkspace& ws) {
  // Taps per tile and pixels per tile: (T * P + T) * V + 1 of the 32 vector registers.
  constexpr int T = V >= 3 ? 1 : V == 2 ? 2 : 4;
  constexpr int P = V == 3 ? 8 : 6;
  const int hwo = g.ho() * g.wo(), hw = g.h * g.w, taps = g.k * g.k;
  // A chunk of samples of about 256 output pixels: its dy and dx rows stay in the L2 cache
  // while all taps pass over them. Each dx value is the sum of its taps' products, added in
  // an order fixed by the geometry.
  const int chunk = std::max(1, 256 / hwo);
  std::vector<int64_t>& base = ws.base;  // dx row of output pixel i of the chunk, tap (0, 0)
  std::vector<float>& local = ws.local;
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int b1 = std::min(batch, b0 + chunk);
    const int64_t n = int64_t{b1 - b0} * hwo, q0 = int64_t{b0} * hwo;
    base.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = (q0 + i) / hwo, p = (q0 + i) % hwo;
      base[size_t(i)] = b * hw + (p / g.wo()) * g.w + p % g.wo();
    }
    // The chunk's dy, copied with a row stride that is not a multiple of 4 KiB (dy's planes
    // often are: their rows would share the L1 cache's sets) and zero-padded to a tile.
    const int64_t ld_local = std::max<int64_t>(n, P) + 16;
    local.assign(size_t(g.cout * ld_local), 0.0f);
    for (int o = 0; o < g.cout; ++o)
      std::copy_n(dy + o * dy_plane + q0, n, local.data() + o * ld_local);
    int t0 = 0;
    for (; t0 + T <= taps; t0 += T)
      input_grad_taps<V, P, T>(g, t0, local.data(), ld_local, n, base, wt, ldc, dxt);
    for (; t0 < taps; ++t0)
      input_grad_taps<V, P, 1>(g, t0, local.data(), ld_local, n, base, wt, ldc, dxt);
  }
}

}  // namespace

void conv_forward_direct(const ConvGeometry& g, int batch, const float* x, int64_t x_plane,
                         const float* weights, const float* bias, float* y, int64_t y_plane,
                         ConvWorkspace& ws) {
  const int64_t kk = g.kk(), ldw = padded_out(g.cout);
  // Weights transposed to rows r of the (padded) output channels, then the padded bias.
  ws.values.assign(size_t(kk * ldw + ldw), 0.0f);
  float* wt = ws.values.data();
  float* b = wt + kk * ldw;
  for (int o = 0; o < g.cout; ++o) {
    for (int64_t r = 0; r < kk; ++r) wt[r * ldw + o] = weights[o * kk + r];
    b[o] = bias[o];
  }
  std::vector<int32_t>& pofs = ws.pixels;
  std::vector<int64_t>& rofs = ws.rows;
  offsets(g, x_plane, pofs, rofs);
  for (int o0 = 0; o0 < g.cout; o0 += 4 * kLanes) {
    const int v = int(std::min<int64_t>(4, (g.cout - o0 + kLanes - 1) / kLanes));
    const float* wg = wt + o0;
    switch (v) {
      case 4:
        forward_group<4>(g, batch, x, x_plane, rofs, pofs, wg, ldw, b + o0, o0, y, y_plane);
        break;
      case 3:
        forward_group<3>(g, batch, x, x_plane, rofs, pofs, wg, ldw, b + o0, o0, y, y_plane);
        break;
      case 2:
        forward_group<2>(g, batch, x, x_plane, rofs, pofs, wg, ldw, b + o0, o0, y, y_plane);
        break;
      default:
        forward_group<1>(g, batch, x, x_plane, rofs, pofs, wg, ldw, b + o0, o0, y, y_plane);
    }
  }
}

void conv_weight_grad_direct(const ConvGeometry& g, int batch, const float* x, int64_t x_plane,
                             const float* dy, int64_t dy_plane, float* dw,
                             ConvWorkspace& ws) {
  const int64_t kk = g.kk(), ld = padded_out(g.cout);
  const int64_t n = int64_t{batch} * g.ho() * g.wo();
  // dy transposed to pixel-major rows of the padded channels, then the gradient's rows r.
  ws.values.resize(size_t(n * ld + kk * ld));
  float* dyt = ws.values.data();
  float* dwt = dyt + n * ld;
  std::fill(dwt, dwt + kk * ld, 0.0f);
  // A tile of 64 pixels at a time: its rows (64 x ld floats) stay in the L1 cache while every
  // channel's 64 values are written into them.
  constexpr int64_t kTile = 64;
  for (int64_t q0 = 0; q0 < n; q0 += kTile) {
    const int64_t q1 = std::min(n, q0 + kTile);
    for (int o = 0; o < g.cout; ++o) {
      const float* s = dy + o * dy_plane;
      for (int64_t q = q0; q < q1; ++q) dyt[q * ld + o] = s[q];
    }
    if (g.cout < ld)
      for (int64_t q = q0; q < q1; ++q) std::fill(dyt + q * ld + g.cout, dyt + (q + 1) * ld, 0.0f);
  }
  std::vector<int32_t>& pofs = ws.pixels;
  std::vector<int64_t>& rofs = ws.rows;
  offsets(g, x_plane, pofs, rofs);
  for (int o0 = 0; o0 < g.cout; o0 += 4 * kLanes) {
    const int v = int(std::min<int64_t>(4, (g.cout - o0 + kLanes - 1) / kLanes));
    switch (v) {
      case 4:
        grad_group<4>(g, batch, x, rofs, pofs, dyt + o0, ld, dwt + o0, ld);
        break;
      case 3:
        grad_group<3>(g, batch, x, rofs, pofs, dyt + o0, ld, dwt + o0, ld);
        break;
      case 2:
        grad_group<2>(g, batch, x, rofs, pofs, dyt + o0, ld, dwt + o0, ld);
        break;
      default:
        grad_group<1>(g, batch, x, rofs, pofs, dyt + o0, ld, dwt + o0, ld);
    }
  }
  for (int o = 0; o < g.cout; ++o)
    for (int64_t r = 0; r < kk; ++r) dw[o * kk + r] = dwt[r * ld + o];
}

void conv_input_grad_direct(const ConvGeometry& g, int batch, const float* dy, int64_t dy_plane,
                            const float* weights, float* dx, int64_t dx_plane,
                            ConvWorkspace& ws) {
  const int64_t ldc = padded_out(g.cin), kk = g.kk(), taps = int64_t{g.k} * g.k;
  const int64_t pixels = int64_t{batch} * g.h * g.w;
  // Weights as [tap][o][ci] (input channels padded), then dx as pixel-major rows of channels.
  ws.values.resize(size_t(taps * g.cout * ldc + pixels * ldc));
  float* wt = ws.values.data();
  float* dxt = wt + taps * g.cout * ldc;
  std::fill(wt, wt + taps * g.cout * ldc, 0.0f);
  for (int o = 0; o < g.cout; ++o)
    for (int ci = 0; ci < g.cin; ++ci)
      for (int64_t t = 0; t < taps; ++t)
        wt[(t * g.cout + o) * ldc + ci] = weights[o * kk + ci * taps + t];
  std::fill(dxt, dxt + pixels * ldc, 0.0f);
  for (int c0 = 0; c0 < g.cin; c0 += 4 * kLanes) {
    const int v = int(std::min<int64_t>(4, (g.cin - c0 + kLanes - 1) / kLanes));
    switch (v) {
      case 4:
        input_grad_group<4>(g, batch, dy, dy_plane, wt + c0, ldc, dxt + c0, ws);
        break;
      case 3:
        input_grad_group<3>(g, batch, dy, dy_plane, wt + c0, ldc, dxt + c0, ws);
        break;
      case 2:
        input_grad_group<2>(g, batch, dy, dy_plane, wt + c0, ldc, dxt + c0, ws);
        break;
      default:
        input_grad_group<1>(g, batch, dy, dy_plane, wt + c0, ldc, dxt + c0, ws);
    }
  }
  constexpr int64_t kTile = 64;
  for (int64_t q0 = 0; q0 < pixels; q0 += kTile) {
    const int64_t q1 = std::min(pixels, q0 + kTile);
    for (int ci = 0; ci < g.cin; ++ci) {
      float* d = dx + ci * dx_plane;
      for (int64_t q = q0; q < q1; ++q) d[q] = dxt[q * ldc + ci];
    }
  }
}

#else  // no AVX-512: Conv2d uses im2col + GEMM

bool direct_conv_available() {
  return false;
}

void conv_forward_direct(const ConvGeometry&, int, const float*, int64_t, const float*,
                         const float*, float*, int64_t, ConvWorkspace&) {
  throw std::logic_error("conv_forward_direct: not built (no AVX-512)");
}

void conv_weight_grad_direct(const ConvGeometry&, int, const float*, int64_t, const float*, int64_t,
                             float*, ConvWorkspace&) {
  throw std::logic_error("conv_weight_grad_direct: not built (no AVX-512)");
}

void conv_input_grad_direct(const ConvGeometry&, int, const float*, int64_t, const float*, float*,
                            int64_t, ConvWorkspace&) {
  throw std::logic_error("conv_input_grad_direct: not built (no AVX-512)");
}

#endif

}  // namespace qring::train
