// The fields of a model or fault spec given on a command line or in a config: a string of
// fields separated by ':' ("fixed:2:200", "stop:2:40:ring:1500"). Empty fields are kept, so
// that "fixed::200" has three fields and the parser names the empty one.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace qring::collectives {

inline std::vector<std::string> spec_fields(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t p = s.find(':', start);
    out.emplace_back(s.substr(start, p == std::string_view::npos ? s.npos : p - start));
    if (p == std::string_view::npos) return out;
    start = p + 1;
  }
}

}  // namespace qring::collectives
