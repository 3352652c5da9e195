// The single-process compute core of qring-train: one rank's model, optimizer, data stream
// and schedule. The distributed loop drives it:
//
//   TrainerCore core(cfg, data, rank, world, quorum);
//   while (core.step() < core.total_steps()) {
//     core.compute_gradient();                    // next batch of this rank's shard
//     allreduce_mean(core.gradient(), core.num_params());   // or the quorum all-reduce
//     core.apply_gradient(core.gradient());       // SGD step at lr = schedule.at(step)
//   }
//
// Every rank starts from the same parameters (init from run.seed) and applies the same averaged
// gradient, so parameters stay bit-identical across ranks. The data position advances by one
// batch per compute_gradient() or skip_batch(), independently of the optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/config.h"
#include "train/dataset.h"
#include "train/model.h"
#include "train/nn.h"
#include "train/optim.h"

namespace qring::train {

// Whether the n floats at p are all finite (no NaN, no infinity).
bool all_finite(const float* p, size_t n);

// The check of a step's mean gradient (n_params floats, then the mean loss): an empty string
// when every value is finite, else what is not ("the mean loss (nan)", "the mean gradient
// (12 of its 535818 values)").
std::string nonfinite_text(const float* mean, size_t n_params);

class TrainerCore {
 public:
  // data must outlive the core. quorum = Q (for the LR scaling rule). Total steps =
  // train.steps, or train.epochs * batches_per_epoch when train.steps is 0. With
  // train.budget = "gradients" the run ends once its updates have counted total_steps() x
  // world gradients (budget_spent), and the schedule spans that many gradients in steps of
  // `quorum`: it is read at counted_gradients() / quorum, warm-up and step decay scaled by
  // world / quorum.
  TrainerCore(const TrainConfig& cfg, const DatasetPair& data, int rank, int world, int quorum);

  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  Sgd& optimizer() { return opt_; }
  const Sharder& sharder() const { return sharder_; }
  const LrSchedule& schedule() const { return schedule_; }

  int64_t step() const { return step_; }  // optimizer steps applied
  int64_t total_steps() const { return total_steps_; }
  int64_t steps_per_epoch() const { return sharder_.batches_per_epoch(); }
  DataPosition position() const { return sharder_.position(); }
  double lr() const { return schedule_.at(schedule_position()); }  // of the next step
  // The schedule's step for the next update: step() with a budget of steps, counted
  // gradients / the schedule's quorum with a budget of gradients.
  int64_t schedule_position() const {
    return budget_gradients_ > 0 ? counted_ / sched_quorum_ : step_;
  }
  // Gradients counted into the updates applied so far (apply_gradient's `contributors`).
  int64_t counted_gradients() const { return counted_; }
  // 0 with a budget of steps; else the gradients the run is to count.
  int64_t budget_gradients() const { return budget_gradients_; }
  // Whether the run is over after `steps_run` steps (skipped ones included): a budget of
  // steps ends at total_steps(), one of gradients once counted_gradients() reaches it.
  bool budget_spent(int64_t steps_run) const {
    return budget_gradients_ > 0 ? counted_ >= budget_gradients_ : steps_run >= total_steps_;
  }
  size_t num_params() const { return model_->num_params(); }
  float* params() { return model_->params(); }
  float* gradient() { return model_->grads(); }

  // Forward + backward on the next batch; the gradient (of the batch-mean loss) is in
  // gradient(). Returns the batch-mean loss.
  double compute_gradient();
  // Advances the data position by one batch without computing (e.g. abandoned stale work).
  void skip_batch();
  // One SGD step with `grad` (num_params() floats, may alias gradient()); step() += 1 and
  // counted_gradients() += contributors (the gradients averaged into grad; 0: the schedule's
  // quorum). The scheduled learning rate is multiplied by lr_scale (the adaptive quorum:
  // contributors of the step over the quorum the schedule was built for).
  void apply_gradient(const float* grad, double lr_scale = 1.0, int contributors = 0);
  // apply_gradient, then whether the parameters are still all finite (a finite gradient
  // times a huge learning rate overflows them). With `undo` the parameters, momentum, step and
  // counted gradients are put back as they were when they are not (train.nonfinite = "skip";
  // costs a copy of parameters and momentum per step).
  bool apply_gradient_finite(const float* grad, double lr_scale, int contributors, bool undo);

  // Accuracy and mean loss on the test set (or the train set), batches of train.eval_batch.
  EvalResult evaluate_test();
  EvalResult evaluate_train();

  // Parameters, momentum, step, data position, config fingerprint, world and rank. The caller
  // adds carry, rng_state and meta as needed.
  CheckpointState checkpoint_state() const;
  // The same content as spans into the live parameters and momentum (valid until the next
  // update): for encoding without a copy in between.
  CheckpointView checkpoint_view() const;
  // What this core puts in a state's meta ({"counted": N}); a caller adding keys starts here.
  // "lr_in_velocity": the form of the momentum buffer (SgdOptions; quorum "auto").
  nlohmann::json checkpoint_meta() const {
    return {{"counted", counted_}, {"lr_in_velocity", opt_.options().lr_in_velocity}};
  }
  // Restores parameters, momentum, step, data position and (a budget of gradients) the
  // counted gradients, from the state's meta ({"counted": N, "lr_in_velocity": B};
  // checkpoint_view writes it; a meta without the form is the plain one).
  // Throws DataError if the sizes or the config fingerprint do not match this core, if a
  // budget of gradients finds no count, or if the buffer's form is not this run's (a
  // checkpoint of quorum "auto" resumed with a fixed quorum, or the other way round).
  void restore(const CheckpointState& s);
  void restore(const CheckpointView& s);

 private:
  const TrainConfig cfg_;
  const DatasetPair& data_;
  int rank_, world_;
  std::unique_ptr<Model> model_;
  Sgd opt_;
  Sharder sharder_;
  LrSchedule schedule_;
  int64_t total_steps_;
  int64_t step_ = 0;
  int sched_quorum_;
  int64_t budget_gradients_ = 0;
  int64_t counted_ = 0;
  mutable std::string meta_;  // checkpoint_view's meta
  AlignedVector<float> x_;
  std::vector<int32_t> y_;
  std::vector<float> undo_params_, undo_velocity_;  // apply_gradient_finite's copies
};

}  // namespace qring::train
