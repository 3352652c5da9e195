#!/usr/bin/python3
"""One rank of scripts/bench_torch.sh: the same PyTorch model, data, optimizer and schedule
with qring.torch (--backend qring) or PyTorch DDP over gloo (--backend ddp), under
qring-launch (rank and world from QRING_RANK / QRING_WORLD_SIZE for both).

  qring-launch -n 4 -- bench_torch.py --backend qring|ddp --model cnn|mlp [--steps N]
      [--batch 64] [--quorum Q] [--straggler fixed:2:200] [--snapshot-every K]
      [--target 0.88] [--ddp-port P] [--wait block|poll] [--summary out.json]

Models: cnn = PyTorch's Fashion-MNIST CNN (python/examples/fmnist_cnn.py, configs/
fmnist-cnn-torch.toml); mlp = 784-256-128-10. SGD momentum 0.9, weight decay 5e-4, lr 0.1 per
256 counted samples (linear rule: qring counts quorum x batch per step, DDP world x batch),
200 warm-up steps then cosine. The straggler model's delay is slept at the start of each step
on both backends (qring.torch: in zero_grad(), cut short when the step is decided without the
rank, which then skips its forward and backward; DDP cannot drop a rank, so it sleeps it all).

Rank 0 prints one JSON line: samples_per_s (samples computed per second by all ranks over the
step loop, start-up excluded), step_ms, and for qring the time inside step() beyond the
all-reduce and the optimizer (overhead_pct of a whole step), for DDP the sizes of its gradient
buckets (ddp_bucket_bytes). With --snapshot-every K rank 0
keeps the parameters every K steps with the loop's wall time, evaluates them after the loop and
reports time_to_target_s (the first snapshot at --target test accuracy) and final_accuracy.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "examples"))
from fashion_mnist import Cnn, accuracy, batch_at, checksum, load_fashion_mnist, lr_at  # noqa: E402
from torch_fmnist import Mlp  # noqa: E402  (scripts/, the directory of this file)


def args_of():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["qring", "ddp"], required=True)
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--quorum", type=int, default=0, help="qring: ranks counted (0: world)")
    ap.add_argument("--straggler", default="none")
    ap.add_argument("--wait", choices=["block", "poll"], default="block",
                    help="qring: qring.init(wait=...), how a rank waits for its peers")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.88)
    ap.add_argument("--ddp-port", type=int, default=29600)
    ap.add_argument("--summary")
    return ap.parse_args()


class QringBackend:
    def __init__(self, model, opt, a, world):
        import qring
        import qring.torch
        qring.init(wait=a.wait)
        self.qring = qring
        self.opt = qring.torch.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), quorum=a.quorum or None,
            straggler=a.straggler, seed=a.seed)
        qring.torch.broadcast_parameters(model.state_dict(), root_rank=0)
        qring.torch.broadcast_optimizer_state(self.opt, root_rank=0)
        self.model = model
        self.counted = 0
        self.compute_s = 0.0

    def step(self, step, x, y):
        self.opt.zero_grad()  # the straggler delay, cut short once excluded
        c0 = time.perf_counter()
        if not self.opt.excluded():
            F.cross_entropy(self.model(x), y).backward()
        c1 = time.perf_counter()
        self.opt.step()
        self.compute_s += c1 - c0
        self.counted += self.opt.last_result.count

    def finish(self, out):
        tm = self.opt.timings
        out["mean_contributors"] = self.counted / max(1, tm["steps"])
        out["step_call_ms"] = 1e3 * tm["step_s"] / max(1, tm["steps"])
        out["allreduce_ms"] = 1e3 * tm["allreduce_s"] / max(1, tm["steps"])
        out["optimizer_ms"] = 1e3 * tm["optimizer_s"] / max(1, tm["steps"])
        overhead = tm["step_s"] - tm["allreduce_s"] - tm["optimizer_s"] - tm["delay_s"]
        out["overhead_ms"] = 1e3 * overhead / max(1, tm["steps"])
        self.qring.finalize()


class DdpBackend:
    def __init__(self, model, opt, a, world, rank):
        import torch.distributed as dist
        from qring import _qring  # the straggler model's delays only (no qring.init)
        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.ddp_port}", rank=rank,
                                world_size=world)
        self.model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's params
        self.opt = opt
        self.delay = lambda step: _qring.straggler_delay_ms(a.straggler, a.seed, rank, step)
        self.compute_s = 0.0
        self.optimizer_s = 0.0

    def step(self, step, x, y):
        self.opt.zero_grad()
        d = self.delay(step)
        if d > 0:
            time.sleep(d / 1e3)
        c0 = time.perf_counter()
        # All-reduces bucket by bucket, each once its gradients are ready; a model that fits
        # one bucket (the CNN, the MLP) is all-reduced after backward, as qring's is.
        F.cross_entropy(self.model(x), y).backward()
        c1 = time.perf_counter()
        self.opt.step()
        self.compute_s += c1 - c0
        self.optimizer_s += time.perf_counter() - c1

    def finish(self, out):
        out["optimizer_ms"] = 1e3 * self.optimizer_s / max(1, out["steps"])
        # The gradient buckets DDP settled on (bytes, in all-reduce order): how much of its
        # all-reduce can overlap backward. A private PyTorch call; absent where it is gone.
        logging_data = getattr(self.model, "_get_ddp_logging_data", None)
        if logging_data is not None:
            d = logging_data()
            sizes = d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or ""
            out["ddp_bucket_bytes"] = [int(b) for b in str(sizes).replace(",", " ").split()]
        self.dist.destroy_process_group()


def main():
    a = args_of()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    rank, world = int(os.environ["QRING_RANK"]), int(os.environ["QRING_WORLD_SIZE"])
    xtr, ytr, xte, yte = load_fashion_mnist(a.data)
    model = Cnn() if a.model == "cnn" else Mlp()
    counted_per_step = (a.quorum or world) if a.backend == "qring" else world
    base_lr = a.lr * counted_per_step * a.batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=5e-4)
    be = QringBackend(model, opt, a, world) if a.backend == "qring" else \
        DdpBackend(model, opt, a, world, rank)
    snapshots = []
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    paused = 0.0  # snapshot copies, not counted as training time
    for step in range(a.steps):
        for group in be.opt.param_groups:
            group["lr"] = lr_at(step, a.steps, base_lr, warmup=200)
        x, y = batch_at(step, xtr, ytr, a.batch, rank, world, a.seed)
        be.step(step, x, y)
        if rank == 0 and a.snapshot_every and (step + 1) % a.snapshot_every == 0:
            s0 = time.perf_counter()
            snapshots.append((step + 1, s0 - t0 - paused,
                              {k: v.detach().clone() for k, v in model.state_dict().items()}))
            paused += time.perf_counter() - s0
    loop_s = time.perf_counter() - t0 - paused
    cpu_s = time.process_time() - cpu0
    out = {"backend": a.backend, "model": a.model, "wait": a.wait, "world": world, "steps": a.steps,
           "batch": a.batch, "quorum": counted_per_step, "straggler": a.straggler,
           "loop_s": loop_s, "step_ms": 1e3 * loop_s / a.steps,
           "samples_per_s": world * a.batch * a.steps / loop_s,
           "cpu_ms_per_step": 1e3 * cpu_s / a.steps,
           "compute_ms": 1e3 * be.compute_s / a.steps}
    be.finish(out)
    if rank != 0:
        print(f"rank {rank} params_checksum {checksum(model)}", flush=True)
        return
    if "overhead_ms" in out:
        out["overhead_pct"] = 100 * out["overhead_ms"] / out["step_ms"]
    out["final_accuracy"] = accuracy(model, xte, yte)
    out["params_checksum"] = checksum(model)
    if snapshots:
        out["time_to_target_s"] = None
        curve = []
        for step, wall, state in snapshots:
            model.load_state_dict(state)
            acc = accuracy(model, xte, yte)
            curve.append([step, round(wall, 3), acc])
            if acc >= a.target:
                out["time_to_target_s"] = wall
                out["steps_to_target"] = step
                break
        out["curve"] = curve
    print(json.dumps(out), flush=True)
    if a.summary:
        with open(a.summary, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
