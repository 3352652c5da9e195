// libFuzzer target: the configuration's input limits (train/config_limits.h, issue 44, N6).
// The input is a program of bytes that builds a TOML text far larger and deeper than the
// fuzzer would write byte by byte: each byte appends one piece -- an opening array or inline
// table, a closing one, a dotted key part, a string or comment that hides brackets, a value, a
// newline -- repeated (byte >> 4) + 1 times. The text goes through TrainConfig::from_string and,
// as the value of an override, through apply_override. Every outcome must be a ConfigError or
// a configuration, never a crash (the parser's recursion), and quick (-timeout).
#include <cstddef>
#include <cstdint>
#include <string>

#include <spdlog/spdlog.h>

#include "net/base/error.h"
#include "train/config.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* const kPieces[] = {
      "[",  "]",  "{a=", "}",  ".a", "a",   "=",      ",",        "\n", "1",
      "\"[{", "'{[", "# [[{\n", "[[", "]]", "\"\"\"[\n{\"\"\""};
  std::string text = "[run]\nname = ";
  for (size_t i = 0; i < size && text.size() < (size_t{1} << 21); ++i) {
    const char* piece = kPieces[data[i] & 0xF];
    for (int k = 0; k <= data[i] >> 4; ++k) text += piece;
  }
  try {
    (void)qring::train::TrainConfig::from_string(text, {}, "fuzz.toml");
  } catch (const qring::ConfigError&) {
  }
  try {
    qring::train::TrainConfig cfg;
    cfg.apply_override("model.hidden=" + text.substr(13));
  } catch (const qring::ConfigError&) {
  }
  return 0;
}
