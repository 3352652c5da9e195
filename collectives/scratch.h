// Scratch memory of an engine, reused (and registered with the transport once) across
// operations: the in-place ring's receive slots, halving-doubling's halves, reduce-scatter's
// full buffer. Engine thread only; a lease gives its buffer back to the pool when destroyed.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "net/transport/endpoint.h"

namespace qring::collectives {

class ScratchPool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(ScratchPool* pool, std::vector<char>* b) : pool_(pool), buf_(b) {}
    Lease(Lease&& o) noexcept : pool_(o.pool_), buf_(o.buf_) { o.buf_ = nullptr; }
    Lease& operator=(Lease&& o) noexcept {
      std::swap(pool_, o.pool_);
      std::swap(buf_, o.buf_);
      return *this;
    }
    ~Lease();
    char* data() const { return buf_ ? buf_->data() : nullptr; }

   private:
    ScratchPool* pool_ = nullptr;
    std::vector<char>* buf_ = nullptr;
  };
  // At least `bytes`: the best fitting free buffer, else the largest free one grown, else a
  // new one; registered with `ep`.
  Lease lease(net::Endpoint& ep, size_t bytes);

 private:
  std::vector<std::unique_ptr<std::vector<char>>> free_;
  std::vector<std::unique_ptr<std::vector<char>>> used_;
};

}  // namespace qring::collectives
