"""The benchmark models: CPU-sized versions of the paper's model families, their input, and how their
parameters divide under TernGrad's default policy. No Horovod: the performance model reads these offline.

    alexnet    AlexNet-style, FC-heavy: two small convs, then 1600 -> 2048 -> 2048 -> 10 (7.5 M parameters)
    vgg        VGG-A-style: 8 conv layers 64 .. 256, two 512-wide FC layers (3.7 M)
    googlenet  GoogLeNet-style, conv-heavy: inception blocks, global pooling, one FC (0.35 M)
    mlp        3072 -> 2048 -> 2048 -> 10 (10.5 M)
    wide       3072 -> 4096 -> 10 (12.6 M), little compute: for transport sweeps at batch size 4
    tiny       3072 -> 128 -> 10, for smoke tests
    alexnet-imagenet  torchvision's AlexNet layer for layer (61.1 M, 224x224 images, 1000 classes): the model of
               Horovod's pytorch_synthetic_benchmark.py, without torchvision
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (3, 32, 32)  # CIFAR-sized images
NUM_CLASSES = 10
_INPUT_NUMEL = INPUT_SHAPE[0] * INPUT_SHAPE[1] * INPUT_SHAPE[2]


class AlexNetS(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(INPUT_SHAPE[0], 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, 2048)
        self.fc2 = nn.Linear(2048, 2048)
        self.fc3 = nn.Linear(2048, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class VGGAS(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = [64, "M", 128, "M", 256, 256, "M", 256, 256, "M", 256, 256, "M"]
        layers, c = [], INPUT_SHAPE[0]
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(inplace=True), nn.Linear(512, 512),
                                        nn.ReLU(inplace=True), nn.Linear(512, NUM_CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Inception(nn.Module):
    def __init__(self, c_in, c1, c3r, c3, c5r, c5, cp):
        super().__init__()
        self.b1 = nn.Conv2d(c_in, c1, 1)
        self.b3 = nn.Sequential(nn.Conv2d(c_in, c3r, 1), nn.ReLU(inplace=True), nn.Conv2d(c3r, c3, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(c_in, c5r, 1), nn.ReLU(inplace=True), nn.Conv2d(c5r, c5, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c_in, cp, 1))

    def forward(self, x):
        return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1))


class GoogLeNetS(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(INPUT_SHAPE[0], 64, 3, padding=1), nn.ReLU(inplace=True))
        self.i3a = Inception(64, 32, 48, 64, 8, 16, 16)
        self.i3b = Inception(128, 64, 64, 96, 16, 48, 32)
        self.i4a = Inception(240, 96, 48, 104, 8, 24, 32)
        self.i4b = Inception(256, 80, 56, 112, 12, 32, 32)
        self.fc = nn.Linear(256, NUM_CLASSES)

    def forward(self, x):
        x = self.i3b(self.i3a(self.stem(x)))
        x = F.max_pool2d(x, 2)
        x = F.max_pool2d(self.i4b(self.i4a(x)), 2)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_INPUT_NUMEL, 2048), nn.ReLU(inplace=True),
                                 nn.Linear(2048, 2048), nn.ReLU(inplace=True), nn.Linear(2048, NUM_CLASSES))

    def forward(self, x):
        return self.net(x)


class FC(nn.Module):
    """3072 -> hidden -> 10: `wide` (4096, 12.6 M parameters, communication-bound) and `tiny` (128, smoke tests)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(_INPUT_NUMEL, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, NUM_CLASSES))

    def forward(self, x):
        return self.net(x)


class AlexNetImageNet(nn.Module):
    """torchvision.models.alexnet(): the same layers, shapes and parameter names (features.*, classifier.*)."""

    INPUT_SHAPE, NUM_CLASSES = (3, 224, 224), 1000

    def __init__(self):
        super().__init__()
        relu = functools.partial(nn.ReLU, inplace=True)
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2), relu(), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), relu(), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), relu(), nn.Conv2d(384, 256, 3, padding=1), relu(),
            nn.Conv2d(256, 256, 3, padding=1), relu(), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 6 * 6, 4096), relu(), nn.Dropout(0.5), nn.Linear(4096, 4096), relu(),
            nn.Linear(4096, self.NUM_CLASSES))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


MODELS = {"alexnet": AlexNetS, "vgg": VGGAS, "googlenet": GoogLeNetS, "mlp": MLP,
          "wide": functools.partial(FC, 4096), "tiny": functools.partial(FC, 128),
          "alexnet-imagenet": AlexNetImageNet}


def synthetic_batch(batch: int, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels of model `name`'s input (CIFAR-sized unless the model says otherwise)."""
    cls = MODELS.get(name)
    shape, classes = getattr(cls, "INPUT_SHAPE", INPUT_SHAPE), getattr(cls, "NUM_CLASSES", NUM_CLASSES)
    return torch.randn(batch, *shape), torch.randint(0, classes, (batch,))


def build(name: str) -> nn.Module:
    """A model by name, with the same initial weights every time (seed 0)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name]()


def param_sizes(name: str) -> list[tuple[str, int]]:
    """(name, numel) of each parameter, in registration order."""
    return [(n, p.numel()) for n, p in build(name).named_parameters()]


