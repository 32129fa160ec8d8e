"""Edge cases of both front ends on real processes: sparse gradients, process sets, bounded waits."""
import time

import pytest
import torch

from tests.mpi_harness import run_ranks, run_ranks_failing

pytestmark = pytest.mark.mpi

STEPS = 3


class SparseMix(torch.nn.Module):
    """An embedding with sparse gradients beside coded and float dense layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32, sparse=True)  # 2048 elements: coded when made dense
        self.fc = torch.nn.Linear(32, 64)  # 2048: coded
        self.head = torch.nn.Linear(64, 4)  # 256: float

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx).mean(1))))


def _lookups(step, rank):
    """Rows each rank looks up: overlapping between ranks, so the average has rows seen by one and by both."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 40, (8, 5), generator=g)


def body_sparse(front, sparse_as_dense):
    """STEPS steps at lr=0 (the parameters stay put, so every method sees the same gradients): the gradients
    after synchronize() under Compression.none and under TernGrad, and TernGrad's step bookkeeping."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for method in ("none", front):
        model = SparseMix()
        named = list(model.named_parameters())
        base = torch.optim.SGD(model.parameters(), lr=0.0)
        tg = None
        if method == "none":
            opt = hvd.DistributedOptimizer(base, named_parameters=named, sparse_as_dense=sparse_as_dense)
        elif method == "stock":
            tg = hvd_terngrad.TernGrad(named, seed=3)
            opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg,
                                           sparse_as_dense=sparse_as_dense)
        else:
            tg = hvd_terngrad.TernGrad(seed=3)
            opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg,
                                                    sparse_as_dense=sparse_as_dense)
        steps = []
        for step in range(STEPS):
            opt.zero_grad()
            model(_lookups(step, hvd.rank())).sum().backward()
            opt.synchronize()
            grads = {n: p.grad.detach().clone() for n, p in named}
            book = None
            if tg is not None:
                book = {"pipeline_step": tg.pipeline.step, "scaler": dict(tg.pipeline.coder.scalers_used),
                        "calls": getattr(tg, "_calls", 0), "done": getattr(tg, "_done", 0)}
            steps.append({"grads": grads, "book": book})
            with opt.skip_synchronize():
                opt.step()
        out[method] = steps
    return out


@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_sparse_gradients_pass_through_as_horovod_averages_them(front):
    for rank_out in run_ranks("tests.test_edge_cases:body_sparse", np=2, timeout=120, args=(front, False)):
        for step, (plain, tern) in enumerate(zip(rank_out["none"], rank_out[front])):
            g_plain, g_tern = plain["grads"]["emb.weight"], tern["grads"]["emb.weight"]
            assert g_tern.is_sparse
            assert torch.allclose(g_tern.to_dense(), g_plain.to_dense(), rtol=0, atol=1e-7), step
            # the dense tensors were coded: fc's average is a multiple of scaler / N everywhere
            s = tern["book"]["scaler"]["fc.weight"]
            units = tern["grads"]["fc.weight"] * 2 / s
            assert torch.equal(units, units.round()) and not torch.equal(tern["grads"]["fc.weight"],
                                                                          plain["grads"]["fc.weight"])
            # one pipeline step per optimizer step, and nothing left over to shift a later tensor's Philox step
            assert tern["book"]["pipeline_step"] == step + 1
            assert (tern["book"]["calls"], tern["book"]["done"]) == (0, 0)


@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_sparse_as_dense_codes_the_embedding_and_hands_it_back_sparse(front):
    ranks = run_ranks("tests.test_edge_cases:body_sparse", np=2, timeout=120, args=(front, True))
    for rank_out in ranks:
        for step, tern in enumerate(rank_out[front]):
            g = tern["grads"]["emb.weight"]
            assert g.is_sparse
            s = tern["book"]["scaler"]["emb.weight"]
            units = g.to_dense() * 2 / s
            assert torch.equal(units, units.round())  # coded: multiples of scaler / N
            seen = set(_lookups(step, 0).reshape(-1).tolist()) | set(_lookups(step, 1).reshape(-1).tolist())
            unseen = [r for r in range(64) if r not in seen]
            assert torch.count_nonzero(g.to_dense()[unseen]) == 0  # rows nobody looked up stay exactly zero
            assert tern["book"]["pipeline_step"] == step + 1
    assert all(torch.equal(a["grads"][n].to_dense(), b["grads"][n].to_dense())
               for a, b in zip(ranks[0][front], ranks[1][front]) for n in a["grads"])  # every rank: one average


def test_stock_and_hvd_terngrad_agree_bit_for_bit_on_a_sparse_model():
    stock = run_ranks("tests.test_edge_cases:body_sparse", np=2, timeout=120, args=("stock", False))
    ours = run_ranks("tests.test_edge_cases:body_sparse", np=2, timeout=120, args=("hvd_terngrad", False))
    for a, b in zip(stock[0]["stock"], ours[0]["hvd_terngrad"]):
        for n in a["grads"]:
            assert torch.equal(a["grads"][n].to_dense(), b["grads"][n].to_dense()), n


# ---------------------------------------------------------------------------------------------
def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def body_process_set_mismatch():
    """The stock optimizer on a process set, TernGrad left on the global one: rank 1 is outside the optimizer's
    set and moves on to a collective of its own, as a training script's end-of-epoch metric would."""
    import horovod.torch as hvd

    import hvd_terngrad

    even = hvd.ProcessSet([0])
    hvd.init(process_sets=[even])
    model = _small_model()
    named = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=named,
                                   process_set=even, compression=hvd_terngrad.TernGrad(named, timeout_s=5))
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    hvd.allreduce(torch.ones(1), name="metric")
    return "finished"


def test_a_process_set_that_differs_from_the_optimizers_fails_in_bounded_time_naming_the_cause():
    msg = run_ranks_failing("tests.test_edge_cases:body_process_set_mismatch", np=2, within=45)
    assert "CollectiveTimeoutError" in msg
    assert "rank 0 waited 5 s for the scaler Max allreduce of '2.weight' over the global process set" in msg, msg
    assert "Do all ranks and the optimizer use the same process set and the same TernGrad options?" in msg


def _train_with_a_sleepy_rank(front, steps, sleep_at, seconds, **tg_options):
    """Rank 1 sleeps `seconds` before its backward at step `sleep_at`: TernGrad's stats of that step."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    model = _small_model()
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    if front == "stock":
        tg = hvd_terngrad.TernGrad(named, **tg_options)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg)
    else:
        tg = hvd_terngrad.TernGrad(**tg_options)
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg)
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 64)).sum()
        if step == sleep_at and hvd.rank() == 1:
            time.sleep(seconds)
        loss.backward()
        opt.step()
        if step == sleep_at:
            stats = tg.stats.last
    return stats


def body_stuck_rank(front):
    """Rank 1 stops calling collectives mid-step (asleep before its backward, not dead)."""
    _train_with_a_sleepy_rank(front, 10, 3, 120, timeout_s=5)
    return "finished"


@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_a_stuck_rank_makes_the_others_fail_in_bounded_time(front):
    msg = run_ranks_failing("tests.test_edge_cases:body_stuck_rank", np=2, within=45, args=(front,))
    if front == "stock":  # the wait is Horovod's own, in its synchronize(): the watchdog names it and ends the rank
        assert "rank 0 waited 5 s for the scaler Max allreduce of '2.weight'" in msg, msg[-3000:]
        assert "ending this rank" in msg, msg[-3000:]
    else:
        what = "the scaler Max allreduce of bucket 0 ('2.weight' and 1 more)"
        assert "rank 0 of 2 failed" in msg and f"rank 0 waited 5 s for {what}" in msg, msg[-3000:]


def body_stuck_rank_uncoded():
    """As body_stuck_rank, with every tensor left in float (the optimizer's own float averages)."""
    _train_with_a_sleepy_rank("hvd_terngrad", 10, 3, 120, timeout_s=5, min_numel=2**62)
    return "finished"


def test_a_stuck_rank_fails_the_optimizers_float_averages_in_bounded_time():
    """The float averages of a step share one wait: on a timeout it names one still missing (here the one
    average of the tensors never coded, named by the first)."""
    msg = run_ranks_failing("tests.test_edge_cases:body_stuck_rank_uncoded", np=2, within=45)
    what = "the float average of the tensors never coded ('0.weight' and 3 more)"
    assert "rank 0 of 2 failed" in msg and f"rank 0 waited 5 s for {what}" in msg, msg[-3000:]


def body_late_rank(front):
    """Rank 1 reaches backward 0.6 s late at step 2; rank 0's wait in that step, wall and CPU seconds."""
    stats = _train_with_a_sleepy_rank(front, 4, 2, 0.6)
    return stats.time_comm, stats.cpu_comm


@pytest.mark.parametrize("front", ["hvd_terngrad"])
def test_a_long_wait_sleeps_instead_of_spinning(front):
    """A wait past its first 20 ms leaves the core to other work (ranks sharing it, data loaders). (With
    the stock optimizer the long wait is Horovod's own, in its synchronize(): compress() never waits.)"""
    res = run_ranks("tests.test_edge_cases:body_late_rank", np=2, timeout=120, args=(front,))
    wall, cpu = res[0]
    assert wall > 0.5 and cpu < 0.1 * wall, (wall, cpu)


# ---------------------------------------------------------------------------------------------
def body_bound_elsewhere():
    """Process sets that can be told apart before any collective: both are ValueErrors, on every rank."""
    import horovod.torch as hvd

    import hvd_terngrad

    first, second = hvd.ProcessSet([0]), hvd.ProcessSet([1])
    hvd.init(process_sets=[first, second])
    model = _small_model()
    named = list(model.named_parameters())
    errors = []
    try:
        hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                          compression=hvd_terngrad.TernGrad(process_set=first))
    except ValueError as exc:
        errors.append(str(exc))
    mine = first if hvd.rank() == 0 else second
    try:  # the compressor on the other rank's set: this rank is not in it
        other = second if mine is first else first
        hvd_terngrad.TernGrad(process_set=other).connect()
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_a_compressor_bound_to_another_process_set_is_a_value_error():
    for rank, errors in enumerate(run_ranks("tests.test_edge_cases:body_bound_elsewhere", np=2, timeout=60)):
        assert len(errors) == 2, errors
        assert "the TernGrad compressor works on process set 1 (ranks [0]) but the optimizer on the global " \
               "process set: pass the same process_set= to both" in errors[0]
        assert f"rank {rank} is not in process set {2 - rank} (ranks [{1 - rank}])" in errors[1], errors[1]
