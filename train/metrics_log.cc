#include "train/metrics_log.h"

#include <fmt/format.h>

#include <algorithm>

namespace qring::train {

namespace {
// Lines recorded and kept for a rank that starts to lead: steps of the last seconds of a run.
constexpr size_t kKeepRecent = 1024;
}  // namespace

MetricsLog::MetricsLog(std::filesystem::path path, int64_t start)
    : path_(std::move(path)), start_(start) {}

std::string MetricsLog::key_of(const nlohmann::json& line) {
  const std::string type = line.value("type", std::string());
  if (type == "step" || type == "eval")
    return fmt::format("{}:{}", type, line.value("step", int64_t(-1)));
  if (type == "view") return fmt::format("view:{}", line.value("epoch", int64_t(-1)));
  if (type == "rejoin")
    return fmt::format("rejoin:{}.{}", line.value("rank", -1), line.value("incarnation", -1));
  return "";
}

void MetricsLog::start_leading() {
  written_.clear();
  std::ifstream in(path_, std::ios::binary);
  std::string text;
  bool ends_line = true;  // a torn last line has no newline: the next starts on a line of its own
  while (std::getline(in, text)) {
    ends_line = !in.eof();
    try {
      const std::string key = key_of(nlohmann::json::parse(text));
      if (!key.empty()) written_.insert(key);
    } catch (const std::exception&) {
      // A torn last line from a killed coordinator: its key is not there.
    }
  }
  in.close();
  out_.close();
  out_.clear();
  out_.open(path_, std::ios::app);
  if (!ends_line) out_ << '\n';
  leading_ = true;
  for (auto& [key, text] : recent_) {
    if (!written_.insert(key).second) continue;
    out_ << text << '\n' << std::flush;
  }
}

void MetricsLog::record(const nlohmann::json& line, bool lead) {
  const std::string key = key_of(line);
  std::string text = line.dump();
  if (!lead) {
    leading_ = false;
  } else if (!leading_) {
    start_leading();
  }
  if (lead && (key.empty() || written_.insert(key).second)) out_ << text << '\n' << std::flush;
  if (key.empty()) return;
  recent_.emplace_back(key, std::move(text));
  if (recent_.size() > kKeepRecent) recent_.pop_front();
}

void MetricsLog::close() {
  out_.close();
  leading_ = false;
}

void MetricsLog::recount(RunSummary& sum) const {
  std::ifstream in(path_);
  if (!in) return;
  RunSummary n;
  std::string text;
  while (std::getline(in, text)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const std::exception&) {
      continue;
    }
    const std::string type = j.value("type", std::string());
    const int64_t step = j.value(type == "rejoin" ? "counted_step" : "step", int64_t(-1));
    if (step < start_) continue;
    if (type == "step" && j.value("skipped", false)) ++n.skipped_steps;
    if (type == "rejoin") n.heal_s = std::max(n.heal_s, j.value("heal_s", 0.0));
    if (type != "view") continue;
    for (const auto& l : j.value("left", nlohmann::json::array())) {
      n.evicted_ranks.push_back(l.value("rank", -1));
      ++n.failures_survived;
    }
    n.rejoins += int64_t(j.value("joined", nlohmann::json::array()).size());
    n.recovery_s = std::max(n.recovery_s, j.value("recovery_s", 0.0));
  }
  sum.failures_survived = n.failures_survived;
  sum.evicted_ranks = n.evicted_ranks;
  sum.recovery_s = n.recovery_s;
  sum.rejoins = n.rejoins;
  sum.heal_s = n.heal_s;
  sum.skipped_steps = n.skipped_steps;
}

}  // namespace qring::train
