// Slurm hostlist expansion (net/rendezvous/hostlist.h).
#include "net/rendezvous/hostlist.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdint>

#include "net/base/error.h"

namespace qring::net {
namespace {

constexpr size_t kMaxHosts = size_t{1} << 20;
constexpr size_t kMaxDigits = 18;

[[noreturn]] void fail(std::string_view expr, const std::string& why) {
  throw ConfigError(fmt::format("malformed hostlist '{}': {}", expr, why));
}

uint64_t parse_number(std::string_view expr, std::string_view s) {
  if (s.empty()) fail(expr, "empty number in a range");
  if (s.size() > kMaxDigits) fail(expr, fmt::format("number '{}' is too long", s));
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size())
    fail(expr, fmt::format("'{}' is not a number", s));
  return v;
}

// "01-04,07" -> {"01","02","03","04","07"}
std::vector<std::string> expand_ranges(std::string_view expr, std::string_view body) {
  if (body.empty()) fail(expr, "empty brackets");
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string_view part =
        body.substr(start, comma == std::string_view::npos ? body.npos : comma - start);
    if (part.empty()) fail(expr, "empty range inside brackets");
    size_t dash = part.find('-');
    std::string_view lo_s = part.substr(0, dash);
    std::string_view hi_s = dash == std::string_view::npos ? lo_s : part.substr(dash + 1);
    uint64_t lo = parse_number(expr, lo_s);
    uint64_t hi = parse_number(expr, hi_s);
    if (hi < lo) fail(expr, fmt::format("descending range '{}'", part));
    if (hi - lo >= kMaxHosts || out.size() + (hi - lo + 1) > kMaxHosts)
      fail(expr, fmt::format("more than {} hosts", kMaxHosts));
    for (uint64_t v = lo; v <= hi; ++v) out.push_back(fmt::format("{:0{}}", v, lo_s.size()));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// One top-level item: literal text and bracket groups, expanded as a cartesian product with
// the leftmost group varying slowest (Slurm's order).
void expand_item(std::string_view expr, std::string_view item, std::vector<std::string>& out) {
  std::vector<std::string> acc{""};
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] == '[') {
      size_t close = item.find(']', i);
      if (close == std::string_view::npos) fail(expr, "unbalanced '['");
      std::string_view body = item.substr(i + 1, close - i - 1);
      if (body.find('[') != std::string_view::npos) fail(expr, "nested '['");
      auto values = expand_ranges(expr, body);
      if (acc.size() * values.size() > kMaxHosts)
        fail(expr, fmt::format("more than {} hosts", kMaxHosts));
      std::vector<std::string> next;
      next.reserve(acc.size() * values.size());
      for (const auto& a : acc)
        for (const auto& v : values) next.push_back(a + v);
      acc = std::move(next);
      i = close + 1;
    } else if (item[i] == ']') {
      fail(expr, "unbalanced ']'");
    } else {
      size_t j = item.find_first_of("[]", i);
      if (j == std::string_view::npos) j = item.size();
      for (auto& a : acc) a.append(item.substr(i, j - i));
      i = j;
    }
  }
  if (out.size() + acc.size() > kMaxHosts) fail(expr, fmt::format("more than {} hosts", kMaxHosts));
  for (auto& a : acc) out.push_back(std::move(a));
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view expr) {
  if (expr.empty()) fail(expr, "empty");
  for (char c : expr)
    if (c == ' ' || c == '\t' || c == '\n') fail(expr, "whitespace");
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= expr.size(); ++i) {
    char c = i < expr.size() ? expr[i] : ',';
    if (c == '[') {
      if (++depth > 1) fail(expr, "nested '['");
    } else if (c == ']') {
      if (--depth < 0) fail(expr, "unbalanced ']'");
    } else if (c == ',' && depth == 0) {
      std::string_view item = expr.substr(start, i - start);
      if (item.empty()) fail(expr, "empty host name");
      expand_item(expr, item, out);
      start = i + 1;
    }
  }
  if (depth != 0) fail(expr, "unbalanced '['");
  return out;
}

}  // namespace qring::net
