#include "net/transport/endpoint.h"

#include <fmt/format.h>
#include <sched.h>
#include <time.h>

#include "net/base/error.h"

namespace qring::net {

namespace {
constexpr uint32_t kSpinPolls = 64;       // pure polling: a message usually lands within these
constexpr uint32_t kYieldPolls = 512;     // then yield the core to ranks that compute
constexpr long kMaxSleepNs = 500'000;     // then sleep, doubling up to 0.5 ms
constexpr long kLongSleepNs = 4'000'000;  // and up to 4 ms once idle for long
constexpr auto kLongIdle = std::chrono::milliseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string describe(const Request& r) {
  if (r.peer == kAnyPeer)
    return fmt::format("{} from any peer (tag {:#x})", r.is_send ? "send" : "receive", r.tag);
  return fmt::format("{} rank {} (tag {:#x}, {} bytes)", r.is_send ? "send to" : "receive from",
                     r.peer, r.tag, r.len);
}
}  // namespace

void Endpoint::reset_peer(int peer, const std::string& /*published*/, uint32_t /*incarnation*/) {
  throw UsageError(fmt::format("rank {}: the {} endpoint cannot reconnect rank {} (no rejoin)",
                               rank(), provider(), peer));
}

std::chrono::nanoseconds Backoff::next_sleep() {
  if (idle_polls_ == 0) idle_since_ = Clock::now();
  ++idle_polls_;
  if (idle_polls_ < kYieldPolls) return std::chrono::nanoseconds(0);
  uint32_t k = std::min<uint32_t>(idle_polls_ - kYieldPolls, 20);
  long cap = Clock::now() - idle_since_ > kLongIdle ? kLongSleepNs : kMaxSleepNs;
  return std::chrono::nanoseconds(std::min<long>(1000L << k, cap));
}

void Backoff::idle() {
  auto sleep = next_sleep();
  if (sleep.count() > 0) {
    timespec ts{0, long(sleep.count())};
    nanosleep(&ts, nullptr);
  } else if (idle_polls_ < kSpinPolls) {
    cpu_relax();
  } else {
    sched_yield();
  }
}

void throw_if_failed(const Request& req, std::string_view what) {
  if (req.state == RequestState::kError)
    throw IoError(
        fmt::format("{}{}{} failed: {}", what, what.empty() ? "" : ": ", describe(req), req.error));
}

void Endpoint::wait(const RequestPtr& req, Deadline deadline, std::string_view what) {
  Backoff backoff;
  while (!req->done()) {
    if (progress() > 0) {
      backoff.reset();
      continue;
    }
    if (req->done()) break;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("rank {}: timed out{}{} waiting for {}", rank(),
                                     what.empty() ? "" : " in ", what, describe(*req)));
    }
    backoff.idle();
  }
  throw_if_failed(*req, what);
}

void Endpoint::wait_all(std::span<const RequestPtr> reqs, Deadline deadline,
                        std::string_view what) {
  Backoff backoff;
  size_t first_pending = 0;
  while (true) {
    while (first_pending < reqs.size() && reqs[first_pending]->done()) {
      throw_if_failed(*reqs[first_pending], what);
      ++first_pending;
    }
    if (first_pending == reqs.size()) return;
    if (progress() > 0) {
      backoff.reset();
      continue;
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("rank {}: timed out{}{} waiting for {}", rank(),
                                     what.empty() ? "" : " in ", what,
                                     describe(*reqs[first_pending])));
    }
    backoff.idle();
  }
}

}  // namespace qring::net
