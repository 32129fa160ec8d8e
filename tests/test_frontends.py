"""Both Horovod front ends and the simulator against the golden parameters (tests/golden/frontends.py).

The golden file was written by real jobs before the exchange was refactored into one pipeline: K steps of
training with the stock hvd.DistributedOptimizer and with hvd_terngrad's, every transport, 2 and 4 ranks. Real
jobs must still give those bits (one launch per world size runs every case of both front ends), and so must
the simulator, which drives the same pipeline over loopback collectives in one process.
"""
import json

import pytest
import torch

from benchmarks.simulator import SimulatedWorkers
from hvd_terngrad import TernGradConfig
from tests.golden import frontends as G
from tests.mpi_harness import run_ranks

GOLDEN = json.loads(G.GOLDEN.read_text())


def _simulate(options: dict, n: int) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    model = G.Net()
    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(**G.COMMON, **options), n, G.BUCKET_BYTES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    for step in range(G.STEPS):
        grads = []
        for r in range(n):
            model.zero_grad()
            G.loss(model, r, step).backward()
            grads.append([p.grad.clone() for p in params])
        for p, g in zip(params, sim.average(grads)):
            p.grad = g
        opt.step()
    return params


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_real_jobs_of_both_front_ends_give_the_golden_parameters(n):
    res = run_ranks("tests.golden.frontends:body_frontends", np=n, timeout=300)
    for r in range(n):
        assert res[r] == GOLDEN[str(n)], [(f, c) for f in res[r] for c in res[r][f]
                                          if res[r][f][c] != GOLDEN[str(n)][f][c]]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", [name for name, _ in G.CASES])
def test_the_simulator_gives_the_golden_parameters(case, n):
    options = dict(G.CASES)[case]
    assert G.digest(_simulate(options, n)) == GOLDEN[str(n)]["optimizer"][case]


def test_one_worker_is_left_alone_and_bad_shapes_are_refused():
    model = G.Net()
    sim = SimulatedWorkers(model.named_parameters(), TernGradConfig(), 1)
    g = [torch.ones_like(p) for p in model.parameters()]
    assert all(a is b for a, b in zip(sim.average([g]), g))
    with pytest.raises(ValueError, match="need 2 lists"):
        SimulatedWorkers(model.named_parameters(), TernGradConfig(), 2).average([g])
    with pytest.raises(ValueError, match="hierarchical"):
        SimulatedWorkers(model.named_parameters(), TernGradConfig(hierarchical=True), 2)
