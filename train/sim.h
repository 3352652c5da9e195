// qring-sim: the training algorithm of qring-train for W = N + b virtual workers in one
// process, on a virtual clock (issue 16; Chen et al., "Revisiting Distributed Synchronous
// SGD"). Every worker's gradient is a real gradient of the real model on that worker's shard
// (rank w of W, the Sharder of qring-train); only time is simulated:
//
//   compute time of worker w at its k-th gradient = compute_ms + straggler.delay(seed, w, k)
//       (the StragglerModel and run.seed of qring-train: the same delays as a real run; a
//       trace:FILE model replays recorded ones, e.g. a qring-train run's arrivals)
//   all-reduce among k contributors  = rounds(k, bytes) alpha + bytes beta 2 (k - 1) / k
//       rounds: the dependent message rounds of the algorithm qring picks (make_collective_op):
//       recursive doubling up to 32 KiB (log2 k, + 2 off a power of two), halving-doubling
//       up to 1 MiB on a power of two (2 log2 k), else the ring (2 (k - 1))
//   READY/DECIDE round trip          = rtt, only when b > 0: with Q = W qring-train starts
//                                      the ring with the READY (speculation), hiding it
//   or, for the contributor counts N that qring-bench measured in a training-like duty cycle
//   (step_cost_full_ms / step_cost_backup_ms, scripts/reproduce.py calibrate), the measured
//   time of a step after its N-th arrival instead of rtt + all-reduce
//   optimizer step                   = apply_ms
//   and, where measured for N (arrival_offsets_ms), each rank's arrival later by its measured
//   offset from the coordinator's: the ranks do not start a step together on real hosts
//   bytes = 4 (P + 1): the gradient and the loss, as qring-train reduces them
// alpha, beta and rtt come from qring-bench (scripts/reproduce.py calibrate;
// docs/reproduction.md, "Calibration").
//
// Modes:
//   sync (b = 0 full sync, b > 0 backups): every step all W workers start together; the step
//     ends at the N-th arrival (arrival order: time, ties by rank) + rtt + all-reduce among N
//     + apply. The first N gradients are summed in arrival order, divided by N and applied
//     with TrainerCore's optimizer and schedule (quorum N for the LR scaling). The b late
//     workers' batches are skipped, not computed: their gradients are dropped and change
//     nothing (qring-train abandons them too), so only N gradients a step cost real time.
//     With quorum.grace_ms = G the step counts, as qring-train's coordinator, the first N and
//     every later arrival within G of the N-th, and is decided at the N-th arrival + G (at the
//     last arrival when all W came sooner); the round trip, the all-reduce among the counted
//     and the update follow the decision.
//   async (a parameter server, as train.mode = "async"): each worker computes on the
//     parameters it last pulled; its gradient reaches the server alpha + bytes beta after it
//     is ready; the server applies the gradients one at a time in arrival order (ties by
//     rank), taking apply_ms + bytes beta each (the update and sending the parameters back);
//     the worker has them alpha + bytes beta later and computes again.
//     staleness = updates applied between its pull and its own update (about W - 1).
//     Each worker computes train.steps gradients: train.steps * W updates in all, each of one
//     worker's batch, so the schedule has quorum 1, train.steps * W steps and
//     train.warmup_steps * W warmup updates; evaluations every train.eval_every * W updates.
//
// --arrivals-only (sync): the arrivals and step times of train.steps steps, no training.
// Evaluations take no virtual time. Output (when out_dir is set): <out_dir>/metrics.jsonl
// (one "step" line per sync step, or per W updates in async, and "eval" lines),
// <out_dir>/summary.json, <out_dir>/config.toml, and in sync mode <out_dir>/arrivals.jsonl
// (every worker's arrival in ms after the step's first, as qring-train writes it).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "collectives/straggler.h"
#include "train/config.h"
#include "train/dataset.h"

namespace qring::train {

enum class SimMode { kSync, kAsync };

// Defaults: the fit of scripts/reproduce.py calibrate to qring-bench on this repository's 2-core
// machine (docs/reproduction.md, "Calibration"); --calibration FILE replaces them.
constexpr double kSimDefaultAlphaUs = 20.4;
constexpr double kSimDefaultBetaNsPerByte = 0.34;
constexpr double kSimDefaultRttUs = 21.5;

struct SimOptions {
  int workers = 0;  // W = N + b
  int backups = 0;  // b (sync only; 0 in async)
  SimMode mode = SimMode::kSync;
  double compute_ms = -1;  // base compute time per gradient; < 0: measured once at the start
  double apply_ms = -1;    // one optimizer step; < 0: measured once at the start
  double alpha_us = kSimDefaultAlphaUs;
  double beta_ns_per_byte = kSimDefaultBetaNsPerByte;
  double rtt_us = kSimDefaultRttUs;
  // Measured time of a sync step beyond its N-th arrival, by N: full sync (b = 0) and with
  // backups (b > 0). For the N they hold they replace rtt + all-reduce (not the update).
  std::map<int, double> step_cost_full_ms, step_cost_backup_ms;
  // Measured, by quorum N (sync, fixed quorum): per step, each rank's READY after the
  // coordinator's when every rank idles the same time (the ranks' start skew after the
  // previous step and the READY's way to the coordinator); step t adds row t % rows to the
  // arrivals (every row has W entries). None for N: the ranks start together.
  std::map<int, std::vector<std::vector<double>>> arrival_offsets_ms;
  std::string out_dir;  // empty: no files
  bool progress = false;  // a progress line on stderr every few seconds
  // Sync only: draw the arrivals of train.steps steps and time the steps, without training
  // (the arrival process alone, e.g. against the order statistics' closed form).
  bool arrivals_only = false;
  // Sync only: the adaptive quorum (quorum.quorum = "auto"): each step's N chosen by the
  // coordinator's rule (collectives/quorum/auto_quorum.h) from the window of the arrivals it would
  // have seen (the first N of each step; the others cut off at the decision), within
  // [auto_min, auto_max] (0 = W); the rate scaled by N over the largest quorum, the round
  // trip charged every step (no speculation), as qring-train.
  bool adaptive = false;
  int auto_min = 1, auto_max = 0;
  // The rule's noise scale in workers' batches (0: the linear value); none: the run's own
  // estimate (collectives/quorum/noise_scale.h) from the steps so far, as the coordinator's.
  std::optional<double> auto_kappa;
  // Sync: quorum.grace_ms, as the coordinator applies it: once N have arrived, every arrival
  // within the grace counts too; the step is decided at the N-th arrival + grace, or at the
  // last arrival if all W came sooner (sim_decide).
  double grace_ms = 0;
};

struct SimStepRecord {
  int64_t step = 0;
  double virtual_s = 0;  // at the end of the step (sync) or of the W updates (async)
  double step_ms = 0;    // sync: the step's virtual time; async: mean worker iteration time
  double loss = 0;       // mean batch loss of the gradients applied
  double lr = 0;
  int contributors = 0;            // sync: gradients averaged (N); async: updates (W)
  int quorum = 0;                  // sync: the quorum in force (= contributors without a grace)
  std::vector<int> ranks;          // sync: the contributors in arrival order
  double kth_arrival_ms = 0;       // sync: the N-th arrival (compute + delay)
  double staleness_mean = 0;       // async
  int64_t staleness_max = 0;       // async
  std::optional<double> noise_scale;  // sync: the gradient-noise estimate after this step
};

struct SimEval {
  int64_t step = 0;
  double virtual_s = 0;
  double accuracy = 0, loss = 0;
};

struct SimResult {
  std::vector<SimStepRecord> steps;
  std::vector<SimEval> evals;
  double virtual_s = 0;
  double wall_s = 0;
  double compute_ms = 0;  // the base compute time used
  double apply_ms = 0;    // the optimizer step time used
  int64_t gradients_computed = 0;
  int64_t updates = 0;  // optimizer steps applied
  double test_accuracy = 0, best_test_accuracy = 0, test_loss = 0;
  std::optional<double> time_to_target_s;  // virtual seconds
  double step_p50_ms = 0, step_p90_ms = 0;  // sync: step time; async: worker iteration time
  double staleness_mean = 0;                // async
  int64_t staleness_max = 0;                // async
  std::vector<int64_t> staleness_hist;      // async: [s] = updates with staleness s
  std::vector<double> kth_arrival_mean_ms;  // sync: [k-1] = mean over steps of the k-th arrival
  std::map<int, int64_t> quorum_hist;       // sync: steps decided with each quorum
  // sync: the mean over steps of the gradient-noise estimate (samples), over the whole run
  // and over the steps before the target accuracy was first reached (the whole run if never)
  std::optional<double> noise_scale_mean, noise_scale_to_target;
  uint64_t params_checksum = 0;
  nlohmann::json to_json() const;
};

// One worker's readiness in a sync step: compute_ms + delay, in ms.
struct SimArrival {
  double ms = 0;
  int rank = 0;
};

// The W arrivals of sync step `step`, sorted by time, ties by rank: what the simulator uses.
std::vector<SimArrival> sim_arrivals(const collectives::StragglerModel& straggler, uint64_t seed,
                                     int workers, uint64_t step, double compute_ms);

// `arr` with rows[step % rows.size()][rank] added to each arrival, sorted again (time, then
// rank); rows empty: unchanged.
void sim_offset_arrivals(std::vector<SimArrival>& arr,
                         const std::vector<std::vector<double>>& rows, uint64_t step);

// A sync step's decision among `arr` (sorted as sim_arrivals) with quorum n and a grace (ms):
// the contributors are the first `count` arrivals, decided at `at_ms` (the n-th arrival
// without a grace, else min(n-th + grace, the last arrival when all came within it)): the
// coordinator's own rule (collectives/quorum/decide_rule.h) asked at every arrival and at
// the instant the grace runs out.
struct SimDecision {
  int count = 0;
  double at_ms = 0;
};
SimDecision sim_decide(const std::vector<SimArrival>& arr, int n, double grace_ms);

// Dependent message rounds of qring's all-reduce among k ranks of `bytes` (above).
int sim_allreduce_rounds(int k, double bytes);
// All-reduce time among k contributors of `bytes` (cost model above), in ms.
double sim_allreduce_ms(int k, double bytes, double alpha_us, double beta_ns_per_byte);
// A sync step's time after its N-th arrival (ms): the round trip unless `speculative` (full
// sync), the all-reduce and the update; or the measured step cost for N.
double sim_step_comm_ms(const SimOptions& o, int n, bool speculative, double bytes,
                        double apply_ms);
// The same for a fixed quorum: speculative when b = 0.
double sim_sync_comm_ms(const SimOptions& o, int n, double bytes, double apply_ms);

// Runs the simulation. Throws ConfigError on bad options (workers < 1, backups outside
// 0..W-1, backups with async, non-finite or negative costs).
SimResult simulate(const TrainConfig& cfg, const DatasetPair& data, const SimOptions& opts);

}  // namespace qring::train
