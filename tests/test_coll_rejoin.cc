// Rejoin in the coordinator's pure state machine (collectives/quorum/coordinator.h) and the
// wire codec of its messages: a new incarnation of a rank is admitted once every member has
// reconnected to it and it has reached them all, at the next step to be decided, with the
// coordinator as the donor of its state. Simulated clock, no threads, no sleeps.
#include <gtest/gtest.h>

#include "collectives/quorum/coordinator.h"
#include "collectives/quorum/errors.h"
#include "collectives/quorum/join_agent.h"
#include "collectives/quorum/wire.h"
#include "net/base/error.h"
#include "net/rendezvous/store.h"
#include "wire_harness.h"

namespace qring::testing {
namespace {

using namespace collectives::qproto;
namespace wire = collectives::qwire;
using K = Down::Kind;
using std::chrono::milliseconds;

std::vector<Down> of(const std::vector<Down>& v, K k) {
  std::vector<Down> r;
  for (auto& a : v)
    if (a.kind == k) r.push_back(a);
  return r;
}

struct Sim {
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c;
  explicit Sim(Config cfg) : c(cfg, Time{} + std::chrono::hours(1)) {
    for (int r = 0; r < cfg.world; ++r) beat(r);
  }
  std::vector<Down> send(Event e) { return c.handle(e, now); }
  std::vector<Down> ready(int r, uint64_t t, int64_t completed = -1) {
    Event e;
    e.kind = Event::Kind::kReady;
    e.from = r;
    e.step = t;
    e.count = 8;
    e.completed = completed;
    return send(e);
  }
  std::vector<Down> beat(int r, int64_t completed = -1) {
    Event e;
    e.kind = Event::Kind::kHeartbeat;
    e.from = r;
    e.completed = completed;
    return send(e);
  }
  std::vector<Down> join(int r, uint32_t inc) {
    Event e;
    e.kind = Event::Kind::kJoin;
    e.from = r;
    e.count = inc;
    return send(e);
  }
  std::vector<Down> hello(int r, uint32_t inc) {
    Event e;
    e.kind = Event::Kind::kHello;
    e.from = r;
    e.count = inc;
    return send(e);
  }
  std::vector<Down> accept(int member, int joiner, uint32_t inc) {
    Event e;
    e.kind = Event::Kind::kAccept;
    e.from = member;
    e.suspect = joiner;
    e.count = inc;
    return send(e);
  }
  std::vector<Down> report(int r, uint64_t t, uint32_t attempt, bool have, bool absent) {
    Event e;
    e.kind = Event::Kind::kReport;
    e.from = r;
    e.step = t;
    e.attempt = attempt;
    e.have = have;
    e.absent = absent;
    return send(e);
  }
  // The clock runs with `alive` heartbeating every 10 ms (completed: their last step).
  std::vector<Down> run(milliseconds d, const std::vector<int>& alive, int64_t completed = -1) {
    std::vector<Down> all;
    for (auto end = now + d; now < end;) {
      now += milliseconds(10);
      for (int r : alive) {
        auto a = beat(r, completed);
        all.insert(all.end(), a.begin(), a.end());
      }
      auto a = send(Event{});
      all.insert(all.end(), a.begin(), a.end());
    }
    return all;
  }
  // Steps [from, to) decided among `who`.
  void steps(uint64_t from, uint64_t to, const std::vector<int>& who) {
    for (uint64_t t = from; t < to; ++t)
      for (int r : who) ready(r, t, int64_t(t) - 1);
  }
};

Config base(int world, int quorum) {
  Config c;
  c.world = world;
  c.quorum = quorum;
  c.count = 8;
  c.evict = milliseconds(500);
  c.deadline = milliseconds(5000);
  c.join_timeout = milliseconds(5000);
  return c;
}

// W = 4, quorum 3, rank 3 gone (silent) and steps 0..4 decided without it.
Sim lost_rank3(Config cfg = base(4, 3)) {
  Sim s(cfg);
  auto a = s.run(milliseconds(600), {1, 2});
  EXPECT_EQ(of(a, K::kView).size(), 1u);
  s.steps(0, 5, {0, 1, 2});
  return s;
}

TEST(CoordinatorRejoin, AdmittedOnceEveryMemberReconnectedAndTheJoinerReachedThem) {
  Sim s = lost_rank3();
  auto a = s.join(3, 1);
  auto j = of(a, K::kJoining);
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0].joiner, 3);
  EXPECT_EQ(j[0].incarnation, 1u);
  EXPECT_EQ(s.c.joining(), 1u);
  // Not before every member of the view accepted and the joiner said hello.
  EXPECT_TRUE(of(s.accept(0, 3, 1), K::kView).empty());
  EXPECT_TRUE(of(s.accept(1, 3, 1), K::kView).empty());
  EXPECT_TRUE(of(s.hello(3, 1), K::kView).empty());
  a = s.accept(2, 3, 1);
  auto v = of(a, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].view.epoch, 2u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(v[0].left.empty());
  ASSERT_EQ(v[0].joined.size(), 1u);
  EXPECT_EQ(v[0].joined[0], (Joined{3, 1, 5, 0}));  // at the next step, state from rank 0
  EXPECT_EQ(s.c.joining(), 0u);
  EXPECT_EQ(s.c.incarnation(3), 1u);
  // It takes part from step 5 on: a step among the other three is decided as before, and it
  // is outside S(5) (the result goes to it).
  s.ready(0, 5);
  s.ready(1, 5);
  auto d = of(s.ready(2, 5), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.epoch, 2u);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 2}));
}

// Rank 3's incarnation 1 admitted: every member accepted it and it said HELLO.
void admit_rank3(Sim& s) {
  s.join(3, 1);
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);
  ASSERT_EQ(of(s.hello(3, 1), K::kView).size(), 1u);
}

// The coordinator cannot see when its VIEW reaches an admitted joiner (over tcp a connection
// may still be completing, on a loaded host its engine may wait for a CPU): until the new
// incarnation speaks in the view, the start-up limit applies, not evict; from its first
// message on, evict + a heartbeat period as for every member.
TEST(CoordinatorRejoin, AnAdmittedJoinerHasTheStartUpLimitUntilItSpeaksInTheView) {
  Sim s = lost_rank3();
  ASSERT_NO_FATAL_FAILURE(admit_rank3(s));
  EXPECT_TRUE(of(s.run(milliseconds(1500), {1, 2}, 4), K::kView).empty());
  EXPECT_TRUE(s.c.view().has(3));
  s.beat(3, 4);
  auto v = of(s.run(milliseconds(600), {1, 2}, 4), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left.at(0).rank, 3);
  EXPECT_EQ(v[0].left.at(0).why, Why::kSilent);
  EXPECT_LT(v[0].left.at(0).silent_ms, 600.0);
}

// A joiner that never speaks after its admission (it died before the VIEW reached it, and no
// store witnessed it) leaves once the start-up limit passed: nothing waits for it for good.
TEST(CoordinatorRejoin, AnAdmittedJoinerThatNeverSpeaksLeavesAfterTheStartUpLimit) {
  Sim s = lost_rank3();
  ASSERT_NO_FATAL_FAILURE(admit_rank3(s));
  EXPECT_TRUE(of(s.run(milliseconds(5000), {1, 2}, 4), K::kView).empty());
  auto v = of(s.run(milliseconds(700), {1, 2}, 4), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left.at(0).rank, 3);
  EXPECT_EQ(v[0].left.at(0).why, Why::kSilent);
}

TEST(CoordinatorRejoin, ARestartedRankStillInTheViewLeavesAtOnce) {
  Sim s(base(4, 3));
  s.steps(0, 3, {0, 1, 2, 3});
  // Rank 2 died and came back within the evict time: its old incarnation goes first.
  auto a = s.join(2, 1);
  ASSERT_GE(a.size(), 2u);
  EXPECT_EQ(a.front().kind, K::kView);
  EXPECT_EQ(a.front().view.members, (std::vector<int>{0, 1, 3}));
  ASSERT_EQ(a.front().left.size(), 1u);
  EXPECT_EQ(a.front().left[0].why, Why::kRestarted);
  // Its unsettled steps are recovered as after any loss; then every member reconnects.
  EXPECT_EQ(of(a, K::kRecover).size(), a.size() - 2);
  EXPECT_EQ(a.back().kind, K::kJoining);
  EXPECT_EQ(a.back().joiner, 2);
}

TEST(CoordinatorRejoin, StaleJoinsAndMismatchedIncarnationsAreIgnored) {
  Sim s = lost_rank3();
  ASSERT_EQ(of(s.join(3, 2), K::kJoining).size(), 1u);
  EXPECT_TRUE(s.join(3, 2).empty());  // found again: known
  EXPECT_TRUE(s.join(3, 1).empty());  // an older incarnation
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);  // accepts for another incarnation
  EXPECT_TRUE(of(s.hello(3, 1), K::kView).empty());
  for (int m : {0, 1, 2}) s.accept(m, 3, 2);
  EXPECT_TRUE(of(s.hello(3, 1), K::kView).empty());
  auto v = of(s.hello(3, 2), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].joined[0].incarnation, 2u);
  // A later lower or equal incarnation changes nothing.
  EXPECT_TRUE(of(s.join(3, 2), K::kView).empty());
  EXPECT_TRUE(of(s.join(3, 2), K::kJoining).empty());
}

TEST(CoordinatorRejoin, AJoinThatDoesNotCompleteIsAbandoned) {
  Sim s = lost_rank3();
  s.join(3, 1);
  s.accept(0, 3, 1);
  s.run(milliseconds(4990), {1, 2}, 4);
  EXPECT_EQ(s.c.joining(), 1u);
  s.run(milliseconds(30), {1, 2}, 4);
  EXPECT_EQ(s.c.joining(), 0u);
  // Late messages of the abandoned join admit nobody.
  s.accept(1, 3, 1);
  s.accept(2, 3, 1);
  EXPECT_TRUE(of(s.hello(3, 1), K::kView).empty());
  // Found again (a new incarnation), it can still come back.
  EXPECT_EQ(of(s.join(3, 2), K::kJoining).size(), 1u);
}

TEST(CoordinatorRejoin, AMemberLostDuringTheJoinIsNotWaitedFor) {
  Sim s = lost_rank3(base(4, 2));
  s.join(3, 1);
  s.accept(0, 3, 1);
  s.accept(1, 3, 1);
  s.hello(3, 1);
  // Rank 2 never accepts: it falls silent and leaves; the join completes without it.
  auto a = s.run(milliseconds(600), {1}, 4);
  auto v = of(a, K::kView);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 1}));
  EXPECT_TRUE(v[0].joined.empty());
  // Two of three is still a majority of the view before it.
  EXPECT_EQ(v[1].view.members, (std::vector<int>{0, 1, 3}));
  ASSERT_EQ(v[1].joined.size(), 1u);
  EXPECT_EQ(v[1].joined[0].rank, 3);
}

TEST(CoordinatorRejoin, ACatchingUpJoinerDoesNotCountForAFractionalQuorum) {
  Config cfg = base(4, 0);
  cfg.fraction = 1.0;  // every live member
  Sim s = lost_rank3(cfg);
  s.join(3, 1);
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);
  ASSERT_EQ(of(s.hello(3, 1), K::kView).size(), 1u);
  // Step 5: rank 3 applies the results it missed before it contributes; the three decide.
  s.ready(0, 5);
  s.ready(1, 5);
  auto d = of(s.ready(2, 5), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.quorum, 3);
  // Its first READY (late for step 5) ends the catching up: step 6 needs all four.
  EXPECT_TRUE(of(s.ready(3, 5, 4), K::kDecide).empty());
  s.ready(0, 6);
  s.ready(1, 6);
  EXPECT_TRUE(of(s.ready(2, 6), K::kDecide).empty());
  d = of(s.ready(3, 6), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.quorum, 4);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 1, 2, 3}));
}

TEST(CoordinatorRejoin, MissedStepsDoNotEvictAJoinerBeforeItContributes) {
  Config cfg = base(4, 3);
  cfg.evict_steps = 2;
  Sim s = lost_rank3(cfg);
  s.join(3, 1);
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);
  ASSERT_EQ(of(s.hello(3, 1), K::kView).size(), 1u);
  std::vector<Down> all;
  for (uint64_t t = 5; t < 9; ++t)
    for (int r : {0, 1, 2}) {
      auto a = s.ready(r, t);
      all.insert(all.end(), a.begin(), a.end());
    }
  EXPECT_TRUE(of(all, K::kView).empty());
  // Once it contributed (late here), missing two steps evicts it as any member.
  s.ready(3, 8, 7);
  all.clear();
  for (uint64_t t = 9; t < 11; ++t)
    for (int r : {0, 1, 2}) {
      auto a = s.ready(r, t);
      all.insert(all.end(), a.begin(), a.end());
    }
  auto a = s.send(Event{});  // evictions decided with a step take effect at the next tick
  all.insert(all.end(), a.begin(), a.end());
  auto v = of(all, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kMissedSteps);
}

// A joiner's lag (quorum.max_lag) counts only once its state arrived (it completed its join
// step): waiting for the donor's transfer is not being behind. From then on it is a member as
// any other: a rank that stays behind for more than max_lag leaves "behind".
TEST(CoordinatorRejoin, AJoinersLagCountsFromItsStateNotFromItsAdmission) {
  Config cfg = base(4, 2);
  cfg.max_lag = milliseconds(300);
  Sim s = lost_rank3(cfg);
  s.join(3, 1);
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);
  ASSERT_EQ(of(s.hello(3, 1), K::kView).size(), 1u);  // admitted at step 5
  std::vector<Down> all;
  auto steps = [&](uint64_t from, uint64_t to, int64_t completed3) {
    for (uint64_t t = from; t < to; ++t) {
      s.now += milliseconds(10);
      for (int r : {0, 1, 2}) {
        auto a = s.ready(r, t, int64_t(t) - 1);
        all.insert(all.end(), a.begin(), a.end());
      }
      auto a = s.beat(3, completed3);
      all.insert(all.end(), a.begin(), a.end());
    }
  };
  steps(5, 100, 4);  // 950 ms without its state: not behind
  EXPECT_TRUE(of(all, K::kView).empty());
  steps(100, 125, 5);  // its state arrived, step 5 done: 250 ms behind, within max_lag
  EXPECT_TRUE(of(all, K::kView).empty());
  steps(125, 140, 5);  // 400 ms
  auto v = of(all, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kBehind);
}

TEST(CoordinatorRejoin, RecoveryOfAStepBeforeTheJoinDoesNotWaitForTheJoiner) {
  Config cfg = base(5, 3);
  Sim s(cfg);
  s.run(milliseconds(600), {1, 2, 3});  // rank 4 leaves
  s.steps(0, 5, {0, 1, 2, 3});
  // Step 5 decided among 0, 1, 2 (rank 3 late) and not completed by everyone; then rank 4
  // comes back and is admitted at step 6.
  s.ready(0, 5, 4);
  s.ready(1, 5, 4);
  ASSERT_EQ(of(s.ready(2, 5, 4), K::kDecide).size(), 1u);
  s.ready(3, 5, 4);
  s.join(4, 1);
  for (int m : {0, 1, 2, 3}) s.accept(m, 4, 1);
  auto v = of(s.hello(4, 1), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].joined[0].step, 6u);
  // Rank 1 dies before completing step 5: step 5 is recovered among those who were there.
  auto a = s.run(milliseconds(600), {2, 3, 4}, 4);
  auto rec = of(a, K::kRecover);
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0].step, 5u);
  s.report(0, 5, rec[0].attempt, false, false);
  s.report(2, 5, rec[0].attempt, false, false);
  // The joiner reports itself absent (or says nothing): the recovery does not wait for it.
  auto d = of(s.report(3, 5, rec[0].attempt, false, false), K::kDecide);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].decide.step, 5u);
  EXPECT_GT(d[0].decide.attempt, 0u);
  EXPECT_EQ(d[0].decide.contributors, (std::vector<int>{0, 2, 3}));
  EXPECT_TRUE(std::find(d[0].decide.needers.begin(), d[0].decide.needers.end(), 4) ==
              d[0].decide.needers.end());
}

TEST(CoordinatorRejoin, ANewCoordinatorKnowsWhoRejoinedBefore) {
  Config cfg = base(4, 3);
  cfg.self = 1;
  View v{3, {1, 2, 3}};
  std::vector<Down> out;
  Coordinator c(cfg, Time{}, v, {-1, 9, 9, 9}, {}, out, {0, 0, 1, 0});
  EXPECT_EQ(c.incarnation(2), 1u);
  Event e;
  e.kind = Event::Kind::kJoin;
  e.from = 0;  // the old coordinator's new incarnation: not known yet
  e.count = 1;
  EXPECT_EQ(of(c.handle(e, Time{}), K::kJoining).size(), 1u);
}

// A joiner whose state did not come says LEAVE (issue 42, case 4): it leaves the next view at
// once ("left"), not an evict period later, and a later join is admitted without waiting for it.
TEST(CoordinatorRejoin, AJoinerThatLeavesIsDroppedAtOnceAndLaterJoinsGoOn) {
  Sim s = lost_rank3();
  s.join(3, 1);
  for (int m : {0, 1, 2}) s.accept(m, 3, 1);
  ASSERT_EQ(of(s.hello(3, 1), K::kView).size(), 1u);
  ASSERT_TRUE(s.c.view().has(3));
  Event leave;
  leave.kind = Event::Kind::kLeave;
  leave.from = 3;
  auto v = of(s.send(leave), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(v[0].left.size(), 1u);
  EXPECT_EQ(v[0].left[0].rank, 3);
  EXPECT_EQ(v[0].left[0].why, Why::kLeft);
  EXPECT_STREQ(to_string(Why::kLeft), "left");
  // Its next incarnation is admitted by the members that are left.
  s.join(3, 2);
  for (int m : {0, 1, 2}) s.accept(m, 3, 2);
  auto b = of(s.hello(3, 2), K::kView);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].joined.at(0).incarnation, 2u);
  EXPECT_TRUE(s.c.view().has(3));
}

// Two joins at once (issue 42, case 4 over tcp: rank 1 rejoined in-process while rank 0's
// restarted process joined too). W = 5, ranks 1 and 3 gone: rank 3 is admitted while rank 1's
// join is under way. Rank 3,
// a member now, must reconnect to rank 1 and accept it, so the coordinator tells it the join
// again right after the VIEW; rank 1 is admitted once rank 3 accepted it. Before, nobody told
// rank 3, rank 1 waited for its acceptance until join_timeout and the job went on without it.
TEST(CoordinatorRejoin, AJoinUnderWayWhenAnotherIsAdmittedIsToldToTheNewMember) {
  Sim s(base(5, 2));
  auto a = s.run(milliseconds(600), {2, 4});
  ASSERT_EQ(s.c.view().members, (std::vector<int>{0, 2, 4}));
  s.join(1, 1);
  for (int m : {0, 2, 4}) s.accept(m, 1, 1);
  s.join(3, 1);
  for (int m : {0, 2, 4}) s.accept(m, 3, 1);
  a = s.hello(3, 1);
  auto v = of(a, K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 2, 3, 4}));
  auto j = of(a, K::kJoining);
  ASSERT_EQ(j.size(), 1u) << "the new member was not told of rank 1's join";
  EXPECT_EQ(j[0].joiner, 1);
  EXPECT_EQ(j[0].incarnation, 1u);
  auto at = [&](K k) {
    return std::find_if(a.begin(), a.end(), [&](const Down& d) { return d.kind == k; });
  };
  EXPECT_LT(at(K::kView), at(K::kJoining)) << "the JOINING must follow the VIEW that made it a member";
  // Rank 1 reached every member it knew; not admitted before rank 3 accepted it.
  EXPECT_TRUE(of(s.hello(1, 1), K::kView).empty());
  v = of(s.accept(3, 1, 1), K::kView);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].view.members, (std::vector<int>{0, 1, 2, 3, 4}));
  ASSERT_EQ(v[0].joined.size(), 1u);
  EXPECT_EQ(v[0].joined[0].rank, 1);
}

// A rank restarted into a job that was lost or finished meanwhile is refused from the store's
// records alone (qring-train checks them before it loads its data), naming why; the records of
// another quorum all-reduce (instance) are not this one's.
TEST(JoinEnd, ARankRestartedIntoAnEndedJobIsRefusedFromTheStoresRecords) {
  using collectives::read_job_end;
  using collectives::refuse_join_to_ended_job;
  net::MemoryStore store;
  EXPECT_NO_THROW(refuse_join_to_ended_job(read_job_end(store, 1, 4), 2));
  store.set(collectives::join_lost_key(1, 3), "rank 3: the job stops: only 1 of 4 ranks are left");
  EXPECT_NO_THROW(refuse_join_to_ended_job(read_job_end(store, 2, 4), 2));
  try {
    refuse_join_to_ended_job(read_job_end(store, 1, 4), 2);
    ADD_FAILURE() << "a lost job was not refused";
  } catch (const collectives::QuorumLost& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2: the job was lost before this incarnation could "
                                         "rejoin it (rank 3: the job stops: only 1 of 4"),
              std::string::npos)
        << e.what();
  }
  net::MemoryStore finished;
  finished.set(collectives::join_done_key(1, 0), "");
  EXPECT_THROW(refuse_join_to_ended_job(read_job_end(finished, 1, 4), 1), collectives::JobOver);
}

TEST(QuorumWireRejoin, JoinMessagesRoundTrip) {
  const int world = 6;
  Event e;
  e.from = 5;
  e.count = 3;
  auto up = encode_as(world, Up::Kind::kHello, e);
  Up::Kind type;
  Event back = decode_as(up.data(), up.size(), world, 5, &type);
  EXPECT_EQ(type, Up::Kind::kHello);
  EXPECT_EQ(back.kind, Event::Kind::kHello);
  EXPECT_EQ(back.count, 3u);
  e.from = 1;
  e.suspect = 5;
  up = encode_as(world, Up::Kind::kAccept, e);
  back = decode_as(up.data(), up.size(), world, 1, &type);
  EXPECT_EQ(back.kind, Event::Kind::kAccept);
  EXPECT_EQ(back.suspect, 5);
  e.absent = true;
  up = encode_as(world, Up::Kind::kReport, e);
  back = decode_as(up.data(), up.size(), world, 1, &type);
  EXPECT_TRUE(back.absent);
  EXPECT_FALSE(back.have);
  // A joiner's WARM to a member (it opens the connection): decoded, and nothing the
  // coordinator's state machine acts on.
  Event warm;
  warm.from = 3;
  up = encode_as(world, Up::Kind::kWarm, warm);
  back = decode_as(up.data(), up.size(), world, 3, &type);
  EXPECT_EQ(type, Up::Kind::kWarm);
  Sim s(base(world, 3));
  EXPECT_TRUE(s.send(back).empty());
  // A joiner's LEAVE.
  Event leave;
  leave.from = 4;
  up = encode_as(world, Up::Kind::kLeave, leave);
  back = decode_as(up.data(), up.size(), world, 4, &type);
  EXPECT_EQ(type, Up::Kind::kLeave);
  EXPECT_EQ(back.kind, Event::Kind::kLeave);

  Down j;
  j.kind = Down::Kind::kJoining;
  j.joiner = 4;
  j.incarnation = 7;
  auto buf = wire::encode_down(world, j);
  auto jb = wire::decode_down(buf.data(), buf.size(), world, 0);
  EXPECT_EQ(jb.kind, Down::Kind::kJoining);
  EXPECT_EQ(jb.joiner, 4);
  EXPECT_EQ(jb.incarnation, 7u);

  Down v;
  v.kind = Down::Kind::kView;
  v.view = {4, {0, 1, 2, 4}};
  v.left = {{3, Why::kRestarted, 20}, {5, Why::kLeft, 3}};
  v.joined = {{4, 2, 1234, 0}};
  buf = wire::encode_down(world, v);
  ASSERT_LE(buf.size(), wire::down_capacity(world));
  auto vb = wire::decode_down(buf.data(), buf.size(), world, 0);
  EXPECT_EQ(vb.view.members, v.view.members);
  ASSERT_EQ(vb.left.size(), 2u);
  EXPECT_EQ(vb.left[0].why, Why::kRestarted);
  EXPECT_EQ(vb.left[1].why, Why::kLeft);
  ASSERT_EQ(vb.joined.size(), 1u);
  EXPECT_EQ(vb.joined[0], (Joined{4, 2, 1234, 0}));
  // A full view of departures and joins fits the receive buffer.
  Down big;
  big.kind = Down::Kind::kView;
  big.view = {1, {0, 1, 2, 3, 4, 5}};
  for (int r = 0; r < world; ++r) big.left.push_back({r, Why::kSilent, 1});
  for (int r = 1; r < world; ++r) big.joined.push_back({r, 1, 1, 0});
  EXPECT_LE(wire::encode_down(world, big).size(), wire::down_capacity(world));
}

TEST(QuorumWireRejoin, MalformedJoinMessagesAreRejected) {
  const int world = 4;
  Event e;
  e.from = 1;
  e.suspect = 1;  // accepts itself
  e.count = 1;
  auto up = encode_as(world, Up::Kind::kAccept, e);
  Up::Kind type;
  EXPECT_THROW(decode_as(up.data(), up.size(), world, 1, &type), ProtocolError);
  e.suspect = 2;
  e.count = 0;  // incarnation 0 never rejoins
  up = encode_as(world, Up::Kind::kAccept, e);
  EXPECT_THROW(decode_as(up.data(), up.size(), world, 1, &type), ProtocolError);
  up = encode_as(world, Up::Kind::kHello, e);
  EXPECT_THROW(decode_as(up.data(), up.size(), world, 1, &type), ProtocolError);
  e.count = 1;
  up = encode_as(world, Up::Kind::kWarm, e);
  up[6] = char(uint8_t(Up::Kind::kWarm) + 1);  // the type byte: no such type
  EXPECT_THROW(decode_as(up.data(), up.size(), world, 1, &type), ProtocolError);

  Down v;
  v.kind = Down::Kind::kView;
  v.view = {2, {0, 1, 3}};
  v.joined = {{2, 1, 5, 0}};  // the joiner is not a member of the view
  auto buf = wire::encode_down(world, v);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
  v.joined = {{3, 1, 5, 2}};  // nor is its donor
  buf = wire::encode_down(world, v);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
  v.joined = {{3, 0, 5, 0}};  // incarnation 0
  buf = wire::encode_down(world, v);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
  v.joined = {{3, 1, 5, 0}};
  buf = wire::encode_down(world, v);
  buf.resize(buf.size() - 1);  // truncated
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);

  Down j;
  j.kind = Down::Kind::kJoining;
  j.joiner = 9;  // out of range
  j.incarnation = 1;
  buf = wire::encode_down(world, j);
  EXPECT_THROW(wire::decode_down(buf.data(), buf.size(), world, 0), ProtocolError);
}

}  // namespace
}  // namespace qring::testing
