#include "collectives/param_server.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/engine.h"
#include "net/transport/tags.h"

namespace qring::collectives {

namespace {

constexpr uint32_t kMagic = 0x53504751;  // "QGPS"
constexpr uint16_t kWire = 1;
enum Kind : uint16_t { kPushHeader = 0, kPushData = 1, kAnswerHeader = 2, kAnswerData = 3 };

struct Header {
  uint32_t magic = kMagic;
  uint16_t wire = kWire;
  uint16_t kind = 0;
  uint32_t rank = 0;
  uint32_t pad = 0;
  uint64_t index = 0;
  uint64_t version = 0;
  uint64_t count = 0;
};
static_assert(sizeof(Header) == 40);

uint64_t tag(uint64_t index, Kind k) {
  return net::make_tag(net::Op::kParamServer, index, uint64_t(k));
}

using Buffer = std::shared_ptr<std::vector<float>>;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

}  // namespace

struct ParamServer::Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr poison;
  bool shutdown = false;

  // Worker side. The push waiting for the engine to send it (remote server only), and the
  // answer: complete once the push's sends and the answer's receives are in.
  struct Out {
    Buffer data;
    uint64_t index = 0, version = 0;
  };
  std::optional<Out> to_send;
  Buffer staging;  // this worker's copy of its last push
  bool answered = true;
  uint64_t answer_version = 0;
  std::vector<float> answer;  // the parameters received (param_count)

  // Server side. Pushes arrived and not taken; answers not yet sent; buffers of answers sent.
  std::deque<Push> queue;
  struct Answer {
    int rank;
    uint64_t index, version;
    Buffer params;
  };
  std::deque<Answer> answers;
  std::vector<Buffer> pool;
  std::vector<int64_t> taken;  // per worker: pushes taken by next_push
  std::vector<Clock::time_point> last_heard;

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!poison) poison = e;
    cv.notify_all();
  }
};

namespace {

class ParamService final : public EngineOp {
 public:
  ParamService(Engine& engine, size_t grad_count, size_t param_count,
               const ParamServerOptions& o, std::shared_ptr<ParamServer::Shared> sh)
      : engine_(engine),
        rank_(engine.rank()),
        world_(engine.size()),
        grad_count_(grad_count),
        param_count_(param_count),
        o_(o),
        sh_(std::move(sh)) {
    seq = 0;
    sequenced = false;
    deadline = Clock::time_point::max();
  }

  std::string name() const override { return "parameter server"; }
  bool finished() const override { return finished_; }
  std::string waiting_on() const override {
    return rank_ == o_.server ? "gradients from the workers" : "the server's parameters";
  }
  // Nothing of this rank in flight: only standing receives (pushes at the server, the answer
  // at a worker) that may be noticed a little late.
  bool passive() const override {
    return sends_.empty() && (!push_d_ || push_d_->done()) && !finished_;
  }

  void start(net::Endpoint& ep) override {
    if (rank_ != o_.server || o_.pushes_per_worker <= 0) return;
    in_.resize(size_t(world_));
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      in_[size_t(p)].data = std::make_shared<std::vector<float>>(grad_count_);
      post_push_recv(ep, p);
    }
  }

  void abort(net::Endpoint& ep) override {
    cancel_all(ep);
    sh_->fail(std::make_exception_ptr(
        IoError(fmt::format("rank {}: the communicator under the parameter server failed: {}",
                            rank_, engine_.broken_reason()))));
  }

  bool advance(net::Endpoint& ep) override {
    if (finished_) return false;
    bool moved = false;
    moved |= send_push(ep);
    moved |= poll_answer();
    if (rank_ == o_.server) {
      moved |= poll_pushes();
      moved |= send_answers(ep);
    }
    moved |= reap_sends(ep);
    bool stop;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      stop = sh_->shutdown;
    }
    if (stop) {
      // Answers still in flight get two seconds; then a send to a peer that reads nothing is
      // left to the endpoint (retain_until_closed), which may still read its buffer.
      if (drain_until_ == Clock::time_point{}) drain_until_ = Clock::now() + std::chrono::seconds(2);
      if (sends_.empty() || Clock::now() >= drain_until_) {
        for (auto& s : sends_) ep.retain_until_closed(s.buf);
        sends_.clear();
        cancel_all(ep);
        finished_ = true;
        moved = true;
      }
    }
    return moved;
  }

 private:
  struct In {
    Header hdr;
    Buffer data;
    net::RequestPtr rh, rd;
    uint64_t next = 0;  // the push number expected next
    bool posted = false;
  };
  struct Send {
    net::RequestPtr req;
    std::shared_ptr<const void> buf;  // what the request reads
    int peer;
    Buffer params;  // an answer's parameters: back to the pool once sent
  };

  void post_push_recv(net::Endpoint& ep, int p) {
    In& in = in_[size_t(p)];
    in.rh = ep.irecv(p, tag(in.next, kPushHeader), &in.hdr, sizeof(Header));
    in.rd = ep.irecv(p, tag(in.next, kPushData), in.data->data(), grad_count_ * sizeof(float));
    in.posted = true;
  }

  // A worker's push to a remote server: header and data, and the answer's receives.
  bool send_push(net::Endpoint& ep) {
    std::optional<ParamServer::Shared::Out> out;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      if (!sh_->to_send) return false;
      out = std::move(sh_->to_send);
      sh_->to_send.reset();
    }
    const int s = o_.server;
    answer_index_ = out->index;
    answer_hdr_ = Header{};
    answer_rh_ = ep.irecv(s, tag(out->index, kAnswerHeader), &answer_hdr_, sizeof(Header));
    answer_rd_ = ep.irecv(s, tag(out->index, kAnswerData), sh_->answer.data(),
                          param_count_ * sizeof(float));
    auto hdr = std::make_shared<Header>();
    hdr->kind = kPushHeader;
    hdr->rank = uint32_t(rank_);
    hdr->index = out->index;
    hdr->version = out->version;
    hdr->count = grad_count_;
    push_h_ = ep.isend(s, tag(out->index, kPushHeader), hdr.get(), sizeof(Header));
    push_d_ = ep.isend(s, tag(out->index, kPushData), out->data->data(),
                       grad_count_ * sizeof(float));
    push_bufs_ = {hdr, out->data};
    return true;
  }

  // The worker's answer is complete once its own push left and both parts of the answer came.
  bool poll_answer() {
    if (!answer_rh_) return false;
    for (auto* r : {&push_h_, &push_d_, &answer_rh_, &answer_rd_}) {
      if (!(*r)->done()) return false;
      if (!(*r)->ok())
        throw IoError(fmt::format("rank {}: async SGD push #{}: {} the server (rank {}) "
                                  "failed: {}",
                                  rank_, answer_index_,
                                  (*r)->is_send ? "sending the gradient to"
                                                : "receiving the parameters from",
                                  o_.server, (*r)->error));
    }
    const Header& h = answer_hdr_;
    if (answer_rh_->bytes != sizeof(Header) || h.magic != kMagic || h.wire != kWire ||
        h.kind != kAnswerHeader || h.index != answer_index_ || h.count != param_count_ ||
        answer_rd_->bytes != param_count_ * sizeof(float))
      throw ProtocolError(fmt::format(
          "rank {}: malformed answer from the parameter server (rank {}) to push #{}", rank_,
          o_.server, answer_index_));
    answer_rh_.reset();
    answer_rd_.reset();
    push_h_.reset();
    push_d_.reset();
    push_bufs_.clear();
    std::lock_guard<std::mutex> lock(sh_->mu);
    sh_->answer_version = h.version;
    sh_->answered = true;
    sh_->cv.notify_all();
    return true;
  }

  bool poll_pushes() {
    bool moved = false;
    for (int p = 0; p < int(in_.size()); ++p) {
      In& in = in_[size_t(p)];
      if (!in.posted || !in.rh->done() || !in.rd->done()) continue;
      for (auto* r : {&in.rh, &in.rd})
        if (!(*r)->ok())
          throw IoError(fmt::format("rank {} (async SGD server): receive of push #{} from rank "
                                    "{} failed: {}",
                                    rank_, in.next, p, (*r)->error));
      const Header& h = in.hdr;
      if (in.rh->bytes != sizeof(Header) || h.magic != kMagic || h.wire != kWire ||
          h.kind != kPushHeader || int(h.rank) != p || h.index != in.next ||
          h.count != grad_count_ || in.rd->bytes != grad_count_ * sizeof(float))
        throw ProtocolError(fmt::format(
            "rank {} (async SGD server): malformed push #{} from rank {} (magic {:08x}, wire {}, "
            "rank {}, push {}, {} values, {} data bytes; expected {} values)",
            rank_, in.next, p, h.magic, h.wire, h.rank, h.index, h.count, in.rd->bytes,
            grad_count_));
      in.posted = false;
      {
        std::lock_guard<std::mutex> lock(sh_->mu);
        sh_->queue.push_back(ParamServer::Push{p, h.index, h.version, in.data->data()});
        sh_->last_heard[size_t(p)] = Clock::now();
        sh_->cv.notify_all();
      }
      ++in.next;
      moved = true;
    }
    return moved;
  }

  bool send_answers(net::Endpoint& ep) {
    std::deque<ParamServer::Shared::Answer> todo;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      todo.swap(sh_->answers);
    }
    for (auto& a : todo) {
      auto hdr = std::make_shared<Header>();
      hdr->kind = kAnswerHeader;
      hdr->rank = uint32_t(rank_);
      hdr->index = a.index;
      hdr->version = a.version;
      hdr->count = param_count_;
      sends_.push_back({ep.isend(a.rank, tag(a.index, kAnswerHeader), hdr.get(), sizeof(Header)),
                        hdr, a.rank, nullptr});
      sends_.push_back({ep.isend(a.rank, tag(a.index, kAnswerData), a.params->data(),
                                 param_count_ * sizeof(float)),
                        a.params, a.rank, a.params});
      // The worker's buffer is free again: take its next push.
      In& in = in_[size_t(a.rank)];
      if (!in.posted && int64_t(in.next) < o_.pushes_per_worker) post_push_recv(ep, a.rank);
    }
    return !todo.empty();
  }

  bool reap_sends(net::Endpoint& ep) {
    bool moved = false;
    while (!sends_.empty() && sends_.front().req->done()) {
      Send s = std::move(sends_.front());
      sends_.pop_front();
      if (!s.req->ok())
        throw IoError(fmt::format("rank {} (async SGD server): answer to rank {} failed: {}",
                                  rank_, s.peer, s.req->error));
      // Answer buffers go back to the pool (headers are small and just freed).
      if (s.params) {
        s.buf.reset();
        std::lock_guard<std::mutex> lock(sh_->mu);
        sh_->pool.push_back(std::move(s.params));
      }
      moved = true;
    }
    return moved;
  }

  void cancel_all(net::Endpoint& ep) {
    for (auto& in : in_) {
      if (!in.posted) continue;
      for (auto* r : {&in.rh, &in.rd})
        if (*r && !(*r)->done()) ep.cancel(*r);
      in.posted = false;
    }
    for (auto* r : {&answer_rh_, &answer_rd_})
      if (*r && !(*r)->done()) ep.cancel(*r);
    for (auto* r : {&push_h_, &push_d_})
      if (*r && !(*r)->done()) {
        for (auto& b : push_bufs_) ep.retain_until_closed(b);
        break;
      }
  }

  Engine& engine_;
  const int rank_, world_;
  const size_t grad_count_, param_count_;
  const ParamServerOptions o_;
  std::shared_ptr<ParamServer::Shared> sh_;
  bool finished_ = false;
  Clock::time_point drain_until_{};
  // Worker: the push in flight and the receives of its answer.
  net::RequestPtr push_h_, push_d_, answer_rh_, answer_rd_;
  std::vector<std::shared_ptr<const void>> push_bufs_;
  Header answer_hdr_;
  uint64_t answer_index_ = 0;
  // Server: one standing push receive per remote worker, and the answers in flight.
  std::vector<In> in_;
  std::deque<Send> sends_;
};

}  // namespace

ParamServer::ParamServer(Communicator& comm, size_t grad_count, size_t param_count,
                         ParamServerOptions opts)
    : comm_(comm),
      grad_count_(grad_count),
      param_count_(param_count),
      opts_(opts),
      sh_(std::make_shared<Shared>()) {
  if (opts_.server < 0 || opts_.server >= comm.size())
    throw ConfigError(fmt::format("parameter server rank {} out of range [0, {})", opts_.server,
                                  comm.size()));
  if (opts_.pushes_per_worker < 0)
    throw ConfigError("parameter server: pushes_per_worker must be >= 0");
  if (opts_.deadline.count() <= 0) throw ConfigError("parameter server: deadline must be > 0");
  if (comm.size() > int(net::kChunkMask))
    throw ConfigError(fmt::format("parameter server: {} ranks is too many", comm.size()));
  sh_->answer.assign(param_count, 0.0f);
  sh_->taken.assign(size_t(comm.size()), 0);
  sh_->last_heard.assign(size_t(comm.size()), Clock::now());
  auto op = std::make_unique<ParamService>(comm.engine(), grad_count, param_count, opts_, sh_);
  service_ = comm.submit(std::move(op));
}

ParamServer::~ParamServer() {
  {
    std::lock_guard<std::mutex> lock(sh_->mu);
    sh_->shutdown = true;
  }
  comm_.engine().kick();
  // The service drains its answers for at most 2 s; never throw from a destructor.
  auto until = Clock::now() + std::chrono::seconds(5);
  while (!service_->done() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!service_->done())
    spdlog::warn("rank {}: parameter server service did not stop in 5 s", comm_.rank());
}

void ParamServer::push(const float* grad, uint64_t version) {
  if (!grad && grad_count_) throw UsageError("parameter server push: null gradient");
  if (int64_t(pushed_) >= opts_.pushes_per_worker)
    throw UsageError(fmt::format("rank {}: push #{}, but every worker pushes {} times",
                                 comm_.rank(), pushed_, opts_.pushes_per_worker));
  const uint64_t index = pushed_;
  if (awaiting_pull_)
    throw UsageError(fmt::format("rank {}: push #{} before the answer to push #{} was pulled",
                                 comm_.rank(), index, index - 1));
  {
    std::lock_guard<std::mutex> lock(sh_->mu);
    if (sh_->poison) std::rethrow_exception(sh_->poison);
    if (!sh_->staging) sh_->staging = std::make_shared<std::vector<float>>(grad_count_);
  }
  // The previous push's sends are complete (its answer came), so the copy is free to reuse.
  std::memcpy(sh_->staging->data(), grad, grad_count_ * sizeof(float));
  ++pushed_;
  awaiting_pull_ = true;
  std::lock_guard<std::mutex> lock(sh_->mu);
  sh_->answered = false;
  if (comm_.rank() == opts_.server) {
    sh_->queue.push_back(Push{comm_.rank(), index, version, sh_->staging->data()});
    sh_->last_heard[size_t(comm_.rank())] = Clock::now();
    sh_->cv.notify_all();
    return;
  }
  sh_->to_send = Shared::Out{sh_->staging, index, version};
  comm_.engine().kick();
}

uint64_t ParamServer::pull(float* params) {
  if (!params && param_count_) throw UsageError("parameter server pull: null buffer");
  if (!awaiting_pull_) throw UsageError("parameter server pull without a push to answer");
  auto answered = [&] {
    std::lock_guard<std::mutex> lock(sh_->mu);
    return sh_->answered || sh_->poison;
  };
  if (comm_.rank() != opts_.server) comm_.engine().drive_until(answered, Deadline::max(), kHelpBriefly);
  std::unique_lock<std::mutex> lock(sh_->mu);
  const auto until = Clock::now() + opts_.deadline;
  while (!sh_->answered && !sh_->poison) {
    if (sh_->cv.wait_until(lock, until) == std::cv_status::timeout && !sh_->answered &&
        !sh_->poison) {
      auto e = std::make_exception_ptr(CollectiveTimeout(fmt::format(
          "rank {}: async SGD: no parameters from the server (rank {}) within {} ms of push "
          "#{}",
          comm_.rank(), opts_.server, opts_.deadline.count(), pushed_ - 1)));
      if (!sh_->poison) sh_->poison = e;
      sh_->cv.notify_all();
      std::rethrow_exception(e);
    }
  }
  if (sh_->poison) std::rethrow_exception(sh_->poison);
  if (param_count_) std::memcpy(params, sh_->answer.data(), param_count_ * sizeof(float));
  awaiting_pull_ = false;
  return sh_->answer_version;
}

std::optional<ParamServer::Push> ParamServer::next_push() {
  if (comm_.rank() != opts_.server)
    throw UsageError(fmt::format("rank {}: next_push on a worker (the server is rank {})",
                                 comm_.rank(), opts_.server));
  const int world = comm_.size();
  auto owed = [&] {
    for (int r = 0; r < world; ++r)
      if (sh_->taken[size_t(r)] < opts_.pushes_per_worker) return true;
    return false;
  };
  auto ready = [&] {
    std::lock_guard<std::mutex> lock(sh_->mu);
    return !sh_->queue.empty() || sh_->poison || !owed();
  };
  if (!ready()) comm_.engine().drive_until(ready, Deadline::max(), kHelpBriefly);
  std::unique_lock<std::mutex> lock(sh_->mu);
  const auto start = Clock::now(), until = start + opts_.deadline;
  while (sh_->queue.empty() && !sh_->poison && owed()) {
    if (sh_->cv.wait_until(lock, until) == std::cv_status::timeout && sh_->queue.empty() &&
        !sh_->poison) {
      std::vector<std::string> who;
      int64_t done = 0;
      for (int r = 0; r < world; ++r) {
        done += sh_->taken[size_t(r)];
        if (sh_->taken[size_t(r)] < opts_.pushes_per_worker)
          who.push_back(fmt::format("rank {} ({} of {} pushes, last heard {:.0f} ms ago)", r,
                                    sh_->taken[size_t(r)], opts_.pushes_per_worker,
                                    ms_since(sh_->last_heard[size_t(r)])));
      }
      auto e = std::make_exception_ptr(CollectiveTimeout(fmt::format(
          "rank {} (async SGD server): no gradient arrived for {} ms after update {} of {}; "
          "still owing pushes: {}",
          comm_.rank(), opts_.deadline.count(), done, opts_.pushes_per_worker * world,
          fmt::join(who, ", "))));
      if (!sh_->poison) sh_->poison = e;
      sh_->cv.notify_all();
      std::rethrow_exception(e);
    }
  }
  if (sh_->poison) std::rethrow_exception(sh_->poison);
  if (sh_->queue.empty()) return std::nullopt;
  Push p = sh_->queue.front();
  sh_->queue.pop_front();
  ++sh_->taken[size_t(p.rank)];
  return p;
}

void ParamServer::reply(const Push& p, const float* params, uint64_t version) {
  if (comm_.rank() != opts_.server)
    throw UsageError(fmt::format("rank {}: reply on a worker", comm_.rank()));
  if (p.rank < 0 || p.rank >= comm_.size())
    throw UsageError(fmt::format("parameter server reply to rank {}", p.rank));
  std::unique_lock<std::mutex> lock(sh_->mu);
  if (sh_->poison) std::rethrow_exception(sh_->poison);
  if (p.rank == comm_.rank()) {
    if (param_count_) std::memcpy(sh_->answer.data(), params, param_count_ * sizeof(float));
    sh_->answer_version = version;
    sh_->answered = true;
    sh_->cv.notify_all();
    return;
  }
  Buffer b;
  if (!sh_->pool.empty()) {
    b = std::move(sh_->pool.back());
    sh_->pool.pop_back();
  }
  lock.unlock();
  if (!b) b = std::make_shared<std::vector<float>>(param_count_);
  if (param_count_) std::memcpy(b->data(), params, param_count_ * sizeof(float));
  lock.lock();
  sh_->answers.push_back({p.rank, p.index, version, std::move(b)});
  lock.unlock();
  if (!comm_.engine().try_progress()) comm_.engine().kick();
}

void ParamServer::fail(std::exception_ptr e) {
  sh_->fail(std::move(e));
}

}  // namespace qring::collectives
