"""The fidelity suite's CI slice: every task and method runs a few simulated steps and is reported."""
import json
import math

from benchmarks import fidelity_suite


def test_smoke_slice_runs_every_task_and_method(tmp_path):
    assert fidelity_suite.main(["--smoke", "--jobs", "2", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "fidelity_suite.json").read_text())
    assert {(r["task"], r["method"]) for r in runs} == {(t, m) for t in fidelity_suite.TASKS
                                                         for m in fidelity_suite.METHODS}
    assert all(math.isfinite(r["final"]) and r["steps"] == 6 and r["workers"] == 2 for r in runs)
    table = (tmp_path / "fidelity_suite.md").read_text()
    assert all(f"| {t} | 2 | terngrad |" in table for t in fidelity_suite.TASKS)
    assert all((tmp_path / f"fidelity_{t}.png").stat().st_size > 0 for t in fidelity_suite.TASKS)
    # every method of a task starts from the same initialization: FP32 and TernGrad differ only by the exchange
    first = {(r["task"], r["method"]): r["curve"] for r in runs}
    assert all(len(c) >= 1 for c in first.values())


def test_a_diverging_run_is_recorded_not_fatal(tmp_path):
    """A TernGrad run whose gradients turn NaN ends as a diverged run (final NaN) and the report still comes out."""
    import dataclasses

    data = fidelity_suite.Data(fidelity_suite.TASKS["digits"])
    data.task = dataclasses.replace(data.task, lr=1e6)  # diverges within a few steps
    r = fidelity_suite.train(data, "terngrad", 2, 0, steps_cap=6)
    assert math.isnan(r["final"]) and "non-finite" in r["diverged"]
    rows = fidelity_suite.summarize([r, fidelity_suite.train(data, "fp32", 2, 0, steps_cap=6)])
    assert {row["method"]: row["diverged"] for row in rows}["terngrad"] == 1
    assert "1 (1 diverged)" in fidelity_suite.table(rows)


def test_set_changes_a_recipe_and_records_it(tmp_path, monkeypatch):
    """--set TASK.FIELD=VALUE changes that task's recipe for the invocation; each run records its recipe."""
    import pytest

    monkeypatch.setattr(fidelity_suite, "TASKS", dict(fidelity_suite.TASKS))  # --set writes to the table
    assert fidelity_suite.main(["--smoke", "--tasks", "digits", "--methods", "fp32,terngrad", "--set",
                                "digits.clip_norm=0.5", "--set", "digits.lr=0.02", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "fidelity_suite.json").read_text())
    assert [(r["recipe"]["clip_norm"], r["recipe"]["lr"], r["recipe"]["epochs"]) for r in runs] == [(0.5, 0.02, 8)] * 2
    for bad in ("digits.nope=1", "mnist.lr=1", "digits.lr"):
        with pytest.raises(SystemExit):
            fidelity_suite.main(["--smoke", "--set", bad, "--out", str(tmp_path)])


def body_powersgd_reference(port):
    """DDP with torch's powerSGD_hook on one bucket, 2 gloo ranks: per step every rank's own gradient, the
    averaged gradient DDP hands the optimizer, and the bucket's parameter order."""
    import copy
    import gc
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from tests.golden import frontends as G

    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    model = G.Net()
    local = copy.deepcopy(model)
    index = {p: i for i, p in enumerate(model.parameters())}
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)  # one bucket
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        min_compression_rate=0.5, random_seed=3)
    orders = []

    def hook(st, bucket):
        orders.append([index[p] for p in bucket.parameters()])
        return powerSGD_hook.powerSGD_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = []
    for step in range(6):
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        G.loss(local, rank, step).backward()
        mine = [p.grad.clone() for p in local.parameters()]
        opt.zero_grad()
        G.loss(ddp, rank, step).backward()
        every = [None] * size
        dist.all_gather_object(every, mine)
        steps.append((every, [p.grad.clone() for p in model.parameters()], orders[-1]))
        opt.step()
    del ddp, state
    gc.collect()
    dist.destroy_process_group()
    return steps, len(orders)


def test_simulated_powersgd_is_torchs_hook_bit_for_bit():
    """benchmarks.simulator.SimulatedPowerSGD against torch's powerSGD_hook on 2 real gloo ranks: from each
    step's per-rank gradients it computes the very average DDP handed the optimizer, warm-up and compressed
    steps alike (rank 2, error feedback, warm start)."""
    import torch

    from benchmarks.simulator import SimulatedPowerSGD
    from tests.golden import frontends as G
    from tests.mpi_harness import free_port, run_ranks

    (steps, hooks), _ = run_ranks("tests.test_fidelity_suite:body_powersgd_reference", np=2, timeout=120,
                                  args=(free_port(),))
    assert hooks == 6  # one bucket a step
    order = steps[-1][2]
    sim = SimulatedPowerSGD(G.Net().named_parameters(), 2, rank=2, start_iter=2, min_compression_rate=0.5, seed=3,
                            order=order)
    assert sim.compressed  # some tensors are approximated, not all averaged
    for k, (every, avg, bucket_order) in enumerate(steps):
        assert k < 2 or bucket_order == order
        out = sim.average(every)
        assert all(torch.equal(a, b) for a, b in zip(out, avg)), k


def test_the_communication_bound_tasks_are_wide_where_the_exchange_costs():
    """vgg: at least 10 M parameters, nearly all in its fully-connected layers; wordlm: an 8,192-word vocabulary
    of real text, its output layer the input embedding (tied), at least 5 M parameters, all but its final norm
    coded; both train with their recipe's optimizer (wordlm's Adam) through the simulated exchange."""
    import torch

    vgg = fidelity_suite.Data(fidelity_suite.TASKS["vgg"])
    model = vgg.model()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(sizes.values())
    assert total >= 10e6 and sum(v for n, v in sizes.items() if n.startswith("fc.")) >= 0.95 * total
    lm = fidelity_suite.Data(fidelity_suite.TASKS["wordlm"])
    model = lm.model()
    assert len(lm.words) == fidelity_suite.WORDS == 8192 and lm.words[-1] == "<unk>"
    assert lm.train.shape == (2000, fidelity_suite.WORD_CONTEXT + 1) and len(lm.test) == 125
    assert float((lm.train == len(lm.words) - 1).float().mean()) < 0.05  # most tokens are in the vocabulary
    names = [n for n, _ in model.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) >= 5e6 and not any("head" in n for n in names)
    assert isinstance(fidelity_suite.base_optimizer(lm.task, model.parameters()), torch.optim.Adam)
    for data in (vgg, lm):
        for method in ("fp32", "terngrad:noclip:ef:block64"):
            r = fidelity_suite.train(data, method, 2, 0, steps_cap=3)
            assert r["steps"] == 3 and math.isfinite(r["final"]), (data.task.name, method)
