#include "collectives/reduce.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "net/base/error.h"

namespace qring::collectives {

namespace {

constexpr size_t kParallelMin = size_t(1) << 18;  // elements; below this one thread wins

template <typename T, typename F>
void apply(T* __restrict dst, const T* a, const T* b, size_t n, F f, int threads) {
  if (threads > 1 && n >= kParallelMin) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
  } else {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
  }
}

template <typename T>
void reduce_typed(void* dst, const void* a, const void* b, size_t n, RedOp op, int threads) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      apply(
          d, x, y, n, [](T p, T q) { return T(p + q); }, threads);
      return;
    case RedOp::kMin:
      apply(
          d, x, y, n, [](T p, T q) { return q < p ? q : p; }, threads);
      return;
    case RedOp::kMax:
      apply(
          d, x, y, n, [](T p, T q) { return p < q ? q : p; }, threads);
      return;
  }
}

void reduce_bf16(void* dst, const void* a, const void* b, size_t n, RedOp op, int threads) {
  auto* d = static_cast<uint16_t*>(dst);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      apply(
          d, x, y, n,
          [](uint16_t p, uint16_t q) { return float_to_bf16(bf16_to_float(p) + bf16_to_float(q)); },
          threads);
      return;
    case RedOp::kMin:
      apply(
          d, x, y, n,
          [](uint16_t p, uint16_t q) { return bf16_to_float(q) < bf16_to_float(p) ? q : p; },
          threads);
      return;
    case RedOp::kMax:
      apply(
          d, x, y, n,
          [](uint16_t p, uint16_t q) { return bf16_to_float(p) < bf16_to_float(q) ? q : p; },
          threads);
      return;
  }
}

template <typename T>
void scale_typed(void* dst, size_t n, int divisor) {
  T* d = static_cast<T*>(dst);
  if constexpr (std::is_floating_point_v<T>) {
    // Divide (not multiply by the reciprocal): bit-equal to a reference that divides.
#pragma omp simd
    for (size_t i = 0; i < n; ++i) d[i] = d[i] / T(divisor);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = d[i] / T(divisor);
  }
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, size_t count, DataType type, RedOp op,
            int threads) {
  if (count == 0) return;
  switch (type) {
    case DataType::kFloat32:
      return reduce_typed<float>(dst, a, b, count, op, threads);
    case DataType::kFloat64:
      return reduce_typed<double>(dst, a, b, count, op, threads);
    case DataType::kInt32:
      return reduce_typed<int32_t>(dst, a, b, count, op, threads);
    case DataType::kInt64:
      return reduce_typed<int64_t>(dst, a, b, count, op, threads);
    case DataType::kBFloat16:
      return reduce_bf16(dst, a, b, count, op, threads);
  }
  throw UsageError("reduce: unknown data type");
}

void scale_avg(void* dst, size_t count, DataType type, int divisor) {
  if (divisor <= 1 || count == 0) return;
  switch (type) {
    case DataType::kFloat32:
      return scale_typed<float>(dst, count, divisor);
    case DataType::kFloat64:
      return scale_typed<double>(dst, count, divisor);
    case DataType::kInt32:
      return scale_typed<int32_t>(dst, count, divisor);
    case DataType::kInt64:
      return scale_typed<int64_t>(dst, count, divisor);
    case DataType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = float_to_bf16(bf16_to_float(d[i]) / float(divisor));
      return;
    }
  }
}

}  // namespace qring::collectives
