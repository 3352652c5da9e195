// A rank that comes back (net/transport/endpoint.h, "Ranks that come back"): its peers reconnect to its
// new incarnation with Endpoint::reset_peer, and no message of the old incarnation -- sent
// before it died or was torn down, delivered late -- ever matches a receive of the new one.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "net/base/error.h"
#include "net/transport/fault_endpoint.h"
#include "net/transport/inproc_endpoint.h"
#include "proc_harness.h"

namespace qring::testing {
namespace {

using net::make_tag;
using net::Op;

const auto kDl = [] { return net::deadline_in(std::chrono::seconds(20)); };
constexpr uint64_t kTag = make_tag(Op::kUser, 7, 3);

// Drives `ep` for a while (what the old incarnation sent lands in its unexpected queue).
void pump(net::Endpoint& ep, std::chrono::milliseconds d) {
  const auto until = net::Clock::now() + d;
  while (net::Clock::now() < until) {
    ep.progress();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

class Rejoin : public ::testing::TestWithParam<std::string> {};

// Rank 1's first incarnation sends 1 under kTag and goes away before rank 0 receives it. Its
// second incarnation (same process, a new endpoint in join mode) sends 2 under the same tag:
// rank 0's receive gets 2, and a second one gets nothing more. Then traffic works both ways,
// a large message included (shm: by CMA through the replaced per-peer endpoint).
TEST_P(Rejoin, MessagesOfTheOldIncarnationNeverMatchTheNewOne) {
  const std::string prov = GetParam();
  auto res = run_procs(2, [&](int r, int, net::Rendezvous& rdv) {
    net::Store& store = rdv.store();
    std::vector<uint8_t> big(1 << 20);
    if (r == 0) {
      auto ep = open_endpoint(rdv, prov);
      // Progress while the old incarnation sends (tcp connects through both sides' progress).
      while (!store.check({"old-sent"})) pump(*ep, std::chrono::milliseconds(5));
      pump(*ep, std::chrono::milliseconds(200));
      const std::string addr = store.get("new-addr", kDl());
      if (ep->connected(1) != true) return 10;
      ep->reset_peer(1, addr, 1);
      store.set("addr-for-1", ep->published_address());
      uint32_t v = 0;
      auto rq = ep->irecv(1, kTag, &v, sizeof v);
      ep->wait(rq, kDl(), "the new incarnation's message");
      if (v != 2) {
        fprintf(stderr, "rank 0 got %u, expected 2 (1 is the old incarnation's)\n", v);
        return 1;
      }
      // Nothing else under that tag: the old message is gone for good.
      uint32_t extra = 0;
      auto rq2 = ep->irecv(1, kTag, &extra, sizeof extra);
      pump(*ep, std::chrono::milliseconds(200));
      if (rq2->done()) return 2;
      if (!ep->cancel(rq2)) return 3;
      uint32_t w = 3;
      auto sq = ep->isend(1, kTag, &w, sizeof w);
      ep->wait(sq, kDl(), "send to the new incarnation");
      for (size_t i = 0; i < big.size(); ++i) big[i] = uint8_t(i * 7);
      auto bq = ep->isend(1, make_tag(Op::kUser, 8, 0), big.data(), big.size());
      ep->wait(bq, kDl(), "large send to the new incarnation");
      store.get("done-1", kDl());
      return 0;
    }
    {
      auto old = open_endpoint(rdv, prov);
      uint32_t v = 1;
      auto sq = old->isend(0, kTag, &v, sizeof v);
      old->wait(sq, kDl(), "the old incarnation's send");
      store.set("old-sent", "1");
    }  // the old incarnation's endpoint is closed
    net::FabricOptions o;
    o.provider = prov;
    o.incarnation = 1;
    o.join = true;
    o.instance = 9;
    auto ep = net::make_fabric_endpoint(o, 1, 2, store, rdv.single_host(), kDl());
    if (ep->connected(0) || ep->incarnation() != 1) return 11;
    // A post to a peer that is not connected waits; reset_peer ends it.
    uint32_t early = 0;
    auto waiting = ep->irecv(0, kTag, &early, sizeof early);
    store.set("new-addr", ep->published_address());
    ep->reset_peer(0, store.get("addr-for-1", kDl()), 0);
    if (waiting->state != net::RequestState::kCancelled) return 12;
    uint32_t v = 2;
    auto sq = ep->isend(0, kTag, &v, sizeof v);
    ep->wait(sq, kDl(), "the new incarnation's send");
    uint32_t w = 0;
    auto rq = ep->irecv(0, kTag, &w, sizeof w);
    ep->wait(rq, kDl(), "rank 0's answer");
    std::vector<uint8_t> got(big.size());
    auto bq = ep->irecv(0, make_tag(Op::kUser, 8, 0), got.data(), got.size());
    ep->wait(bq, kDl(), "rank 0's large message");
    store.set("done-1", "1");
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != uint8_t(i * 7)) return 13;
    return w == 3 ? 0 : 14;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << "rank 0 status " << res.status[0];
  EXPECT_TRUE(res.exited(1, 0)) << "rank 1 status " << res.status[1];
}

// The peer is another process that died (SIGKILL) with a large send to rank 0 unanswered;
// rank 0 reconnects to its replacement and large messages flow again both ways.
// `prepare`: rank 0 calls prepare_reset_peer(1) once it knows rank 1 is gone, as the quorum
// service does when a rank leaves the view (pairwise shm: the replacement endpoint is opened
// then, and reset_peer puts it in place); what rank 0 publishes does not change until the
// reset_peer.
void replacement_of_a_killed_peer(const std::string& prov, bool prepare) {
  auto res = run_procs(3, [&](int r, int, net::Rendezvous& rdv) {
    net::Store& store = rdv.store();
    std::vector<uint8_t> big(1 << 20, uint8_t(r + 1));
    if (r == 1) {
      // The first incarnation: a large send to rank 0 that rank 0 never receives, then death.
      auto ep = open_endpoint(rdv, prov);
      auto sq = ep->isend(0, make_tag(Op::kUser, 1, 0), big.data(), big.size());
      pump(*ep, std::chrono::milliseconds(100));
      store.set("victim-sent", "1");
      raise(SIGKILL);
    }
    rdv.lost({1});  // its first incarnation never meets the others at the exit
    if (r == 2) {
      // Plays rank 1's next incarnation (its own rank number is not used on the wire).
      auto first = open_endpoint(rdv, prov);  // the address exchange of the job's start
      store.get("victim-sent", kDl());
      net::FabricOptions o;
      o.provider = prov;
      o.incarnation = 1;
      o.join = true;
      o.instance = 9;
      net::PrefixStore ns("as-rank-1", store);
      auto ep = net::make_fabric_endpoint(o, 1, 3, ns, rdv.single_host(), kDl());
      store.set("new-addr", ep->published_address());
      ep->reset_peer(0, store.get("addr-for-1", kDl()), 0);
      std::vector<uint8_t> got(big.size());
      auto rq = ep->irecv(0, make_tag(Op::kUser, 2, 0), got.data(), got.size());
      std::vector<uint8_t> mine(big.size(), uint8_t(42));
      auto sq = ep->isend(0, make_tag(Op::kUser, 3, 0), mine.data(), mine.size());
      ep->wait(rq, kDl(), "rank 0's large message");
      ep->wait(sq, kDl(), "the large send to rank 0");
      store.set("done-2", "1");
      return got == std::vector<uint8_t>(big.size(), uint8_t(1)) ? 0 : 1;
    }
    auto ep = open_endpoint(rdv, prov);
    // A large send to rank 1 that its first incarnation never answers (shm: by CMA).
    std::vector<uint8_t> stuck(1 << 20, 9);
    auto stuck_req = ep->isend(1, make_tag(Op::kUser, 4, 0), stuck.data(), stuck.size());
    while (!store.check({"victim-sent"})) pump(*ep, std::chrono::milliseconds(5));
    if (prepare) {
      const std::string before = ep->published_address();
      ep->prepare_reset_peer(1);
      ep->prepare_reset_peer(1);  // a second hint changes nothing either
      if (ep->published_address() != before) return 22;
    }
    pump(*ep, std::chrono::milliseconds(300));
    ep->reset_peer(1, store.get("new-addr", kDl()), 1);
    if (!stuck_req->done()) return 20;  // ended with the old incarnation
    store.set("addr-for-1", ep->published_address());
    auto sq = ep->isend(1, make_tag(Op::kUser, 2, 0), big.data(), big.size());
    std::vector<uint8_t> got(big.size());
    auto rq = ep->irecv(1, make_tag(Op::kUser, 3, 0), got.data(), got.size());
    ep->wait(sq, kDl(), "the large send to the new incarnation");
    ep->wait(rq, kDl(), "the new incarnation's large message");
    store.get("done-2", kDl());
    return got == std::vector<uint8_t>(big.size(), uint8_t(42)) ? 0 : 21;
  });
  EXPECT_FALSE(res.timed_out);
  EXPECT_TRUE(res.exited(0, 0)) << "rank 0 status " << res.status[0];
  EXPECT_TRUE(res.exited(2, 0)) << "rank 2 status " << res.status[2];
}

TEST_P(Rejoin, ReplacementOfAKilledPeerGetsLargeMessagesThrough) {
  replacement_of_a_killed_peer(GetParam(), false);
}

TEST_P(Rejoin, ReplacementOfAKilledPeerGetsLargeMessagesThroughAfterPrepareResetPeer) {
  replacement_of_a_killed_peer(GetParam(), true);
}

// Ranks 1, 2 and 3 pass messages around a ring (1 -> 2 -> 3 -> 1, 64 KiB, 300 rounds, each
// rank's receive from its neighbour posted before it sends), while rank 0 comes back as a new
// incarnation: halfway, with that receive posted, each of them reconnects to it
// (reset_peer). No message of the ring may be lost or changed by the reconnection (rank 3's
// messages to itself share its endpoint for rank 0 over shm, which reset_peer replaces), and
// the new incarnation then talks with each of them.
// `prepare`: each member calls prepare_reset_peer(0) a quarter of the way, with its ring
// traffic in flight (rank 3's replacement also carries its messages to itself).
void reconnecting_one_rank(const std::string& prov, bool prepare) {
  constexpr int kRounds = 300, kAt = 150;
  constexpr size_t kBytes = 64 << 10;
  auto res = run_procs(4, [&](int r, int, net::Rendezvous& rdv) {
    net::Store& store = rdv.store();
    if (r == 0) {
      { auto first = open_endpoint(rdv, prov); }  // the first incarnation, closed
      net::FabricOptions o;
      o.provider = prov;
      o.incarnation = 1;
      o.join = true;
      o.instance = 9;
      auto ep = net::make_fabric_endpoint(o, 0, 4, store, rdv.single_host(), kDl());
      store.set("new-addr", ep->published_address());
      for (int p = 1; p < 4; ++p)
        ep->reset_peer(p, store.get("addr-for-0/" + std::to_string(p), kDl()), 0);
      for (int p = 1; p < 4; ++p) {
        uint32_t v = 0;
        auto rq = ep->irecv(p, kTag, &v, sizeof v);
        ep->wait(rq, kDl(), "a member's message to the new incarnation");
        if (v != uint32_t(100 + p)) return 1;
        auto sq = ep->isend(p, kTag, &v, sizeof v);
        ep->wait(sq, kDl(), "the answer");
      }
      return 0;
    }
    auto ep = open_endpoint(rdv, prov);
    const int next = r == 3 ? 1 : r + 1, prev = r == 1 ? 3 : r - 1;
    std::vector<uint32_t> out(kBytes / 4), in(kBytes / 4);
    for (int i = 0; i < kRounds; ++i) {
      const uint64_t tag = make_tag(Op::kUser, uint32_t(100 + i), 1);
      auto rq = ep->irecv(prev, tag, in.data(), kBytes);
      if (prepare && i == kAt / 2) {
        const std::string before = ep->published_address();
        ep->prepare_reset_peer(0);
        if (ep->published_address() != before) return 50;
      }
      if (i == kAt) {
        ep->reset_peer(0, store.get("new-addr", kDl()), 1);
        store.set("addr-for-0/" + std::to_string(r), ep->published_address());
      }
      for (size_t k = 0; k < out.size(); ++k) out[k] = uint32_t(r * 1000003 + i * 7919 + k);
      auto sq = ep->isend(next, tag, out.data(), kBytes);
      ep->wait(rq, kDl(), "the ring neighbour's message");
      ep->wait(sq, kDl(), "the send to the ring neighbour");
      for (size_t k = 0; k < in.size(); ++k)
        if (in[k] != uint32_t(prev * 1000003 + i * 7919 + k)) return 30 + (i == kAt ? 1 : 0);
    }
    uint32_t v = uint32_t(100 + r), w = 0;
    auto sq = ep->isend(0, kTag, &v, sizeof v);
    auto rq = ep->irecv(0, kTag, &w, sizeof w);
    ep->wait(sq, kDl(), "the message to the new incarnation");
    ep->wait(rq, kDl(), "its answer");
    return w == v ? 0 : 40;
  });
  EXPECT_FALSE(res.timed_out);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(res.exited(r, 0)) << "rank " << r << " status " << res.status[r];
}

TEST_P(Rejoin, ReconnectingOneRankDoesNotDisturbTheOthersTraffic) {
  reconnecting_one_rank(GetParam(), false);
}

TEST_P(Rejoin, ReconnectingOneRankDoesNotDisturbTheOthersTrafficAfterPrepareResetPeer) {
  reconnecting_one_rank(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Providers, Rejoin, ::testing::Values("shm", "tcp"));

TEST(RejoinInproc, MessagesOfTheOldIncarnationNeverMatchTheNewOne) {
  net::InprocFabric f(2);
  auto ep0 = f.endpoint(0);
  {
    auto old1 = f.endpoint(1);
    uint32_t v = 1;
    old1->wait(old1->isend(0, kTag, &v, sizeof v), kDl());
  }
  auto new1 = f.endpoint(1, 1, /*join=*/true);
  EXPECT_FALSE(new1->connected(0));
  uint32_t early = 0;
  auto waiting = new1->irecv(0, kTag, &early, sizeof early);
  new1->reset_peer(0, ep0->published_address(), 0);
  EXPECT_EQ(waiting->state, net::RequestState::kCancelled);
  ep0->reset_peer(1, new1->published_address(), 1);
  uint32_t v = 2;
  new1->wait(new1->isend(0, kTag, &v, sizeof v), kDl());
  uint32_t got = 0;
  auto rq = ep0->irecv(1, kTag, &got, sizeof got);
  ep0->wait(rq, kDl());
  EXPECT_EQ(got, 2u);
  EXPECT_EQ(rq->matched_tag, kTag);  // the generation bits are not the caller's business
  uint32_t extra = 0;
  auto rq2 = ep0->irecv(1, kTag, &extra, sizeof extra);
  ep0->progress();
  EXPECT_FALSE(rq2->done());
  EXPECT_TRUE(ep0->cancel(rq2));
}

TEST(RejoinInproc, BadAddressesAndSelfAreRefused) {
  net::InprocFabric f(2);
  auto ep0 = f.endpoint(0);
  EXPECT_THROW(ep0->reset_peer(1, "garbage", 1), ProtocolError);
  EXPECT_THROW(ep0->reset_peer(0, "inproc\n", 1), UsageError);
  EXPECT_THROW(ep0->reset_peer(2, "inproc\n", 1), UsageError);
}

}  // namespace
}  // namespace qring::testing

