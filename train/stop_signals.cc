#include "train/stop_signals.h"

#include <signal.h>
#include <string.h>

namespace qring::train {
namespace {

std::atomic<int> g_stop{0};

// Async-signal-safe: a lock-free atomic, sigaction and raise only.
void on_stop_signal(int sig) {
  int none = 0;
  if (g_stop.compare_exchange_strong(none, sig)) return;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

}  // namespace

const std::atomic<int>& install_stop_signals() {
  static_assert(std::atomic<int>::is_always_lock_free);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  return g_stop;
}

std::string signal_name(int sig) {
  if (sig == 0) return "";
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace qring::train
