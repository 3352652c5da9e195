#include "train/stop_signals.h"

#include <signal.h>

namespace qring::train {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

// Async-signal-safe: lock-free atomics, sigaction and raise only.
void on_stop_signal(int sig) {
  if (g_stop.exchange(true)) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  g_signal.store(sig);
}

}  // namespace

const std::atomic<bool>& install_stop_signals() {
  static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  return g_stop;
}

int stop_signal() { return g_signal.load(); }

}  // namespace qring::train
