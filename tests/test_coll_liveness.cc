// Liveness of a quorum member as pure functions of the view and the time
// (collectives/quorum/liveness.h), the member's paced sends (outbox.h), and the engine's
// scheduling rules the quorum all-reduce relies on: an op that fails alone, an op given up,
// ops started from a pass. No threads but the engine's, no sleeps.
#include <gtest/gtest.h>

#include <atomic>

#include "coll_harness.h"
#include "collectives/engine.h"
#include "collectives/quorum/failover.h"
#include "collectives/quorum/liveness.h"
#include "collectives/quorum/outbox.h"

namespace qring::testing {
namespace {

using collectives::Clock;
using collectives::Deaths;
using collectives::Liveness;
using collectives::LivenessTimes;
using collectives::silence_limit;
using collectives::Takeover;
using collectives::TakeoverOutcome;
using collectives::qproto::View;
using std::chrono::milliseconds;

const Clock::time_point T0 = Clock::time_point{} + std::chrono::hours(1);

View view(uint64_t epoch, std::vector<int> members) {
  View v;
  v.epoch = epoch;
  v.members = std::move(members);
  return v;
}

TEST(Liveness, HeartbeatsEveryEighthOfTheEvictTimeAndAtOnceAfterAStepAtMostFourTimesAPeriod) {
  const auto t = LivenessTimes::of(milliseconds(800), milliseconds(8000));
  EXPECT_EQ(t.heartbeat, milliseconds(100));
  Liveness l(t, T0);
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(99), -1));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(100), -1));
  // A completed step: at once, but not within a quarter period of the last beat.
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(110), 5));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(126), 5));
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(200), 5));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(227), 5));
}

// A step this rank was outside of (its result came from a member): the completion goes out
// within heartbeat / 64 of the last beat (1 ms here), since no READY carries it and every member
// keeps the step's result until the coordinator knows. Once per step, and a step it reduced keeps
// the quarter-period cap.
TEST(Liveness, ACompletedStepThisRankWasOutsideOfBeatsWithinASixtyFourthOfAPeriod) {
  const auto t = LivenessTimes::of(milliseconds(800), milliseconds(8000));
  Liveness l(t, T0);
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(100), -1));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(101), 5, /*outside=*/true));
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(101), 5, /*outside=*/true));  // told already
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(101), 6, /*outside=*/true));  // too soon
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(102), 6, /*outside=*/true));
  // A step it reduced: its next READY carries it; the quarter-period cap holds.
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(103), 7));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(127), 7));
  // Nothing new: the period.
  EXPECT_FALSE(l.beat_due(T0 + milliseconds(226), 7, /*outside=*/true));
  EXPECT_TRUE(l.beat_due(T0 + milliseconds(227), 7, /*outside=*/true));
}

// A rank is lost after evict + one heartbeat period of silence (the deadline before it spoke
// once): its last message may be a heartbeat period older than a pause, so a pause shorter
// than evict never reaches the limit, wherever it falls, and 1.2 evict always does.
TEST(Liveness, APauseShorterThanEvictNeverReachesTheSilenceLimitOneOf1Point2EvictDoes) {
  const auto t = LivenessTimes::of(milliseconds(1000), milliseconds(30000));
  EXPECT_EQ(silence_limit(true, t), milliseconds(1125));
  EXPECT_EQ(silence_limit(false, t), milliseconds(30125));
  for (double factor : {0.75, 0.95, 1.2}) {
    const auto pause = milliseconds(int64_t(factor * 1000));
    // The longest silence a pause makes: its last heartbeat a whole period before it.
    const auto worst = pause + t.heartbeat, best = pause;
    if (factor < 1)
      EXPECT_LT(worst, silence_limit(true, t)) << factor;
    else
      EXPECT_GT(best, silence_limit(true, t)) << factor;
  }
  // The coordinator's silence on a member, a beat before the pause and 0.95 evict stopped.
  Liveness l(t, T0);
  l.heard_coordinator(T0);
  const auto v = view(0, {0, 1, 2, 3});
  EXPECT_EQ(l.coordinator_silence(T0 + t.heartbeat + milliseconds(950), v, 0, 1, true),
            Liveness::Silence::kNone);
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(1200), v, 0, 1, false),
            Liveness::Silence::kLost);
}

TEST(Liveness, APassHalfAnEvictTimeAfterTheLastIsAPauseAndRestartsTheSilence) {
  const auto t = LivenessTimes::of(milliseconds(400), milliseconds(8000));
  Liveness l(t, T0);
  l.heard_coordinator(T0);
  EXPECT_FALSE(l.paused(T0 + milliseconds(150)));
  EXPECT_FALSE(l.paused(T0 + milliseconds(350)));
  // Stopped for 1 s: the coordinator's silence across it counts for nothing.
  EXPECT_TRUE(l.paused(T0 + milliseconds(1350)));
  EXPECT_DOUBLE_EQ(l.silent_ms(T0 + milliseconds(1360)), 10.0);
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(1400), view(0, {0, 1, 2, 3}), 0, 1, true),
            Liveness::Silence::kNone);
}

// A rank stopped 0.8 s of every second (issue 42, case 1 at the end of a job): every pause
// starts the silence clocks over, so it never finds its coordinator silent, but the time it
// has not heard it at all (unheard_long: pauses included) passes evict after its first
// second; that makes the member look for the end of the job (rejoin.h, watch_for_end).
// Hearing the coordinator, or its goodbye, ends it.
TEST(Liveness, ARankStoppedAgainAndAgainNeverFindsItsCoordinatorSilentButKnowsItWasNotHeard) {
  const auto t = LivenessTimes::of(milliseconds(1000), milliseconds(8000));
  Liveness l(t, T0);
  l.heard_coordinator(T0);
  const auto v = view(0, {0, 1, 2, 3});
  auto at = T0;
  for (int cycle = 0; cycle < 5; ++cycle) {
    EXPECT_TRUE(l.paused(at += milliseconds(800)));  // stopped
    for (int i = 0; i < 10; ++i) EXPECT_FALSE(l.paused(at += milliseconds(20)));  // runs 200 ms
    EXPECT_EQ(l.coordinator_silence(at, v, 0, 1, true), Liveness::Silence::kNone);
    EXPECT_EQ(l.unheard_long(at), at - T0 > milliseconds(1000)) << cycle;
  }
  l.heard_coordinator(at);
  EXPECT_FALSE(l.unheard_long(at + milliseconds(999)));
  EXPECT_TRUE(l.unheard_long(at + milliseconds(1001)));
  l.coordinator_finished();
  EXPECT_FALSE(l.unheard_long(at + milliseconds(5000)));
}

// Silence counts only while this process looks: gaps between its passes beyond `look`
// (heartbeat / 2) are time it waited for a CPU, not the coordinator's silence; they are handed
// on (take_stall) for a coordinator's roster. Passes every 20 ms count in full.
TEST(Liveness, GapsBetweenPassesBeyondLookAreNotCountedAsTheCoordinatorsSilence) {
  const auto t = LivenessTimes::of(milliseconds(800), milliseconds(8000));
  EXPECT_EQ(t.look, milliseconds(50));
  Liveness l(t, T0);
  l.heard_coordinator(T0);
  const auto v = view(0, {0, 1, 2, 3});
  auto at = T0;
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(l.paused(at += milliseconds(20)));  // 400 ms
  EXPECT_EQ(l.take_stall(), Clock::duration(0));
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(l.paused(at += milliseconds(150)));  // 1000 ms
  EXPECT_EQ(l.take_stall(), milliseconds(400));
  EXPECT_EQ(l.take_stall(), Clock::duration(0));
  EXPECT_DOUBLE_EQ(l.silent_ms(at), 600.0);
  // The limit (900 ms) is reached at 1300 ms of wall time, not 900.
  while (at < T0 + milliseconds(1280)) EXPECT_FALSE(l.paused(at += milliseconds(20)));
  EXPECT_EQ(l.coordinator_silence(at, v, 0, 1, true), Liveness::Silence::kNone);
  for (int i = 0; i < 2; ++i) l.paused(at += milliseconds(20));
  EXPECT_EQ(l.coordinator_silence(at, v, 0, 1, true), Liveness::Silence::kTakeOver);
}

TEST(Liveness, SuccessorsProposeThemselvesInRankOrderOneEvictPeriodApart) {
  const auto t = LivenessTimes::of(milliseconds(400), milliseconds(8000));
  const View v = view(3, {0, 2, 5, 7});
  EXPECT_EQ(collectives::successors(v, 0), (std::vector<int>{2, 5, 7}));
  EXPECT_EQ(collectives::successors(v, 5), (std::vector<int>{0, 2, 7}));
  // Heard once: evict + one heartbeat; each later successor one evict + heartbeat more.
  EXPECT_EQ(collectives::takeover_turn(v, 0, 2, T0, true, t), T0 + milliseconds(450));
  EXPECT_EQ(collectives::takeover_turn(v, 0, 5, T0, true, t), T0 + milliseconds(900));
  EXPECT_EQ(collectives::takeover_turn(v, 0, 7, T0, true, t), T0 + milliseconds(1350));
  // Never heard (start-up): the deadline instead of the evict time.
  EXPECT_EQ(collectives::takeover_turn(v, 0, 2, T0, false, t), T0 + milliseconds(8050));
  // Members the coordinator admitted (a joiner may wait for its state from it) come last.
  EXPECT_EQ(collectives::takeover_turn(v, 0, 5, T0, true, t, {}, {2}), T0 + milliseconds(450));
  EXPECT_EQ(collectives::takeover_turn(v, 0, 7, T0, true, t, {}, {2}), T0 + milliseconds(900));
  EXPECT_EQ(collectives::takeover_turn(v, 0, 2, T0, true, t, {}, {2}), T0 + milliseconds(1350));
  // Witnessed dead: no silence limit, and the admitted member still after the others.
  Deaths dead(8, 0);
  dead[0] = 1;
  EXPECT_EQ(collectives::takeover_turn(v, 0, 5, T0, true, t, dead, {2}), T0);
  EXPECT_EQ(collectives::takeover_turn(v, 0, 2, T0, true, t, dead, {2}), T0 + milliseconds(900));
  Liveness l(t, T0);
  l.heard_coordinator(T0);
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(451), v, 0, 2, true),
            Liveness::Silence::kTakeOver);
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(451), v, 0, 5, true), Liveness::Silence::kNone);
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(901), v, 0, 5, true),
            Liveness::Silence::kTakeOver);
  // A job that cannot lose a rank stops instead.
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(451), v, 0, 2, false),
            Liveness::Silence::kLost);
  // A coordinator that said goodbye is silent for good, and that is no failure.
  l.coordinator_finished();
  EXPECT_EQ(l.coordinator_silence(T0 + milliseconds(5000), v, 0, 2, false),
            Liveness::Silence::kNone);
}

TEST(Liveness, ATakeoverWinsWithAMajorityOnceAllAnsweredOrEvictPassedAndIsLostWithoutOne) {
  const auto t = LivenessTimes::of(milliseconds(400), milliseconds(2000));
  Takeover k;
  k.epoch = 4;
  k.candidates = {1, 2, 3, 4};
  k.started = T0;
  // View of 5 (the silent coordinator included): this rank alone is no majority.
  EXPECT_EQ(collectives::takeover_outcome(k, 5, T0 + milliseconds(300), t),
            TakeoverOutcome::kGathering);
  k.acks[2] = collectives::qproto::Up{};
  k.acks[3] = collectives::qproto::Up{};
  // 3 of 5: a majority, but candidate 4 has not answered and evict has not passed.
  EXPECT_EQ(collectives::takeover_outcome(k, 5, T0 + milliseconds(300), t),
            TakeoverOutcome::kGathering);
  EXPECT_EQ(collectives::takeover_outcome(k, 5, T0 + milliseconds(401), t), TakeoverOutcome::kWon);
  k.acks[4] = collectives::qproto::Up{};
  EXPECT_EQ(collectives::takeover_outcome(k, 5, T0 + milliseconds(1), t), TakeoverOutcome::kWon);
  // 2 of 5 never win; after 2 evict + a heartbeat period the job is lost.
  Takeover lone = k;
  lone.acks.erase(3);
  lone.acks.erase(4);
  EXPECT_EQ(collectives::takeover_outcome(lone, 5, T0 + milliseconds(850), t),
            TakeoverOutcome::kGathering);
  EXPECT_EQ(collectives::takeover_outcome(lone, 5, T0 + milliseconds(851), t),
            TakeoverOutcome::kLost);
}

TEST(Liveness, AMemberAcceptsOneTakeoverPerEpochAndTheLowerCandidateWins) {
  const View current = view(2, {0, 1, 2, 3});
  const View proposal = view(3, {1, 2, 3});
  using collectives::TakeoverAnswer;
  auto answer = [&](const View& p, int from, uint64_t acked, bool coordinating,
                    const std::optional<Takeover>& own, bool lost = true) {
    return collectives::answer_takeover(p, from, 2, current, acked, coordinating, own, lost);
  };
  // Fresh: accepted. Stale epochs, proposals without this rank, a coordinator: refused.
  EXPECT_EQ(answer(proposal, 1, 2, false, std::nullopt), TakeoverAnswer::kAccept);
  EXPECT_EQ(answer(view(2, {1, 2, 3}), 1, 2, false, std::nullopt), TakeoverAnswer::kRefuse);
  EXPECT_EQ(answer(proposal, 1, 3, false, std::nullopt), TakeoverAnswer::kRefuse);
  EXPECT_EQ(answer(view(3, {1, 3}), 1, 2, false, std::nullopt), TakeoverAnswer::kRefuse);
  EXPECT_EQ(answer(proposal, 1, 2, true, std::nullopt), TakeoverAnswer::kRefuse);
  // Rank 2 proposed itself too: it yields to rank 1, not to rank 3.
  Takeover own;
  own.epoch = 3;
  EXPECT_EQ(answer(proposal, 1, 2, false, own), TakeoverAnswer::kAccept);
  EXPECT_EQ(answer(proposal, 3, 2, false, own), TakeoverAnswer::kRefuse);
  // A member that still hears the coordinator (issue 42, case 1) answers later, not now.
  EXPECT_EQ(answer(proposal, 1, 2, false, std::nullopt, false), TakeoverAnswer::kLater);
}

// ---- the engine's rules the quorum all-reduce relies on.

// An op that counts its passes and fails at the third, or waits for ever.
class Probe final : public collectives::EngineOp {
 public:
  explicit Probe(bool fail) : fail_(fail) {}
  bool advance(net::Endpoint&) override {
    if (fail_ && ++passes_ == 3) throw IoError("the probe fails");
    return false;
  }
  bool finished() const override { return false; }
  void abort(net::Endpoint&) override { aborted = true; }
  std::string waiting_on() const override { return "nothing"; }
  std::string name() const override { return "probe"; }
  std::atomic<bool> aborted{false};

 private:
  bool fail_;
  int passes_ = 0;
};

TEST(EngineScheduling, AnOpThatFailsAloneLeavesTheCommunicatorWorking) {
  run_ranks(2, {}, [&](Communicator& comm) {
    auto op = std::make_unique<Probe>(true);
    op->on_failure = collectives::EngineOp::OnFailure::kFailsOp;
    op->sequenced = false;
    auto w = comm.submit(std::move(op));
    EXPECT_THROW(w->wait(), IoError);
    EXPECT_FALSE(comm.broken());
    std::vector<float> buf(100, float(comm.rank() + 1));
    comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
    EXPECT_EQ(buf[7], 3.f);
  });
}

TEST(EngineScheduling, AnOpThatFailsAloneAtItsDeadlineTimesOutWithoutProbes) {
  run_ranks(2, {}, [&](Communicator& comm) {
    auto op = std::make_unique<Probe>(false);
    op->on_failure = collectives::EngineOp::OnFailure::kFailsOp;
    op->sequenced = false;
    op->deadline = Clock::now() + milliseconds(50);
    auto w = comm.submit(std::move(op));
    try {
      w->wait();
      ADD_FAILURE() << "no timeout";
    } catch (const collectives::CollectiveTimeout& e) {
      EXPECT_NE(std::string(e.what()).find("probe #0 timed out after"), std::string::npos)
          << e.what();
      EXPECT_EQ(std::string(e.what()).find("liveness probe"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(comm.broken());
  });
}

TEST(EngineScheduling, AnOpThatBreaksTheCommunicatorFailsEveryOp) {
  run_ranks(1, {}, [&](Communicator& comm) {
    auto waiting = comm.submit(std::make_unique<Probe>(false));
    auto failing = comm.submit(std::make_unique<Probe>(true));
    EXPECT_THROW(failing->wait(), IoError);
    EXPECT_THROW(waiting->wait(), IoError);
    EXPECT_TRUE(comm.broken());
  });
}

// ---- the outbox: results to one rank are paced, two in flight.

TEST(Outbox, ResultsToOneRankGoTwoAtATimeAndAForgottenRankGetsNoMore) {
  net::InprocFabric fabric(2);
  auto a = fabric.endpoint(0);
  auto b = fabric.endpoint(1);
  collectives::Outbox out(2);
  auto keep = std::make_shared<std::vector<char>>(16, 'x');
  for (uint64_t k = 0; k < 5; ++k) out.send_result(*a, 1, k, keep, keep->data(), keep->size());
  // The in-process endpoint completes sends at once: each reap lets the next two go.
  std::vector<std::pair<int, std::string>> failed;
  auto may = [](int) { return true; };
  int rounds = 0;
  while (!out.empty() && rounds < 10) {
    out.reap(*a, failed, may);
    ++rounds;
  }
  EXPECT_EQ(rounds, 3);  // 2 + 2 + 1
  std::vector<char> got(16);
  for (uint64_t k = 0; k < 5; ++k) {
    auto r = b->irecv(0, k, got.data(), got.size());
    b->progress();
    EXPECT_TRUE(r->ok()) << "result " << k;
  }
  for (uint64_t k = 5; k < 9; ++k) out.send_result(*a, 1, k, keep, keep->data(), keep->size());
  out.forget_results(1);
  while (!out.empty()) out.reap(*a, failed, may);
  auto r = b->irecv(0, 8, got.data(), got.size());
  b->progress();
  EXPECT_FALSE(r->done()) << "a result queued for a rank that left went out";
  EXPECT_TRUE(failed.empty());
}

}  // namespace
}  // namespace qring::testing
