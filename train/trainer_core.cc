#include "train/trainer_core.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <nlohmann/json.hpp>

#include "net/base/error.h"

namespace qring::train {

TrainerCore::TrainerCore(const TrainConfig& cfg, const DatasetPair& data, int rank, int world,
                         int quorum)
    : cfg_(cfg),
      data_(data),
      rank_(rank),
      world_(world),
      model_(make_model(cfg.model, static_cast<uint64_t>(cfg.run.seed))),
      opt_(model_->num_params(), sgd_options(cfg)),
      sharder_(data.train.size(), rank, world, cfg.train.batch_per_rank,
               static_cast<uint64_t>(cfg.run.seed)) {
  if (data.train.dim != model_->input_shape().size()) {
    throw UsageError(fmt::format("TrainerCore: data has {} features, the model expects {}",
                                 data.train.dim, model_->input_shape().size()));
  }
  total_steps_ =
      cfg.train.steps > 0 ? cfg.train.steps : cfg.train.epochs * sharder_.batches_per_epoch();
  if (quorum < 1) throw UsageError(fmt::format("TrainerCore: quorum {} must be >= 1", quorum));
  sched_quorum_ = quorum;
  if (cfg.train.budget == "gradients") {
    // As many gradients as full sync counts in total_steps_, in steps of `quorum`.
    budget_gradients_ = total_steps_ * world;
    TrainConfig c = cfg;
    c.train.warmup_steps = cfg.train.warmup_steps * world / quorum;
    c.train.step_decay_every = std::max<int64_t>(1, cfg.train.step_decay_every * world / quorum);
    schedule_ = make_schedule(c, quorum, (budget_gradients_ + quorum - 1) / quorum);
  } else {
    schedule_ = make_schedule(cfg, quorum, total_steps_);
  }
  x_.resize(static_cast<size_t>(cfg.train.batch_per_rank * data.train.dim));
  y_.resize(static_cast<size_t>(cfg.train.batch_per_rank));
}

bool all_finite(const float* p, size_t n) {
  // NaN and the infinities have every exponent bit set; OR-ing a mask over the words
  // vectorizes (std::isfinite per element does not at -O2).
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto w = std::bit_cast<uint32_t>(p[i]);
    bad |= uint32_t((w & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

std::string nonfinite_text(const float* mean, size_t n_params) {
  if (all_finite(mean, n_params + 1)) return {};
  if (!std::isfinite(mean[n_params])) return fmt::format("the mean loss ({})", mean[n_params]);
  size_t bad = 0;
  for (size_t i = 0; i < n_params; ++i) bad += std::isfinite(mean[i]) ? 0 : 1;
  return fmt::format("the mean gradient ({} of its {} values)", bad, n_params);
}

double TrainerCore::compute_gradient() {
  gather_batch(data_.train, sharder_.next_batch(), x_.data(), y_.data());
  return model_->forward_backward(x_.data(), y_.data(), static_cast<int>(y_.size()));
}

void TrainerCore::skip_batch() {
  sharder_.next_batch();
}

void TrainerCore::apply_gradient(const float* grad, double lr_scale, int contributors) {
  opt_.step(model_->params(), grad, lr() * lr_scale);
  ++step_;
  counted_ += contributors > 0 ? contributors : sched_quorum_;
}

bool TrainerCore::apply_gradient_finite(const float* grad, double lr_scale, int contributors,
                                        bool undo) {
  const size_t n = num_params();
  const int64_t step = step_, counted = counted_;
  if (undo) {
    undo_params_.assign(params(), params() + n);
    undo_velocity_ = opt_.velocity();
  }
  apply_gradient(grad, lr_scale, contributors);
  if (all_finite(params(), n)) return true;
  if (undo) {
    std::copy(undo_params_.begin(), undo_params_.end(), params());
    opt_.velocity() = undo_velocity_;
    step_ = step;
    counted_ = counted;
  }
  return false;
}

EvalResult TrainerCore::evaluate_test() {
  return evaluate_dataset(*model_, data_.test, cfg_.train.eval_batch);
}

EvalResult TrainerCore::evaluate_train() {
  return evaluate_dataset(*model_, data_.train, cfg_.train.eval_batch);
}

CheckpointState TrainerCore::checkpoint_state() const {
  return state_of(checkpoint_view());
}

CheckpointView TrainerCore::checkpoint_view() const {
  CheckpointView v;
  v.step = static_cast<uint64_t>(step_);
  v.position = sharder_.position();
  v.config_fingerprint = cfg_.fingerprint();
  v.world = static_cast<uint32_t>(world_);
  v.rank = static_cast<uint32_t>(rank_);
  v.params = std::span<const float>(model_->params(), model_->num_params());
  v.velocity = opt_.velocity();
  meta_ = checkpoint_meta().dump();
  v.meta = meta_;
  return v;
}

// The checkpoint's meta as a JSON object (empty if it is not one).
static nlohmann::json meta_of(const CheckpointView& s) {
  try {
    auto j = nlohmann::json::parse(s.meta);
    if (j.is_object()) return j;
  } catch (const nlohmann::json::exception&) {
  }
  return nlohmann::json::object();
}

static int64_t counted_of(const nlohmann::json& meta) {
  if (meta.contains("counted") && meta["counted"].is_number_integer() &&
      meta["counted"].get<int64_t>() >= 0)
    return meta["counted"].get<int64_t>();
  return -1;
}

// The form of the checkpoint's momentum buffer: "lr_in_velocity" in its meta; absent (a
// checkpoint from before the form was recorded, or a meta that is not JSON): the plain one.
static bool lr_in_velocity_of(const nlohmann::json& meta) {
  return meta.contains("lr_in_velocity") && meta["lr_in_velocity"].is_boolean() &&
         meta["lr_in_velocity"].get<bool>();
}

void TrainerCore::restore(const CheckpointState& s) {
  restore(view_of(s));
}

void TrainerCore::restore(const CheckpointView& s) {
  if (s.params.size() != model_->num_params() || s.velocity.size() != model_->num_params()) {
    throw DataError(
        fmt::format("checkpoint has {} parameters and {} momentum values, the model has {}",
                    s.params.size(), s.velocity.size(), model_->num_params()));
  }
  if (s.config_fingerprint != cfg_.fingerprint()) {
    throw DataError(
        fmt::format("checkpoint config fingerprint {:016x} does not match this "
                    "config's {:016x} (seed, data, model or batch changed)",
                    s.config_fingerprint, cfg_.fingerprint()));
  }
  if (s.position.index >= sharder_.batches_per_epoch()) {
    throw DataError(
        fmt::format("checkpoint data position (epoch {}, batch {}) is past the {} "
                    "batches per epoch of this run",
                    s.position.epoch, s.position.index, sharder_.batches_per_epoch()));
  }
  const nlohmann::json meta = meta_of(s);
  const int64_t counted = counted_of(meta);
  if (budget_gradients_ > 0 && counted < 0)
    throw DataError(
        "checkpoint has no count of gradients (meta 'counted'; written by a run with "
        "train.budget = \"steps\"?), which train.budget = \"gradients\" needs");
  if (const bool in = lr_in_velocity_of(meta); in != opt_.options().lr_in_velocity) {
    auto form = [](bool inside) {
      return inside ? "the rate inside it (quorum.quorum = \"auto\")"
                    : "the plain form (a fixed quorum)";
    };
    throw DataError(fmt::format(
        "checkpoint's momentum buffer holds {}, this run's holds {}: resume with the quorum "
        "mode that wrote it, or start afresh",
        form(in), form(opt_.options().lr_in_velocity)));
  }
  std::copy(s.params.begin(), s.params.end(), model_->params());
  opt_.velocity().assign(s.velocity.begin(), s.velocity.end());
  sharder_.seek(s.position);
  step_ = static_cast<int64_t>(s.step);
  counted_ = counted >= 0 ? counted : step_ * sched_quorum_;
}

}  // namespace qring::train
