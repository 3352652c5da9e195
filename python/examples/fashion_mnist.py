"""Fashion-MNIST for the examples (no qring here): Debian's dataset-fashion-mnist IDX files,
PyTorch's reference CNN (configs/fmnist-cnn-torch.toml), the batch of a rank at a step, the
learning-rate schedule, test accuracy and a parameter checksum. Used by fmnist_cnn.py,
fmnist_resnet.py, scripts/bench_torch.py and scripts/torch_fmnist.py.
"""
import gzip
import math
import os
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 5), nn.Conv2d(32, 64, 5)
        self.fc1, self.fc2 = nn.Linear(1024, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3])]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def load_fashion_mnist(dirname):
    """Train and test sets as float tensors (N, 1, 28, 28), standardized, and labels."""
    def split(prefix):
        def path(base):
            p = os.path.join(dirname, base)
            return p + ".gz" if os.path.exists(p + ".gz") else p
        x = read_idx(path(prefix + "-images-idx3-ubyte")).astype(np.float32) / 255.0
        y = read_idx(path(prefix + "-labels-idx1-ubyte")).astype(np.int64)
        return x, y
    xtr, ytr = split("train")
    xte, yte = split("t10k")
    mean, std = float(xtr.astype(np.float64).mean()), float(xtr.astype(np.float64).std())
    norm = lambda x: torch.from_numpy((x - mean) / std).reshape(-1, 1, 28, 28)
    return norm(xtr), torch.from_numpy(ytr), norm(xte), torch.from_numpy(yte)


def batch_at(step, x, y, batch, rank, world, seed):
    """Rank `rank`'s batch of step `step`: a function of the step alone, so a rank that
    rejoins at any step reads what it would have read."""
    per_epoch = len(x) // (world * batch)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
    idx = perm[(i * world + rank) * batch:(i * world + rank + 1) * batch]
    return x[idx], y[idx]


def lr_at(step, total, base, warmup):
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    model.train()
    return correct / len(x)


def checksum(model):
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    return f"{crc:08x}"
