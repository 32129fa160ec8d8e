"""The main job's data and models, without any framework for distribution: scikit-learn's digits (bundled with
the package, 1,797 8x8 images) split 80/20; the main job's FC-heavy net, which the Horovod job
(examples/train_digits.py) and the DDP job (examples/train_digits_ddp.py) train; and the small CNN the fidelity
suite trains (benchmarks/fidelity_suite.py, task "digits")."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class WideDigitsNet(nn.Module):
    """DigitsCNN's two convolutions, then two wide fully connected layers: 3.2 M parameters, 99.8% of them in the
    FC layers, the shape of the paper's AlexNet and VGG. Why: the main job should show the case TernGrad is for,
    a step whose exchange costs more than its compute. At 2 workers on 1 Gbit/s its 12.6 MB of fp32 gradient take
    about 150 ms a step to average, against 17 ms of compute on one core (results/main_job/); DigitsCNN's 153 KB
    take about 1 ms, which coding does not win back."""

    def __init__(self, hidden: tuple[int, int] = (2048, 1024)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def load_data(split_seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_test = len(y) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return (x[tr], y[tr]), (x[te], y[te])


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return 100.0 * acc
