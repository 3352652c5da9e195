// Slurm hostlist expressions: "node[01-04,07]", "a[1-2]b[3-4]", "x,y[1-3],z", zero padding.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace qring::net {

// Expands a hostlist into host names in Slurm's order. Throws ConfigError on malformed input
// (unbalanced brackets, empty ranges, descending ranges, non-digits in a range ...).
std::vector<std::string> expand_hostlist(std::string_view expr);

}  // namespace qring::net
