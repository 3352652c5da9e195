// The transport of asynchronous SGD with a parameter server (the baseline of Chen et al.,
// "Revisiting Distributed Synchronous SGD"): every rank is a worker, and one rank (`server`)
// also holds the parameters. A worker pushes a gradient, then pulls the parameters the server
// sends back once it has applied that gradient; no worker ever waits for another. The server
// takes the pushes one at a time in the order they arrived and answers each.
//
//   ParamServer ps(comm, grad_count, param_count, opts);
//   worker, every rank:          ps.push(grad, version);  version = ps.pull(params);
//   server, rank opts.server:    while (auto p = ps.next_push()) {
//                                  apply(p->data);  ps.reply(*p, params, ++version);
//                                }
//
// Guarantees:
// - Order: the server gets every push exactly once, in the order the pushes arrived there
//   (the server rank's own worker included, which goes through no network).
// - Staleness is the caller's to compute: a push carries the version its gradient was
//   computed on, the server's reply the version it sends.
// - Bounded waits: pull() fails with CollectiveTimeout when the answer is not in `deadline`
//   after the push; next_push() fails when no push arrived for `deadline` while some worker
//   still owes pushes, naming those workers and how long ago each was last heard from.
//   A transport error fails every later call on this rank with the error.
// - End: each worker pushes exactly pushes_per_worker times; next_push() returns nullopt once
//   all were taken. The destructor waits (at most 5 s) for the server's answers to go out.
//
// Messages (tag op kParamServer, seq = the worker's push number mod 2^24, chunk = kind): a
// 40-byte header and the float data, push and answer alike; everything travels through the
// communicator's endpoint, driven by its engine (docs/design.md, "Asynchronous SGD").
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>

#include "collectives/communicator.h"

namespace qring::collectives {

struct ParamServerOptions {
  int server = 0;                 // the rank that serves (it is a worker too)
  int64_t pushes_per_worker = 0;  // every worker pushes exactly this many gradients
  std::chrono::milliseconds deadline{30000};
};

class ParamServer {
 public:
  // Taken by next_push(): the gradient stays valid until reply() answers it.
  struct Push {
    int rank = 0;
    uint64_t index = 0;    // the worker's push number, 0-based
    uint64_t version = 0;  // the parameter version the gradient was computed on
    const float* data = nullptr;  // grad_count floats
  };

  ParamServer(Communicator& comm, size_t grad_count, size_t param_count, ParamServerOptions opts);
  ~ParamServer();
  ParamServer(const ParamServer&) = delete;
  ParamServer& operator=(const ParamServer&) = delete;

  // Worker: sends grad (grad_count floats, copied before this returns). Non-blocking; every
  // push is followed by its pull().
  void push(const float* grad, uint64_t version);
  // Worker: waits for the answer to this rank's last push, writes param_count floats to
  // `params` and returns their version.
  uint64_t pull(float* params);

  // Server: the oldest push not yet taken; nullopt once every worker's pushes were taken.
  std::optional<Push> next_push();
  // Server: answers `p` (the push taken last) with `params` (param_count floats, copied before
  // this returns) at `version`; p's gradient buffer is reused after this.
  void reply(const Push& p, const float* params, uint64_t version);

  // Fails every waiting and later call on this rank with `e` (a thread of the caller failed:
  // the server's waits for the local worker, or the other way round, must not run out).
  void fail(std::exception_ptr e);

  int server() const { return opts_.server; }
  const ParamServerOptions& options() const { return opts_; }

  struct Shared;

 private:
  Communicator& comm_;
  size_t grad_count_, param_count_;
  ParamServerOptions opts_;
  std::shared_ptr<Shared> sh_;
  WorkPtr service_;
  uint64_t pushed_ = 0;         // this worker's pushes so far
  bool awaiting_pull_ = false;  // pushed, answer not pulled yet
};

}  // namespace qring::collectives
