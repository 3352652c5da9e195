// The parameter server transport of asynchronous SGD (collectives/param_server.h) on the
// in-process endpoint: every push taken once and in order, answers carry the parameters of
// the version they name, every wait bounded, misuse refused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "coll_harness.h"
#include "collectives/param_server.h"

namespace qring::testing {
namespace {

using collectives::CollectiveTimeout;
using collectives::ParamServer;
using collectives::ParamServerOptions;
using std::chrono::milliseconds;

// Gradient element j of worker r's push k: small integers, so every sum is exact.
float g(size_t j, int r, uint64_t k) {
  return float((j + 1) * (r + 1) + k % 5);
}

struct ServerLog {
  std::mutex mu;
  std::vector<std::pair<int, uint64_t>> order;   // (rank, push index) as taken
  std::map<uint64_t, float> param0_at_version;  // params[0] after update `version`
  std::vector<float> final_params;
};

// W ranks, each a worker pushing K gradients; rank 0 also serves on a thread of its own:
// params += grad for every push, answered with version = updates so far.
void run_ps(int W, int K, size_t n, ServerLog& log,
            std::vector<std::vector<std::pair<uint64_t, float>>>& pulled) {
  CommOptions co;
  co.timeout = std::chrono::seconds(10);
  pulled.assign(size_t(W), {});
  run_ranks(W, co, [&](Communicator& comm) {
    ParamServerOptions o;
    o.pushes_per_worker = K;
    o.deadline = milliseconds(5000);
    ParamServer ps(comm, n + 1, n, o);
    std::thread server;
    std::exception_ptr err;
    if (comm.rank() == 0) {
      server = std::thread([&] {
        try {
          std::vector<float> params(n, 0.0f);
          uint64_t version = 0;
          while (auto p = ps.next_push()) {
            for (size_t j = 0; j < n; ++j) params[j] += p->data[j];
            ++version;
            {
              std::lock_guard<std::mutex> lock(log.mu);
              log.order.emplace_back(p->rank, p->index);
              log.param0_at_version[version] = params[0];
              // The push carries the version it was computed on, which precedes its update.
              EXPECT_LT(p->version, version);
              EXPECT_EQ(p->data[n], float(p->rank * 1000 + p->index));  // the trailing slot
            }
            ps.reply(*p, params.data(), version);
          }
          log.final_params = params;
        } catch (...) {
          err = std::current_exception();
          ps.fail(err);
        }
      });
    }
    std::vector<float> grad(n + 1), params(n);
    uint64_t version = 0;
    for (int k = 0; k < K; ++k) {
      for (size_t j = 0; j < n; ++j) grad[j] = g(j, comm.rank(), uint64_t(k));
      grad[n] = float(comm.rank() * 1000 + k);
      ps.push(grad.data(), version);
      // The push is copied: the caller may reuse its buffer at once.
      std::fill(grad.begin(), grad.end(), -1.0f);
      uint64_t v = ps.pull(params.data());
      EXPECT_GT(v, version);
      version = v;
      pulled[size_t(comm.rank())].emplace_back(v, params[0]);
    }
    if (server.joinable()) server.join();
    if (err) std::rethrow_exception(err);
  });
}

TEST(ParamServer, EveryPushTakenOnceInOrderAndAnswersCarryTheirVersion) {
  for (int W : {1, 2, 4}) {
    const int K = 25;
    const size_t n = 300;
    ServerLog log;
    std::vector<std::vector<std::pair<uint64_t, float>>> pulled;
    run_ps(W, K, n, log, pulled);
    ASSERT_EQ(log.order.size(), size_t(W * K)) << W;
    std::vector<uint64_t> next(size_t(W), 0);
    for (auto [r, k] : log.order) EXPECT_EQ(k, next[size_t(r)]++) << "rank " << r;
    for (int r = 0; r < W; ++r) EXPECT_EQ(next[size_t(r)], uint64_t(K));
    // The server's parameters are the exact sum of every gradient.
    ASSERT_EQ(log.final_params.size(), n);
    for (size_t j = 0; j < n; ++j) {
      double want = 0;
      for (int r = 0; r < W; ++r)
        for (int k = 0; k < K; ++k) want += g(j, r, uint64_t(k));
      ASSERT_EQ(double(log.final_params[j]), want) << j;
    }
    // Each answer holds the parameters of the version it names.
    for (int r = 0; r < W; ++r) {
      ASSERT_EQ(pulled[size_t(r)].size(), size_t(K));
      for (auto [v, p0] : pulled[size_t(r)]) EXPECT_EQ(p0, log.param0_at_version.at(v));
    }
  }
}

// A worker that never pushes: the server's wait ends at its deadline, naming that worker.
TEST(ParamServer, ServerWaitIsBoundedAndNamesTheSilentWorker) {
  CommOptions co;
  co.timeout = std::chrono::seconds(10);
  std::atomic<bool> named{false};
  std::atomic<int> took{0};
  run_ranks(3, co, [&](Communicator& comm) {
    ParamServerOptions o;
    o.pushes_per_worker = 2;
    o.deadline = milliseconds(300);
    ParamServer ps(comm, 5, 4, o);
    std::vector<float> buf(5, 1.0f);
    if (comm.rank() == 1) {
      for (int k = 0; k < 2; ++k) {
        ps.push(buf.data(), 0);
        ps.pull(buf.data());
      }
    } else if (comm.rank() == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        while (auto p = ps.next_push()) {
          ++took;
          ps.reply(*p, buf.data(), 1);
        }
      } catch (const CollectiveTimeout& e) {
        const std::string m = e.what();
        named = m.find("rank 2 (0 of 2 pushes") != std::string::npos &&
                m.find("rank 0 (0 of 2") != std::string::npos &&
                m.find("rank 1 (") == std::string::npos;
        EXPECT_TRUE(named) << m;
      }
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
    } else {
      std::this_thread::sleep_for(milliseconds(600));  // rank 2: silent, then leaves
    }
  });
  EXPECT_TRUE(named);
  EXPECT_EQ(took.load(), 2);
}

// A server that takes pushes but never answers: the worker's pull ends at its deadline.
TEST(ParamServer, WorkerWaitIsBoundedWhenTheServerNeverAnswers) {
  CommOptions co;
  co.timeout = std::chrono::seconds(10);
  std::atomic<bool> timed_out{false};
  run_ranks(2, co, [&](Communicator& comm) {
    ParamServerOptions o;
    o.pushes_per_worker = 1;
    o.deadline = milliseconds(300);
    ParamServer ps(comm, 3, 3, o);
    std::vector<float> buf(3, 2.0f);
    if (comm.rank() == 1) {
      ps.push(buf.data(), 0);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        ps.pull(buf.data());
      } catch (const CollectiveTimeout& e) {
        timed_out = std::string(e.what()).find("no parameters from the server (rank 0)") !=
                    std::string::npos;
      }
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
    } else {
      std::this_thread::sleep_for(milliseconds(700));
    }
  });
  EXPECT_TRUE(timed_out);
}

TEST(ParamServer, MisuseIsRefused) {
  CommOptions co;
  co.timeout = std::chrono::seconds(10);
  run_ranks(2, co, [&](Communicator& comm) {
    ParamServerOptions o;
    o.pushes_per_worker = 2;
    o.deadline = milliseconds(2000);
    ParamServer ps(comm, 2, 2, o);
    std::vector<float> buf(2, 0.0f);
    // The server thread's parameters: not buf, which rank 0's worker pulls into meanwhile.
    const std::vector<float> params(2, 0.0f);
    std::thread server;
    if (comm.rank() == 1) {
      EXPECT_THROW(ps.next_push(), UsageError);
      EXPECT_THROW(ps.pull(buf.data()), UsageError);  // nothing pushed yet
    } else {
      server = std::thread([&] {
        while (auto p = ps.next_push()) ps.reply(*p, params.data(), 1);
      });
    }
    ps.push(buf.data(), 0);
    if (comm.rank() == 1) {
      EXPECT_THROW(ps.push(buf.data(), 0), UsageError);  // not pulled yet
    }
    ps.pull(buf.data());
    ps.push(buf.data(), 1);
    ps.pull(buf.data());
    EXPECT_THROW(ps.push(buf.data(), 2), UsageError);  // every worker pushes twice
    if (server.joinable()) server.join();
  });
  EXPECT_THROW(
      {
        net::InprocFabric f(1);
        Communicator comm(f.endpoint(0), co);
        ParamServerOptions o;
        o.server = 1;
        ParamServer ps(comm, 1, 1, o);
      },
      ConfigError);
}

}  // namespace
}  // namespace qring::testing
