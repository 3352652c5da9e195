// The distributed training loop of qring-train: synchronous SGD with backup workers over the
// quorum all-reduce (docs/training.md, "The training loop").
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/fault_inject.h"
#include "net/rendezvous/store.h"
#include "train/config.h"
#include "train/dataset.h"

namespace qring::train {

struct RunSummary {
  double test_accuracy = 0;
  double best_test_accuracy = 0;
  double test_loss = 0;
  double wall_s = 0;
  std::optional<double> time_to_target_s;
  int64_t steps = 0;
  int64_t dropped_gradients = 0;      // (step, rank) contributions left out of S(t)
  double samples_per_s = 0;           // samples whose gradients were counted, per second
  double computed_samples_per_s = 0;  // samples every rank computed, per second
  double mean_contributors = 0;
  // The backup workers' saving (train/full_sync.h): what waiting for every rank at every step
  // would have added to the step loop's measured time, from the arrivals that happened;
  // full_sync_estimate_s = the loop's time + backup_saved_s. From the coordinator (0 on the
  // other ranks).
  double full_sync_estimate_s = 0;
  double backup_saved_s = 0;
  // Stopped by SIGTERM/SIGUSR1 (TrainerOptions::stop) after step `steps`, checkpointed there;
  // the signal this rank got (0: it stopped because another rank asked).
  bool preempted = false;
  int stop_signal = 0;
  uint64_t params_checksum = 0;
  // Membership: ranks lost and survived, steps skipped on every rank because a member was
  // lost mid-step with too few contributors left, and the longest recovery (from the lost
  // rank's last sign of life to the first step completed in the view without it).
  int64_t failures_survived = 0;
  std::vector<int> evicted_ranks;
  int64_t skipped_steps = 0;
  // Steps whose mean loss or gradient was not finite, left out (train.nonfinite = "skip").
  int64_t nonfinite_steps = 0;
  double recovery_s = 0;
  // Rejoins (docs/design.md, "Rejoin"): ranks that came back, and the longest healing (from
  // the view without the lost rank to the first step that counted its new incarnation).
  int64_t rejoins = 0;
  double heal_s = 0;
  nlohmann::json to_json() const;
};

struct TrainerOptions {
  bool resume = false;
  // A fresh run deletes the checkpoints an earlier run left in its run directory instead of
  // refusing to start (qring-train --force).
  bool force = false;
  // Set (by a signal handler: train/stop_signals.h) to the signal's number when this rank
  // should stop: every rank stops after the first step whose decision counted a rank with it
  // set, checkpoints that step and returns with RunSummary::preempted. nullptr: never.
  const std::atomic<int>* stop = nullptr;
  // Every rank's host (net::Rendezvous::hostnames), for summary.json.
  std::vector<std::string> hosts;
  // Stop after this many steps of this invocation (0 = run to the end); tests use it to
  // simulate a run killed part-way.
  int64_t stop_after = 0;
  // Real faults to inject into this process at named phases (QRING_FAULT; fault tests).
  std::vector<collectives::FaultSpec> faults;
  // The rendezvous store (net::Rendezvous::store): ranks that come back are found and
  // connected through it. nullptr: no rejoin.
  net::Store* store = nullptr;
  // This process's incarnation of its rank (net::Rendezvous::incarnation): > 0 joins the
  // running job with the state of a live member instead of starting (or resuming) it.
  uint32_t incarnation = 0;
  // Ranks on this host (net::BootstrapInfo::local_size): they share its memory, which bounds
  // the datasets each may load (data.max_bytes, train/dataset.h).
  int local_ranks = 1;
  // When this process started (the joiner reports its time to the first counted step).
  std::chrono::steady_clock::time_point process_start = std::chrono::steady_clock::now();
};

// Runs training on this rank. All ranks call it with the same config and communicator world.
// Rank 0 writes runs/<run.name>/{metrics.jsonl, summary.json, config.toml, arrivals.jsonl};
// every rank writes its checkpoints under runs/<run.name>/checkpoints/rank-<r>/.
RunSummary train(const TrainConfig& cfg, collectives::Communicator& comm,
                 const TrainerOptions& opts = {});

// Every rank of `comm` trains on the same data: the DatasetPair::digest of every rank is
// gathered (a collective with the communicator's deadline), and a rank whose files differ
// from the most common ones (rank 0's on a tie) stops every rank with a DataError naming it.
void check_data_agrees(const TrainConfig& cfg, const DatasetPair& data,
                       collectives::Communicator& comm);

// FNV-1a 64 of a float buffer's bytes (replica checksums).
uint64_t checksum(const float* p, size_t n);

}  // namespace qring::train
