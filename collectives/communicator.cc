#include "collectives/communicator.h"

#include <fmt/format.h>

#include <algorithm>

#include "collectives/engine.h"
#include "collectives/ring.h"

namespace qring::collectives {

Communicator::Communicator(std::unique_ptr<net::Endpoint> endpoint, CommOptions opts)
    : rank_(endpoint->rank()), size_(endpoint->world_size()), opts_(opts) {
  if (opts_.timeout.count() <= 0) throw UsageError("CommOptions.timeout must be > 0");
  engine_ = std::make_unique<Engine>(std::move(endpoint), opts_);
}

Communicator::~Communicator() = default;

std::string Communicator::provider() const {
  return engine_->provider();
}
bool Communicator::broken() const {
  return engine_->broken();
}

WorkPtr Communicator::submit(std::unique_ptr<EngineOp> op) {
  if (op->deadline == Deadline{}) op->deadline = Clock::now() + opts_.timeout;
  bool wake = !caller_drives_;
  caller_drives_ = false;
  return engine_->submit(std::move(op), wake);
}

namespace {
void check_buffers(const char* what, const void* send, const void* recv, size_t count) {
  if (count && (!send || !recv))
    throw UsageError(fmt::format("{}: null buffer for {} elements", what, count));
}
void check_members(const char* what, const std::vector<int>& m, int rank, int size) {
  if (m.empty()) return;
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i] < 0 || m[i] >= size || (i > 0 && m[i] <= m[i - 1]))
      throw UsageError(fmt::format("{}: members must be distinct ranks in [0, {}) in ascending "
                                   "order",
                                   what, size));
  if (!std::binary_search(m.begin(), m.end(), rank))
    throw UsageError(fmt::format("{}: rank {} is not among the members", what, rank));
}
}  // namespace

WorkPtr Communicator::allreduce_async(const void* send, void* recv, size_t count, DataType type,
                                      RedOp op, const std::vector<int>& members) {
  check_buffers("allreduce", send, recv, count);
  check_members("allreduce", members, rank_, size_);
  RingArgs a{RingKind::kAllreduce, send, recv, count, type, op, net::Op::kAllreduce, members};
  auto e = make_ring_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::allgather_async(const void* send, void* recv, size_t count, DataType type,
                                      const std::vector<int>& members) {
  check_buffers("allgather", send, recv, count);
  check_members("allgather", members, rank_, size_);
  RingArgs a{RingKind::kAllgather, send, recv, count, type, RedOp::kSum, net::Op::kAllgather,
             members};
  auto e = make_ring_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::reduce_scatter_async(const void* send, void* recv, size_t count,
                                           DataType type, RedOp op) {
  check_buffers("reduce_scatter", send, recv, count);
  RingArgs a{RingKind::kReduceScatter, send, recv, count, type, op, net::Op::kReduceScatter, {}};
  auto e = make_ring_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::broadcast_async(void* buf, size_t count, DataType type, int root) {
  if (root < 0 || root >= size_)
    throw UsageError(fmt::format("broadcast: root {} out of range [0, {})", root, size_));
  check_buffers("broadcast", buf, buf, count);
  auto e = make_broadcast_op(*engine_, opts_, buf, count, type, root);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::barrier_async() {
  auto e = make_barrier_op(*engine_);
  e->seq = next_seq();
  return submit(std::move(e));
}

void Communicator::register_buffer(const void* ptr, size_t bytes) {
  engine_->run([&](net::Endpoint& ep) { ep.register_memory(ptr, bytes); });
}

}  // namespace qring::collectives
