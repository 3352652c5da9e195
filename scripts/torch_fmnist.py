#!/usr/bin/python3
"""The PyTorch side of scripts/bench_vs_torch.sh: the same models, data, optimizer and schedule
as qring-train, in PyTorch (DDP over gloo for more than one rank).

  torch_fmnist.py --model mlp|cnn [--world 4] [--batch 64] [--steps N | --epochs E]
                  [--threads 1] [--summary out.json]

Models (as configs/fmnist-cnn-torch.toml and the MLP 784-256-128-10 of bench_vs_torch.sh):
  mlp: 784 -> 256 -> ReLU -> 128 -> ReLU -> 10
  cnn: conv5x5 32 -> ReLU -> maxpool 2 -> conv5x5 64 -> ReLU -> maxpool 2 -> 1024 -> 128 -> 10
Data: Fashion-MNIST from the IDX files, /255 then standardized with the training set's mean and
std (train/dataset.cc); every epoch a seeded permutation, rank r takes its shard of
N / world samples in batches of --batch. Optimizer: SGD momentum 0.9, weight decay 5e-4,
lr 0.1 * (world * batch) / 256, linear warmup over 200 steps, then cosine to the last step.
Prints one JSON line (and writes it to --summary): samples_per_s over the step loop (start-up
and the final evaluation excluded), test_accuracy after the last step, steps, world.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# The data and PyTorch's CNN as the qring.torch example has them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "examples"))
from fashion_mnist import Cnn, load_fashion_mnist as load  # noqa: E402


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 256), nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def run(rank, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
    xtr, ytr, xte, yte = load(args.data)
    model = Mlp() if args.model == "mlp" else Cnn()
    if args.world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    shard = xtr.shape[0] // args.world
    per_epoch = shard // args.batch
    total = args.steps if args.steps > 0 else args.epochs * per_epoch
    peak = 0.1 * args.world * args.batch / 256
    warm = 200

    def lr_at(t):
        if t < warm:
            return (t + 1) / warm
        span = total - warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / span))) if span > 0 else 1.0

    opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    if args.world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    step = 0
    while step < total:
        perm = torch.randperm(xtr.shape[0], generator=gen)[rank * shard:(rank + 1) * shard]
        for i in range(per_epoch):
            if step >= total:
                break
            idx = perm[i * args.batch:(i + 1) * args.batch]
            x, y = xtr[idx], ytr[idx]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    if args.world > 1:
        dist.barrier()
    loop_s = time.perf_counter() - t0
    model.eval()
    correct = 0
    with torch.no_grad():
        for s in range(0, xte.shape[0], 1000):
            correct += int((model(xte[s:s + 1000]).argmax(1) == yte[s:s + 1000]).sum())
    if rank == 0:
        out = {"framework": "pytorch", "torch": torch.__version__, "model": args.model,
               "world": args.world, "batch_per_rank": args.batch, "threads": args.threads,
               "steps": total, "loop_s": loop_s,
               "samples_per_s": total * args.world * args.batch / loop_s,
               "test_accuracy": correct / xte.shape[0], "final_loss": float(loss)}
        print(json.dumps(out))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(out, f)
    if args.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn"], required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--summary", default="")
    args = p.parse_args()
    if args.world < 1 or args.batch < 1 or args.threads < 1 or (args.steps < 1 and args.epochs < 1):
        p.error("--world, --batch, --threads and --steps or --epochs must be >= 1")
    if args.world == 1:
        run(0, args)
    else:
        mp.spawn(run, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
