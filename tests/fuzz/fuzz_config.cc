// libFuzzer target: run configurations (train/config.cc): a TOML text, then, after a line
// "---", key=value overrides one per line (as given on the command line), then validation.
// Every bad input must be a ConfigError (the program's exit 2), never another exception.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "net/base/error.h"
#include "train/config.h"

// The parsers log what they reject; at fuzzing rates that is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  if (size_t sep = text.find("\n---\n"); sep != std::string::npos) {
    std::istringstream in(text.substr(sep + 5));
    for (std::string line; std::getline(in, line);) overrides.push_back(line);
    text.resize(sep);
  }
  try {
    auto cfg = qring::train::TrainConfig::from_string(text, overrides, "fuzz.toml");
    cfg.validate(4);
    (void)cfg.to_toml();
    (void)cfg.fingerprint();
  } catch (const qring::ConfigError&) {
  }
  return 0;
}
