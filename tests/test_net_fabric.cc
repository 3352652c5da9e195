// FabricEndpoint as real processes over libfabric's shm and tcp providers.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <thread>

#include "net/base/error.h"
#include "net/transport/doorbell.h"
#include "net/transport/fault_endpoint.h"
#include "net/transport/inproc_endpoint.h"
#include "proc_harness.h"

namespace qring::testing {
namespace {

using net::make_tag;
using net::Op;

uint8_t byte_at(size_t i, int rank) {
  return uint8_t((i * 131 + size_t(rank) * 7 + (i >> 9)) & 0xFF);
}

std::vector<uint8_t> pattern_buf(size_t n, int rank) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = byte_at(i, rank);
  return v;
}

bool check_buf(const std::vector<uint8_t>& v, int rank) {
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] != byte_at(i, rank)) {
      fprintf(stderr, "mismatch at %zu from rank %d\n", i, rank);
      return false;
    }
  return true;
}

const auto kDl = [] { return net::deadline_in(std::chrono::seconds(20)); };

// The Fabric tests' providers: "shm" (one libfabric endpoint per peer, the default there),
// "tcp", and "shm-single": shm with one endpoint for all peers (QRING_SHM_PAIRWISE=0).
std::unique_ptr<net::Endpoint> open_fabric(net::Rendezvous& rdv, const std::string& prov,
                                           size_t max_msg = 0, bool always_reg = false) {
  if (prov == "shm-single") {
    setenv("QRING_SHM_PAIRWISE", "0", 1);  // in the rank's own process
    return open_endpoint(rdv, "shm", max_msg, always_reg);
  }
  return open_endpoint(rdv, prov, max_msg, always_reg);
}

class Fabric : public ::testing::TestWithParam<std::string> {};

TEST_P(Fabric, ExchangeIsBitExactBothWays) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    int peer = 1 - r;
    for (size_t size :
         {size_t(0), size_t(1), size_t(4097), size_t(1) << 20, (size_t(1) << 22) + 5}) {
      auto out = pattern_buf(size, r);
      std::vector<uint8_t> in(size);
      auto rq = ep->irecv(peer, make_tag(Op::kUser, size & 0xFFFF, 1), in.data(), in.size());
      auto sq = ep->isend(peer, make_tag(Op::kUser, size & 0xFFFF, 1), out.data(), out.size());
      ep->wait(sq, kDl(), "send");
      ep->wait(rq, kDl(), "recv");
      if (rq->bytes != size || !check_buf(in, peer)) return 1;
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0) && res.exited(1, 0));
}

TEST_P(Fabric, ManyMessagesOutstandingAndTagsMatchedOutOfOrder) {
  const std::string prov = GetParam();
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const int kMsgs = 64;
    std::vector<std::vector<uint8_t>> in, out;
    std::vector<net::RequestPtr> reqs;
    // Receives posted in reverse tag order; sends in increasing order.
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      for (int k = kMsgs - 1; k >= 0; --k) {
        in.emplace_back(size_t(100 + 37 * k));
        reqs.push_back(
            ep->irecv(p, make_tag(Op::kUser, 7, size_t(k)), in.back().data(), in.back().size()));
      }
    }
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      for (int k = 0; k < kMsgs; ++k) {
        auto v = pattern_buf(size_t(100 + 37 * k), r * 1000 + k);
        out.push_back(std::move(v));
        reqs.push_back(
            ep->isend(p, make_tag(Op::kUser, 7, size_t(k)), out.back().data(), out.back().size()));
      }
    }
    ep->wait_all(reqs, kDl(), "exchange");
    size_t i = 0;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      for (int k = kMsgs - 1; k >= 0; --k, ++i)
        if (!check_buf(in[i], p * 1000 + k)) return 1;
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(res.exited(r, 0)) << "rank " << r;
}

TEST_P(Fabric, MessagesAboveTheSizeLimitAreSplitAndReassembled) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov, /*max_msg=*/4096);
    if (ep->max_message_size() != 4096) return 2;
    const size_t size = 300 * 1024 + 3;  // 76 fragments, not a multiple of the limit
    if (r == 0) {
      auto out = pattern_buf(size, 0);
      ep->wait(ep->isend(1, make_tag(Op::kUser, 1, 2), out.data(), size), kDl(), "send");
    } else {
      std::vector<uint8_t> in(size);
      auto q = ep->irecv(0, make_tag(Op::kUser, 1, 2), in.data(), size);
      ep->wait(q, kDl(), "recv");
      if (q->bytes != size || !check_buf(in, 0)) return 1;
    }
    return 0;
  });
  EXPECT_TRUE(res.exited(0, 0) && res.exited(1, 0));
}

TEST_P(Fabric, RegisteredMemoryPathDeliversData) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov, 0, /*always_register=*/true);
    auto out = pattern_buf(65536, r);
    std::vector<uint8_t> in(65536);
    ep->register_memory(out.data(), out.size());
    for (int it = 0; it < 3; ++it) {  // reuse: the cache must serve repeated buffers
      auto q = ep->irecv(1 - r, make_tag(Op::kUser, 3, it), in.data(), in.size());
      ep->wait(ep->isend(1 - r, make_tag(Op::kUser, 3, it), out.data(), out.size()), kDl());
      ep->wait(q, kDl());
      if (!check_buf(in, 1 - r)) return 1;
    }
    return 0;
  });
  EXPECT_TRUE(res.exited(0, 0) && res.exited(1, 0));
}

TEST_P(Fabric, CancelledReceiveFreesItsBufferAndLaterMessagesStillMatch) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    uint64_t tag = make_tag(Op::kUser, 9, 9);
    if (r == 1) {
      std::vector<uint8_t> a(64), b(64);
      auto q = ep->irecv(0, tag, a.data(), a.size());
      if (!ep->cancel(q)) return 1;
      if (q->state != net::RequestState::kCancelled) return 2;
      rdv.store().set("cancelled", "1");
      auto q2 = ep->irecv(0, tag, b.data(), b.size());
      ep->wait(q2, kDl());
      if (b[0] != 42) return 3;
      if (a[0] != 0) return 4;  // the cancelled buffer was not written
    } else {
      rdv.store().get("cancelled", kDl());
      std::vector<uint8_t> m(64, 42);
      ep->wait(ep->isend(1, tag, m.data(), m.size()), kDl());
    }
    return 0;
  });
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

TEST_P(Fabric, ExpiredDeadlineNamesThePeerItWaitedFor) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    if (r == 0) {
      std::vector<uint8_t> buf(16);
      auto q = ep->irecv(1, make_tag(Op::kUser, 5, 0), buf.data(), buf.size());
      auto t0 = std::chrono::steady_clock::now();
      try {
        ep->wait(q, net::deadline_in(std::chrono::milliseconds(200)), "test receive");
        return 1;
      } catch (const TimeoutError& e) {
        std::string m = e.what();
        if (m.find("rank 1") == std::string::npos || m.find("test receive") == std::string::npos)
          return 2;
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(2)) return 3;
      }
      ep->cancel(q);
    }
    return 0;
  });
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
}

TEST_P(Fabric, WildcardReceiveReportsTheMatchedTag) {
  const std::string prov = GetParam();
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    if (r == 0) {
      int seen = 0;
      for (int k = 0; k < 2; ++k) {
        uint32_t v = 0;
        auto q = ep->irecv(net::kAnyPeer, make_tag(Op::kControl, 1, 0), &v, sizeof(v),
                           net::kIgnoreChunk);
        ep->wait(q, kDl());
        int from = int(net::tag_chunk(q->matched_tag));
        if (v != uint32_t(from * 11)) return 1;
        seen |= 1 << from;
      }
      if (seen != 6) return 2;
    } else {
      uint32_t v = uint32_t(r * 11);
      ep->wait(ep->isend(0, make_tag(Op::kControl, 1, r), &v, sizeof(v)), kDl());
    }
    return 0;
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(res.exited(r, 0)) << "rank " << r;
}

// Any-peer receives while several peers send at once (pairwise shm: one receive per peer
// endpoint, the first message wins, one that another part took anyway goes to the next
// any-peer receive): every message arrives exactly once, each sender's in its order, and a
// pending any-peer receive can still be cancelled. Exact tags (shm loses unexpected messages
// matched through an ignore mask, docs/design.md).
TEST_P(Fabric, AnyPeerReceivesUnderRacingSendersGetEveryMessageOnceInOrder) {
  const std::string prov = GetParam();
  auto res = run_procs(4, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const uint64_t tag = make_tag(Op::kUser, 30, 0);
    const uint32_t kPerSender = 300;
    if (r != 0) {
      std::vector<uint32_t> out(kPerSender);
      std::vector<net::RequestPtr> reqs;
      for (uint32_t i = 0; i < kPerSender; ++i) {
        out[i] = uint32_t(r) << 16 | i;
        reqs.push_back(ep->isend(0, tag, &out[i], sizeof(uint32_t)));
      }
      ep->wait_all(reqs, kDl(), "sends");
      return 0;
    }
    // Up to 8 any-peer receives pending at a time, reposted as they complete.
    const size_t kWindow = 8, total = size_t(n - 1) * kPerSender;
    std::vector<uint32_t> slot(kWindow);
    std::vector<net::RequestPtr> reqs(kWindow);
    std::vector<uint32_t> next(size_t(n), 0);
    size_t posted = 0, got = 0;
    for (size_t k = 0; k < kWindow; ++k, ++posted)
      reqs[k] = ep->irecv(net::kAnyPeer, tag, &slot[k], sizeof(uint32_t));
    // Completed in posting order: take the oldest pending one each time.
    for (auto dl = kDl(); got < total;) {
      net::RequestPtr& q = reqs[got % kWindow];
      ep->wait(q, dl, "any-peer receive");
      if (!q->ok() || q->bytes != sizeof(uint32_t) || q->matched_tag != tag) return 1;
      const uint32_t v = slot[got % kWindow];
      const uint32_t from = v >> 16, seq = v & 0xFFFF;
      if (from < 1 || from >= uint32_t(n) || seq != next[from]++) {
        fprintf(stderr, "rank 0: message %zu: rank %u seq %u, expected seq %u\n", got, from, seq,
                from < uint32_t(n) ? next[from] - 1 : 0);
        return 2;
      }
      ++got;
      if (posted < total) {
        q = ep->irecv(net::kAnyPeer, tag, &slot[(got - 1) % kWindow], sizeof(uint32_t));
        ++posted;
      }
    }
    // Nothing more comes: a pending any-peer receive is cancelled, its buffer untouched.
    uint32_t none = 12345;
    auto q = ep->irecv(net::kAnyPeer, tag, &none, sizeof(none));
    for (int k = 0; k < 1000; ++k) ep->progress();
    if (q->done() || !ep->cancel(q) || q->state != net::RequestState::kCancelled) return 3;
    return none == 12345 && ep->suspect_peers().empty() ? 0 : 4;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 4; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

// Two peers' messages are already there when an any-peer receive is posted (pairwise shm:
// both of its parts match, one message is kept): directed receives posted afterwards still get
// each sender's messages in order, the kept one included.
TEST_P(Fabric, DirectedReceivesAfterAnAnyPeerReceiveGetEachSendersMessagesInOrder) {
  const std::string prov = GetParam();
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const uint64_t tag = make_tag(Op::kUser, 31, 0);
    if (r != 0) {
      uint32_t out[2] = {uint32_t(r) << 16, uint32_t(r) << 16 | 1};
      auto a = ep->isend(0, tag, &out[0], sizeof(uint32_t));
      auto b = ep->isend(0, tag, &out[1], sizeof(uint32_t));
      for (auto until = net::Clock::now() + std::chrono::milliseconds(100);
           net::Clock::now() < until;)
        ep->progress();
      rdv.store().set("sent/" + std::to_string(r), "1");
      ep->wait(a, kDl(), "send");
      ep->wait(b, kDl(), "send");
      rdv.store().get("done", kDl());
      return 0;
    }
    rdv.store().get("sent/1", kDl());
    rdv.store().get("sent/2", kDl());
    // Both peers' messages in before the any-peer receive is posted.
    for (auto until = net::Clock::now() + std::chrono::milliseconds(200); net::Clock::now() < until;)
      ep->progress();
    uint32_t v = 0;
    auto q = ep->irecv(net::kAnyPeer, tag, &v, sizeof(v));
    ep->wait(q, kDl(), "any-peer receive");
    const uint32_t first = v >> 16;
    if ((v & 0xFFFF) != 0 || (first != 1 && first != 2)) return 1;
    const uint32_t other = 3 - first;
    uint32_t a = 0, b = 0, c = 0;
    auto qa = ep->irecv(int(first), tag, &a, sizeof(a));
    auto qb = ep->irecv(int(other), tag, &b, sizeof(b));
    auto qc = ep->irecv(int(other), tag, &c, sizeof(c));
    ep->wait(qa, kDl(), "receive");
    ep->wait(qb, kDl(), "receive");
    ep->wait(qc, kDl(), "receive");
    rdv.store().set("done", "1");
    if (a != (first << 16 | 1) || b != other << 16 || c != (other << 16 | 1)) {
      fprintf(stderr, "rank 0: got %#x %#x %#x after %#x\n", a, b, c, v);
      return 2;
    }
    return ep->suspect_peers().empty() ? 0 : 3;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

// State letter of process `pid` in /proc/<pid>/stat ('T': stopped), or 0.
char process_state(pid_t pid) {
  std::string stat;
  try {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    stat.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure&) {
    return 0;  // the process is gone (ESRCH while reading)
  }
  size_t p = stat.rfind(')');
  return p != std::string::npos && p + 2 < stat.size() ? stat[p + 2] : 0;
}

// Rank 0 and every other rank exchange one message each way on `tag`: the connections are up.
void connect_both_ways(net::Endpoint& ep, int r, int n, uint64_t tag) {
  if (r != 0) {
    uint32_t v = 0, w = uint32_t(r);
    auto q = ep.irecv(0, tag, &v, sizeof(v));
    ep.wait(ep.isend(0, tag, &w, sizeof(w)), kDl(), "hello");
    ep.wait(q, kDl(), "hello");
    return;
  }
  std::vector<uint32_t> v(static_cast<size_t>(n)), w(static_cast<size_t>(n));
  std::iota(w.begin(), w.end(), 0u);
  std::vector<net::RequestPtr> reqs;
  for (int p = 1; p < n; ++p) {
    reqs.push_back(ep.irecv(p, tag, &v[size_t(p)], sizeof(uint32_t)));
    reqs.push_back(ep.isend(p, tag, &w[size_t(p)], sizeof(uint32_t)));
  }
  ep.wait_all(reqs, kDl(), "hello");
}

// Receives the "flood-count" messages rank 0 sent on `tag` (message i carries i): 0 when all
// arrived in order, 1 otherwise.
int receive_flood_in_order(net::Endpoint& ep, net::Store& store, uint64_t tag) {
  const size_t count = std::stoul(store.get("flood-count", kDl()));
  std::vector<uint32_t> in(count);
  for (size_t i = 0; i < count; i += 1024) {
    std::vector<net::RequestPtr> reqs;
    for (size_t j = i; j < std::min(count, i + 1024); ++j)
      reqs.push_back(ep.irecv(0, tag, &in[j], sizeof(uint32_t)));
    ep.wait_all(reqs, kDl(), "flood");
  }
  for (size_t i = 0; i < count; ++i)
    if (in[i] != uint32_t(i)) {
      fprintf(stderr, "rank 1: message %zu carries %u\n", i, in[i]);
      return 1;
    }
  return 0;
}

// A peer that stops reading holds back only the sends to itself (issue 13). Rank 1 stops
// itself (SIGSTOP); rank 0 sends it small messages until the provider pushes back (sends
// stay pending), then a send to rank 2 must still complete. With one queue of refused posts
// for the whole endpoint it waited behind the stopped peer's. After SIGCONT rank 1 gets every
// message, in order.
TEST_P(Fabric, StoppedPeerDoesNotHoldBackSendsToOtherPeers) {
  const std::string prov = GetParam();
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    net::Store& store = rdv.store();
    const uint64_t hello = make_tag(Op::kUser, 10, 0);
    const uint64_t flood = make_tag(Op::kUser, 11, 0);
    const uint64_t probe = make_tag(Op::kUser, 12, 0);
    connect_both_ways(*ep, r, n, hello);  // before anyone stops
    if (r == 1) {
      store.set("stopped-pid", std::to_string(getpid()));
      raise(SIGSTOP);  // rank 0 resumes it
      return receive_flood_in_order(*ep, store, flood);
    }
    if (r == 2) {
      uint32_t v = 0;
      auto q = ep->irecv(0, probe, &v, sizeof(v));
      ep->wait(q, kDl(), "probe");
      return v == 77 ? 0 : 1;
    }
    const pid_t stopped = pid_t(std::stol(store.get("stopped-pid", kDl())));
    struct Resume {
      pid_t pid;
      ~Resume() { kill(pid, SIGCONT); }
    } resume{stopped};
    for (auto dl = kDl(); process_state(stopped) != 'T';) {
      if (net::Clock::now() > dl) return 4;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Flood rank 1 until no send completes for 200 ms, then 4096 more so that the provider
    // refuses some for sure.
    const size_t kMax = size_t(1) << 20;
    std::vector<uint32_t> out(kMax);
    std::iota(out.begin(), out.end(), 0u);
    std::vector<net::RequestPtr> sends;
    auto done_count = [&] {
      size_t d = 0;
      for (auto it = sends.rbegin(); it != sends.rend() && !(*it)->done(); ++it) ++d;
      return sends.size() - d;  // sends complete in order here: count the done prefix
    };
    size_t extra = 0;
    while (extra < 4096) {
      if (sends.size() + 1024 > kMax) {
        fprintf(stderr, "rank 0: %zu sends to a stopped rank, no pushback\n", sends.size());
        return 5;
      }
      for (int k = 0; k < 1024; ++k) {
        const size_t i = sends.size();
        sends.push_back(ep->isend(1, flood, &out[i], sizeof(uint32_t)));
      }
      if (extra > 0) {
        extra += 1024;
        continue;
      }
      size_t before = done_count();
      auto quiet_since = net::Clock::now();
      while (net::Clock::now() - quiet_since < std::chrono::milliseconds(200)) {
        ep->progress();
        size_t now_done = done_count();
        if (now_done == sends.size()) break;
        if (now_done != before) {
          before = now_done;
          quiet_since = net::Clock::now();
        }
      }
      if (done_count() < sends.size()) extra = 1;  // stalled: the provider pushes back
    }
    for (int k = 0; k < 100; ++k) ep->progress();
    fprintf(stderr, "rank 0: %zu sends to stopped rank 1, %zu done\n", sends.size(), done_count());
    uint32_t v = 77;
    auto q = ep->isend(2, probe, &v, sizeof(v));
    try {
      ep->wait(q, net::deadline_in(std::chrono::seconds(5)), "send to rank 2");
    } catch (const TimeoutError& e) {
      fprintf(stderr, "rank 0: %s\n", e.what());
      return 3;
    }
    if (!ep->suspect_peers().empty()) return 6;  // a stopped peer is no error
    kill(stopped, SIGCONT);
    store.set("flood-count", std::to_string(sends.size()));
    ep->wait_all(sends, kDl(), "flood");
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

// shm completes a send above its inject size (4 KiB: CMA, SAR or mmap, which need an answer
// from the receiver) through one response queue per sending endpoint, read strictly in order.
// With one libfabric endpoint for all peers, a large send to a peer that stopped (SIGSTOP) or
// died (SIGKILL) therefore held back the completion of every later large send of that rank to
// ANY peer: in a 4-rank ring where rank 2 died, rank 3's sends to rank 0 never completed.
// Rank 1 stops itself; rank 0 posts 256 KiB to it, then (kill: after SIGKILLing rank 1)
// 256 KiB to rank 2, which must complete within 5 s with the right bytes both ways. A stopped
// rank 1 gets its message intact once resumed.
int large_send_to_lost_peer(const std::string& prov, bool kill_it, int r, net::Rendezvous& rdv) {
  auto ep = open_fabric(rdv, prov);
  net::Store& store = rdv.store();
  const size_t kBig = size_t(256) << 10;
  const uint64_t hello = make_tag(Op::kUser, 20, 0), big = make_tag(Op::kUser, 21, 0);
  const uint64_t back = make_tag(Op::kUser, 22, 0);
  // Every link used once, both ways, before anyone stops (connections up over tcp).
  {
    std::vector<uint32_t> in(3), out{0, 1, 2};
    std::vector<net::RequestPtr> reqs;
    for (int p = 0; p < 3; ++p) {
      if (p == r) continue;
      reqs.push_back(ep->irecv(p, hello, &in[size_t(p)], sizeof(uint32_t)));
      reqs.push_back(ep->isend(p, hello, &out[size_t(r)], sizeof(uint32_t)));
    }
    ep->wait_all(reqs, kDl(), "hello");
  }
  if (kill_it) rdv.lost({1});  // the final store barrier does not wait for it
  if (r == 1) {
    store.set("lost-pid", std::to_string(getpid()));
    raise(SIGSTOP);  // rank 0 resumes it (or kills it)
    std::vector<uint8_t> in(kBig);
    auto q = ep->irecv(0, big, in.data(), in.size());
    ep->wait(q, kDl(), "large message from rank 0");
    return q->bytes == kBig && check_buf(in, 0) ? 0 : 1;
  }
  if (r == 2) {
    std::vector<uint8_t> in(kBig);
    auto out = pattern_buf(kBig, 2);
    auto q = ep->irecv(0, big, in.data(), in.size());
    ep->wait(q, kDl(), "large message from rank 0");
    if (q->bytes != kBig || !check_buf(in, 0)) return 1;
    ep->wait(ep->isend(0, back, out.data(), out.size()), kDl(), "large send to rank 0");
    store.get("rank0-done", kDl());  // keep the endpoint open until rank 0 is through
    return 0;
  }
  const pid_t lost = pid_t(std::stol(store.get("lost-pid", kDl())));
  struct Resume {
    pid_t pid;
    ~Resume() { kill(pid, SIGCONT); }
  } resume{lost};
  for (auto dl = kDl(); process_state(lost) != 'T';) {
    if (net::Clock::now() > dl) return 4;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto out = pattern_buf(kBig, 0);
  std::vector<uint8_t> in(kBig);
  auto to_lost = ep->isend(1, big, out.data(), out.size());
  for (auto until = net::Clock::now() + std::chrono::milliseconds(100); net::Clock::now() < until;)
    ep->progress();
  // (Over tcp;ofi_rxm the send completes anyway: below the eager limit it is written out.)
  if (kill_it) {
    kill(lost, SIGKILL);
    for (auto dl = kDl(); process_state(lost) != 'Z' && process_state(lost) != 0;) {
      if (net::Clock::now() > dl) return 6;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Its shm regions stay behind (nobody else would remove them): unlink them.
    if (DIR* d = opendir("/dev/shm")) {
      const std::string prefix = std::to_string(lost) + ":";
      while (dirent* e = readdir(d))
        if (std::string(e->d_name).rfind(prefix, 0) == 0)
          unlink(("/dev/shm/" + std::string(e->d_name)).c_str());
      closedir(d);
    }
  }
  auto q = ep->irecv(2, back, in.data(), in.size());
  auto to_2 = ep->isend(2, big, out.data(), out.size());
  try {
    ep->wait(to_2, net::deadline_in(std::chrono::seconds(5)), "large send to rank 2");
    ep->wait(q, net::deadline_in(std::chrono::seconds(5)), "large message from rank 2");
  } catch (const TimeoutError& e) {
    fprintf(stderr, "rank 0: %s\n", e.what());
    return 3;
  }
  if (!to_2->ok() || q->bytes != kBig || !check_buf(in, 2)) return 7;
  store.set("rank0-done", "1");
  if (!kill_it) {
    kill(lost, SIGCONT);
    ep->wait(to_lost, kDl(), "large send to the resumed rank 1");
    if (!to_lost->ok() || !ep->suspect_peers().empty()) return 8;
  }
  return 0;
}

TEST_P(Fabric, LargeSendToAStoppedPeerDoesNotHoldBackLargeSendsToOthers) {
  const std::string prov = GetParam();
  if (prov == "shm-single") GTEST_SKIP() << "one shm endpoint for all peers has this problem";
  auto res = run_procs(
      3, [&](int r, int n, net::Rendezvous& rdv) { return large_send_to_lost_peer(prov, false, r, rdv); });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

TEST_P(Fabric, LargeSendToAKilledPeerDoesNotHoldBackLargeSendsToOthers) {
  const std::string prov = GetParam();
  if (prov == "shm-single") GTEST_SKIP() << "one shm endpoint for all peers has this problem";
  auto res = run_procs(
      3, [&](int r, int n, net::Rendezvous& rdv) { return large_send_to_lost_peer(prov, true, r, rdv); });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(WIFSIGNALED(res.status[1]) && WTERMSIG(res.status[1]) == SIGKILL) << res.status[1];
  EXPECT_TRUE(res.exited(2, 0)) << res.status[2];
}

// An error that concerns one peer (here: a message longer than the receive) fails that
// request and marks the peer suspect; traffic with the other peers goes on. (Over
// tcp;ofi_rxm, libfabric 1.17 loses what that peer sends after a truncated message, so the
// suspect peer itself is not exercised further.)
TEST_P(Fabric, ErrorFromOnePeerFailsOnlyItsRequestAndMarksThePeerSuspect) {
  const std::string prov = GetParam();
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    net::Store& store = rdv.store();
    const uint64_t bad = make_tag(Op::kUser, 13, 0), good = make_tag(Op::kUser, 14, 0);
    if (r == 0) {
      std::vector<uint8_t> small(16), in(64);
      auto q = ep->irecv(1, bad, small.data(), small.size());
      store.set("posted", "1");
      for (auto dl = kDl(); !q->done();) {
        ep->progress();
        if (net::Clock::now() > dl) return 1;
      }
      if (q->state != net::RequestState::kError || q->error.find("rank 1") == std::string::npos) {
        fprintf(stderr, "rank 0: state %d error '%s'\n", int(q->state), q->error.c_str());
        return 2;
      }
      if (ep->suspect_peers() != std::vector<int>{1}) return 3;
      // After the error, both ways with rank 2.
      auto out = pattern_buf(64, 0);
      auto q2 = ep->irecv(2, good, in.data(), in.size());
      store.set("errored", "1");
      ep->wait(ep->isend(2, good, out.data(), out.size()), kDl(), "send to rank 2");
      ep->wait(q2, kDl(), "receive from rank 2");
      if (!check_buf(in, 2)) return 4;
      if (ep->suspect_peers() != std::vector<int>{1}) return 5;
    } else if (r == 1) {
      store.get("posted", kDl());
      auto big = pattern_buf(64, r);
      ep->wait(ep->isend(0, bad, big.data(), big.size()), kDl(), "send");
      if (!ep->suspect_peers().empty()) return 6;
    } else {
      store.get("errored", kDl());
      auto out = pattern_buf(64, 2);
      std::vector<uint8_t> in(64);
      auto q = ep->irecv(0, good, in.data(), in.size());
      ep->wait(ep->isend(0, good, out.data(), out.size()), kDl(), "send");
      ep->wait(q, kDl(), "receive");
      if (!check_buf(in, 0) || !ep->suspect_peers().empty()) return 7;
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

// Drives endpoints until `pred` holds or 5 s pass.
template <typename Pred>
bool progress_until(std::initializer_list<net::Endpoint*> eps, Pred pred) {
  for (auto dl = net::deadline_in(std::chrono::seconds(5)); !pred();) {
    if (net::Clock::now() > dl) return false;
    for (auto* e : eps) e->progress();
  }
  return true;
}

// Drives endpoints for `d` (for things that must NOT happen).
void progress_for(std::initializer_list<net::Endpoint*> eps, std::chrono::milliseconds d) {
  for (auto until = net::Clock::now() + d; net::Clock::now() < until;)
    for (auto* e : eps) e->progress();
}

// At the end of a job the peers close their connections in any order: an error with a peer
// that said goodbye (expect_departure) still fails the request and marks the peer suspect,
// but is no warning; the same error with a peer that did not say goodbye is one. (The errors
// here are truncations, which every provider reports at once; a closed connection's comes
// whenever the transport notices.)
TEST(EndpointSuspects, ErrorsWithAPeerThatSaidGoodbyeAreNoWarnings) {
  auto res = run_procs(3, [](int r, int, net::Rendezvous& rdv) {
    std::ostringstream log;
    spdlog::default_logger()->sinks().push_back(
        std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
    auto ep = open_fabric(rdv, "tcp");
    net::Store& store = rdv.store();
    const uint64_t bad = make_tag(Op::kUser, 31, 0);
    if (r != 0) {
      store.get("posted", kDl());
      auto big = pattern_buf(64, r);
      ep->wait(ep->isend(0, bad, big.data(), big.size()), kDl(), "send");
      store.get("done", kDl());  // the endpoint stays open until rank 0 is through
      return 0;
    }
    ep->expect_departure(1);
    std::vector<uint8_t> small1(16), small2(16);
    auto q1 = ep->irecv(1, bad, small1.data(), small1.size());
    auto q2 = ep->irecv(2, bad, small2.data(), small2.size());
    store.set("posted", "1");
    for (auto dl = kDl(); !q1->done() || !q2->done();) {
      ep->progress();
      if (net::Clock::now() > dl) return 1;
    }
    const int code = q1->state != net::RequestState::kError ||
                             q2->state != net::RequestState::kError                ? 2
                     : ep->suspect_peers() != std::vector<int>{1, 2}               ? 3
                     : log.str().find("rank 1 is suspect") != std::string::npos   ? 4
                     : log.str().find("rank 2 is suspect") == std::string::npos   ? 5
                                                                                   : 0;
    store.set("done", "1");
    return code;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << ": " << res.status[size_t(r)];
}

TEST(EndpointSuspects, InprocTruncationFailsTheReceiveAndMarksItsSender) {
  net::InprocFabric fabric(3);
  net::FaultEndpoint f0(fabric.endpoint(0), {});  // forwards suspect_peers()
  net::Endpoint& e0 = f0;
  auto e1 = fabric.endpoint(1), e2 = fabric.endpoint(2);
  const uint64_t tag = make_tag(Op::kUser, 1, 0), good = make_tag(Op::kUser, 2, 0);
  uint32_t small = 0, v = 0;
  std::vector<uint8_t> big(16, 1);
  // Receive posted first: the error arrives through progress().
  auto q1 = e0.irecv(1, tag, &small, sizeof(small));
  e1->isend(0, tag, big.data(), big.size());
  ASSERT_TRUE(progress_until({&e0}, [&] { return q1->done(); }));
  EXPECT_EQ(q1->state, net::RequestState::kError);
  EXPECT_NE(q1->error.find("rank 1"), std::string::npos) << q1->error;
  // Message first (unexpected), from rank 2, to an any-peer receive: the sender is known.
  e2->isend(0, tag, big.data(), big.size());
  auto q2 = e0.irecv(net::kAnyPeer, tag, &small, sizeof(small));
  ASSERT_TRUE(progress_until({&e0}, [&] { return q2->done(); }));
  EXPECT_EQ(q2->state, net::RequestState::kError);
  EXPECT_NE(q2->error.find("rank 2"), std::string::npos) << q2->error;
  // The endpoint goes on with the suspect peer.
  uint32_t w = 5;
  auto q3 = e0.irecv(1, good, &v, sizeof(v));
  e1->isend(0, good, &w, sizeof(w));
  ASSERT_TRUE(progress_until({&e0}, [&] { return q3->done(); }));
  EXPECT_TRUE(q3->ok());
  EXPECT_EQ(v, 5u);
  EXPECT_EQ(e0.suspect_peers(), (std::vector<int>{1, 2}));
  EXPECT_TRUE(e1->suspect_peers().empty());
}

// Rank 0 behind a FaultEndpoint with no rules, ranks 1 and 2 plain, on one in-process fabric.
class FaultEndpointCut : public ::testing::Test {
 protected:
  static uint64_t tag(int k) { return make_tag(Op::kUser, 3, k); }
  net::InprocFabric fabric{3};
  net::FaultEndpoint f0{fabric.endpoint(0), {}};
  net::Endpoint& e0 = f0;
  std::unique_ptr<net::Endpoint> e1 = fabric.endpoint(1), e2 = fabric.endpoint(2);
};

// cut(X): everything to X is dropped, nothing from X completes (receives posted before the
// cut included), traffic with other ranks goes on, and nothing is reported.
TEST_F(FaultEndpointCut, CutPeerIsSilentBothWaysAndOthersAreUnaffected) {
  uint32_t a = 0, b = 0, c = 0, d = 0, one = 1, two = 2;
  // Before the cut: traffic with rank 1 flows.
  auto r0 = e0.irecv(1, tag(0), &a, sizeof(a));
  e1->isend(0, tag(0), &one, sizeof(one));
  ASSERT_TRUE(progress_until({&e0}, [&] { return r0->done(); }));
  EXPECT_TRUE(r0->ok());
  auto before = e0.irecv(1, tag(1), &b, sizeof(b));  // posted before the cut
  std::thread([&] { f0.cut(1); }).join();            // from another thread
  EXPECT_TRUE(f0.is_cut(1));
  EXPECT_FALSE(f0.is_cut(2));
  e1->isend(0, tag(1), &one, sizeof(one));
  e1->isend(0, tag(2), &one, sizeof(one));
  auto after = e0.irecv(1, tag(2), &c, sizeof(c));  // message already there
  auto s1 = e0.isend(1, tag(3), &two, sizeof(two));
  EXPECT_TRUE(s1->ok());  // the sender cannot tell
  auto at1 = e1->irecv(0, tag(3), &d, sizeof(d));
  // Rank 2, both ways: unaffected.
  uint32_t from2 = 0, at2 = 0;
  auto r2 = e0.irecv(2, tag(4), &from2, sizeof(from2));
  e2->isend(0, tag(4), &two, sizeof(two));
  auto s2 = e0.isend(2, tag(5), &two, sizeof(two));
  auto q2 = e2->irecv(0, tag(5), &at2, sizeof(at2));
  ASSERT_TRUE(progress_until({&e0, e1.get(), e2.get()},
                             [&] { return r2->done() && s2->done() && q2->done(); }));
  EXPECT_TRUE(r2->ok() && s2->ok() && q2->ok());
  EXPECT_EQ(from2, 2u);
  EXPECT_EQ(at2, 2u);
  progress_for({&e0, e1.get(), e2.get()}, std::chrono::milliseconds(100));
  EXPECT_FALSE(before->done());
  EXPECT_FALSE(after->done());
  EXPECT_FALSE(at1->done());
  EXPECT_EQ(f0.dropped(), 1u);
  EXPECT_TRUE(e0.suspect_peers().empty());  // a cut is silence, not an error
  EXPECT_TRUE(e0.cancel(before));
  EXPECT_TRUE(e0.cancel(after));
  EXPECT_EQ(before->state, net::RequestState::kCancelled);
  EXPECT_EQ(after->state, net::RequestState::kCancelled);
  EXPECT_TRUE(e1->cancel(at1));
  EXPECT_THROW(f0.cut(3), UsageError);
}

// refuse(X): a cut that the sender is told of, as tcp's sends to a host that is gone: every
// send to X fails at once naming X, X becomes a suspect, nothing from X completes, and traffic
// with the others goes on.
TEST_F(FaultEndpointCut, RefusedPeerFailsSendsAndBecomesASuspect) {
  uint32_t a = 0, two = 2, at2 = 0;
  f0.refuse(1);
  EXPECT_TRUE(f0.is_cut(1));
  EXPECT_TRUE(e0.suspect_peers().empty());  // nothing was refused yet
  auto s1 = e0.isend(1, tag(0), &two, sizeof(two));
  ASSERT_TRUE(s1->done());
  EXPECT_EQ(s1->state, net::RequestState::kError);
  EXPECT_NE(s1->error.find("rank 1: Connection refused"), std::string::npos) << s1->error;
  EXPECT_EQ(e0.suspect_peers(), (std::vector<int>{1}));
  auto r1 = e0.irecv(1, tag(1), &a, sizeof(a));
  e1->isend(0, tag(1), &two, sizeof(two));
  auto s2 = e0.isend(2, tag(2), &two, sizeof(two));
  auto q2 = e2->irecv(0, tag(2), &at2, sizeof(at2));
  ASSERT_TRUE(progress_until({&e0, e1.get(), e2.get()}, [&] { return s2->done() && q2->done(); }));
  EXPECT_TRUE(s2->ok() && q2->ok());
  EXPECT_EQ(at2, 2u);
  progress_for({&e0, e1.get(), e2.get()}, std::chrono::milliseconds(50));
  EXPECT_FALSE(r1->done());
  EXPECT_TRUE(e0.cancel(r1));
  EXPECT_THROW(f0.refuse(3), UsageError);
}

// Messages a rule delays wait per peer: a long delay towards rank 1 holds back nothing to 2.
TEST_F(FaultEndpointCut, DelayedMessagesToOnePeerDoNotHoldBackAnother) {
  std::vector<net::FaultRule> rules(1);
  rules[0].dst = 1;
  rules[0].delay = std::chrono::seconds(30);
  net::InprocFabric ruled(3);
  net::FaultEndpoint f(ruled.endpoint(0), rules);
  net::Endpoint& e = f;
  auto to = ruled.endpoint(2);
  uint32_t v = 7, got = 0;
  auto held = e.isend(1, tag(0), &v, sizeof(v));
  auto s2 = e.isend(2, tag(0), &v, sizeof(v));
  auto q2 = to->irecv(0, tag(0), &got, sizeof(got));
  ASSERT_TRUE(progress_until({&e, to.get()}, [&] { return s2->done() && q2->done(); }));
  EXPECT_EQ(got, 7u);
  EXPECT_FALSE(held->done());
  EXPECT_EQ(f.delayed(), 1u);
}

// A rank SIGKILLed earlier leaves /dev/shm/<pid>:0:0 behind; a new process that gets the same
// pid must still open its shm endpoint.
TEST(FabricProvider, StaleShmRegionOfAnEarlierProcessWithThisPidIsRemoved) {
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    std::string stale = "/dev/shm/" + std::to_string(getpid()) + ":0:0";
    {
      std::ofstream f(stale);
      f << std::string(4096, 'x');
    }
    auto ep = open_endpoint(rdv, "shm");
    uint32_t v = uint32_t(r), got = 99;
    auto q = ep->irecv(1 - r, make_tag(Op::kUser, 1, 1), &got, sizeof(got));
    ep->wait(ep->isend(1 - r, make_tag(Op::kUser, 1, 1), &v, sizeof(v)), kDl());
    ep->wait(q, kDl());
    return got == uint32_t(1 - r) ? 0 : 1;
  });
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// A process blocked on its doorbell wakes when another process rings it, and a wait nobody
// ends returns at its timeout, saying nothing came.
TEST(Doorbell, AnotherProcessRingingEndsTheWaitAndAnUnrungWaitTimesOut) {
  auto own = net::Doorbell::own();
  ASSERT_TRUE(own);
  EXPECT_EQ(own, net::Doorbell::own());  // one per process
  const uint32_t token = own->token();
  EXPECT_FALSE(own->wait(token, std::chrono::milliseconds(1)));
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto bell = net::Doorbell::of(parent);
    if (bell) bell->ring();
    auto mine = net::Doorbell::own();  // its own, not the parent's it inherited
    const bool own_ok = mine && mine != own && net::Doorbell::of(getpid());
    mine.reset();  // removes its file (_exit runs no destructors)
    _exit(bell && own_ok ? 0 : 1);
  }
  const bool rung = own->wait(token, std::chrono::seconds(60));
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(rung);
  EXPECT_NE(own->token(), token);
  EXPECT_FALSE(net::Doorbell::of(child));  // an exited process's bell is gone or never was
}

TEST(Doorbell, PidOfAShmAddress) {
  EXPECT_EQ(net::Doorbell::pid_in_shm_address("fi_shm://1234:0:1"), 1234);
  EXPECT_EQ(net::Doorbell::pid_in_shm_address("77:2:0"), 77);
  EXPECT_EQ(net::Doorbell::pid_in_shm_address("fi_shm://abc"), 0);
  EXPECT_EQ(net::Doorbell::pid_in_shm_address("fi_sockaddr_in://127.0.0.1:80"), 0);
  EXPECT_EQ(net::Doorbell::pid_in_shm_address(""), 0);
}

// With FabricOptions::doorbells, over shm a rank that waits for traffic (no polling) is woken
// by its peer's send, which it then receives; over tcp the endpoint does not offer such waits,
// and without the option neither does shm.
TEST_P(Fabric, ShmPeerSendingWakesARankWaitingForTraffic) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    if (open_fabric(rdv, prov)->wakes_on_traffic()) return 4;  // off unless asked for
    if (prov == "shm-single") setenv("QRING_SHM_PAIRWISE", "0", 1);
    net::FabricOptions o;
    o.provider = prov == "shm-single" ? "shm" : prov;
    o.doorbells = true;
    auto ep = net::make_fabric_endpoint(o, rdv.info().rank, rdv.info().world_size, rdv.store(),
                                        rdv.single_host(), kDl());
    const bool shm = prov != "tcp";
    if (ep->wakes_on_traffic() != shm) return 2;
    uint32_t v = 7, got = 0;
    {  // connected first (shm's first send to a peer waits for the peer to take it)
      uint32_t hello = 1, back = 0;
      auto q = ep->irecv(1 - r, make_tag(Op::kUser, 2, 1), &back, sizeof(back));
      ep->wait(ep->isend(1 - r, make_tag(Op::kUser, 2, 1), &hello, sizeof(hello)), kDl());
      ep->wait(q, kDl());
    }
    const auto tag = make_tag(Op::kUser, 3, 1);
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ep->wait(ep->isend(1, tag, &v, sizeof(v)), kDl());
      return 0;
    }
    auto q = ep->irecv(0, tag, &got, sizeof(got));
    const uint32_t token = ep->traffic_token();
    ep->progress();
    const bool woken = q->done() || ep->wait_traffic(token, std::chrono::seconds(20));
    ep->wait(q, kDl());
    return got == 7 && woken == shm ? 0 : 3;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// Large messages that arrive before their receive is posted (over tcp;ofi_rxm those up to
// the eager limit qring sets are read into a temporary buffer and copied at the match,
// larger ones wait for the receive as a rendezvous) are delivered whole and in tag order.
TEST_P(Fabric, LargeMessagesSentBeforeTheReceiveIsPostedArriveIntact) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const size_t sizes[] = {size_t(1) << 20, (size_t(4) << 20) + 3, (size_t(12) << 20) + 1};
    if (r == 0) {
      std::vector<std::vector<uint8_t>> out;
      std::vector<net::RequestPtr> reqs;
      for (size_t k = 0; k < 3; ++k) {
        out.push_back(pattern_buf(sizes[k], int(k)));
        reqs.push_back(ep->isend(1, make_tag(Op::kUser, 5, k), out.back().data(), sizes[k]));
      }
      ep->wait_all(reqs, kDl(), "sends");
    } else {
      // Let the sends arrive first (drive progress meanwhile so they are read).
      auto until = net::Clock::now() + std::chrono::milliseconds(300);
      while (net::Clock::now() < until) ep->progress();
      for (size_t k = 3; k-- > 0;) {  // receives in reverse order of the sends
        std::vector<uint8_t> in(sizes[k]);
        auto q = ep->irecv(0, make_tag(Op::kUser, 5, k), in.data(), in.size());
        ep->wait(q, kDl(), "recv");
        if (q->bytes != sizes[k] || !check_buf(in, int(k))) return 1;
      }
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// A receiver that gave up on messages (an abandoned collective: its receive cancelled, or
// never posted) discards them: the sender's later sends to it complete. Over shm a large send
// completes only once the receiver takes it, and an endpoint completes its sends in order, so
// without the discard neither the unwanted send nor any later one to that rank would.
TEST_P(Fabric, DiscardedMessagesDoNotHoldBackTheSendersLaterOnes) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const size_t big = 64 << 10;
    const uint64_t early = make_tag(Op::kUser, 7, 1);   // sent before the receiver gives up
    const uint64_t late = make_tag(Op::kUser, 7, 2);    // given up before it is sent
    const uint64_t wanted = make_tag(Op::kUser, 7, 3);  // sent after both, received
    auto until = [] { return net::deadline_in(std::chrono::seconds(20)); };
    if (r == 0) {
      std::vector<uint8_t> a = pattern_buf(big, 1), b = pattern_buf(big, 2), c = pattern_buf(big, 3);
      auto s1 = ep->isend(1, early, a.data(), a.size());
      rdv.store().set("early", "1");
      rdv.store().get("given_up", kDl());
      auto s2 = ep->isend(1, late, b.data(), b.size());
      auto s3 = ep->isend(1, wanted, c.data(), c.size());
      // Short: the sends complete at once when discarded, never when not.
      ep->wait_all(std::vector<net::RequestPtr>{s1, s2, s3},
                   net::deadline_in(std::chrono::seconds(5)), "sends");
      if (!s1->ok() || !s2->ok() || !s3->ok()) return 1;
      rdv.store().set("sent", "1");
      rdv.store().get("received", kDl());
    } else {
      rdv.store().get("early", kDl());
      // Let the unwanted message arrive unexpected first.
      auto t = net::Clock::now() + std::chrono::milliseconds(200);
      while (net::Clock::now() < t) ep->progress();
      std::vector<uint8_t> given_up(big);
      auto q = ep->irecv(0, late, given_up.data(), given_up.size());
      if (!ep->cancel(q)) return 2;
      ep->discard(0, early, big, until());
      ep->discard(0, late, big, until());
      rdv.store().set("given_up", "1");
      std::vector<uint8_t> in(big);
      auto w = ep->irecv(0, wanted, in.data(), in.size());
      ep->wait(w, kDl(), "wanted");
      if (!check_buf(in, 3)) return 3;
      if (given_up[0] != 0 || given_up[big - 1] != 0) return 4;  // the cancelled buffer is untouched
      rdv.store().get("sent", kDl());
      if (!ep->suspect_peers().empty()) return 5;
      rdv.store().set("received", "1");
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// rxm refuses connections between endpoints with different eager limits; qring reports the
// difference when the endpoints meet instead of timing out later.
TEST(FabricProvider, DifferentRxmEagerLimitsAreAClearError) {
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    setenv("FI_OFI_RXM_EAGER_LIMIT", r == 0 ? "65536" : "131072", 1);
    try {
      open_endpoint(rdv, "tcp");
    } catch (const ConfigError& e) {
      std::string m = e.what();
      fprintf(stderr, "rank %d: %s\n", r, m.c_str());
      return m.find("FI_OFI_RXM_EAGER_LIMIT") != std::string::npos &&
                     m.find("eager=131072") != std::string::npos &&
                     m.find("eager=65536") != std::string::npos
                 ? 0
                 : 2;
    }
    return 1;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// Congestion control of every TCP socket of this process except those of the rendezvous
// store (local or peer port store_port): what libfabric's tcp provider opened for qring.
std::vector<std::string> fabric_socket_congestion(int store_port) {
  std::vector<std::string> out;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
    int type = 0, domain = 0;
    socklen_t len = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
    len = sizeof(domain);
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || domain != AF_INET) continue;
    sockaddr_in local{}, peer{};
    socklen_t ll = sizeof(local), pl = sizeof(peer);
    getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll);
    bool connected = getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) == 0;
    if (ntohs(local.sin_port) == store_port || (connected && ntohs(peer.sin_port) == store_port))
      continue;
    char cc[32] = {};
    len = sizeof(cc);
    if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, &len) == 0) out.emplace_back(cc);
  }
  closedir(d);
  return out;
}

std::string system_congestion() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_congestion_control");
  std::string s;
  f >> s;
  return s;
}

// QRING_TCP_CONGESTION (net/transport/tcp_tuning.h): the listening socket and the connections libfabric
// opens for an endpoint get the setting from their start; the store's sockets keep the
// system's. Case: setting, expected congestion control ("" = the system's).
class TcpCongestion : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(TcpCongestion, FabricConnectionsGetTheSettingAndStillDeliver) {
  const auto [setting, expected_in] = GetParam();
  const std::string expected = *expected_in ? expected_in : system_congestion();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    if (*setting)
      setenv("QRING_TCP_CONGESTION", setting, 1);
    else
      unsetenv("QRING_TCP_CONGESTION");
    auto ep = open_endpoint(rdv, "tcp");
    const int peer = 1 - r;
    // Both directions, so each rank has connected or accepted.
    for (int i = 0; i < 2; ++i) {
      auto out = pattern_buf(size_t(1) << 20, r);
      std::vector<uint8_t> in(out.size());
      auto rq = ep->irecv(peer, make_tag(Op::kUser, 7, i), in.data(), in.size());
      auto sq = ep->isend(peer, make_tag(Op::kUser, 7, i), out.data(), out.size());
      ep->wait(sq, kDl(), "send");
      ep->wait(rq, kDl(), "recv");
      if (!check_buf(in, peer)) return 1;
    }
    auto ccs = fabric_socket_congestion(rdv.info().store_port);
    std::string all;
    for (const auto& c : ccs) all += c + " ";
    fprintf(stderr, "rank %d: fabric sockets: %s(expected %s)\n", r, all.c_str(),
            expected.c_str());
    // At least the listener and one connection; every one with the expected setting.
    if (ccs.size() < 2) return 2;
    for (const auto& c : ccs)
      if (c != expected) return 3;
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

INSTANTIATE_TEST_SUITE_P(
    Settings, TcpCongestion,
    ::testing::Values(std::make_pair("", "cubic"), std::make_pair("auto", "cubic"),
                      std::make_pair("reno", "reno"), std::make_pair("system", ""),
                      // Unknown: a warning, and the system's default.
                      std::make_pair("no-such-algorithm", "")),
    [](const auto& info) {
      std::string s = *info.param.first ? info.param.first : "unset";
      for (auto& ch : s)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

TEST(FabricProvider, AliasesResolve) {
  EXPECT_EQ(net::resolve_provider("tcp", false), "tcp;ofi_rxm");
  EXPECT_EQ(net::resolve_provider("auto", true), "shm");
  EXPECT_EQ(net::resolve_provider("verbs", false), "verbs;ofi_rxm");
  EXPECT_EQ(net::resolve_provider("psm3", false), "psm3");
}

TEST(FabricProvider, UnknownProviderIsAClearError) {
  auto res = run_procs(1, [&](int r, int n, net::Rendezvous& rdv) {
    try {
      open_endpoint(rdv, "no-such-provider");
    } catch (const ConfigError& e) {
      return std::string(e.what()).find("no-such-provider") != std::string::npos ? 0 : 2;
    }
    return 1;
  });
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
}

// Ranks that disagree on pairwise endpoints would look for addresses the others never
// publish; the difference is a ConfigError naming the variable. A bad value is one too.
TEST(FabricProvider, DifferentShmPairwiseSettingsAreAClearError) {
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    setenv("QRING_SHM_PAIRWISE", r == 0 ? "0" : "1", 1);
    try {
      open_endpoint(rdv, "shm");
    } catch (const ConfigError& e) {
      std::string m = e.what();
      fprintf(stderr, "rank %d: %s\n", r, m.c_str());
      return m.find("QRING_SHM_PAIRWISE") != std::string::npos ? 0 : 2;
    }
    return 1;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
  auto bad = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    setenv("QRING_SHM_PAIRWISE", "yes", 1);
    try {
      open_endpoint(rdv, "shm");
    } catch (const ConfigError& e) {
      return std::string(e.what()).find("QRING_SHM_PAIRWISE") != std::string::npos ? 0 : 2;
    }
    return 1;
  });
  EXPECT_TRUE(bad.exited(0, 0)) << bad.status[0];
  EXPECT_TRUE(bad.exited(1, 0)) << bad.status[1];
}

// FabricOptions::pairwise = kOn works with other providers too (tcp: one listener and
// connection set per peer endpoint): every pair exchanges 1 MiB both ways, bit-exact.
TEST(FabricProvider, PairwiseEndpointsOverTcpDeliver) {
  auto res = run_procs(3, [&](int r, int n, net::Rendezvous& rdv) {
    net::FabricOptions o;
    o.provider = "tcp";
    o.pairwise = net::FabricOptions::Pairwise::kOn;
    auto ep = net::make_fabric_endpoint(o, r, n, rdv.store(), rdv.single_host(), kDl());
    std::vector<std::vector<uint8_t>> in(size_t(n), std::vector<uint8_t>(size_t(1) << 20));
    auto out = pattern_buf(size_t(1) << 20, r);
    std::vector<net::RequestPtr> reqs;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      reqs.push_back(ep->irecv(p, make_tag(Op::kUser, 40, 0), in[size_t(p)].data(), out.size()));
      reqs.push_back(ep->isend(p, make_tag(Op::kUser, 40, 0), out.data(), out.size()));
    }
    ep->wait_all(reqs, kDl(), "exchange");
    for (int p = 0; p < n; ++p)
      if (p != r && !check_buf(in[size_t(p)], p)) return 1;
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(res.exited(r, 0)) << "rank " << r;
}

// Immediate data (the collectives' operation descriptors) rides with every message: small and
// large, sent before or after the receive is posted, split into fragments, taken by an any-peer
// receive, and (tcp) on a message truncated by a too small receive.
TEST_P(Fabric, ImmediateDataArrivesWithEveryMessage) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov, /*max_msg=*/size_t(256) << 10);
    const size_t sizes[] = {0, 1, 5000, size_t(1) << 20};
    auto data_of = [](size_t k) { return 0x8000000000000000ull | (k * 0x1234567ull + 1); };
    if (r == 1) {
      std::vector<std::vector<uint8_t>> in;
      std::vector<net::RequestPtr> reqs;
      for (size_t k = 0; k < 4; ++k) {  // posted before the sends
        in.emplace_back(sizes[k]);
        reqs.push_back(ep->irecv(0, make_tag(Op::kUser, 50, k), in.back().data(), sizes[k]));
      }
      rdv.store().set("posted", "1");
      rdv.store().get("sent", kDl());
      for (size_t k = 4; k < 8; ++k) {  // after: unexpected at first
        in.emplace_back(sizes[k - 4]);
        reqs.push_back(ep->irecv(0, make_tag(Op::kUser, 50, k), in.back().data(), sizes[k - 4]));
      }
      std::vector<uint8_t> any(64);
      reqs.push_back(ep->irecv(net::kAnyPeer, make_tag(Op::kUser, 51, 0), any.data(), any.size()));
      ep->wait_all(reqs, kDl(), "receives");
      for (size_t k = 0; k < reqs.size(); ++k)
        if (reqs[k]->data != data_of(k)) {
          fprintf(stderr, "message %zu: data %llx\n", k, (unsigned long long)reqs[k]->data);
          return 1;
        }
      std::vector<uint8_t> small(8);
      auto t = ep->irecv(0, make_tag(Op::kUser, 52, 0), small.data(), small.size());
      try {
        ep->wait(t, kDl(), "truncated");
        return 2;
      } catch (const IoError&) {
      }
      // libfabric 1.17's shm reports no immediate data with a truncation error (tcp;ofi_rxm
      // does): there the rank whose receives come up short names the mismatch instead.
      if (t->data != data_of(99) && !(prov != "tcp" && t->data == 0)) return 3;
    } else {
      rdv.store().get("posted", kDl());
      std::vector<uint8_t> out(size_t(1) << 20, 3);
      std::vector<net::RequestPtr> reqs;
      for (size_t k = 0; k < 8; ++k)
        reqs.push_back(ep->isend(1, make_tag(Op::kUser, 50, k), out.data(), sizes[k % 4], data_of(k)));
      reqs.push_back(ep->isend(1, make_tag(Op::kUser, 51, 0), out.data(), 64, data_of(8)));
      rdv.store().set("sent", "1");
      reqs.push_back(ep->isend(1, make_tag(Op::kUser, 52, 0), out.data(), 64, data_of(99)));
      ep->wait_all(reqs, kDl(), "sends");
    }
    rdv.store().set(fmt::format("done/{}", r), "1");
    rdv.store().get(fmt::format("done/{}", 1 - r), kDl());
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// close() ends every request: a posted receive is cancelled and its buffer never written, a
// send that the peer never takes ends too, and the endpoint refuses new work.
TEST_P(Fabric, CloseEndsEveryRequestAndReleasesTheBuffers) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
    auto ep = open_fabric(rdv, prov);
    const uint64_t tag = make_tag(Op::kUser, 60, 0);
    if (r == 1) {
      std::vector<uint8_t> in(size_t(1) << 20, 0), big(size_t(4) << 20, 1);
      auto rv = ep->irecv(0, tag, in.data(), in.size());
      // A send rank 0 never receives: large over tcp (it stays in flight). Over shm it is
      // small: libfabric 1.17's shm crashed the receiving process now and then (4 of 25 runs,
      // SIGSEGV in its progress) when a peer closed with a large send to it outstanding, with
      // or without qring's changes (the destructor always closed that way).
      const size_t n = prov == "tcp" ? big.size() : 64;
      auto sv = ep->isend(0, make_tag(Op::kUser, 61, 0), big.data(), n);
      ep->close();
      if (!ep->closed()) return 1;
      if (rv->state != net::RequestState::kCancelled) return 2;
      if (!sv->done()) return 3;
      rdv.store().set("closed", "1");
      rdv.store().get("sent", kDl());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (ep->progress() != 0) return 4;
      for (uint8_t v : in)
        if (v != 0) return 5;
      try {
        ep->irecv(0, tag, in.data(), in.size());
        return 6;
      } catch (const IoError&) {
      }
      try {
        ep->isend(0, tag, in.data(), 1);
        return 7;
      } catch (const IoError&) {
      }
      ep->close();  // idempotent
    } else {
      rdv.store().get("closed", kDl());
      // A send to the closed rank, over tcp only: libfabric 1.17's shm crashed this process
      // in its progress (SIGSEGV inside fi_cq_read) in about a third of the runs on a loaded
      // machine when it sent to a peer whose endpoint was closed, 64 bytes or 1 MiB alike
      // (docs/design.md, the fault section's "Limits").
      if (prov == "tcp") {
        std::vector<uint8_t> out(size_t(1) << 20, 9);
        auto sv = ep->isend(1, tag, out.data(), out.size());
        try {  // it may still complete into the kernel's buffers: bounded either way
          ep->wait(sv, net::deadline_in(std::chrono::milliseconds(500)), "send to a closed rank");
        } catch (const Error&) {
        }
      }
      rdv.store().set("sent", "1");
      ep->close();
    }
    return 0;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << res.status[1];
}

// A peer address in the store that does not fit the provider's address format (another build,
// another provider, or a rank writing garbage) is a ProtocolError naming that rank, before
// fi_av_insert reads it. Rank 1 publishes the right settings line with a bad address.
TEST(FabricProvider, MalformedPeerAddressIsAProtocolErrorNamingTheRank) {
  for (const char* prov : {"tcp", "shm-single"}) {
    for (const std::string& bad : {std::string("abc"), std::string(16, 'x'), std::string(70, 'y')}) {
      auto res = run_procs(2, [&](int r, int n, net::Rendezvous& rdv) {
        if (r == 1) {
          const std::string setting =
              std::string(prov) == "tcp" ? "tcp;ofi_rxm eager=8388608" : "shm";
          rdv.store().set("fabric/addr/1", setting + "\n" + bad);
          rdv.store().get("done", kDl());
          return 0;
        }
        try {
          open_fabric(rdv, prov);
        } catch (const ProtocolError& e) {
          rdv.store().set("done", "1");
          const std::string m = e.what();
          fprintf(stderr, "%s\n", m.c_str());
          return m.find("the fabric address that rank 1 published is not a valid") !=
                         std::string::npos
                     ? 0
                     : 2;
        } catch (const std::exception& e) {
          rdv.store().set("done", "1");
          fprintf(stderr, "not a ProtocolError: %s\n", e.what());
          return 3;
        }
        rdv.store().set("done", "1");
        return 1;
      });
      EXPECT_FALSE(res.timed_out) << prov;
      EXPECT_TRUE(res.exited(0, 0)) << prov << " " << bad.size() << ": " << res.status[0];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, Fabric, ::testing::Values("shm", "tcp", "shm-single"));

}  // namespace
}  // namespace qring::testing
