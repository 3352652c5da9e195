#include "train/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <toml.hpp>

#include "collectives/quorum/quorum.h"
#include "collectives/straggler.h"
#include "net/base/error.h"
#include "net/base/fnv1a.h"
#include "train/config_limits.h"

namespace qring::train {
namespace {

enum class Kind { kInt, kFloat, kBool, kString, kIntList, kQuorum };

struct Field {
  std::string key;
  Kind kind;
  std::function<void(TrainConfig&, const toml::value&)> set;
  std::function<nlohmann::json(const TrainConfig&)> get;
};

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw ConfigError(fmt::format("config key '{}': {}", key, what));
}

const char* type_name(const toml::value& v) {
  switch (v.type()) {
    case toml::value_t::integer:
      return "integer";
    case toml::value_t::floating:
      return "float";
    case toml::value_t::boolean:
      return "boolean";
    case toml::value_t::string:
      return "string";
    case toml::value_t::array:
      return "array";
    case toml::value_t::table:
      return "table";
    default:
      return "date/time";
  }
}

int64_t to_int(const std::string& key, const toml::value& v) {
  if (!v.is_integer()) fail(key, fmt::format("expected an integer, got a {}", type_name(v)));
  return v.as_integer();
}

double to_float(const std::string& key, const toml::value& v) {
  if (v.is_integer()) return static_cast<double>(v.as_integer());
  if (!v.is_floating()) fail(key, fmt::format("expected a number, got a {}", type_name(v)));
  const double d = v.as_floating();
  if (!std::isfinite(d)) fail(key, "must be finite");
  return d;
}

template <class Acc>
Field int_field(const std::string& key, Acc acc) {
  return {key, Kind::kInt,
          [key, acc](TrainConfig& c, const toml::value& v) { acc(c) = to_int(key, v); },
          [acc](const TrainConfig& c) { return nlohmann::json(acc(c)); }};
}
template <class Acc>
Field float_field(const std::string& key, Acc acc) {
  return {key, Kind::kFloat,
          [key, acc](TrainConfig& c, const toml::value& v) { acc(c) = to_float(key, v); },
          [acc](const TrainConfig& c) { return nlohmann::json(acc(c)); }};
}
template <class Acc>
Field bool_field(const std::string& key, Acc acc) {
  return {key, Kind::kBool,
          [key, acc](TrainConfig& c, const toml::value& v) {
            if (!v.is_boolean())
              fail(key, fmt::format("expected true or false, got a {}", type_name(v)));
            acc(c) = v.as_boolean();
          },
          [acc](const TrainConfig& c) { return nlohmann::json(acc(c)); }};
}
template <class Acc>
Field string_field(const std::string& key, Acc acc) {
  return {key, Kind::kString,
          [key, acc](TrainConfig& c, const toml::value& v) {
            if (!v.is_string()) fail(key, fmt::format("expected a string, got a {}", type_name(v)));
            acc(c) = v.as_string().str;
          },
          [acc](const TrainConfig& c) { return nlohmann::json(acc(c)); }};
}
template <class Acc>
Field int_list_field(const std::string& key, Acc acc) {
  return {key, Kind::kIntList,
          [key, acc](TrainConfig& c, const toml::value& v) {
            if (!v.is_array())
              fail(key, fmt::format("expected an array of integers, got a {}", type_name(v)));
            std::vector<int64_t> out;
            for (const auto& e : v.as_array()) out.push_back(to_int(key, e));
            acc(c) = std::move(out);
          },
          [acc](const TrainConfig& c) { return nlohmann::json(acc(c)); }};
}

#define QRING_ACC(expr)  \
  [](auto& c) -> auto& { \
    return c.expr;       \
  }

std::vector<Field> fields() {
  std::vector<Field> f;
  f.push_back(string_field("run.name", QRING_ACC(run.name)));
  f.push_back(string_field("run.out_dir", QRING_ACC(run.out_dir)));
  f.push_back(int_field("run.seed", QRING_ACC(run.seed)));
  f.push_back(string_field("run.umask", QRING_ACC(run.umask)));
  f.push_back(string_field("data.path", QRING_ACC(data.path)));
  f.push_back(string_field("data.dataset", QRING_ACC(data.dataset)));
  f.push_back(int_field("data.synthetic_train", QRING_ACC(data.synthetic_train)));
  f.push_back(int_field("data.synthetic_test", QRING_ACC(data.synthetic_test)));
  f.push_back(int_field("data.max_bytes", QRING_ACC(data.max_bytes)));
  f.push_back(string_field("model.type", QRING_ACC(model.type)));
  f.push_back(int_list_field("model.hidden", QRING_ACC(model.hidden)));
  f.push_back(int_list_field("model.conv_channels", QRING_ACC(model.conv_channels)));
  f.push_back(int_field("model.conv_kernel", QRING_ACC(model.conv_kernel)));
  f.push_back(string_field("model.conv_padding", QRING_ACC(model.conv_padding)));
  f.push_back(string_field("train.mode", QRING_ACC(train.mode)));
  f.push_back(int_field("train.batch_per_rank", QRING_ACC(train.batch_per_rank)));
  f.push_back(int_field("train.epochs", QRING_ACC(train.epochs)));
  f.push_back(int_field("train.steps", QRING_ACC(train.steps)));
  f.push_back(string_field("train.budget", QRING_ACC(train.budget)));
  f.push_back(string_field("train.async_staleness", QRING_ACC(train.async_staleness)));
  f.push_back(float_field("train.lr", QRING_ACC(train.lr)));
  f.push_back(float_field("train.momentum", QRING_ACC(train.momentum)));
  f.push_back(bool_field("train.nesterov", QRING_ACC(train.nesterov)));
  f.push_back(float_field("train.weight_decay", QRING_ACC(train.weight_decay)));
  f.push_back(int_field("train.warmup_steps", QRING_ACC(train.warmup_steps)));
  f.push_back(string_field("train.schedule", QRING_ACC(train.schedule)));
  f.push_back(int_field("train.step_decay_every", QRING_ACC(train.step_decay_every)));
  f.push_back(float_field("train.step_decay_factor", QRING_ACC(train.step_decay_factor)));
  f.push_back(string_field("train.lr_scaling", QRING_ACC(train.lr_scaling)));
  f.push_back(int_field("train.reference_batch", QRING_ACC(train.reference_batch)));
  f.push_back(int_field("train.eval_every", QRING_ACC(train.eval_every)));
  f.push_back(int_field("train.eval_batch", QRING_ACC(train.eval_batch)));
  f.push_back(float_field("train.target_accuracy", QRING_ACC(train.target_accuracy)));
  f.push_back(int_field("train.checkpoint_every", QRING_ACC(train.checkpoint_every)));
  f.push_back(int_field("train.checksum_every", QRING_ACC(train.checksum_every)));
  f.push_back(string_field("train.nonfinite", QRING_ACC(train.nonfinite)));
  f.push_back({"quorum.quorum", Kind::kQuorum,
               [](TrainConfig& c, const toml::value& v) {
                 c.quorum.quorum_auto = false;
                 if (v.is_integer()) {
                   c.quorum.quorum = static_cast<double>(v.as_integer());
                   c.quorum.quorum_is_fraction = false;
                 } else if (v.is_floating()) {
                   c.quorum.quorum = to_float("quorum.quorum", v);
                   c.quorum.quorum_is_fraction = true;
                 } else if (v.is_string() && v.as_string().str == "auto") {
                   c.quorum.quorum_auto = true;
                   c.quorum.quorum_is_fraction = false;
                 } else {
                   fail("quorum.quorum",
                        fmt::format("expected an integer count, a float fraction or \"auto\", "
                                    "got a {}",
                                    type_name(v)));
                 }
               },
               [](const TrainConfig& c) {
                 if (c.quorum.quorum_auto) return nlohmann::json("auto");
                 return c.quorum.quorum_is_fraction
                            ? nlohmann::json(c.quorum.quorum)
                            : nlohmann::json(static_cast<int64_t>(c.quorum.quorum));
               }});
  f.push_back(int_field("quorum.min", QRING_ACC(quorum.min)));
  f.push_back(int_field("quorum.max", QRING_ACC(quorum.max)));
  f.push_back({"quorum.noise_scale", Kind::kFloat,
               [](TrainConfig& c, const toml::value& v) {
                 c.quorum.noise_scale_estimate = v.is_string() && v.as_string().str == "estimate";
                 if (c.quorum.noise_scale_estimate)
                   c.quorum.noise_scale = 0;
                 else if (v.is_integer() || v.is_floating())
                   c.quorum.noise_scale = to_float("quorum.noise_scale", v);
                 else
                   fail("quorum.noise_scale",
                        fmt::format("expected a number of samples or \"estimate\", got a {}",
                                    type_name(v)));
               },
               [](const TrainConfig& c) {
                 return c.quorum.noise_scale_estimated() ? nlohmann::json("estimate")
                                                         : nlohmann::json(c.quorum.noise_scale);
               }});
  f.push_back(int_field("quorum.grace_ms", QRING_ACC(quorum.grace_ms)));
  f.push_back(int_field("quorum.deadline_ms", QRING_ACC(quorum.deadline_ms)));
  f.push_back(string_field("quorum.late_policy", QRING_ACC(quorum.late_policy)));
  f.push_back(int_field("quorum.evict_ms", QRING_ACC(quorum.evict_ms)));
  f.push_back(int_field("quorum.evict_steps", QRING_ACC(quorum.evict_steps)));
  f.push_back(int_field("quorum.max_lag_ms", QRING_ACC(quorum.max_lag_ms)));
  f.push_back(int_field("quorum.min_world", QRING_ACC(quorum.min_world)));
  f.push_back(string_field("straggler.model", QRING_ACC(straggler.model)));
  f.push_back(string_field("net.provider", QRING_ACC(net.provider)));
  f.push_back(string_field("log.level", QRING_ACC(log.level)));
  f.push_back(bool_field("log.progress", QRING_ACC(log.progress)));
  return f;
}

#undef QRING_ACC

const Field* find_field(const std::vector<Field>& fs, const std::string& key) {
  for (const auto& f : fs)
    if (f.key == key) return &f;
  return nullptr;
}

// Edit distance (insertions, deletions, substitutions, transpositions of neighbours).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// "did you mean 'train.lr'?" when a known key is close to `key` (a typo, or the right name in
// another section), else "".
std::string did_you_mean(const std::vector<Field>& fs, const std::string& key) {
  if (key.size() > 64) return "";  // no key is that long; and the distances cost |key| each
  const std::string name = key.substr(key.rfind('.') + 1);
  const Field* best = nullptr;
  size_t best_d = 0;
  for (const auto& f : fs) {
    const std::string fname = f.key.substr(f.key.find('.') + 1);
    // The whole key, or the name alone (a key put into the wrong section).
    const size_t d =
        std::min(edit_distance(key, f.key), name == fname ? 1 : edit_distance(name, fname) + 1);
    if (best == nullptr || d < best_d) {
      best = &f;
      best_d = d;
    }
  }
  const size_t limit = std::max<size_t>(2, key.size() / 4);
  if (best == nullptr || best_d > limit) return "";
  return fmt::format("did you mean '{}'?", best->key);
}

std::string unknown_key(const std::vector<Field>& fs, const std::string& key) {
  const std::string hint = did_you_mean(fs, key);
  return hint.empty() ? "unknown key (docs/training.md lists every key)" : "unknown key; " + hint;
}

// What a key of this kind takes, for parse errors.
const char* expected_type(Kind kind) {
  switch (kind) {
    case Kind::kInt:
      return "an integer";
    case Kind::kFloat:
      return "a number";
    case Kind::kBool:
      return "true or false";
    case Kind::kString:
      return "a string";
    case Kind::kIntList:
      return "an array of integers, e.g. [512, 256]";
    case Kind::kQuorum:
      return "an integer count, a float fraction in (0, 1] or \"auto\"";
  }
  return "a value";
}

// Walks a parsed TOML document: every leaf must be a known key.
void apply_table(TrainConfig& c, const std::vector<Field>& fs, const toml::value& v,
                 const std::string& prefix) {
  for (const auto& [k, child] : v.as_table()) {
    const std::string key = prefix.empty() ? k : prefix + "." + k;
    if (child.is_table()) {
      if (prefix.empty()) {
        apply_table(c, fs, child, key);
        continue;
      }
      fail(key, "unknown key (nested tables are not used)");
    }
    const Field* f = find_field(fs, key);
    if (f == nullptr) {
      const std::string hint = did_you_mean(fs, key);
      if (prefix.empty())
        fail(key, "unknown key (keys belong to a [section])" + (hint.empty() ? "" : "; " + hint));
      fail(key, unknown_key(fs, key));
    }
    f->set(c, child);
  }
}

// The offset of the first byte that does not start a valid UTF-8 sequence (overlong forms,
// surrogates and code points above U+10FFFF are invalid), or npos. TOML files are UTF-8, and
// toml11 3.7 reads out of bounds when it reports invalid UTF-8 inside a string, so the text
// is checked before it gets there.
size_t invalid_utf8(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (n - i < len) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

toml::value parse_toml(const std::string& text, const std::string& name) {
  check_toml_limits(text, name);
  if (const size_t bad = invalid_utf8(text); bad != std::string::npos) {
    const size_t line = 1 + size_t(std::count(text.begin(), text.begin() + long(bad), '\n'));
    throw ConfigError(
        fmt::format("{}: not valid UTF-8: byte {} (line {}) starts no valid "
                    "sequence; TOML files are UTF-8",
                    name, bad, line));
  }
  std::istringstream is(text);
  try {
    return toml::parse(is, name);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("{}: TOML syntax error: {}", name, e.what()));
  }
}

void check_one_of(const std::string& key, const std::string& v,
                  std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return;
    list += list.empty() ? a : std::string(", ") + a;
  }
  fail(key, fmt::format("unknown value '{}' (one of: {})", v, list));
}

void check_min(const std::string& key, int64_t v, int64_t lo) {
  if (v < lo) fail(key, fmt::format("must be >= {}, got {}", lo, v));
}

// Durations in ms: at most a day, far from where converting them to clock ticks overflows
// (a deadline of 2^62 ms wrapped round to "timed out after 0 ms").
constexpr int64_t kMaxMs = 24 * 3600 * 1000;

void check_ms(const std::string& key, int64_t v, int64_t lo) {
  if (v < lo || v > kMaxMs)
    fail(key, fmt::format("must be in {}..{} (one day), got {}", lo, kMaxMs, v));
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<int>(ch));
        else
          out += ch;
    }
  }
  return out + "\"";
}

std::string toml_value_text(const nlohmann::json& j) {
  if (j.is_string()) return toml_string(j.get<std::string>());
  if (j.is_boolean()) return j.get<bool>() ? "true" : "false";
  if (j.is_number_integer()) return std::to_string(j.get<int64_t>());
  if (j.is_number_float()) {
    std::string s = fmt::format("{}", j.get<double>());  // shortest round-trip form
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
  }
  std::string out = "[";
  for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + toml_value_text(j[i]);
  return out + "]";
}

}  // namespace

TrainConfig TrainConfig::from_file(const std::string& path,
                                   const std::vector<std::string>& overrides) {
  return from_string(read_config_file(path), overrides, path);
}

TrainConfig TrainConfig::from_string(const std::string& toml_text,
                                     const std::vector<std::string>& overrides,
                                     const std::string& source_name) {
  TrainConfig c;
  const auto fs = fields();
  const toml::value doc = parse_toml(toml_text, source_name);
  apply_table(c, fs, doc, "");
  for (const auto& o : overrides) c.apply_override(o);
  c.validate();
  return c;
}

void TrainConfig::apply_override(const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("override '{}': expected section.key=value", assignment));
  auto trim = [](std::string s) {
    const size_t b = s.find_first_not_of(" \t");
    const size_t e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  const std::string key = trim(assignment.substr(0, eq));
  const std::string text = trim(assignment.substr(eq + 1));
  const auto fs = fields();
  const Field* f = find_field(fs, key);
  if (f == nullptr) fail(key, unknown_key(fs, key));
  // Bare text for string keys and for the named values of number keys ("auto", "estimate").
  const bool named = (f->kind == Kind::kQuorum && text == "auto") ||
                     (f->key == "quorum.noise_scale" && text == "estimate");
  if ((f->kind == Kind::kString || named) &&
      (text.empty() || (text[0] != '"' && text[0] != '\''))) {
    f->set(*this, toml::value(text));
    return;
  }
  if (invalid_utf8(text) != std::string::npos) fail(key, "the value is not valid UTF-8");
  try {
    check_toml_limits(text, "the value");
  } catch (const ConfigError& e) {
    fail(key, e.what());
  }
  toml::value v;
  try {
    std::istringstream is("v = " + text);
    v = toml::parse(is, "override").as_table().at("v");
  } catch (const std::exception&) {
    fail(key, fmt::format("cannot parse value '{}': expected {}", text, expected_type(f->kind)));
  }
  f->set(*this, v);
}

namespace {

// TrainConfig::validate's checks of the sections that need no world size.
void validate_run_and_data(const RunSection& run, const DataSection& data) {
  if (run.name.empty()) fail("run.name", "must not be empty");
  if (run.name == "." || run.name == ".." || run.name.find('/') != std::string::npos ||
      run.name.find('\0') != std::string::npos)
    fail("run.name", fmt::format("'{}' is not a name inside run.out_dir (no '/', not '.' or "
                                 "'..'); put the directory in run.out_dir",
                                 run.name));
  if (run.umask.size() != 3 || run.umask.find_first_not_of("01234567") != std::string::npos)
    fail("run.umask", fmt::format("expected 3 octal digits such as \"077\", got '{}'", run.umask));
  if (run.out_dir.empty()) fail("run.out_dir", "must not be empty");
  check_min("run.seed", run.seed, 0);
  check_one_of("data.dataset", data.dataset, {"fashion-mnist", "synthetic"});
  if (data.dataset == "fashion-mnist" && data.path.empty()) fail("data.path", "must not be empty");
  check_min("data.synthetic_train", data.synthetic_train, 1);
  check_min("data.synthetic_test", data.synthetic_test, 1);
  check_min("data.max_bytes", data.max_bytes, 0);
}

void validate_model(const ModelSection& model) {
  check_one_of("model.type", model.type, {"mlp", "cnn"});
  if (model.type == "mlp" && model.hidden.empty())
    fail("model.hidden", "an MLP needs at least one hidden layer");
  if (model.hidden.size() > 8) fail("model.hidden", "at most 8 hidden layers");
  for (int64_t h : model.hidden)
    if (h < 1 || h > 65536)
      fail("model.hidden", fmt::format("sizes must be in 1..65536, got {}", h));
  if (model.conv_channels.empty() || model.conv_channels.size() > 3)
    fail("model.conv_channels", "needs 1 to 3 entries (28x28 is halved by each block)");
  for (int64_t ch : model.conv_channels)
    if (ch < 1 || ch > 1024)
      fail("model.conv_channels", fmt::format("channels must be in 1..1024, got {}", ch));
  check_one_of("model.conv_padding", model.conv_padding, {"same", "valid"});
  if (model.conv_kernel < 1 || model.conv_kernel > 9)
    fail("model.conv_kernel", fmt::format("must be in 1..9, got {}", model.conv_kernel));
  if (model.conv_padding == "same" && model.conv_kernel % 2 == 0)
    fail("model.conv_kernel",
         fmt::format("must be odd with model.conv_padding = \"same\", got {}", model.conv_kernel));
}

void validate_train(const TrainSection& train) {
  check_one_of("train.mode", train.mode, {"sync", "async"});
  check_min("train.batch_per_rank", train.batch_per_rank, 1);
  check_min("train.epochs", train.epochs, 0);
  check_min("train.steps", train.steps, 0);
  if (train.epochs == 0 && train.steps == 0)
    fail("train.epochs", "train.epochs or train.steps must be > 0");
  check_one_of("train.budget", train.budget, {"steps", "gradients"});
  check_one_of("train.async_staleness", train.async_staleness, {"none", "divide"});
  if (train.budget == "gradients" && train.mode != "sync")
    fail("train.budget", "\"gradients\" needs train.mode = \"sync\" (async counts no quorum)");
  if (!(train.lr > 0)) fail("train.lr", fmt::format("must be > 0, got {}", train.lr));
  if (train.momentum < 0 || train.momentum >= 1)
    fail("train.momentum", fmt::format("must be in [0, 1), got {}", train.momentum));
  if (train.nesterov && train.momentum == 0) fail("train.nesterov", "needs train.momentum > 0");
  if (train.weight_decay < 0)
    fail("train.weight_decay", fmt::format("must be >= 0, got {}", train.weight_decay));
  check_min("train.warmup_steps", train.warmup_steps, 0);
  check_one_of("train.schedule", train.schedule, {"constant", "step", "cosine"});
  check_min("train.step_decay_every", train.step_decay_every, 1);
  if (!(train.step_decay_factor > 0 && train.step_decay_factor <= 1))
    fail("train.step_decay_factor",
         fmt::format("must be in (0, 1], got {}", train.step_decay_factor));
  check_one_of("train.lr_scaling", train.lr_scaling, {"none", "linear", "sqrt"});
  check_min("train.reference_batch", train.reference_batch, 1);
  check_min("train.eval_every", train.eval_every, 0);
  check_min("train.eval_batch", train.eval_batch, 1);
  if (train.target_accuracy < 0 || train.target_accuracy > 1)
    fail("train.target_accuracy", fmt::format("must be in [0, 1], got {}", train.target_accuracy));
  check_min("train.checkpoint_every", train.checkpoint_every, 0);
  check_min("train.checksum_every", train.checksum_every, 0);
  check_one_of("train.nonfinite", train.nonfinite, {"fail", "skip"});
}

}  // namespace

void TrainConfig::validate(int world) const {
  validate_run_and_data(run, data);
  validate_model(model);
  validate_train(train);
  if (quorum.quorum_auto) {
    // (the count and fraction checks do not apply)
  } else if (quorum.quorum_is_fraction) {
    if (!(quorum.quorum > 0 && quorum.quorum <= 1))
      fail("quorum.quorum", fmt::format("a fraction must be in (0, 1], got {}", quorum.quorum));
  } else if (quorum.quorum < 1) {
    fail("quorum.quorum", fmt::format("a count must be >= 1, got {}", quorum.quorum));
  }
  check_min("quorum.min", quorum.min, 1);
  check_min("quorum.max", quorum.max, 0);
  if (quorum.max > 0 && quorum.max < quorum.min)
    fail("quorum.max", fmt::format("must be 0 or >= quorum.min ({}), got {}", quorum.min,
                                   quorum.max));
  if (!quorum.noise_scale_estimated() &&
      (!(quorum.noise_scale >= 0) || !std::isfinite(quorum.noise_scale)))
    fail("quorum.noise_scale", fmt::format("must be \"estimate\" or a number of samples >= 0 "
                                           "(0 = none), got {}",
                                           quorum.noise_scale));
  if (world > 0 && quorum.quorum_auto && quorum.min > world)
    fail("quorum.min", fmt::format("{} is more than the {} ranks of this job", quorum.min, world));
  if (world > 0 && quorum.quorum_auto && quorum.max > world)
    fail("quorum.max", fmt::format("{} is more than the {} ranks of this job", quorum.max, world));
  if (world > 0) quorum_count(world);
  check_ms("quorum.grace_ms", quorum.grace_ms, 0);
  check_ms("quorum.deadline_ms", quorum.deadline_ms, 1);
  if (quorum.deadline_ms <= quorum.grace_ms)
    fail("quorum.deadline_ms", fmt::format("must be > quorum.grace_ms ({}), got {}",
                                           quorum.grace_ms, quorum.deadline_ms));
  check_one_of("quorum.late_policy", quorum.late_policy, {"drop", "carry"});
  check_ms("quorum.evict_ms", quorum.evict_ms, 1);
  check_min("quorum.evict_steps", quorum.evict_steps, 0);
  check_ms("quorum.max_lag_ms", quorum.max_lag_ms, -1);
  check_min("quorum.min_world", quorum.min_world, 0);
  if (world > 0 && quorum.min_world > world)
    fail("quorum.min_world",
         fmt::format("{} is more than the {} ranks of this job", quorum.min_world, world));
  try {
    collectives::StragglerModel::parse(straggler.model);  // the one parser of these specs
  } catch (const ConfigError& e) {
    fail("straggler.model", e.what());
  }
  if (net.provider.empty()) fail("net.provider", "must not be empty");
  check_one_of("log.level", log.level, {"trace", "debug", "info", "warn", "error", "off"});
}

int TrainConfig::quorum_count(int world) const {
  if (world < 1) throw UsageError(fmt::format("quorum_count: world size {} < 1", world));
  int64_t q;
  if (quorum.quorum_auto) {
    q = quorum.min;  // the lower bound of Q(t), which the membership rules use
  } else if (quorum.quorum_is_fraction) {
    if (!(quorum.quorum > 0 && quorum.quorum <= 1))
      fail("quorum.quorum", fmt::format("a fraction must be in (0, 1], got {}", quorum.quorum));
    q = collectives::quorum_of_fraction(quorum.quorum, world);
    q = std::max<int64_t>(q, 1);
  } else {
    q = static_cast<int64_t>(quorum.quorum);
  }
  if (q < 1 || q > world)
    fail("quorum.quorum", fmt::format("quorum {} is not within 1..{} (the world size)", q, world));
  return static_cast<int>(q);
}

std::string TrainConfig::to_toml() const {
  std::string out;
  std::string section;
  for (const auto& f : fields()) {
    const size_t dot = f.key.find('.');
    const std::string sec = f.key.substr(0, dot);
    if (sec != section) {
      out += (section.empty() ? "[" : "\n[") + sec + "]\n";
      section = sec;
    }
    out += f.key.substr(dot + 1) + " = " + toml_value_text(f.get(*this)) + "\n";
  }
  return out;
}

nlohmann::json TrainConfig::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : fields()) {
    const size_t dot = f.key.find('.');
    j[f.key.substr(0, dot)][f.key.substr(dot + 1)] = f.get(*this);
  }
  return j;
}

uint64_t TrainConfig::fingerprint() const {
  std::string text;
  for (const auto& f : fields()) {
    const bool relevant = f.key == "run.seed" ||
                          (f.key.rfind("data.", 0) == 0 && f.key != "data.path" &&
                           f.key != "data.max_bytes") ||
                          f.key.rfind("model.", 0) == 0 || f.key == "train.batch_per_rank";
    if (relevant) text += f.key + "=" + f.get(*this).dump() + "\n";
  }
  return fnv1a64(text);
}

std::vector<std::string> TrainConfig::keys() {
  std::vector<std::string> out;
  for (const auto& f : fields()) out.push_back(f.key);
  return out;
}

std::vector<std::string> TrainConfig::agreed_keys() {
  std::vector<std::string> out;
  for (const auto& f : fields()) {
    const bool local = f.key == "run.out_dir" || f.key == "run.umask" || f.key == "data.path" ||
                       f.key == "data.max_bytes" || f.key == "net.provider" ||
                       f.key.rfind("log.", 0) == 0;
    if (!local) out.push_back(f.key);
  }
  return out;
}

uint64_t TrainConfig::digest(const std::string& text) {
  return fnv1a64(text);
}

std::vector<uint64_t> TrainConfig::agreed_digests() const {
  const auto fs = fields();
  std::vector<uint64_t> out;
  for (const auto& key : agreed_keys()) out.push_back(digest(find_field(fs, key)->get(*this).dump()));
  return out;
}

void TrainConfig::check_ranks_agree(const std::vector<uint64_t>& all, int world,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> keys = agreed_keys();
  keys.insert(keys.end(), extra.begin(), extra.end());
  const size_t n = keys.size();
  if (world < 1 || all.size() != n * size_t(world))
    throw UsageError(
        fmt::format("check_ranks_agree: {} digests for {} ranks of {} keys", all.size(), world, n));
  auto of = [&](int r) { return all.begin() + std::ptrdiff_t(size_t(r) * n); };
  auto same = [&](int a, int b) { return std::equal(of(a), of(a) + std::ptrdiff_t(n), of(b)); };
  int ref = 0, ref_count = 0;
  for (int r = 0; r < world; ++r) {
    int c = 0;
    for (int o = 0; o < world; ++o) c += same(r, o) ? 1 : 0;
    if (c > ref_count) {
      ref = r;
      ref_count = c;
    }
  }
  if (ref_count == world) return;
  std::string which;
  for (int r = 0; r < world; ++r) {
    if (same(r, ref)) continue;
    std::string differ;
    for (size_t k = 0; k < n; ++k)
      if (of(r)[std::ptrdiff_t(k)] != of(ref)[std::ptrdiff_t(k)])
        differ += (differ.empty() ? "'" : ", '") + keys[k] + "'";
    which += fmt::format("{}rank {} ({})", which.empty() ? "" : "; ", r, differ);
  }
  throw ConfigError(fmt::format(
      "the ranks' configurations differ: {} {} other values than rank {}{} (every rank needs "
      "the same config file and overrides)",
      which, world - ref_count == 1 ? "has" : "have", ref,
      ref_count > 1 ? fmt::format(" and {} other rank(s)", ref_count - 1) : ""));
}

}  // namespace qring::train
