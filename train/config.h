// qring-train configuration: one struct per TOML section, parsed strictly.
//
// Every key has a type, a default and a range. Unknown keys, wrong types and out-of-range values
// throw qring::ConfigError naming the key (e.g. "train.lr: must be > 0, got -1"). Overrides are
// "section.key=value" strings applied after the file; the value is read as a TOML value
// (numbers, true/false, [arrays], "strings"), and string keys also accept bare text
// (model.type=cnn, straggler.model=fixed:2:200). docs/training.md lists all keys.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace qring::train {

struct RunSection {
  std::string name = "qring";  // one name inside out_dir: no '/', not "." or ".."
  std::string out_dir = "runs";
  int64_t seed = 42;
  // The umask of the run's outputs (checkpoints, metrics, summary), 3 octal digits: "077"
  // keeps them to their owner (files 0600, directories 0700).
  std::string umask = "077";
};

struct DataSection {
  std::string path = "/usr/share/datasets/fashion-mnist";
  std::string dataset = "fashion-mnist";  // fashion-mnist | synthetic
  int64_t synthetic_train = 8192;
  int64_t synthetic_test = 2048;
  // The memory the datasets may take, in bytes (images as floats and labels, training and
  // test sets); 0 = no limit but the available memory, which bounds it in any case (shared
  // by the ranks of a host). Both files' headers are checked against it before anything is
  // allocated.
  int64_t max_bytes = int64_t{2} << 30;
};

struct ModelSection {
  std::string type = "mlp";                       // mlp | cnn
  std::vector<int64_t> hidden = {512, 256};       // MLP hidden layers; CNN dense-head hidden layers
  std::vector<int64_t> conv_channels = {16, 32};  // CNN: one conv-ReLU-maxpool block per entry
  int64_t conv_kernel = 3;                        // CNN: square kernel, stride 1
  std::string conv_padding = "same";              // CNN: same (odd kernel; keeps H x W) | valid
};

struct TrainSection {
  // sync: synchronous SGD over the quorum all-reduce (with backup workers when Q < W);
  // async: asynchronous SGD with a parameter server on rank 0 (train/async_sgd.h).
  std::string mode = "sync";
  int64_t batch_per_rank = 64;
  int64_t epochs = 10;  // used when steps == 0
  int64_t steps = 0;    // total optimizer steps; 0 = epochs * steps_per_epoch
  // steps: the run is that many steps. gradients (sync): it ends once the updates have
  // counted steps x world gradients, as many as full sync would; with backups it runs more
  // steps of fewer gradients, its schedule read at counted gradients / the schedule's quorum.
  std::string budget = "steps";
  // async: the learning rate of an update whose gradient is `s` updates stale: the schedule's
  // ("none") or the schedule's / max(1, s) ("divide": the staleness-aware rule of Zhang, Gupta,
  // Lian and Liu, "Staleness-aware Async-SGD", 2016; train/optim.h, staleness_lr_scale).
  std::string async_staleness = "none";
  double lr = 0.05;     // base learning rate, before lr_scaling
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = 5e-4;
  int64_t warmup_steps = 200;
  std::string schedule = "cosine";  // constant | step | cosine
  int64_t step_decay_every = 1000;  // schedule = step: multiply by step_decay_factor every N steps
  double step_decay_factor = 0.1;
  std::string lr_scaling = "linear";  // none | linear | sqrt
  int64_t reference_batch = 256;
  int64_t eval_every = 0;  // steps; 0 = at the end of every epoch
  int64_t eval_batch = 1000;
  double target_accuracy = 0.0;  // 0 = none; else time-to-accuracy is reported
  int64_t checkpoint_every = 0;  // steps; 0 = off
  int64_t checksum_every = 100;  // steps; 0 = off (cost: docs/benchmarks.md)
  // A step whose mean loss or gradient is not finite (NaN, inf): "fail" stops the job on
  // every rank naming the step; "skip" leaves the parameters and momentum as they were,
  // counts the step (summary: nonfinite_steps) and goes on.
  std::string nonfinite = "fail";
};

struct QuorumSection {
  // TOML integer: a count Q. TOML float in (0, 1]: a fraction of the world, Q = ceil(f * W).
  // "auto": the coordinator chooses Q(t) per step within [min, max] (collectives/quorum/auto_quorum.h).
  double quorum = 1.0;
  bool quorum_is_fraction = true;
  bool quorum_auto = false;
  int64_t min = 1;  // quorum "auto": bounds of Q(t); max 0 = the world
  int64_t max = 0;
  // quorum "auto": the gradient-noise scale B in samples: the value of a step that averages k
  // workers' batches of b samples is taken as k / (1 + k b / B) instead of k
  // (collectives/quorum/auto_quorum.h). 0 (the default): none, the linear value k, which
  // fits qring's linear learning-rate rule (docs/reproduction.md, "The adaptive quorum");
  // "estimate" (noise_scale_estimate): B is the run's own estimate from its steps
  // (collectives/quorum/noise_scale.h); a number > 0 fixes it.
  double noise_scale = 0;
  bool noise_scale_estimate = false;
  bool noise_scale_estimated() const { return noise_scale_estimate; }
  int64_t grace_ms = 0;
  int64_t deadline_ms = 30000;
  std::string late_policy = "drop";  // drop | carry
  // Membership (docs/design.md, "Membership"): a rank silent this long leaves the job's view
  // (every rank's engine heartbeats, so long compute is not silence); one that missed
  // evict_steps consecutive steps too (0 = never); the job stops below min_world live ranks
  // (0 = the quorum). A rank whose oldest missing result was decided more than max_lag_ms
  // ago leaves too and rejoins with a live member's state (0 = 3 x evict_ms, -1 = never).
  int64_t evict_ms = 5000;
  int64_t evict_steps = 0;
  int64_t max_lag_ms = 0;
  int64_t min_world = 0;
};

struct StragglerSection {
  std::string model = "none";  // collectives/straggler.h: none, fixed:R:MS, exp:MEAN_MS, ...
};

struct NetSection {
  std::string provider = "auto";
};

struct LogSection {
  std::string level = "info";  // trace | debug | info | warn | error | off
  bool progress = true;
};

struct TrainConfig {
  RunSection run;
  DataSection data;
  ModelSection model;
  TrainSection train;
  QuorumSection quorum;
  StragglerSection straggler;
  NetSection net;
  LogSection log;

  // Parses a TOML file (path) or text, then applies the overrides in order, then validates.
  static TrainConfig from_file(const std::string& path,
                               const std::vector<std::string>& overrides = {});
  static TrainConfig from_string(const std::string& toml_text,
                                 const std::vector<std::string>& overrides = {},
                                 const std::string& source_name = "<string>");

  // Applies one "section.key=value" override (no validation of cross-key rules; call
  // validate() afterwards). Throws ConfigError naming the key.
  void apply_override(const std::string& assignment);

  // Checks every range and cross-key rule. With world > 0 also checks quorum <= world.
  void validate(int world = 0) const;

  // Q for a world of W ranks (count, or ceil(fraction * W)); ConfigError naming
  // quorum.quorum if it is not within 1..W.
  int quorum_count(int world) const;

  // The resolved configuration, every key, re-parseable by from_string.
  std::string to_toml() const;
  nlohmann::json to_json() const;

  // FNV-1a 64 over the keys a checkpoint must agree on to resume exactly: run.seed, data.*
  // except data.path and data.max_bytes, model.*, train.batch_per_rank.
  uint64_t fingerprint() const;

  // All dotted key names, in to_toml order.
  static std::vector<std::string> keys();

  // The keys every rank of a job must agree on: all but where this rank's files are, how it
  // logs and what its host allows (run.out_dir, run.umask, data.path, data.max_bytes,
  // net.provider, log.*), which may differ between nodes.
  static std::vector<std::string> agreed_keys();
  // Per agreed_keys() entry, in that order, a 64-bit hash (FNV-1a) of its value: what the
  // trainer compares across ranks at start.
  std::vector<uint64_t> agreed_digests() const;
  // `all` holds every rank's agreed_digests() followed by the digests of `extra` values that
  // are not config keys (the trainer adds "kernels", train/kernels.h), rank r's at
  // [r * n, (r + 1) * n) with n = agreed_keys().size() + extra.size(). Throws ConfigError
  // naming each rank whose values differ from the most common ones (rank 0's on a tie) and
  // the keys that differ.
  static void check_ranks_agree(const std::vector<uint64_t>& all, int world,
                                const std::vector<std::string>& extra = {});
  // The 64-bit hash (FNV-1a) agreed_digests() uses, of any text.
  static uint64_t digest(const std::string& text);
};

}  // namespace qring::train
