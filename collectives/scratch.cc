#include "collectives/scratch.h"

namespace qring::collectives {

ScratchPool::Lease ScratchPool::lease(net::Endpoint& ep, size_t bytes) {
  size_t best = free_.size();
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i]->size() >= bytes &&
        (best == free_.size() || free_[i]->size() < free_[best]->size()))
      best = i;
  }
  std::unique_ptr<std::vector<char>> buf;
  if (best < free_.size()) {
    buf = std::move(free_[best]);
    free_.erase(free_.begin() + static_cast<long>(best));
  } else {
    if (!free_.empty()) {
      buf = std::move(free_.back());
      free_.pop_back();
      ep.deregister_memory(buf->data());
    } else {
      buf = std::make_unique<std::vector<char>>();
    }
    buf->assign(bytes, 0);
    ep.register_memory(buf->data(), buf->size());
  }
  used_.push_back(std::move(buf));
  return Lease(this, used_.back().get());
}

ScratchPool::Lease::~Lease() {
  if (!buf_) return;
  auto& used = pool_->used_;
  for (auto it = used.begin(); it != used.end(); ++it) {
    if (it->get() == buf_) {
      pool_->free_.push_back(std::move(*it));
      used.erase(it);
      break;
    }
  }
}

}  // namespace qring::collectives
