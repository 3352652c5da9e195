// What a binary is: qring's version, the commit it was built from, the build type and the
// instruction set it was compiled for. Every program prints it for --version (net/base/cli.h);
// qring-train writes it into summary.json and its first log line, qring-bench and
// qring-mpi-bench into every JSON row (docs/bootstrap.md, "Provenance").
//
// The commit is read from git at every build (net/base/build_info.cmake): a binary built from
// a tree with uncommitted changes says "+dirty"; one built outside a git checkout "unknown".
#pragma once

#include <map>
#include <string>

namespace qring::build {

const char* version();     // the project's version (CMakeLists.txt), e.g. "0.1.0"
const char* commit();      // 40 hex digits [+dirty], or "unknown"
const char* build_type();  // CMAKE_BUILD_TYPE: Release, RelWithDebInfo, ...
const char* arch();        // QRING_ARCH, the -march value ("" = the compiler's default)
// The widest vector extension the compiler targeted: "avx512f", "avx2", "avx", "sse4.2",
// "neon", or "baseline".
const char* isa();

// The commit shortened to 12 digits (its "+dirty" kept).
std::string short_commit();
// One line: "PROGRAM VERSION (commit C, BUILD_TYPE, ISA I, -march=A)" -- the --version text.
std::string version_text(const std::string& program);
// {"version", "commit", "build_type", "isa", "arch"} -> value, for JSON records.
std::map<std::string, std::string> fields();

}  // namespace qring::build
