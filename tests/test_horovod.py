"""TernGrad through Horovod on real processes (2 and 4 ranks): both front ends, exactness, options."""
import re

import pytest
import torch

from tests.mpi_harness import RankFailure, run_ranks, start_transports_late

pytestmark = pytest.mark.mpi


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.ReLU(), torch.nn.Linear(96, 24),
                               torch.nn.ReLU(), torch.nn.Linear(24, 5))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)


def body_exact(front, steps, options):
    """K steps; at each, check the averaged gradients against an independent decode of every rank's codes."""
    import horovod.torch as hvd

    import hvd_terngrad
    from hvd_terngrad import codec, wire
    from hvd_terngrad.codec import reference
    from hvd_terngrad.config import TernGradConfig, tensor_id

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    model = _model()
    twin = _model()  # no hooks: the local gradient of this rank
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = TernGradConfig(seed=11, min_numel=100, **options)
    if front == "stock":
        tg = hvd_terngrad.TernGrad(named, config=cfg)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg)
    else:
        tg = hvd_terngrad.TernGrad(config=cfg)
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg, bucket_bytes=4096)
    checks = {"exact": 0, "scaler_is_max": 0, "float_is_average": 0}
    for step in range(steps):
        x, y = _batch(step, rank)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        local = {n: p.grad.detach().clone() for n, p in twin.named_parameters()}
        residual = {n: r.clone() for n, r in tg.pipeline.coder.feedback.worker.items()}  # error feedback: coded = g + r
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        for n, p in named:
            g = local[n].reshape(-1)
            if n in residual:
                g = g + residual[n]
            if not cfg.compresses(n, g.numel()):
                avg = hvd.allreduce(local[n], op=hvd.Average, name=f"check.float.{n}")
                assert torch.equal(p.grad, avg), n
                checks["float_is_average"] += 1
                continue
            key_step = tg.pipeline.step - 1  # the pipeline has moved on to the next step
            if cfg.block_size:  # one scaler a block, each element on its block's scaler
                k = cfg.block_size
                s_local = cfg.block_scalers(codec.moments(g), reference.block_absmax(g, k))
                s_all = hvd.allgather(s_local[None], name=f"check.s.{n}")
                # shared: the Max over ranks, rounded up to the 16 bits it travels at (wire format section 12)
                s_used = wire.round_block_scalers(s_all.max(dim=0).values) if cfg.share_scaler else s_local
                checks["scaler_is_max"] += cfg.share_scaler and tg.pipeline.coder.scalers_used[n] == float(s_used.max())
                codes = reference.ternarize_pack_blocks(g, s_used, k, cfg.seed, key_step, rank, tensor_id(n))
                all_s = hvd.allgather(reference.per_element(s_used, k, g.numel())[None].double(),
                                      name=f"check.su.{n}")
            else:
                s_local = cfg.scaler(codec.moments(g))
                s_all = hvd.allgather(torch.tensor([s_local], dtype=torch.float64), name=f"check.s.{n}")
                s_used = tg.pipeline.coder.scalers_used[n]
                if cfg.share_scaler:
                    assert s_used == float(s_all.max()), (n, s_used, s_all)
                    checks["scaler_is_max"] += 1
                else:
                    assert s_used == s_local
                codes = reference.ternarize_pack(g, s_used, cfg.seed, key_step, rank, tensor_id(n))
                all_s = hvd.allgather(torch.tensor([s_used], dtype=torch.float64), name=f"check.su.{n}")
            all_codes = hvd.allgather(codes[None], name=f"check.codes.{n}")
            total = torch.zeros(g.numel(), dtype=torch.float64)
            for r in range(size):  # each rank's ternary gradient, decoded on its own
                total += reference.values(reference.unpack(all_codes[r], g.numel())).double() * all_s[r]
            expected = (total / size).float()
            assert torch.equal(p.grad.reshape(-1), expected), (n, step)
            checks["exact"] += 1
        with opt.skip_synchronize():
            opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params, "checks": checks, "stats": tg.stats.last.as_dict()}


# Every scenario of body_exact for one world size runs in one launch (module-scoped), each test reading its own.
SCENARIOS = {
    2: [("stock", 3, {}), ("hvd_terngrad", 3, {}), ("stock", 4, {}), ("hvd_terngrad", 4, {}),
        ("hvd_terngrad", 3, {"share_scaler": False}), ("hvd_terngrad", 3, {"clip": 0.0}),
        ("hvd_terngrad", 3, {"error_feedback": True}), ("hvd_terngrad", 3, {"block_size": 128, "share_scaler": False})],
    4: [("stock", 3, {}), ("hvd_terngrad", 3, {}), ("stock", 3, {"block_size": 64}),
        ("hvd_terngrad", 3, {"block_size": 64}), ("hvd_terngrad", 2, {"transport": "summed"})],
}


def body_exact_all(scenarios):
    return [body_exact(*sc) for sc in scenarios]


@pytest.fixture(scope="module")
def exact_runs():
    """{np: {scenario: every rank's result}}, one launch per world size, made on first use."""
    cache = {}

    def get(np, front, steps, options):
        if np not in cache:
            res = run_ranks("tests.test_horovod:body_exact_all", np=np, timeout=240, args=(SCENARIOS[np],))
            cache[np] = {repr(sc): [r[i] for r in res] for i, sc in enumerate(SCENARIOS[np])}
        return cache[np][repr((front, steps, options))]
    return get


@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_average_is_exact_mean_of_independent_decodes(np, front, exact_runs):
    res = exact_runs(np, front, 3, {})
    for r in res:  # parameters bit-identical on all ranks
        assert torch.equal(r["params"], res[0]["params"])
    c = res[0]["checks"]
    assert c["exact"] == 3 * 3 and c["scaler_is_max"] == 3 * 3 and c["float_is_average"] == 3 * 3
    st = res[0]["stats"]
    assert st["tensors_coded"] == 3 and st["tensors_float"] == 3 and st["ratio"] > 3
    assert 0 < st["cpu_encode"] <= st["time_encode"] + 0.01 and 0 < st["cpu_decode"] <= st["time_decode"] + 0.01


def test_stock_and_hvd_terngrad_paths_agree(exact_runs):
    a, b = exact_runs(2, "stock", 4, {}), exact_runs(2, "hvd_terngrad", 4, {})
    assert torch.equal(a[0]["params"], b[0]["params"])


@pytest.mark.parametrize("options", [{"share_scaler": False}, {"clip": 0.0}, {"error_feedback": True}])
def test_options_on_two_ranks(options, exact_runs):
    res = exact_runs(2, "hvd_terngrad", 3, options)
    assert torch.equal(res[0]["params"], res[1]["params"])
    assert res[0]["checks"]["exact"] == 9


@pytest.mark.parametrize("np,front,options", [(4, "stock", {"block_size": 64}), (4, "hvd_terngrad", {"block_size": 64}),
                                              (2, "hvd_terngrad", {"block_size": 128, "share_scaler": False})])
def test_block_scalers_through_horovod(np, front, options, exact_runs):
    """Every coded gradient equals the independent decode of each rank's block-coded gradient (N = 2 or 4, where
    the check's fp64 sum rounds as the fp32 decode does)."""
    res = exact_runs(np, front, 3, options)
    assert all(torch.equal(r["params"], res[0]["params"]) for r in res)


def body_train(front, options, steps=4, bpps=1):
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    model = _model()
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if front == "stock":
        tg = hvd_terngrad.TernGrad(named, seed=3, min_numel=100, **options)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg, backward_passes_per_step=bpps)
    else:
        tg = hvd_terngrad.TernGrad(seed=3, min_numel=100, **options)
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg,
                                                backward_passes_per_step=bpps)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(bpps):
            x, y = _batch(10 * step + micro, hvd.rank())
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "step": tg.pipeline.step,
            "stats": tg.stats.last.as_dict()}


def test_exclusion_by_name_and_backward_passes_per_step():
    opts = {"exclude": ("2.*",)}
    a = run_ranks("tests.test_horovod:body_train", np=2, timeout=120, args=("stock", opts, 3, 2))
    b = run_ranks("tests.test_horovod:body_train", np=2, timeout=120, args=("hvd_terngrad", opts, 3, 2))
    assert torch.equal(a[0]["params"], a[1]["params"])
    assert torch.equal(a[0]["params"], b[0]["params"])
    assert a[0]["step"] == b[0]["step"] == 3  # one coded exchange per optimizer step
    # "2.weight" (96 * 24) is excluded: "0.weight" and "4.weight" (120 >= min_numel) are coded
    assert a[0]["stats"]["tensors_coded"] == 2 and a[0]["stats"]["tensors_float"] == 4


def body_nonfinite(front, on_nonfinite, min_numel=100, slow_sends=False):
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    if slow_sends and hvd.rank() == 1:  # rank 0 learns of the NaN first
        start_transports_late(0.3)
    model = _model()
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"seed": 1, "min_numel": min_numel, "on_nonfinite": on_nonfinite}
    if front == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=hvd_terngrad.TernGrad(named, **kw))
    else:
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named,
                                                compression=hvd_terngrad.TernGrad(**kw))
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    x, y = _batch(0, hvd.rank())
    if hvd.rank() == 1:
        x[0, 0] = float("nan")
    opt.zero_grad()
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    except hvd_terngrad.NonFiniteGradientError as exc:
        return {"error": str(exc)}
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"error": None, "unchanged": torch.equal(before, after)}


@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
@pytest.mark.parametrize("slow_sends", [False, True])
def test_nan_gradient_raises_on_every_rank_naming_tensor_and_rank(front, slow_sends):
    """slow_sends: a rank that raises first still waits for the step's collectives, or its exit would shut
    Horovod down under a peer still starting them."""
    res = run_ranks("tests.test_horovod:body_nonfinite", np=2, timeout=120, args=(front, "raise", 100, slow_sends))
    for r in res:
        assert r["error"] is not None
        assert "on rank 1" in r["error"] and "weight" in r["error"]


def test_a_nan_in_a_float_average_names_the_rank_it_came_from_on_every_rank():
    """Nothing coded (every tensor below min_numel): the float averages are made out of place, so a
    non-finite one asks every rank whose gradient it was."""
    res = run_ranks("tests.test_horovod:body_nonfinite", np=2, timeout=120, args=("hvd_terngrad", "raise", 10**9))
    for r in res:
        assert re.search(r"gradient in '\d\.(weight|bias)' on rank 1 at step 0, averaged uncoded", r["error"]), \
            r["error"]


def test_nan_gradient_skip_skips_the_step_on_every_rank():
    res = run_ranks("tests.test_horovod:body_nonfinite", np=2, timeout=120, args=("hvd_terngrad", "skip"))
    assert all(r["error"] is None and r["unchanged"] for r in res)


def body_mismatch():
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.manual_seed(0)
    width = 64 if hvd.rank() == 0 else 72  # rank 1 has another shape for the same name
    model = torch.nn.Linear(width, 32)
    named = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=hvd_terngrad.TernGrad(named, min_numel=100))
    try:
        model(torch.randn(4, width)).sum().backward()
        opt.step()
    except hvd_terngrad.PayloadMismatchError as exc:
        return str(exc)
    return None


def test_mismatched_tensor_sizes_are_a_clear_error_on_every_rank():
    res = run_ranks("tests.test_horovod:body_mismatch", np=2, timeout=120)
    for msg in res:
        assert msg is not None and "'weight'" in msg and "rank" in msg


def test_harness_reports_a_failing_body():
    with pytest.raises(RankFailure):
        run_ranks("tests.test_horovod:body_train", np=2, timeout=120, args=("stock", {"clip": -1.0}))


# ---------------------------------------------------------------------------------------------
# Transports (summed: code sums through an allreduce; identical bits to the allgather by construction)
def test_summed_transport_is_exact_with_the_independent_decode(exact_runs):
    res = exact_runs(4, "hvd_terngrad", 2, {"transport": "summed"})
    assert res[0]["checks"]["exact"] == 6
