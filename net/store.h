// Key-value stores for rendezvous (gloo/rendezvous/store.h). Every blocking call has a
// deadline and throws TimeoutError naming the keys it waited for.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "net/endpoint.h"  // Clock, Deadline

namespace qring::net {

constexpr uint32_t kProtocolVersion = 1;

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
// little-endian; strings are u32 length + bytes, integers i64. Requests: JOIN (must come
// first), SET, GET, WAIT, CHECK, ADD; replies OK or ERROR(reason) echo the request id.
// A frame with a bad magic, a payload over kMaxFrameBytes or a malformed payload makes the
// server close that connection.
constexpr uint32_t kStoreMagic = 0x51524E47;  // "QRNG"
constexpr size_t kFrameHeaderBytes = 16;
constexpr size_t kMaxFrameBytes = size_t{64} << 20;
enum class StoreMsg : uint16_t {
  kJoin = 1,
  kSet = 2,
  kGet = 3,
  kWait = 4,
  kCheck = 5,
  kAdd = 6,
  kOk = 0x80,
  kError = 0x81,
};

// Who is joining: sent by every TcpStore client when it connects and validated by the server.
struct JoinInfo {
  uint32_t version = kProtocolVersion;
  int rank = 0;
  int world_size = 1;
  std::string job_id;
  std::string hostname;
};

// The TCP key-value store server that rank 0 runs (one thread, poll()-based). It knows the
// world it serves and rejects, with an error reply the client raises: a protocol version,
// world size or job id different from its own, rank < 0 or >= world size, a rank that already
// joined, and malformed or truncated messages.
class TcpStoreServer {
 public:
  // port 0 picks a free port; see port().
  TcpStoreServer(const std::string& bind_host, int port, int world_size, std::string job_id);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Client of TcpStoreServer. Connects (retrying until `deadline`, then TimeoutError naming
// host:port) and joins with `join` (ProtocolError carrying the server's reason on rejection).
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

}  // namespace qring::net
