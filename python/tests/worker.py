#!/usr/bin/python3
"""The ranks of the pytest tests (python/tests/test_*.py): one mode per scenario, run under
qring-launch (or torchrun, mpirun). Each rank prints JSON lines prefixed "RESULT " that the
tests read; everything else is diagnostics.

  worker.py MODE [options]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import qring
import qring.torch


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


class Net(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def data_of(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def grad_of(model, rank, step):
    """The flat gradient rank `rank` computes at `step` from `model`'s parameters."""
    model.zero_grad()
    x, y = data_of(rank, step)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def checksum(model):
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    return f"{crc:08x}"


def mode_mean(a):
    """QuorumAllreduce on flat gradients: each step's result is compared with the mean over
    the step's contributors, computed in torch from the contributors' own gradients (every
    rank can compute every rank's: the data is a function of (rank, step))."""
    qring.init(wait=a.wait)
    rank, world = qring.rank(), qring.size()
    torch.manual_seed(7)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    q = qring.QuorumAllreduce(n, quorum=a.quorum, straggler=a.straggler)
    for step in range(a.steps):
        buf = grad_of(model, rank, step)
        q.contribute(step, buf)
        r = q.wait(step)
        ref = torch.stack([grad_of(model, c, step) for c in r.contributors]).mean(0)
        emit(step=step, contributors=r.contributors, count=r.count, excluded=r.excluded,
             max_err=float((buf - ref).abs().max()), scale=float(ref.abs().max()),
             digest=f"{zlib.crc32(buf.numpy().tobytes()):08x}")
    q.close()
    qring.finalize()


def make_optimizer(a, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = qring.torch.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), quorum=a.quorum, straggler=a.straggler,
        evict_ms=a.evict_ms)
    qring.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    qring.torch.broadcast_optimizer_state(opt, root_rank=0)
    return opt


def mode_train(a):
    """DistributedOptimizer: a loop of --steps steps; --kill-rank R --kill-step S: rank R's
    first incarnation SIGKILLs itself at step S. --until left|rejoined: the ranks run on
    (bounded) until a view without a rank (left) or with a rank that came back (rejoined),
    then --extra more steps: every rank stops at the same step, derived from results that
    every rank gets alike (the step's view epoch; the step a rank rejoined at)."""
    qring.init()
    rank, world = qring.rank(), qring.size()
    torch.manual_seed(11 + (rank if a.seed_by_rank else 0))
    model = Net(hidden=a.hidden_of_rank.get(rank, 16))
    opt = make_optimizer(a, model)
    step = opt.step_count
    stop = a.steps if not a.until else 100000
    if opt.rejoined:
        emit(rank=rank, rejoined=step, donor=opt.rejoined["donor"],
             incarnation=qring.incarnation())
        stop = step + a.extra
    results = []
    deadline = time.monotonic() + 150
    while step < stop:
        if time.monotonic() > deadline:
            emit(rank=rank, error="Timeout", message=f"no view change by step {step}")
            sys.exit(4)
        if rank == a.kill_rank and step == a.kill_step and qring.incarnation() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == a.stop_rank and step == a.stop_step:
            # A helper stops this process now and continues it stop_ms later (SIGSTOP/SIGCONT).
            subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep {a.stop_ms / 1000}; "
                                          f"kill -CONT {os.getpid()}"])
            time.sleep(1)  # stopped within this second
        opt.zero_grad()
        if not opt.excluded():
            x, y = data_of(rank, step)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        r = opt.last_result
        results.append((step, r.contributors, r.excluded))
        step += 1
        if stop == 100000 and ((a.until == "left" and r.epoch > 0) or
                               (a.until == "rejoined" and r.joined)):
            stop = (r.joined[0][2] if r.joined else step) + a.extra
        if a.pace_ms:
            time.sleep(a.pace_ms / 1000)
    emit(rank=rank, steps=step, checksum=checksum(model), contributors=[c for _, c, _ in results],
         excluded=[s for s, _, e in results if e], members=opt.quorum_allreduce.members(),
         incarnation=qring.incarnation())
    qring.finalize()


def mode_launcher(a):
    """Which launcher qring.init() found, and an all-reduce over every rank."""
    qring.init()
    t = torch.full((5,), float(qring.rank() + 1))
    qring.allreduce(t)
    emit(rank=qring.rank(), size=qring.size(), launcher=qring.launcher(), sum=float(t[0]),
         local_rank=qring.local_rank(), local_size=qring.local_size())
    qring.finalize()


MODES = {"mean": mode_mean, "train": mode_train, "launcher": mode_launcher}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quorum", type=int, default=None)
    ap.add_argument("--straggler", default="none")
    ap.add_argument("--wait", choices=["block", "poll"], default="block")
    ap.add_argument("--evict-ms", type=int, default=5000)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--stop-rank", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--stop-ms", type=int, default=0)
    ap.add_argument("--until", choices=["left", "rejoined"])
    ap.add_argument("--extra", type=int, default=5)
    ap.add_argument("--pace-ms", type=int, default=0)
    ap.add_argument("--seed-by-rank", action="store_true",
                    help="different initial parameters per rank (broadcast makes them equal)")
    ap.add_argument("--hidden", action="append", default=[],
                    help="RANK:N: rank RANK's model has N hidden units (a mismatched model)")
    a = ap.parse_args()
    a.hidden_of_rank = {int(r): int(n) for r, n in (h.split(":") for h in a.hidden)}
    torch.set_num_threads(1)
    try:
        MODES[a.mode](a)
    except qring.Error as e:
        emit(rank=int(os.environ.get("QRING_RANK", "-1")), error=type(e).__name__, message=str(e))
        sys.exit(qring.EXIT_EVICTED if isinstance(e, qring.Evicted) else 3)


if __name__ == "__main__":
    main()
