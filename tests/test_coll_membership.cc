// The quorum coordinator's decisions and membership as a pure function of events and a
// simulated clock (collectives/quorum/coordinator.h), and the control message codec
// (collectives/quorum/wire.h). No threads, no sleeps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include "collectives/quorum/quorum.h"
#include "collectives/quorum/coordinator.h"
#include "collectives/quorum/wire.h"
#include "net/base/error.h"
#include "wire_harness.h"

namespace qring::testing {
namespace {

using namespace collectives::qproto;
using K = Down::Kind;
using std::chrono::milliseconds;

struct Sim {
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c;
  // started: every rank has spoken once (past start-up, where the deadline applies instead
  // of the evict time).
  explicit Sim(Config cfg, bool started = true) : c(cfg, Time{} + std::chrono::hours(1)) {
    if (started)
      for (int r = 0; r < cfg.world; ++r) beat(r);
  }

  std::vector<Down> ready(int r, uint64_t t, int64_t completed = -1, uint64_t count = 8,
                            bool more = false) {
    Event e;
    e.kind = Event::Kind::kReady;
    e.from = r;
    e.step = t;
    e.count = count;
    e.completed = completed;
    return c.handle(e, now, more);
  }
  std::vector<Down> beat(int r, int64_t completed = -1) {
    Event e;
    e.kind = Event::Kind::kHeartbeat;
    e.from = r;
    e.completed = completed;
    return c.handle(e, now);
  }
  std::vector<Down> report(int r, uint64_t t, uint32_t attempt, bool have) {
    Event e;
    e.kind = Event::Kind::kReport;
    e.from = r;
    e.step = t;
    e.attempt = attempt;
    e.have = have;
    return c.handle(e, now);
  }
  std::vector<Down> tick() { return c.handle(Event{}, now); }
  // Advances the clock, with every rank in `alive` heartbeating every 10 ms.
  std::vector<Down> run(milliseconds d, const std::vector<int>& alive, int64_t completed = -1) {
    std::vector<Down> all;
    auto end = now + d;
    while (now < end) {
      now += milliseconds(10);
      for (int r : alive) {
        auto a = beat(r, completed);
        all.insert(all.end(), a.begin(), a.end());
      }
      auto a = tick();
      all.insert(all.end(), a.begin(), a.end());
    }
    return all;
  }
};

Config base(int world, int quorum) {
  Config c;
  c.world = world;
  c.quorum = quorum;
  c.count = 8;
  c.evict = milliseconds(500);
  c.deadline = milliseconds(5000);
  return c;
}

std::vector<Down> of(const std::vector<Down>& v, K k) {
  std::vector<Down> r;
  for (auto& a : v)
    if (a.kind == k) r.push_back(a);
  return r;
}

TEST(Coordinator, DecidesOnTheQuorumthArrivalWithoutGrace) {
  Sim s(base(4, 3));
  EXPECT_TRUE(s.ready(0, 0).empty());
  s.now += milliseconds(2);
  EXPECT_TRUE(s.ready(2, 0).empty());
  s.now += milliseconds(3);
  auto a = s.ready(1, 0);
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(a[0].kind, K::kDecide);
  const Decision& d = a[0].decide;
  EXPECT_EQ(d.status, Status::kOk);
  EXPECT_EQ(d.contributors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(d.epoch, 0u);
  EXPECT_EQ(d.attempt, 0u);
  EXPECT_EQ(d.offsets_us[2], 2000);
  EXPECT_EQ(d.offsets_us[3], -1);
  EXPECT_EQ(d.decide_us, 5000);
  // The late rank is not counted afterwards.
  EXPECT_TRUE(s.ready(3, 0).empty());
}

// READYs that one poll of the streams found together are taken in together (`more`): with
// grace 0 the decision counts all of them, not the first Q in the order they were read. The
// last one of the batch decides; a READY after the decision is late, as before.
TEST(Coordinator, ReadiesFoundTogetherAreCountedTogether) {
  Sim s(base(4, 3));
  EXPECT_TRUE(s.ready(1, 0, -1, 8, /*more=*/true).empty());
  EXPECT_TRUE(s.ready(2, 0, -1, 8, true).empty());
  EXPECT_TRUE(s.ready(3, 0, -1, 8, true).empty());  // the quorum is in: no decision yet
  auto a = of(s.ready(0, 0), K::kDecide);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].decide.contributors, (std::vector<int>{0, 1, 2, 3}));
  // Without `more` the third READY decides at once and the fourth is late.
  s.now += milliseconds(1);
  s.ready(1, 1);
  s.ready(2, 1);
  auto b = of(s.ready(3, 1), K::kDecide);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].decide.contributors, (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(of(s.ready(0, 1), K::kDecide).empty());
}

TEST(Coordinator, GraceCollectsLateArrivalsUntilItEnds) {
  Config cfg = base(4, 2);
  cfg.grace = milliseconds(5);
  Sim s(cfg);
  s.ready(0, 0);
  s.ready(1, 0);
  s.now += milliseconds(4);
  EXPECT_TRUE(s.tick().empty());
  s.ready(3, 0);
  s.now += milliseconds(1);
  auto a = of(s.tick(), K::kDecide);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].decide.contributors, (std::vector<int>{0, 1, 3}));
}

TEST(Coordinator, TooFewByTheDeadlineIsATimeout) {
  Sim s(base(3, 3));
  s.ready(0, 0);
  auto a = s.run(milliseconds(5000), {1, 2});
  auto d = of(a, K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kTimeout);
  EXPECT_TRUE(s.c.stopped());
}

TEST(Coordinator, RankNeverHeardFromHasTheDeadlineToStart) {
  Sim s(base(4, 3), /*started=*/false);
  auto a = s.run(milliseconds(4900), {1, 2});  // rank 3 still starting up
  EXPECT_TRUE(of(a, K::kView).empty());
  a = s.run(milliseconds(200), {1, 2});
  ASSERT_EQ(of(a, K::kView).size(), 1u);
  EXPECT_EQ(of(a, K::kView)[0].left[0].rank, 3);
}

// Silent for the evict time and one heartbeat period (evict / 8: its last heartbeat may be
// that much older than a pause, and a pause shorter than evict never evicts).
TEST(Coordinator, SilentMemberLeavesTheViewAfterEvictTimeAndAHeartbeatPeriod) {
  Sim s(base(4, 3));
  auto a = s.run(milliseconds(550), {1, 2});
  EXPECT_TRUE(of(a, K::kView).empty());  // not yet: 500 + 62 ms
  a = s.run(milliseconds(30), {1, 2});
  auto v = of(a, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].view.epoch, 1u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(v[0].left.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kSilent);
  EXPECT_GT(v[0].left[0].silent_ms, 562);
  EXPECT_TRUE(of(a, K::kFatal).empty());
  // The integer quorum stays 3: the three left must all contribute.
  s.ready(0, 0);
  s.ready(1, 0);
  auto d = of(s.ready(2, 0), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.epoch, 1u);
  EXPECT_EQ(d[0].decide.quorum, 3);
}

TEST(Coordinator, FractionalQuorumFollowsTheView) {
  Config cfg = base(4, 0);
  cfg.fraction = 0.75;
  Sim s(cfg);
  EXPECT_EQ(s.c.quorum(), 3);
  s.run(milliseconds(600), {1, 2});  // rank 3 leaves
  ASSERT_EQ(s.c.view().size(), 3);
  EXPECT_EQ(s.c.quorum(), 3);  // ceil(0.75 * 3)
  s.run(milliseconds(600), {1});   // rank 2 leaves: ceil(0.75 * 2) = 2
  ASSERT_EQ(s.c.view().size(), 2);
  EXPECT_EQ(s.c.quorum(), 2);
  EXPECT_FALSE(s.c.stopped());
}

TEST(Coordinator, BelowQuorumStopsTheJobNamingWhoLeft) {
  Sim s(base(4, 4));
  auto a = s.run(milliseconds(600), {1, 3});
  auto f = of(a, K::kFatal);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].reason.find("rank 2 (silent, last heard"), std::string::npos) << f[0].reason;
  EXPECT_NE(f[0].reason.find("quorum 4"), std::string::npos) << f[0].reason;
  EXPECT_TRUE(s.c.stopped());
  EXPECT_TRUE(s.tick().empty());
}

TEST(Coordinator, MinWorldAboveTheQuorumStopsEarlier) {
  Config cfg = base(4, 2);
  cfg.min_world = 4;
  Sim s(cfg);
  auto a = s.run(milliseconds(600), {1, 2});
  ASSERT_EQ(of(a, K::kFatal).size(), 1u);
  EXPECT_NE(of(a, K::kFatal)[0].reason.find("min_world 4"), std::string::npos);
}

TEST(Coordinator, MissedStepsEvictWhenConfigured) {
  Config cfg = base(4, 3);
  cfg.evict_steps = 2;
  Sim s(cfg);
  std::vector<Down> all;
  for (uint64_t t = 0; t < 2; ++t) {
    EXPECT_EQ(s.c.view().size(), 4);
    for (int r = 0; r < 3; ++r) {
      auto a = s.ready(r, t, int64_t(t) - 1);
      all.insert(all.end(), a.begin(), a.end());
    }
    auto a = s.beat(3, int64_t(t) - 1);  // alive, but never contributes
    all.insert(all.end(), a.begin(), a.end());
  }
  auto v = of(all, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kMissedSteps);
}

TEST(Coordinator, MissedStepsNeverEvictByDefault) {
  Sim s(base(4, 3));
  for (uint64_t t = 0; t < 50; ++t) {
    s.ready(0, t, int64_t(t) - 1);
    s.ready(1, t, int64_t(t) - 1);
    s.ready(2, t, int64_t(t) - 1);
    s.beat(3, int64_t(t) - 1);
  }
  EXPECT_EQ(s.c.view().size(), 4);
}

// Steps every 10 ms among ranks 0, 1 and 3; rank 2 heartbeats every 10 ms (never silent)
// saying it completed `completed2(t)`. Returns every Down and the time step t was decided.
struct Lagging {
  Sim s;
  std::vector<Down> all;
  std::map<uint64_t, Time> decided;
  explicit Lagging(Config cfg) : s(cfg) {}
  void steps(uint64_t from, uint64_t to, const std::function<int64_t(uint64_t)>& completed2) {
    for (uint64_t t = from; t < to; ++t) {
      s.now += milliseconds(10);
      for (int r : {0, 1, 3}) {
        auto a = s.ready(r, t, int64_t(t) - 1);
        for (auto& d : of(a, K::kDecide)) decided[d.decide.step] = s.now;
        all.insert(all.end(), a.begin(), a.end());
      }
      auto a = s.beat(2, completed2(t));
      all.insert(all.end(), a.begin(), a.end());
    }
  }
};

Config lag_config(int quorum) {
  Config cfg = base(4, quorum);
  cfg.max_lag = milliseconds(1000);
  return cfg;
}

// Issue 42, case 6: a rank stopped again and again never catches up by the results it missed
// (every member would keep one a step for it for good); once the oldest result it lacks was
// decided more than max_lag ago it leaves ("behind"), never before, though it never fell
// silent.
TEST(Coordinator, ARankWhoseOldestMissingResultIsOlderThanMaxLagLeavesAsBehind) {
  Lagging j(lag_config(2));
  j.steps(0, 200, [](uint64_t t) { return std::min<int64_t>(int64_t(t) - 1, 29); });
  auto v = of(j.all, K::kView);
  ASSERT_EQ(v.size(), 1u);
  ASSERT_EQ(v[0].left.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 2);
  EXPECT_EQ(v[0].left[0].why, Why::kBehind);
  EXPECT_STREQ(to_string(Why::kBehind), "behind");
  EXPECT_FALSE(j.s.c.view().has(2));
  // Step 30, the first it lacks, was decided at decided[30]: it left 1000 ms after, within a
  // step (10 ms), not before.
  const auto at = j.decided.at(30) + milliseconds(1000);
  int64_t left_step = -1;
  for (auto& [t, when] : j.decided)
    if (left_step < 0 && when > at) left_step = int64_t(t);
  ASSERT_GE(left_step, 0);
  auto d = of(j.all, K::kDecide);
  auto first_without = std::find_if(d.begin(), d.end(), [](const Down& x) {
    return x.decide.epoch == 1;
  });
  ASSERT_NE(first_without, d.end());
  EXPECT_GE(int64_t(first_without->decide.step), left_step - 1);
  EXPECT_LE(int64_t(first_without->decide.step), left_step + 1);
  // It learns why at its next contact (it is not in the VIEW's audience), over the wire too:
  // qring-train then rejoins without counting it as a failure (train/main.cc).
  auto e = of(j.s.beat(2, 29), K::kEvicted);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].why, Why::kBehind);
  auto buf = collectives::qwire::encode_down(4, e[0]);
  EXPECT_EQ(collectives::qwire::decode_down(buf.data(), buf.size(), 4, 0).why, Why::kBehind);
}

// A rank is judged only while it runs: paused for 450 ms (under evict, 500 ms) with its lag
// past max_lag (300 ms), it stays in the view; back and caught up it stays; back and still
// behind it leaves at once.
TEST(Coordinator, APausedRankIsJudgedBehindOnlyOnceItRunsAgain) {
  for (bool caught_up : {true, false}) {
    Config cfg = base(4, 2);
    cfg.max_lag = milliseconds(300);
    Lagging j(cfg);
    j.steps(0, 30, [](uint64_t t) { return int64_t(t) - 1; });
    for (uint64_t t = 30; t < 75; ++t) {  // rank 2 silent for 450 ms
      j.s.now += milliseconds(10);
      for (int r : {0, 1, 3}) {
        auto a = j.s.ready(r, t, int64_t(t) - 1);
        j.all.insert(j.all.end(), a.begin(), a.end());
      }
    }
    EXPECT_TRUE(of(j.all, K::kView).empty()) << "a paused rank left";
    auto a = j.s.beat(2, caught_up ? 74 : 29);
    j.all.insert(j.all.end(), a.begin(), a.end());
    j.steps(75, 80, [&](uint64_t t) { return caught_up ? int64_t(t) - 1 : 29; });
    auto v = of(j.all, K::kView);
    if (caught_up) {
      EXPECT_TRUE(v.empty());
    } else {
      ASSERT_EQ(v.size(), 1u);
      EXPECT_EQ(v[0].left[0].why, Why::kBehind);
      EXPECT_LT(v[0].left[0].silent_ms, 20.0);  // as soon as it spoke
    }
  }
}

// A rank that lags, even by most of max_lag, and then catches up stays; so does a laggard
// where the job cannot lose a rank (quorum = world), or with max_lag 0 (never).
TEST(Coordinator, ARankThatCatchesUpOrThatTheJobCannotLoseStays) {
  Lagging j(lag_config(2));
  // Stuck at step 29 until step 110 (800 ms after step 30's decision), then caught up; again.
  auto caught_up = [](uint64_t t) {
    return t < 110 ? std::min<int64_t>(int64_t(t) - 1, 29)
                   : t < 150 ? int64_t(t) - 1 : t < 240 ? 149 : int64_t(t) - 1;
  };
  j.steps(0, 400, caught_up);
  EXPECT_TRUE(of(j.all, K::kView).empty());
  EXPECT_TRUE(j.s.c.view().has(2));

  auto stuck = [](uint64_t t) { return std::min<int64_t>(int64_t(t) - 1, 29); };
  Config all = lag_config(3);
  all.quorum = 4;  // quorum = world: losing rank 2 would stop the job
  Lagging w(all);
  for (uint64_t t = 0; t < 300; ++t) {  // every rank contributes; rank 2 completes none
    w.s.now += milliseconds(10);
    for (int r : {0, 1, 2, 3}) {
      auto a = w.s.ready(r, t, r == 2 ? stuck(t) : int64_t(t) - 1);
      w.all.insert(w.all.end(), a.begin(), a.end());
    }
  }
  ASSERT_EQ(of(w.all, K::kDecide).size(), 300u);
  EXPECT_TRUE(w.s.c.view().has(2));
  EXPECT_TRUE(of(w.all, K::kView).empty());

  Config off = base(4, 2);  // max_lag 0: never
  Lagging n(off);
  n.steps(0, 300, stuck);
  EXPECT_TRUE(n.s.c.view().has(2));
}

TEST(Coordinator, EvictedRankIsToldAtItsNextContact) {
  Sim s(base(4, 3));
  s.run(milliseconds(600), {1, 2});
  ASSERT_FALSE(s.c.view().has(3));
  auto a = s.beat(3);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].kind, K::kEvicted);
  EXPECT_EQ(a[0].to, 3);
  a = s.ready(3, 7);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].kind, K::kEvicted);
}

TEST(Coordinator, UnreachableRankIsEvictedOnceItMissesAHeartbeat) {
  Sim s(base(4, 3));
  Event e;
  e.kind = Event::Kind::kSuspect;
  e.from = 1;
  e.suspect = 3;
  s.beat(3);
  EXPECT_TRUE(of(s.c.handle(e, s.now), K::kView).empty());  // heard from it just now
  s.now += milliseconds(100);
  EXPECT_TRUE(of(s.tick(), K::kView).empty());  // within a heartbeat period (evict / 4)
  s.now += milliseconds(50);
  auto v = of(s.tick(), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kUnreachable);
}

TEST(Coordinator, SuspectThatSpeaksAgainIsCleared) {
  Sim s(base(4, 3));
  Event e;
  e.kind = Event::Kind::kSuspect;
  e.from = 1;
  e.suspect = 3;
  s.c.handle(e, s.now);
  auto a = s.run(milliseconds(400), {1, 2, 3});
  EXPECT_TRUE(of(a, K::kView).empty());
}

TEST(Coordinator, RankThatSaidGoodbyeIsNeverEvicted) {
  Sim s(base(4, 4));
  Event e;
  e.kind = Event::Kind::kBye;
  e.from = 3;
  s.c.handle(e, s.now);
  auto a = s.run(milliseconds(2000), {1, 2});
  EXPECT_TRUE(of(a, K::kView).empty());
  EXPECT_TRUE(of(a, K::kFatal).empty());
}

TEST(Coordinator, ItsOwnPauseEvictsNobody) {
  Sim s(base(4, 3));
  s.now += milliseconds(10000);  // the coordinator was stopped
  s.c.resync(s.now);
  EXPECT_TRUE(of(s.tick(), K::kView).empty());
  EXPECT_EQ(s.c.view().size(), 4);
}

// The time the coordinator's own process waited for a CPU (liveness.h, take_stall) is not
// counted as a member's silence: rank 3, silent 400 ms, then 300 ms while the coordinator
// waited, is not evicted at 700 ms of wall time but once 562 ms of the coordinator's own time
// passed; the view names its wall-clock silence. A member heard again starts from zero.
TEST(Coordinator, ItsOwnStallsAreNotCountedAsAMembersSilence) {
  Sim s(base(4, 3));
  EXPECT_TRUE(of(s.run(milliseconds(400), {1, 2}), K::kView).empty());
  s.now += milliseconds(300);
  s.c.excuse(milliseconds(300));
  EXPECT_TRUE(of(s.tick(), K::kView).empty());
  EXPECT_TRUE(of(s.run(milliseconds(150), {1, 2}), K::kView).empty());
  auto v = of(s.run(milliseconds(30), {1, 2}), K::kView);
  ASSERT_EQ(v.size(), 1u);
  ASSERT_EQ(v[0].left.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_GT(v[0].left[0].silent_ms, 862);
  // Rank 2 was heard during the stall's aftermath: the excuse ended with its message, and its
  // silence from there on counts in full.
  s.c.excuse(milliseconds(200));
  s.beat(2);
  v = of(s.run(milliseconds(580), {1}), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left.at(0).rank, 2);
}

// Step 0 decided with S = {0, 1, 2}; then rank 2 dies before everyone completed it.
Sim with_lost_member(int quorum) {
  Sim s(base(4, quorum));
  s.ready(0, 0);
  s.ready(1, 0);
  auto d = s.ready(2, 0);
  EXPECT_EQ(of(d, K::kDecide).size(), 1u);
  return s;
}

TEST(Coordinator, LostMemberWithTheResultSomewhereIsForwarded) {
  Sim s = with_lost_member(3);
  auto a = s.run(milliseconds(600), {0, 1, 3});
  auto r = of(a, K::kRecover);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].step, 0u);
  EXPECT_EQ(r[0].attempt, 1u);
  EXPECT_EQ(s.c.view().members, (std::vector<int>{0, 1, 3}));
  EXPECT_TRUE(s.report(0, 0, 1, false).empty());
  EXPECT_TRUE(s.report(3, 0, 1, false).empty());
  EXPECT_TRUE(s.report(1, 0, 0, true).empty());  // a report of an older attempt is ignored
  auto d = of(s.report(1, 0, 1, true), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kOk);
  EXPECT_EQ(d[0].decide.attempt, 1u);
  EXPECT_EQ(d[0].decide.source, 1);
  EXPECT_EQ(d[0].decide.needers, (std::vector<int>{0, 3}));
  // S(0) is unchanged: rank 2's contribution is in the result everyone ends with.
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(d[0].decide.epoch, 1u);
  // Settled once every live member completed it.
  EXPECT_EQ(s.c.unsettled(), 1u);
  s.beat(0, 0);
  s.beat(1, 0);
  s.beat(3, 0);
  EXPECT_EQ(s.c.unsettled(), 0u);
}

// Ranks that hold step 0's result go on: step 1 is decided among them in view 0. Then a member
// of S(0) is lost before the coordinator (rank 0) had step 0's result: step 0 is decided again
// in view 1. Rank 0 thus completes step 0 in view 1 and step 1 in view 0, the order in which
// qring-train once logged the view changes twice (views_learned below).
TEST(Coordinator, NextStepCanBeDecidedInAnOlderViewThanARecoveredStep) {
  Sim s(base(5, 3));
  s.ready(0, 0);
  s.ready(1, 0);
  ASSERT_EQ(of(s.ready(2, 0), K::kDecide).size(), 1u);  // S(0) = {0, 1, 2}
  s.ready(1, 1, /*completed=*/0);
  s.ready(3, 1, /*completed=*/0);
  auto first = of(s.ready(4, 1, /*completed=*/0), K::kDecide);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].decide.step, 1u);
  EXPECT_EQ(first[0].decide.epoch, 0u);
  EXPECT_EQ(first[0].decide.contributors, (std::vector<int>{1, 3, 4}));
  // Rank 2 dies; rank 0 never completed step 0.
  auto a = s.run(milliseconds(600), {0, 1, 3, 4});
  ASSERT_EQ(of(a, K::kView).size(), 1u);
  ASSERT_EQ(of(a, K::kRecover).size(), 1u);
  EXPECT_EQ(of(a, K::kRecover)[0].step, 0u);
  s.report(0, 0, 1, false);
  s.report(3, 0, 1, true);
  s.report(4, 0, 1, true);
  auto d = of(s.report(1, 0, 1, true), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.step, 0u);
  EXPECT_EQ(d[0].decide.epoch, 1u);
  EXPECT_EQ(d[0].decide.needers, (std::vector<int>{0}));
}

// What a rank logs of the views as its steps complete: each view once, in order, though a
// step can come in an older view than the one before it (the case above).
TEST(ViewsLearned, EachViewOnceThoughAStepComesInAnOlderView) {
  std::vector<collectives::ViewChange> views(3);
  for (uint64_t e = 0; e < 3; ++e) views[e].epoch = e;
  views[1].left.push_back({2, "silent", 500});
  views[2].left.push_back({4, "unreachable", 120});
  auto epochs = [](const std::vector<collectives::ViewChange>& v) {
    std::vector<uint64_t> e;
    for (const auto& x : v) e.push_back(x.epoch);
    return e;
  };
  uint64_t known = 0;
  EXPECT_TRUE(collectives::views_learned(views, 0, &known).empty());
  // Steps completed in views 2, 0, 1, 2: views 1 and 2 are learned at the first.
  EXPECT_EQ(epochs(collectives::views_learned(views, 2, &known)), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(known, 2u);
  EXPECT_TRUE(collectives::views_learned(views, 0, &known).empty());
  EXPECT_EQ(known, 2u);
  EXPECT_TRUE(collectives::views_learned(views, 1, &known).empty());
  EXPECT_TRUE(collectives::views_learned(views, 2, &known).empty());
  // One at a time, and from a rejoined rank's view on (it knows views up to 1 already).
  known = 0;
  EXPECT_EQ(epochs(collectives::views_learned(views, 1, &known)), (std::vector<uint64_t>{1}));
  EXPECT_EQ(epochs(collectives::views_learned(views, 2, &known)), (std::vector<uint64_t>{2}));
  known = 1;
  EXPECT_EQ(epochs(collectives::views_learned(views, 2, &known)), (std::vector<uint64_t>{2}));
}

TEST(Coordinator, LostMemberWithoutAResultIsDecidedAgainAmongTheSurvivors) {
  Config cfg = base(4, 2);
  cfg.grace = milliseconds(5);  // S(0) = {0, 1, 2}: all three arrive within the grace
  Sim s(cfg);
  s.ready(0, 0);
  s.ready(1, 0);
  s.ready(2, 0);
  s.now += milliseconds(5);
  auto first = of(s.tick(), K::kDecide);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].decide.contributors, (std::vector<int>{0, 1, 2}));
  s.run(milliseconds(600), {0, 1, 3});
  s.report(0, 0, 1, false);
  s.report(1, 0, 1, false);
  auto d = of(s.report(3, 0, 1, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kOk);
  EXPECT_EQ(d[0].decide.source, -1);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1}));
  EXPECT_EQ(d[0].decide.attempt, 1u);
}

TEST(Coordinator, LateContributorsStandInForALostMember) {
  Sim s = with_lost_member(3);
  s.ready(3, 0);  // late for step 0: not counted, but its contribution is intact
  auto a = s.run(milliseconds(600), {0, 1, 3});
  ASSERT_EQ(of(a, K::kRecover).size(), 1u);
  s.report(0, 0, 1, false);
  s.report(1, 0, 1, false);
  auto d = of(s.report(3, 0, 1, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kOk);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 3}));
}

TEST(Coordinator, LostMemberWithTooFewSurvivorsSkipsTheStepEverywhere) {
  Sim s = with_lost_member(3);
  s.run(milliseconds(600), {0, 1, 3});
  s.report(0, 0, 1, false);
  s.report(1, 0, 1, false);
  auto d = of(s.report(3, 0, 1, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kSkipped);
  EXPECT_TRUE(d[0].decide.contributors.empty());
}

TEST(Coordinator, RecoveryWaitsForEveryLiveMemberAndSurvivesAnotherLoss) {
  Config cfg = base(5, 0);
  cfg.fraction = 0.6;  // 3 of 5, 3 of 4, 2 of 3
  Sim s(cfg);
  s.ready(0, 0);
  s.ready(1, 0);
  s.ready(2, 0);
  ASSERT_EQ(s.c.unsettled(), 1u);
  auto a = s.run(milliseconds(600), {0, 1, 3, 4});  // rank 2 dies
  ASSERT_EQ(of(a, K::kRecover).size(), 1u);
  s.report(0, 0, 1, false);
  s.report(1, 0, 1, false);
  s.report(3, 0, 1, false);
  // rank 4 dies before reporting: the recovery completes among the rest.
  a = s.run(milliseconds(600), {0, 1, 3});
  auto d = of(a, K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.epoch, 2u);
  EXPECT_EQ(d[0].decide.quorum, 2);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1}));
}

TEST(Coordinator, LossOfARankOutsideAStepNeedsNoRecovery) {
  Sim s = with_lost_member(3);
  auto a = s.run(milliseconds(600), {0, 1, 2});  // rank 3 (not in S(0)) dies
  EXPECT_TRUE(of(a, K::kRecover).empty());
  EXPECT_EQ(of(a, K::kView).size(), 1u);
}

TEST(Coordinator, ContributionsOfARankThatLeftDoNotCount) {
  Sim s(base(4, 3));
  s.ready(3, 0);
  s.ready(0, 0);
  s.run(milliseconds(600), {0, 1, 2});  // rank 3 leaves with its READY counted
  s.ready(1, 0);
  auto d = of(s.ready(2, 0), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 2}));
}

// A member's READY or REPORT to a coordinator that took over (its recoveries are attempt 1).
Event takeover_event(Event::Kind k, int from, uint64_t step, bool have) {
  Event e;
  e.kind = k;
  e.from = from;
  e.step = step;
  e.attempt = 1;
  e.have = have;
  e.count = 8;
  return e;
}

TEST(Coordinator, TakeoverRecoversWhatTheMembersSawAndDecidesTheRestAfresh) {
  // Rank 0 (the old coordinator) decided step 5 with S = {0, 1, 2}; rank 1 completed it,
  // rank 2 did not; rank 3 was late. Rank 1 takes over with members {1, 2, 3}.
  Config cfg = base(4, 2);
  cfg.self = 1;
  View v;
  v.epoch = 1;
  v.members = {1, 2, 3};
  std::vector<Down> out;
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c(cfg, now, v, {-1, 5, 4, 4}, {Known{5, 0, false, {0, 1, 2}}}, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, K::kView);
  EXPECT_EQ(out[0].view.members, (std::vector<int>{1, 2, 3}));
  ASSERT_EQ(out[0].left.size(), 1u);
  EXPECT_EQ(out[0].left[0].rank, 0);
  EXPECT_EQ(out[1].kind, K::kRecover);
  EXPECT_EQ(out[1].step, 5u);
  EXPECT_EQ(out[1].attempt, 1u);
  auto ev = [&](Event::Kind k, int from, uint64_t step, bool have) {
    return c.handle(takeover_event(k, from, step, have), now);
  };
  ev(Event::Kind::kReport, 1, 5, true);
  ev(Event::Kind::kReport, 2, 5, false);
  auto d = of(ev(Event::Kind::kReport, 3, 5, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.source, 1);  // it holds the result: S(5) stays {0, 1, 2}
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(d[0].decide.needers, (std::vector<int>{2, 3}));
  // Step 6 nobody saw decided: decided afresh from the READYs sent again.
  ev(Event::Kind::kReady, 2, 6, false);
  d = of(ev(Event::Kind::kReady, 3, 6, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{2, 3}));
  EXPECT_EQ(d[0].decide.epoch, 1u);
  // A READY for step 4 (decided by the old coordinator) is late, not a new step.
  EXPECT_TRUE(of(ev(Event::Kind::kReady, 3, 4, false), K::kDecide).empty());
}

TEST(Coordinator, TakeoverRecoversTheStepsALaggingMemberAwaitsBeforeTheKnownOnes) {
  // The members tell the new coordinator (rank 2) of steps 192-199 only (a takeover's ACKs
  // carry 8); rank 2 itself completed up to step 19, rank 3 up to 199. Steps 20-191 are
  // recovered too: rank 3 holds them and forwards them, S(t) unknown here (the needer keeps
  // the one it was told); nobody is asked about steps every member completed.
  Config cfg = base(4, 2);
  cfg.self = 2;
  View v;
  v.epoch = 1;
  v.members = {2, 3};
  std::vector<Known> known;
  for (uint64_t t = 192; t < 200; ++t) known.push_back(Known{t, 0, false, {0, 1}});
  std::vector<Down> out;
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c(cfg, now, v, {-1, -1, 19, 199}, known, out);
  auto rec = of(out, K::kRecover);
  ASSERT_EQ(rec.size(), 180u);
  EXPECT_EQ(rec.front().step, 20u);
  EXPECT_EQ(rec.back().step, 199u);
  for (const auto& r : rec) EXPECT_EQ(r.attempt, 1u) << "step " << r.step;
  auto report = [&](int from, uint64_t step, bool have) {
    return c.handle(takeover_event(Event::Kind::kReport, from, step, have), now);
  };
  report(2, 20, false);
  auto d = of(report(3, 20, true), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.step, 20u);
  EXPECT_EQ(d[0].decide.source, 3);
  EXPECT_TRUE(d[0].decide.contributors.empty());  // not known here
  EXPECT_EQ(d[0].decide.needers, (std::vector<int>{2}));
  // A known step keeps its S(t).
  report(2, 195, false);
  d = of(report(3, 195, true), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1}));
  // Nobody live holds a step: it is skipped everywhere (no member applied it).
  report(2, 21, false);
  d = of(report(3, 21, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kSkipped);
}

TEST(Coordinator, TakeoverCountsARankOnceWhenItSendsItsReadyAgain) {
  // Step 5 was decided by the old coordinator with S = {1, 2, 3}; rank 3 did not see the
  // DECIDE and sends its READY to the new coordinator again. Nobody holds the result.
  Config cfg = base(4, 2);
  cfg.self = 1;
  View v;
  v.epoch = 1;
  v.members = {1, 2, 3};
  std::vector<Down> out;
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c(cfg, now, v, {-1, 4, 4, 4}, {Known{5, 0, false, {1, 2, 3}}}, out);
  Event e;
  e.kind = Event::Kind::kReady;
  e.from = 3;
  e.step = 5;
  e.count = 8;
  c.handle(e, now);
  std::vector<Down> d;
  for (int r : {1, 2, 3}) {
    Event rep;
    rep.kind = Event::Kind::kReport;
    rep.from = r;
    rep.step = 5;
    rep.attempt = 1;
    d = c.handle(rep, now);
  }
  ASSERT_EQ(of(d, K::kDecide).size(), 1u);
  EXPECT_EQ(of(d, K::kDecide)[0].decide.contributors, (std::vector<int>{1, 2, 3}));
}

TEST(Coordinator, MinoritySideStopsInsteadOfDecidingAlone) {
  // Quorum 1 would let a coordinator cut off from everyone decide steps alone: the view
  // must keep a majority of the one before, so it stops instead.
  Sim s(base(4, 1));
  auto a = s.run(milliseconds(600), {});
  auto f = of(a, K::kFatal);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].reason.find("lost a majority"), std::string::npos) << f[0].reason;
  EXPECT_TRUE(s.c.stopped());
}

TEST(Coordinator, CutOffCoordinatorStopsDecidingWithinHalfTheEvictTime) {
  Sim s(base(4, 1));
  s.now += milliseconds(260);  // nobody heard from for more than evict / 2
  EXPECT_TRUE(of(s.ready(0, 0), K::kDecide).empty());
  s.beat(1);
  EXPECT_TRUE(of(s.tick(), K::kDecide).empty());  // 2 of 4 is no majority
  EXPECT_EQ(of(s.beat(2), K::kDecide).size(), 1u);  // 3 of 4 heard from: decided
}

TEST(Coordinator, CountMismatchIsReported) {
  Sim s(base(2, 2));
  s.ready(0, 0);
  auto d = of(s.ready(1, 0, -1, 9), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kMismatch);
  EXPECT_EQ(d[0].decide.bad_rank, 1);
  EXPECT_EQ(d[0].decide.bad_count, 9u);
}

// Same count, another element type or reduction (READY's layout): a mismatch too.
TEST(Coordinator, LayoutMismatchIsReported) {
  Config cfg = base(2, 2);
  cfg.layout = layout_of(0, true);
  Sim s(cfg);
  Event e;
  e.kind = Event::Kind::kReady;
  e.from = 0;
  e.count = 8;
  e.layout = cfg.layout;
  s.c.handle(e, s.now);
  e.from = 1;
  e.layout = layout_of(2, true);
  auto d = of(s.c.handle(e, s.now), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kMismatch);
  EXPECT_EQ(d[0].decide.bad_rank, 1);
  EXPECT_EQ(d[0].decide.bad_count, 8u);
  EXPECT_EQ(d[0].decide.bad_layout, layout_of(2, true));
}

std::vector<Down> ready_with(Sim& s, int r, uint64_t t, uint64_t digest) {
  Event e;
  e.kind = Event::Kind::kReady;
  e.from = r;
  e.step = t;
  e.count = 8;
  e.digest = digest;
  return s.c.handle(e, s.now);
}

TEST(Coordinator, EqualDigestsDecideAsUsual) {
  Sim s(base(3, 2));
  EXPECT_TRUE(ready_with(s, 0, 0, 0xabc).empty());
  auto d = of(ready_with(s, 1, 0, 0xabc), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.status, Status::kOk);
  // A READY without a digest is compared with nothing.
  EXPECT_TRUE(of(s.ready(2, 0), K::kFatal).empty());
  EXPECT_FALSE(s.c.stopped());
}

TEST(Coordinator, DifferentDigestsForOneStepStopTheJobNamingBothRanks) {
  Sim s(base(4, 3));
  ready_with(s, 3, 5, 0x1111);
  auto a = ready_with(s, 1, 5, 0x2222);
  auto f = of(a, K::kFatal);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].reason.find("replicas drifted"), std::string::npos) << f[0].reason;
  EXPECT_NE(f[0].reason.find("step 5 rank 3 has parameter checksum 0000000000001111"),
            std::string::npos)
      << f[0].reason;
  EXPECT_NE(f[0].reason.find("rank 1 has 0000000000002222"), std::string::npos) << f[0].reason;
  EXPECT_TRUE(of(a, K::kDecide).empty());
  EXPECT_TRUE(s.c.stopped());
}

TEST(Coordinator, LateReadyWithAnotherDigestStillStopsTheJob) {
  Sim s(base(3, 2));
  ready_with(s, 0, 0, 7);
  ASSERT_EQ(of(ready_with(s, 1, 0, 7), K::kDecide).size(), 1u);
  auto f = of(ready_with(s, 2, 0, 8), K::kFatal);  // after the decision: still compared
  ASSERT_EQ(f.size(), 1u);
  EXPECT_TRUE(s.c.stopped());
}

namespace wire = collectives::qwire;

TEST(QuorumWire, RoundTripsEveryMessage) {
  const int world = 11;
  Event e;
  e.from = 7;
  e.step = 123456789;
  e.count = 42;
  e.completed = 99;
  e.attempt = 3;
  e.have = true;
  e.suspect = 4;
  auto up = encode_as(world, Up::Kind::kReport, e);
  ASSERT_EQ(up.size(), wire::kUpBytes);
  Up::Kind type;
  Event back = decode_as(up.data(), up.size(), world, 7, &type);
  EXPECT_EQ(type, Up::Kind::kReport);
  EXPECT_EQ(back.kind, Event::Kind::kReport);
  EXPECT_EQ(back.step, e.step);
  EXPECT_EQ(back.completed, 99);
  EXPECT_EQ(back.attempt, 3u);
  EXPECT_TRUE(back.have);

  Down m;
  m.kind = Down::Kind::kDecide;
  m.decide.step = 77;
  m.decide.attempt = 2;
  m.decide.epoch = 5;
  m.decide.contributors = {0, 3, 10};
  m.decide.needers = {4};
  m.decide.source = 3;
  m.decide.quorum = 3;
  m.decide.settled = 75;
  m.decide.offsets_us.assign(world, -1);
  m.decide.offsets_us[3] = 1500;
  auto buf = wire::encode_down(world, m);
  ASSERT_LE(buf.size(), wire::down_capacity(world));
  auto d = wire::decode_down(buf.data(), buf.size(), world, 0);
  EXPECT_EQ(d.kind, Down::Kind::kDecide);
  EXPECT_EQ(d.decide.contributors, m.decide.contributors);
  EXPECT_EQ(d.decide.needers, m.decide.needers);
  EXPECT_EQ(d.decide.source, 3);
  EXPECT_EQ(d.decide.settled, 75);
  EXPECT_EQ(d.decide.offsets_us, m.decide.offsets_us);

  Down v;
  v.kind = Down::Kind::kView;
  v.view.epoch = 9;
  v.view.members = {0, 1, 2, 5};
  v.left = {{3, Why::kSilent, 812.5}, {4, Why::kUnreachable, 12}, {1, Why::kBehind, 3}};
  buf = wire::encode_down(world, v);
  ASSERT_LE(buf.size(), wire::down_capacity(world));
  auto vb = wire::decode_down(buf.data(), buf.size(), world, 0);
  EXPECT_EQ(vb.view.members, v.view.members);
  ASSERT_EQ(vb.left.size(), 3u);
  EXPECT_EQ(vb.left[0].silent_ms, 812.5);
  EXPECT_EQ(vb.left[1].why, Why::kUnreachable);
  EXPECT_EQ(vb.left[2].why, Why::kBehind);

  Down f;
  f.kind = Down::Kind::kFatal;
  f.reason = std::string(5000, 'x');  // cut to the limit
  buf = wire::encode_down(world, f);
  ASSERT_LE(buf.size(), wire::down_capacity(world));
  EXPECT_EQ(wire::decode_down(buf.data(), buf.size(), world, 0).reason.size(), wire::kMaxFatalText);
}

TEST(QuorumWire, ReadyDigestAndShardValuesRoundTrip) {
  const int world = 6;
  Event e;
  e.from = 4;
  e.step = 31;
  e.count = 100;
  e.layout = layout_of(4, true);
  auto plain = encode_as(world, Up::Kind::kReady, e);
  EXPECT_EQ(plain.size(), wire::kUpBytes);
  Up::Kind type;
  Event plain_back = decode_as(plain.data(), plain.size(), world, 4, &type);
  EXPECT_FALSE(plain_back.digest);
  EXPECT_EQ(plain_back.layout, layout_of(4, true));
  EXPECT_EQ(plain_back.attempt, 0u);
  e.digest = 0xfedcba9876543210ull;
  auto with = encode_as(world, Up::Kind::kReady, e);
  ASSERT_EQ(with.size(), wire::kUpBytes + 8);
  Event back = decode_as(with.data(), with.size(), world, 4, &type);
  EXPECT_EQ(type, Up::Kind::kReady);
  ASSERT_TRUE(back.digest);
  EXPECT_EQ(*back.digest, 0xfedcba9876543210ull);

  // quorum "auto" estimating the noise scale: + 16 bytes of norms, after the digest if any
  // (none for the first step's result: NaN on the wire).
  e.grad_sq = 2.5;
  e.prev_mean_sq = 0.75;
  auto both = encode_as(world, Up::Kind::kReady, e);
  ASSERT_EQ(both.size(), wire::kUpBytes + 24);
  ASSERT_LE(both.size(), wire::up_capacity(world));
  back = decode_as(both.data(), both.size(), world, 4, &type);
  ASSERT_TRUE(back.digest && back.grad_sq && back.prev_mean_sq);
  EXPECT_EQ(*back.digest, 0xfedcba9876543210ull);
  EXPECT_EQ(*back.grad_sq, 2.5);
  EXPECT_EQ(*back.prev_mean_sq, 0.75);
  e.digest.reset();
  e.prev_mean_sq.reset();
  auto norms = encode_as(world, Up::Kind::kReady, e);
  ASSERT_EQ(norms.size(), wire::kUpBytes + 16);
  back = decode_as(norms.data(), norms.size(), world, 4, &type);
  EXPECT_FALSE(back.digest);
  ASSERT_TRUE(back.grad_sq);
  EXPECT_EQ(*back.grad_sq, 2.5);
  EXPECT_FALSE(back.prev_mean_sq);
  for (double bad : {-1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    e.grad_sq = bad;
    auto b = encode_as(world, Up::Kind::kReady, e);
    EXPECT_THROW(decode_as(b.data(), b.size(), world, 4, &type), ProtocolError) << bad;
  }

  Event sh;
  sh.from = 4;
  sh.step = 600;  // the report's key
  sh.attempt = 2;  // part
  sh.count = 5;    // parts
  sh.values = {1.5, 4096, 9999.25};
  auto buf = encode_as(world, Up::Kind::kShard, sh);
  ASSERT_LE(buf.size(), wire::up_capacity(world));
  back = decode_as(buf.data(), buf.size(), world, 4, &type);
  EXPECT_EQ(type, Up::Kind::kShard);
  {
    // A sign of life for the coordinator: rank 4, silent but for the SHARD, stays a member.
    Sim s(base(world, 3));
    s.run(milliseconds(400), {0, 1, 2, 3, 5});
    s.c.handle(back, s.now);
    EXPECT_TRUE(of(s.run(milliseconds(400), {0, 1, 2, 3, 5}), K::kView).empty());
    EXPECT_FALSE(of(s.run(milliseconds(200), {0, 1, 2, 3, 5}), K::kView).empty());
  }
  EXPECT_EQ(back.step, 600u);
  EXPECT_EQ(back.attempt, 2u);
  EXPECT_EQ(back.count, 5u);
  EXPECT_EQ(back.values, sh.values);
}

TEST(QuorumWire, RejectsMalformedDigestsAndShards) {
  const int world = 4;
  Up::Kind type;
  Event e;
  e.from = 1;
  e.digest = 5;
  auto r = encode_as(world, Up::Kind::kReady, e);
  EXPECT_THROW(decode_as(r.data(), r.size() - 4, world, 1, &type), ProtocolError);
  auto hb = encode_as(world, Up::Kind::kHeartbeat, e);
  hb.resize(hb.size() + 8);  // only a READY carries a digest
  EXPECT_THROW(decode_as(hb.data(), hb.size(), world, 1, &type), ProtocolError);

  Event sh;
  sh.from = 1;
  sh.attempt = 0;
  sh.count = 2;
  sh.values = {1, 2};
  auto ok = encode_as(world, Up::Kind::kShard, sh);
  EXPECT_NO_THROW(decode_as(ok.data(), ok.size(), world, 1, &type));
  EXPECT_THROW(decode_as(ok.data(), ok.size() - 3, world, 1, &type), ProtocolError);
  auto none = ok;
  none.resize(wire::kUpBytes);  // no values
  EXPECT_THROW(decode_as(none.data(), none.size(), world, 1, &type), ProtocolError);
  auto many = ok;
  many.resize(wire::kUpBytes + 8 * (wire::kMaxShardValues + 1));
  EXPECT_THROW(decode_as(many.data(), many.size(), world, 1, &type), ProtocolError);
  sh.attempt = 2;  // part 2 of 2
  auto part = encode_as(world, Up::Kind::kShard, sh);
  EXPECT_THROW(decode_as(part.data(), part.size(), world, 1, &type), ProtocolError);
  sh.attempt = 0;
  sh.count = 5;  // more parts than ranks
  part = encode_as(world, Up::Kind::kShard, sh);
  EXPECT_THROW(decode_as(part.data(), part.size(), world, 1, &type), ProtocolError);
  sh.count = 2;
  sh.values = {1, std::nan("")};
  part = encode_as(world, Up::Kind::kShard, sh);
  EXPECT_THROW(decode_as(part.data(), part.size(), world, 1, &type), ProtocolError);
}

TEST(QuorumWire, RejectsMalformedMessages) {
  const int world = 4;
  Event e;
  e.from = 2;
  auto up = encode_as(world, Up::Kind::kReady, e);
  Up::Kind type;
  EXPECT_THROW(decode_as(up.data(), up.size() - 1, world, 2, &type), ProtocolError);
  EXPECT_THROW(decode_as(up.data(), up.size(), world, 1, &type), ProtocolError);  // rank
  EXPECT_THROW(decode_as(up.data(), up.size(), 5, 2, &type), ProtocolError);      // world
  auto bad = up;
  bad[6] = 9;  // type
  EXPECT_THROW(decode_as(bad.data(), bad.size(), world, 2, &type), ProtocolError);
  bad = up;
  bad[4] = 1;  // version
  EXPECT_THROW(decode_as(bad.data(), bad.size(), world, 2, &type), ProtocolError);

  Down m;
  m.kind = Down::Kind::kDecide;
  m.decide.contributors = {0, 1};
  m.decide.offsets_us.assign(world, -1);
  auto buf = wire::encode_down(world, m);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size() - 8, world, 0), ProtocolError);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), 12, 0), ProtocolError);
  auto b2 = buf;
  b2[0] ^= 1;  // magic
  EXPECT_THROW(wire::decode_down(b2.data(), b2.size(), world, 0), ProtocolError);
  m.decide.contributors.clear();  // OK without contributors
  buf = wire::encode_down(world, m);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
  m.decide.attempt = 1;  // a forward may name none (S(t) unknown to a new coordinator)
  m.decide.source = 1;
  buf = wire::encode_down(world, m);
  EXPECT_TRUE(wire::decode_down(buf.data(), buf.size(), world, 0).decide.contributors.empty());
  m.decide.attempt = 0;
  m.decide.contributors = {1};
  m.decide.source = 7;  // source out of range
  buf = wire::encode_down(world, m);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
}

}  // namespace
}  // namespace qring::testing
