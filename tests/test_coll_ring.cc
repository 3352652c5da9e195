// Ring all-reduce and the small collectives on the in-process endpoint: a grid over ranks,
// sizes, in/out of place, data types and reduction operators, checked bit-exactly.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "coll_harness.h"

namespace qring::testing {
namespace {

using collectives::CollectiveTimeout;

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kInt32,
                           DataType::kInt64, DataType::kBFloat16};
const RedOp kOps[] = {RedOp::kSum, RedOp::kAvg, RedOp::kMin, RedOp::kMax};

struct GridCase {
  int ranks;
  int size_kind;  // 0: 0, 1: 1, 2: ranks-1, 3: not divisible, 4: many segments
};

size_t size_of(const GridCase& c) {
  switch (c.size_kind) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return size_t(c.ranks - 1);
    case 3:
      return size_t(c.ranks) * 37 + 3;
    default:
      return size_t(c.ranks) * 211 + 5;
  }
}

class RingGrid : public ::testing::TestWithParam<GridCase> {};

enum class Algo { kRing, kRecursiveDoubling, kHalvingDoubling };

void allreduce_grid(const GridCase& c, Algo algo, int sends_in_flight = 0) {
  const size_t count = size_of(c);
  CommOptions opts;
  opts.timeout = std::chrono::seconds(20);
  // Tiny segments: many segments per chunk, several in flight, for the large sizes.
  opts.segment_bytes = c.size_kind == 4 ? 24 : 4096;
  opts.segments_in_flight = 3;
  opts.sends_in_flight = sends_in_flight;  // 0: unlimited on the in-process endpoint
  opts.small_allreduce_bytes = algo == Algo::kRecursiveDoubling ? SIZE_MAX : 0;
  opts.halving_doubling_bytes = algo == Algo::kHalvingDoubling ? SIZE_MAX : 0;
  std::atomic<size_t> wrong{0}, checked{0};
  run_ranks(c.ranks, opts, [&](Communicator& comm) {
    for (DataType t : kTypes) {
      size_t esz = collectives::dtype_size(t);
      for (RedOp op : kOps) {
        for (bool in_place : {false, true}) {
          std::vector<char> in(count * esz + 1), out(count * esz + 1, 0x5a);
          for (size_t j = 0; j < count; ++j) put(in.data(), j, t, pattern(j, comm.rank()));
          void* dst = in_place ? in.data() : out.data();
          comm.allreduce(in.data(), dst, count, t, op);
          wrong += count_wrong(dst, count, t, op, comm.size());
          if (!in_place) {
            // The input is untouched out of place.
            for (size_t j = 0; j < count; ++j) {
              std::vector<char> ref(esz);
              put(ref.data(), 0, t, pattern(j, comm.rank()));
              if (std::memcmp(in.data() + j * esz, ref.data(), esz)) ++wrong;
            }
            EXPECT_EQ(out[count * esz], char(0x5a)) << "wrote past the end";
          }
          ++checked;
        }
      }
    }
  });
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(checked.load(), size_t(c.ranks) * 5 * 4 * 2);
}

TEST_P(RingGrid, AllreduceRingBitExactEveryTypeOpAndPlacement) {
  allreduce_grid(GetParam(), Algo::kRing);
}

// One send outstanding per link (the default on shm and tcp): later segments queue behind it.
TEST_P(RingGrid, AllreduceRingOneSendAtATimeBitExactEveryTypeOpAndPlacement) {
  allreduce_grid(GetParam(), Algo::kRing, 1);
}

TEST_P(RingGrid, AllreduceRecursiveDoublingBitExactEveryTypeOpAndPlacement) {
  allreduce_grid(GetParam(), Algo::kRecursiveDoubling);
}

TEST_P(RingGrid, AllgatherReduceScatterBroadcast) {
  const GridCase c = GetParam();
  const size_t count = size_of(c);
  CommOptions opts;
  opts.timeout = std::chrono::seconds(20);
  opts.segment_bytes = c.size_kind == 4 ? 24 : 4096;
  std::atomic<size_t> wrong{0};
  run_ranks(c.ranks, opts, [&](Communicator& comm) {
    const int n = comm.size(), r = comm.rank();
    // allgather (float32 and bfloat16): block q holds pattern(j, q).
    for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
      size_t esz = collectives::dtype_size(t);
      std::vector<char> in(count * esz), out(count * esz * size_t(n));
      for (size_t j = 0; j < count; ++j) put(in.data(), j, t, pattern(j, r));
      comm.allgather(in.data(), out.data(), count, t);
      std::vector<char> ref(esz);
      for (int q = 0; q < n; ++q)
        for (size_t j = 0; j < count; ++j) {
          put(ref.data(), 0, t, pattern(j, q));
          if (std::memcmp(out.data() + (size_t(q) * count + j) * esz, ref.data(), esz)) ++wrong;
        }
    }
    // reduce_scatter: rank r gets the reduction of block r (elements r*count ...).
    for (RedOp op : kOps) {
      std::vector<float> in(count * size_t(n)), out(count, -99.f);
      for (size_t j = 0; j < in.size(); ++j) in[j] = float(pattern(j, r));
      comm.reduce_scatter(in.data(), out.data(), count, DataType::kFloat32, op);
      wrong += count_wrong(out.data(), count, DataType::kFloat32, op, n, size_t(r) * count);
    }
    // broadcast from every root.
    for (int root = 0; root < n; ++root) {
      std::vector<int64_t> buf(count);
      for (size_t j = 0; j < count; ++j) buf[j] = r == root ? int64_t(pattern(j, root)) : -1;
      comm.broadcast(buf.data(), count, DataType::kInt64, root);
      for (size_t j = 0; j < count; ++j)
        if (buf[j] != pattern(j, root)) ++wrong;
    }
    comm.barrier();
  });
  EXPECT_EQ(wrong.load(), 0u);
}

std::vector<GridCase> grid() {
  std::vector<GridCase> v;
  for (int n : {1, 2, 3, 4, 5, 7})
    for (int k = 0; k < 5; ++k) v.push_back({n, k});
  return v;
}

std::string case_name(const ::testing::TestParamInfo<GridCase>& i) {
  static const char* const kNames[] = {"zero", "one", "ranks_minus_1", "not_divisible",
                                       "many_segments"};
  return "n" + std::to_string(i.param.ranks) + "_" + kNames[i.param.size_kind];
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingGrid, ::testing::ValuesIn(grid()), case_name);

// Halving-doubling runs on power-of-two rank counts only (make_ring_op picks the ring for
// the others), so it has its own grid, up to 8 ranks (3 halving and 3 doubling steps).
class HalvingDoublingGrid : public ::testing::TestWithParam<GridCase> {};

TEST_P(HalvingDoublingGrid, AllreduceBitExactEveryTypeOpAndPlacement) {
  allreduce_grid(GetParam(), Algo::kHalvingDoubling);
}

std::vector<GridCase> pow2_grid() {
  std::vector<GridCase> v;
  for (int n : {2, 4, 8})
    for (int k = 0; k < 5; ++k) v.push_back({n, k});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Ranks, HalvingDoublingGrid, ::testing::ValuesIn(pow2_grid()), case_name);

TEST(Ring, ManyAsyncOperationsInFlightCompleteInOrderIndependently) {
  CommOptions opts;
  opts.segment_bytes = 256;
  std::atomic<size_t> wrong{0};
  run_ranks(4, opts, [&](Communicator& comm) {
    const size_t count = 1000;
    std::vector<std::vector<float>> bufs(8, std::vector<float>(count));
    std::vector<collectives::WorkPtr> works;
    for (size_t k = 0; k < bufs.size(); ++k) {
      for (size_t j = 0; j < count; ++j) bufs[k][j] = float(pattern(j + k, comm.rank()));
      works.push_back(comm.allreduce_async(bufs[k].data(), bufs[k].data(), count,
                                           DataType::kFloat32, RedOp::kSum));
    }
    for (size_t k = 0; k < bufs.size(); ++k) {
      works[k]->wait();
      wrong += count_wrong(bufs[k].data(), count, DataType::kFloat32, RedOp::kSum, comm.size(), k);
    }
  });
  EXPECT_EQ(wrong.load(), 0u);
}

TEST(Ring, MissingRankTimesOutNamingTheAwaitedPeerAndBreaksCommunicator) {
  CommOptions opts;
  opts.timeout = std::chrono::milliseconds(300);
  const int n = 3, missing = 1;
  std::atomic<int> timeouts{0};
  std::vector<std::string> messages(n);
  run_ranks(n, opts, [&](Communicator& comm) {
    if (comm.rank() == missing) return;  // never joins
    std::vector<float> buf(100, 1.f);
    auto t0 = std::chrono::steady_clock::now();
    try {
      comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
      ADD_FAILURE() << "allreduce completed without rank " << missing;
    } catch (const CollectiveTimeout& e) {
      auto waited = std::chrono::steady_clock::now() - t0;
      EXPECT_LT(waited, std::chrono::milliseconds(300 + 1500));
      messages[size_t(comm.rank())] = e.what();
      ++timeouts;
    }
    EXPECT_TRUE(comm.broken());
    EXPECT_THROW(comm.barrier(), UsageError);
  });
  EXPECT_EQ(timeouts.load(), n - 1);
  // Rank 2 waits on its left neighbour, rank 1; rank 0 waits on rank 2, which is stuck
  // behind rank 1. The liveness probe makes both name the rank that is really missing.
  for (int r : {0, 2}) {
    EXPECT_NE(messages[size_t(r)].find("allreduce #0"), std::string::npos) << messages[size_t(r)];
    EXPECT_NE(messages[size_t(r)].find("liveness probe from rank(s) 1 "), std::string::npos)
        << messages[size_t(r)];
  }
}

TEST(Ring, AliveRankThatSkipsTheOperationIsNamed) {
  CommOptions opts;
  opts.timeout = std::chrono::milliseconds(300);
  std::atomic<int> finished{0};
  std::vector<std::string> messages(4);
  run_ranks(4, opts, [&](Communicator& comm) {
    if (comm.rank() == 3) {  // alive, engine running, but never joins the allreduce
      while (finished.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<float> buf(64, 1.f);
    try {
      comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
    } catch (const CollectiveTimeout& e) {
      messages[size_t(comm.rank())] = e.what();
    }
    ++finished;
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(messages[size_t(r)].find("rank(s) 3 alive but never started allreduce #0"),
              std::string::npos)
        << messages[size_t(r)];
}

TEST(Ring, DelayedMessagesStillGiveExactResults) {
  CommOptions opts;
  opts.segment_bytes = 64;
  std::vector<net::FaultRule> faults(1);
  faults[0].src = 2;
  faults[0].delay = std::chrono::milliseconds(20);
  faults[0].skip_first = 3;
  std::atomic<size_t> wrong{0};
  run_ranks(
      4, opts,
      [&](Communicator& comm) {
        std::vector<double> buf(301);
        for (size_t j = 0; j < buf.size(); ++j) buf[j] = pattern(j, comm.rank());
        comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat64, RedOp::kSum);
        wrong += count_wrong(buf.data(), buf.size(), DataType::kFloat64, RedOp::kSum, comm.size());
      },
      faults);
  EXPECT_EQ(wrong.load(), 0u);
}

TEST(Ring, DroppedMessageIsATimeoutNotAHang) {
  CommOptions opts;
  opts.timeout = std::chrono::milliseconds(300);
  std::vector<net::FaultRule> faults(1);
  faults[0].src = 0;
  faults[0].op = net::Op::kAllreduce;  // the data, not the settings exchanged at creation
  faults[0].drop = true;
  std::atomic<int> failed{0};
  run_ranks(
      2, opts,
      [&](Communicator& comm) {
        std::vector<float> buf(10, 1.f);
        try {
          comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
        } catch (const CollectiveTimeout&) {
          ++failed;
        }
      },
      faults);
  EXPECT_GE(failed.load(), 1);  // rank 1 never gets rank 0's data
}

}  // namespace
}  // namespace qring::testing
