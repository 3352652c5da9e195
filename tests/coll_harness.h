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
#include "collectives/verifiable.h"
#include "net/transport/fault_endpoint.h"
#include "net/transport/inproc_endpoint.h"

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

// Test data and its checks are the benchmark's too (collectives/verifiable.h): pattern(j, r)
// is a small integer, so every sum over up to 32 ranks is exact in all types, bfloat16
// included.
using verifiable::pattern;

// Writes value v as element j of a buffer of `type`.
inline void put(void* buf, size_t j, DataType type, double v) {
  verifiable::store_value(buf, type, j, v);
}

// Number of elements of `buf` (count elements) that differ bit-wise from the reduction of
// pattern(j + index_offset, r) over `n` ranks.
inline size_t count_wrong(const void* buf, size_t count, DataType type, RedOp op, int n,
                          size_t index_offset = 0) {
  return size_t(verifiable::count_wrong_reduced(buf, type, count, index_offset, n, op));
}

}  // namespace qring::testing
