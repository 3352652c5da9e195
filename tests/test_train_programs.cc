// Every program's shared command-line behaviour: --version prints the version, the commit, the
// build type and the ISA and exits 0; an unknown flag is one line on stderr and exit 2.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cli_harness.h"
#include "net/base/build_info.h"

namespace {

using qring::testing::sh;

const std::string kBuild = QRING_BUILD_DIR;
const std::string kSource = QRING_SOURCE_DIR;

std::vector<std::string> programs() {
  std::vector<std::string> p{"net/qring-launch",          "net/qring-store",
                             "collectives/qring-bench",   "collectives/qring-decide-bench",
                             "train/qring-train",         "train/qring-sim"};
  // Built only where OpenMPI is installed.
  if (access((kBuild + "/collectives/qring-mpi-bench").c_str(), X_OK) == 0)
    p.push_back("collectives/qring-mpi-bench");
  return p;
}

std::string name_of(const std::string& path) { return path.substr(path.rfind('/') + 1); }

// The commit as git sees the checkout now (the build reads it the same way), shortened as
// --version prints it; "unknown" outside a git checkout.
std::string expected_commit() {
  auto r = sh("git -C " + kSource + " rev-parse HEAD 2>/dev/null");
  if (r.status != 0 || r.output.size() < 40) return "unknown";
  return r.output.substr(0, 12);
}

TEST(Programs, VersionPrintsTheCommitAndExitsZero) {
  const std::string commit = expected_commit();
  EXPECT_EQ(std::string(qring::build::short_commit()).substr(0, commit.size()), commit);
  for (const std::string& p : programs()) {
    auto r = sh(kBuild + "/" + p + " --version 2>&1");
    EXPECT_EQ(r.status, 0) << p << ": " << r.output;
    const std::string want = name_of(p) + " " + qring::build::version() + " (commit " + commit;
    EXPECT_EQ(r.output.rfind(want, 0), 0u) << p << " printed: " << r.output;
    EXPECT_NE(r.output.find(qring::build::build_type()), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(std::string("ISA ") + qring::build::isa()), std::string::npos)
        << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

TEST(Programs, UnknownFlagExitsTwoWithAMessageNamingIt) {
  for (const std::string& p : programs()) {
    auto r = sh(kBuild + "/" + p + " --no-such-flag 2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2) << p << ": " << r.output;
    EXPECT_NE(r.output.find(name_of(p) + ": "), std::string::npos) << p << ": " << r.output;
    EXPECT_NE(r.output.find("--no-such-flag"), std::string::npos) << p << ": " << r.output;
  }
}

}  // namespace
