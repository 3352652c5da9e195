// The barrier as an engine operation (make_barrier_op, algorithms.h): ceil(log2 n) rounds of
// empty messages.
#include <fmt/format.h>

#include "collectives/algorithms.h"
#include "collectives/shape.h"
#include "net/base/error.h"

namespace qring::collectives {

namespace {

// Dissemination barrier: in round k every rank signals r + 2^k and waits for r - 2^k.
class BarrierOp final : public EngineOp {
 public:
  explicit BarrierOp(Engine& engine) : n_(engine.size()), r_(engine.rank()) {
    Shape sh;
    sh.kind = net::Op::kBarrier;
    sh.algo = Algo::kDissemination;
    shape_ = encode_shape(sh);
  }
  std::string name() const override { return "barrier"; }
  uint64_t shape() const override { return shape_; }
  void start(net::Endpoint& ep) override {
    if (n_ == 1) {
      done_ = true;
      return;
    }
    post(ep);
  }
  bool advance(net::Endpoint& ep) override {
    if (done_) return false;
    if (!recv_->done() || !send_->done()) return false;
    check_message(*recv_, shape_, ep.data_bytes(), r_, name(), seq, ring_index(r_ - dist_, n_));
    net::throw_if_failed(*send_, "barrier");
    dist_ *= 2;
    ++round_;
    if (dist_ >= n_)
      done_ = true;
    else
      post(ep);
    return true;
  }
  bool finished() const override { return done_; }
  void abort(net::Endpoint& ep) override {
    if (recv_ && !recv_->done()) ep.cancel(recv_);
  }
  std::string waiting_on() const override {
    return fmt::format("signal from rank {} (round {})", ring_index(r_ - dist_, n_), round_);
  }

 private:
  void post(net::Endpoint& ep) {
    uint64_t tag = net::make_tag(net::Op::kBarrier, seq, round_);
    recv_ = ep.irecv(ring_index(r_ - dist_, n_), tag, nullptr, 0);
    send_ = ep.isend(ring_index(r_ + dist_, n_), tag, nullptr, 0, shape_);
  }
  int n_, r_;
  int dist_ = 1, round_ = 0;
  net::RequestPtr recv_, send_;
  uint64_t shape_ = 0;
  bool done_ = false;
};

}  // namespace

std::unique_ptr<EngineOp> make_barrier_op(Engine& engine) {
  return std::make_unique<BarrierOp>(engine);
}

}  // namespace qring::collectives
