// The compute kernels under train/nn.cc: matrix products, bias sums, and what they run on.
//
// Products of float matrices go to an optimized BLAS (OpenBLAS: it picks its AVX-512 / AVX2 /
// SSE kernels for the CPU at run time), always called single-threaded: the network runs one
// product per OpenMP lane, so the thread count and the split of a batch into lanes are the
// only parallelism, and both are fixed by OMP_NUM_THREADS and the batch size. Products of
// double matrices (the gradient checks) use Eigen.
//
// Determinism: for a given kernel ISA (kernel_isa()), thread count and batch size every kernel
// here gives the same bits on every call, whatever the alignment of its buffers. That is what
// makes a resumed run and every replica of a step bit-identical to a straight run. (Eigen's own
// vectorized reductions do not have that property: they peel the unaligned head of a
// destination in scalar code, so the rows summed in scalar order and the rows summed in packet
// order depend on where the buffer landed; with 32- or 64-byte packets and 16-byte-aligned
// heap buffers, that made -march=native runs differ after a restore. No Eigen reduction is
// used in the float path.)
//
// Different ISAs (another CPU, another build) round differently: the ranks of a job compare
// kernel_isa() at start (train/trainer.cc) and refuse to mix.
#pragma once

#include <cstdint>
#include <string>

namespace qring::train {

// C (m x n, column-major, leading dimension ldc) = op(A) op(B), or C += op(A) op(B) when
// `accumulate`; op(A) is m x k (A stored k x m when trans_a), op(B) is k x n (B stored n x k
// when trans_b); all column-major with leading dimensions lda, ldb.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a,
          int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc, bool accumulate);

// out[i] = sum over j of x[i + j * ld] for i < rows, j < cols (the row sums of a column-major
// rows x cols matrix), each summed in order j = 0, 1, ...
template <class T>
void row_sums(const T* x, int64_t rows, int64_t cols, int64_t ld, T* out);

// The sum of x[0..n) in a fixed order that does not depend on alignment or ISA: 16 running
// sums over x[16 i + l], combined pairwise, then the tail in order.
template <class T>
T fixed_order_sum(const T* x, int64_t n);

// What the float kernels run on, e.g. "vector avx512f+fma (Eigen AVX512), conv direct, blas
// OpenBLAS 0.3.21 ... Cooperlake": the compile-time vector ISA, how convolutions run (direct
// kernels, train/conv_direct.h, or im2col + GEMM) and the BLAS library with the kernel set it
// chose for this CPU. Ranks whose strings differ would not compute the same bits.
const std::string& kernel_isa();

}  // namespace qring::train
