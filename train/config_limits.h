// Bounds on configuration input, checked before the TOML parser sees it (issue 44, N6): the
// parser (toml11) recurses once per nested array or inline table and works quadratically
// on dotted keys, so a 14 KB file of 7000 nested arrays crashed qring-train (stack overflow)
// and one key of 20000 dotted parts took 16 s. Every limit is a ConfigError naming the input.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace qring::train {

// A configuration file: at most this many bytes.
inline constexpr size_t kMaxConfigBytes = size_t{1} << 20;
// Arrays and inline tables nested at most this deep (a qring configuration needs 2).
inline constexpr size_t kMaxTomlNesting = 32;
// A dotted key (a.b.c = 1, [a.b.c]) of at most this many parts (qring's need 2).
inline constexpr size_t kMaxTomlKeyParts = 32;

// Checks `text` (named `name` in errors: the file, or the override) against the limits above,
// without parsing it: strings and comments are skipped, brackets and dots outside them count.
// ConfigError naming the line and column of the first excess.
void check_toml_limits(std::string_view text, const std::string& name);

// The contents of the configuration file `path`: a regular file (not a directory, device or
// FIFO) of at most kMaxConfigBytes. ConfigError naming the file and the limit otherwise.
std::string read_config_file(const std::string& path);

}  // namespace qring::train
