#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>

#include "collectives/engine.h"
#include "collectives/quorum/join_agent.h"
#include "collectives/quorum/quorum.h"
#include "collectives/straggler.h"
#include "net/base/build_info.h"
#include "net/base/error.h"
#include "net/base/fnv1a.h"
#include "net/base/large_buffer.h"
#include "net/base/out_of_memory.h"
#include "train/async_sgd.h"
#include "train/checkpoint.h"
#include "train/dataset.h"
#include "train/full_sync.h"
#include "train/kernels.h"
#include "train/measure.h"
#include "train/metrics_log.h"
#include "train/model.h"
#include "train/optim.h"
#include "train/rng.h"
#include "train/stop_signals.h"
#include "train/trainer_core.h"

namespace qring::train {

namespace fs = std::filesystem;
using collectives::DataType;
using collectives::RedOp;
using Clock = std::chrono::steady_clock;

namespace {

// After each gradient, in the same all-reduce: the batch loss and the stop flag.
constexpr size_t kSpare = Model::kSpareGrads;
static_assert(kSpare == 2, "the trainer uses two spare slots: loss, stop flag");
// The trainer's quorum all-reduce, the same on every rank whatever collectives ran before (a
// joiner runs none): its control tags and its store keys (join_agent.h).
constexpr uint32_t kQuorumInstance = 1;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t x = int64_t(s);
  if (x >= 3600) return fmt::format("{}h{:02}m", x / 3600, (x / 60) % 60);
  if (x >= 60) return fmt::format("{}m{:02}s", x / 60, x % 60);
  return fmt::format("{}s", x);
}

// Keeps the metrics lines of steps before `step` (resume) and drops the rest.
void truncate_metrics(const fs::path& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line)) {
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t(0)) < step) keep.push_back(line);
    } catch (const std::exception&) {
      break;  // a torn last line from a killed run
    }
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  for (auto& l : keep) out << l << '\n';
}

struct EvalOut {
  double accuracy = 0, loss = 0;
};

// Sums (loss, correct, count) over slice `part` of `parts` of the test set.
std::vector<double> evaluate_slice(Model& model, const Dataset& test, int64_t batch, int64_t part,
                                   int64_t parts) {
  const int64_t n = test.size();
  const int64_t begin = n * part / parts, end = n * (part + 1) / parts;
  std::vector<double> v(3, 0.0);
  for (int64_t s = begin; s < end; s += batch) {
    int b = int(std::min(batch, end - s));
    EvalResult r = model.evaluate(test.image(s), test.labels.data() + s, b);
    v[0] += r.loss_sum;
    v[1] += double(r.correct);
    v[2] += double(r.count);
  }
  return v;
}

// The sharded evaluation, without a collective: each live member (`members`, sorted, as of
// the step each rank completed last) evaluates its slice of the test set and sends the sums
// to the coordinator, which adds them in slice order (exact in float64: the same bits
// whoever evaluated a slice). Nobody but the coordinator waits, and it waits a bounded time,
// ending as soon as the missing slices' members have left the job; those slices, and those of
// a member that completed the step in another view (so cut the set into another number of
// slices), it evaluates itself. Only the coordinator gets a result (nullopt elsewhere).
std::optional<EvalOut> evaluate_sharded(Model& model, const Dataset& test, int64_t batch,
                                        collectives::QuorumAllreduce& q, int rank, uint64_t key) {
  const std::vector<int> members = q.membership().members();
  const int64_t k = int64_t(members.size());
  const int64_t me =
      int64_t(std::lower_bound(members.begin(), members.end(), rank) - members.begin());
  const bool lead = q.membership().coordinator() == rank;
  const auto t0 = Clock::now();
  std::vector<double> mine = evaluate_slice(model, test, batch, me, k);
  if (!lead) {
    q.reports().report(key, int(me), int(k), std::move(mine));
    return std::nullopt;
  }
  std::map<int, std::vector<double>> parts;
  if (k > 1) {
    // The others started at about the same time (right after the same step): a slice is
    // overdue after twice this rank's time for one, plus the eviction time.
    const auto own = Clock::now() - t0;
    parts = q.reports().gather_reports(key, int(k), int(me),
                             Clock::now() + 2 * own + q.options().evict, members);
  }
  parts[int(me)] = std::move(mine);
  double v[3] = {0, 0, 0};
  for (int64_t i = 0; i < k; ++i) {
    auto it = parts.find(int(i));
    if (it == parts.end() || it->second.size() != 3) {
      spdlog::warn("evaluation at step {}: no sums from rank {} (slice {} of {}); evaluating "
                   "that slice here",
                   key, members[size_t(i)], i, k);
      parts[int(i)] = evaluate_slice(model, test, batch, i, k);
      it = parts.find(int(i));
    }
    for (int j = 0; j < 3; ++j) v[j] += it->second[size_t(j)];
  }
  EvalOut o;
  o.accuracy = v[2] > 0 ? v[1] / v[2] : 0;
  o.loss = v[2] > 0 ? v[0] / v[2] : 0;
  return o;
}

}  // namespace

uint64_t checksum(const float* p, size_t n) {
  // Seeded with 1469598103934665603, one digit short of FNV's offset basis, as it always
  // was: checksums stay comparable with earlier runs and logs.
  return fnv1a64(p, n * sizeof(float), 1469598103934665603ull);
}

nlohmann::json RunSummary::to_json() const {
  nlohmann::json j;
  j["test_accuracy"] = test_accuracy;
  j["best_test_accuracy"] = best_test_accuracy;
  j["test_loss"] = test_loss;
  j["wall_s"] = wall_s;
  j["time_to_target_s"] = time_to_target_s ? nlohmann::json(*time_to_target_s) : nlohmann::json();
  j["steps"] = steps;
  j["dropped_gradients"] = dropped_gradients;
  j["samples_per_s"] = samples_per_s;
  j["computed_samples_per_s"] = computed_samples_per_s;
  j["mean_contributors"] = mean_contributors;
  j["full_sync_estimate_s"] = full_sync_estimate_s;
  j["backup_saved_s"] = backup_saved_s;
  j["params_checksum"] = fmt::format("{:016x}", params_checksum);
  j["failures_survived"] = failures_survived;
  j["evicted_ranks"] = evicted_ranks;
  j["skipped_steps"] = skipped_steps;
  j["nonfinite_steps"] = nonfinite_steps;
  j["recovery_s"] = recovery_s;
  j["rejoins"] = rejoins;
  j["heal_s"] = heal_s;
  j["preempted"] = preempted;
  j["stop_signal"] = preempted ? nlohmann::json(signal_name(stop_signal)) : nlohmann::json();
  return j;
}

namespace {

// Every rank must run the same configuration: an override given to one node only would go
// unnoticed (or hang the first collective on a model of another size). The per-key digests
// are gathered from the whole world, and every rank stops naming the ranks and keys that
// differ (the collective has the communicator's deadline). The kernels' ISA is compared too
// (train/kernels.h): ranks that round differently would not stay bit-identical.
void check_config_agrees(const TrainConfig& cfg, collectives::Communicator& comm) {
  const int rank = comm.rank(), world = comm.size();
  std::vector<uint64_t> mine = cfg.agreed_digests();
  mine.push_back(TrainConfig::digest(kernel_isa()));
  std::vector<uint64_t> all(mine.size() * size_t(world));
  comm.allgather(mine.data(), all.data(), mine.size(), DataType::kInt64);
  try {
    TrainConfig::check_ranks_agree(all, world, {"kernels"});
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}; rank {} computes with {}", e.what(), rank, kernel_isa()));
  }
}

// A fresh run never deletes an earlier run's checkpoints (they would mislead --resume if kept,
// and may be all that is left of a long run): when any rank finds some in its directory, every
// rank stops with the same error (a collective of the whole world) -- unless --force, which
// deletes them.
void guard_earlier_checkpoints(const fs::path& run_dir, const fs::path& ckpt_dir,
                               collectives::Communicator& comm, bool force) {
  const std::vector<uint64_t> steps = checkpoint_steps(ckpt_dir.string());
  const int64_t mine = steps.empty() ? -1 : int64_t(steps.front());  // newest first
  int64_t newest = -1;
  comm.allreduce(&mine, &newest, 1, DataType::kInt64, RedOp::kMax);
  if (newest < 0) return;
  if (!force)
    throw ConfigError(fmt::format(
        "{} holds the checkpoints of an earlier run (the newest at step {}): continue that run "
        "with --resume, start it over with --force (deletes them), or choose another run.name",
        run_dir.string(), newest));
  size_t removed = 0;
  for (auto& e : fs::directory_iterator(ckpt_dir))
    if (e.path().extension() == ".qck") removed += fs::remove(e.path()) ? 1 : 0;
  if (comm.rank() == 0)
    spdlog::warn("--force: removed the checkpoints of an earlier run in {} (the newest at step {})",
                 run_dir.string(), newest);
}

// After a stop (SIGTERM/SIGUSR1): no rank leaves before every live member has written its
// checkpoint (and the coordinator summary.json), so that a launcher or srun that ends the job
// at the first exit (srun --kill-on-bad-exit) cuts no write short. Bounded: a member that died
// meanwhile is waited for until `limit`, then this rank leaves anyway, its own state saved.
void wait_for_stopped_members(net::Store& store, const std::vector<int>& members, int rank,
                              int64_t step, std::chrono::milliseconds limit) {
  store.set(fmt::format("stopped/{}/{}", step, rank), "1");
  std::vector<std::string> keys;
  for (int m : members) keys.push_back(fmt::format("stopped/{}/{}", step, m));
  try {
    store.wait(keys, net::deadline_in(limit));
  } catch (const Error& e) {
    spdlog::warn("rank {}: stopped after step {}, but not every member said it saved its state "
                 "within {} ms: {}",
                 rank, step, limit.count(), e.what());
  }
}

// The quorum all-reduce of the trainer's gradients, as the configuration sets it.
collectives::QuorumOptions quorum_options(const TrainConfig& cfg, const TrainerOptions& opts,
                                          int quorum, bool joining) {
  collectives::QuorumOptions qo;
  qo.quorum = quorum;
  qo.grace = std::chrono::milliseconds(cfg.quorum.grace_ms);
  qo.deadline = std::chrono::milliseconds(cfg.quorum.deadline_ms);
  qo.late = collectives::parse_late_policy(cfg.quorum.late_policy);
  qo.type = DataType::kFloat32;
  qo.mean = true;
  if (cfg.quorum.quorum_is_fraction) qo.fraction = cfg.quorum.quorum;
  qo.evict = std::chrono::milliseconds(cfg.quorum.evict_ms);
  qo.evict_steps = int(cfg.quorum.evict_steps);
  qo.max_lag = std::chrono::milliseconds(cfg.quorum.max_lag_ms);
  qo.min_world = int(cfg.quorum.min_world);
  qo.adaptive = cfg.quorum.quorum_auto;
  qo.auto_max = int(cfg.quorum.max);
  qo.auto_estimate = cfg.quorum.noise_scale_estimated();
  qo.auto_kappa =
      qo.auto_estimate ? 0.0 : cfg.quorum.noise_scale / double(cfg.train.batch_per_rank);
  qo.store = opts.store;
  qo.join = joining;
  // What ranks compare at start (the allgather above), for a rank that comes back to compare
  // with every member before it is admitted.
  {
    const std::vector<std::string> keys = TrainConfig::agreed_keys();
    const std::vector<uint64_t> digests = cfg.agreed_digests();
    for (size_t k = 0; k < keys.size(); ++k)
      qo.agreed += fmt::format("config {}={:016x}\n", keys[k], digests[k]);
    qo.agreed += fmt::format("kernels={}\n", kernel_isa());
  }
  qo.instance = kQuorumInstance;
  return qo;
}

// An empty buffer with room for `bytes`, its pages faulted in now (huge pages where they fit):
// on a virtual machine fresh pages cost more than the copy into them, and the state buffers
// are filled between two steps or while the others train.
std::shared_ptr<std::vector<char>> populated_buffer(size_t bytes) {
  auto b = std::make_shared<std::vector<char>>();
  b->reserve(bytes);
  net::populate(b->data(), bytes);
  return b;
}

// A new incarnation of this rank joins the running job: admission by the members, then the
// donor's state (parameters, momentum, data position) before step joined->step, at which
// the loop goes on (returned). `state` keeps the bytes received (the buffer this rank encodes
// its own state into when it is a donor later: its pages are in memory already).
int64_t rejoin(collectives::QuorumAllreduce& q, TrainerCore& core, const TrainerOptions& opts,
               int rank, int64_t deadline_ms, std::optional<collectives::JoinInfo>& joined,
               std::shared_ptr<std::vector<char>>& state) {
  const auto until =
      Clock::now() + std::chrono::milliseconds(std::max<int64_t>(30000, 2 * deadline_ms));
  const auto t0 = Clock::now();
  joined = q.membership().join(until);
  const double admit_ms = ms_since(t0);
  // The donor's state before step joined->step: parameters, momentum, data position, step.
  // Room for the donor's state: the same model and optimizer (a bigger one is an error).
  // Fresh pages cost more than the copy on a virtual machine, and this process competes with
  // the training ranks for the cores: the buffer is faulted in at once, in huge pages, and
  // the state is restored from where it lies.
  const size_t room = encoded_checkpoint_size(core.checkpoint_view()) + 4096;
  state = populated_buffer(room);
  state->resize(room);
  const auto s0 = Clock::now();
  state->resize(q.membership().receive_state(state->data(), state->size(), until));
  const double state_ms = ms_since(s0);
  const CheckpointView st = decode_checkpoint_view(
      {reinterpret_cast<const uint8_t*>(state->data()), state->size()},
      fmt::format("the state from rank {}", joined->donor));
  try {
    core.restore(st);
  } catch (const DataError& e) {
    throw ConfigError(fmt::format("rank {}: cannot rejoin with the state of rank {}: {}", rank,
                                  joined->donor, e.what()));
  }
  // The loop goes on at the step it was admitted to (a skipped step made no optimizer step,
  // so the state's own step count may be lower; the donor's is the same).
  const int64_t start = int64_t(joined->step);
  spdlog::warn(
      "rank {} rejoined at step {} (incarnation {}, view {}, members {}): admitted "
      "{:.0f} ms after it asked, state {:.1f} MB from rank {} in {:.0f} ms",
      rank, start, opts.incarnation, joined->epoch, fmt::join(joined->members, ","), admit_ms,
      double(state->size()) / 1e6, joined->donor, state_ms);
  return start;
}

// Why checkpoint `s` cannot resume this rank of this job (another world or rank, model,
// configuration or data position); empty when it can.
std::string checkpoint_mismatch(const CheckpointState& s, const TrainConfig& cfg, int rank,
                                int world, size_t n_params, int64_t steps_per_epoch) {
  if (int(s.world) != world || int(s.rank) != rank)
    return fmt::format("written by rank {} of {}; this is rank {} of {}", s.rank, s.world, rank,
                       world);
  if (s.params.size() != n_params || s.velocity.size() != n_params)
    return fmt::format("{} parameters and {} momentum values, the model has {}", s.params.size(),
                       s.velocity.size(), n_params);
  if (s.config_fingerprint != cfg.fingerprint())
    return fmt::format(
        "config fingerprint {:016x} does not match this config's {:016x} "
        "(seed, data, model or batch changed)",
        s.config_fingerprint, cfg.fingerprint());
  if (s.position.index >= steps_per_epoch)
    return fmt::format("data position (epoch {}, batch {}) is past the {} batches per epoch",
                       s.position.epoch, s.position.index, steps_per_epoch);
  return {};
}

// The ranks the job's view held when checkpoint `s` was written (its meta's "members"; a
// checkpoint without them: every rank of the world).
std::vector<int> checkpoint_members(const CheckpointState& s, int world) {
  try {
    const auto j = nlohmann::json::parse(s.meta);
    if (j.is_object() && j.contains("members") && j["members"].is_array()) {
      std::vector<int> m;
      for (const auto& r : j["members"])
        if (r.is_number_integer() && r.get<int>() >= 0 && r.get<int>() < world)
          m.push_back(r.get<int>());
      return m;
    }
  } catch (const nlohmann::json::exception&) {
  }
  std::vector<int> all(static_cast<size_t>(world));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// The agreement of --resume on a step (-1: none): in each round every rank proposes its newest
// loadable checkpoint at or below the candidate (`propose`; -1: none) and says whether it
// found a checkpoint of another job (`fatal`). The newest proposal is agreed once every rank
// that was a member of the job's view at that step (checkpoint_members of a holder's file)
// holds it: the stale files of a rank lost earlier do not drag the job back, and a rank whose
// newest file is torn, though a member, makes every rank fall back to an older step. Else
// the candidate drops below it. Every round is two collectives of the whole world; `donor`
// gets the lowest rank that holds the agreed step, `holders` whether each rank does.
int64_t agree_on_resume_step(collectives::Communicator& comm,
                             const std::function<int64_t(int64_t)>& propose,
                             const std::function<std::vector<int>()>& members_of_mine,
                             const std::string& fatal, int* donor, std::vector<char>& holders) {
  const int rank = comm.rank(), world = comm.size();
  int64_t candidate = std::numeric_limits<int64_t>::max();
  while (true) {
    const int64_t p = propose(candidate);
    const int64_t mine[2] = {p, fatal.empty() ? 0 : 1};
    std::vector<int64_t> all(size_t(2 * world));
    comm.allgather(mine, all.data(), 2, DataType::kInt64);
    for (int r = 0; r < world; ++r)
      if (all[size_t(2 * r + 1)] != 0) {
        if (!fatal.empty()) throw DataError(fatal);
        throw DataError(
            fmt::format("--resume: rank {} has a checkpoint of another job or "
                        "configuration (see its log); rank {} stops too",
                        r, rank));
      }
    int64_t newest = -1;
    for (int r = 0; r < world; ++r) newest = std::max(newest, all[size_t(2 * r)]);
    if (newest < 0) return -1;
    holders.assign(size_t(world), 0);
    for (int r = 0; r < world; ++r) holders[size_t(r)] = all[size_t(2 * r)] == newest;
    int64_t complete = 1;  // MIN over the holders: every member of its view holds the step
    if (p == newest)
      for (int m : members_of_mine()) complete &= holders[size_t(m)];
    int64_t all_complete = 0;
    comm.allreduce(&complete, &all_complete, 1, DataType::kInt64, RedOp::kMin);
    if (all_complete == 1) {
      *donor = int(std::find(holders.begin(), holders.end(), 1) - holders.begin());
      return newest;
    }
    candidate = newest - 1;
  }
}

// After the agreement: a rank without the agreed checkpoint (lost before it, its files
// stale) takes the state from `donor`, which restored its own (as a rejoining rank does).
void take_resume_state(collectives::Communicator& comm, TrainerCore& core, int donor, bool holder,
                       int64_t step) {
  std::vector<char> bytes;
  if (comm.rank() == donor) encode_checkpoint_into(core.checkpoint_view(), bytes);
  int64_t size = int64_t(bytes.size());
  comm.broadcast(&size, 1, DataType::kInt64, donor);
  bytes.resize(size_t((size + 7) / 8 * 8));
  comm.broadcast(bytes.data(), bytes.size() / 8, DataType::kInt64, donor);
  if (holder) return;
  const CheckpointView st =
      decode_checkpoint_view({reinterpret_cast<const uint8_t*>(bytes.data()), size_t(size)},
                             fmt::format("the state of step {} from rank {}", step, donor));
  core.restore(st);
  spdlog::warn(
      "--resume: rank {} has no checkpoint of step {} (it was lost before it); it "
      "takes the state from rank {}",
      comm.rank(), step, donor);
}

// --resume: the step of the newest checkpoint every rank alive at it holds (0: none, a fresh
// start), restored into `core` and `q`; a rank without it takes a holder's state.
int64_t resume_from_checkpoints(const TrainConfig& cfg, collectives::Communicator& comm,
                                TrainerCore& core, collectives::QuorumAllreduce& q,
                                const fs::path& ckpt_dir) {
  const int rank = comm.rank(), world = comm.size();
  const size_t n_params = core.num_params();
  const int64_t steps_per_epoch = core.steps_per_epoch();
  // A rank whose newest file is torn or corrupt proposes an older one; a checkpoint that
  // loads but belongs to another job (world, rank, configuration) stops every rank, naming
  // this one (agree_on_resume_step).
  const std::vector<uint64_t> steps = checkpoint_steps(ckpt_dir.string());
  size_t next = 0;                    // steps[next..] not examined yet
  std::optional<CheckpointState> st;  // the newest loadable checkpoint examined so far
  std::string st_path, fatal;
  auto mismatch = [&](const CheckpointState& s) {
    return checkpoint_mismatch(s, cfg, rank, world, n_params, steps_per_epoch);
  };
  auto propose = [&](int64_t candidate) -> int64_t {
    if (st && int64_t(st->step) <= candidate) return int64_t(st->step);
    st.reset();
    for (; next < steps.size() && fatal.empty(); ++next) {
      if (int64_t(steps[next]) > candidate) continue;
      const std::string path = checkpoint_path(ckpt_dir.string(), steps[next]);
      // Larger than any checkpoint of this model: not a torn file of this run (those are
      // shorter), so every rank stops rather than reading it (issue 44).
      std::error_code ec;
      const uint64_t size = fs::file_size(path, ec);
      if (!ec && size > max_checkpoint_bytes(n_params)) {
        fatal = fmt::format("--resume: rank {}: {}: {} bytes, more than the limit of {} bytes "
                            "that a checkpoint of this model ({} parameters) can have",
                            rank, path, size, max_checkpoint_bytes(n_params), n_params);
        break;
      }
      try {
        AllocationScope scope("checkpoint " + path);
        CheckpointState s = load_checkpoint(path, max_checkpoint_bytes(n_params));
        if (s.step != steps[next])
          throw DataError(fmt::format("{}: holds step {}, not the step of its name", path, s.step));
        if (std::string why = mismatch(s); !why.empty()) {
          fatal = fmt::format("--resume: rank {}: {}: {}", rank, path, why);
          break;
        }
        st = std::move(s);
        st_path = path;
        ++next;
        return int64_t(st->step);
      } catch (const DataError& e) {
        spdlog::warn("--resume: rank {} cannot load a checkpoint, trying an older one: {}", rank,
                     e.what());
      }
    }
    return -1;
  };
  int donor = -1;
  std::vector<char> holders;
  const int64_t agreed = agree_on_resume_step(
      comm, propose, [&] { return checkpoint_members(*st, world); }, fatal, &donor, holders);
  if (agreed < 0) {
    if (rank == 0)
      spdlog::warn("--resume: no checkpoint common to the ranks alive at it; starting fresh");
    return 0;
  }
  const bool holder = holders[size_t(rank)] != 0;
  if (holder) {
    try {
      core.restore(*st);
    } catch (const DataError& e) {
      throw DataError(fmt::format("{}: {}", st_path, e.what()));
    }
    std::vector<char> carry(reinterpret_cast<const char*>(st->carry.data()),
                            reinterpret_cast<const char*>(st->carry.data() + st->carry.size()));
    q.restore_carry(carry);
  }
  if (std::count(holders.begin(), holders.end(), 1) < world)
    take_resume_state(comm, core, donor, holder, agreed);
  if (rank == 0)
    spdlog::info("resumed from step {} ({})", agreed,
                 holder ? st_path : "rank " + std::to_string(donor) + "'s state");
  return agreed;
}

// Each QRING_FAULT entry fires once, from the step loop or (phase "ring") the engine thread.
// Copies share what has fired: the engine may call its copy until the QuorumAllreduce is gone.
// A fault fires between two passes of the engine, never with a thread of this process inside
// the endpoint (FaultSpec::inject): the step loop's hold the engine's progress lock, and the
// ring phase fires inside the engine's own pass.
class FaultInjector {
 public:
  FaultInjector(std::vector<collectives::FaultSpec> faults, int rank, collectives::Engine& engine)
      : faults_(std::move(faults)),
        fired_(std::make_shared<std::vector<std::atomic<bool>>>(faults_.size())),
        rank_(rank),
        engine_(&engine) {}

  void operator()(int64_t step, const char* phase) const { fire(step, phase, false); }

  // Entries of phase "ring" and "donate" fire from the engine thread, at the quorum's phases
  // (QuorumOptions::on_phase; empty when there are none).
  std::function<void(uint64_t, const char*)> ring_phase_hook() const {
    if (std::none_of(faults_.begin(), faults_.end(),
                     [](const auto& f) { return f.phase == "ring" || f.phase == "donate"; }))
      return {};
    return [self = *this](uint64_t step, const char* phase) {
      self.fire(int64_t(step), phase, /*in_engine_pass=*/true);
    };
  }

 private:
  void fire(int64_t step, const char* phase, bool in_engine_pass) const {
    for (size_t i = 0; i < faults_.size(); ++i) {
      if (faults_[i].matches(rank_, uint64_t(step), phase) && !(*fired_)[i].exchange(true)) {
        spdlog::warn("injecting fault {} at step {} (QRING_FAULT)", faults_[i].spec(), step);
        faults_[i].inject(in_engine_pass ? nullptr : engine_);
      }
    }
  }

  std::vector<collectives::FaultSpec> faults_;
  std::shared_ptr<std::vector<std::atomic<bool>>> fired_;
  int rank_;
  collectives::Engine* engine_;
};

// One step's work on this rank (compute_and_contribute).
struct Work {
  Clock::time_point start;             // the step's
  std::chrono::microseconds delay{0};  // the straggler model's
  double compute_ms = 0;
  bool abandoned = false;  // decided without this rank: nothing computed, the batch skipped
};

// The job's outputs in the run directory: metrics.jsonl (a line per step, evaluation, view
// change and rejoin), arrivals.jsonl and summary.json. They come from the rank that
// coordinates: rank 0, or after it was lost the rank that took over, which appends to the
// same files. Each line is one write, flushed at once: a deposed coordinator never
// overwrites its lines, and one killed mid-run leaves every line it wrote.
// The coordinator also counts each step, once its arrivals are final, into the estimate of
// what waiting for every rank would have cost (train/full_sync.h).
class MetricsWriter {
 public:
  // `start`: this rank's first step; `joined`: it rejoined the running job there (the
  // summary it may write counts the run from the file's first line, not from its own start).
  MetricsWriter(fs::path run_dir, collectives::QuorumAllreduce& q, int rank, int64_t start,
                bool joined, FullSyncEstimate& full_sync)
      : dir_(std::move(run_dir)),
        q_(q),
        rank_(rank),
        log_(dir_ / "metrics.jsonl", joined ? 0 : start),
        arrivals_next_(start),
        full_sync_(full_sync) {}

  // Rank 0 of a job that starts or resumes (not a rank that rejoins): the configuration, and
  // the metrics and arrivals of the steps before `start` (a fresh run: none).
  void create(const TrainConfig& cfg, bool resume, int64_t start) {
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.toml") << cfg.to_toml();
    if (resume) truncate_metrics(dir_ / "metrics.jsonl", start);
    if (!resume) std::ofstream(dir_ / "metrics.jsonl", std::ios::trunc);
    if (resume) truncate_metrics(dir_ / "arrivals.jsonl", start);
    if (!resume) std::ofstream(dir_ / "arrivals.jsonl", std::ios::trunc);
  }

  // Whether this rank coordinates, and so writes.
  bool lead() const { return q_.membership().coordinator() == rank_; }

  // One line of metrics.jsonl, from any rank: written by the rank that leads, each step,
  // view, rejoin and evaluation once across coordinator changes (train/metrics_log.h).
  void write(const nlohmann::json& line) { log_.record(line, lead()); }

  // Step t's line: this rank's work and wait, and the step's decision.
  void step(int64_t t, int64_t epoch, double wall_s, double loss, double lr, const Work& work,
            double wait_ms, const collectives::QuorumResult& r) {
    if (!r.skipped && lead()) decided_[t] = {r.decide_ms, q_.membership().members()};
    write({{"type", "step"},
           {"step", t},
           {"epoch", epoch},
           {"wall_s", wall_s},
           {"loss", loss},
           {"lr", lr},
           {"contributors", r.count},
           {"quorum", r.quorum},
           {"dropped", r.dropped},
           {"compute_ms", work.compute_ms},
           {"delay_ms", double(work.delay.count()) / 1000.0},
           {"wait_ms", wait_ms},
           {"allreduce_ms", r.reduce_ms},
           {"decide_ms", r.decide_ms},
           {"ready_ms", r.ready_offsets_ms},
           {"view", r.epoch},
           {"skipped", r.skipped}});
  }

  // The coordinator's arrival log keeps its newest steps only (collectives/quorum/quorum.cc); the
  // coordinator appends each step to arrivals.jsonl once it is kArrivalsLag steps old, when
  // no late READY can change it any more (the coordinator logs late READYs for its newest
  // 4096 decided steps, kKeepDecided in step_decider.cc: the lag must stay above it),
  // and the rest at the end (finish).
  void after_step(int64_t done) {
    if (done % kArrivalsEvery == 0 && done > kArrivalsLag) write_arrivals(done - kArrivalsLag);
  }

  // The arrivals not written yet (every step is final now); the caller leads.
  void flush_arrivals() { write_arrivals(std::numeric_limits<int64_t>::max()); }

  // The membership counts of the run, from metrics.jsonl (MetricsLog::recount); the caller
  // leads.
  void recount(RunSummary& sum) const { log_.recount(sum); }

  // summary.json; the caller leads.
  void finish(const nlohmann::json& summary) {
    log_.close();
    std::ofstream(dir_ / "summary.json") << summary.dump(2) << '\n';
  }

 private:
  static constexpr int64_t kArrivalsLag = 8192, kArrivalsEvery = 1024;

  void write_arrivals(int64_t before) {
    if (q_.membership().coordinator() != rank_) return;
    std::ofstream arr(dir_ / "arrivals.jsonl", std::ios::app);
    for (auto& [step, offs] : q_.reports().arrival_log()) {
      if (int64_t(step) < arrivals_next_ || int64_t(step) >= before) continue;
      arr << nlohmann::json{{"step", step}, {"ready_ms", offs}}.dump() << '\n';
      arrivals_next_ = int64_t(step) + 1;
      if (auto d = decided_.find(int64_t(step)); d != decided_.end())
        full_sync_.add(step, offs, d->second.decide_ms, d->second.members);
    }
    decided_.erase(decided_.begin(), decided_.lower_bound(arrivals_next_));
  }

  struct Decided {
    double decide_ms;
    std::vector<int> members;
  };

  fs::path dir_;
  collectives::QuorumAllreduce& q_;
  int rank_;
  MetricsLog log_;
  int64_t arrivals_next_;  // the first step not yet written by this rank
  FullSyncEstimate& full_sync_;
  std::map<int64_t, Decided> decided_;  // steps this rank decided, arrivals not written yet
};

// The test-set evaluation after a step, sharded over the live members, with the result at
// the coordinator only (evaluate_sharded), which keeps it in the summary and the metrics.
class Evaluator {
 public:
  Evaluator(const TrainConfig& cfg, TrainerCore& core, const Dataset& test,
            collectives::QuorumAllreduce& q, int rank, FaultInjector faults, MetricsWriter& out,
            Clock::time_point t_start, bool tty)
      : cfg_(cfg),
        core_(core),
        test_(test),
        q_(q),
        rank_(rank),
        faults_(std::move(faults)),
        out_(out),
        t_start_(t_start),
        tty_(tty),
        steps_per_epoch_(core.steps_per_epoch()) {}

  void operator()(int64_t step, RunSummary& sum) {
    faults_(step, "eval");
    std::optional<EvalOut> got =
        evaluate_sharded(core_.model(), test_, cfg_.train.eval_batch, q_, rank_, uint64_t(step));
    if (got) record(step, *got, sum);
  }

  // This rank coordinates at the end. If the coordinator was lost after the last step and this
  // rank took over (issue 42, case 8: while it waited for the end, or already during the final
  // evaluation), the slices the others sent went with it: this rank evaluates the whole set.
  void again_here(int64_t step, RunSummary& sum) {
    if (last_step_ == step) return;  // the final evaluation came to this rank
    const std::vector<double> v = evaluate_slice(core_.model(), test_, cfg_.train.eval_batch, 0, 1);
    EvalOut e;
    e.accuracy = v[2] > 0 ? v[1] / v[2] : 0;
    e.loss = v[2] > 0 ? v[0] / v[2] : 0;
    record(step, e, sum);
  }

  void record(int64_t step, const EvalOut& e, RunSummary& sum) {
    double wall = seconds_since(t_start_);
    last_accuracy_ = e.accuracy;
    last_step_ = step;
    sum.test_accuracy = e.accuracy;
    sum.test_loss = e.loss;
    sum.best_test_accuracy = std::max(sum.best_test_accuracy, e.accuracy);
    if (cfg_.train.target_accuracy > 0 && !sum.time_to_target_s &&
        e.accuracy >= cfg_.train.target_accuracy)
      sum.time_to_target_s = wall;
    if (out_.lead()) {
      out_.write({{"type", "eval"},
                  {"step", step},
                  {"epoch", step / steps_per_epoch_},
                  {"wall_s", wall},
                  {"test_accuracy", e.accuracy},
                  {"test_loss", e.loss}});
      if (!tty_ || !cfg_.log.progress)
        spdlog::info("eval at step {}: test accuracy {:.4f}, loss {:.4f}", step, e.accuracy,
                     e.loss);
    }
  }

  double last_accuracy() const { return last_accuracy_; }  // -1: no evaluation yet
  int64_t last_step() const { return last_step_; }          // the step it was made after

 private:
  const TrainConfig& cfg_;
  TrainerCore& core_;
  const Dataset& test_;
  collectives::QuorumAllreduce& q_;
  int rank_;
  FaultInjector faults_;
  MetricsWriter& out_;
  Clock::time_point t_start_;
  bool tty_;
  int64_t steps_per_epoch_;
  double last_accuracy_ = -1;
  int64_t last_step_ = 0;
};

// This rank's checkpoints: the trainer's state and the quorum's pending carry, of which the
// newest three are kept (a rank killed mid-write still leaves a common older one).
class Checkpointer {
 public:
  Checkpointer(const TrainConfig& cfg, TrainerCore& core, collectives::QuorumAllreduce& q,
               fs::path dir, int quorum, FaultInjector faults)
      : cfg_(cfg),
        core_(core),
        q_(q),
        dir_(std::move(dir)),
        quorum_(quorum),
        faults_(std::move(faults)) {}

  void save(int64_t step) {
    CheckpointState st = core_.checkpoint_state();
    auto carry = q_.pending_carry();
    st.carry.resize(carry.size() / sizeof(float));
    std::memcpy(st.carry.data(), carry.data(), carry.size());
    nlohmann::json meta = core_.checkpoint_meta();
    meta["run"] = cfg_.run.name;
    meta["quorum"] = quorum_;
    // Who was in the job at this step: --resume needs only their checkpoints (a rank lost
    // earlier has older files; agree_on_resume_step).
    if (const auto views = q_.membership().view_changes(); !views.empty())
      meta["members"] = views.back().members;
    st.meta = meta.dump();
    save_checkpoint(checkpoint_path(dir_.string(), uint64_t(step)), st,
                    [&] { faults_(step, "checkpoint"); });
    std::vector<std::string> all;
    for (auto& e : fs::directory_iterator(dir_))
      if (e.path().extension() == ".qck") all.push_back(e.path().string());
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i + 3 < all.size(); ++i) fs::remove(all[i]);
  }

 private:
  const TrainConfig& cfg_;
  TrainerCore& core_;
  collectives::QuorumAllreduce& q_;
  fs::path dir_;
  int quorum_;
  FaultInjector faults_;
};

// The parameters after the last step, which no READY carries: every member reports its
// checksum (two exact 32-bit halves) to the coordinator, which compares them.
// The end is a step like the others (issue 42, case 8): a member waits for the coordinator's
// goodbye; a coordinator lost after the last step is taken over by a member, which then
// writes the outputs.
// Returns whether this rank coordinates at the end (from the start, or it took over).
bool await_the_end(collectives::QuorumAllreduce& q, int rank) {
  if (q.membership().survives_loss() && q.membership().coordinator() != rank)
    q.membership().await_end(rank, Clock::now() + 2 * q.options().evict + std::chrono::seconds(2));
  return q.membership().coordinator() == rank;
}

void check_final_replicas(TrainerCore& core, collectives::QuorumAllreduce& q, int rank,
                          int64_t step) {
  const uint64_t mine = checksum(core.params(), core.num_params());
  const std::vector<int> members = q.membership().members();
  const int k = int(members.size());
  const int me = int(std::lower_bound(members.begin(), members.end(), rank) - members.begin());
  const uint64_t key = uint64_t(step) | (uint64_t(1) << 62);
  if (q.membership().coordinator() != rank) {
    q.reports().report(key, me, k, {double(mine >> 32), double(mine & 0xFFFFFFFFu)});
    return;
  }
  if (k < 2) return;
  auto parts = q.reports().gather_reports(key, k, me, Clock::now() + q.options().evict, members);
  for (auto& [i, v] : parts) {
    if (v.size() != 2) continue;
    const uint64_t theirs = (uint64_t(v[0]) << 32) | uint64_t(v[1]);
    if (theirs != mine)
      throw Error(fmt::format("rank {}: replicas drifted: after step {} rank {} has parameter "
                              "checksum {:016x}, rank {} (this one) has {:016x}",
                              rank, step, members[size_t(i)], theirs, rank, mine));
  }
  if (int(parts.size()) < k - 1)
    spdlog::warn("parameter checksums after step {}: {} of {} members answered", step,
                 parts.size() + 1, k);
}

// The step counter: what each step counted, for the summary (throughput, mean contributors,
// the quorum histogram) and the progress line.
class StepTimer {
 public:
  StepTimer(int world, int64_t batch_per_rank) : world_(world), batch_per_rank_(batch_per_rank) {}

  void record(const collectives::QuorumResult& r) {
    ++quorum_hist_[r.quorum];
    counted_ += double(r.count) * double(batch_per_rank_);
    computed_ += double(world_) * double(batch_per_rank_);
    contributors_ += r.count;
    dropped_ += world_ - r.count;
  }

  double counted() const { return counted_; }  // samples whose gradients were counted
  double contributors() const { return contributors_; }  // summed over the steps

  // The summary's throughput over the step loop (`loop_s` for `ran` steps) and contributors
  // (the backup workers' saving comes from the coordinator's arrivals: train/full_sync.h).
  void summarize(RunSummary& sum, double loop_s, int64_t ran) const {
    sum.dropped_gradients = dropped_;
    sum.samples_per_s = loop_s > 0 ? counted_ / loop_s : 0;
    sum.computed_samples_per_s = loop_s > 0 ? computed_ / loop_s : 0;
    sum.mean_contributors = ran > 0 ? contributors_ / double(ran) : 0;
  }

  nlohmann::json quorum_histogram() const {  // steps decided with each quorum
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [q, n] : quorum_hist_) j[std::to_string(q)] = n;
    return j;
  }

 private:
  int world_;
  int64_t batch_per_rank_;
  double counted_ = 0, computed_ = 0, contributors_ = 0;
  int64_t dropped_ = 0;
  std::map<int, int64_t> quorum_hist_;
};

// Batch, compute, contribute. The straggler model's delay comes first, cut short when the
// step is decided without this rank; then the gradient of this rank's batch, with the batch's
// loss and this rank's stop flag in the two spare slots after it (kSpare), goes to the quorum
// all-reduce: the step's mean of the flags is > 0 on every rank alike when a contributor
// wants to stop. Every train.checksum_every
// steps the READY carries a checksum of the parameters (after t steps); the coordinator stops
// the job if two members' differ. A step decided without this rank abandons the work: the
// batch is skipped, so that the data stream stays aligned across ranks.
class Worker {
 public:
  Worker(const TrainConfig& cfg, TrainerCore& core, collectives::QuorumAllreduce& q,
         const collectives::StragglerModel& straggler, int rank, FaultInjector faults)
      : cfg_(cfg),
        core_(core),
        q_(q),
        straggler_(straggler),
        rank_(rank),
        faults_(std::move(faults)),
        grad_(core.gradient()),
        n_params_(core.num_params()) {}

  // `stop`: this rank was asked to stop (TrainerOptions::stop); the flag goes with the gradient.
  Work compute_and_contribute(int64_t t, bool stop) {
    Work w;
    w.start = Clock::now();
    w.delay = straggler_.delay(uint64_t(cfg_.run.seed), rank_, uint64_t(t));
    w.abandoned = collectives::sleep_unless(w.delay, [&] { return q_.excluded(uint64_t(t)); });
    if (!w.abandoned && !q_.excluded(uint64_t(t))) {
      auto c0 = Clock::now();
      grad_[n_params_] = float(core_.compute_gradient());
      grad_[n_params_ + 1] = stop ? 1.0f : 0.0f;
      w.compute_ms = ms_since(c0);
      std::optional<uint64_t> digest;
      if (cfg_.train.checksum_every > 0 && t > 0 && t % cfg_.train.checksum_every == 0)
        digest = checksum(core_.params(), n_params_);
      std::optional<collectives::QuorumAllreduce::Norms> norms;
      if (estimate_noise_) norms = collectives::QuorumAllreduce::Norms{sq_norm(grad_), prev_sq_};
      q_.contribute(uint64_t(t), grad_, n_params_ + kSpare, digest, norms);
      faults_(t, "ready");
    } else {
      w.abandoned = true;
      core_.skip_batch();
    }
    return w;
  }

  // The step's mean gradient (null: the step was skipped): its squared norm goes with the
  // next READY (quorum "auto" estimating the noise scale).
  void took_result(const float* mean) {
    if (estimate_noise_) prev_sq_ = mean ? std::optional<double>(sq_norm(mean)) : std::nullopt;
  }

 private:
  double sq_norm(const float* g) const {  // the gradient's, without the spare slots after it
    double s = 0;
    for (size_t i = 0; i < n_params_; ++i) s += double(g[i]) * double(g[i]);
    return s;
  }

  const TrainConfig& cfg_;
  TrainerCore& core_;
  collectives::QuorumAllreduce& q_;
  const collectives::StragglerModel& straggler_;
  int rank_;
  FaultInjector faults_;
  float* grad_;
  size_t n_params_;
  const bool estimate_noise_ = cfg_.quorum.quorum_auto && cfg_.quorum.noise_scale_estimated();
  std::optional<double> prev_sq_;
};

// The membership as the steps see it. A rank that rejoined at a step gets the state before
// its update from its donor, and logs the first step that counts it again. View changes
// (ranks lost, ranks back) are logged when the first step decided in the new view completes;
// a rank that comes back heals the job once a step counts it again.
class Membership {
 public:
  Membership(TrainerCore& core, collectives::QuorumAllreduce& q, MetricsWriter& out, int rank,
             const std::optional<collectives::JoinInfo>& joined, Clock::time_point t_start,
             Clock::time_point process_start, std::shared_ptr<std::vector<char>> received)
      : core_(core),
        q_(q),
        out_(out),
        rank_(rank),
        joining_(joined.has_value()),
        view_epoch_(joined ? joined->epoch : 0),
        t_start_(t_start),
        process_start_(process_start) {
    // A job that survives a loss can take a rank back, and any member may be its donor: the
    // buffer for the state is made (and its pages touched) here, not between two steps. A
    // rank that rejoined has one: the buffer its own state came in.
    if (received) {
      state_buf_ = std::move(received);
    } else if (q.membership().survives_loss() && q.membership().members().size() > 1) {
      state_buf_ = populated_buffer(encoded_checkpoint_size(core.checkpoint_view()));
      encode_checkpoint_into(core.checkpoint_view(), *state_buf_);
    }
  }

  // Once step t is decided: `position` is this rank's data position before the step's batch.
  void decided(int64_t t, const collectives::QuorumResult& r, const DataPosition& position) {
    for (const auto& j : r.joined) {
      if (j.donor != rank_) continue;
      CheckpointView st = core_.checkpoint_view();
      st.position = position;
      // The buffer of the last transfer when the engine has let go of it (already in memory:
      // fresh pages cost more than the copy), else a new one.
      if (!state_buf_ || state_buf_.use_count() > 1) {
        state_buf_ = populated_buffer(encoded_checkpoint_size(st));
      } else {  // the engine's release of its reference (after its send) happens before our writes
        std::atomic_thread_fence(std::memory_order_acquire);
      }
      encode_checkpoint_into(st, *state_buf_);
      const size_t size = state_buf_->size();
      q_.membership().send_state(j.rank, uint64_t(t), state_buf_);
      spdlog::info("step {}: sending the state ({:.1f} MB) to rank {}, which rejoins", t,
                   double(size) / 1e6, j.rank);
    }
    if (joining_ && !counted_once_ && r.self_counted) {
      counted_once_ = true;
      spdlog::warn("rank {}: first contribution counted again at step {}, {:.2f} s after this "
                   "process started",
                   rank_, t, std::chrono::duration<double>(Clock::now() - process_start_).count());
    }
  }

  // After step t's update.
  void after_step(int64_t t, const collectives::QuorumResult& r, RunSummary& sum) {
    if (r.epoch > view_epoch_) log_views(t, r, sum);
    for (auto it = healing_.begin(); it != healing_.end();) {
      if (!r.contains(it->first)) {
        ++it;
        continue;
      }
      const double heal = seconds_since(it->second.lost);
      sum.heal_s = std::max(sum.heal_s, heal);
      out_.write({{"type", "rejoin"},
                  {"rank", it->first},
                  {"incarnation", it->second.incarnation},
                  {"join_step", it->second.join_step},
                  {"counted_step", t},
                  {"heal_s", heal}});
      it = healing_.erase(it);
    }
  }

 private:
  void log_views(int64_t step, const collectives::QuorumResult& r, RunSummary& sum) {
    const auto now = Clock::now();
    // Each view once, though a step can come in a view older than the step before it.
    for (const auto& v : collectives::views_learned(q_.membership().view_changes(), r.epoch, &view_epoch_)) {
      double detect_ms = 0;
      nlohmann::json left = nlohmann::json::array(), back = nlohmann::json::array();
      std::vector<int> who;
      std::vector<std::string> why;
      for (const auto& l : v.left) {
        left.push_back({{"rank", l.rank}, {"why", l.why}, {"silent_ms", l.silent_ms}});
        sum.evicted_ranks.push_back(l.rank);
        who.push_back(l.rank);
        why.push_back(fmt::format("{}: {}, last heard {:.0f} ms before", l.rank, l.why,
                                  l.silent_ms));
        detect_ms = std::max(detect_ms, l.silent_ms);
        ++sum.failures_survived;
        // Its last sign of life (for a restarted rank: the old incarnation's).
        lost_at_[l.rank] = v.seen - std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double, std::milli>(l.silent_ms));
      }
      for (const auto& j : v.joined) {
        back.push_back({{"rank", j.rank},
                        {"incarnation", j.incarnation},
                        {"step", j.step},
                        {"donor", j.donor}});
        ++sum.rejoins;
        auto la = lost_at_.find(j.rank);
        healing_[j.rank] = {int64_t(j.step), j.incarnation,
                           la != lost_at_.end() ? la->second : v.seen};
        spdlog::warn("view {}: rank {} rejoined at step {} (incarnation {}, {:.1f} s after it "
                     "left; state from rank {}); {} ranks: {}",
                     v.epoch, j.rank, j.step, j.incarnation,
                     la != lost_at_.end() ? std::chrono::duration<double>(v.seen - la->second).count()
                                         : 0.0,
                     j.donor, v.members.size(), fmt::join(v.members, ", "));
      }
      nlohmann::json line{{"type", "view"},
                          {"step", step},
                          {"epoch", v.epoch},
                          {"wall_s", std::chrono::duration<double>(now - t_start_).count()},
                          {"members", v.members},
                          {"left", left},
                          {"joined", back}};
      // From the lost rank's last sign of life to this step, the first completed without it.
      const double recovery =
          detect_ms / 1000.0 + std::chrono::duration<double>(now - v.seen).count();
      if (!v.left.empty()) {
        sum.recovery_s = std::max(sum.recovery_s, recovery);
        line["detection_ms"] = detect_ms;
        line["recovery_s"] = recovery;
      }
      out_.write(line);
      if (v.left.empty()) continue;
      spdlog::warn("view {}: rank(s) {} left ({}); {} ranks go on: {}; step {} "
                   "completed {:.2f} s after the lost rank's last sign of life",
                   v.epoch, fmt::join(who, ", "), fmt::join(why, "; "), v.members.size(),
                   fmt::join(v.members, ", "), step, recovery);
    }
  }

  struct Healing {
    int64_t join_step;
    uint32_t incarnation;
    Clock::time_point lost;
  };

  TrainerCore& core_;
  collectives::QuorumAllreduce& q_;
  MetricsWriter& out_;
  int rank_;
  bool joining_;
  bool counted_once_ = false;  // the joiner: has a step counted its contribution yet
  uint64_t view_epoch_;        // the latest view logged (views_learned)
  Clock::time_point t_start_, process_start_;
  std::shared_ptr<std::vector<char>> state_buf_;  // the state for a rejoining rank
  std::map<int, Clock::time_point> lost_at_;  // rank -> when the view without it formed
  std::map<int, Healing> healing_;            // rejoined, not yet counted
};

// The progress line (log.progress), at the coordinator: redrawn on a terminal at most four
// times a second, else logged every 10 s, and at the last step.
class Progress {
 public:
  Progress(const TrainConfig& cfg, const TrainerCore& core, collectives::QuorumAllreduce& q,
           MetricsWriter& out, int world, int64_t start, int64_t total, int64_t steps_per_epoch,
           Clock::time_point t_start, bool tty)
      : on_(cfg.log.progress),
        core_(core),
        counted_start_(core.counted_gradients()),
        q_(q),
        out_(out),
        world_(world),
        start_(start),
        total_(total),
        steps_per_epoch_(steps_per_epoch),
        t_start_(t_start),
        tty_(tty) {}

  // `evaluation`: the newest test-set evaluation (its accuracy and step).
  void after_step(int64_t t, double loss, const Evaluator& evaluation, const StepTimer& timer,
                  const RunSummary& sum) {
    if (!on_ || !out_.lead()) return;
    const int64_t done = t + 1;
    auto now = Clock::now();
    double since = std::chrono::duration<double>(now - last_).count();
    const bool last = core_.budget_spent(done);
    if (!((tty_ && since > 0.25) || (!tty_ && since > 10) || last)) return;
    last_ = now;
    double wall = std::chrono::duration<double>(now - t_start_).count();
    double sps = wall > 0 ? timer.counted() / wall : 0;
    // A budget of gradients: how far by the counted gradients (the steps left are not known).
    const int64_t budget = core_.budget_gradients(), counted = core_.counted_gradients();
    double eta = 0;
    std::string where;
    if (budget > 0) {
      if (counted > counted_start_)
        eta = wall / double(counted - counted_start_) *
              double(std::max<int64_t>(0, budget - counted));
      where = fmt::format("epoch {} step {} gradients {}/{}", t / steps_per_epoch_ + 1, done,
                          counted, budget);
    } else {
      if (done > start_) eta = wall / double(done - start_) * double(total_ - done);
      where = fmt::format("epoch {}/{} step {}/{}", t / steps_per_epoch_ + 1,
                          (total_ + steps_per_epoch_ - 1) / steps_per_epoch_, done, total_);
    }
    // train_loss: the step's mean batch loss; test_acc: the newest evaluation, at its step.
    const double accuracy = evaluation.last_accuracy();
    std::string line = fmt::format(
        "{} train_loss {:.4f} test_acc {} {:.0f} samples/s contributors {:.2f}/{} ETA {}{}", where,
        loss,
        accuracy < 0 ? std::string("-")
                     : fmt::format("{:.2f}% (step {})", 100 * accuracy, evaluation.last_step()),
        sps, timer.contributors() / double(done - start_), world_, hms(eta),
        sum.evicted_ranks.empty()
            ? std::string()
            : fmt::format(" live {}/{} (lost {}{})", q_.membership().members().size(), world_,
                          fmt::join(sum.evicted_ranks, ","),
                          sum.rejoins ? fmt::format(", {} rejoined", sum.rejoins) : ""));
    if (tty_)
      fmt::print(stderr, "\r\033[K{}", line);
    else
      spdlog::info("{}", line);
  }

  // After the loop: the terminal's line ends.
  void end() {
    if (tty_ && on_ && out_.lead()) fmt::print(stderr, "\n");
  }

 private:
  bool on_;
  const TrainerCore& core_;
  int64_t counted_start_;
  collectives::QuorumAllreduce& q_;
  MetricsWriter& out_;
  int world_;
  int64_t start_, total_, steps_per_epoch_;
  Clock::time_point t_start_;
  bool tty_;
  Clock::time_point last_ = Clock::now() - std::chrono::hours(1);
};

}  // namespace

namespace {

// summary.json: the run's summary, the job's shape and the quorums its steps were decided with.
nlohmann::json summary_json(const RunSummary& sum, const TrainConfig& cfg, int world, int quorum,
                            const StepTimer& timer, const std::string& provider,
                            const collectives::StragglerModel& straggler, bool finished,
                            int64_t counted_gradients, const std::vector<std::string>& hosts) {
  nlohmann::json j = sum.to_json();
  j["build"] = build::fields();  // the binary (net/base/build_info.h)
  j["hosts"] = hosts;            // rank r ran on hosts[r]
  j["budget"] = cfg.train.budget;
  j["counted_gradients"] = counted_gradients;
  j["world"] = world;
  j["quorum"] = cfg.quorum.quorum_auto ? nlohmann::json("auto") : nlohmann::json(quorum);
  j["quorum_histogram"] = timer.quorum_histogram();
  j["provider"] = provider;
  j["straggler"] = straggler.spec();
  j["finished"] = finished;
  return j;
}

// A step of train_sync: the gradient of this rank's batch goes into the quorum all-reduce,
// the step's mean gradient (the first Q contributions) is applied, and the parts beside the
// loop record it. What it works with is set up by train_sync, once.
struct SyncStep {
  const TrainConfig& cfg;
  TrainerCore& core;
  collectives::QuorumAllreduce& q;
  const FaultInjector& maybe_fault;
  Worker& worker;
  StepTimer& timer;
  Membership& membership;
  MetricsWriter& out;
  Evaluator& evaluate;
  Checkpointer& checkpoints;
  Progress& progress;
  const size_t n_params;
  const int sched_quorum;
  const int64_t steps_per_epoch, eval_every;
  const Clock::time_point t_start;
  const std::atomic<int>* stop;  // TrainerOptions::stop

  // Returns true when the ranks agreed to stop after this step (a contributor's stop flag
  // was counted): the caller checkpoints it and ends the loop.
  bool operator()(int64_t t, collectives::QuorumAllreduce::View& result, double& last_loss,
                  RunSummary& sum) {
    maybe_fault(t, "step");
    const DataPosition position = core.position();  // before this step's batch
    const bool stop_here = stop != nullptr && stop->load(std::memory_order_relaxed) != 0;
    const Work work = worker.compute_and_contribute(t, stop_here);
    const auto w0 = Clock::now();
    // Zero-copy: the mean gradient is read where the reduction left it (in a job that can
    // lose ranks, the all-reduce's kept buffer), held until the next step's wait.
    collectives::QuorumResult r = q.wait(uint64_t(t), &result);
    const double wait_ms = ms_since(w0);
    membership.decided(t, r, position);
    const double lr_scale = cfg.quorum.quorum_auto ? double(r.count) / sched_quorum : 1.0;
    const double lr = core.lr() * lr_scale;
    bool agreed_stop = false;
    if (r.skipped) {
      // A member was lost mid-step and too few contributors survived: no rank updates.
      ++sum.skipped_steps;
      spdlog::warn("step {} skipped on every rank: a member was lost during it", t);
    } else {
      const float* mean = static_cast<const float*>(result.data);
      last_loss = mean[n_params];
      agreed_stop = mean[n_params + 1] > 0;  // bit-identical on every rank
      worker.took_result(mean);
      // Every rank holds the same mean and parameters, so every rank decides the same here.
      const bool skip = cfg.train.nonfinite == "skip";
      std::string bad = nonfinite_text(mean, n_params);
      if (bad.empty() && !core.apply_gradient_finite(mean, lr_scale, r.count, skip))
        bad = "a parameter after the step's update";
      if (!bad.empty()) {
        if (!skip)
          throw Error(fmt::format(
              "step {} ({} contributor(s)): {} is not finite: the run diverged (train.lr = "
              "{}, {} at this step); train.nonfinite = \"skip\" leaves such steps out instead",
              t, r.count, bad, cfg.train.lr, lr));
        if (sum.nonfinite_steps++ % 100 == 0)
          spdlog::warn("step {} left out on every rank: {} is not finite ({} such step(s) so "
                       "far)",
                       t, bad, sum.nonfinite_steps);
      }
    }
    if (r.skipped) worker.took_result(nullptr);
    membership.after_step(t, r, sum);
    timer.record(r);
    out.step(t, t / steps_per_epoch, seconds_since(t_start), last_loss, lr, work, wait_ms, r);
    const int64_t done = t + 1;
    out.after_step(done);
    if (agreed_stop) return true;  // the caller checkpoints `done`
    if (done % eval_every == 0 && !core.budget_spent(done)) evaluate(done, sum);
    if (cfg.train.checkpoint_every > 0 && done % cfg.train.checkpoint_every == 0)
      checkpoints.save(done);
    progress.after_step(t, last_loss, evaluate, timer, sum);
    return false;
  }
};

// The step loop from `start`: until the budget is spent, `stop_after` steps ran (> 0), or the
// ranks agreed to stop. Returns the first step not run and whether they stopped.
std::pair<int64_t, bool> run_steps(SyncStep& step, TrainerCore& core, int64_t start,
                                   int64_t stop_after, RunSummary& sum) {
  collectives::QuorumAllreduce::View result;  // the current step's mean gradient
  double last_loss = 0;
  int64_t t = start;
  for (; !core.budget_spent(t); ++t) {
    if (stop_after > 0 && t - start >= stop_after) break;
    if (step(t, result, last_loss, sum)) return {t + 1, true};
  }
  return {t, false};
}

// After the ranks stopped at step t (SIGTERM/SIGUSR1) and saved it: rank 0 says how to go on,
// and no rank leaves before every live member has saved (wait_for_stopped_members).
void after_stop(const TrainConfig& cfg, const TrainerOptions& opts,
                const std::vector<int>& members, int rank, int64_t t, const fs::path& run_dir) {
  if (rank == 0)
    spdlog::warn("stopped by a signal after step {} (every rank after the same step): checkpoint "
                 "written to {}; run the same command with --resume to go on",
                 t, (run_dir / "checkpoints").string());
  const auto limit = std::chrono::milliseconds(std::max<int64_t>(60000, cfg.quorum.deadline_ms));
  if (opts.store) wait_for_stopped_members(*opts.store, members, rank, t, limit);
}

// Rank 0's lines at the start of a run: its shape, and where it writes.
void announce_start(const TrainConfig& cfg, const TrainerCore& core, int world, int quorum,
                    const std::string& provider, const collectives::StragglerModel& straggler,
                    const fs::path& run_dir) {
  const size_t n_params = core.num_params();
  const int64_t total = core.total_steps(), steps_per_epoch = core.steps_per_epoch();
  spdlog::info(
      "training {} ({} parameters) on {} ranks, quorum {}, {} ({} steps per epoch), "
      "provider {}, straggler {}",
      cfg.model.type, n_params, world, quorum,
      core.budget_gradients() > 0
          ? fmt::format("until {} gradients are counted ({} steps of full sync)",
                        core.budget_gradients(), total)
          : fmt::format("{} steps", total),
      steps_per_epoch, provider, straggler.spec());
  spdlog::info("run directory {}: metrics.jsonl, summary.json; checkpoints {}",
               fs::absolute(run_dir).string(),
               cfg.train.checkpoint_every > 0
                   ? fmt::format("every {} steps", cfg.train.checkpoint_every)
                   : std::string("at the end and when stopped by SIGTERM/SIGUSR1"));
}

namespace {

// The rank's datasets, checked against the others' (a joiner's were checked by its first
// incarnation). A new incarnation restarted into a job that ended meanwhile leaves first, not
// after the seconds its data take to load (a lost job's restarts would keep the launcher
// waiting).
DatasetPair load_data(const TrainConfig& cfg, collectives::Communicator& comm,
                      const TrainerOptions& opts, bool joining) {
  if (joining && opts.store)
    collectives::refuse_join_to_ended_job(
        collectives::read_job_end(*opts.store, kQuorumInstance, comm.size()), comm.rank());
  DatasetPair data = allocating(
      fmt::format("the datasets ({})",
                  cfg.data.dataset == "synthetic" ? "synthetic" : "data.path " + cfg.data.path),
      0, [&] { return load_datasets(cfg.data, uint64_t(cfg.run.seed), opts.local_ranks); });
  if (comm.size() > 1 && !joining) check_data_agrees(cfg, data, comm);
  return data;
}

}  // namespace

// The synchronous trainer (train.mode "sync"): each step, every rank computes the gradient
// of its batch and contributes it to the quorum all-reduce, waits for the step's decision
// (the mean of the first Q contributions) and applies it; the parts beside the loop above
// write the metrics, evaluate, checkpoint and time the steps. `joining`: this process is a
// new incarnation that rejoins the running job.
RunSummary train_sync(const TrainConfig& cfg, collectives::Communicator& comm,
                      const TrainerOptions& opts, bool joining) {
  const int rank = comm.rank(), world = comm.size();
  const int quorum = cfg.quorum_count(world);
  const uint64_t seed = uint64_t(cfg.run.seed);
  const fs::path run_dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  const fs::path ckpt_dir = run_dir / "checkpoints" / fmt::format("rank-{}", rank);
  fs::create_directories(ckpt_dir);
  if (!opts.resume && !joining) guard_earlier_checkpoints(run_dir, ckpt_dir, comm, opts.force);

  DatasetPair data = load_data(cfg, comm, opts, joining);
  const AllocationScope model_scope(
      fmt::format("the model ({}) and its training state", cfg.model.type));
  // quorum "auto": the schedule is the one of the largest quorum, each step's rate scaled by
  // its contributors over that (the linear rule, step by step).
  const int sched_quorum =
      cfg.quorum.quorum_auto ? (cfg.quorum.max > 0 ? int(cfg.quorum.max) : world) : quorum;
  TrainerCore core(cfg, data, rank, world, sched_quorum);
  const size_t n_params = core.num_params();
  const int64_t batch_per_rank = cfg.train.batch_per_rank;
  const int64_t steps_per_epoch = core.steps_per_epoch();
  if (steps_per_epoch < 1)
    throw ConfigError(
        fmt::format("train.batch_per_rank: {} samples over {} ranks leave no full "
                    "batch of {} per rank",
                    data.train.size(), world, batch_per_rank));
  const int64_t total = core.total_steps();
  const auto straggler = collectives::StragglerModel::parse(cfg.straggler.model);
  const int64_t eval_every = cfg.train.eval_every > 0 ? cfg.train.eval_every : steps_per_epoch;

  collectives::QuorumOptions qo = quorum_options(cfg, opts, quorum, joining);
  const FaultInjector maybe_fault(opts.faults, rank, comm.engine());
  qo.on_phase = maybe_fault.ring_phase_hook();
  // The gradient plus the spare slots for the loss and the stop flag (Network::grads()): they
  // come with the reduction, which happens in place, without copies.
  collectives::QuorumAllreduce q(comm, n_params + kSpare, qo);
  comm.register_buffer(core.gradient(), (n_params + kSpare) * sizeof(float));

  int64_t start = 0;
  std::optional<collectives::JoinInfo> joined;
  std::shared_ptr<std::vector<char>> state;  // rejoin: the state received
  if (joining) {
    start = rejoin(q, core, opts, rank, cfg.quorum.deadline_ms, joined, state);
  } else if (opts.resume) {
    start = resume_from_checkpoints(cfg, comm, core, q, ckpt_dir);
  }

  FullSyncEstimate full_sync([&straggler, seed](int r, uint64_t step) {
    return double(straggler.delay(seed, r, step).count()) / 1000.0;
  });
  MetricsWriter out(run_dir, q, rank, start, joining, full_sync);
  if (rank == 0 && !joining) {
    out.create(cfg, opts.resume, start);
    announce_start(cfg, core, world, quorum, comm.provider(), straggler, run_dir);
  }
  if (!joining) comm.barrier();

  RunSummary sum;
  const auto t_start = Clock::now();
  const bool tty = isatty(2);
  Worker worker(cfg, core, q, straggler, rank, maybe_fault);
  StepTimer timer(world, batch_per_rank);
  Membership membership(core, q, out, rank, joined, t_start, opts.process_start,
                        std::move(state));
  Evaluator evaluate(cfg, core, data.test, q, rank, maybe_fault, out, t_start, tty);
  Checkpointer checkpoints(cfg, core, q, ckpt_dir, quorum, maybe_fault);
  Progress progress(cfg, core, q, out, world, start, total, steps_per_epoch, t_start, tty);

  SyncStep step{cfg,      core,     q,           maybe_fault, worker,   timer,
                membership, out,     evaluate,    checkpoints, progress, n_params,
                sched_quorum, steps_per_epoch, eval_every, t_start, opts.stop};
  const auto [t, stopped] = run_steps(step, core, start, opts.stop_after, sum);
  progress.end();
  const double loop_s = seconds_since(t_start);
  const bool finished = core.budget_spent(t);
  sum.preempted = stopped && !finished;
  if (sum.preempted && opts.stop) sum.stop_signal = opts.stop->load();
  if (finished) evaluate(t, sum);
  if (finished && cfg.train.checksum_every > 0) check_final_replicas(core, q, rank, t);
  if (cfg.train.checkpoint_every > 0 || finished || sum.preempted) checkpoints.save(t);

  sum.wall_s = seconds_since(t_start);
  sum.steps = t;
  // Throughput over the step loop (evaluations inside it included, the final one not).
  timer.summarize(sum, loop_s, t - start);
  sum.params_checksum = checksum(core.params(), n_params);
  if (finished && await_the_end(q, rank)) evaluate.again_here(t, sum);
  if (out.lead()) {
    out.recount(sum);  // the whole run's, whoever coordinated when
    out.flush_arrivals();  // every step's arrivals are final: the estimate is complete
    sum.backup_saved_s = full_sync.saved_ms() / 1000.0;
    sum.full_sync_estimate_s = loop_s + sum.backup_saved_s;
    out.finish(summary_json(sum, cfg, world, quorum, timer, comm.provider(), straggler, finished,
                            core.counted_gradients(), opts.hosts));
  }
  if (sum.preempted) after_stop(cfg, opts, q.membership().members(), rank, t, run_dir);
  return sum;
}

}  // namespace

// A node whose dataset files differ (another version, a partial copy) would not be noticed by
// the configuration check, which leaves data.path out (issue 44).
void check_data_agrees(const TrainConfig& cfg, const DatasetPair& data,
                       collectives::Communicator& comm) {
  const int world = comm.size();
  const uint64_t mine = data.digest;
  std::vector<uint64_t> all(size_t(world), 0);
  comm.allgather(&mine, all.data(), 1, DataType::kInt64);
  std::map<uint64_t, int> votes;
  for (uint64_t d : all) ++votes[d];
  if (votes.size() == 1) return;
  uint64_t ref = all[0];
  for (const auto& [d, n] : votes)
    if (n > votes[ref]) ref = d;
  std::vector<std::string> odd;
  for (int r = 0; r < world; ++r)
    if (all[size_t(r)] != ref) odd.push_back(fmt::format("{} ({:016x})", r, all[size_t(r)]));
  int first = 0;
  while (all[size_t(first)] != ref) ++first;
  throw DataError(fmt::format(
      "the ranks' training data differ: the dataset files of rank(s) {} are not those of rank "
      "{} ({:016x}); rank {} read data.path '{}' ({:016x}); every rank needs the same files",
      fmt::join(odd, ", "), first, ref, comm.rank(), cfg.data.path, mine));
}

RunSummary train(const TrainConfig& cfg, collectives::Communicator& comm,
                 const TrainerOptions& opts) {
  const int rank = comm.rank(), world = comm.size();
  // A new incarnation of this rank joins the running job (docs/design.md, "Rejoin"): it runs
  // no collective with the others, takes the state of a live member, and its configuration is
  // checked against that state's fingerprint instead.
  const bool joining = opts.incarnation > 0 && world > 1;
  if (joining && !opts.store)
    throw UsageError(fmt::format("rank {}: incarnation {} joins a running job, which needs the "
                                 "rendezvous store",
                                 rank, opts.incarnation));
  // Every rank runs the same configuration and kernels (a joiner is checked at admission).
  if (world > 1 && !joining) check_config_agrees(cfg, comm);
  cfg.validate(world);
  if (cfg.train.mode == "async") {
    if (joining)
      throw ConfigError(fmt::format("rank {}: train.mode = \"async\" cannot take a rank back "
                                    "(incarnation {}); restart the job with --resume instead",
                                    rank, opts.incarnation));
    return train_async(cfg, comm, opts);
  }
  return train_sync(cfg, comm, opts, joining);
}

}  // namespace qring::train
