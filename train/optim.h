// SGD with momentum and weight decay, and the learning-rate schedule.
//
// Update (PyTorch's torch.optim.SGD, dampening 0), per element, in float:
//   d = g + weight_decay * p
//   v = momentum * v + d              (v starts at 0, so the first v is d)
//   p = p - lr * (nesterov ? d + momentum * v : v)
// or, with lr_in_velocity (quorum.quorum = "auto"), the rate inside the buffer:
//   v = momentum * v + lr * d
//   p = p - (nesterov ? lr * d + momentum * v : v)
// The two are the same at a constant rate. Where the rate changes from step to step, as under
// the adaptive quorum (the rate scales with each step's contributors, 1 then 2 then 1 ...),
// PyTorch's form applies the new rate to the whole buffer, i.e. to the gradients of earlier
// steps too (a step of 2 after steps of 1 doubles what their momentum still moves); the rate
// inside the buffer gives each step's gradient its own rate for good (the "momentum
// correction" of Goyal et al., "Accurate, Large Minibatch SGD", 2017), so that every counted
// gradient moves the parameters by the same total amount: its step's rate over the step's k
// gradients, over 1 - momentum, which the linear rule makes the same for every k.
//
// Learning rate at step t (0-based), with peak = scaled_lr(...):
//   warmup (t < W):  peak * (t + 1) / W
//   constant:        peak
//   step:            peak * factor ^ floor(t / every)         (t >= W)
//   cosine:          peak * 0.5 * (1 + cos(pi * (t - W) / (T - W)))   (t >= W, clamped at T)
//
// Scaling rule (train.lr_scaling) with effective batch E = quorum * batch_per_rank:
//   none: peak = lr;  linear: peak = lr * E / reference_batch;
//   sqrt: peak = lr * sqrt(E / reference_batch)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace qring::train {

struct TrainConfig;

struct SgdOptions {
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool lr_in_velocity = false;  // the buffer holds lr-scaled steps (above)
};

// Async SGD (train.async_staleness): the factor on the scheduled learning rate of an update
// whose gradient is `staleness` updates old: 1, or 1 / max(1, staleness) with `divide`.
double staleness_lr_scale(bool divide, int64_t staleness);

class Sgd {
 public:
  Sgd(size_t num_params, SgdOptions opts);
  // One update of params (num_params floats) with the (averaged) gradient.
  void step(float* params, const float* grads, double lr);
  size_t size() const { return velocity_.size(); }
  const SgdOptions& options() const { return opts_; }
  // The momentum buffer, for checkpoints.
  std::vector<float>& velocity() { return velocity_; }
  const std::vector<float>& velocity() const { return velocity_; }

 private:
  SgdOptions opts_;
  std::vector<float> velocity_;
};

enum class ScheduleKind { kConstant, kStep, kCosine };

struct LrSchedule {
  double peak_lr = 0.1;
  int64_t warmup_steps = 0;
  ScheduleKind kind = ScheduleKind::kConstant;
  int64_t total_steps = 1;    // cosine
  int64_t step_every = 1000;  // step
  double step_factor = 0.1;   // step
  double at(int64_t step) const;
};

// The documented scaling rule; throws ConfigError naming train.lr_scaling for an unknown rule.
double scaled_lr(double base_lr, const std::string& rule, int quorum, int64_t batch_per_rank,
                 int64_t reference_batch);

// The schedule for this config, quorum Q and total step count.
LrSchedule make_schedule(const TrainConfig& cfg, int quorum, int64_t total_steps);

SgdOptions sgd_options(const TrainConfig& cfg);

}  // namespace qring::train
