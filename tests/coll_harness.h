// Shared helpers for collective tests: ranks as threads over the in-process endpoint, and
// inputs that depend on (index, rank) so misplaced data is caught bit-exactly.
#pragma once

#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/types.h"
#include "net/fault_endpoint.h"
#include "net/inproc_endpoint.h"

namespace qring::testing {

using collectives::CommOptions;
using collectives::Communicator;
using collectives::DataType;
using collectives::RedOp;

// Runs fn(comm) on `n` threads, one Communicator each; rethrows the first failure.
inline void run_ranks(int n, const CommOptions& opts, const std::function<void(Communicator&)>& fn,
                      const std::vector<net::FaultRule>& faults = {}) {
  net::InprocFabric fabric(n);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<net::Endpoint> ep = fabric.endpoint(r);
        if (!faults.empty()) ep = std::make_unique<net::FaultEndpoint>(std::move(ep), faults);
        Communicator comm(std::move(ep), opts);
        fn(comm);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Small integers: every sum over up to 8 ranks is exact in all types, bfloat16 included.
inline int pattern(size_t j, int r) {
  return int((j * 7 + size_t(r) * 13) % 17) - 8;
}

// Writes value v as element j of a buffer of `type`.
inline void put(void* buf, size_t j, DataType type, double v) {
  switch (type) {
    case DataType::kFloat32:
      static_cast<float*>(buf)[j] = float(v);
      break;
    case DataType::kFloat64:
      static_cast<double*>(buf)[j] = v;
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(buf)[j] = int32_t(v);
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(buf)[j] = int64_t(v);
      break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(buf)[j] = collectives::float_to_bf16(float(v));
      break;
  }
}

// Expected element j of the reduction of pattern(j, r) over `n` ranks, as raw bytes.
inline void expected(void* out, size_t j, DataType type, RedOp op, int n) {
  long sum = 0, mn = 1 << 30, mx = -(1 << 30);
  for (int r = 0; r < n; ++r) {
    long v = pattern(j, r);
    sum += v;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  long v = op == RedOp::kMin ? mn : op == RedOp::kMax ? mx : sum;
  if (op != RedOp::kAvg) {
    put(out, 0, type, double(v));
    return;
  }
  switch (type) {
    case DataType::kFloat32:
      *static_cast<float*>(out) = float(sum) / float(n);
      break;
    case DataType::kFloat64:
      *static_cast<double*>(out) = double(sum) / double(n);
      break;
    case DataType::kInt32:
      *static_cast<int32_t*>(out) = int32_t(sum) / n;
      break;
    case DataType::kInt64:
      *static_cast<int64_t*>(out) = int64_t(sum) / n;
      break;
    case DataType::kBFloat16:
      *static_cast<uint16_t*>(out) = collectives::float_to_bf16(float(sum) / float(n));
      break;
  }
}

// Number of elements of `buf` (count elements) that differ bit-wise from the reference.
inline size_t count_wrong(const void* buf, size_t count, DataType type, RedOp op, int n,
                          size_t index_offset = 0) {
  size_t esz = collectives::dtype_size(type), wrong = 0;
  char ref[8];
  for (size_t j = 0; j < count; ++j) {
    expected(ref, j + index_offset, type, op, n);
    if (std::memcmp(static_cast<const char*>(buf) + j * esz, ref, esz) != 0) ++wrong;
  }
  return wrong;
}

}  // namespace qring::testing
