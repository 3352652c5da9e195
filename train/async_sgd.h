// Asynchronous SGD, train.mode = "async": the comparison point of Chen et al., "Revisiting
// Distributed Synchronous SGD" (docs/training.md, "Asynchronous SGD").
//
// Every rank is a worker; rank 0 also runs the parameter server, on a thread of its own, over
// the same communicator (collectives/param_server.h). Worker w, for k = 0 .. K-1 (K =
// train.steps, or train.epochs x batches per epoch of its shard, as in sync mode):
//
//   sleep straggler.delay(run.seed, w, k)       the same delays as sync step k
//   g = gradient of its next batch at the parameters it pulled last (version v)
//   push(g, v); pull the parameters the server sends back once it applied g
//
// The server applies every gradient as it arrives, one at a time, with the optimizer and
// schedule of a run of K x W steps at quorum 1 (the learning rate of one worker's batch,
// warmup W times longer): W times as many updates as the sync run's steps, each from one
// batch. Staleness of an update = updates applied between the worker's pull and this one.
// Evaluations (every train.eval_every x W updates, or each epoch's worth) run on the server
// thread, pausing the updates as the sharded evaluation pauses sync training.
//
// Every wait is bounded by quorum.deadline_ms: a worker waiting for its parameters, the server
// waiting for any gradient (the error names the workers that still owe some). No checkpoints,
// --resume or QRING_FAULT in this mode (ConfigError).
//
// Rank 0 writes runs/<run.name>/{metrics.jsonl, summary.json, config.toml}: a "step" line per
// update (step = update number, worker, push, staleness, loss, lr, iteration_ms = time since
// that worker's previous gradient reached the server, server_wait_ms = time the server sat
// idle before it), "eval" lines as in sync mode, and summary keys of sync mode plus mode,
// updates, staleness_mean, staleness_max, staleness_hist and iteration_p50_ms / _p90_ms.
#pragma once

#include "collectives/communicator.h"
#include "train/config.h"
#include "train/trainer.h"

namespace qring::train {

RunSummary train_async(const TrainConfig& cfg, collectives::Communicator& comm,
                       const TrainerOptions& opts);

}  // namespace qring::train
