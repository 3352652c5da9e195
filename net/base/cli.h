// Command lines of qring's programs (qring-launch, qring-store, qring-bench, qring-mpi-bench,
// qring-train), all through CLI11, so that they share one syntax and one behaviour:
//   --flag value, --flag=value and -f value; -h/--help prints the help to stdout and exits 0;
//   --version prints one line (version, commit, build type, ISA: net/base/build_info.h) to
//   stdout and exits 0;
//   a flag given twice keeps the last value; an unknown flag, a missing value or a bad value is
//   one line "PROG: what is wrong" on stderr and exit status 2 (the ConfigError policy of
//   docs/design.md). Values are converted by the functions below, whose messages name the
//   flag ("--port expects an integer in [1, 65535], got 'x'").
//
// Usage:
//   CLI::App app{"Serves a job's rendezvous store.", "qring-store"};
//   qring::cli::init(app);
//   qring::cli::add_value(app, "--port", "...")->each([&](const std::string& v) {
//     port = qring::cli::to_int("--port", v, 1, 65535);
//   });
//   if (int rc = qring::cli::parse(app, args); rc >= 0) return rc;
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "net/base/build_info.h"
#include "net/base/error.h"

namespace qring::cli {

// The shared conventions, for an app made as CLI::App app{description, prog}: help flag
// -h/--help, --version, the last of repeated values wins, unknown arguments are collected
// (parse() reports the first one in qring's words).
inline void init(CLI::App& app) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.allow_extras();
  app.set_version_flag("--version", build::version_text(app.get_name()),
                       "print the version, commit, build type and ISA, and exit");
}

// An option whose value goes to the callback given to ->each() (qring's conversions and
// messages) instead of into a variable.
inline CLI::Option* add_value(CLI::App& app, const std::string& name,
                              const std::string& description) {
  return app.add_option(name)->description(description);
}

// The positional "section.key=value" configuration overrides of qring-train and qring-sim
// (`examples`: a few, for the help); check_overrides() finds one without its '='.
inline CLI::Option* add_overrides(CLI::App& app, std::vector<std::string>& out,
                                  const std::string& examples) {
  return app
      .add_option("overrides", out, "key=value: override any configuration key, e.g. " + examples)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}
inline void check_overrides(const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides)
    if (o.find('=') == std::string::npos)
      throw ConfigError(fmt::format("unknown argument '{}' (overrides are key=value; see --help)", o));
}

struct ParseOptions {
  // Follows the name of an unknown argument in its message.
  std::string unknown_hint = "(see --help)";
  // Checks across flags, run after parsing; a ConfigError it throws is a usage error.
  std::function<void()> check;
  // false: print nothing (the ranks of an MPI program but one), only return the status.
  bool report = true;
};

// Parses `args` (the program's arguments, without argv[0]). Returns -1 when the program goes
// on, else the exit status it ends with: 0 after printing --help or --version, 2 after printing the
// problem (a CLI11 parse error, a ConfigError from a conversion or from `check`, an unknown
// argument).
inline int parse(CLI::App& app, std::vector<std::string> args, const ParseOptions& po = {}) {
  const std::string prog = app.get_name();
  try {
    std::reverse(args.begin(), args.end());  // CLI11 takes them from the back
    app.parse(args);
    const std::vector<std::string> extra = app.remaining();
    if (!extra.empty())
      throw ConfigError(fmt::format("unknown option '{}' {}", extra.front(), po.unknown_hint));
    if (po.check) po.check();
  } catch (const CLI::CallForHelp&) {
    if (po.report) std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    if (po.report) std::printf("%s\n", e.what());
    return 0;
  } catch (const CLI::ParseError& e) {
    // CLI11 says "--op: 1 required  missing" for a flag without its value: qring's words.
    std::string what = e.what();
    const size_t colon = what.find(':');
    if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) && colon != std::string::npos &&
        what.find("required", colon) != std::string::npos)
      what = what.substr(0, colon) + " needs a value";
    if (po.report) std::fprintf(stderr, "%s: %s (see --help)\n", prog.c_str(), what.c_str());
    return 2;
  } catch (const ConfigError& e) {
    if (po.report) std::fprintf(stderr, "%s: %s\n", prog.c_str(), e.what());
    return 2;
  }
  return -1;
}

// Checks before the work starts that `path` (the value of `flag`, e.g. --json) can be written:
// opens it for appending, creating it, and removes it again if it did not exist. A ConfigError
// naming the flag, the path and the reason otherwise (a run must not fail at its end).
inline void check_output_path(const std::string& flag, const std::string& path) {
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr)
    throw ConfigError(
        fmt::format("{}: cannot write '{}': {}", flag, path, std::strerror(errno)));
  std::fclose(f);
  if (!existed) std::remove(path.c_str());
}

inline std::vector<std::string> args_of(int argc, char** argv) {
  return std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + argc);
}

// An integer in [lo, hi], or a ConfigError naming `flag`.
inline long to_int(const std::string& flag, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
    throw ConfigError(fmt::format("{} expects an integer in [{}, {}], got '{}'", flag, lo, hi, v));
  return x;
}

// A finite number in [lo, hi], or a ConfigError naming `flag`.
inline double to_number(const std::string& flag, const std::string& v, double lo, double hi) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x >= lo && x <= hi))
    throw ConfigError(fmt::format("{} expects a number in [{}, {}], got '{}'", flag, lo, hi, v));
  return x;
}

// A number of seconds in (0, hi] (`zero_ok`: [0, hi]), or a ConfigError naming `flag`.
inline double to_seconds(const std::string& flag, const std::string& v, double hi,
                         bool zero_ok = false) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  const bool low_ok = zero_ok ? x >= 0 : x > 0;
  if (v.empty() || *end != '\0' || !low_ok || !(x <= hi))
    throw ConfigError(fmt::format("{} expects a number of seconds in {}0, {:.0f}], got '{}'", flag,
                                  zero_ok ? "[" : "(", hi, v));
  return x;
}

}  // namespace qring::cli
