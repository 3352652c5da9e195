// Quorum all-reduce protocol (see quorum.h and docs/design.md).
//
//   contribute(t) ──READY(t, r)──▶ coordinator (rank 0's engine, even while rank 0 computes)
//                                   decides S(t): all W arrived, or Q arrived and the grace
//                                   passed; fewer than Q by first READY + H → FAIL
//   every rank ◀──DECIDE(t, S, offsets)──
//   ranks in S(t): ring all-reduce among themselves, in place in the contributed buffers
//   rank x ∉ S(t): receives the result from member S[x mod |S|] into an internal buffer
#include "collectives/quorum/quorum.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "collectives/algorithms.h"
#include "collectives/engine.h"
#include "collectives/quorum/coordinator.h"
#include "collectives/quorum/wire.h"
#include "collectives/reduce.h"
#include "net/base/large_buffer.h"

namespace qring::collectives {

// Results and kept buffers (count elements each): in huge pages, since a rank that falls
// behind, or a joiner catching up, makes the others keep a new one per step.
using Bytes = net::LargeVector<char>;

LatePolicy parse_late_policy(std::string_view s) {
  if (s == "drop") return LatePolicy::kDrop;
  if (s == "carry") return LatePolicy::kCarry;
  throw ConfigError(fmt::format("unknown late policy '{}' (expected drop or carry)", s));
}
std::string_view to_string(LatePolicy p) {
  return p == LatePolicy::kDrop ? "drop" : "carry";
}

std::vector<ViewChange> views_learned(const std::vector<ViewChange>& views, uint64_t decided_in,
                                      uint64_t* known) {
  std::vector<ViewChange> out;
  if (decided_in <= *known) return out;
  for (const auto& v : views)  // in epoch order, as applied (view_changes())
    if (v.epoch > *known && v.epoch <= decided_in) out.push_back(v);
  *known = decided_in;
  return out;
}

int resolve_quorum(std::string_view spec, int world) {
  std::string s(spec);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    throw ConfigError(fmt::format("quorum '{}' is not a number", spec));
  int q;
  if (s.find('.') != std::string::npos) {
    if (v <= 0 || v > 1)
      throw ConfigError(fmt::format("quorum fraction {} must be in (0, 1]", spec));
    q = static_cast<int>(quorum_of_fraction(v, world));
  } else {
    q = static_cast<int>(v);
  }
  if (q < 1 || q > world)
    throw ConfigError(
        fmt::format("quorum {} out of range [1, {}] for {} ranks", spec, world, world));
  return q;
}

namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Tag sequence of one attempt at a step: the ring and the result sends of a step that was
// decided again never match those of an earlier attempt.
uint64_t attempt_seq(uint64_t step, uint32_t attempt) {
  return (step << 3) | (attempt & 7u);
}

using qproto::Event;
using UpKind = qproto::Up::Kind;
using DownKind = qproto::Down::Kind;

// Store keys of a rejoin (docs/design.md, "Rejoin"): what rank `owner` publishes about the
// join of incarnation `inc` of rank `r` -- the joiner its address, each member its address for
// the joiner -- under "join/<instance>/<r>.<inc>/<owner>" (a key of `owner`: net/rendezvous/store.h).
std::string join_key(uint32_t instance, int r, uint32_t inc, int owner) {
  return fmt::format("join/{}/{}.{}/{}", instance, r, inc, owner);
}
// Set by the rank that coordinated the end of the job: a rank that comes back later learns
// that there is nothing to rejoin.
std::string join_done_key(uint32_t instance, int coordinator) {
  return fmt::format("join/{}/done/{}", instance, coordinator);
}

// The value of a join key: "<incarnation> <coordinator> <epoch> <members, comma-separated>
// <length of the settings>" (the publisher's, as it knows them; the joiner: "-1 0 -"), then
// after a newline its communicator settings (Communicator::settings_text, compared as at a
// communicator's creation) and its address (net::Endpoint::published_address).
struct JoinValue {
  uint32_t incarnation = 0;
  int coordinator = -1;
  uint64_t epoch = 0;
  std::vector<int> members;
  std::string settings;
  std::string address;
};

std::string encode_join_value(const JoinValue& v) {
  std::string m = v.members.empty() ? "-" : fmt::format("{}", fmt::join(v.members, ","));
  return fmt::format("{} {} {} {} {}\n{}{}", v.incarnation, v.coordinator, v.epoch, m,
                     v.settings.size(), v.settings, v.address);
}

JoinValue decode_join_value(const std::string& s, int world, const std::string& key) {
  auto bad = [&] {
    return ProtocolError(fmt::format("quorum: malformed rejoin record under '{}'", key));
  };
  const size_t nl = s.find('\n');
  if (nl == std::string::npos) throw bad();
  std::istringstream head(s.substr(0, nl));
  JoinValue v;
  int64_t inc = -1, settings_len = -1;
  std::string members;
  if (!(head >> inc >> v.coordinator >> v.epoch >> members >> settings_len) || inc < 0 ||
      inc > UINT32_MAX || v.coordinator < -1 || v.coordinator >= world || settings_len < 0 ||
      size_t(settings_len) > s.size() - nl - 1)
    throw bad();
  v.incarnation = uint32_t(inc);
  if (members != "-") {
    std::istringstream ms(members);
    std::string item;
    while (std::getline(ms, item, ',')) {
      char* end = nullptr;
      long r = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end || r < 0 || r >= world) throw bad();
      v.members.push_back(int(r));
    }
  }
  v.settings = s.substr(nl + 1, size_t(settings_len));
  v.address = s.substr(nl + 1 + size_t(settings_len));
  return v;
}

}  // namespace

struct StepLocal {
  void* buf = nullptr;
  std::vector<Rejoined> joined;  // ranks that entered the view at this step
  std::optional<uint64_t> digest;  // sent with the READY
  bool contributed = false;
  Clock::time_point contrib_time{};
  bool decided = false;
  bool ring_finished = false;  // speculative ring (quorum = world) done, DECIDE pending
  bool excluded = false;
  bool done = false;
  std::exception_ptr error;
  QuorumResult result;
  // Where the result lands when it is not reduced in place: the excluded rank's copy, and in
  // a job that survives lost ranks every rank's (kept until every live rank has the step).
  std::shared_ptr<Bytes> out;
};

// The join agent's work (a thread of QuorumAllreduce: the store look-ups of a rejoin, which
// may block, stay off the engine thread; what touches the endpoint runs in the service).
struct JoinAgentIo {
  bool stop = false;
  // service -> agent
  std::deque<std::pair<std::string, std::string>> publish;       // key, value
  struct Fetch {
    int rank;
    uint32_t incarnation;
    std::string key;
    Clock::time_point until;
  };
  std::deque<Fetch> fetch;               // a joiner's address (members)
  bool coordinating = false;             // watch the incarnations of the ranks outside the view
  std::vector<uint32_t> incarnations;    // per rank, as the coordinator knows them
  std::vector<char> outside;             // per rank: not in the coordinator's view
  bool searching = false;                // the joiner: look for the members' addresses
  bool watch_end = false;                // the joiner: until it has its state, watch for the end
  bool finished = false;                 // the joiner: the job has ended (join_done_key)
  // agent -> service
  std::deque<std::string> published;
  std::deque<std::tuple<int, uint32_t, std::string>> fetched;  // joiner, incarnation, value
  std::deque<std::pair<int, uint32_t>> found;                  // new incarnations
  std::deque<std::pair<int, std::string>> values;              // the joiner: member, value
};

struct QuorumAllreduce::Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, StepLocal> steps;
  std::deque<uint64_t> ready_events;  // contributed steps whose READY is not sent yet
  struct Report {
    uint64_t key;
    uint32_t part, parts;
    std::vector<double> values;
  };
  std::deque<Report> reports_out;  // report() calls not sent yet
  // Coordinator: reports received, by key, then by the number of parts the sender split the
  // report into and the part. A key waits until the coordinator gathers it (which drops it and
  // every older one), however far the others are ahead: a lagging coordinator still finds its
  // next key's parts. Only a bound on the parts held (a coordinator that never gathers) drops
  // the oldest keys. (A bound of 16 keys once dropped them: a coordinator 16 evaluations
  // behind found no sums, waited its deadline at every evaluation, and fell further behind.)
  static constexpr size_t kMaxReportParts = size_t(1) << 16;
  std::map<uint64_t, std::map<std::pair<uint32_t, int>, std::vector<double>>> reports_in;
  size_t report_parts = 0;  // the parts in reports_in
  void keep_report(uint64_t key, uint32_t part, uint32_t parts, std::vector<double> v) {
    std::lock_guard<std::mutex> lock(mu);
    if (reports_in[key].insert_or_assign({parts, int(part)}, std::move(v)).second) ++report_parts;
    while (report_parts > kMaxReportParts && reports_in.size() > 1) {
      report_parts -= reports_in.begin()->second.size();
      reports_in.erase(reports_in.begin());
    }
    cv.notify_all();
  }
  // Drops the reports of `key` and every older key (the caller holds mu).
  void drop_reports_through(uint64_t key) {
    const auto end = reports_in.upper_bound(key);
    for (auto it = reports_in.begin(); it != end; ++it) report_parts -= it->second.size();
    reports_in.erase(reports_in.begin(), end);
  }
  std::exception_ptr poison;
  std::exception_ptr service_error;  // why the service died, when it did
  bool shutdown = false;
  std::function<void(uint64_t)> on_excluded;
  std::function<void(uint64_t, const char*)> on_phase;
  // Coordinator only: the newest kKeepArrivals steps, so that a long run's log stays bounded.
  // A step's entry changes while late READYs for it are logged (the coordinator remembers its
  // newest 4096 decided steps, quorum_coordinator.cc); the trainer streams each step into
  // arrivals.jsonl once it is far enough behind to be final (train/trainer.cc).
  static constexpr size_t kKeepArrivals = 16384;
  std::map<uint64_t, std::vector<double>> arrivals;
  std::vector<int> members;                          // as of the last completed step
  int coordinator = 0;                               // the rank coordinating now
  std::vector<ViewChange> views;

  JoinAgentIo agent;
  std::condition_variable agent_cv;
  // The joiner: set once it is admitted; what it waits for until then (for the error).
  std::optional<JoinInfo> joined_info;
  std::string join_stage = "waiting for the coordinator to notice this incarnation";
  // State transfer: donor side (send_state), joiner side (receive_state).
  struct StateOut {
    int to;
    uint64_t step;
    std::shared_ptr<const std::vector<char>> buf;
  };
  std::deque<StateOut> state_out;
  size_t state_len = 0;  // > 0: receive_state waits for this many bytes at most
  bool state_done = false;
  std::shared_ptr<Bytes> state_in;
  size_t state_bytes = 0;
  std::string state_error;

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!poison) poison = e;
    for (auto& [t, s] : steps)
      if (!s.done && !s.error) s.error = e;
    cv.notify_all();
  }
};

namespace {

class QuorumService final : public EngineOp {
 public:
  QuorumService(Engine& engine, const CommOptions& copts, size_t count, const QuorumOptions& o,
                std::shared_ptr<QuorumAllreduce::Shared> sh, uint32_t instance)
      : engine_(engine),
        copts_(copts),
        count_(count),
        o_(o),
        sh_(std::move(sh)),
        rank_(engine.rank()),
        world_(engine.size()),
        esz_(dtype_size(o.type)),
        instance_(instance & 0xFF) {
    seq = 0;
    sequenced = false;
    deadline = Clock::time_point::max();
    cfg_.world = world_;
    cfg_.self = coord_;
    cfg_.quorum = o.fraction > 0 ? 0 : o.quorum;
    cfg_.fraction = o.fraction;
    cfg_.grace = o.grace;
    cfg_.deadline = o.deadline;
    cfg_.evict = o.evict;
    cfg_.evict_steps = o.evict_steps;
    cfg_.min_world = o.min_world;
    cfg_.count = count;
    cfg_.adaptive = o.adaptive;
    cfg_.auto_max = o.auto_max;
    cfg_.auto_kappa = o.auto_kappa;
    cfg_.layout = qproto::layout_of(uint8_t(o.type), o.mean);
    // A job that can lose a rank keeps every contribution intact until its step completes
    // (rings out of place) and every result until every live rank has it (recovery).
    tolerant_ = qproto::floor_for(cfg_, world_ - 1) <= world_ - 1;
    heartbeat_ = std::max(std::chrono::milliseconds(1), o.evict / 4);
    view_.members.resize(size_t(world_));
    for (int r = 0; r < world_; ++r) view_.members[size_t(r)] = r;
    out_next_.assign(size_t(world_), 0);
    results_to_.resize(size_t(world_));
    reported_suspect_.assign(size_t(world_), false);
    inc_.assign(size_t(world_), 0);
    join_step_of_.assign(size_t(world_), 0);
    joining_ = o.join;
    admitted_ = !joining_;
    if (joining_) {
      view_.members.clear();  // learned when it is admitted
      coord_ = -1;
    }
  }

  std::string name() const override { return "quorum service"; }
  // Chunk field of control tags: the sender's rank and this all-reduce's instance number, so
  // a late message of an earlier instance on the same communicator never matches.
  uint64_t chunk(int r) const { return uint64_t(r) | (uint64_t(instance_) << 16); }
  bool finished() const override { return finished_; }
  std::string waiting_on() const override { return "contributions"; }
  // Between steps: nothing of this rank in flight, only the standing receives.
  bool passive() const override {
    return rings_.empty() && result_recvs_.empty() && sends_.empty() && awaiting_decide_.empty() &&
           (!coord_state_ || !coord_state_->waiting()) && !finished_ && member_joins_.empty() &&
           (!joining_ || admitted_);
  }

  void start(net::Endpoint& ep) override {
    auto now = Clock::now();
    last_pass_ = last_down_ = last_beat_ = now;
    // Any rank may become the coordinator (failover): every rank takes messages of both
    // directions from every peer.
    up_in_.resize(size_t(world_));
    down_in_.resize(size_t(world_));
    up_out_next_.assign(size_t(world_), 0);
    told_deposed_.assign(size_t(world_), false);
    my_inc_ = ep.incarnation();
    inc_[size_t(rank_)] = my_inc_;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      post_up_recv(ep, p);
      post_down_recv(ep, p);
    }
    if (rank_ == coord_ && !joining_) {
      coord_state_ = std::make_unique<qproto::Coordinator>(cfg_, now);
      log_arrivals();
    }
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->members = view_.members;
      if (joining_) {
        sh_->coordinator = -1;
        sh_->agent.searching = true;
        sh_->agent.watch_end = true;
      }
      ViewChange v;
      v.members = view_.members;
      v.seen = now;
      sh_->views.push_back(v);
    }
  }

  // Withdraws everything; the callers of wait() are told in failed(), once the engine has
  // made sure that no buffer of theirs is still with the transport.
  void abort(net::Endpoint& ep) override {
    cancel_all(ep);
    retain_sends(ep);
  }
  bool holds_buffers() const override { return user_sends_pending(); }

  bool advance(net::Endpoint& ep) override {
    if (finished_) return false;
    bool moved = false;
    bool fatal = false;
    try {
      resync_after_pause(ep);
      moved |= take_events(ep);
      moved |= poll_agent(ep);
      moved |= poll_state(ep);
      moved |= poll_down(ep);
      moved |= poll_up(ep);
      moved |= gather_takeover(ep);
      moved |= advance_rings(ep);
      moved |= poll_results(ep);
      moved |= reap_sends(ep);
      heartbeat(ep);
      // The process may have been stopped during this pass too (SIGSTOP lands anywhere).
      if (!resync_after_pause(ep)) check_deadlines(ep);
    } catch (const Evicted&) {
      fatal = true;
      error_ = std::current_exception();
      dead_ = true;
    } catch (const JobOver&) {
      // Rethrown below (fatal) like an eviction: error_ must hold it (a null exception_ptr
      // rethrown is a crash: a rank that came back after the job ended died of SIGSEGV).
      fatal = true;
      error_ = std::current_exception();
      sh_->fail(error_);
      told_ = true;
      dead_ = true;
    } catch (const QuorumLost&) {
      fatal = true;
      error_ = std::current_exception();
      dead_ = true;
    } catch (...) {
      error_ = std::current_exception();
      dead_ = true;
    }
    if (error_) {
      std::lock_guard<std::mutex> lock(sh_->mu);
      if (!sh_->service_error) sh_->service_error = error_;
    }
    bool stop;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      stop = sh_->shutdown;
    }
    if (stop && !dead_ && !bye_sent_) {
      // Finished: nobody may take this rank's silence from now on for a failure.
      bye_sent_ = true;
      try {
        if (coord_state_) {
          qproto::Down m;
          m.kind = DownKind::kBye;
          broadcast_down(ep, m);
        } else {
          send_up(ep, UpKind::kBye, Event{});
        }
      } catch (const std::exception& e) {
        spdlog::debug("rank {}: quorum: goodbye not sent: {}", rank_, e.what());
      }
    }
    if ((stop || dead_) && !finished_) {
      // Receives into the callers' buffers are withdrawn before the callers hear of an error
      // (a cancellation that is not confirmed throws: the engine then closes the endpoint).
      cancel_all(ep);
      // A ring aborted with sends still reading a caller's buffer: the engine fails the
      // communicator and closes the endpoint before the callers are told (failed()).
      if (dead_ && user_sends_pending()) std::rethrow_exception(error_);
      if (error_ && !told_) {
        told_ = true;
        sh_->fail(error_);
      }
      reap_aborted();
      // Sends to ranks that left may never complete: they are not waited for.
      const bool only_lost = std::all_of(sends_.begin(), sends_.end(), [&](const Send& x) {
        return x.req->done() || !view_.has(x.peer);
      });
      if (sends_.empty() || only_lost || Clock::now() > drain_deadline()) {
        if (user_sends_pending())
          throw IoError(fmt::format("rank {}: quorum: ring sends from the callers' buffers did "
                                    "not complete by the end",
                                    rank_));
        retain_sends(ep);
        finished_ = true;
      }
    }
    // Eviction and a job below its quorum end every operation of this communicator, so that
    // no collective among the old members waits for its deadline.
    if (fatal) std::rethrow_exception(error_);
    return moved;
  }

 private:
  struct Send {
    net::RequestPtr req;
    std::shared_ptr<const void> buf;  // kept alive until the send completes
    int peer = -1;
    bool result = false;  // a step's result to a rank outside S(t)
    uint32_t incarnation = 0;  // of the peer when it was sent
  };
  struct MemberJoin {
    uint32_t incarnation = 0;
    std::string key;  // where this rank publishes its address for the joiner
    bool connected = false;
    bool refused = false;  // other settings: reconnected, but not accepted
    Clock::time_point started = Clock::now();
  };
  struct Ring {
    std::unique_ptr<EngineOp> op;
    Clock::time_point started;
    std::vector<int> members;
    uint32_t attempt = 0;
    bool speculative = false;
    bool phase_told = false;
  };
  struct ResultRecv {
    net::RequestPtr req;
    int from;
    Clock::time_point started;
  };
  struct In {
    std::vector<char> msg;
    net::RequestPtr req;
    uint64_t next = 0;  // number of the next message expected from this peer
  };
  struct Takeover {
    uint64_t epoch = 0;
    std::vector<int> candidates;  // the last view without the silent coordinator
    Clock::time_point started{};
    std::map<int, Event> acks;
    std::vector<Event> early;  // messages of members that switched already (READYs ...)
  };

  // A pass long after the previous one: this process was stopped (SIGSTOP, a swap storm).
  // Silence measured across the pause says nothing about the peers; every clock starts over.
  bool resync_after_pause(net::Endpoint& ep) {
    const auto now = Clock::now();
    const bool paused = now - last_pass_ > heartbeat_ * 2;
    last_pass_ = now;
    if (!paused) return false;
    last_down_ = now;
    if (coord_state_) feed(ep, Event{}, /*resync=*/true);
    return true;
  }

  // ---- failover. The coordinator fell silent: this rank proposes itself for the next epoch
  // to the other members of the last view and coordinates once a majority of that view
  // (itself included) accepted; members that do not answer within the evict time are left
  // out. A member accepts one takeover per epoch, so two candidates never both win.
  void start_takeover(net::Endpoint& ep, const std::vector<int>& cands) {
    spdlog::warn("rank {}: quorum: the coordinator (rank {}) is silent; taking over", rank_,
                 coord_);
    takeover_ = Takeover{};
    takeover_->epoch = std::max(view_.epoch, acked_epoch_) + 1;
    takeover_->candidates = cands;
    takeover_->started = Clock::now();
    acked_epoch_ = takeover_->epoch;
    qproto::Down m;
    m.kind = DownKind::kTakeover;
    m.view.epoch = takeover_->epoch;
    m.view.members = cands;
    auto buf = std::make_shared<std::vector<char>>(qwire::encode_down(world_, m));
    for (int r : cands)
      if (r != rank_) send_down(ep, r, buf);
  }

  void answer_takeover(net::Endpoint& ep, int from, const qproto::View& v) {
    if (coord_state_ || v.epoch <= view_.epoch || v.epoch <= acked_epoch_ || !v.has(rank_))
      return;  // stale, or this rank coordinates, or it accepted another candidate already
    if (takeover_) {
      if (from > rank_) return;  // the lower candidate wins
      takeover_.reset();
    }
    acked_epoch_ = v.epoch;
    spdlog::warn("rank {}: quorum: rank {} takes over from the silent coordinator (rank {})",
                 rank_, from, coord_);
    coord_ = from;
    last_down_ = Clock::now();
    heard_coordinator_ = true;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->coordinator = from;
    }
    Event e;
    e.epoch = v.epoch;
    for (auto& [t, k] : decisions_) e.known.push_back(k);
    send_up(ep, UpKind::kAck, e);
    // The new coordinator has not seen the contributions still waiting for a decision.
    for (uint64_t t : awaiting_decide_) send_up(ep, UpKind::kReady, ready_event(t));
  }

  bool gather_takeover(net::Endpoint& ep) {
    if (!takeover_) return false;
    auto now = Clock::now();
    const int acked = int(takeover_->acks.size()) + 1;
    const bool majority = 2 * acked > view_.size();
    const bool all = acked == int(takeover_->candidates.size());
    const bool waited = now - takeover_->started > o_.evict;
    if (!(majority && (all || waited))) {
      if (now - takeover_->started > 2 * o_.evict + o_.deadline)
        throw QuorumLost(fmt::format(
            "rank {}: quorum: the coordinator (rank {}) fell silent and only {} of the {} ranks "
            "of the last view accepted this rank as its successor, not a majority",
            rank_, coord_, acked, view_.size()),
            {coord_});
      return false;
    }
    qproto::View v;
    v.epoch = takeover_->epoch;
    v.members.push_back(rank_);
    std::vector<int64_t> completed(size_t(world_), -1);
    completed[size_t(rank_)] = completed_;
    std::vector<qproto::Known> known;
    for (auto& [t, k] : decisions_) known.push_back(k);
    for (auto& [r, e] : takeover_->acks) {
      v.members.push_back(r);
      completed[size_t(r)] = e.completed;
      known.insert(known.end(), e.known.begin(), e.known.end());
    }
    std::sort(v.members.begin(), v.members.end());
    spdlog::warn("rank {}: quorum: coordinating from view {} (members {}) after rank {} fell "
                 "silent",
                 rank_, v.epoch, v.members, coord_);
    qproto::Config cfg = cfg_;
    cfg.self = rank_;
    std::vector<qproto::Down> out;
    coord_state_ =
        std::make_unique<qproto::Coordinator>(cfg, now, v, completed, known, out, inc_);
    coord_ = rank_;
    log_arrivals();
    auto early = std::move(takeover_->early);
    takeover_.reset();
    for (auto& a : out) act(ep, a);
    for (auto& e : early) feed(ep, e);
    for (uint64_t t : awaiting_decide_) send_up(ep, UpKind::kReady, ready_event(t));
    drain_self(ep);
    return true;
  }

  Clock::time_point drain_deadline() {
    if (drain_deadline_ == Clock::time_point{})
      drain_deadline_ = Clock::now() + std::chrono::seconds(2);
    return drain_deadline_;
  }

  void log_arrivals() {
    coord_state_->on_arrival([this](uint64_t t, int r, double ms) {
      std::lock_guard<std::mutex> lock(sh_->mu);
      auto& log = sh_->arrivals[t];
      if (log.empty()) log.assign(size_t(world_), -1.0);
      log[size_t(r)] = ms;
      while (sh_->arrivals.size() > QuorumAllreduce::Shared::kKeepArrivals)
        sh_->arrivals.erase(sh_->arrivals.begin());
    });
    std::lock_guard<std::mutex> lock(sh_->mu);
    sh_->coordinator = rank_;
  }

  // Rings first: they post into the callers' buffers.
  void cancel_all(net::Endpoint& ep) {
    for (auto it = rings_.begin(); it != rings_.end(); it = rings_.erase(it)) {
      it->second.op->abort(ep);
      if (it->second.op->holds_buffers()) aborted_.push_back(std::move(it->second.op));
    }
    for (auto it = result_recvs_.begin(); it != result_recvs_.end(); it = result_recvs_.erase(it))
      if (!it->second.req->done()) ep.cancel(it->second.req);
    for (auto& in : up_in_)
      if (in.req && !in.req->done()) ep.cancel(in.req);
    for (auto& in : down_in_)
      if (in.req && !in.req->done()) ep.cancel(in.req);
  }

  // Rings aborted while their sends were in flight, kept until those complete.
  void reap_aborted() {
    aborted_.erase(std::remove_if(aborted_.begin(), aborted_.end(),
                                  [](const auto& op) { return !op->holds_buffers(); }),
                   aborted_.end());
  }
  bool user_sends_pending() const {
    for (const auto& op : aborted_)
      if (op->holds_buffers()) return true;
    return false;
  }

  // The service's own send buffers stay alive until the endpoint is closed: the provider may
  // still read those of sends that never complete (to a rank that left).
  void retain_sends(net::Endpoint& ep) {
    for (auto& s : sends_)
      if (!s.req->done() && s.buf) ep.retain_until_closed(s.buf);
    sends_.clear();
  }

  // ---- rejoin (docs/design.md, "Rejoin"). A new incarnation of rank r is found in the store
  // by the coordinator's join agent (kJoin); the coordinator tells every member (JOINING);
  // each member fetches r's address, reconnects to it (Engine::reset_peer: new generation in
  // the tags, streams from message 0), publishes its own address for r and ACCEPTs; r finds
  // those addresses, connects to every member and says HELLO to the coordinator, which admits
  // it in the next view. What blocks (the store) runs on the agent thread.

  // Streams with `p` start over (its new incarnation, or this rank's first contact with it).
  void reset_streams(net::Endpoint& ep, int p) {
    for (In* in : {&up_in_[size_t(p)], &down_in_[size_t(p)]}) {
      if (in->req && !in->req->done()) ep.cancel(in->req);
      in->req.reset();
      in->next = 0;
    }
    post_up_recv(ep, p);
    post_down_recv(ep, p);
    up_out_next_[size_t(p)] = 0;
    out_next_[size_t(p)] = 0;
    results_to_[size_t(p)] = ResultsTo{};
    told_deposed_[size_t(p)] = false;
    reported_suspect_[size_t(p)] = false;
  }

  void connect_peer(net::Endpoint& ep, int p, const std::string& address, uint32_t inc) {
    engine_.reset_peer(p, address, inc);
    inc_[size_t(p)] = inc;
    reset_streams(ep, p);
  }

  // What a joiner must share with every member: the communicator's settings and the caller's.
  std::string join_settings(net::Endpoint& ep) const {
    return Communicator::settings_text(ep, copts_) + o_.agreed;
  }

  std::string own_join_value(net::Endpoint& ep) const {
    JoinValue v;
    v.incarnation = my_inc_;
    v.coordinator = coord_;
    v.epoch = view_.epoch;
    v.members = view_.members;
    v.settings = join_settings(ep);
    v.address = ep.published_address();
    return encode_join_value(v);
  }

  // JOINING(r, inc): fetch r's address (agent), then reconnect and accept (poll_agent).
  void apply_joining(int r, uint32_t inc) {
    if (r == rank_ || inc <= inc_[size_t(r)]) return;
    member_joins_[r] = MemberJoin{inc, join_key(instance_, r, inc, rank_)};
    spdlog::info("rank {}: quorum: rank {} comes back (incarnation {}); reconnecting", rank_, r,
                 inc);
    std::lock_guard<std::mutex> lock(sh_->mu);
    sh_->agent.fetch.push_back(
        {r, inc, join_key(instance_, r, inc, r), Clock::now() + o_.deadline});
    sh_->agent_cv.notify_all();
  }

  // What the join agent handed back since the last pass (JoinAgentIo's agent -> service part).
  struct AgentOutput {
    std::deque<std::string> published;
    std::deque<std::tuple<int, uint32_t, std::string>> fetched;
    std::deque<std::pair<int, uint32_t>> found;
    std::deque<std::pair<int, std::string>> values;
  };

  bool poll_agent(net::Endpoint& ep) {
    AgentOutput got;
    exchange_with_agent(got);
    bool moved = feed_found_incarnations(ep, got.found);
    moved |= reconnect_to_joiners(ep, got.fetched);
    forget_abandoned_joins();
    moved |= accept_published_joins(ep, got.published);
    moved |= connect_to_members(ep, got.values);
    report_join_stage();
    moved |= say_hello_when_connected(ep);
    return moved;
  }

  // Tells the agent what the coordinator watches and takes what it found.
  void exchange_with_agent(AgentOutput& got) {
    std::lock_guard<std::mutex> lock(sh_->mu);
    JoinAgentIo& a = sh_->agent;
    a.coordinating = coord_state_ != nullptr && !coord_state_->stopped();
    if (a.coordinating) {
      a.incarnations.resize(size_t(world_));
      a.outside.assign(size_t(world_), 1);
      for (int r = 0; r < world_; ++r) a.incarnations[size_t(r)] = coord_state_->incarnation(r);
      for (int r : coord_state_->view().members) a.outside[size_t(r)] = 0;
    }
    got.published.swap(a.published);
    got.fetched.swap(a.fetched);
    got.found.swap(a.found);
    got.values.swap(a.values);
    if (a.finished && joining_ && !admitted_)
      throw JobOver(fmt::format("rank {}: the job finished before this incarnation could "
                                "rejoin it",
                                rank_));
  }

  // The coordinator: new incarnations of ranks outside the view (kJoin).
  bool feed_found_incarnations(net::Endpoint& ep,
                               const std::deque<std::pair<int, uint32_t>>& found) {
    bool moved = false;
    for (auto& [r, inc] : found) {
      if (!coord_state_) continue;
      Event e;
      e.kind = Event::Kind::kJoin;
      e.from = r;
      e.count = inc;
      feed(ep, e);
      moved = true;
    }
    return moved;
  }

  // A member: the joiners' addresses it fetched; it reconnects and publishes its own.
  bool reconnect_to_joiners(net::Endpoint& ep,
                            const std::deque<std::tuple<int, uint32_t, std::string>>& fetched) {
    bool moved = false;
    for (auto& [r, inc, value] : fetched) {
      auto it = member_joins_.find(r);
      if (it == member_joins_.end() || it->second.incarnation != inc || it->second.connected)
        continue;
      try {
        const JoinValue v = decode_join_value(value, world_, join_key(instance_, r, inc, r));
        if (v.incarnation != inc)
          throw ProtocolError(fmt::format("rank {}'s record names incarnation {}, not {}", r,
                                          v.incarnation, inc));
        // A joiner of another build or settings is not accepted (it finds out itself from
        // this rank's record, which it still gets).
        const std::string why =
            Communicator::settings_difference(join_settings(ep), rank_, v.settings, r);
        if (!why.empty()) {
          spdlog::error("rank {}: quorum: rank {} (incarnation {}) cannot rejoin: {}", rank_, r,
                        inc, why);
          it->second.refused = true;
        }
        connect_peer(ep, r, v.address, inc);
      } catch (const std::exception& e) {
        spdlog::warn("rank {}: quorum: cannot reconnect to rank {} (incarnation {}): {}", rank_,
                     r, inc, e.what());
        member_joins_.erase(it);
        continue;
      }
      it->second.connected = true;
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->agent.publish.emplace_back(it->second.key, own_join_value(ep));
      sh_->agent_cv.notify_all();
      moved = true;
    }
    return moved;
  }

  // A join the coordinator gave up on (the joiner never published, or left) is forgotten
  // here too, after twice the time the coordinator waits for it.
  void forget_abandoned_joins() {
    for (auto it = member_joins_.begin(); it != member_joins_.end();) {
      if (Clock::now() - it->second.started > 2 * o_.deadline)
        it = member_joins_.erase(it);
      else
        ++it;
    }
  }

  // A member: its record for a joiner is published; it ACCEPTs the joiner (unless refused).
  bool accept_published_joins(net::Endpoint& ep, const std::deque<std::string>& published) {
    bool moved = false;
    for (auto& key : published) {
      for (auto it = member_joins_.begin(); it != member_joins_.end(); ++it) {
        if (it->second.key != key) continue;
        if (!it->second.refused) {
          Event e;
          e.suspect = it->first;
          e.count = it->second.incarnation;
          send_up(ep, UpKind::kAccept, e);
        }
        member_joins_.erase(it);
        moved = true;
        break;
      }
    }
    return moved;
  }

  bool connect_to_members(net::Endpoint& ep,
                          const std::deque<std::pair<int, std::string>>& values) {
    bool moved = false;
    for (auto& [p, value] : values) {
      // The joiner: member p's address for this incarnation.
      JoinValue v;
      std::string why;
      try {
        v = decode_join_value(value, world_, join_key(instance_, rank_, my_inc_, p));
        why = Communicator::settings_difference(join_settings(ep), rank_, v.settings, p);
        if (why.empty()) {
          connect_peer(ep, p, v.address, v.incarnation);
          // Providers that connect on first use (ofi_rxm over tcp: a handshake that needs
          // both sides' progress) do it now, while the members step without this rank, and
          // not in the first ring step that counts it.
          Event warm;
          warm.from = rank_;
          warm.completed = completed_;
          send_up_to(ep, p, UpKind::kWarm, warm);
        }
      } catch (const std::exception& e) {
        throw ConfigError(fmt::format("rank {}: rejoin: cannot connect to rank {}: {}", rank_,
                                      p, e.what()));
      }
      if (!why.empty())
        throw ConfigError(fmt::format("rank {}: cannot rejoin the job: settings differ: {}; "
                                      "every rank must run the same build, configuration and "
                                      "settings",
                                      rank_, why));
      joiner_connected_.insert(p);
      if (v.epoch >= joiner_epoch_ && v.coordinator >= 0) {
        joiner_epoch_ = v.epoch;
        joiner_coord_ = v.coordinator;
        joiner_members_ = v.members;
      }
      moved = true;
    }
    return moved;
  }

  // The joiner: what it waits for (QuorumAllreduce's join stage).
  void report_join_stage() {
    if (joining_ && !admitted_ && !hello_sent_ && joiner_coord_ >= 0) {
      std::vector<int> missing;
      for (int m : joiner_members_)
        if (m != rank_ && !joiner_connected_.count(m)) missing.push_back(m);
      std::lock_guard<std::mutex> lock(sh_->mu);
      if (missing.empty() && joiner_connected_.count(joiner_coord_)) {
        sh_->join_stage = fmt::format(
            "connected to the members {}; waiting for the coordinator (rank {}) to admit it",
            joiner_members_, joiner_coord_);
        sh_->agent.searching = false;
      } else {
        sh_->join_stage = fmt::format(
            "waiting for members {} of {} to reconnect to this incarnation", missing,
            joiner_members_);
      }
    }
  }

  // The joiner, connected to the coordinator and every member: HELLO to the coordinator.
  bool say_hello_when_connected(net::Endpoint& ep) {
    if (joining_ && !admitted_ && !hello_sent_ && joiner_coord_ >= 0 &&
        joiner_connected_.count(joiner_coord_) &&
        std::all_of(joiner_members_.begin(), joiner_members_.end(), [&](int m) {
          return m == rank_ || joiner_connected_.count(m) != 0;
        })) {
      hello_sent_ = true;
      coord_ = joiner_coord_;
      last_down_ = Clock::now();
      Event e;
      e.from = rank_;
      e.completed = completed_;
      e.count = my_inc_;
      send_up_to(ep, coord_, UpKind::kHello, e);
      return true;
    }
    return false;
  }

  // State transfer: the donor's sends (send_state), the joiner's receive (receive_state).
  bool poll_state(net::Endpoint& ep) {
    std::deque<QuorumAllreduce::Shared::StateOut> out;
    size_t want = 0;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      out.swap(sh_->state_out);
      if (!state_req_ && !sh_->state_done) want = sh_->state_len;
    }
    bool moved = false;
    for (auto& st : out) {
      auto req = ep.isend(st.to, net::make_tag(net::Op::kQuorumState, st.step, chunk(rank_)),
                          st.buf->data(), st.buf->size());
      sends_.push_back({req, st.buf, st.to, false, inc_[size_t(st.to)]});
      moved = true;
    }
    if (want > 0 && admitted_ && joining_) {
      state_buf_ = std::make_shared<Bytes>(want);
      state_req_ = ep.irecv(donor_, net::make_tag(net::Op::kQuorumState, join_step_, chunk(donor_)),
                            state_buf_->data(), want);
      moved = true;
    }
    if (state_req_ && (state_req_->done() || !view_.has(donor_))) {
      std::lock_guard<std::mutex> lock(sh_->mu);
      if (!state_req_->done()) {
        ep.cancel(state_req_);
        sh_->state_error = fmt::format("the donor, rank {}, left the view before its state came",
                                       donor_);
      } else if (!state_req_->ok()) {
        sh_->state_error = fmt::format("the state from rank {} failed: {}", donor_,
                                       state_req_->error);
      } else {
        sh_->state_in = state_buf_;
        sh_->state_bytes = state_req_->bytes;
      }
      sh_->state_done = true;
      sh_->agent.watch_end = false;
      state_req_.reset();
      sh_->cv.notify_all();
      moved = true;
    }
    return moved;
  }

  // ---- streams. Up: rank -> coordinator, (kQuorumReady, n, sender). Down: coordinator ->
  // rank, (kQuorumDecide, n, coordinator). Exact tags numbered per stream, never ignore
  // masks: libfabric 1.17's shm provider loses unexpected messages matched through one.
  void post_up_recv(net::Endpoint& ep, int p) {
    In& in = up_in_[size_t(p)];
    in.msg.resize(qwire::up_capacity(world_));
    in.req = ep.irecv(p, net::make_tag(net::Op::kQuorumReady, in.next, chunk(p)), in.msg.data(),
                      in.msg.size());
  }
  void post_down_recv(net::Endpoint& ep, int p) {
    In& in = down_in_[size_t(p)];
    in.msg.resize(qwire::down_capacity(world_));
    in.req = ep.irecv(p, net::make_tag(net::Op::kQuorumDecide, in.next, chunk(p)), in.msg.data(),
                      in.msg.size());
  }
  void send_up(net::Endpoint& ep, UpKind type, Event e) {
    e.kind = type;
    e.from = rank_;
    e.completed = completed_;
    if (coord_state_) {
      // The coordinator's own messages go straight into its state machine.
      self_events_.push_back(e);
      return;
    }
    if (takeover_) return;  // collecting acks: this rank is about to coordinate
    if (coord_ < 0) return;  // a joiner that has not reached the coordinator yet
    send_up_to(ep, coord_, type, e);
  }
  // On the up stream to `to` (the coordinator, or a deposed one told so).
  void send_up_to(net::Endpoint& ep, int to, UpKind type, Event e) {
    e.kind = type;
    auto buf = std::make_shared<std::vector<char>>(qwire::encode_up(world_, e));
    auto req = ep.isend(to, net::make_tag(net::Op::kQuorumReady, up_out_next_[size_t(to)]++,
                                          chunk(rank_)),
                        buf->data(), buf->size());
    sends_.push_back({req, buf, to, false, inc_[size_t(to)]});
  }
  // The coordinator's message to every other member of the view in force (one encoding).
  void broadcast_down(net::Endpoint& ep, const qproto::Down& m) {
    auto buf = std::make_shared<std::vector<char>>(qwire::encode_down(world_, m));
    for (int r : coord_state_->view().members)
      if (r != rank_) send_down(ep, r, buf);
  }
  void send_down(net::Endpoint& ep, int to, const std::shared_ptr<std::vector<char>>& buf) {
    auto req = ep.isend(to, net::make_tag(net::Op::kQuorumDecide, out_next_[size_t(to)]++, chunk(rank_)),
                        buf->data(), buf->size());
    sends_.push_back({req, buf, to, false, inc_[size_t(to)]});
  }

  // ---- the coordinator: messages in, actions out.
  // Whether the next message of a stream is in. A failed receive ends the stream: the error
  // concerns that peer only, which falls silent and leaves the view.
  bool arrived(In& in, int from) {
    if (!in.req || !in.req->done()) return false;
    if (in.req->ok()) return true;
    if (in.req->state != net::RequestState::kCancelled)
      spdlog::warn("rank {}: quorum: receive from rank {} failed: {}", rank_, from,
                   in.req->error);
    in.req.reset();
    return false;
  }

  // Messages to a coordinator: fed to this rank's state machine when it coordinates, kept
  // while it gathers the acks of a takeover, dropped otherwise (stale).
  bool poll_up(net::Endpoint& ep) {
    bool moved = false;
    // What this pass finds goes into the state machine together (handle's `more`), this
    // rank's own messages included, so that a decision counts every contribution already in.
    std::vector<Event> batch;
    for (int from = 0; from < world_; ++from) {
      if (from == rank_) continue;
      In& in = up_in_[size_t(from)];
      if (!arrived(in, from)) continue;
      moved = true;
      Event e = qwire::decode_up(in.msg.data(), in.req->bytes, world_, from);
      const UpKind type = e.kind;
      ++in.next;
      post_up_recv(ep, from);
      --from;  // the next message of this peer may be waiting already
      if (type == UpKind::kWarm) continue;  // it has done its work: the connection is open
      if (type == UpKind::kDeposed) {
        if (coord_state_)
          throw Evicted(fmt::format(
              "rank {}: evicted from the job: while this rank (the coordinator) was unreachable, "
              "another rank took over from it (rank {} says so); it must leave (exit)",
              rank_, e.from));
        continue;
      }
      if (type == UpKind::kShard) {
        // A part of a report: kept for gather_reports() (when this rank coordinates, or is
        // about to), and a sign of life like a heartbeat.
        if (coord_state_ || takeover_)
          sh_->keep_report(e.step, e.attempt, uint32_t(e.count), std::move(e.values));
        e.values.clear();
      }
      if (takeover_) {
        if (type == UpKind::kAck && e.epoch == takeover_->epoch)
          takeover_->acks[e.from] = e;
        else
          takeover_->early.push_back(e);
      } else if (coord_state_) {
        batch.push_back(std::move(e));
      }
    }
    if (!coord_state_) return moved;
    while (!self_events_.empty()) {
      batch.push_back(self_events_.front());
      self_events_.pop_front();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      feed(ep, batch[i], /*resync=*/false, /*more=*/i + 1 < batch.size());
      if (!coord_state_) break;
    }
    moved |= !batch.empty();
    if (coord_state_) moved |= drain_self(ep);  // what the batch's actions sent to this rank
    auto now = Clock::now();
    if (!bye_sent_ && now - last_tick_ >= std::chrono::microseconds(200)) {
      last_tick_ = now;
      feed(ep, Event{});
    }
    return moved;
  }

  bool drain_self(net::Endpoint& ep) {
    bool moved = false;
    while (!self_events_.empty()) {
      Event e = self_events_.front();
      self_events_.pop_front();
      feed(ep, e);
      moved = true;
    }
    return moved;
  }

  void feed(net::Endpoint& ep, const Event& e, bool resync = false, bool more = false) {
    auto now = Clock::now();
    // This process may have been stopped since the last pass (SIGSTOP lands anywhere, also
    // inside this pass): the others' silence across the pause is no evidence.
    if (resync || now - last_pass_ > heartbeat_ * 2) {
      coord_state_->resync(now);
      last_pass_ = last_down_ = now;
    }
    std::vector<qproto::Down> acts = coord_state_->handle(e, now, more);
    for (auto& a : acts) act(ep, a);
  }

  void act(net::Endpoint& ep, const qproto::Down& m) {
    if (m.kind == DownKind::kEvicted) {
      send_down(ep, m.to, std::make_shared<std::vector<char>>(qwire::encode_down(world_, m)));
      return;
    }
    // To the members of the view in force (for a VIEW: the new one).
    broadcast_down(ep, m);
    last_down_ = Clock::now();
    apply(ep, m);
  }

  // ---- every rank: the coordinator's messages, in the order it sent them.
  // Messages of coordinators, each stream in the order it was sent: the current
  // coordinator's are applied, a takeover is answered, a deposed coordinator's are dropped.
  bool poll_down(net::Endpoint& ep) {
    bool moved = false;
    for (int from = 0; from < world_; ++from) {
      if (from == rank_) continue;
      In& in = down_in_[size_t(from)];
      while (arrived(in, from)) {
        moved = true;
        qproto::Down m = qwire::decode_down(in.msg.data(), in.req->bytes, world_, from);
        ++in.next;
        post_down_recv(ep, from);
        if (m.kind == DownKind::kTakeover) {
          answer_takeover(ep, from, m.view);
        } else if (from == coord_ && !coord_state_) {
          last_down_ = Clock::now();
          heard_coordinator_ = true;
          apply(ep, m);
        } else if (!told_deposed_[size_t(from)] && m.kind != DownKind::kBye) {
          // A coordinator that was replaced while it was unreachable: tell it, once.
          told_deposed_[size_t(from)] = true;
          Event e;
          e.from = rank_;
          send_up_to(ep, from, UpKind::kDeposed, e);
        }
      }
    }
    return moved;
  }

  void apply(net::Endpoint& ep, const qproto::Down& m) {
    switch (m.kind) {
      case DownKind::kHeartbeat:
      case DownKind::kTakeover:  // answered in poll_down
        return;
      case DownKind::kBye:
        coordinator_done_ = true;  // its silence from now on is no failure
        return;
      case DownKind::kEvicted:
        throw Evicted(fmt::format(
            "rank {}: evicted from the job: the other ranks stopped waiting for this one (silent "
            "for more than quorum.evict_ms = {} ms, or unreachable); it must leave (exit)",
            rank_, o_.evict.count()));
      case DownKind::kFatal: {
        std::vector<int> gone;
        for (int r = 0; r < world_; ++r)
          if (!view_.has(r)) gone.push_back(r);
        throw QuorumLost(fmt::format("rank {}: the job stops: {}", rank_, m.reason), gone);
      }
      case DownKind::kView:
        apply_view(m);
        return;
      case DownKind::kRecover:
        apply_recover(ep, m.step, m.attempt);
        return;
      case DownKind::kDecide:
        apply_decide(ep, m.decide);
        return;
      case DownKind::kJoining:
        apply_joining(m.joiner, m.incarnation);
        return;
    }
  }

  void apply_view(const qproto::Down& m) {
    if (m.view.epoch <= view_.epoch)
      throw ProtocolError(fmt::format("rank {}: quorum: view {} after view {}", rank_,
                                      m.view.epoch, view_.epoch));
    view_ = m.view;
    ViewChange v;
    v.epoch = view_.epoch;
    v.members = view_.members;
    for (auto& d : m.left) v.left.push_back({d.rank, qproto::to_string(d.why), d.silent_ms});
    for (auto& j : m.joined) {
      v.joined.push_back({j.rank, j.incarnation, j.step, j.donor});
      join_step_of_[size_t(j.rank)] = j.step;
      if (j.rank == rank_ && joining_ && !admitted_ && j.incarnation == my_inc_) {
        admitted_ = true;
        join_step_ = j.step;
        donor_ = j.donor;
        completed_ = int64_t(j.step) - 1;
        heard_coordinator_ = true;
        last_down_ = Clock::now();
        JoinInfo info;
        info.step = j.step;
        info.donor = j.donor;
        info.epoch = view_.epoch;
        info.members = view_.members;
        info.join_ms = ms_between(created_, Clock::now());
        std::lock_guard<std::mutex> lock(sh_->mu);
        sh_->joined_info = info;
        sh_->members = view_.members;
        sh_->coordinator = coord_;
        sh_->cv.notify_all();
      } else if (j.rank != rank_) {
        // Every member learns it with step j.step's result (QuorumResult::joined).
        std::lock_guard<std::mutex> lock(sh_->mu);
        sh_->steps[j.step].joined.push_back({j.rank, j.incarnation, j.step, j.donor});
      }
    }
    v.seen = Clock::now();
    std::string who;
    for (auto& d : v.left)
      who += fmt::format("{}rank {} ({}, last heard {:.0f} ms before)", who.empty() ? "" : ", ",
                         d.rank, d.why, d.silent_ms);
    if (rank_ == coord_)
      spdlog::warn("quorum: view {}: members {}; left: {}", v.epoch, v.members, who);
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->views.push_back(std::move(v));
      sh_->cv.notify_all();  // gather_reports stops waiting for ranks that left
    }
    if (!view_.has(rank_))
      throw Evicted(fmt::format("rank {}: evicted from the job in view {} (members {}): the "
                                "other ranks stopped waiting for this one; it must leave (exit)",
                                rank_, view_.epoch, view_.members));
    // Results owed to ranks that left are no longer sent.
    for (auto& d : m.left) results_to_[size_t(d.rank)].queued.clear();
    // A rank that left may come back (rejoin): what reconnecting to it needs is made now,
    // beside the view change, not later while the others step (connect_peer).
    if (o_.store)
      for (auto& d : m.left) engine_.prepare_reset_peer(d.rank);
  }

  // A member was lost while step t may be unfinished: say whether this rank holds the result;
  // if not, stop working on it (its reduction can no longer complete as decided) and wait for
  // the step to be decided again.
  void apply_recover(net::Endpoint& ep, uint64_t t, uint32_t attempt) {
    if (joining_ && t < join_step_) {
      // Before this rank (re)joined: it takes no part in that step.
      Event e;
      e.step = t;
      e.attempt = attempt;
      e.absent = true;
      send_up(ep, UpKind::kReport, e);
      return;
    }
    bool have = done_.count(t) != 0;
    if (!have) {
      // The other members may have sent this step's messages already, or still send them
      // until they hear of the recovery too: what is left is discarded (EngineOp::abandon),
      // not left to hold back their later sends to this rank.
      const Deadline until = Clock::now() + o_.deadline;
      auto r = rings_.find(t);
      if (r != rings_.end()) {
        r->second.op->abandon(ep, until);
        rings_.erase(r);
      }
      auto rr = result_recvs_.find(t);
      if (rr != result_recvs_.end()) {
        const ResultRecv& x = rr->second;
        if (!x.req->done() && ep.cancel(x.req)) ep.discard(x.from, x.req->tag, x.req->len, until);
        result_recvs_.erase(rr);
      }
    }
    Event e;
    e.step = t;
    e.attempt = attempt;
    e.have = have;
    send_up(ep, UpKind::kReport, e);
  }

  std::shared_ptr<Bytes> result_buffer() {
    for (auto& b : pool_)
      if (b.use_count() == 1) return b;
    pool_.push_back(std::make_shared<Bytes>(count_ * esz_));
    return pool_.back();
  }

  // Contributions made by the caller: READY to the coordinator.
  bool take_events(net::Endpoint& ep) {
    std::deque<uint64_t> ev;
    std::deque<QuorumAllreduce::Shared::Report> reports;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      ev.swap(sh_->ready_events);
      reports.swap(sh_->reports_out);
      for (uint64_t t : ev) {
        auto it = sh_->steps.find(t);
        if (it != sh_->steps.end() && it->second.digest) digests_[t] = *it->second.digest;
      }
    }
    for (uint64_t t : ev) {
      awaiting_decide_.insert(t);
      if (speculate_) start_speculative_ring(ep, t);
      send_up(ep, UpKind::kReady, ready_event(t));
    }
    for (auto& r : reports) {
      if (coord_state_) {
        sh_->keep_report(r.key, r.part, r.parts, std::move(r.values));
        continue;
      }
      Event e;
      e.step = r.key;
      e.attempt = r.part;
      e.count = r.parts;
      e.values = std::move(r.values);
      send_up(ep, UpKind::kShard, e);
    }
    return !ev.empty() || !reports.empty();
  }

  // The READY of step t (sent again to a coordinator that takes over).
  Event ready_event(uint64_t t) const {
    Event e;
    e.step = t;
    e.count = count_;
    e.layout = cfg_.layout;
    auto d = digests_.find(t);
    if (d != digests_.end()) e.digest = d->second;
    return e;
  }

  // With quorum = world (no rank may be lost), S(t) can only be every rank, so once one step
  // has been decided OK (which proves every rank set this all-reduce up with the same count)
  // the ring starts at contribute time, in parallel with READY/DECIDE, instead of a round trip
  // through the coordinator later. The step completes when both the ring and the DECIDE are
  // in; a DECIDE that reports a timeout aborts the ring.
  void start_speculative_ring(net::Endpoint& ep, uint64_t t) {
    void* buf;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      buf = sh_->steps[t].buf;
    }
    start_ring(ep, t, 0, buf, nullptr, view_.members, /*speculative=*/true);
  }

  // In place (out == nullptr) or from the kept contribution into `out`.
  void start_ring(net::Endpoint& ep, uint64_t t, uint32_t attempt, void* buf, void* out,
                  std::vector<int> members, bool speculative) {
    CollArgs a;
    a.kind = CollKind::kAllreduce;
    a.send = buf;
    a.recv = out ? out : buf;
    a.count = count_;
    a.type = o_.type;
    a.op = o_.mean ? RedOp::kAvg : RedOp::kSum;
    a.tag_op = net::Op::kQuorumData;
    a.members = members;
    auto op = make_collective_op(engine_, copts_, a);
    op->seq = uint32_t(attempt_seq(t, attempt));
    op->start(ep);
    rings_[t] = Ring{std::move(op), Clock::now(), std::move(members), attempt, speculative, false};
  }

  // Results to a rank outside S(t): at most two in flight to one rank, later ones wait here
  // (they are kept until every live rank has the step anyway), so a rank that stops reading
  // holds no more than that in the transport; it leaves the view when it falls silent.
  void send_result(net::Endpoint& ep, uint64_t t, uint32_t attempt, int to,
                   const std::shared_ptr<Bytes>& buf) {
    ResultsTo& q = results_to_[size_t(to)];
    q.queued.push_back({t, attempt, buf});
    flush_results(ep, to);
  }
  void flush_results(net::Endpoint& ep, int to) {
    ResultsTo& q = results_to_[size_t(to)];
    while (q.in_flight < 2 && !q.queued.empty()) {
      auto r = std::move(q.queued.front());
      q.queued.pop_front();
      auto req = ep.isend(to, net::make_tag(net::Op::kQuorumResult, attempt_seq(r.step, r.attempt),
                                            chunk(0)),
                          r.buf->data(), r.buf->size());
      ++q.in_flight;
      sends_.push_back({req, r.buf, to, true, inc_[size_t(to)]});
    }
  }

  // A transport error with `peer`: the coordinator evicts it if it also misses a heartbeat.
  void suspect(net::Endpoint& ep, int peer, const std::string& what) {
    if (peer < 0 || peer >= world_ || peer == rank_ || reported_suspect_[size_t(peer)]) return;
    reported_suspect_[size_t(peer)] = true;
    spdlog::warn("rank {}: quorum: rank {} is unreachable ({}); telling the coordinator", rank_,
                 peer, what);
    Event e;
    e.suspect = peer;
    send_up(ep, UpKind::kSuspect, e);
  }

  void apply_decide(net::Endpoint& ep, const qproto::Decision& d) {
    const uint64_t t = d.step;
    if (joining_ && t < join_step_) return;  // decided again, before this rank (re)joined
    if (d.epoch != view_.epoch)
      throw ProtocolError(fmt::format("rank {}: quorum step {} decided in view {}, this rank is "
                                      "in view {}",
                                      rank_, t, d.epoch, view_.epoch));
    record_decision(d);
    QuorumResult res = decided_result(d);
    throw_if_failed(d, res);
    if (d.attempt == 0) {
      awaiting_decide_.erase(t);
      digests_.erase(t);
    }
    if (d.attempt > 0 && d.source >= 0 && !forward_held_result(ep, d)) return;
    if (d.attempt > 0 && done_.count(t))
      throw ProtocolError(fmt::format("rank {}: quorum step {} decided again after it completed here",
                                      rank_, t));

    DecidedStep s;
    if (!settle_decided_step(d, res, s)) return;  // skipped
    // Every rank applies every DECIDE in step order, so all switch to speculation together.
    if (!tolerant_ && o_.quorum == world_) speculate_ = true;
    if (s.finished) {
      sh_->cv.notify_all();
      mark_done(t, nullptr);
    }
    if (s.cb) s.cb(t);
    if (s.spec) return;
    if (d.attempt > 0 && d.source >= 0) {
      post_result_recv(ep, t, d.attempt, d.source, s.out);
    } else if (res.self_counted) {
      start_ring(ep, t, d.attempt, s.buf, tolerant_ ? s.out->data() : nullptr, d.contributors,
                 /*speculative=*/false);
    } else {
      post_result_recv(ep, t, d.attempt,
                       d.contributors[size_t(rank_) % d.contributors.size()], s.out);
    }
  }

  // Forgets the steps every live rank holds (d.settled) and keeps the decision of a step
  // with a result.
  void record_decision(const qproto::Decision& d) {
    const uint64_t t = d.step;
    if (d.settled >= 0) {
      done_.erase(done_.begin(), done_.upper_bound(uint64_t(d.settled)));
      kept_.erase(kept_.begin(), kept_.upper_bound(uint64_t(d.settled)));
      decisions_.erase(decisions_.begin(), decisions_.upper_bound(uint64_t(d.settled)));
    }
    if (d.status == qproto::Status::kOk || d.status == qproto::Status::kSkipped) {
      auto& k = decisions_[t];
      if (d.attempt >= k.attempt) k = {t, d.attempt, d.status == qproto::Status::kSkipped, d.contributors};
      while (decisions_.size() > qwire::kMaxKnown) decisions_.erase(decisions_.begin());
    }
  }

  // The step's QuorumResult as the DECIDE gives it (reduce_ms and wait_ms come later).
  QuorumResult decided_result(const qproto::Decision& d) const {
    QuorumResult res;
    res.step = d.step;
    res.epoch = d.epoch;
    res.attempt = d.attempt;
    res.contributors.assign((size_t(world_) + 7) / 8, 0);
    for (int r : d.contributors) res.contributors[size_t(r) / 8] |= uint8_t(1u << (r % 8));
    for (int r = 0; r < world_; ++r) {
      if (!res.contains(r)) res.dropped.push_back(r);
      int64_t off = size_t(r) < d.offsets_us.size() ? d.offsets_us[size_t(r)] : -1;
      res.ready_offsets_ms.push_back(off < 0 ? -1.0 : double(off) / 1000.0);
    }
    res.count = int(d.contributors.size());
    res.quorum = d.quorum;
    res.self_counted = res.contains(rank_);
    res.ready_ms = res.ready_offsets_ms[size_t(rank_)];
    res.decide_ms = double(d.decide_us) / 1000.0;
    return res;
  }

  // A step that failed (timeout, or ranks that disagree on the all-reduce) throws here.
  void throw_if_failed(const qproto::Decision& d, const QuorumResult& res) const {
    const uint64_t t = d.step;
    if (d.status == qproto::Status::kTimeout) {
      throw QuorumTimeout(
          fmt::format("rank {}: quorum step {} failed: only {} of {} ranks contributed within "
                      "the hard deadline of {} ms (quorum {}); ranks that never contributed: {}",
                      rank_, t, res.count, world_, o_.deadline.count(), d.quorum, res.dropped),
          res.dropped);
    }
    if (d.status == qproto::Status::kMismatch) {
      auto layout = [](uint64_t count, uint32_t l) {
        const auto type = DataType(l >> 8);
        return fmt::format("{} elements of {} ({})", count,
                           uint8_t(type) <= uint8_t(DataType::kBFloat16)
                               ? std::string(to_string(type))
                               : fmt::format("type {}", l >> 8),
                           (l & 1) ? "mean" : "sum");
      };
      if (d.bad_rank == rank_)
        throw UsageError(fmt::format(
            "rank {}: quorum step {}: ranks disagree on the all-reduce: rank {} contributes {} "
            "(this rank), which is not what the coordinator (rank {}) contributes",
            rank_, t, rank_, layout(count_, cfg_.layout), coord_));
      throw UsageError(fmt::format(
          "rank {}: quorum step {}: ranks disagree on the all-reduce: rank {} contributes {}, "
          "rank {} {}",
          rank_, t, d.bad_rank, layout(d.bad_count, d.bad_layout), rank_,
          layout(count_, cfg_.layout)));
    }
  }

  // A step decided again (d.attempt > 0) with a holder of its result (d.source). Returns
  // whether this rank needs the result.
  bool forward_held_result(net::Endpoint& ep, const qproto::Decision& d) {
    const uint64_t t = d.step;
    // Someone holds the result: it sends it to those that do not.
    if (d.source == rank_) {
      auto it = kept_.find(t);
      if (it == kept_.end())
        throw ProtocolError(fmt::format(
            "rank {}: quorum step {}: asked to forward a result it does not hold", rank_, t));
      for (int x : d.needers) send_result(ep, t, d.attempt, x, it->second);
    }
    return std::binary_search(d.needers.begin(), d.needers.end(), rank_);
  }

  // What apply_decide does after recording the decision in the step (settle_decided_step).
  struct DecidedStep {
    void* buf = nullptr;
    std::shared_ptr<Bytes> out;
    std::function<void(uint64_t)> cb;
    bool spec = false, finished = false;
  };

  // Records the decision in the caller's view of the step. A skipped step is complete here
  // (returns false); otherwise `ds` says where its result comes from.
  bool settle_decided_step(const qproto::Decision& d, QuorumResult& res, DecidedStep& ds) {
    const uint64_t t = d.step;
    std::lock_guard<std::mutex> lock(sh_->mu);
    StepLocal& s = sh_->steps[t];
    if (d.status == qproto::Status::kSkipped) {
      res.skipped = true;
      res.self_counted = false;
      s.decided = true;
      s.result = res;
      s.done = true;
      sh_->members = view_.members;
      sh_->cv.notify_all();
      mark_done(t, nullptr);
      return false;
    }
    ds.spec = s.ring_finished || rings_.count(t);
    if (ds.spec && res.count != world_)
      throw ProtocolError(fmt::format(
          "rank {}: quorum step {} decided {} of {} contributors with quorum = world", rank_, t,
          res.count, world_));
    s.decided = true;
    double reduce_ms = s.result.reduce_ms;
    s.result = res;
    sh_->members = view_.members;
    if (s.ring_finished) {
      s.result.reduce_ms = reduce_ms;
      s.done = ds.finished = true;
    }
    if (res.self_counted) {
      if (!s.contributed)
        throw ProtocolError(
            fmt::format("rank {}: counted in step {} without contributing", rank_, t));
      ds.buf = s.buf;
      s.excluded = false;  // a late contribution counted when the step was decided again
    } else {
      if (!s.excluded) ds.cb = sh_->on_excluded;
      s.excluded = true;
    }
    if (!ds.spec && (tolerant_ || !res.self_counted)) {
      if (!s.out) s.out = result_buffer();
      ds.out = s.out;
    }
    return true;
  }

  void post_result_recv(net::Endpoint& ep, uint64_t t, uint32_t attempt, int from,
                        const std::shared_ptr<Bytes>& out) {
    auto req = ep.irecv(from, net::make_tag(net::Op::kQuorumResult, attempt_seq(t, attempt), chunk(0)),
                        out->data(), count_ * esz_);
    result_recvs_[t] = ResultRecv{req, from, Clock::now()};
  }

  // Step t's result is complete on this rank.
  void mark_done(uint64_t t, std::shared_ptr<Bytes> out) {
    completed_ = std::max(completed_, int64_t(t));
    if (tolerant_) {
      done_.insert(t);
      if (out) kept_[t] = std::move(out);
    }
  }

  bool advance_rings(net::Endpoint& ep) {
    bool moved = false;
    for (auto it = rings_.begin(); it != rings_.end();) {
      Ring& ring = it->second;
      try {
        bool m = ring.op->advance(ep);
        moved |= m;
        if (m && !ring.phase_told) {
          ring.phase_told = true;
          std::function<void(uint64_t, const char*)> cb;
          {
            std::lock_guard<std::mutex> lock(sh_->mu);
            cb = sh_->on_phase;
          }
          if (cb) cb(it->first, "ring");
        }
      } catch (const std::exception& e) {
        if (!tolerant_) throw;
        // A peer of this ring failed: the coordinator evicts it (it falls silent) and decides
        // the step again; the deadline below bounds the wait if it does not.
        spdlog::warn("rank {}: quorum step {}: the reduction among {} failed: {}; waiting for "
                     "the coordinator to decide the step again",
                     rank_, it->first, ring.members, e.what());
        ring.op->abandon(ep, Clock::now() + o_.deadline);
        failed_[it->first] = Clock::now();
        it = rings_.erase(it);
        moved = true;
        continue;
      }
      if (!ring.op->finished()) {
        ++it;
        continue;
      }
      const uint64_t t = it->first;
      double reduce_ms = ms_between(ring.started, Clock::now());
      // Serve the ranks outside S(t) assigned to this member: from the kept result, or (in
      // place) from a staging copy so the caller gets its buffer back now.
      std::vector<int> targets;
      size_t k = ring.members.size();
      for (int x : view_.members) {
        if (std::find(ring.members.begin(), ring.members.end(), x) != ring.members.end()) continue;
        if (join_step_of_[size_t(x)] > t) continue;  // joined after this step: not its result
        if (ring.members[size_t(x) % k] == rank_) targets.push_back(x);
      }
      std::shared_ptr<Bytes> out;
      {
        std::lock_guard<std::mutex> lock(sh_->mu);
        StepLocal& s = sh_->steps[t];
        out = s.out;
        if (!targets.empty()) {
          auto src = out ? out
                         : std::make_shared<Bytes>(static_cast<char*>(s.buf),
                                                   static_cast<char*>(s.buf) + count_ * esz_);
          for (int x : targets) send_result(ep, t, ring.attempt, x, src);
        }
        s.result.reduce_ms = reduce_ms;
        if (s.decided)
          s.done = true;
        else
          s.ring_finished = true;  // speculative: the DECIDE completes the step
      }
      sh_->cv.notify_all();
      mark_done(t, out);
      it = rings_.erase(it);
      moved = true;
    }
    return moved;
  }

  bool poll_results(net::Endpoint& ep) {
    bool moved = false;
    for (auto it = result_recvs_.begin(); it != result_recvs_.end();) {
      if (!it->second.req->done()) {
        ++it;
        continue;
      }
      const uint64_t t = it->first;
      if (!it->second.req->ok()) {
        if (!tolerant_) net::throw_if_failed(*it->second.req, "quorum result receive");
        spdlog::warn("rank {}: quorum step {}: the result from rank {} failed: {}", rank_, t,
                     it->second.from, it->second.req->error);
        suspect(ep, it->second.from, it->second.req->error);
        failed_[t] = Clock::now();
        it = result_recvs_.erase(it);
        moved = true;
        continue;
      }
      std::shared_ptr<Bytes> out;
      {
        std::lock_guard<std::mutex> lock(sh_->mu);
        StepLocal& s = sh_->steps[t];
        s.done = true;
        out = s.out;
      }
      sh_->cv.notify_all();
      mark_done(t, out);
      it = result_recvs_.erase(it);
      moved = true;
    }
    return moved;
  }

  bool reap_sends(net::Endpoint& ep) {
    bool moved = false;
    // What completed sends call for is done after the sweep: it posts new sends, and a
    // deque's iterators do not survive a push_back.
    std::vector<std::pair<int, std::string>> failed;
    std::vector<int> flush;
    for (auto it = sends_.begin(); it != sends_.end();) {
      if (!it->req->done()) {
        ++it;
        continue;
      }
      // A failed send concerns that peer only: it is reported, nothing else is affected.
      if (!it->req->ok() && it->req->state != net::RequestState::kCancelled && !dead_)
        failed.emplace_back(it->peer, it->req->error);
      if (it->result && it->incarnation == inc_[size_t(it->peer)]) {
        --results_to_[size_t(it->peer)].in_flight;
        flush.push_back(it->peer);
      }
      it = sends_.erase(it);
      moved = true;
    }
    for (auto& [peer, error] : failed) suspect(ep, peer, error);
    for (int peer : flush)
      if (view_.has(peer)) flush_results(ep, peer);
    return moved;
  }

  // Every rank tells the coordinator it is alive (with the last step it completed), and the
  // coordinator tells every member, so silence means a stopped or dead process, never a long
  // computation: this runs on the engine thread.
  void heartbeat(net::Endpoint& ep) {
    if (bye_sent_ || (joining_ && !admitted_)) return;
    auto now = Clock::now();
    if (now - last_beat_ < heartbeat_ && completed_ == beat_completed_) return;
    if (now - last_beat_ < heartbeat_ / 4) return;
    last_beat_ = now;
    beat_completed_ = completed_;
    if (coord_state_) {
      send_up(ep, UpKind::kHeartbeat, Event{});
      drain_self(ep);
      qproto::Down m;
      m.kind = DownKind::kHeartbeat;
      broadcast_down(ep, m);
    } else {
      send_up(ep, UpKind::kHeartbeat, Event{});
    }
  }

  void check_deadlines(net::Endpoint& ep) {
    auto now = Clock::now();
    if (joining_ && !admitted_) return;  // join() has its own deadline
    // Until the coordinator has spoken once (start-up) the deadline applies.
    const auto silence_limit =
        (heard_coordinator_ ? o_.evict : std::max(o_.evict, o_.deadline)) + heartbeat_;
    if (!coord_state_ && !coordinator_done_ && now - last_down_ > silence_limit && tolerant_) {
      // Failover: the members of the last view other than the coordinator take over in rank
      // order, each after the ones before it had their turn.
      std::vector<int> cands;
      for (int r : view_.members)
        if (r != coord_) cands.push_back(r);
      const auto k = std::find(cands.begin(), cands.end(), rank_) - cands.begin();
      if (!takeover_ && now - last_down_ > silence_limit + k * (o_.evict + heartbeat_))
        start_takeover(ep, cands);
    } else if (!coord_state_ && !coordinator_done_ && now - last_down_ > silence_limit)
      throw QuorumLost(
          fmt::format("rank {}: quorum: the coordinator (rank {}) has been silent for {:.0f} ms "
                      "(quorum.evict_ms = {}); it stopped or died, and a job that cannot lose a "
                      "rank stops",
                      rank_, coord_, ms_between(last_down_, now), o_.evict.count()),
          {coord_});
    if (!coord_state_) {
      // The coordinator decides by (first contribution + H); ours came after the first.
      std::lock_guard<std::mutex> lock(sh_->mu);
      for (auto& [t, s] : sh_->steps) {
        if (s.contributed && !s.decided &&
            now > s.contrib_time + o_.deadline + std::chrono::seconds(2))
          throw QuorumTimeout(fmt::format("rank {}: quorum step {}: no decision from the "
                                          "coordinator (rank {}) within {} ms of contributing",
                                          rank_, t, coord_, o_.deadline.count() + 2000),
                              {coord_});
      }
    }
    for (auto& [t, ring] : rings_) {
      // A speculative ring starts before the coordinator's clock (first READY + H) does:
      // leave the coordinator time to report a QuorumTimeout first.
      auto limit = o_.deadline + (ring.speculative ? std::chrono::milliseconds(2000)
                                                   : std::chrono::milliseconds(0));
      if (now > ring.started + limit)
        throw CollectiveTimeout(fmt::format(
            "rank {}: quorum step {}: the ring reduction among {} timed out after {} ms waiting "
            "for {}",
            rank_, t, ring.members, limit.count(), ring.op->waiting_on()));
    }
    for (auto& [t, rr] : result_recvs_) {
      if (now > rr.started + o_.deadline)
        throw QuorumTimeout(fmt::format("rank {}: quorum step {}: the result from rank {} did not "
                                        "arrive within {} ms",
                                        rank_, t, rr.from, o_.deadline.count()),
                            {rr.from});
    }
    for (auto it = failed_.begin(); it != failed_.end();) {
      if (done_.count(it->first) || rings_.count(it->first) || result_recvs_.count(it->first)) {
        it = failed_.erase(it);  // decided again and under way
        continue;
      }
      if (now > it->second + o_.deadline)
        throw QuorumTimeout(fmt::format("rank {}: quorum step {}: its reduction failed and the "
                                        "step was not decided again within {} ms",
                                        rank_, it->first, o_.deadline.count()),
                            {});
      ++it;
    }
  }

  Engine& engine_;
  CommOptions copts_;
  size_t count_;
  QuorumOptions o_;
  std::shared_ptr<QuorumAllreduce::Shared> sh_;
  int rank_, world_;
  size_t esz_;
  uint32_t instance_;
  qproto::Config cfg_;
  int coord_ = 0;  // the coordinator this rank follows (the lowest live rank after failover)
  bool tolerant_ = false;
  std::chrono::milliseconds heartbeat_{1000};
  bool finished_ = false, dead_ = false, bye_sent_ = false, coordinator_done_ = false;
  std::exception_ptr error_;  // why the service died (told to the callers once)
  bool told_ = false;
  std::vector<std::unique_ptr<EngineOp>> aborted_;  // see reap_aborted()
  bool heard_coordinator_ = false;
  Clock::time_point drain_deadline_{};
  Clock::time_point last_pass_{}, last_down_{}, last_beat_{}, last_tick_{};
  int64_t completed_ = -1, beat_completed_ = -1;
  qproto::View view_;
  // Coordinator.
  std::unique_ptr<qproto::Coordinator> coord_state_;
  std::vector<In> up_in_;  // per peer: its messages to this rank as coordinator
  std::vector<uint64_t> out_next_;  // per destination: number of the next down message
  std::deque<Event> self_events_;
  // Everyone.
  std::vector<In> down_in_;            // per peer: its messages as coordinator
  std::vector<uint64_t> up_out_next_;  // per peer: number of the next message to it
  std::optional<Takeover> takeover_;   // this rank gathers acks to take over
  uint64_t acked_epoch_ = 0;           // the last takeover epoch this rank accepted
  std::vector<bool> told_deposed_;     // per peer: told it that another rank took over
  std::map<uint64_t, qproto::Known> decisions_;  // decisions not yet settled everywhere
  bool speculate_ = false;  // quorum = world and a step was decided OK: start rings early
  std::set<uint64_t> awaiting_decide_;  // steps this rank contributed to, not decided yet
  std::map<uint64_t, uint64_t> digests_;  // their READYs' digests
  std::deque<Send> sends_;
  struct QueuedResult {
    uint64_t step;
    uint32_t attempt;
    std::shared_ptr<Bytes> buf;
  };
  struct ResultsTo {
    int in_flight = 0;
    std::deque<QueuedResult> queued;
  };
  std::vector<ResultsTo> results_to_;  // per rank outside S(t): its results
  std::vector<bool> reported_suspect_;
  std::map<uint64_t, Ring> rings_;
  std::map<uint64_t, ResultRecv> result_recvs_;
  std::map<uint64_t, Clock::time_point> failed_;  // steps whose reduction failed here
  std::set<uint64_t> done_;  // completed here, not yet settled everywhere (tolerant jobs)
  std::map<uint64_t, std::shared_ptr<Bytes>> kept_;  // their results
  std::vector<std::shared_ptr<Bytes>> pool_;
  // Rejoin.
  Clock::time_point created_ = Clock::now();
  uint32_t my_inc_ = 0;               // this process's incarnation
  std::vector<uint32_t> inc_;         // per rank: the incarnation this rank talks to
  std::vector<uint64_t> join_step_of_;  // per rank: the step it (re)joined at (0: at the start)
  std::map<int, MemberJoin> member_joins_;  // ranks coming back that this member reconnects to
  bool joining_ = false;              // this process joins a running job
  bool admitted_ = true;              // ... and has been admitted to a view
  uint64_t join_step_ = 0;
  int donor_ = -1;
  bool hello_sent_ = false;
  std::set<int> joiner_connected_;
  std::vector<int> joiner_members_;
  int joiner_coord_ = -1;
  uint64_t joiner_epoch_ = 0;
  net::RequestPtr state_req_;
  std::shared_ptr<Bytes> state_buf_;
};

}  // namespace

namespace {

// The join agent (QuorumOptions::store): the store look-ups of rejoins, on a thread of their
// own because they block. Every 20 ms it publishes what the service asked for, fetches the
// addresses of joiners for it (members), looks for new incarnations of the ranks outside the
// view every 100 ms (the coordinator), and looks for the members' addresses (a joiner).
// Store errors are logged and retried; they never stop the job (a rank that cannot rejoin
// stays out).
struct JoinAgent {
  std::shared_ptr<QuorumAllreduce::Shared> sh;
  net::Store* store;
  Engine* engine;
  int rank, world;
  uint32_t instance, my_inc;
  Clock::time_point last_watch{}, last_done_check{};
  std::vector<char> found_peer;
  Clock::time_point last_warning{};

  JoinAgent(std::shared_ptr<QuorumAllreduce::Shared> sh, net::Store* store, Engine* engine,
            int rank, int world, uint32_t instance, uint32_t my_inc)
      : sh(std::move(sh)),
        store(store),
        engine(engine),
        rank(rank),
        world(world),
        instance(instance),
        my_inc(my_inc),
        found_peer(size_t(world), 0) {
    found_peer[size_t(rank)] = 1;
  }

  // What the service asks for in one pass (JoinAgentIo's service -> agent part).
  struct Requests {
    std::deque<std::pair<std::string, std::string>> publish;
    std::deque<JoinAgentIo::Fetch> fetch;
    bool coordinating, searching, watch_end;
    std::vector<uint32_t> incs;
    std::vector<char> outside;
  };
  // What a pass could not do yet; the next one tries again.
  struct Retries {
    std::deque<std::pair<std::string, std::string>> publish;
    std::deque<JoinAgentIo::Fetch> fetch;
  };

  void run() {
    using namespace std::chrono_literals;
    while (true) {
      Requests q;
      if (!take_requests(q)) return;
      JoinAgentIo out;
      Retries retry;
      publish_values(q, out, retry);
      fetch_joiners(q, out, retry);
      const auto now = Clock::now();
      if (q.coordinating && now - last_watch >= 100ms) {
        last_watch = now;
        watch_incarnations(q, out);
      }
      if ((q.searching || q.watch_end) && now - last_done_check >= 200ms) {
        last_done_check = now;
        check_job_end(out);
      }
      if (q.searching) search_members(out);
      const bool any = !out.published.empty() || !out.fetched.empty() || !out.found.empty() ||
                       !out.values.empty() || out.finished;
      hand_back(out, retry);
      if (any) engine->kick();
      if (!retry.publish.empty()) std::this_thread::sleep_for(20ms);
    }
  }

  void warn(const std::string& what, const std::exception& e) {
    using namespace std::chrono_literals;
    if (Clock::now() - last_warning < 5s) return;
    last_warning = Clock::now();
    spdlog::warn("rank {}: quorum join agent: {}: {}", rank, what, e.what());
  }

  // Waits up to 20 ms for something to publish; false once the agent is to stop.
  bool take_requests(Requests& q) {
    using namespace std::chrono_literals;
    std::unique_lock<std::mutex> lock(sh->mu);
    JoinAgentIo& a = sh->agent;
    sh->agent_cv.wait_for(lock, 20ms, [&] { return a.stop || !a.publish.empty(); });
    if (a.stop) return false;
    q.publish.swap(a.publish);
    q.fetch.swap(a.fetch);
    q.coordinating = a.coordinating;
    q.searching = a.searching;
    q.watch_end = a.watch_end;
    q.incs = a.incarnations;
    q.outside = a.outside;
    return true;
  }

  void publish_values(Requests& q, JoinAgentIo& out, Retries& retry) {
    for (auto& [key, value] : q.publish) {
      try {
        store->set(key, value);
        out.published.push_back(key);
      } catch (const std::exception& e) {
        warn(fmt::format("cannot publish '{}'", key), e);
        retry.publish.emplace_back(key, value);
      }
    }
  }

  void fetch_joiners(Requests& q, JoinAgentIo& out, Retries& retry) {
    using namespace std::chrono_literals;
    for (auto& f : q.fetch) {
      try {
        if (store->check({f.key})) {
          out.fetched.emplace_back(f.rank, f.incarnation, store->get(f.key, net::deadline_in(2s)));
          continue;
        }
      } catch (const std::exception& e) {
        warn(fmt::format("cannot read '{}'", f.key), e);
      }
      if (Clock::now() < f.until) retry.fetch.push_back(f);
    }
  }

  // The coordinator: new incarnations of the ranks outside its view.
  void watch_incarnations(const Requests& q, JoinAgentIo& out) {
    using namespace std::chrono_literals;
    for (int r = 0; r < world && size_t(r) < q.outside.size(); ++r) {
      if (!q.outside[size_t(r)] || r == rank) continue;
      try {
        const std::string key = net::incarnation_key(r);
        if (!store->check({key})) continue;
        const int64_t n = net::parse_counter(key, store->get(key, net::deadline_in(2s)));
        if (n < 1 || n - 1 <= int64_t(q.incs[size_t(r)]) || n - 1 > int64_t(UINT32_MAX)) continue;
        const uint32_t inc = uint32_t(n - 1);
        // Found once its address is there to fetch.
        if (store->check({join_key(instance, r, inc, r)})) out.found.emplace_back(r, inc);
      } catch (const std::exception& e) {
        warn(fmt::format("cannot look for a new incarnation of rank {}", r), e);
      }
    }
  }

  void check_job_end(JoinAgentIo& out) {
    // The job may have finished while this rank was away.
    for (int p = 0; p < world && !out.finished; ++p) {
      try {
        out.finished = store->check({join_done_key(instance, p)});
      } catch (const std::exception& e) {
        warn("cannot look for the end of the job", e);
      }
    }
  }

  // The joiner: the members' addresses for this incarnation.
  void search_members(JoinAgentIo& out) {
    using namespace std::chrono_literals;
    for (int p = 0; p < world; ++p) {
      if (found_peer[size_t(p)]) continue;
      const std::string key = join_key(instance, rank, my_inc, p);
      try {
        if (!store->check({key})) continue;
        out.values.emplace_back(p, store->get(key, net::deadline_in(2s)));
        found_peer[size_t(p)] = 1;
      } catch (const std::exception& e) {
        warn(fmt::format("cannot read '{}'", key), e);
      }
    }
  }

  void hand_back(JoinAgentIo& out, Retries& retry) {
    std::lock_guard<std::mutex> lock(sh->mu);
    JoinAgentIo& a = sh->agent;
    for (auto& k : out.published) a.published.push_back(std::move(k));
    for (auto& f : out.fetched) a.fetched.push_back(std::move(f));
    for (auto& f : out.found) a.found.push_back(f);
    for (auto& v : out.values) a.values.push_back(std::move(v));
    a.finished = a.finished || out.finished;
    for (auto& p : retry.publish) a.publish.push_back(std::move(p));
    for (auto& f : retry.fetch) a.fetch.push_back(std::move(f));
  }
};

void run_join_agent(std::shared_ptr<QuorumAllreduce::Shared> sh, net::Store* store,
                    Engine* engine, int rank, int world, uint32_t instance, uint32_t my_inc) {
  JoinAgent(std::move(sh), store, engine, rank, world, instance, my_inc).run();
}

}  // namespace

QuorumAllreduce::QuorumAllreduce(Communicator& comm, size_t count, QuorumOptions opts)
    : comm_(comm), count_(count), opts_(opts), shared_(std::make_shared<Shared>()) {
  const int w = comm.size();
  if (opts_.fraction < 0 || opts_.fraction > 1)
    throw ConfigError(fmt::format("quorum fraction {} must be in (0, 1]", opts_.fraction));
  if (opts_.fraction > 0) {
    qproto::Config c;
    c.fraction = opts_.fraction;
    opts_.quorum = qproto::quorum_for(c, w);
  }
  if (opts_.quorum == 0) opts_.quorum = w;
  if (opts_.evict.count() <= 0) throw ConfigError("quorum evict time must be > 0");
  if (opts_.evict_steps < 0) throw ConfigError("quorum evict_steps must be >= 0");
  if (opts_.min_world < 0 || opts_.min_world > w)
    throw ConfigError(
        fmt::format("quorum min_world {} out of range [0, {}]", opts_.min_world, w));
  if (opts_.quorum < 1 || opts_.quorum > w)
    throw ConfigError(fmt::format("quorum {} out of range [1, {}]", opts_.quorum, w));
  if (opts_.adaptive && (opts_.fraction > 0 || opts_.auto_max < 0 || opts_.auto_max > w ||
                         (opts_.auto_max > 0 && opts_.auto_max < opts_.quorum)))
    throw ConfigError(fmt::format("adaptive quorum: bounds [{}, {}] not within 1..{} ranks (or "
                                  "with a fraction)",
                                  opts_.quorum, opts_.auto_max, w));
  if (!(opts_.auto_kappa >= 0) || !std::isfinite(opts_.auto_kappa))
    throw ConfigError(
        fmt::format("adaptive quorum: noise scale {} must be >= 0", opts_.auto_kappa));
  if (opts_.grace.count() < 0) throw ConfigError("quorum grace must be >= 0");
  if (opts_.deadline.count() <= 0) throw ConfigError("quorum hard deadline must be > 0");
  if (opts_.deadline <= opts_.grace)
    throw ConfigError(fmt::format("quorum hard deadline ({} ms) must exceed the grace ({} ms)",
                                  opts_.deadline.count(), opts_.grace.count()));
  if (opts_.late == LatePolicy::kCarry) carry_.assign(count * dtype_size(opts_.type), 0);
  if (w > (1 << 16))
    throw ConfigError(fmt::format("the quorum all-reduce supports up to 65536 ranks, not {}", w));
  if (opts_.join && (!opts_.store || w < 2))
    throw UsageError("quorum: joining a running job needs the rendezvous store and peers");
  const uint32_t instance = opts_.instance >= 0 ? uint32_t(opts_.instance) : comm.next_seq();
  instance_ = int(instance);
  auto op = std::make_unique<QuorumService>(comm.engine(), comm.options(), count, opts_, shared_,
                                            instance);
  if (opts_.store && w > 1 && survives_loss()) {
    uint32_t inc = 0;
    std::string address, settings;
    comm.engine().run([&](net::Endpoint& ep) {
      inc = ep.incarnation();
      address = ep.published_address();
      settings = Communicator::settings_text(ep, comm.options()) + opts_.agreed;
    });
    if (opts_.join) {
      if (inc == 0) throw UsageError("quorum: joining a running job as incarnation 0");
      // The joiner's address for the members (they fetch it when the coordinator tells them).
      JoinValue v;
      v.incarnation = inc;
      v.settings = settings;
      v.address = address;
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->agent.publish.emplace_back(
          join_key(instance & 0xFF, comm.rank(), inc, comm.rank()), encode_join_value(v));
    }
    agent_ = std::thread(run_join_agent, shared_, opts_.store, &comm.engine(), comm.rank(), w,
                         instance & 0xFF, inc);
  }
  // When the service fails (its own error, or the communicator's), every waiter is told, after
  // the engine made sure no buffer of theirs is still with the transport.
  op->deadline = Clock::time_point::max();
  service_ = comm.engine().submit(
      std::move(op), true,
      [sh = shared_, rank = comm.rank()](const std::exception_ptr& err) {
        if (!err) return;
        std::exception_ptr why;
        {
          std::lock_guard<std::mutex> lock(sh->mu);
          why = sh->service_error;
        }
        if (!why) {
          std::string what = "unknown error";
          try {
            std::rethrow_exception(err);
          } catch (const std::exception& e) {
            what = e.what();
          }
          why = std::make_exception_ptr(IoError(fmt::format(
              "rank {}: the communicator under the quorum all-reduce failed: {}", rank, what)));
        }
        sh->fail(why);
      });
}

QuorumAllreduce::~QuorumAllreduce() {
  if (agent_.joinable()) {
    // The job ended well here: a rank that comes back now has nothing to rejoin.
    bool done = std::uncaught_exceptions() == 0 && coordinator() == comm_.rank();
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      done = done && !shared_->poison;
    }
    if (done) {
      try {
        opts_.store->set(join_done_key(uint32_t(instance_) & 0xFF, comm_.rank()), "1");
      } catch (const std::exception& e) {
        spdlog::warn("rank {}: quorum: cannot record the end of the job: {}", comm_.rank(),
                     e.what());
      }
    }
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->agent.stop = true;
    }
    shared_->agent_cv.notify_all();
    agent_.join();
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->shutdown = true;
  }
  comm_.engine().kick();
  // The service drains its sends for at most 2 s.
  auto until = Clock::now() + std::chrono::seconds(5);
  while (!service_->done() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!service_->done()) spdlog::warn("rank {}: quorum service did not stop in 5 s", comm_.rank());
}

void QuorumAllreduce::on_excluded(std::function<void(uint64_t)> cb) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->on_excluded = std::move(cb);
}

void QuorumAllreduce::on_phase(std::function<void(uint64_t, const char*)> cb) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->on_phase = std::move(cb);
}

bool QuorumAllreduce::excluded(uint64_t step) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  auto it = shared_->steps.find(step);
  return it != shared_->steps.end() && it->second.excluded;
}

bool QuorumAllreduce::survives_loss() const {
  qproto::Config c;
  c.quorum = opts_.fraction > 0 ? 0 : opts_.quorum;
  c.fraction = opts_.fraction;
  c.min_world = opts_.min_world;
  const int w = comm_.size();
  return w > 1 && qproto::floor_for(c, w - 1) <= w - 1;
}

int QuorumAllreduce::coordinator() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->coordinator;
}

std::vector<int> QuorumAllreduce::members() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->members;
}

std::vector<ViewChange> QuorumAllreduce::view_changes() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->views;
}

std::map<uint64_t, std::vector<double>> QuorumAllreduce::arrival_log() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->arrivals;
}

// While this rank waits anyway, it drives the engine itself for a bounded time (the decision
// and the ring then progress without engine wake-ups), then leaves the rest to the engine
// thread: a long wait for stragglers costs no CPU.
void QuorumAllreduce::help_progress(uint64_t step) {
  auto finished = [&] {
    std::lock_guard<std::mutex> lock(shared_->mu);
    auto it = shared_->steps.find(step);
    return shared_->poison || (it != shared_->steps.end() && (it->second.done || it->second.error));
  };
  comm_.engine().drive_until(finished, Deadline::max(), kHelpBriefly);
}

std::vector<char> QuorumAllreduce::pending_carry() const {
  return carry_pending_ ? carry_ : std::vector<char>{};
}

void QuorumAllreduce::restore_carry(const std::vector<char>& bytes) {
  if (bytes.empty()) {
    carry_pending_ = false;
    return;
  }
  if (opts_.late != LatePolicy::kCarry || bytes.size() != carry_.size())
    throw UsageError(fmt::format("restore_carry: {} bytes for a carry buffer of {} (policy {})",
                                 bytes.size(), carry_.size(), to_string(opts_.late)));
  carry_ = bytes;
  carry_pending_ = true;
}

void QuorumAllreduce::report(uint64_t key, int part, int parts, std::vector<double> values) {
  if (parts < 1 || parts > comm_.size() || part < 0 || part >= parts)
    throw UsageError(fmt::format("quorum report: part {} of {} ({} ranks)", part, parts,
                                 comm_.size()));
  if (values.empty() || values.size() > qwire::kMaxShardValues)
    throw UsageError(fmt::format("quorum report: {} values (1 to {})", values.size(),
                                 qwire::kMaxShardValues));
  for (double v : values)
    if (!std::isfinite(v)) throw UsageError("quorum report: a value is not finite");
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (shared_->poison) std::rethrow_exception(shared_->poison);
    shared_->reports_out.push_back({key, uint32_t(part), uint32_t(parts), std::move(values)});
  }
  if (!comm_.engine().try_progress()) comm_.engine().kick();
}

std::map<int, std::vector<double>> QuorumAllreduce::gather_reports(
    uint64_t key, int parts, int skip, Clock::time_point until, const std::vector<int>& senders) {
  std::unique_lock<std::mutex> lock(shared_->mu);
  const size_t views_before = shared_->views.size();
  // Part p's sender has left the job: it is not in the newest view, or a view since this call
  // began dropped it (it may be back as a new incarnation, which does not send this report).
  auto gone = [&](int p) {
    if (size_t(p) >= senders.size() || shared_->views.empty()) return false;
    const int r = senders[size_t(p)];
    const std::vector<int>& m = shared_->views.back().members;
    if (std::find(m.begin(), m.end(), r) == m.end()) return true;
    for (size_t i = views_before; i < shared_->views.size(); ++i)
      for (auto& l : shared_->views[i].left)
        if (l.rank == r) return true;
    return false;
  };
  auto have = [&] {
    auto it = shared_->reports_in.find(key);
    for (int p = 0; p < parts; ++p) {
      if (p == skip) continue;
      const bool in =
          it != shared_->reports_in.end() && it->second.count({uint32_t(parts), p}) > 0;
      if (!in && !gone(p)) return false;
    }
    return true;
  };
  // The engine thread receives the parts (keep_report notifies).
  while (!have() && !shared_->poison && Clock::now() < until)
    shared_->cv.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(50)));
  if (shared_->poison) std::rethrow_exception(shared_->poison);
  std::map<int, std::vector<double>> out;
  auto it = shared_->reports_in.find(key);
  if (it != shared_->reports_in.end()) {
    for (auto& [at, v] : it->second)
      if (at.first == uint32_t(parts) && at.second != skip) out[at.second] = std::move(v);
  }
  // This key and every older one are done.
  shared_->drop_reports_through(key);
  return out;
}

void QuorumAllreduce::contribute(uint64_t step, void* buf, size_t count,
                                 std::optional<uint64_t> digest) {
  if (count != count_)
    throw UsageError(
        fmt::format("rank {}: quorum step {}: contribution of {} elements, this "
                    "all-reduce was set up for {}",
                    comm_.rank(), step, count, count_));
  if (!buf && count) throw UsageError("quorum contribute: null buffer");
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: contribution for step {}, but step {} is next",
                                 comm_.rank(), step, next_step_));
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (shared_->poison) std::rethrow_exception(shared_->poison);
    if (service_->done()) throw UsageError("quorum all-reduce: the service has stopped");
    StepLocal& s = shared_->steps[step];
    if (s.contributed)
      throw UsageError(fmt::format("rank {}: step {} contributed twice", comm_.rank(), step));
  }
  if (carry_pending_) {
    reduce(buf, buf, carry_.data(), count_, opts_.type, RedOp::kSum);
    carry_pending_ = false;
  }
  have_next_ = true;
  next_step_ = step;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    StepLocal& s = shared_->steps[step];
    s.buf = buf;
    s.digest = digest;
    s.contributed = true;
    s.contrib_time = Clock::now();
    shared_->ready_events.push_back(step);
  }
  // Send READY (and start a speculative ring) from this thread when the engine is free;
  // wake the engine thread only when it is busy elsewhere and might not look soon.
  if (!comm_.engine().try_progress()) comm_.engine().kick();
}

QuorumResult QuorumAllreduce::wait(uint64_t step, void* out) {
  if (!out && count_) throw UsageError("quorum wait: null output buffer");
  return wait_impl(step, out, nullptr);
}

QuorumResult QuorumAllreduce::wait(uint64_t step, View* view) {
  if (!view) throw UsageError("quorum wait: null view");
  return wait_impl(step, nullptr, view);
}

QuorumResult QuorumAllreduce::wait_impl(uint64_t step, void* out, View* view) {
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: wait for step {}, but step {} is next", comm_.rank(),
                                 step, next_step_));
  auto t0 = Clock::now();
  help_progress(step);
  std::unique_lock<std::mutex> lock(shared_->mu);
  StepLocal& s = shared_->steps[step];
  // Last-resort guard; the engine enforces the finer deadlines and reports them first.
  auto guard = (s.contributed ? s.contrib_time : t0) + 2 * opts_.deadline + std::chrono::seconds(5);
  while (!s.done && !s.error && !shared_->poison) {
    if (shared_->cv.wait_until(lock, guard) == std::cv_status::timeout && !s.done) {
      auto e = std::make_exception_ptr(QuorumTimeout(
          fmt::format("rank {}: quorum step {}: no result within {} ms", comm_.rank(), step,
                      std::chrono::duration_cast<std::chrono::milliseconds>(guard - t0).count()),
          {0}));
      lock.unlock();
      shared_->fail(e);
      std::rethrow_exception(e);
    }
  }
  if (s.error) std::rethrow_exception(s.error);
  if (!s.done && shared_->poison) std::rethrow_exception(shared_->poison);
  QuorumResult res = std::move(s.result);
  res.joined = std::move(s.joined);
  const size_t bytes = count_ * dtype_size(opts_.type);
  if (s.excluded && s.contributed && opts_.late == LatePolicy::kCarry) {
    // The late gradient (with anything carried into it) counts in the next contribution.
    std::memcpy(carry_.data(), s.buf, bytes);
    carry_pending_ = true;
  }
  if (view) {
    *view = View{};
    if (res.skipped) {
      // No result on any rank: the caller makes no update.
    } else if (s.out) {
      view->data = s.out->data();
      view->hold = std::shared_ptr<const void>(s.out, s.out->data());
    } else {
      view->data = s.buf;
    }
  } else if (res.skipped) {
    // No result on any rank: the caller makes no update.
  } else if (s.out) {
    if (bytes) std::memcpy(out, s.out->data(), bytes);
  } else if (out != s.buf && bytes) {
    std::memcpy(out, s.buf, bytes);
  }
  shared_->steps.erase(step);
  lock.unlock();
  res.wait_ms = ms_between(t0, Clock::now());
  have_next_ = true;
  next_step_ = step + 1;
  return res;
}

JoinInfo QuorumAllreduce::join(Clock::time_point until) {
  if (!opts_.join) throw UsageError("quorum join(): this all-reduce was not made to join");
  std::unique_lock<std::mutex> lock(shared_->mu);
  const auto t0 = Clock::now();
  while (!shared_->joined_info && !shared_->poison && !shared_->agent.finished &&
         Clock::now() < until)
    shared_->cv.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(50)));
  if (shared_->poison) std::rethrow_exception(shared_->poison);
  if (!shared_->joined_info && shared_->agent.finished)
    throw JobOver(fmt::format("rank {}: the job finished before this incarnation was admitted",
                              comm_.rank()));
  if (!shared_->joined_info)
    throw QuorumTimeout(
        fmt::format("rank {}: rejoining the running job: not admitted within {:.0f} ms ({})",
                    comm_.rank(), ms_between(t0, Clock::now()), shared_->join_stage),
        {});
  return *shared_->joined_info;
}

size_t QuorumAllreduce::receive_state(void* buf, size_t len, Clock::time_point until) {
  if (!opts_.join) throw UsageError("quorum receive_state(): not a joining rank");
  if (len == 0 || !buf) throw UsageError("quorum receive_state(): empty buffer");
  int donor;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (!shared_->joined_info) throw UsageError("quorum receive_state() before join()");
    donor = shared_->joined_info->donor;
    shared_->state_len = len;
  }
  comm_.engine().kick();
  std::unique_lock<std::mutex> lock(shared_->mu);
  const auto t0 = Clock::now();
  while (!shared_->state_done && !shared_->poison && !shared_->agent.finished &&
         Clock::now() < until)
    shared_->cv.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(50)));
  if (shared_->poison) std::rethrow_exception(shared_->poison);
  // Admitted at the very end: the members finished before the donor's next step boundary,
  // where it would have sent the state.
  if (!shared_->state_done && shared_->agent.finished)
    throw JobOver(fmt::format("rank {}: the job finished before this incarnation got its state "
                              "from rank {}",
                              comm_.rank(), donor));
  if (!shared_->state_done)
    throw QuorumTimeout(fmt::format("rank {}: rejoining: no state from rank {} (the donor) "
                                    "within {:.0f} ms",
                                    comm_.rank(), donor, ms_between(t0, Clock::now())),
                        {donor});
  if (!shared_->state_error.empty())
    throw IoError(fmt::format("rank {}: rejoining: {}", comm_.rank(), shared_->state_error));
  std::memcpy(buf, shared_->state_in->data(), shared_->state_bytes);
  const size_t n = shared_->state_bytes;
  shared_->state_in.reset();
  return n;
}

void QuorumAllreduce::send_state(int to, uint64_t step, std::vector<char> state) {
  send_state(to, step, std::make_shared<const std::vector<char>>(std::move(state)));
}

void QuorumAllreduce::send_state(int to, uint64_t step,
                                 std::shared_ptr<const std::vector<char>> state) {
  if (to < 0 || to >= comm_.size() || to == comm_.rank())
    throw UsageError(fmt::format("quorum send_state(): rank {} out of range", to));
  if (!state) throw UsageError("quorum send_state(): no state");
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (shared_->poison) std::rethrow_exception(shared_->poison);
    shared_->state_out.push_back({to, step, std::move(state)});
  }
  comm_.engine().kick();
}

}  // namespace qring::collectives
