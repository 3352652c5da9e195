// MemoryStore and PrefixStore (net/rendezvous/store.h). TcpStore / TcpStoreServer are in tcp_store.cc.
#include "net/rendezvous/store.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "net/base/error.h"

namespace qring::net {

std::string describe_keys(const std::vector<std::string>& keys) {
  if (keys.size() == 1) return fmt::format("key '{}'", keys[0]);
  return fmt::format("keys ['{}']", fmt::join(keys, "', '"));
}

int64_t parse_counter(const std::string& key, const std::string& value) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || p != value.data() + value.size())
    throw UsageError(fmt::format("store add: value of key '{}' is not an integer: '{}'", key,
                                 value.substr(0, 64)));
  return v;
}

std::string hmac_sha256(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // HMAC() takes a null key as "no key"; an empty key must still be a key.
  static const unsigned char kEmpty = 0;
  const void* k = key.empty() ? &kEmpty : static_cast<const void*>(key.data());
  if (HMAC(EVP_sha256(), k, static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out,
           &len) == nullptr ||
      len != 32)
    throw IoError("HMAC-SHA256 failed (OpenSSL)");
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("getrandom(): {} (errno {})", std::strerror(errno), errno));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string random_hex(size_t n) {
  std::string bytes = random_bytes(n);
  std::string out;
  out.reserve(2 * n);
  for (unsigned char b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

std::string secret_weakness(std::string_view secret) {
  const size_t n = secret.size();
  if (n < 16) return fmt::format("has {} characters, fewer than 16", n);
  bool seen[256] = {};
  size_t distinct = 0;
  for (unsigned char c : secret) distinct += seen[c] ? 0 : 1, seen[c] = true;
  if (distinct < 6) return fmt::format("uses only {} different characters", distinct);
  for (size_t period = 1; period <= n / 2; ++period) {
    if (secret.substr(period) == secret.substr(0, n - period))
      return fmt::format("repeats its first {} characters", period);
  }
  size_t run = 1;
  for (size_t i = 1; i < n; ++i) {
    const int step = int(static_cast<unsigned char>(secret[i])) -
                     int(static_cast<unsigned char>(secret[i - 1]));
    const int prev = i >= 2 ? int(static_cast<unsigned char>(secret[i - 1])) -
                                  int(static_cast<unsigned char>(secret[i - 2]))
                            : 0;
    if (step == 1 || step == -1)
      run = run > 1 && step == prev ? run + 1 : 2;
    else
      run = 1;
    if (run >= 8) return fmt::format("contains the sequence '{}'", secret.substr(i + 1 - run, run));
  }
  return {};
}

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0;
}

int key_owner(std::string_view key, int world_size) {
  auto slash = key.find('/');
  if (slash == std::string_view::npos) return -1;
  std::string_view family = key.substr(0, slash);
  if (family != "host" && family != "exit" && family != "fabric" && family != "incarnation" &&
      family != "join")
    return -1;
  std::string_view last = key.substr(key.rfind('/') + 1);
  int rank = -1;
  auto [p, ec] = std::from_chars(last.data(), last.data() + last.size(), rank);
  if (last.empty() || ec != std::errc() || p != last.data() + last.size() || rank < 0 ||
      rank >= world_size)
    return -1;
  return rank;
}

bool owner_only_key(std::string_view key) {
  return key.substr(0, 5) == "dead/";
}

std::string dead_key(int rank, uint32_t incarnation) {
  return fmt::format("dead/{}/{}", rank, incarnation);
}

std::string incarnation_key(int rank) {
  return fmt::format("incarnation/{}", rank);
}

// ---------------------------------------------------------------------------------------------
// PrefixStore

PrefixStore::PrefixStore(std::string prefix, Store& base)
    : prefix_(std::move(prefix)), base_(base) {}

std::string PrefixStore::key(const std::string& k) const {
  return prefix_ + "/" + k;
}

void PrefixStore::set(const std::string& k, const std::string& value) {
  base_.set(key(k), value);
}

std::string PrefixStore::get(const std::string& k, Deadline deadline) {
  return base_.get(key(k), deadline);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  base_.wait(full, deadline);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  return base_.check(full);
}

int64_t PrefixStore::add(const std::string& k, int64_t delta) {
  return base_.add(key(k), delta);
}

// ---------------------------------------------------------------------------------------------
// MemoryStore

struct MemoryStore::Impl {
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<std::string, std::string> data;

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }
  // Waits (lock held) until every key exists or throws TimeoutError at `deadline`.
  void wait_locked(std::unique_lock<std::mutex>& lk, const std::vector<std::string>& keys,
                   Deadline deadline) {
    auto start = Clock::now();
    if (cv.wait_until(lk, deadline, [&] { return has_all(keys); })) return;
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (!data.count(k)) missing.push_back(k);
    auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    throw TimeoutError(fmt::format("memory store: timed out after {} ms waiting for {}", ms,
                                   describe_keys(missing)));
  }
};

MemoryStore::MemoryStore() : impl_(std::make_unique<Impl>()) {}
MemoryStore::~MemoryStore() = default;

void MemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard lk(impl_->mu);
    impl_->data[key] = value;
  }
  impl_->cv.notify_all();
}

std::string MemoryStore::get(const std::string& key, Deadline deadline) {
  std::unique_lock lk(impl_->mu);
  impl_->wait_locked(lk, {key}, deadline);
  return impl_->data.at(key);
}

void MemoryStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  std::unique_lock lk(impl_->mu);
  impl_->wait_locked(lk, keys, deadline);
}

bool MemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lk(impl_->mu);
  return impl_->has_all(keys);
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard lk(impl_->mu);
    auto it = impl_->data.find(key);
    if (it != impl_->data.end()) v = parse_counter(key, it->second);
    if (__builtin_add_overflow(v, delta, &v))
      throw UsageError(fmt::format("add to key '{}': {} + {} overflows a 64-bit counter", key,
                                   it == impl_->data.end() ? "0" : it->second, delta));
    impl_->data[key] = std::to_string(v);
  }
  impl_->cv.notify_all();
  return v;
}

}  // namespace qring::net
