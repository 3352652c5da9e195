// The quorum all-reduce contract (DESIGN.md §3) on the in-process endpoint.
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

class QuorumContract : public ::testing::TestWithParam<ContractCase> {};

TEST_P(QuorumContract, AgreementAndExactnessUnderRandomStragglers) {
  const auto c = GetParam();
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
  std::atomic<int> abandoned{0};
  run_ranks(c.world, co, [&](Communicator& comm) {
    QuorumAllreduce q(comm, count, qo);
    std::mt19937 rng(1234u + unsigned(comm.rank()) * 7919u + unsigned(c.quorum) * 31u);
    std::vector<float> buf(count);
    for (uint64_t t = 0; t < uint64_t(steps); ++t) {
      for (size_t j = 0; j < count; ++j) buf[j] = grad(j, comm.rank(), t);
      int delay = int(rng() % 4);
      if (rng() % 5 == 0) delay += 6;  // an occasional real straggler
      bool gave_up = interruptible_sleep(milliseconds(delay), [&] { return q.excluded(t); });
      if (!gave_up)
        q.contribute(t, buf.data(), count);
      else
        ++abandoned;
      QuorumResult r = q.wait(t, buf.data());
      EXPECT_GE(r.count, c.quorum);
      EXPECT_EQ(r.self_counted, r.contains(comm.rank()));
      if (gave_up) {
        EXPECT_FALSE(r.self_counted);
      }
      rec[size_t(comm.rank())][t] = {r.contributors, buf};
    }
  });
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

// World 4, Q=3, G=20 ms, rank 2 two seconds late: the others finish step 0 well under 1 s;
// rank 2 learns at once that it is excluded, abandons its work and gets the result.
TEST(Quorum, StragglerDoesNotHoldTheOthersBeyondTheGrace) {
  for (int quorum : {3, 4}) {
    QuorumOptions qo;
    qo.quorum = quorum;
    qo.grace = milliseconds(20);
    qo.deadline = milliseconds(10000);
    std::vector<double> step_ms(4);
    std::vector<char> counted(4);  // one byte per rank thread: vector<bool> shares words
    run_ranks(4, {}, [&](Communicator& comm) {
      QuorumAllreduce q(comm, 64, qo);
      std::vector<float> buf(64, float(comm.rank()));
      auto t0 = std::chrono::steady_clock::now();
      bool gave_up = false;
      if (comm.rank() == 2)
        gave_up = interruptible_sleep(milliseconds(2000), [&] { return q.excluded(0); });
      if (!gave_up) q.contribute(0, buf.data(), buf.size());
      QuorumResult r = q.wait(0, buf.data());
      step_ms[size_t(comm.rank())] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      counted[size_t(comm.rank())] = r.self_counted;
      float expect = quorum == 3 ? (0 + 1 + 3) / 3.f : (0 + 1 + 2 + 3) / 4.f;
      EXPECT_EQ(buf[0], expect) << "rank " << comm.rank();
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
  std::atomic<int> done_live{0};
  run_ranks(4, {}, [&](Communicator& comm) {
    QuorumAllreduce q(comm, 16, qo);
    if (comm.rank() >= 2) {  // silent: alive, never contributes
      while (done_live.load() < 2) std::this_thread::sleep_for(milliseconds(5));
      return;
    }
    std::vector<float> buf(16, 1.f);
    auto t0 = std::chrono::steady_clock::now();
    q.contribute(0, buf.data(), buf.size());
    try {
      q.wait(0, buf.data());
      ADD_FAILURE() << "step completed without a quorum";
    } catch (const QuorumTimeout& e) {
      msgs[size_t(comm.rank())] = e.what();
      missing[size_t(comm.rank())] = e.missing();
      EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(300 + 1500));
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
  std::atomic<int> done_live{0};
  run_ranks(3, {}, [&](Communicator& comm) {
    QuorumAllreduce q(comm, 1000, qo);
    std::vector<float> buf(1000);
    for (uint64_t t = 0; t < 3; ++t) {
      for (size_t j = 0; j < buf.size(); ++j) buf[j] = grad(j, comm.rank(), t);
      q.contribute(t, buf.data(), buf.size());
      QuorumResult r = q.wait(t, buf.data());
      EXPECT_EQ(r.count, 3);
      float want = (grad(7, 0, t) + grad(7, 1, t) + grad(7, 2, t)) / 3.f;
      EXPECT_EQ(buf[7], want) << "step " << t;
    }
    if (comm.rank() == 2) {  // silent from step 3 on: alive, never contributes
      while (done_live.load() < 2) std::this_thread::sleep_for(milliseconds(5));
      return;
    }
    auto t0 = std::chrono::steady_clock::now();
    q.contribute(3, buf.data(), buf.size());
    try {
      q.wait(3, buf.data());
      ADD_FAILURE() << "step completed without rank 2";
    } catch (const QuorumTimeout& e) {
      msgs[size_t(comm.rank())] = e.what();
      missing[size_t(comm.rank())] = e.missing();
      EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(300 + 1500));
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
  run_ranks(3, {}, [&](Communicator& comm) {
    QuorumAllreduce q(comm, 8, qo);
    std::vector<float> buf(8, float(comm.rank() + 1));
    bool gave_up = false;
    if (comm.rank() == 0)
      gave_up = interruptible_sleep(milliseconds(1000), [&] { return q.excluded(0); });
    if (!gave_up) q.contribute(0, buf.data(), buf.size());
    QuorumResult r = q.wait(0, buf.data());
    EXPECT_EQ(r.count, 2);
    EXPECT_FALSE(r.contains(0));
    EXPECT_EQ(buf[0], (2.f + 3.f) / 2.f);
    EXPECT_EQ(r.dropped, std::vector<int>{0});
  });
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
    run_ranks(3, {}, [&](Communicator& comm) {
      QuorumAllreduce q(comm, 1, qo);
      const int r = comm.rank();
      float g = float(10 * (r + 1));                               // step 0 gradients: 10, 20, 30
      if (r == 2) std::this_thread::sleep_for(milliseconds(300));  // late, but contributes
      q.contribute(0, &g, 1);
      QuorumResult a = q.wait(0, &g);
      s0[size_t(r)] = a.contributors;
      float h = float(r + 1);                                      // step 1 gradients: 1, 2, 3
      // Rank 2 reaches step 1 at ~300 ms (after its late step 0); the others at ~600 ms.
      if (r != 2) std::this_thread::sleep_for(milliseconds(600));
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
// rank leaves while another still gathers its reports).
void between_two_steps(int quorum, milliseconds deadline,
                       const std::function<void(QuorumAllreduce&, int)>& between) {
  run_ranks(4, {}, [&](Communicator& comm) {
    QuorumOptions qo;
    qo.quorum = quorum;
    qo.deadline = deadline;
    QuorumAllreduce q(comm, 4, qo);
    std::vector<float> buf(4, 1.f);
    q.contribute(0, buf.data(), 4);
    q.wait(0, buf.data());
    between(q, comm.rank());
    q.contribute(1, buf.data(), 4);
    q.wait(1, buf.data());
  });
}

TEST(Quorum, ReportsGatherAtTheCoordinatorWithoutBlockingTheOthers) {
  std::atomic<int> gathered{0};
  between_two_steps(3, milliseconds(3000), [&](QuorumAllreduce& q, int r) {
    if (q.membership().coordinator() != r) {
      // Rank 3 never reports key 10 in 4 parts (it splits it in 3, as if it saw 3 members):
      // the coordinator stops waiting at its deadline.
      if (r != 3) q.reports().report(10, r, 4, {double(r), 0.5 * r});
      if (r == 3) q.reports().report(10, 2, 3, {99.0});
      q.reports().report(11, r, 4, {double(10 * r)});
    } else {
      EXPECT_THROW(q.reports().report(12, 4, 4, {1.0}), UsageError);           // part out of range
      EXPECT_THROW(q.reports().report(12, 0, 4, std::vector<double>(9)), UsageError);  // too many
      auto t0 = std::chrono::steady_clock::now();
      auto a = q.reports().gather_reports(10, 4, r, t0 + milliseconds(300));
      EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(290));
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
  EXPECT_EQ(gathered.load(), 1);
}

// A coordinator that lags the others by many evaluations (a small quorum lets them run ahead)
// still gathers every key's parts, oldest first: its reports are kept until it gathers them.
// (Kept for the newest 16 keys only, key 100's parts were gone by the time it asked, so it
// waited out its deadline and evaluated the others' slices itself, at every evaluation.)
TEST(Quorum, ALaggingCoordinatorStillGathersEveryReport) {
  constexpr int kKeys = 40;
  std::atomic<int> reported{0}, gathered{0};
  between_two_steps(4, milliseconds(20000), [&](QuorumAllreduce& q, int r) {
    if (q.membership().coordinator() != r) {
      for (int k = 0; k < kKeys; ++k) q.reports().report(uint64_t(100 + k), r, 4, {double(1000 * r + k)});
      ++reported;
    } else {
      // Behind the others by all their reports, and then some (they are on their way).
      while (reported.load() < 3) std::this_thread::sleep_for(milliseconds(5));
      std::this_thread::sleep_for(milliseconds(300));
      for (int k = 0; k < kKeys; ++k) {
        auto got = q.reports().gather_reports(uint64_t(100 + k), 4, r,
                                    std::chrono::steady_clock::now() + milliseconds(10000));
        ASSERT_EQ(got.size(), 3u) << "key " << 100 + k;
        for (auto& [part, v] : got) EXPECT_EQ(v, (std::vector<double>{1000.0 * part + k}));
      }
      ++gathered;
    }
  });
  EXPECT_EQ(gathered.load(), 1);
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

// The coordinator (rank 0) is cut off from the others by the fault endpoint mid-run: the
// majority elects rank 1 and goes on; the cut-off rank never decides a step of its own (the
// quorum of 2 needs another rank) and stops with an error. Every step that two ranks both
// completed has one contributor set and the same bits on both.
TEST(QuorumMembership, CutOffCoordinatorIsReplacedAndNoStepHasTwoOutcomes) {
  const int world = 4, steps = 60, cut_at = 20;
  const size_t count = 37;
  QuorumOptions qo;
  qo.quorum = 2;
  qo.deadline = milliseconds(3000);
  qo.evict = milliseconds(200);
  net::InprocFabric fabric(world);
  std::vector<net::FaultEndpoint*> fault(static_cast<size_t>(world), nullptr);
  std::vector<std::vector<StepRecord>> rec(static_cast<size_t>(world));
  std::vector<std::string> error(static_cast<size_t>(world));
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto fe = std::make_unique<net::FaultEndpoint>(fabric.endpoint(r),
                                                       std::vector<net::FaultRule>{});
        fault[size_t(r)] = fe.get();
        ++ready;
        while (ready.load() < world) std::this_thread::yield();
        Communicator comm(std::move(fe), CommOptions{});
        QuorumAllreduce q(comm, count, qo);
        std::vector<float> buf(count);
        for (uint64_t t = 0; t < uint64_t(steps); ++t) {
          if (r == 0 && t == uint64_t(cut_at))
            for (int p = 1; p < world; ++p) {
              fault[0]->cut(p);
              fault[size_t(p)]->cut(0);
            }
          for (size_t j = 0; j < count; ++j) buf[j] = grad(j, r, t);
          q.contribute(t, buf.data(), count);
          QuorumResult res = q.wait(t, buf.data());
          rec[size_t(r)].push_back({res.contributors, buf});
          std::this_thread::sleep_for(milliseconds(2));
        }
      } catch (const std::exception& e) {
        error[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(error[size_t(r)], "") << "rank " << r;
    ASSERT_EQ(rec[size_t(r)].size(), size_t(steps)) << "rank " << r;
  }
  EXPECT_NE(error[0], "") << "the cut-off coordinator went on alone";
  EXPECT_LE(rec[0].size(), size_t(cut_at) + 1) << error[0];
  for (int r = 0; r < world; ++r)
    for (size_t t = 0; t < rec[size_t(r)].size(); ++t) {
      EXPECT_EQ(rec[size_t(r)][t].bitmap, rec[1][t].bitmap) << "rank " << r << " step " << t;
      EXPECT_EQ(rec[size_t(r)][t].out, rec[1][t].out) << "rank " << r << " step " << t;
    }
}

// Reports gathered at the coordinator stop waiting for a sender that has left the job: rank
// 3 is cut off by the fault endpoint before it reports; the coordinator's gather names the
// senders and returns once rank 3 is evicted (200 ms), long before its 20 s deadline, with
// the other ranks' parts.
TEST(QuorumMembership, GatherStopsWaitingForASenderThatLeft) {
  const int world = 4;
  const size_t count = 8;
  QuorumOptions qo;
  qo.quorum = 3;
  qo.deadline = milliseconds(3000);
  qo.evict = milliseconds(200);
  net::InprocFabric fabric(world);
  std::vector<net::FaultEndpoint*> fault(static_cast<size_t>(world), nullptr);
  std::atomic<int> ready{0}, reported{0}, past{0};
  std::map<int, std::vector<double>> got;
  double gather_s = -1;
  std::vector<std::string> error(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto fe = std::make_unique<net::FaultEndpoint>(fabric.endpoint(r),
                                                       std::vector<net::FaultRule>{});
        fault[size_t(r)] = fe.get();
        ++ready;
        while (ready.load() < world) std::this_thread::yield();
        Communicator comm(std::move(fe), CommOptions{});
        QuorumAllreduce q(comm, count, qo);
        std::vector<float> buf(count, float(r));
        for (uint64_t t = 0; t < 3; ++t) {
          q.contribute(t, buf.data(), count);
          q.wait(t, buf.data());
        }
        // Every rank completed step 2 in view 0 before rank 3 goes silent: all see the
        // same members.
        ++past;
        while (past.load() < world) std::this_thread::yield();
        const std::vector<int> members = q.membership().members();
        if (r == 3) {
          for (int p = 0; p < 3; ++p) {
            fault[3]->cut(p);
            fault[size_t(p)]->cut(3);
          }
          ++reported;
          return;  // silent from now on
        }
        ASSERT_EQ(members, (std::vector<int>{0, 1, 2, 3}));
        if (q.membership().coordinator() != r) {
          q.reports().report(7, r, world, {double(r)});
          ++reported;
        } else {
          while (reported.load() < world - 1) std::this_thread::sleep_for(milliseconds(1));
          const auto t0 = std::chrono::steady_clock::now();
          got = q.reports().gather_reports(7, world, r, t0 + milliseconds(20000), members);
          gather_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        // The survivors go on without rank 3.
        for (uint64_t t = 3; t < 6; ++t) {
          q.contribute(t, buf.data(), count);
          q.wait(t, buf.data());
        }
      } catch (const std::exception& e) {
        error[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(error[size_t(r)], "") << "rank " << r;
  EXPECT_GE(gather_s, 0.0);
  EXPECT_LT(gather_s, 10.0) << "the gather waited for the evicted rank until its deadline";
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1], std::vector<double>{1.0});
  EXPECT_EQ(got[2], std::vector<double>{2.0});
  EXPECT_EQ(got.count(3), 0u);
}

}  // namespace
}  // namespace qring::testing
