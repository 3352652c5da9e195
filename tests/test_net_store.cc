// One suite over every Store (MemoryStore, PrefixStore, TcpStore), then TCP-specific cases:
// join validation, malformed frames from raw sockets, unreachable stores.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "net/error.h"
#include "net/store.h"

namespace qring::net {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

JoinInfo join_info(int rank, int world = 4, std::string job = "job") {
  return JoinInfo{kProtocolVersion, rank, world, std::move(job), "testhost"};
}

struct MemoryKind {
  MemoryStore mem;
  Store& store() { return mem; }
};
struct PrefixKind {
  MemoryStore base;
  PrefixStore prefixed{"ns", base};
  Store& store() { return prefixed; }
};
struct TcpKind {
  TcpStoreServer server{"127.0.0.1", 0, 4, "job"};
  TcpStore client{"127.0.0.1", server.port(), join_info(0), deadline_in(5s)};
  Store& store() { return client; }
};

template <class Kind>
class StoreTest : public ::testing::Test {
 protected:
  Kind kind;
  Store& store() { return kind.store(); }
};
using Kinds = ::testing::Types<MemoryKind, PrefixKind, TcpKind>;
TYPED_TEST_SUITE(StoreTest, Kinds);

TYPED_TEST(StoreTest, SetGetOverwrite) {
  Store& s = this->store();
  s.set("a", "1");
  EXPECT_EQ(s.get("a", deadline_in(1s)), "1");
  s.set("a", "two");
  EXPECT_EQ(s.get("a", deadline_in(1s)), "two");
  std::string binary("x\0y\xff", 4);
  std::string big(3 << 20, 'z');
  big[12345] = 'q';
  s.set("bin", binary);
  s.set("big", big);
  s.set("", "empty key");
  EXPECT_EQ(s.get("bin", deadline_in(1s)), binary);
  EXPECT_EQ(s.get("big", deadline_in(2s)), big);
  EXPECT_EQ(s.get("", deadline_in(1s)), "empty key");
}

TYPED_TEST(StoreTest, GetBlocksUntilSet) {
  Store& s = this->store();
  std::thread setter([&] {
    std::this_thread::sleep_for(150ms);
    s.set("later", "v");
  });
  auto t0 = Clock::now();
  EXPECT_EQ(s.get("later", deadline_in(5s)), "v");
  EXPECT_GE(ms_since(t0), 100);
  setter.join();
}

TYPED_TEST(StoreTest, GetMissingKeyTimesOutNamingTheKey) {
  Store& s = this->store();
  auto t0 = Clock::now();
  try {
    s.get("no-such-key", deadline_in(200ms));
    FAIL() << "get of a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no-such-key"));
  }
  EXPECT_GE(ms_since(t0), 190);
  EXPECT_LT(ms_since(t0), 1500);
  // The store keeps working after a timeout, and the late key is still delivered.
  s.set("no-such-key", "now");
  s.set("other", "o");
  EXPECT_EQ(s.get("other", deadline_in(1s)), "o");
  EXPECT_EQ(s.get("no-such-key", deadline_in(1s)), "now");
}

TYPED_TEST(StoreTest, WaitAndCheck) {
  Store& s = this->store();
  EXPECT_TRUE(s.check({}));
  EXPECT_FALSE(s.check({"w1", "w2"}));
  s.set("w1", "");
  EXPECT_FALSE(s.check({"w1", "w2"}));
  EXPECT_TRUE(s.check({"w1"}));
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    s.set("w2", "x");
  });
  s.wait({"w1", "w2"}, deadline_in(5s));
  setter.join();
  EXPECT_TRUE(s.check({"w1", "w2"}));
  try {
    s.wait({"w1", "w3"}, deadline_in(100ms));
    FAIL() << "wait for a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("w3"));
  }
}

TYPED_TEST(StoreTest, AddCounts) {
  Store& s = this->store();
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -7), -2);
  EXPECT_EQ(s.get("n", deadline_in(1s)), "-2");
  EXPECT_EQ(s.add("n", 0), -2);
  s.set("text", "abc");
  EXPECT_THROW(s.add("text", 1), UsageError);
  EXPECT_EQ(s.add("n", 2), 0);  // still usable after the error
}

TYPED_TEST(StoreTest, AddWakesWaiters) {
  Store& s = this->store();
  std::thread adder([&] {
    std::this_thread::sleep_for(50ms);
    s.add("counter", 3);
  });
  EXPECT_EQ(s.get("counter", deadline_in(5s)), "3");
  adder.join();
}

TYPED_TEST(StoreTest, ConcurrentWaitersFromThreads) {
  Store& s = this->store();
  constexpr int kThreads = 8;
  std::vector<std::string> got(kThreads);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      try {
        s.wait({"go"}, deadline_in(5s));
        got[i] = s.get(fmt::format("k{}", i), deadline_in(5s));
        s.add("done", 1);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << i << ": " << e.what();
        ++errors;
      }
    });
  }
  std::this_thread::sleep_for(50ms);
  for (int i = kThreads - 1; i >= 0; --i) s.set(fmt::format("k{}", i), fmt::format("v{}", i));
  s.set("go", "");
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(got[i], fmt::format("v{}", i));
  EXPECT_EQ(s.add("done", 0), kThreads);
}

TYPED_TEST(StoreTest, PrefixesIsolateNamespaces) {
  Store& s = this->store();
  PrefixStore a("a", s), b("b", s);
  a.set("k", "from-a");
  b.set("k", "from-b");
  EXPECT_EQ(a.get("k", deadline_in(1s)), "from-a");
  EXPECT_EQ(b.get("k", deadline_in(1s)), "from-b");
  a.set("only-a", "1");
  EXPECT_FALSE(b.check({"only-a"}));
  EXPECT_THROW(b.get("only-a", deadline_in(50ms)), TimeoutError);
  EXPECT_TRUE(s.check({"a/k", "b/k", "a/only-a"}));
  EXPECT_FALSE(s.check({"k"}));
  EXPECT_EQ(a.add("c", 2), 2);
  EXPECT_EQ(b.add("c", 5), 5);
}

// ---- TCP-specific ---------------------------------------------------------------------------

std::string rejection(const TcpStoreServer& server, const JoinInfo& join) {
  try {
    TcpStore c("127.0.0.1", server.port(), join, deadline_in(3s));
  } catch (const ProtocolError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(TcpStore, JoinRejections) {
  TcpStoreServer server("127.0.0.1", 0, 3, "job-1");
  JoinInfo ok{kProtocolVersion, 1, 3, "job-1", "h"};
  TcpStore first("127.0.0.1", server.port(), ok, deadline_in(3s));

  JoinInfo j = ok;
  j.version = kProtocolVersion + 1;
  EXPECT_THAT(rejection(server, j), HasSubstr("protocol version mismatch"));
  j = ok;
  j.world_size = 4;
  EXPECT_THAT(rejection(server, j), HasSubstr("world size mismatch"));
  j = ok;
  j.job_id = "job-2";
  EXPECT_THAT(rejection(server, j), HasSubstr("job id mismatch"));
  j = ok;
  j.rank = 3;
  EXPECT_THAT(rejection(server, j), HasSubstr("rank 3 out of range [0, 3)"));
  j.rank = -1;
  EXPECT_THAT(rejection(server, j), HasSubstr("rank -1 out of range"));
  EXPECT_THAT(rejection(server, ok), HasSubstr("duplicate rank 1"));

  // The accepted client is unaffected, and a valid new rank still joins.
  first.set("x", "1");
  j = ok;
  j.rank = 2;
  TcpStore second("127.0.0.1", server.port(), j, deadline_in(3s));
  EXPECT_EQ(second.get("x", deadline_in(1s)), "1");
}

// A raw TCP connection for sending hand-made frames.
class RawConn {
 public:
  explicit RawConn(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  ~RawConn() { close(fd_); }
  void send_bytes(const std::string& b) {
    ASSERT_EQ(send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size()));
  }
  // Reads until EOF or 3 s; returns the bytes and whether EOF was seen.
  std::pair<std::string, bool> read_until_eof() {
    std::string got;
    auto deadline = deadline_in(3s);
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[4096];
      ssize_t r = recv(fd_, buf, sizeof(buf), 0);
      if (r <= 0) return {got, true};
      got.append(buf, r);
    }
    return {got, false};
  }

 private:
  int fd_ = -1;
};

void put_le(std::string& s, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_str(std::string& s, const std::string& v) {
  put_le(s, v.size(), 4);
  s += v;
}
std::string frame(StoreMsg type, const std::string& payload, uint32_t len_override = 0,
                  uint32_t magic = kStoreMagic) {
  std::string f;
  put_le(f, magic, 4);
  put_le(f, kProtocolVersion, 2);
  put_le(f, static_cast<uint16_t>(type), 2);
  put_le(f, 7, 4);
  put_le(f, len_override ? len_override : payload.size(), 4);
  return f + payload;
}
std::string join_frame(int rank, int world, const std::string& job) {
  std::string p;
  put_le(p, kProtocolVersion, 4);
  put_le(p, static_cast<uint64_t>(rank), 8);
  put_le(p, static_cast<uint64_t>(world), 8);
  put_str(p, job);
  put_str(p, "raw");
  return frame(StoreMsg::kJoin, p);
}

TEST(TcpStore, MalformedFramesCloseOnlyThatConnection) {
  TcpStoreServer server("127.0.0.1", 0, 4, "job");
  TcpStore good("127.0.0.1", server.port(), join_info(0), deadline_in(3s));
  good.set("before", "1");

  {  // bad magic
    RawConn c(server.port());
    c.send_bytes(std::string(16, '\x5a'));
    EXPECT_TRUE(c.read_until_eof().second);
  }
  {  // oversized frame (header claims 100 MiB)
    RawConn c(server.port());
    c.send_bytes(frame(StoreMsg::kSet, "", 100u << 20));
    EXPECT_TRUE(c.read_until_eof().second);
  }
  {  // truncated frame, then the client closes
    RawConn c(server.port());
    c.send_bytes(frame(StoreMsg::kJoin, std::string(10, 'a'), 100));
  }
  {  // a request before JOIN gets an error reply naming the reason, then EOF
    RawConn c(server.port());
    std::string p;
    put_str(p, "k");
    put_str(p, "v");
    c.send_bytes(frame(StoreMsg::kSet, p));
    auto [bytes, eof] = c.read_until_eof();
    EXPECT_TRUE(eof);
    EXPECT_THAT(bytes, HasSubstr("must be JOIN"));
  }
  {  // valid JOIN, then a SET whose string length runs past the payload
    RawConn c(server.port());
    c.send_bytes(join_frame(1, 4, "job"));
    std::string p;
    put_le(p, 1000, 4);
    p += "short";
    c.send_bytes(frame(StoreMsg::kSet, p));
    auto [bytes, eof] = c.read_until_eof();
    EXPECT_TRUE(eof);
    EXPECT_EQ(bytes.size(), kFrameHeaderBytes);  // only the JOIN reply
  }
  {  // valid JOIN, then an unknown message type
    RawConn c(server.port());
    c.send_bytes(join_frame(2, 4, "job"));
    c.send_bytes(frame(static_cast<StoreMsg>(0x77), ""));
    EXPECT_TRUE(c.read_until_eof().second);
  }
  {  // a truncated frame on a connection that stays open does not block others
    RawConn c(server.port());
    c.send_bytes(frame(StoreMsg::kJoin, "abc", 50));
    good.set("during", "2");
    EXPECT_EQ(good.get("during", deadline_in(1s)), "2");
  }
  // The server still serves the old client and new ones (ranks 1 and 2 were released).
  EXPECT_EQ(good.get("before", deadline_in(1s)), "1");
  TcpStore late("127.0.0.1", server.port(), join_info(1), deadline_in(3s));
  EXPECT_EQ(late.get("during", deadline_in(1s)), "2");
}

TEST(TcpStore, GetTimeoutNamesKeyAndHostPort) {
  TcpStoreServer server("127.0.0.1", 0, 4, "job");
  TcpStore c("127.0.0.1", server.port(), join_info(2), deadline_in(3s));
  try {
    c.wait({"present", "absent"}, deadline_in(100ms));
    FAIL() << "wait returned";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("127.0.0.1:{}", server.port())));
    EXPECT_THAT(e.what(), HasSubstr("'absent'"));
    EXPECT_THAT(e.what(), HasSubstr("rank 2"));
  }
}

// Random bytes, random headers and random payloads after a valid JOIN: the server drops the
// offending connections and keeps serving.
TEST(TcpStore, RandomGarbageNeverBreaksTheServer) {
  TcpStoreServer server("127.0.0.1", 0, 64, "job");
  TcpStore good("127.0.0.1", server.port(), join_info(0, 64), deadline_in(3s));
  good.set("k", "v");
  std::mt19937 rng(42);
  auto byte = [&] { return static_cast<char>(rng() & 0xff); };
  for (int i = 0; i < 300; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(server.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    std::string bytes;
    if (i % 3 != 0) bytes = join_frame(1 + i % 62, 64, "job");  // rank 63 stays free
    int frames = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < frames; ++f) {
      std::string payload(rng() % 48, '\0');
      for (auto& ch : payload) ch = byte();
      if (rng() % 4 == 0) {
        for (int b = 0; b < 16; ++b) bytes.push_back(byte());  // a random header
        bytes += payload;
      } else {
        auto type = static_cast<StoreMsg>(rng() % 8);
        uint32_t len = rng() % 2 ? static_cast<uint32_t>(payload.size()) : rng() % 64;
        bytes += frame(type, payload, len);
      }
    }
    send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    close(fd);
    if (i % 50 == 0) {
      EXPECT_EQ(good.get("k", deadline_in(2s)), "v");
    }
  }
  EXPECT_EQ(good.get("k", deadline_in(2s)), "v");
  TcpStore late("127.0.0.1", server.port(), join_info(63, 64), deadline_in(3s));
  EXPECT_EQ(late.get("k", deadline_in(2s)), "v");
}

TEST(TcpStore, MalformedReplyRaisesProtocolError) {
  // A fake server that answers the JOIN with garbage.
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd, 4), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  std::thread fake([lfd] {
    int c = accept(lfd, nullptr, nullptr);
    char buf[256];
    recv(c, buf, sizeof(buf), 0);
    std::string garbage(16, '\x11');
    send(c, garbage.data(), garbage.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(300ms);
    close(c);
  });
  try {
    TcpStore c("127.0.0.1", port, join_info(0), deadline_in(3s));
    ADD_FAILURE() << "a garbage reply was accepted";
  } catch (const ProtocolError& e) {
    EXPECT_THAT(e.what(), HasSubstr("malformed reply"));
  }
  fake.join();
  close(lfd);
}

TEST(TcpStore, UnreachableStoreTimesOut) {
  // A bound but not listening socket: connections to its port are refused.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  auto t0 = Clock::now();
  try {
    TcpStore c("127.0.0.1", port, join_info(3), deadline_in(300ms));
    ADD_FAILURE() << "connected to a closed port";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(port)));
    EXPECT_THAT(e.what(), HasSubstr("unreachable"));
    EXPECT_THAT(e.what(), HasSubstr("rank 3"));
  }
  EXPECT_GE(ms_since(t0), 290);
  EXPECT_LT(ms_since(t0), 1500);
  close(fd);
}

TEST(TcpStore, ClientConnectsBeforeServerStarts) {
  // Reserve a port, release it, start the server there a little later.
  int port = 0;
  {
    TcpStoreServer probe("127.0.0.1", 0, 2, "job");
    port = probe.port();
  }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(200ms);
    server = std::make_unique<TcpStoreServer>("127.0.0.1", port, 2, "job");
  });
  TcpStore c("127.0.0.1", port, join_info(1, 2), deadline_in(5s));
  starter.join();
  c.set("k", "v");
  EXPECT_EQ(c.get("k", deadline_in(1s)), "v");
}

TEST(TcpStore, ServerShutdownFailsWaitersPromptly) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, 2, "job");
  TcpStore c("127.0.0.1", server->port(), join_info(1, 2), deadline_in(3s));
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    auto t0 = Clock::now();
    server.reset();
    EXPECT_LT(ms_since(t0), 1000);  // the destructor stops the thread promptly
  });
  auto t0 = Clock::now();
  try {
    c.get("never", deadline_in(5s));
    ADD_FAILURE() << "get returned";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "expected a closed connection, got a timeout: " << e.what();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("closed the connection"));
  }
  EXPECT_LT(ms_since(t0), 2000);
  stopper.join();
  EXPECT_THROW(c.set("k", "v"), IoError);  // the client stays broken
}

}  // namespace
}  // namespace qring::net
