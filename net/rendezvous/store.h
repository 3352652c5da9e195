// Key-value stores for rendezvous (gloo/rendezvous/store.h). Every blocking call has a
// deadline and throws TimeoutError naming the keys it waited for.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "net/transport/endpoint.h"  // Clock, Deadline

namespace qring::net {

// 2: the server opens with a CHALLENGE, JOIN proves the job secret (HMAC-SHA256), MISSING.
constexpr uint32_t kProtocolVersion = 2;

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists, then returns its value.
  virtual std::string get(const std::string& key, Deadline deadline) = 0;
  // Blocks until every key exists.
  virtual void wait(const std::vector<std::string>& keys, Deadline deadline) = 0;
  // Non-blocking: true if every key exists.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Atomically adds `delta` to the integer stored at `key` (absent = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// Namespaces every key of `base` under "prefix/".
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, Store& base);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;

 private:
  std::string key(const std::string& k) const;
  std::string prefix_;
  Store& base_;
};

// Thread-safe in-process store (ranks as threads, tests).
class MemoryStore : public Store {
 public:
  MemoryStore();
  ~MemoryStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Wire protocol of TcpStore / TcpStoreServer (docs/bootstrap.md). Every frame is
//   magic u32 | version u16 | type u16 | request id u32 | payload length u32 | payload
// little-endian; strings are u32 length + bytes, integers i64. The server speaks first: a
// CHALLENGE (id 0) carrying a fresh random nonce. The client's first message must be JOIN,
// which proves the job secret without sending it (see join_proof()); the server answers OK
// with its own proof (server_proof()), so a client also knows it reached its job's store.
// Then: SET, GET, WAIT, CHECK, ADD, MISSING; replies OK or ERROR(reason) echo the request id.
// Before JOIN succeeds a frame may carry at most kMaxHandshakeFrameBytes; a frame with a bad
// magic, a payload over the limit or a malformed payload makes the server close that
// connection. A failed JOIN gets ERROR("rejected") and nothing else; the server logs why.
constexpr uint32_t kStoreMagic = 0x51524E47;  // "QRNG"
constexpr size_t kFrameHeaderBytes = 16;
constexpr size_t kMaxFrameBytes = size_t{64} << 20;
constexpr size_t kMaxHandshakeFrameBytes = 4096;
constexpr size_t kNonceBytes = 32;
enum class StoreMsg : uint16_t {
  kJoin = 1,
  kSet = 2,
  kGet = 3,
  kWait = 4,
  kCheck = 5,
  kAdd = 6,
  kChallenge = 7,  // server -> client, first frame of a connection: str nonce
  kMissing = 8,    // keys -> the keys that do not exist (for timeout messages)
  kOk = 0x80,
  kError = 0x81,
};

// Who is joining: sent by every TcpStore client when it connects and validated by the server.
// The secret itself never goes on the wire.
struct JoinInfo {
  uint32_t version = kProtocolVersion;
  int rank = 0;
  int world_size = 1;
  std::string job_id;
  std::string hostname;
  std::string secret;  // the job secret (QRING_JOB_SECRET); empty only for a loopback store
};

// HMAC-SHA256(key, message): 32 bytes.
std::string hmac_sha256(std::string_view key, std::string_view message);
// `n` bytes from getrandom(); IoError if the kernel cannot supply them.
std::string random_bytes(size_t n);
// 2n lowercase hex digits of n random bytes (job secrets, unique job ids).
std::string random_hex(size_t n);
// The JOIN payload without its proof: u32 version | i64 rank | i64 world size | str job id |
// str hostname | str client nonce.
std::string encode_join_fields(const JoinInfo& join, std::string_view client_nonce);
// What a client proves: HMAC(secret, "qring-store-join" | server nonce | join fields), and
// what the server answers: HMAC(secret, "qring-store-server" | server nonce | join fields).
std::string join_proof(std::string_view secret, std::string_view server_nonce,
                       std::string_view join_fields);
std::string server_proof(std::string_view secret, std::string_view server_nonce,
                         std::string_view join_fields);
// Why `secret` is too weak to be a job secret, or "" when it is not: fewer than 16 characters,
// fewer than 6 different ones ("aaaa...", "abababab..."), a repetition of a shorter part
// ("abcdefabcdefabcd"), or a run of 8 consecutive characters ("01234567", "hgfedcba"). A
// random hex string of 16 characters fails one of these with a probability of 2e-5.
std::string secret_weakness(std::string_view secret);

// True for the addresses and names of this host's loopback interface (127.0.0.0/8,
// "localhost").
bool is_loopback_host(const std::string& host);

// The rank that owns `key`, or -1 for a shared key. The keys a rank publishes about itself
// -- "host/<r>", "exit/<r>", "fabric/.../<r>", "incarnation/<r>", "join/.../<r>" -- belong
// to rank r: only r may SET or ADD them.
int key_owner(std::string_view key, int world_size);

// A key that only the store's owner writes (TcpStoreServer::record), never a rank:
// "dead/<r>/<incarnation>", a death the launcher or the store witnessed for certain (a reaped
// process; a joined rank's connection closed: collectives/quorum/witness.h, docs/design.md,
// "Witnessed deaths").
bool owner_only_key(std::string_view key);
// "dead/<rank>/<incarnation>".
std::string dead_key(int rank, uint32_t incarnation);

// The counter of rank r's incarnations: each process of rank r adds 1 at its rendezvous, so
// its incarnation is the value it gets minus 1 (0 at the job's start; docs/design.md, "Rejoin").
std::string incarnation_key(int rank);

struct StoreServerOptions {
  // The job secret every JOIN must prove. Empty: no proof is needed (anyone who can reach
  // the port can join), so the server then binds only a loopback address.
  std::string secret;
  // Connections that have not joined yet (issue 44, N1): at most world size + max_handshakes
  // at a time (and at most a quarter of the process's descriptor limit, RLIMIT_NOFILE: the
  // store may share its process with a rank), and max_handshakes_per_source from one
  // address. A new connection is always
  // served: past either cap the oldest connection that has not joined (of that address, else
  // of all) is dropped instead, so that holding connections open cannot lock ranks out. A
  // rank sends its JOIN as soon as the CHALLENGE arrives, so a connection is dropped when its
  // complete JOIN has not arrived within handshake_timeout of the CHALLENGE.
  int max_handshakes = 1024;
  int max_handshakes_per_source = 256;
  std::chrono::milliseconds handshake_timeout{2000};
  // qring-store: a closed connection of a joined rank whose incarnation it counted is a
  // witnessed death (dead_key). qring-launch reaps its ranks and records their deaths itself;
  // node 0's launcher of several hosts witnesses the other hosts' ranks so, those from
  // `witness_first_rank` on (its own are 0 .. n-1).
  bool witness_deaths = false;
  int witness_first_rank = 0;
};

// Why the server dropped or refused a connection that had not joined, or closed one: each is
// counted, and logged through a rate-limited warning per reason (at most one line per reason
// every 10 s, with the number of occurrences since the last line).
enum class StoreRejection : int {
  kJoinRejected,     // a JOIN that failed validation (wrong proof, world, job, rank...)
  kNotJoin,          // the first message was not a JOIN, or of another protocol version
  kBadFrame,         // bad magic, a frame over the limit, a malformed or unknown message
  kTruncatedFrame,   // closed inside a frame
  kJoinDeadline,     // no complete JOIN within handshake_timeout of the CHALLENGE
  kDroppedForNewer,  // the oldest connection that had not joined, dropped for a new one
  kConnectionError,  // a receive failed (a reset connection)
  kCount
};
// "join rejected", "not a join", ... (the log's and the counters' names).
const char* store_rejection_name(StoreRejection r);

// The TCP key-value store server that rank 0 runs (one thread, poll()-based). It knows the
// world it serves and rejects (ERROR "rejected" to the client, the reason in its log): a JOIN
// whose proof of the job secret is wrong, a protocol version, world size or job id different
// from its own, rank < 0 or >= world size, a rank that already joined, and malformed or
// truncated messages. A joined rank may not write another rank's keys (key_owner()), nor the
// owner's (owner_only_key()). With `witness_deaths` (qring-store) a joined rank's connection
// that closes is its death, recorded under dead_key(rank, incarnation) when the connection
// took part in the rank's incarnation count (its ADD to incarnation_key), so that the
// incarnation is certain; a rank whose process ends closes it (a killed one too). Its
// memory and descriptors stay bounded under floods of connections, oversized or trickled
// frames, and descriptor exhaustion (accept backs off, warnings are rate-limited).
class TcpStoreServer {
 public:
  // port 0 picks a free port; see port(). ConfigError for an empty secret with a bind
  // address that is not loopback.
  TcpStoreServer(const std::string& bind_host, int port, int world_size, std::string job_id,
                 StoreServerOptions options = {});
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const;
  // How many connections were dropped or refused for each reason so far (thread-safe).
  uint64_t rejections(StoreRejection why) const;
  // Ranks whose joined connection is open now (a launcher that serves the store waits for
  // the ranks of other hosts to close theirs before it stops it).
  int connected_ranks() const;
  // A write of the store's owner (thread-safe; applied by the server's thread at once, waking
  // the requests that wait for `key`): the launcher records the deaths it witnessed.
  void record(const std::string& key, const std::string& value);

 private:
  friend std::string store_server_feed(std::string_view bytes, bool joined, int world_size);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Client of TcpStoreServer. Connects and joins with `join`, in attempts until `deadline`: an
// attempt whose connection is refused, closed before the JOIN is answered, or gets no
// CHALLENGE within a per-attempt timeout (500 ms, doubling to 4 s: a connection the kernel
// accepted but the server did not serve) is retried on a new connection; at the deadline a
// TimeoutError names host:port and what happened on how many attempts. ProtocolError when
// the store rejects the JOIN, or cannot prove the job secret. A wait() that times out names
// only the keys still missing.
class TcpStore : public Store {
 public:
  TcpStore(const std::string& host, int port, const JoinInfo& join, Deadline deadline);
  ~TcpStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Helpers shared by the store implementations.
// "key 'a'" or "keys ['a', 'b']", for error messages.
std::string describe_keys(const std::vector<std::string>& keys);
// The integer stored at `key` (the value format of add()); UsageError if it is not one.
int64_t parse_counter(const std::string& key, const std::string& value);

// For the fuzz harness (tests/fuzz): runs the store server's frame parser and request handlers
// over `bytes` as one connection's input, without sockets (a connection of rank 0 that has
// joined when `joined`, beside a joined rank 1 parked in a WAIT), and returns the replies the
// server would send. Never throws for any input: a malformed frame ends the connection.
std::string store_server_feed(std::string_view bytes, bool joined, int world_size);

}  // namespace qring::net
