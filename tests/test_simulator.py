"""The simulator (benchmarks/simulator.py) against real jobs: K steps of training give bit-identical parameters.

One real horovodrun-style job per world size (2 and 4 ranks) trains a small model with hvd_terngrad's optimizer
for every transport and option set below; the simulator trains the same model, from the same initialization
and on the same per-rank batches, in one process.
"""
import pytest
import torch

from benchmarks.simulator import SimulatedWorkers
from hvd_terngrad import TernGradConfig
from tests.mpi_harness import run_ranks

STEPS = 4
CASES = [  # (name, TernGrad options)
    ("allgather", {}),
    ("allgather-ef-noshare", {"error_feedback": True, "share_scaler": False, "clip": 0.0}),
    ("summed", {"transport": "summed"}),
    ("summed-int8", {"transport": "summed-int8"}),
    ("sharded", {"transport": "sharded"}),
    ("sharded-ternary", {"transport": "sharded-ternary"}),
    ("sharded-ternary-owner-ef", {"transport": "sharded-ternary", "owner_error_feedback": True,
                                  "error_feedback": True}),
    ("blocks", {"block_size": 64}),
    ("blocks-noshare-ef", {"block_size": 128, "share_scaler": False, "error_feedback": True}),
    ("blocks-summed", {"block_size": 64, "transport": "summed"}),
    ("blocks-sharded", {"block_size": 64, "transport": "sharded"}),
    ("blocks-sharded-ternary", {"block_size": 256, "transport": "sharded-ternary"}),
]
COMMON = {"seed": 3, "min_numel": 256, "exclude": ("head.*",)}
BUCKET_BYTES = 4 * 2048  # several buckets


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                                        torch.nn.ReLU(), torch.nn.Linear(48, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 5)  # excluded: a float pass-through, as the paper's classifier

    def forward(self, x):
        return self.head(self.body(x))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def body_train(cases) -> dict:
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for name, options in cases:
        model = _Net()
        tg = hvd_terngrad.TernGrad(**COMMON, **options)
        opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                named_parameters=model.named_parameters(), compression=tg,
                                                bucket_bytes=BUCKET_BYTES)
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, hvd.rank(), step).backward()
            opt.step()
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def _simulate(options: dict, n: int) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    model = _Net()
    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(**COMMON, **options), n, BUCKET_BYTES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    for step in range(STEPS):
        grads = []
        for r in range(n):
            model.zero_grad()
            _loss(model, r, step).backward()
            grads.append([p.grad.clone() for p in params])
        for p, g in zip(params, sim.average(grads)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_simulator_gives_the_parameters_of_a_real_job_bit_for_bit(n):
    real = run_ranks("tests.test_simulator:body_train", np=n, timeout=240, args=(CASES,))
    for name, options in CASES:
        for r in range(1, n):  # the job itself: every rank the same
            assert all(torch.equal(a, b) for a, b in zip(real[0][name], real[r][name])), name
        sim = _simulate(options, n)
        for (pname, _), a, b in zip(_Net().named_parameters(), real[0][name], sim):
            assert torch.equal(a, b), f"{name}, {n} ranks: {pname} differs by {float((a - b).abs().max()):.3g}"


def test_one_worker_is_left_alone_and_bad_shapes_are_refused():
    model = _Net()
    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(), 1)
    g = [torch.ones_like(p) for p in model.parameters()]
    assert all(a is b for a, b in zip(sim.average([g]), g))
    with pytest.raises(ValueError, match="need 2 lists"):
        SimulatedWorkers(model.named_parameters(), TernGradConfig(), 2).average([g])
    with pytest.raises(ValueError, match="hierarchical"):
        SimulatedWorkers(model.named_parameters(), TernGradConfig(hierarchical=True), 2)
