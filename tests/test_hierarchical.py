"""hierarchical=True: float averages inside nodes, TernGrad between them, a broadcast back.

The node layout comes from Horovod (local_rank, cross_rank), so a real 2-node x 2-rank job needs two machines:
here two emulated nodes (benchmarks/cluster.py), each a network namespace hosting 2 ranks that share memory.
"""
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.cluster import PROFILES, ClusterUnavailable, EmulatedCluster, check_support
from hvd_terngrad import TernGradConfig
from hvd_terngrad.hierarchy import topology
from tests.loopback import exchange

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


# ---------------------------------------------------------------------------------------------- topology
def test_topology_groups_ranks_by_node_and_turns_buckets_over_local_ranks():
    table = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    t = topology(table, 3)
    assert (t.node, t.nodes, t.local_index, t.local_size) == (1, 3, 1, 2)
    assert t.grid == ((0, 1), (2, 3), (4, 5)) and t.node_ranks == (2, 3)
    assert [t.coder(k) for k in range(4)] == [0, 1, 0, 1]


def test_topology_follows_horovods_numbering_when_ranks_are_not_contiguous():
    table = [(0, 0), (1, 0), (0, 1), (1, 1)]  # round-robin placement: ranks 0, 2 on node 0
    t = topology(table, 2)
    assert t.grid == ((0, 2), (1, 3)) and (t.node, t.local_index) == (0, 1)


def test_topology_refuses_nodes_of_different_sizes():
    with pytest.raises(ValueError, match=r"same number of ranks on every node.*\{0: 2, 1: 1\}"):
        topology([(0, 0), (0, 1), (1, 0)], 0)


def test_hierarchical_is_validated():
    with pytest.raises(ValueError, match="hierarchical must be True or False"):
        TernGradConfig(hierarchical=1)
    with pytest.raises(ValueError, match="summed-int8"):
        TernGradConfig(hierarchical=True, transport="summed-int8")


# ---------------------------------------------------------------------------------------------- 2 x 2 job
def _grads(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"a.weight": torch.randn(48, 64, generator=g), "a.bias": torch.randn(48, generator=g),
            "b.weight": torch.randn(32, 48, generator=g) * 3}


def body_two_by_two(transports: list[str]) -> dict:
    """Every transport for STEPS steps at lr=0 with given gradients, then a NaN on one rank of node 1."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    out = {"local_rank": hvd.local_rank(), "cross_rank": hvd.cross_rank()}
    model = torch.nn.Sequential()
    model.add_module("a", torch.nn.Linear(64, 48))
    model.add_module("b", torch.nn.Linear(48, 32, bias=False))

    def step(opt, k: int, nan: bool = False) -> dict:
        opt.zero_grad()
        for name, p in model.named_parameters():
            p.grad = _grads(hvd.rank(), k)[name].clone()
            if nan and name == "a.weight":
                p.grad[0, 0] = float("nan")
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    for transport in transports:
        tg = hvd_terngrad.TernGrad(transport=transport, hierarchical=True, seed=7, timeout_s=60)
        # two buckets, so each local rank codes one
        opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                                named_parameters=model.named_parameters(), compression=tg,
                                                bucket_bytes=4 * 32 * 48)
        topo = tg.hierarchy.topology
        out[transport] = {"steps": [step(opt, k) for k in range(STEPS)], "grid": topo.grid,
                          "pipeline": (tg.pipeline.rank, tg.pipeline.size)}
        try:
            step(opt, STEPS, nan=hvd.rank() == 3)
            out[transport]["nan"] = "no error"
        except hvd_terngrad.NonFiniteGradientError as exc:
            out[transport]["nan"] = str(exc)
    # a node that is done must not shut Horovod down while the other still broadcasts inside itself
    hvd.barrier()
    return out


def _run_on_cluster(target: str, args: tuple, nodes: int, per_node: int, timeout: float = 240) -> list:
    try:
        check_support()
    except ClusterUnavailable as exc:
        pytest.skip(f"no emulated cluster: {exc}")
    work = Path(tempfile.mkdtemp(prefix="hvdtg-hier-"))
    try:
        (work / "spec.pkl").write_bytes(pickle.dumps({"target": target, "args": args}))
        with EmulatedCluster(nodes, PROFILES["fast"], ranks_per_node=per_node) as c:
            res = c.run([sys.executable, "-m", "tests._rank_main", str(work)], timeout=timeout,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
        n = nodes * per_node
        errors = [(work / f"rank{r}.error").read_text() for r in range(n) if (work / f"rank{r}.error").exists()]
        assert not errors and res.returncode == 0, "\n".join(errors) or res.stdout[-3000:]
        return [pickle.loads((work / f"rank{r}.result").read_bytes()) for r in range(n)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _flat_reference(transport: str, node_avgs: list[dict], step: int) -> dict:
    """TernGrad between `len(node_avgs)` ranks that hold the node averages, per tensor with in-process ranks
    (codes depend on seed, step, rank, name and the shared scaler, not on buckets)."""
    cfg = TernGradConfig(transport=transport, seed=7)
    nodes = len(node_avgs)
    out = {}
    for name in node_avgs[0]:
        if not cfg.compresses(name, node_avgs[0][name].numel()):
            out[name] = sum(a[name] for a in node_avgs) / nodes
            continue
        run = exchange(nodes, [[(name, avg[name])] for avg in node_avgs], config=cfg, step=step)
        out[name] = run.averages[0][0].view(node_avgs[0][name].shape)
    return out


@pytest.mark.mpi
def test_two_nodes_of_two_ranks_code_the_node_averages_between_nodes():
    transports = ["allgather", "sharded", "sharded-ternary"]
    res = _run_on_cluster("tests.test_hierarchical:body_two_by_two", (transports,), nodes=2, per_node=2)
    assert [(r["cross_rank"], r["local_rank"]) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for t in transports:
        assert res[0][t]["grid"] == ((0, 1), (2, 3))
        assert [r[t]["pipeline"] for r in res] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # coded between 2 nodes
        for k in range(STEPS):
            got = [r[t]["steps"][k] for r in res]
            for name in got[0]:  # every rank ends with the same bits
                assert all(torch.equal(g[name], got[0][name]) for g in got), (t, k, name)
            node_avgs = [{n: (_grads(2 * i, k)[n] + _grads(2 * i + 1, k)[n]) / 2 for n in got[0]} for i in range(2)]
            assert torch.equal(got[0]["a.bias"], (node_avgs[0]["a.bias"] + node_avgs[1]["a.bias"]) / 2)
            if t != "sharded-ternary":  # exactly TernGrad between two ranks holding the node averages
                ref = _flat_reference(t, node_avgs, k)
                for name in ("a.weight", "b.weight"):
                    assert torch.equal(got[0][name], ref[name]), (t, k, name)
            else:  # the owners' second draw: codes times each shard owner's scaler, near the true mean
                for name in ("a.weight", "b.weight"):
                    true = (node_avgs[0][name] + node_avgs[1][name]) / 2
                    assert len(torch.unique(got[0][name].abs())) <= 3  # 0 and up to 2 owner scalers
                    assert float((got[0][name] - true).norm() / true.norm()) < 3.0
        for r in res:  # a NaN on rank 3 (node 1, local rank 1) reaches every rank as an error
            assert "non-finite" in r[t]["nan"] and "'a.weight'" in r[t]["nan"], r[t]["nan"]


def body_one_node() -> dict:
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    model = torch.nn.Linear(64, 48)
    tg = hvd_terngrad.TernGrad(hierarchical=True, timeout_s=60)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                            named_parameters=model.named_parameters(), compression=tg)
    for name, p in model.named_parameters():
        p.grad = _grads(hvd.rank(), 0)["a." + name].clone()
    opt.synchronize()
    out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "pipeline_size": tg.pipeline.size}
    for name, p in model.named_parameters():  # a NaN on rank 1 only: an error on both
        p.grad = _grads(hvd.rank(), 1)["a." + name].clone()
        if hvd.rank() == 1 and name == "weight":
            p.grad[3, 5] = float("nan")
    try:
        opt.synchronize()
        out["nan"] = "no error"
    except hvd_terngrad.NonFiniteGradientError as exc:
        out["nan"] = str(exc)
    # a model of its own: the first model's hooks would start collectives beside the refused one
    other = torch.nn.Linear(64, 48)
    stock = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.0),
                                     named_parameters=other.named_parameters(),
                                     compression=hvd_terngrad.TernGrad(hierarchical=True))
    try:  # the first gradient reaches compress() in backward
        other(torch.ones(1, 64)).sum().backward()
        stock.synchronize()
        out["stock"] = "no error"
    except ValueError as exc:
        out["stock"] = str(exc)
    return out


@pytest.mark.mpi
def test_one_node_averages_in_float_and_the_stock_optimizer_is_refused():
    from tests.mpi_harness import run_ranks

    res = run_ranks("tests.test_hierarchical:body_one_node", np=2, timeout=120)
    for r in res:  # all ranks on one node: the node's float average is the whole exchange
        assert r["pipeline_size"] == 1
        for name in ("weight", "bias"):
            assert torch.equal(r["grads"][name], (_grads(0, 0)["a." + name] + _grads(1, 0)["a." + name]) / 2)
        assert "hierarchical=True needs hvd_terngrad.DistributedOptimizer" in r["stock"]
        assert "non-finite" in r["nan"] and "'weight'" in r["nan"], r["nan"]


def body_ddp_two_by_two(transports: list[str]) -> dict:
    """DDP with terngrad_hook and hierarchical=True, beside hvd_terngrad's hierarchical optimizer on the same
    model and losses in the same processes; then a NaN on rank 3 under DDP."""
    import gc
    import os

    import horovod.torch as hvd
    import torch.distributed as dist

    import hvd_terngrad
    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    from tests.golden import frontends as G

    hvd.init()
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29681", rank=hvd.rank(),
                            world_size=hvd.size())
    torch.set_num_threads(1)
    out = {}
    for transport in transports:
        opts = {"transport": transport, "hierarchical": True, "seed": 7, "min_numel": 1, "timeout_s": 60}
        model, ref = G.Net(), G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = TernGradState(model.named_parameters(), **opts)
        ddp.register_comm_hook(state, terngrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        ref_opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                                    named_parameters=ref.named_parameters(),
                                                    compression=hvd_terngrad.TernGrad(**opts))
        for step in range(STEPS):
            for net, o in ((ddp, opt), (ref, ref_opt)):
                o.zero_grad()
                G.loss(net, hvd.rank(), step).backward()
                o.step()
        topo = state.hierarchy.topology
        out[transport] = {"ddp": G.digest(model.parameters()), "ref": G.digest(ref.parameters()),
                          "grid": topo.grid, "pipeline": (state.pipeline.rank, state.pipeline.size)}
        opt.zero_grad()
        try:
            loss = G.loss(ddp, hvd.rank(), STEPS)
            (loss * (float("nan") if hvd.rank() == 3 else 1.0)).backward()
            out[transport]["nan"] = "no error"
        except RuntimeError as exc:
            out[transport]["nan"] = str(exc).splitlines()[0]
        del ddp, state
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    hvd.barrier()
    return out


@pytest.mark.mpi
def test_ddp_hook_with_hierarchical_gives_the_horovod_optimizers_bits_on_two_nodes_of_two():
    """The hook finds the nodes itself (host names here), averages in float inside each node and codes
    between nodes as hvd_terngrad's hierarchical optimizer does: the same parameters bit for bit."""
    transports = ["allgather", "summed", "sharded"]
    res = _run_on_cluster("tests.test_hierarchical:body_ddp_two_by_two", (transports,), nodes=2, per_node=2)
    for t in transports:
        assert [r[t]["pipeline"] for r in res] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # coded between 2 nodes
        assert res[0][t]["grid"] == ((0, 1), (2, 3))
        assert all(r[t]["ddp"] == res[0][t]["ddp"] for r in res), t  # every rank the same
        assert res[0][t]["ddp"] == res[0][t]["ref"], t
        for r in res:  # a NaN on rank 3 reaches every rank as an error naming the tensor
            assert "NonFiniteGradientError" in r[t]["nan"] and "non-finite" in r[t]["nan"], r[t]["nan"]
