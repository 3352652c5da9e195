#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "net/base/error.h"
#include "net/rendezvous/hostlist.h"

namespace qring::net {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Hostlist, SingleNames) {
  EXPECT_THAT(expand_hostlist("node7"), ElementsAre("node7"));
  EXPECT_THAT(expand_hostlist("gpu-a.cluster"), ElementsAre("gpu-a.cluster"));
}

TEST(Hostlist, RangesKeepZeroPadding) {
  EXPECT_THAT(expand_hostlist("node[01-04,07]"),
              ElementsAre("node01", "node02", "node03", "node04", "node07"));
  EXPECT_THAT(expand_hostlist("n[8-11]"), ElementsAre("n8", "n9", "n10", "n11"));
  EXPECT_THAT(expand_hostlist("n[098-101]"), ElementsAre("n098", "n099", "n100", "n101"));
  EXPECT_THAT(expand_hostlist("n[5]"), ElementsAre("n5"));
}

TEST(Hostlist, CartesianInSlurmOrder) {
  EXPECT_THAT(expand_hostlist("a[1-2]b[3-4]"), ElementsAre("a1b3", "a1b4", "a2b3", "a2b4"));
  EXPECT_THAT(expand_hostlist("r[1-2]-n[0,2]-x"),
              ElementsAre("r1-n0-x", "r1-n2-x", "r2-n0-x", "r2-n2-x"));
}

TEST(Hostlist, TopLevelCommaLists) {
  EXPECT_THAT(expand_hostlist("x,y[1-3],z"), ElementsAre("x", "y1", "y2", "y3", "z"));
  EXPECT_THAT(expand_hostlist("a[1,3],b[02-03]"), ElementsAre("a1", "a3", "b02", "b03"));
}

std::string error_of(std::string_view expr) {
  try {
    expand_hostlist(expr);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Hostlist, MalformedInputIsAConfigError) {
  EXPECT_THAT(error_of(""), HasSubstr("empty"));
  EXPECT_THAT(error_of("a[1-2"), HasSubstr("unbalanced '['"));
  EXPECT_THAT(error_of("a1-2]"), HasSubstr("unbalanced ']'"));
  EXPECT_THAT(error_of("a[[1]]"), HasSubstr("nested"));
  EXPECT_THAT(error_of("a[3-1]"), HasSubstr("descending range '3-1'"));
  EXPECT_THAT(error_of("a[x]"), HasSubstr("'x' is not a number"));
  EXPECT_THAT(error_of("a[1-]"), HasSubstr("empty number"));
  EXPECT_THAT(error_of("a[]"), HasSubstr("empty brackets"));
  EXPECT_THAT(error_of("a[1,,2]"), HasSubstr("empty range"));
  EXPECT_THAT(error_of("a,,b"), HasSubstr("empty host name"));
  EXPECT_THAT(error_of("a,"), HasSubstr("empty host name"));
  EXPECT_THAT(error_of("a[0-99999999]"), HasSubstr("more than"));
  EXPECT_THAT(error_of("a[1-3] b"), HasSubstr("whitespace"));
  EXPECT_THAT(error_of("a[1-3]"), HasSubstr("(no error)"));
  // The message quotes the whole expression.
  EXPECT_THAT(error_of("n[1-2],m[x]"), HasSubstr("'n[1-2],m[x]'"));
}

}  // namespace
}  // namespace qring::net
