#include "collectives/straggler.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "collectives/spec_fields.h"
#include "net/base/error.h"

namespace qring::collectives {

namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1), a pure function of its inputs.
double uniform(uint64_t seed, int rank, uint64_t step, uint64_t salt) {
  uint64_t h = splitmix(seed ^ splitmix(uint64_t(rank) + 0x1234567ull * (salt + 1)) ^
                        splitmix(step * 0x51ED27ull + salt));
  return (double(h >> 11) + 0.5) / 9007199254740992.0;
}

double number(std::string_view spec, const std::string& s, const char* what) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    throw ConfigError(fmt::format("straggler model '{}': {} '{}' is not a number", spec, what, s));
  return v;
}

// "step rank ms" lines (',' and tabs as spaces, '#' comments): the trace:FILE model's delays.
std::map<std::pair<uint64_t, int>, double> read_trace(std::string_view spec, const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("straggler trace '{}' cannot be opened", path));
  std::map<std::pair<uint64_t, int>, double> trace;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    for (char& c : line)
      if (c == ',' || c == '\t') c = ' ';
    std::istringstream ls(line);
    std::string a, b, c, extra;
    if (!(ls >> a)) continue;
    if (!(ls >> b >> c) || (ls >> extra))
      throw ConfigError(fmt::format("{}:{}: expected 'step rank ms'", path, lineno));
    double step, rank, ms;
    try {
      step = number(spec, a, "step");
      rank = number(spec, b, "rank");
      ms = number(spec, c, "delay");
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}:{}: {}", path, lineno, e.what()));
    }
    if (step < 0 || rank < 0 || ms < 0 || step != std::floor(step) || rank != std::floor(rank))
      throw ConfigError(
          fmt::format("{}:{}: step and rank must be non-negative integers and "
                      "the delay >= 0",
                      path, lineno));
    trace[{uint64_t(step), int(rank)}] = ms;
  }
  return trace;
}

// "STEP RANK MS" lines of a real job (MS > 0, the same ranks every step) as ratios to each
// step's fastest rank, step-major: ratio[s * ranks + c].
void read_times(std::string_view spec, const std::string& path, std::vector<double>& ratio,
                int& columns, uint64_t& steps) {
  std::map<uint64_t, std::map<int, double>> t;
  for (const auto& [key, ms] : read_trace(spec, path)) {
    if (!(ms > 0))
      throw ConfigError(fmt::format("{}: step {} rank {}: a time must be > 0, got {}", path,
                                    key.first, key.second, ms));
    t[key.first][key.second] = ms;
  }
  if (t.empty()) throw ConfigError(fmt::format("straggler model '{}': '{}' has no times", spec, path));
  const auto& first = t.begin()->second;
  columns = int(first.size());
  steps = t.size();
  ratio.clear();
  for (const auto& [s, row] : t) {
    bool same = row.size() == first.size();
    for (auto a = row.begin(), b = first.begin(); same && a != row.end(); ++a, ++b)
      same = a->first == b->first;
    if (!same)
      throw ConfigError(fmt::format("{}: step {} has other ranks than step {}", path, s,
                                    t.begin()->first));
    double fastest = row.begin()->second;
    for (const auto& [r, ms] : row) fastest = std::min(fastest, ms);
    for (const auto& [r, ms] : row) ratio.push_back(ms / fastest);
  }
}

}  // namespace

StragglerModel StragglerModel::parse(std::string_view spec) {
  StragglerModel m;
  m.spec_ = std::string(spec);
  if (spec.empty() || spec == "none") {
    m.spec_ = "none";
    return m;
  }
  auto colon = spec.find(':');
  std::string kind(spec.substr(0, colon));
  if (kind == "trace") {
    if (colon == std::string_view::npos || colon + 1 == spec.size())
      throw ConfigError(fmt::format("straggler model '{}': expected trace:FILE", spec));
    m.kind_ = Kind::kTrace;
    m.trace_ = read_trace(spec, std::string(spec.substr(colon + 1)));
    return m;
  }
  if (kind == "resample") {
    // resample:SCALE_MS:FILE (the path last: it may hold colons).
    const auto second = colon == std::string_view::npos ? colon : spec.find(':', colon + 1);
    if (second == std::string_view::npos || second + 1 == spec.size())
      throw ConfigError(fmt::format("straggler model '{}': expected resample:SCALE_MS:FILE", spec));
    m.kind_ = Kind::kResample;
    m.a_ = number(spec, std::string(spec.substr(colon + 1, second - colon - 1)), "scale");
    if (m.a_ < 0) throw ConfigError(fmt::format("straggler model '{}': scale must be >= 0", spec));
    read_times(spec, std::string(spec.substr(second + 1)), m.ratio_, m.columns_, m.steps_);
    return m;
  }
  auto parts = spec_fields(spec);
  auto need = [&](size_t n, const char* form) {
    if (parts.size() != n)
      throw ConfigError(fmt::format("straggler model '{}': expected {}", spec, form));
  };
  if (kind == "fixed") {
    need(3, "fixed:RANK:MS");
    double r = number(spec, parts[1], "rank");
    if (r < 0 || r != std::floor(r))
      throw ConfigError(fmt::format("straggler model '{}': rank must be an integer >= 0", spec));
    m.kind_ = Kind::kFixed;
    m.rank_ = int(r);
    m.a_ = number(spec, parts[2], "delay");
  } else if (kind == "exp") {
    need(2, "exp:MEAN_MS");
    m.kind_ = Kind::kExp;
    m.a_ = number(spec, parts[1], "mean");
  } else if (kind == "lognormal") {
    need(3, "lognormal:MU:SIGMA");
    m.kind_ = Kind::kLognormal;
    m.a_ = number(spec, parts[1], "mu");
    m.b_ = number(spec, parts[2], "sigma");
    if (m.b_ < 0) throw ConfigError(fmt::format("straggler model '{}': sigma must be >= 0", spec));
    return m;
  } else if (kind == "shiftexp") {
    need(3, "shiftexp:SHIFT_MS:MEAN_MS");
    m.kind_ = Kind::kShiftExp;
    m.a_ = number(spec, parts[1], "shift");
    m.b_ = number(spec, parts[2], "mean");
    if (m.b_ < 0) throw ConfigError(fmt::format("straggler model '{}': mean must be >= 0", spec));
  } else if (kind == "tail") {
    need(3, "tail:P:MS");
    m.kind_ = Kind::kTail;
    m.b_ = number(spec, parts[1], "probability");
    m.a_ = number(spec, parts[2], "delay");
    if (m.b_ < 0 || m.b_ > 1)
      throw ConfigError(fmt::format("straggler model '{}': probability must be in [0, 1]", spec));
  } else {
    throw ConfigError(
        fmt::format("unknown straggler model '{}' (expected none, fixed:RANK:MS, exp:MEAN_MS, "
                    "lognormal:MU:SIGMA, shiftexp:SHIFT_MS:MEAN_MS, tail:P:MS, trace:FILE or "
                    "resample:SCALE_MS:FILE)",
                    spec));
  }
  if (m.a_ < 0) throw ConfigError(fmt::format("straggler model '{}': delay must be >= 0", spec));
  return m;
}

std::chrono::microseconds StragglerModel::delay(uint64_t seed, int rank, uint64_t step) const {
  double ms = 0;
  switch (kind_) {
    case Kind::kNone:
      break;
    case Kind::kFixed:
      ms = rank == rank_ ? a_ : 0;
      break;
    case Kind::kExp:
      ms = -a_ * std::log(uniform(seed, rank, step, 1));
      break;
    case Kind::kLognormal: {
      double u1 = uniform(seed, rank, step, 2), u2 = uniform(seed, rank, step, 3);
      double z = std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
      ms = std::exp(a_ + b_ * z);
      break;
    }
    case Kind::kShiftExp:
      ms = a_ - b_ * std::log(uniform(seed, rank, step, 5));
      break;
    case Kind::kTail:
      ms = uniform(seed, rank, step, 4) < b_ ? a_ : 0;
      break;
    case Kind::kResample: {
      // Worker `rank`'s column: position rank mod R of block rank div R's permutation
      // (Fisher-Yates, seeded by the block), and its step offset.
      const int R = columns_;
      const uint64_t block = uint64_t(rank / R);
      std::vector<int> perm(static_cast<size_t>(R));
      for (int i = 0; i < R; ++i) perm[size_t(i)] = i;
      for (int i = R - 1; i > 0; --i) {
        const int j = int(uniform(seed, i, block, 6) * double(i + 1));
        std::swap(perm[size_t(i)], perm[size_t(std::min(j, i))]);
      }
      const int col = perm[size_t(rank % R)];
      const uint64_t offset = uint64_t(uniform(seed, rank, 0, 7) * double(steps_)) % steps_;
      const uint64_t s = (step + offset) % steps_;
      ms = ratio_[size_t(s) * size_t(R) + size_t(col)] * a_;
      break;
    }
    case Kind::kTrace: {
      auto it = trace_.find({step, rank});
      ms = it == trace_.end() ? 0 : it->second;
      break;
    }
  }
  return std::chrono::microseconds(static_cast<int64_t>(std::llround(ms * 1000.0)));
}

bool sleep_unless(std::chrono::microseconds d, const std::function<bool()>& abandon) {
  auto until = std::chrono::steady_clock::now() + d;
  while (true) {
    if (abandon && abandon()) return true;
    auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    auto slice =
        std::min<std::chrono::steady_clock::duration>(until - now, std::chrono::microseconds(250));
    std::this_thread::sleep_for(slice);
  }
}

}  // namespace qring::collectives
