#include "collectives/clock.h"

namespace qring::collectives {

namespace {
class SystemTime final : public TimeSource {
 public:
  Clock::time_point now() override { return Clock::now(); }
  bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                  Deadline deadline, const std::function<bool()>& pred) override {
    return cv.wait_until(lock, deadline, pred);
  }
};
}  // namespace

void TimeSource::sleep_until(Deadline t) {
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  wait_until(lock, cv, t, [] { return false; });
}

TimeSource& system_time() {
  static SystemTime clock;
  return clock;
}

}  // namespace qring::collectives
