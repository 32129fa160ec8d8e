"""The Collectives protocol's implementations: loopback and mirror semantics in-process, and the pipeline over
torch.distributed (gloo, 2 real ranks) giving the loopback's bits for every transport."""
import os
import time

import pytest
import torch

from hvd_terngrad import TernGradConfig
from hvd_terngrad.collectives import Collectives, LoopbackWorld
from hvd_terngrad.errors import CollectiveTimeoutError, PayloadMismatchError
from tests.loopback import exchange
from tests.mpi_harness import free_port, run_ranks

CASES = [  # (name, options): every transport, with and without block scalers and error feedback
    ("allgather", {}),
    ("allgather-noshare-ef-blocks", {"share_scaler": False, "error_feedback": True, "block_size": 64}),
    ("summed", {"transport": "summed"}),
    ("summed-int8", {"transport": "summed-int8"}),
    ("sharded", {"transport": "sharded", "block_size": 64}),
    ("sharded-ternary", {"transport": "sharded-ternary", "owner_error_feedback": True, "error_feedback": True}),
]
STEPS = 3


def _grads(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [("a.weight", torch.randn(33, 7, generator=g)), ("b.weight", torch.randn(1001, generator=g)),
            ("c.bias", torch.randn(5, generator=g))]


def _steps(pipes_or_pipe, rank_of=None) -> list[list[torch.Tensor]]:
    """STEPS steps of one group per rank; the averages of every step (rank `rank_of`'s, or rank 0's)."""
    from hvd_terngrad.pipeline import exchange as loopback_exchange

    out = []
    for step in range(STEPS):
        if isinstance(pipes_or_pipe, list):
            _, avgs = loopback_exchange(pipes_or_pipe, "g", [_grads(r, step) for r in range(len(pipes_or_pipe))])
            out.append(avgs[0])
        else:
            p = pipes_or_pipe
            out.append(p.finish(p.start("g", _grads(rank_of, step))))
        for p in (pipes_or_pipe if isinstance(pipes_or_pipe, list) else [pipes_or_pipe]):
            p.next_step()
    return out


def _init_gloo(port: int):
    import torch.distributed as dist

    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    return rank


def body_torch_pipeline(cases, port):
    import torch.distributed as dist

    from hvd_terngrad.collectives.distributed import TorchCollectives
    from hvd_terngrad.pipeline import Pipeline

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = {}
    for name, options in cases:
        pipe = Pipeline(TernGradConfig(min_numel=1, seed=4, **options), TorchCollectives(timeout_s=60))
        out[name] = _steps(pipe, rank)
    dist.destroy_process_group()
    return out


@pytest.mark.mpi
def test_the_pipeline_over_torch_distributed_gives_the_loopbacks_bits():
    real = run_ranks("tests.test_collectives:body_torch_pipeline", np=2, timeout=180, args=(CASES, free_port()))
    for name, options in CASES:
        world = LoopbackWorld(2)
        from hvd_terngrad.pipeline import Pipeline

        want = _steps([Pipeline(TernGradConfig(min_numel=1, seed=4, **options), c) for c in world.ranks()])
        for r in range(2):
            for a, b in zip(real[r][name], want):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, r)


def body_torch_peer_late(port):
    import torch.distributed as dist

    from hvd_terngrad.collectives.distributed import TorchCollectives

    rank = _init_gloo(port)
    comm = TorchCollectives(timeout_s=1.0)
    if rank == 1:
        time.sleep(4)  # joins after rank 0's bound: rank 0 must have given up by then
    t0 = time.monotonic()
    try:
        comm.wait(comm.allgather_async(torch.ones(8, dtype=torch.uint8), "x"), "the code allgather of 'w'")
        res = "completed"
    except CollectiveTimeoutError as exc:
        res = str(exc)
    waited = time.monotonic() - t0
    dist.barrier()
    dist.destroy_process_group()
    return res, waited


@pytest.mark.mpi
def test_a_torch_collective_whose_peer_is_late_times_out_with_a_clear_error():
    (msg, waited), _ = run_ranks("tests.test_collectives:body_torch_peer_late", np=2, timeout=60, args=(free_port(),))
    assert "rank 0 waited 1 s for the code allgather of 'w' over the default process group" in msg, msg
    assert waited < 3


def test_loopback_results_are_the_collectives():
    comms = LoopbackWorld(3).ranks()
    assert all(isinstance(c, Collectives) for c in comms)
    xs = [torch.tensor([float(r), -float(r), 2.0]) for r in range(3)]
    hs = [c.max_allreduce_async(x, "m") for c, x in zip(comms, xs)]
    assert all(torch.equal(c.wait(h, "max"), torch.tensor([2.0, 0.0, 2.0])) for c, h in zip(comms, hs))
    pays = [torch.full((4,), r, dtype=torch.uint8) for r in range(3)]
    hs = [c.allgather_async(p, "g") for c, p in zip(comms, pays)]
    assert torch.equal(comms[1].wait(hs[1], "g"), torch.cat(pays))
    streams = [torch.arange(6, dtype=torch.uint8) + 10 * r for r in range(3)]
    hs = [c.alltoall_async(s, "a") for c, s in zip(comms, streams)]
    assert comms[2].wait(hs[2], "a").tolist() == [4, 5, 14, 15, 24, 25]  # slice 2 of every rank, in rank order
    vals = [torch.tensor([1.0, -1.0, 0.0], dtype=torch.float16) for _ in range(3)]
    hs = [c.sum_async_(v, "s") for c, v in zip(comms, vals)]
    comms[0].wait(hs[0], "s")
    assert vals[0].tolist() == [3.0, -3.0, 0.0] and vals[1].tolist() == [1.0, -1.0, 0.0]  # each rank's, in place


@pytest.mark.parametrize("name,options", [c for c in CASES if not c[0].startswith("sharded")])
def test_a_mirrored_rank_codes_and_decodes_as_in_a_world_of_its_copies(name, options):
    """MirrorCollectives (auto's rehearsal of the coding): every peer sends what this rank sends. Rank 2's average
    of 4 mirrored is bit for bit that of 4 loopback ranks that each code as rank 2, and it costs as much coding."""
    from hvd_terngrad.collectives import MirrorCollectives
    from hvd_terngrad.pipeline import Pipeline

    cfg = TernGradConfig(min_numel=1, seed=4, **options)
    copies = [Pipeline(cfg, c, rank=2) for c in LoopbackWorld(4).ranks()]
    mirrored = Pipeline(cfg, MirrorCollectives(2, 4))
    assert isinstance(mirrored.comm, Collectives)
    for step in range(STEPS):
        groups = [p.start("g", _grads(2, step)) for p in copies]
        while any([p.progress(g) for p, g in zip(copies, groups)]):
            pass
        world = [p.finish(g) for p, g in zip(copies, groups)][0]
        mine = mirrored.finish(mirrored.start("g", _grads(2, step)))
        assert all(torch.equal(a, b) for a, b in zip(mine, world)), step
        for p in copies + [mirrored]:
            p.next_step()
    assert mirrored.stats.last.bytes_sent == copies[0].stats.last.bytes_sent > 0
    assert mirrored.stats.last.time_encode > 0 and mirrored.stats.last.time_decode > 0


def test_a_rehearsal_codes_a_sharded_group_with_the_allgather():
    """An owner's reply is for its own shard, and a mirror answers for the other owners with this rank's: a
    rehearsal of a group the model sends sharded codes it with the allgather, whose average is a world's."""
    from hvd_terngrad.collectives import MirrorCollectives
    from hvd_terngrad.pipeline import Pipeline

    cfg = TernGradConfig(min_numel=1, transport="sharded", block_size=64)
    r = Pipeline(cfg, MirrorCollectives(2, 4), rehearsal=True)
    g = r.start("g", _grads(2, 0))
    mine = r.finish(g)
    world = Pipeline(TernGradConfig(min_numel=1, block_size=64), MirrorCollectives(2, 4))
    assert g.transport.name == "allgather" and r.auto is None
    assert all(torch.equal(a, b) for a, b in zip(mine, world.finish(world.start("g", _grads(2, 0)))))


def test_a_loopback_rank_that_never_joins_is_named_at_once():
    comms = LoopbackWorld(3).ranks()
    h = comms[0].allgather_async(torch.ones(2, dtype=torch.uint8), "g")
    comms[2].allgather_async(torch.ones(2, dtype=torch.uint8), "g")
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 waited for the codes over a loopback of 3 ranks, "
                                                     r"and rank\(s\) \[1\] never joined"):
        comms[0].wait(h, "the codes")
    assert time.monotonic() - t0 < 1
    with pytest.raises(PayloadMismatchError, match="started a max where another rank started a allgather"):
        comms[1].max_allreduce_async(torch.ones(2), "g")


def test_a_pipeline_rank_that_never_joins_times_out_naming_the_group():
    """Rank 1 of 2 never starts its group: rank 0's finish raises, naming the scaler allreduce and the tensor."""
    from hvd_terngrad.pipeline import Pipeline

    pipes = [Pipeline(TernGradConfig(min_numel=1), c) for c in LoopbackWorld(2).ranks()]
    g = pipes[0].start("g", _grads(0, 0))
    with pytest.raises(CollectiveTimeoutError, match=r"the scaler Max allreduce of 'a.weight' and 2 more.*\[1\]"):
        pipes[0].finish(g)


@pytest.mark.parametrize("name,options", CASES)
def test_every_rank_decodes_the_same_average(name, options):
    run = exchange(4, [_grads(r, 0) for r in range(4)], min_numel=1, seed=4, **options)
    for avgs in run.averages[1:]:
        assert all(torch.equal(a, b) for a, b in zip(avgs, run.averages[0]))


def test_the_summed_transport_sends_two_bytes_a_coded_element():
    """The stats count what each transport puts on the wire: fp16 code sums against 2-bit records."""
    def sent(transport):
        run = exchange(2, [_grads(r, 0) for r in range(2)], min_numel=1, transport=transport)
        run.pipes[0].next_step()
        return run.pipes[0].stats.last

    gather, summed = sent("allgather"), sent("summed")
    coded = 33 * 7 + 1001 + 5
    assert summed.bytes_sent == 2 * coded + 3 * 16  # the values, and each tensor's scaler entry
    assert gather.bytes_sent < summed.bytes_sent / 4 and gather.dense_bytes == summed.dense_bytes == 4 * coded
