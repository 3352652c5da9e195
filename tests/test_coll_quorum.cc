// The quorum all-reduce contract (DESIGN.md §3) on the in-process endpoint: on virtual time
// (sim_harness.h) where a test waits for stragglers, deadlines or evictions, so that its
// seconds of protocol time cost milliseconds; a few cases on the real clock keep the engine
// thread and the callers' threads racing for real.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "coll_harness.h"
#include "collectives/quorum/quorum.h"
#include "sim_harness.h"

namespace qring::testing {
namespace {

using collectives::LatePolicy;
using collectives::QuorumAllreduce;
using collectives::QuorumOptions;
using collectives::QuorumResult;
using collectives::QuorumTimeout;
using std::chrono::milliseconds;

float grad(size_t j, int r, uint64_t step) {
  return float(pattern(j + step * 3, r));
}

// Sleeps `d`, returning early (true) once `abandon()` says the work is stale.
bool interruptible_sleep(milliseconds d, const std::function<bool()>& abandon) {
  auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
    if (abandon()) return true;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return false;
}

struct StepRecord {
  std::vector<uint8_t> bitmap;
  std::vector<float> out;
};

struct ContractCase {
  int world;
  int quorum;
  int grace_ms;
};

// Every step of `steps`, each rank contributing after a random delay (an occasional real
// straggler), abandoning its work once excluded: S(t) has at least `quorum` ranks, every rank
// gets the same S(t) and the same bits, equal to the mean over exactly S(t). On virtual time, or
// on the real clock with the engine threads (`real`).
void check_contract(const ContractCase& c, bool real) {
  const int steps = 60;
  const size_t count = 37;
  QuorumOptions qo;
  qo.quorum = c.quorum;
  qo.grace = milliseconds(c.grace_ms);
  qo.deadline = milliseconds(5000);
  CommOptions co;
  co.segment_bytes = 32;  // several segments per chunk even at this size
  // Grace 0 cases reduce among the contributors with the ring, grace > 0 ones with
  // recursive doubling: both member-subset algorithms are covered.
  if (c.grace_ms == 0) co.small_allreduce_bytes = 0;
  std::vector<std::vector<StepRecord>> rec(size_t(c.world), std::vector<StepRecord>(steps));
  std::unique_ptr<SimWorld> sim = real ? nullptr : std::make_unique<SimWorld>(c.world, co);
  auto program = [&](int rank, Communicator& comm) {
    QuorumAllreduce q(comm, count, qo);
    std::mt19937 rng(1234u + unsigned(rank) * 7919u + unsigned(c.quorum) * 31u);
    std::vector<float> buf(count);
    for (uint64_t t = 0; t < uint64_t(steps); ++t) {
      for (size_t j = 0; j < count; ++j) buf[j] = grad(j, rank, t);
      int delay = int(rng() % 4);
      if (rng() % 5 == 0) delay += 6;  // an occasional real straggler
      auto stale = [&] { return q.excluded(t); };
      const bool gave_up = real ? interruptible_sleep(milliseconds(delay), stale)
                                : sleep_unless(sim->clock(), milliseconds(delay), stale);
      if (!gave_up) q.contribute(t, buf.data(), count);
      QuorumResult r = q.wait(t, buf.data());
      EXPECT_GE(r.count, c.quorum);
      EXPECT_EQ(r.self_counted, r.contains(rank));
      if (gave_up) {
        EXPECT_FALSE(r.self_counted);
      }
      rec[size_t(rank)][t] = {r.contributors, buf};
    }
  };
  if (real)
    run_ranks(c.world, co, [&](Communicator& comm) { program(comm.rank(), comm); });
  else
    sim->run(program);
  if (sim) {
    for (int r = 0; r < c.world; ++r) ASSERT_EQ(sim->error(r), "") << "rank " << r;
  }
  for (int t = 0; t < steps; ++t) {
    const auto& ref = rec[0][size_t(t)];
    int k = 0;
    for (int r = 0; r < c.world; ++r) k += (ref.bitmap[size_t(r) / 8] >> (r % 8)) & 1;
    ASSERT_GE(k, c.quorum) << "step " << t;
    for (size_t j = 0; j < count; ++j) {
      float sum = 0;
      for (int r = 0; r < c.world; ++r)
        if ((ref.bitmap[size_t(r) / 8] >> (r % 8)) & 1) sum += grad(j, r, uint64_t(t));
      ASSERT_EQ(ref.out[j], sum / float(k)) << "step " << t << " element " << j;
    }
    for (int r = 1; r < c.world; ++r) {
      ASSERT_EQ(rec[size_t(r)][size_t(t)].bitmap, ref.bitmap) << "rank " << r << " step " << t;
      ASSERT_EQ(0, std::memcmp(rec[size_t(r)][size_t(t)].out.data(), ref.out.data(),
                               count * sizeof(float)))
          << "rank " << r << " step " << t << " output differs";
    }
  }
}

class QuorumContract : public ::testing::TestWithParam<ContractCase> {};

TEST_P(QuorumContract, AgreementAndExactnessUnderRandomStragglers) {
  check_contract(GetParam(), /*real=*/false);
}

class QuorumContractRealClock : public ::testing::TestWithParam<ContractCase> {};

TEST_P(QuorumContractRealClock, AgreementAndExactnessUnderRandomStragglers) {
  check_contract(GetParam(), /*real=*/true);
}

INSTANTIATE_TEST_SUITE_P(Threads, QuorumContractRealClock,
                         ::testing::Values(ContractCase{4, 3, 0}, ContractCase{4, 4, 0},
                                           ContractCase{7, 5, 2}),
                         [](const auto& i) {
                           return "w" + std::to_string(i.param.world) + "_q" +
                                  std::to_string(i.param.quorum) + "_g" +
                                  std::to_string(i.param.grace_ms);
                         });

std::vector<ContractCase> contract_cases() {
  std::vector<ContractCase> v;
  for (int w : {2, 3, 4, 5, 7})
    for (int q = 1; q <= w; ++q)
      for (int g : {0, 2}) v.push_back({w, q, g});
  return v;
}

std::string contract_name(const ::testing::TestParamInfo<ContractCase>& i) {
  return "w" + std::to_string(i.param.world) + "_q" + std::to_string(i.param.quorum) + "_g" +
         std::to_string(i.param.grace_ms);
}

INSTANTIATE_TEST_SUITE_P(Grid, QuorumContract, ::testing::ValuesIn(contract_cases()),
                         contract_name);

// Virtual ms since `t0`.
double ms_since(VirtualClock& clock, Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock.now() - t0).count();
}

// World 4, Q=3, G=20 ms, rank 2 two seconds late: the others finish step 0 well under 1 s;
// rank 2 learns at once that it is excluded, abandons its work and gets the result.
TEST(Quorum, StragglerDoesNotHoldTheOthersBeyondTheGrace) {
  for (int quorum : {3, 4}) {
    QuorumOptions qo;
    qo.quorum = quorum;
    qo.grace = milliseconds(20);
    qo.deadline = milliseconds(10000);
    std::vector<double> step_ms(4);
    std::vector<char> counted(4);
    SimWorld w(4);
    w.run([&](int rank, Communicator& comm) {
      QuorumAllreduce q(comm, 64, qo);
      std::vector<float> buf(64, float(rank));
      auto t0 = w.clock().now();
      bool gave_up = false;
      if (rank == 2)
        gave_up = sleep_unless(w.clock(), milliseconds(2000), [&] { return q.excluded(0); });
      if (!gave_up) q.contribute(0, buf.data(), buf.size());
      QuorumResult r = q.wait(0, buf.data());
      step_ms[size_t(rank)] = ms_since(w.clock(), t0);
      counted[size_t(rank)] = r.self_counted;
      float expect = quorum == 3 ? (0 + 1 + 3) / 3.f : (0 + 1 + 2 + 3) / 4.f;
      EXPECT_EQ(buf[0], expect) << "rank " << rank;
    });
    if (quorum == 3) {
      for (int r : {0, 1, 3}) {
        EXPECT_LT(step_ms[size_t(r)], 1000) << "rank " << r;
        EXPECT_TRUE(counted[size_t(r)]);
      }
      EXPECT_FALSE(counted[2]);
      EXPECT_LT(step_ms[2], 1000) << "the excluded rank abandoned its stale work";
    } else {
      for (int r = 0; r < 4; ++r) EXPECT_GE(step_ms[size_t(r)], 1900) << "rank " << r;
      EXPECT_TRUE(counted[2]);
    }
  }
}

TEST(Quorum, TwoSilentRanksBelowQuorumFailEveryLiveRankNamingThem) {
  QuorumOptions qo;
  qo.quorum = 3;
  qo.deadline = milliseconds(300);
  std::vector<std::string> msgs(4);
  std::vector<std::vector<int>> missing(4);
  int done_live = 0;
  SimWorld w(4);
  w.run([&](int rank, Communicator& comm) {
    QuorumAllreduce q(comm, 16, qo);
    if (rank >= 2) {  // silent: alive, never contributes
      wait_for(w.clock(), [&] { return done_live == 2; });
      return;
    }
    std::vector<float> buf(16, 1.f);
    auto t0 = w.clock().now();
    q.contribute(0, buf.data(), buf.size());
    try {
      q.wait(0, buf.data());
      ADD_FAILURE() << "step completed without a quorum";
    } catch (const QuorumTimeout& e) {
      msgs[size_t(rank)] = e.what();
      missing[size_t(rank)] = e.missing();
      EXPECT_LT(ms_since(w.clock(), t0), 300 + 1500);
    }
    // The failure is sticky: the next step refuses at once.
    EXPECT_THROW(q.contribute(1, buf.data(), buf.size()), std::exception);
    ++done_live;
  });
  for (int r : {0, 1}) {
    EXPECT_EQ(missing[size_t(r)], (std::vector<int>{2, 3})) << msgs[size_t(r)];
    EXPECT_NE(msgs[size_t(r)].find("[2, 3]"), std::string::npos) << msgs[size_t(r)];
  }
}

// With quorum = world the ring starts at contribute time once a step has been decided
// (docs/design.md); a rank that falls silent later must still end in a QuorumTimeout that
// names it, not in a ring timeout or a hang.
TEST(Quorum, SilentRankWithQuorumEqualsWorldFailsTheOthersNamingIt) {
  QuorumOptions qo;
  qo.deadline = milliseconds(300);
  std::vector<std::string> msgs(3);
  std::vector<std::vector<int>> missing(3);
  int done_live = 0;
  SimWorld w(3);
  w.run([&](int rank, Communicator& comm) {
    QuorumAllreduce q(comm, 1000, qo);
    std::vector<float> buf(1000);
    for (uint64_t t = 0; t < 3; ++t) {
      for (size_t j = 0; j < buf.size(); ++j) buf[j] = grad(j, rank, t);
      q.contribute(t, buf.data(), buf.size());
      QuorumResult r = q.wait(t, buf.data());
      EXPECT_EQ(r.count, 3);
      float want = (grad(7, 0, t) + grad(7, 1, t) + grad(7, 2, t)) / 3.f;
      EXPECT_EQ(buf[7], want) << "step " << t;
    }
    if (rank == 2) {  // silent from step 3 on: alive, never contributes
      wait_for(w.clock(), [&] { return done_live == 2; });
      return;
    }
    auto t0 = w.clock().now();
    q.contribute(3, buf.data(), buf.size());
    try {
      q.wait(3, buf.data());
      ADD_FAILURE() << "step completed without rank 2";
    } catch (const QuorumTimeout& e) {
      msgs[size_t(rank)] = e.what();
      missing[size_t(rank)] = e.missing();
      EXPECT_LT(ms_since(w.clock(), t0), 300 + 1500);
    }
    ++done_live;
  });
  for (int r : {0, 1}) {
    EXPECT_EQ(missing[size_t(r)], (std::vector<int>{2})) << msgs[size_t(r)];
    EXPECT_NE(msgs[size_t(r)].find("step 3"), std::string::npos) << msgs[size_t(r)];
  }
}

TEST(Quorum, CoordinatorThatStragglesStillDecides) {
  QuorumOptions qo;
  qo.quorum = 2;
  qo.deadline = milliseconds(5000);
  SimWorld w(3);
  w.run([&](int rank, Communicator& comm) {
    QuorumAllreduce q(comm, 8, qo);
    std::vector<float> buf(8, float(rank + 1));
    bool gave_up = false;
    if (rank == 0)
      gave_up = sleep_unless(w.clock(), milliseconds(1000), [&] { return q.excluded(0); });
    if (!gave_up) q.contribute(0, buf.data(), buf.size());
    QuorumResult r = q.wait(0, buf.data());
    EXPECT_EQ(r.count, 2);
    EXPECT_FALSE(r.contains(0));
    EXPECT_EQ(buf[0], (2.f + 3.f) / 2.f);
    EXPECT_EQ(r.dropped, std::vector<int>{0});
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(w.error(r), "") << "rank " << r;
}

// Under `carry`, a gradient that missed step 0 is counted exactly once, in step 1; under
// `drop` it is gone.
TEST(Quorum, CarryCountsALateGradientOnceInTheNextStep) {
  for (LatePolicy policy : {LatePolicy::kCarry, LatePolicy::kDrop}) {
    QuorumOptions qo;
    qo.quorum = 2;
    qo.late = policy;
    qo.mean = false;  // sums make the bookkeeping visible
    qo.deadline = milliseconds(5000);
    std::vector<float> out1(3);
    std::vector<std::vector<uint8_t>> s0(3), s1(3);
    SimWorld w(3);
    w.run([&](int r, Communicator& comm) {
      QuorumAllreduce q(comm, 1, qo);
      float g = float(10 * (r + 1));  // step 0 gradients: 10, 20, 30
      if (r == 2) w.clock().sleep_until(w.clock().now() + milliseconds(300));  // late
      q.contribute(0, &g, 1);
      QuorumResult a = q.wait(0, &g);
      s0[size_t(r)] = a.contributors;
      float h = float(r + 1);  // step 1 gradients: 1, 2, 3
      // Rank 2 reaches step 1 at ~300 ms (after its late step 0); the others at ~600 ms.
      if (r != 2) w.clock().sleep_until(w.clock().now() + milliseconds(600));
      q.contribute(1, &h, 1);
      QuorumResult b = q.wait(1, &h);
      s1[size_t(r)] = b.contributors;
      out1[size_t(r)] = h;
    });
    ASSERT_EQ(s0[0], s0[2]);
    EXPECT_EQ(s0[0][0], 0b011) << "ranks 0 and 1 win step 0";
    ASSERT_EQ(s1[0], s1[2]);
    ASSERT_TRUE(s1[0][0] & 0b100) << "rank 2 is counted in step 1";
    float expect = 3.f + (policy == LatePolicy::kCarry ? 30.f : 0.f);
    for (int r : {0, 1})
      if (s1[0][0] & (1 << r)) expect += float(r + 1);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(out1[size_t(r)], expect) << "rank " << r;
  }
}

TEST(Quorum, WrongStepOrSizeIsAClearError) {
  run_ranks(1, {}, [&](Communicator& comm) {
    QuorumAllreduce q(comm, 4, {});
    std::vector<float> buf(4, 1.f);
    EXPECT_THROW(q.contribute(0, buf.data(), 3), UsageError);
    q.contribute(0, buf.data(), 4);
    EXPECT_THROW(q.contribute(0, buf.data(), 4), UsageError);  // twice
    q.wait(0, buf.data());
    try {
      q.contribute(5, buf.data(), 4);
      ADD_FAILURE() << "out-of-order step accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("step 1 is next"), std::string::npos) << e.what();
    }
  });
}

TEST(Quorum, MismatchedSizesAcrossRanksFailEveryRank) {
  std::atomic<int> errors{0};
  run_ranks(3, {}, [&](Communicator& comm) {
    QuorumOptions qo;
    qo.deadline = milliseconds(2000);
    size_t n = comm.rank() == 1 ? 5 : 4;
    QuorumAllreduce q(comm, n, qo);
    std::vector<float> buf(n, 1.f);
    // The coordinator decides the mismatch as soon as rank 1's READY is in, so a rank that
    // contributes after that learns it already in contribute, the others in wait.
    try {
      q.contribute(0, buf.data(), n);
      q.wait(0, buf.data());
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("rank 1 contributes 5 elements of float32 (mean)") !=
          std::string::npos)
        ++errors;
      else
        ADD_FAILURE() << e.what();
    }
  });
  EXPECT_EQ(errors.load(), 3);
}

// Same element count, another element type or reduction on one rank (same bytes for float32
// and int32): READY carries both, so every rank fails naming that rank.
TEST(Quorum, MismatchedTypeOrReductionAcrossRanksFailsEveryRank) {
  for (const bool type : {true, false}) {
    std::atomic<int> errors{0};
    run_ranks(3, {}, [&](Communicator& comm) {
      QuorumOptions qo;
      qo.deadline = milliseconds(2000);
      if (comm.rank() == 2) {
        if (type)
          qo.type = DataType::kInt32;
        else
          qo.mean = false;
      }
      QuorumAllreduce q(comm, 4, qo);
      std::vector<float> buf(4, 1.f);
      try {
        q.contribute(0, buf.data(), 4);
        q.wait(0, buf.data());
        ADD_FAILURE() << "rank " << comm.rank() << ": a mismatched step completed";
      } catch (const UsageError& e) {
        const std::string want = type ? "rank 2 contributes 4 elements of int32 (mean)"
                                      : "rank 2 contributes 4 elements of float32 (sum)";
        if (std::string(e.what()).find(want) != std::string::npos)
          ++errors;
        else
          ADD_FAILURE() << e.what();
      }
    });
    EXPECT_EQ(errors.load(), 3) << (type ? "type" : "reduction");
  }
}

TEST(Quorum, DriftedDigestStopsEveryRankNamingBoth) {
  std::atomic<int> errors{0};
  run_ranks(3, {}, [&](Communicator& comm) {
    QuorumOptions qo;
    qo.quorum = 2;
    // The grace holds each step open for rank 2's READY (all three arrive, so no step waits
    // it out): a step decided without it would leave the drift unseen on a loaded machine,
    // where rank 2 may come after the others have finished every step.
    qo.grace = milliseconds(2000);
    qo.deadline = milliseconds(5000);
    QuorumAllreduce q(comm, 4, qo);
    std::vector<float> buf(4, 1.f);
    try {
      // Step 0 agrees; before step 1 rank 2's "parameters" differ.
      q.contribute(0, buf.data(), 4, uint64_t(77));
      q.wait(0, buf.data());
      q.contribute(1, buf.data(), 4, uint64_t(comm.rank() == 2 ? 78 : 77));
      q.wait(1, buf.data());
      // Decided before rank 2's READY came in: the next step fails.
      q.contribute(2, buf.data(), 4);
      q.wait(2, buf.data());
    } catch (const collectives::QuorumLost& e) {
      const std::string w = e.what();
      if (w.find("replicas drifted: before step 1") != std::string::npos &&
          w.find("000000000000004e") != std::string::npos &&
          w.find("000000000000004d") != std::string::npos && w.find("rank 2") != std::string::npos)
        ++errors;
      else
        ADD_FAILURE() << w;
    }
  });
  EXPECT_EQ(errors.load(), 3);
}

// Four ranks complete quorum step 0, run `between(q, rank)`, then complete step 1 (so that no
// rank leaves while another still gathers its reports). On virtual time.
void between_two_steps(int quorum, milliseconds deadline,
                       const std::function<void(SimWorld&, QuorumAllreduce&, int)>& between) {
  SimWorld w(4);
  w.run([&](int rank, Communicator& comm) {
    QuorumOptions qo;
    qo.quorum = quorum;
    qo.deadline = deadline;
    QuorumAllreduce q(comm, 4, qo);
    std::vector<float> buf(4, 1.f);
    q.contribute(0, buf.data(), 4);
    q.wait(0, buf.data());
    between(w, q, rank);
    q.contribute(1, buf.data(), 4);
    q.wait(1, buf.data());
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(w.error(r), "") << "rank " << r;
}

TEST(Quorum, ReportsGatherAtTheCoordinatorWithoutBlockingTheOthers) {
  int gathered = 0;
  between_two_steps(3, milliseconds(3000), [&](SimWorld& w, QuorumAllreduce& q, int r) {
    if (q.membership().coordinator() != r) {
      // Rank 3 never reports key 10 in 4 parts (it splits it in 3, as if it saw 3 members):
      // the coordinator stops waiting at its deadline.
      if (r != 3) q.reports().report(10, r, 4, {double(r), 0.5 * r});
      if (r == 3) q.reports().report(10, 2, 3, {99.0});
      q.reports().report(11, r, 4, {double(10 * r)});
    } else {
      EXPECT_THROW(q.reports().report(12, 4, 4, {1.0}), UsageError);           // part out of range
      EXPECT_THROW(q.reports().report(12, 0, 4, std::vector<double>(9)), UsageError);  // too many
      auto t0 = w.clock().now();
      auto a = q.reports().gather_reports(10, 4, r, t0 + milliseconds(300));
      EXPECT_GE(ms_since(w.clock(), t0), 290);
      EXPECT_EQ(a.size(), 2u);
      EXPECT_EQ(a[1], (std::vector<double>{1.0, 0.5}));
      EXPECT_EQ(a[2], (std::vector<double>{2.0, 1.0}));
      EXPECT_EQ(a.count(3), 0u);
      auto b = q.reports().gather_reports(11, 4, r, t0 + milliseconds(5000));
      EXPECT_EQ(b.size(), 3u);
      EXPECT_EQ(b[3], (std::vector<double>{30.0}));
      ++gathered;
    }
  });
  EXPECT_EQ(gathered, 1);
}

// A coordinator that lags the others by many evaluations (a small quorum lets them run ahead)
// still gathers every key's parts, oldest first: its reports are kept until it gathers them.
// (Kept for the newest 16 keys only, key 100's parts were gone by the time it asked, so it
// waited out its deadline and evaluated the others' slices itself, at every evaluation.)
TEST(Quorum, ALaggingCoordinatorStillGathersEveryReport) {
  constexpr int kKeys = 40;
  int reported = 0, gathered = 0;
  between_two_steps(4, milliseconds(20000), [&](SimWorld& w, QuorumAllreduce& q, int r) {
    if (q.membership().coordinator() != r) {
      for (int k = 0; k < kKeys; ++k)
        q.reports().report(uint64_t(100 + k), r, 4, {double(1000 * r + k)});
      ++reported;
    } else {
      // Behind the others by all their reports, and then some (they are on their way).
      wait_for(w.clock(), [&] { return reported == 3; });
      w.clock().sleep_until(w.clock().now() + milliseconds(300));
      for (int k = 0; k < kKeys; ++k) {
        auto got = q.reports().gather_reports(uint64_t(100 + k), 4, r,
                                              w.clock().now() + milliseconds(10000));
        ASSERT_EQ(got.size(), 3u) << "key " << 100 + k;
        for (auto& [part, v] : got) EXPECT_EQ(v, (std::vector<double>{1000.0 * part + k}));
      }
      ++gathered;
    }
  });
  EXPECT_EQ(gathered, 1);
}

TEST(Quorum, ResolveQuorumSpec) {
  EXPECT_EQ(collectives::resolve_quorum("3", 4), 3);
  EXPECT_EQ(collectives::resolve_quorum("0.75", 4), 3);
  EXPECT_EQ(collectives::resolve_quorum("0.7", 4), 3);
  EXPECT_EQ(collectives::resolve_quorum("1.0", 5), 5);
  EXPECT_THROW(collectives::resolve_quorum("5", 4), ConfigError);
  EXPECT_THROW(collectives::resolve_quorum("0", 4), ConfigError);
  EXPECT_THROW(collectives::resolve_quorum("1.5", 4), ConfigError);
  EXPECT_THROW(collectives::resolve_quorum("x", 4), ConfigError);
}

// The coordinator (rank 0) is cut off from the others mid-run: the majority elects rank 1 and
// goes on; the cut-off rank never decides a step of its own (the quorum of 2 needs another
// rank) and stops with an error. Every step that two ranks both completed has one contributor
// set and the same bits on both.
TEST(QuorumMembership, CutOffCoordinatorIsReplacedAndNoStepHasTwoOutcomes) {
  const int world = 4, steps = 60, cut_at = 20;
  const size_t count = 37;
  QuorumOptions qo;
  qo.quorum = 2;
  qo.deadline = milliseconds(3000);
  qo.evict = milliseconds(200);
  std::vector<std::vector<StepRecord>> rec(static_cast<size_t>(world));
  SimWorld w(world);
  w.run([&](int r, Communicator& comm) {
    QuorumAllreduce q(comm, count, qo);
    std::vector<float> buf(count);
    for (uint64_t t = 0; t < uint64_t(steps); ++t) {
      if (r == 0 && t == uint64_t(cut_at)) w.cut(0);
      for (size_t j = 0; j < count; ++j) buf[j] = grad(j, r, t);
      q.contribute(t, buf.data(), count);
      QuorumResult res = q.wait(t, buf.data());
      rec[size_t(r)].push_back({res.contributors, buf});
      w.clock().sleep_until(w.clock().now() + milliseconds(2));
    }
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(w.error(r), "") << "rank " << r;
    ASSERT_EQ(rec[size_t(r)].size(), size_t(steps)) << "rank " << r;
  }
  EXPECT_NE(w.error(0), "") << "the cut-off coordinator went on alone";
  EXPECT_LE(rec[0].size(), size_t(cut_at) + 1) << w.error(0);
  for (int r = 0; r < world; ++r)
    for (size_t t = 0; t < rec[size_t(r)].size(); ++t) {
      EXPECT_EQ(rec[size_t(r)][t].bitmap, rec[1][t].bitmap) << "rank " << r << " step " << t;
      EXPECT_EQ(rec[size_t(r)][t].out, rec[1][t].out) << "rank " << r << " step " << t;
    }
}

// Reports gathered at the coordinator stop waiting for a sender that has left the job: rank
// 3 is cut off before it reports; the coordinator's gather names the senders and returns once
// rank 3 is evicted (200 ms), long before its 20 s deadline, with the other ranks' parts.
TEST(QuorumMembership, GatherStopsWaitingForASenderThatLeft) {
  const int world = 4;
  const size_t count = 8;
  QuorumOptions qo;
  qo.quorum = 3;
  qo.deadline = milliseconds(3000);
  qo.evict = milliseconds(200);
  int reported = 0, past = 0;
  std::map<int, std::vector<double>> got;
  double gather_s = -1;
  SimWorld w(world);
  w.run([&](int r, Communicator& comm) {
    QuorumAllreduce q(comm, count, qo);
    std::vector<float> buf(count, float(r));
    for (uint64_t t = 0; t < 3; ++t) {
      q.contribute(t, buf.data(), count);
      q.wait(t, buf.data());
    }
    // Every rank completed step 2 in view 0 before rank 3 goes silent: all see the same
    // members.
    ++past;
    wait_for(w.clock(), [&] { return past == world; });
    const std::vector<int> members = q.membership().members();
    if (r == 3) {
      w.cut(3);
      ++reported;
      w.kill(3);  // silent from now on
    }
    ASSERT_EQ(members, (std::vector<int>{0, 1, 2, 3}));
    if (q.membership().coordinator() != r) {
      q.reports().report(7, r, world, {double(r)});
      ++reported;
    } else {
      wait_for(w.clock(), [&] { return reported == world - 1; });
      const auto t0 = w.clock().now();
      got = q.reports().gather_reports(7, world, r, t0 + milliseconds(20000), members);
      gather_s = ms_since(w.clock(), t0) / 1000;
    }
    // The survivors go on without rank 3.
    for (uint64_t t = 3; t < 6; ++t) {
      q.contribute(t, buf.data(), count);
      q.wait(t, buf.data());
    }
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(w.error(r), "") << "rank " << r;
  EXPECT_GE(gather_s, 0.0);
  EXPECT_LT(gather_s, 10.0) << "the gather waited for the evicted rank until its deadline";
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1], std::vector<double>{1.0});
  EXPECT_EQ(got[2], std::vector<double>{2.0});
  EXPECT_EQ(got.count(3), 0u);
}

}  // namespace
}  // namespace qring::testing
