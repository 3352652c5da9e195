#!/usr/bin/python3
"""A deeper model with qring.torch: a 14-layer residual network on Fashion-MNIST.

    build/net/qring-launch -n 4 -- python3 python/examples/fmnist_resnet.py --quorum 3
    build/net/qring-launch -n 4 --max-restarts 1 -- python3 python/examples/fmnist_resnet.py \\
        --quorum 3 --straggler lognormal:4:1
    sbatch -N 2 --ntasks-per-node 2 scripts/slurm/torch.sbatch python/examples/fmnist_resnet.py

A 3x3 convolution stem and three stages of two residual blocks (16, 32, 64 channels at 28x28,
14x14 and 7x7; each block two 3x3 convolutions with group normalization: no batch statistics,
so every rank's model is its parameters alone), global average pooling and a linear layer:
13 convolutions + 1 linear on the main path (and two 1x1 projections), 175 k parameters,
about 40 MFLOP per image. Data, loop, schedule
and options are those of fmnist_cnn.py (same directory); only the model differs.
"""
import torch.nn as nn
import torch.nn.functional as F

from fmnist_cnn import run


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.GroupNorm(8, cout))

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, 1, 1, bias=False),
                                  nn.GroupNorm(8, widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean((2, 3)))


if __name__ == "__main__":
    run(make_model=ResNet, doc=__doc__, defaults={"epochs": 1, "batch": 32, "lr": 0.05})
