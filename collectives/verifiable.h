// Inputs that catch misplaced data, and their bit-exact checks: the data of qring-bench,
// qring-mpi-bench and the collective tests (gloo's Fixture::assignValues, nccl-tests'
// verifiable/). Header-only, so that qring-mpi-bench uses it without linking qring.
//
// Element j of rank r's input is pattern(j, r) = ((7j + 13r) mod 17) - 8, a small integer, so
// sums over up to 32 ranks are exact in every type (bfloat16 included) and a result can be
// compared bit for bit with the expectation computed here, the way the implementations
// compute it: exact integer sum, min or max; avg = the sum divided by the number of ranks
// in the type's own arithmetic (integers truncate; bfloat16 divides in float32 and rounds to
// nearest even).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives/types.h"

namespace qring::verifiable {

using collectives::DataType;
using collectives::RedOp;

inline int pattern(size_t j, int r) {
  return int((j * 7 + size_t(r) * 13) % 17) - 8;
}
constexpr size_t kPatternPeriod = 17;  // pattern(j, r) depends on j only through j mod 17

// Writes value v (a small integer) as type t at element i of buf.
inline void store_value(void* buf, DataType t, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32:
      static_cast<float*>(buf)[i] = float(v);
      break;
    case DataType::kFloat64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(buf)[i] = int32_t(v);
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(buf)[i] = int64_t(v);
      break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = collectives::float_to_bf16(float(v));
      break;
  }
}

// Element i of buf (type t) as a double.
inline double load_value(const void* buf, DataType t, size_t i) {
  switch (t) {
    case DataType::kFloat32:
      return static_cast<const float*>(buf)[i];
    case DataType::kFloat64:
      return static_cast<const double*>(buf)[i];
    case DataType::kInt32:
      return static_cast<const int32_t*>(buf)[i];
    case DataType::kInt64:
      return double(static_cast<const int64_t*>(buf)[i]);
    case DataType::kBFloat16:
      return collectives::bf16_to_float(static_cast<const uint16_t*>(buf)[i]);
  }
  return 0;
}

// buf[i] = pattern(first + i, rank) for i in [0, count). The first period element by element,
// then copies of what is written, doubling: the pattern repeats every kPatternPeriod elements,
// so whole periods copied further on continue it. At memory speed: the benchmarks refill
// their buffers every step, and on ranks that share cores an element-by-element loop took a
// quarter of the quorum benchmark's CPU at 1 MiB, its speed shifting with where the linker
// placed the loop (the same function 1.35x slower in one build than in another).
inline void fill_pattern(void* buf, DataType t, size_t count, size_t first, int rank) {
  const size_t ts = collectives::dtype_size(t);
  alignas(8) unsigned char enc[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) store_value(enc[k], t, 0, pattern(k, rank));
  auto* p = static_cast<unsigned char*>(buf);
  const size_t head = std::min(count, kPatternPeriod);
  size_t k = first % kPatternPeriod;
  for (size_t i = 0; i < head; ++i) {
    std::memcpy(p + i * ts, enc[k], ts);
    if (++k == kPatternPeriod) k = 0;
  }
  for (size_t done = head; done < count;) {  // done: a whole number of periods
    const size_t n = std::min(done, count - done);
    std::memcpy(p + done * ts, p, n * ts);
    done += n;
  }
}

// Bytes that decode as wrong values in every type.
inline void fill_garbage(void* buf, size_t bytes) {
  std::memset(buf, 0xA5, bytes);
}

// The expected reduction of pattern(j, r) over the ranks `ranks`, encoded as type t into
// `out` exactly the way the implementations compute it (see the top of this file).
inline void expected_reduced(size_t j, const std::vector<int>& ranks, RedOp op, DataType t,
                             void* out) {
  int64_t sum = 0, mn = INT64_MAX, mx = INT64_MIN;
  for (int r : ranks) {
    int64_t v = pattern(j, r);
    sum += v;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  const int64_t n = int64_t(ranks.size());
  int64_t v = op == RedOp::kMin ? mn : op == RedOp::kMax ? mx : sum;
  if (op != RedOp::kAvg) {
    store_value(out, t, 0, double(v));
    return;
  }
  switch (t) {
    case DataType::kFloat32:
      *static_cast<float*>(out) = float(sum) / float(n);
      break;
    case DataType::kFloat64:
      *static_cast<double*>(out) = double(sum) / double(n);
      break;
    case DataType::kInt32:
      *static_cast<int32_t*>(out) = int32_t(sum / n);
      break;
    case DataType::kInt64:
      *static_cast<int64_t*>(out) = sum / n;
      break;
    case DataType::kBFloat16:
      *static_cast<uint16_t*>(out) = collectives::float_to_bf16(float(sum) / float(n));
      break;
  }
}

// Ranks 0 .. n-1.
inline std::vector<int> first_ranks(int n) {
  std::vector<int> v(size_t(std::max(n, 0)));
  for (int r = 0; r < n; ++r) v[size_t(r)] = r;
  return v;
}

// Elements i in [0, count) of buf that differ from the encoded values want[(first + i) % 17].
inline int64_t count_mismatches(const void* buf, size_t ts, size_t count, size_t first,
                                const unsigned char (&want)[kPatternPeriod][8]) {
  int64_t wrong = 0;
  const auto* p = static_cast<const unsigned char*>(buf);
  size_t k = first % kPatternPeriod;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(p + i * ts, want[k], ts) != 0) ++wrong;
    if (++k == kPatternPeriod) k = 0;
  }
  return wrong;
}

// Elements i in [0, count) where buf[i] != reduction over `ranks` of pattern(first + i, .).
inline int64_t count_wrong_reduced(const void* buf, DataType t, size_t count, size_t first,
                                   const std::vector<int>& ranks, RedOp op) {
  alignas(8) unsigned char want[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) expected_reduced(k, ranks, op, t, want[k]);
  return count_mismatches(buf, collectives::dtype_size(t), count, first, want);
}
// The same over ranks 0 .. n-1.
inline int64_t count_wrong_reduced(const void* buf, DataType t, size_t count, size_t first, int n,
                                   RedOp op) {
  return count_wrong_reduced(buf, t, count, first, first_ranks(n), op);
}

// Elements i in [0, count) where buf[i] != pattern(first + i, src).
inline int64_t count_wrong_pattern(const void* buf, DataType t, size_t count, size_t first,
                                   int src) {
  alignas(8) unsigned char want[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) store_value(want[k], t, 0, pattern(k, src));
  return count_mismatches(buf, collectives::dtype_size(t), count, first, want);
}

}  // namespace qring::verifiable
