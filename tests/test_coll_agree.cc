// Ranks that disagree, and failures that must not leave buffers with the transport (issue 15
// items 8, 9, 10), on the in-process endpoint:
//  - a collective called with another count, element type, reduction or root on one rank
//    fails on every rank with a UsageError naming that rank (operation descriptors, shape.h),
//    never a timeout and never mixed data; a message shorter than posted is never reduced;
//  - communicators whose settings differ (thresholds, segment size, protocol) fail to form
//    with a ConfigError naming both ranks and the setting;
//  - a failed collective whose receive cannot be cancelled closes the endpoint before the
//    caller hears of the failure, so no later message lands in the caller's buffer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "coll_harness.h"
#include "collectives/shape.h"
#include "net/base/error.h"

namespace qring::testing {
namespace {

using collectives::CollectiveTimeout;
using std::chrono::milliseconds;

// Runs fn(comm) on n threads, with per-rank options; collects each rank's error message
// ("" when it returned normally).
std::vector<std::string> run_disagreeing(
    int n, const std::function<CommOptions(int)>& opts_of,
    const std::function<void(Communicator&)>& fn) {
  net::InprocFabric fabric(n);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Communicator comm(fabric.endpoint(r), opts_of(r));
        fn(comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
        if (errors[size_t(r)].empty()) errors[size_t(r)] = "?";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

struct MismatchCase {
  const char* name;
  int ranks;
  // What every rank calls; rank `odd` calls it with `odd_call` instead.
  std::function<void(Communicator&, bool odd)> call;
  const char* expect;  // in every rank's error
};

std::vector<float> buffer(size_t n) {
  return std::vector<float>(n, 1.f);
}

void allreduce(Communicator& c, size_t n, DataType t, RedOp op) {
  std::vector<double> buf(n, 1.0);  // room for every element type
  c.allreduce(buf.data(), buf.data(), n, t, op);
}

const MismatchCase kMismatch[] = {
    {"RecursiveDoublingCount", 4,
     [](Communicator& c, bool odd) { allreduce(c, odd ? 65 : 64, DataType::kFloat32, RedOp::kSum); },
     "allreduce (recursive doubling) of 65 float32"},
    {"RecursiveDoublingTypeOfTheSameSize", 4,
     [](Communicator& c, bool odd) {
       allreduce(c, 64, odd ? DataType::kInt32 : DataType::kFloat32, RedOp::kSum);
     },
     "of 64 int32"},
    {"RecursiveDoublingReduction", 5,
     [](Communicator& c, bool odd) { allreduce(c, 64, DataType::kFloat32, odd ? RedOp::kMax : RedOp::kSum); },
     "of 64 float32, max"},
    {"HalvingDoublingCount", 4,
     [](Communicator& c, bool odd) { allreduce(c, odd ? 20001 : 20000, DataType::kFloat32, RedOp::kSum); },
     "(halving-doubling) of 20001 float32"},
    {"RingType", 3,
     [](Communicator& c, bool odd) {
       allreduce(c, 90000, odd ? DataType::kInt64 : DataType::kFloat64, RedOp::kSum);
     },
     "allreduce (ring) of 90000 int64"},
    {"BroadcastCount", 4,
     [](Communicator& c, bool odd) {
       auto b = buffer(odd ? 10 : 12);
       c.broadcast(b.data(), b.size(), DataType::kFloat32, 0);
     },
     "broadcast (chain) of 10 float32 from rank 0"},
    {"BroadcastRoot", 4,
     [](Communicator& c, bool odd) {
       auto b = buffer(12);
       c.broadcast(b.data(), b.size(), DataType::kFloat32, odd ? 1 : 0);
     },
     "of 12 float32 from rank 1"},
    {"AllgatherCount", 3,
     [](Communicator& c, bool odd) {
       const size_t n = odd ? 7 : 8;
       auto in = buffer(n);
       std::vector<float> out(3 * 8);
       c.allgather(in.data(), out.data(), n, DataType::kFloat32);
     },
     "allgather (ring) of 7 float32"},
    {"ReduceScatterReduction", 3,
     [](Communicator& c, bool odd) {
       auto in = buffer(3 * 8);
       std::vector<float> out(8);
       c.reduce_scatter(in.data(), out.data(), 8, DataType::kFloat32,
                        odd ? RedOp::kMin : RedOp::kSum);
     },
     "reduce_scatter (ring) of 8 float32, min"},
};

class Mismatch : public ::testing::TestWithParam<MismatchCase> {};

// The odd rank is 2; every rank fails with a UsageError naming it, well before the timeout:
// in the collective itself, or (upstream ranks of a broadcast) in the next one.
TEST_P(Mismatch, FailsEveryRankNamingTheRank) {
  const MismatchCase& c = GetParam();
  CommOptions opts;
  opts.timeout = milliseconds(20000);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<char> usage(size_t(c.ranks), 0);  // one byte per rank thread (not vector<bool>)
  auto errors = run_disagreeing(
      c.ranks, [&](int) { return opts; },
      [&](Communicator& comm) {
        try {
          c.call(comm, comm.rank() == 2);
          // A rank upstream of the odd one in a broadcast chain completes (its data is
          // right) and learns of the mismatch by its next operation.
          comm.barrier();
        } catch (const UsageError&) {
          usage[size_t(comm.rank())] = true;
          throw;
        }
      });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_TRUE(usage[size_t(r)]) << "rank " << r << ": " << errors[size_t(r)];
    // Both ranks of the pair that met and both calls are named; rank 2's call is the odd one.
    EXPECT_NE(errors[size_t(r)].find("ranks disagree on the operation"), std::string::npos)
        << "rank " << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find("rank 2 "), std::string::npos)
        << "rank " << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find(c.expect), std::string::npos)
        << "rank " << r << ": " << errors[size_t(r)];
  }
}

INSTANTIATE_TEST_SUITE_P(Agree, Mismatch, ::testing::ValuesIn(kMismatch),
                         [](const auto& info) { return std::string(info.param.name); });

// Different operations under one sequence number never match each other's tags: the
// timeout's liveness probe names the rank and what it called instead. Rank 1, the odd one,
// waits longer than the others (the timeout is a rank's own setting): it is still there to
// answer their probes when theirs fire, whichever thread the scheduler started first. (With
// one timeout for all, rank 1 once started 75 ms before rank 0 under ThreadSanitizer, timed
// out first and closed its endpoint, so rank 0's probe found nobody to name.)
TEST(Mismatch, AnotherOperationIsNamedAtTheTimeout) {
  auto errors = run_disagreeing(
      3,
      [&](int r) {
        CommOptions opts;
        opts.timeout = milliseconds(r == 1 ? 2000 : 300);
        return opts;
      },
      [&](Communicator& comm) {
        if (comm.rank() == 1) {
          comm.barrier();
        } else {
          auto b = buffer(16);
          comm.allreduce(b.data(), b.data(), b.size(), DataType::kFloat32, RedOp::kSum);
        }
      });
  for (int r : {0, 2})
    EXPECT_NE(errors[size_t(r)].find("rank 1 called #0 as barrier"), std::string::npos)
        << errors[size_t(r)];
}

// A message shorter than the receive (with the right descriptor, so only its length is wrong)
// is a ProtocolError naming the sender; it is never reduced from stale scratch memory. Rank 1
// is a bare endpoint that speaks the protocol by hand.
TEST(Mismatch, ShortMessageIsAnErrorNotStaleScratch) {
  net::InprocFabric fabric(2);
  CommOptions opts;
  opts.timeout = milliseconds(5000);
  std::string error;
  std::vector<float> result(16, 1.f);
  std::thread fake([&] {
    auto ep = fabric.endpoint(1);
    const std::string hello = Communicator::settings_text(*ep, opts);
    const uint64_t tag = net::make_tag(net::Op::kHello, 0, 0);
    std::vector<char> in(4096);
    auto rv = ep->irecv(0, tag, in.data(), in.size());
    ep->wait(ep->isend(0, tag, hello.data(), hello.size()), net::deadline_in(milliseconds(5000)));
    ep->wait(rv, net::deadline_in(milliseconds(5000)));
    // Round 1 of a 2-rank recursive doubling of 16 float32: 8 of the 16 elements.
    collectives::Shape s;
    s.kind = net::Op::kAllreduce;
    s.algo = collectives::Algo::kRecursiveDoubling;
    s.count = 16;
    std::vector<float> half(8, 5.f);
    ep->wait(ep->isend(0, net::make_tag(net::Op::kAllreduce, 0, 1), half.data(),
                       half.size() * sizeof(float), collectives::encode_shape(s)),
             net::deadline_in(milliseconds(5000)));
    std::this_thread::sleep_for(milliseconds(300));  // stays up while rank 0 reads it
  });
  try {
    Communicator comm(fabric.endpoint(0), opts);
    comm.allreduce(result.data(), result.data(), result.size(), DataType::kFloat32, RedOp::kSum);
  } catch (const ProtocolError& e) {
    error = e.what();
  }
  fake.join();
  EXPECT_NE(error.find("rank 1 sent 32 bytes, expected 64"), std::string::npos) << error;
}

// ---- item 9: settings every rank must share.

TEST(Settings, DifferentAlgorithmThresholdsAreAConfigErrorNamingBothRanks) {
  auto errors = run_disagreeing(
      3,
      [](int r) {
        CommOptions o;
        o.timeout = milliseconds(5000);
        if (r == 1) o.small_allreduce_bytes = 4096;
        return o;
      },
      [](Communicator&) { ADD_FAILURE() << "a communicator formed"; });
  EXPECT_NE(errors[0].find("small_allreduce_bytes is '32768' on rank 0 and '4096' on rank 1"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("small_allreduce_bytes is '4096' on rank 1 and '32768' on rank 0"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[2].find("small_allreduce_bytes"), std::string::npos) << errors[2];
}

TEST(Settings, DifferentSegmentSizesAreAConfigError) {
  auto errors = run_disagreeing(
      2,
      [](int r) {
        CommOptions o;
        o.timeout = milliseconds(5000);
        o.segment_bytes = r == 0 ? 4096 : 8192;
        return o;
      },
      [](Communicator&) {});
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[size_t(r)].find("segment_bytes is '"), std::string::npos) << errors[size_t(r)];
}

TEST(Settings, SameSettingsFormACommunicatorAndLocalOnesMayDiffer) {
  auto errors = run_disagreeing(
      2,
      [](int r) {
        CommOptions o;
        o.timeout = milliseconds(5000);
        o.reduce_threads = r + 1;     // per host
        o.segments_in_flight = r + 1;  // pacing of this rank's own sends
        return o;
      },
      [](Communicator& c) {
        std::vector<float> b(100, 1.f);
        c.allreduce(b.data(), b.data(), b.size(), DataType::kFloat32, RedOp::kSum);
        if (b[0] != 2.f) throw std::runtime_error("wrong result");
      });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Settings, TextNamesVersionsBuildAndIsa) {
  net::InprocFabric fabric(1);
  auto ep = fabric.endpoint(0);
  const std::string t = Communicator::settings_text(*ep, CommOptions{});
  for (const char* key : {"protocol=", "quorum_wire=", "provider=inproc", "max_message_size=",
                          "small_allreduce_bytes=32768", "halving_doubling_bytes=1048576",
                          "segment_bytes=1048576", "build_id=", "kernel_isa="})
    EXPECT_NE(t.find(key), std::string::npos) << key << " in " << t;
  EXPECT_EQ(t.find("build_id=unknown"), std::string::npos) << t;  // linked with a build id
}

// A rank that speaks another protocol version (a bare endpoint sending edited settings).
TEST(Settings, AnotherProtocolVersionIsAConfigError) {
  net::InprocFabric fabric(2);
  CommOptions opts;
  opts.timeout = milliseconds(5000);
  std::thread fake([&] {
    auto ep = fabric.endpoint(1);
    std::string hello = Communicator::settings_text(*ep, opts);
    const size_t at = hello.find("protocol=");
    hello.replace(at, hello.find('\n', at) - at, "protocol=1");
    const uint64_t tag = net::make_tag(net::Op::kHello, 0, 0);
    ep->wait(ep->isend(0, tag, hello.data(), hello.size()), net::deadline_in(milliseconds(5000)));
    std::this_thread::sleep_for(milliseconds(200));
  });
  std::string error;
  try {
    Communicator comm(fabric.endpoint(0), opts);
  } catch (const ConfigError& e) {
    error = e.what();
  }
  fake.join();
  EXPECT_NE(error.find("protocol is '2' on rank 0 and '1' on rank 1"), std::string::npos) << error;
}

TEST(Settings, ARankThatNeverComesIsNamed) {
  net::InprocFabric fabric(3);
  CommOptions opts;
  opts.timeout = milliseconds(200);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        Communicator comm(fabric.endpoint(r), opts);
      } catch (const TimeoutError& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[size_t(r)].find("no settings from rank(s) 2"), std::string::npos)
        << errors[size_t(r)];
}

// ---- item 10: a failed operation leaves no buffer with the transport.

// Rank 1's broadcast times out (rank 0 is late) and its receive cannot be cancelled (fault
// injection). The engine closes the endpoint before the caller hears of the failure: when rank
// 0 broadcasts afterwards, nothing lands in rank 1's buffer. Without the close, the still
// posted receive took rank 0's data into memory the caller considered its own again.
TEST(Abort, UncancellableReceiveClosesTheEndpointBeforeTheCallerIsTold) {
  net::InprocFabric fabric(2);
  CommOptions opts;
  opts.timeout = milliseconds(300);
  std::atomic<bool> rank1_failed{false}, rank0_sent{false};
  std::vector<float> buf1(64, -1.f);
  std::string error1;
  bool closed1 = false;
  std::thread r0([&] {
    Communicator comm(fabric.endpoint(0), opts);
    while (!rank1_failed) std::this_thread::sleep_for(milliseconds(5));
    std::vector<float> b(64, 7.f);
    try {
      comm.broadcast(b.data(), b.size(), DataType::kFloat32, 0);
    } catch (const std::exception&) {
      // rank 1 no longer listens; what matters is that the data was sent
    }
    rank0_sent = true;
  });
  {
    auto fe = std::make_unique<net::FaultEndpoint>(fabric.endpoint(1), std::vector<net::FaultRule>{});
    net::FaultEndpoint* raw = fe.get();
    Communicator comm(std::move(fe), opts);
    raw->fail_cancels();
    try {
      comm.broadcast(buf1.data(), buf1.size(), DataType::kFloat32, 0);
    } catch (const CollectiveTimeout& e) {
      error1 = e.what();
    }
    closed1 = raw->closed();
    rank1_failed = true;
    while (!rank0_sent) std::this_thread::sleep_for(milliseconds(5));
    std::this_thread::sleep_for(milliseconds(50));  // the engine thread polls meanwhile
    EXPECT_TRUE(comm.broken());
  }
  r0.join();
  EXPECT_NE(error1.find("broadcast #0 timed out"), std::string::npos) << error1;
  EXPECT_TRUE(closed1);
  for (float v : buf1) ASSERT_EQ(v, -1.f) << "a message landed in the failed broadcast's buffer";
}

// Closing an endpoint withdraws what is posted: the receive ends cancelled, a later message
// to it is not written anywhere, and posting afterwards is an IoError.
TEST(Abort, ClosedEndpointReleasesPostedReceives) {
  net::InprocFabric fabric(2);
  auto a = fabric.endpoint(0), b = fabric.endpoint(1);
  std::vector<char> in(16, 0), out(16, 9);
  auto rv = b->irecv(0, 5, in.data(), in.size());
  b->close();
  EXPECT_EQ(rv->state, net::RequestState::kCancelled);
  a->wait(a->isend(1, 5, out.data(), out.size()), net::deadline_in(milliseconds(1000)));
  EXPECT_EQ(in, std::vector<char>(16, 0));
  EXPECT_THROW(b->irecv(0, 5, in.data(), in.size()), IoError);
  EXPECT_THROW(b->isend(0, 5, out.data(), out.size()), IoError);
  EXPECT_EQ(b->progress(), 0u);
  b->close();  // idempotent
}

}  // namespace
}  // namespace qring::testing
