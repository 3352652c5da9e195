#include "train/optim.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "net/base/error.h"
#include "train/config.h"

namespace qring::train {

Sgd::Sgd(size_t num_params, SgdOptions opts) : opts_(opts), velocity_(num_params, 0.0f) {}

void Sgd::step(float* params, const float* grads, double lr) {
  const float m = static_cast<float>(opts_.momentum);
  const float wd = static_cast<float>(opts_.weight_decay);
  const float eta = static_cast<float>(lr);
  const int64_t n = static_cast<int64_t>(velocity_.size());
  float* v = velocity_.data();
  if (opts_.lr_in_velocity && opts_.nesterov) {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; ++i) {
      const float d = eta * (grads[i] + wd * params[i]);
      v[i] = m * v[i] + d;
      params[i] -= d + m * v[i];
    }
  } else if (opts_.lr_in_velocity) {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; ++i) {
      v[i] = m * v[i] + eta * (grads[i] + wd * params[i]);
      params[i] -= v[i];
    }
  } else if (opts_.nesterov) {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; ++i) {
      const float d = grads[i] + wd * params[i];
      v[i] = m * v[i] + d;
      params[i] -= eta * (d + m * v[i]);
    }
  } else {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; ++i) {
      const float d = grads[i] + wd * params[i];
      v[i] = m * v[i] + d;
      params[i] -= eta * v[i];
    }
  }
}

double LrSchedule::at(int64_t step) const {
  if (step < 0) step = 0;
  if (step < warmup_steps)
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  switch (kind) {
    case ScheduleKind::kConstant:
      return peak_lr;
    case ScheduleKind::kStep:
      return peak_lr * std::pow(step_factor, static_cast<double>(step / step_every));
    case ScheduleKind::kCosine: {
      const int64_t span = total_steps - warmup_steps;
      if (span <= 0) return peak_lr;
      const double frac = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
      return peak_lr * 0.5 * (1.0 + std::cos(std::numbers::pi * frac));
    }
  }
  return peak_lr;
}

double scaled_lr(double base_lr, const std::string& rule, int quorum, int64_t batch_per_rank,
                 int64_t reference_batch) {
  if (quorum < 1 || batch_per_rank < 1 || reference_batch < 1) {
    throw UsageError(fmt::format("scaled_lr: quorum {}, batch {}, reference {} must be >= 1",
                                 quorum, batch_per_rank, reference_batch));
  }
  const double ratio =
      static_cast<double>(quorum) * static_cast<double>(batch_per_rank) / reference_batch;
  if (rule == "none") return base_lr;
  if (rule == "linear") return base_lr * ratio;
  if (rule == "sqrt") return base_lr * std::sqrt(ratio);
  throw ConfigError(fmt::format("config key 'train.lr_scaling': unknown value '{}'", rule));
}

LrSchedule make_schedule(const TrainConfig& cfg, int quorum, int64_t total_steps) {
  LrSchedule s;
  s.peak_lr = scaled_lr(cfg.train.lr, cfg.train.lr_scaling, quorum, cfg.train.batch_per_rank,
                        cfg.train.reference_batch);
  s.warmup_steps = cfg.train.warmup_steps;
  s.total_steps = total_steps;
  s.step_every = cfg.train.step_decay_every;
  s.step_factor = cfg.train.step_decay_factor;
  if (cfg.train.schedule == "constant") {
    s.kind = ScheduleKind::kConstant;
  } else if (cfg.train.schedule == "step") {
    s.kind = ScheduleKind::kStep;
  } else if (cfg.train.schedule == "cosine") {
    s.kind = ScheduleKind::kCosine;
  } else {
    throw ConfigError(
        fmt::format("config key 'train.schedule': unknown value '{}'", cfg.train.schedule));
  }
  return s;
}

SgdOptions sgd_options(const TrainConfig& cfg) {
  // quorum "auto" scales the rate with each step's contributors: the rate goes into the buffer.
  return {cfg.train.momentum, cfg.train.weight_decay, cfg.train.nesterov, cfg.quorum.quorum_auto};
}

double staleness_lr_scale(bool divide, int64_t staleness) {
  return divide && staleness > 1 ? 1.0 / double(staleness) : 1.0;
}

}  // namespace qring::train
