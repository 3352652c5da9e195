#!/usr/bin/python3
"""PyTorch's Fashion-MNIST CNN, trained with backup workers by qring.torch.

    build/net/qring-launch -n 4 -- python3 python/examples/fmnist_cnn.py --quorum 3
    build/net/qring-launch -n 4 --tolerate-failures 1 -- python3 python/examples/fmnist_cnn.py \\
        --quorum 3 --straggler fixed:2:200
    sbatch -N 2 --ntasks-per-node 2 scripts/slurm/torch.sbatch python/examples/fmnist_cnn.py

The model of configs/fmnist-cnn-torch.toml (conv 5x5 32 -> max pool -> conv 5x5 64 -> max
pool -> 1024 -> 128 -> 10) on Debian's dataset-fashion-mnist, SGD with momentum, a linear
warm-up then a cosine schedule. Each step counts the first `--quorum` ranks' gradients; the
others' are dropped. Rank 0 evaluates on the test set after every epoch and prints one JSON
line at the end; every rank prints its parameter checksum (they are equal).
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import qring
import qring.torch
from fashion_mnist import Cnn, accuracy, batch_at, checksum, load_fashion_mnist, lr_at


def main(make_model=Cnn, doc=__doc__, defaults=None):
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    ap.add_argument("--lr", type=float, default=0.1, help="for 256 samples per step (scaled)")
    ap.add_argument("--quorum", type=int, default=None, help="ranks counted per step (all)")
    ap.add_argument("--grace-ms", type=int, default=0)
    ap.add_argument("--straggler", default="none", help="e.g. fixed:2:200 (qring-train's models)")
    ap.add_argument("--evict-ms", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--test-samples", type=int, default=0, help="evaluate on the first N (0: all)")
    ap.add_argument("--summary", help="write the final JSON line here too (rank 0)")
    ap.set_defaults(**(defaults or {}))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    qring.init()
    rank, world = qring.rank(), qring.size()
    xtr, ytr, xte, yte = load_fashion_mnist(args.data)
    if args.test_samples:
        xte, yte = xte[:args.test_samples], yte[:args.test_samples]
    model = make_model()
    quorum = args.quorum or world
    base_lr = args.lr * quorum * args.batch / 256  # the linear rule, per counted sample
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=5e-4)
    opt = qring.torch.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), quorum=args.quorum,
        grace_ms=args.grace_ms, straggler=args.straggler, evict_ms=args.evict_ms, seed=args.seed)
    qring.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    qring.torch.broadcast_optimizer_state(opt, root_rank=0)

    per_epoch = len(xtr) // (world * args.batch)
    total = args.steps or args.epochs * per_epoch
    t0 = time.perf_counter()
    dropped = 0
    # A rank restarted by qring-launch --max-restarts starts at the job's step (step_count),
    # with the job's parameters and optimizer state; its batches follow from the step.
    for step in range(opt.step_count, total):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, base_lr, warmup=200)
        opt.zero_grad()  # a straggler model's delay is slept here
        if not opt.excluded():  # the step was decided without this rank: skip the work
            x, y = batch_at(step, xtr, ytr, args.batch, rank, world, args.seed)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        dropped += world - opt.last_result.count
        if rank == 0 and (step + 1) % per_epoch == 0 and step + 1 < total:
            print(f"step {step + 1}/{total} test accuracy {accuracy(model, xte, yte):.4f} "
                  f"contributors {opt.last_result.count}/{world} "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    wall = time.perf_counter() - t0
    if rank == 0:
        summary = {"test_accuracy": accuracy(model, xte, yte), "steps": total, "wall_s": wall,
                   "world": world, "quorum": quorum, "dropped_gradients": dropped,
                   "params_checksum": checksum(model), "provider": qring.provider()}
        print(json.dumps(summary), flush=True)
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)
    else:
        print(f"rank {rank} params_checksum {checksum(model)}", flush=True)
    qring.finalize()


def run(**kw):
    try:
        main(**kw)
    except qring.Evicted as e:  # alive but evicted: qring-launch counts status 75 as lost
        print(f"evicted: {e}", file=sys.stderr)
        sys.exit(qring.EXIT_EVICTED)


if __name__ == "__main__":
    run()
