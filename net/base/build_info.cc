#include "net/base/build_info.h"

#include <string>

#ifndef QRING_VERSION
#define QRING_VERSION "unknown"
#endif
#ifndef QRING_BUILD_TYPE
#define QRING_BUILD_TYPE "unknown"
#endif
#ifndef QRING_ARCH_FLAG
#define QRING_ARCH_FLAG ""
#endif

namespace qring::build {

namespace detail {
extern const char* const kCommit;  // build_commit.cc, written by build_info.cmake
}

const char* version() { return QRING_VERSION; }
const char* commit() { return detail::kCommit; }
const char* build_type() { return QRING_BUILD_TYPE[0] ? QRING_BUILD_TYPE : "none"; }
const char* arch() { return QRING_ARCH_FLAG; }

const char* isa() {
#if defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__AVX__)
  return "avx";
#elif defined(__SSE4_2__)
  return "sse4.2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "baseline";
#endif
}

std::string short_commit() {
  const std::string c = commit();
  const size_t plus = c.find('+');
  const std::string hash = c.substr(0, plus);
  if (hash.size() <= 12) return c;
  return hash.substr(0, 12) + (plus == std::string::npos ? "" : c.substr(plus));
}

std::string version_text(const std::string& program) {
  std::string s = program + " " + version() + " (commit " + short_commit() + ", " + build_type() +
                  ", ISA " + isa();
  if (arch()[0]) s += std::string(", -march=") + arch();
  return s + ")";
}

std::map<std::string, std::string> fields() {
  return {{"version", version()},
          {"commit", commit()},
          {"build_type", build_type()},
          {"isa", isa()},
          {"arch", arch()}};
}

}  // namespace qring::build
