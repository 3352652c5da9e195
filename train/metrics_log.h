// metrics.jsonl of a run (docs/training.md): one JSON object a line, written by the rank that
// coordinates. The coordinator changes during a run (a takeover after it was lost; a rank that
// rejoined may take over later), so every rank records each line it would write under a key
// (a step, a view's epoch, a rejoin's rank and incarnation, an evaluation's step), and the
// rank that coordinates writes each key once: when it starts to lead it reads the keys the
// file holds, writes the lines it recorded that the file lacks (a step its predecessor
// completed but did not log before it died, a view it learned first), and from then on skips
// the keys the file has (a step its predecessor logged too). summary.json's membership counts
// come from the file (recount): every view change, rejoin and skipped step of the run once,
// whichever rank wrote it and whenever the rank that writes the summary joined.
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "train/trainer.h"

namespace qring::train {

class MetricsLog {
 public:
  // The run's metrics.jsonl; its lines from step `start` on are this invocation's.
  MetricsLog(std::filesystem::path path, int64_t start);

  // Line `line` (its key: key_of), written now when `lead` (this rank coordinates), after the
  // recorded lines the file lacks when it has just started to lead. Each line is one write,
  // flushed at once.
  void record(const nlohmann::json& line, bool lead);
  void close();
  // "step:T", "view:EPOCH", "rejoin:RANK.INCARNATION", "eval:T"; "" for other lines (written
  // by whoever leads, never deduplicated).
  static std::string key_of(const nlohmann::json& line);
  // From the file's lines of this invocation (step >= start): the views' departures and joins
  // (failures_survived, evicted_ranks, recovery_s, rejoins), the rejoins' heal_s and the
  // skipped steps. Nothing changes when the file cannot be read.
  void recount(RunSummary& sum) const;

 private:
  void start_leading();

  std::filesystem::path path_;
  int64_t start_;
  std::ofstream out_;
  bool leading_ = false;
  std::set<std::string> written_;                         // keys in the file
  std::deque<std::pair<std::string, std::string>> recent_;  // key, line: the newest recorded
};

}  // namespace qring::train
