"""Training loops as people write them, on real ranks: here, ranks whose backward reaches different parameters
(conditional branches, multi-task heads, expert routing). Horovod's synchronize() allreduces the gradients a
rank did not produce as zeros, after backward; TernGrad must not wait for a peer inside backward meanwhile."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.mpi_harness import run_ranks

pytestmark = pytest.mark.mpi
STEPS = 4


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(100, 10), nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        a = self.fc2(x)
        return a, self.fc3(F.relu(a))


def body_rank_dependent_parameters(fronts, transports):
    """Rank 0's loss never reaches fc3. Every (front end, transport): parameters after STEPS steps."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for front in fronts:
        for transport in transports:
            model = _TwoHeads()
            named = list(model.named_parameters())
            base = torch.optim.SGD(model.parameters(), lr=0.1)
            if front == "none":
                opt = hvd.DistributedOptimizer(base, named_parameters=named)
            elif front == "stock":
                tg = hvd_terngrad.TernGrad(named, min_numel=1, timeout_s=20, transport=transport)
                opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg)
            else:
                tg = hvd_terngrad.TernGrad(min_numel=1, timeout_s=20, transport=transport)
                opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg)
            g = torch.Generator().manual_seed(hvd.rank())
            for _ in range(STEPS):
                x, y = torch.randn(8, 100, generator=g), torch.randn(8, 10, generator=g)
                a, b = model(x)
                loss = F.mse_loss(a if hvd.rank() == 0 else b, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            out[(front, transport)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def test_ranks_that_reach_different_parameters_train_with_both_optimizers():
    fronts, transports = ["none", "stock", "hvd_terngrad"], ["allgather", "sharded"]
    res = run_ranks("tests.test_training_loops:body_rank_dependent_parameters", np=2, timeout=120,
                    args=(fronts, transports))
    for key in res[0]:
        assert torch.equal(res[0][key], res[1][key]), key  # the ranks agree
        assert torch.isfinite(res[0][key]).all(), key
    for t in transports:  # both TernGrad front ends give the same bits, and they moved the model
        assert torch.equal(res[0][("stock", t)], res[0][("hvd_terngrad", t)]), t
        assert not torch.equal(res[0][("stock", t)], _initial()), t


def _initial():
    return torch.cat([p.detach().reshape(-1) for p in _TwoHeads().parameters()])


# ---------------------------------------------------------------------------------------------
# Checkpoints: model, optimizer and TernGrad state saved after K steps, a new job resumes for K more
K = 3


def _with_error_feedback(front: str):
    """(model, optimizer, TernGrad with error feedback) of `front`, from the same initialization every time."""
    import horovod.torch as hvd

    import hvd_terngrad

    model = _TwoHeads()
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tg = hvd_terngrad.TernGrad(named if front == "stock" else None, min_numel=1, error_feedback=True, seed=5)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg) if front == "stock" else \
        hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg)
    return model, opt, tg


def _train(model, opt, steps) -> None:
    """The given steps, each on its own batch per rank (so a resumed run sees the batches it would have)."""
    import horovod.torch as hvd

    for step in steps:
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        x, y = torch.randn(8, 100, generator=g), torch.randn(8, 10, generator=g)
        a, b = model(x)
        opt.zero_grad()
        F.mse_loss(a + b, y).backward()
        opt.step()


def _ckpt_run(front: str, steps: range, workdir: str, save: bool, load: bool, load_terngrad: bool = True):
    import horovod.torch as hvd

    model, opt, tg = _with_error_feedback(front)
    path = f"{workdir}/{front}.rank{hvd.rank()}.pt"
    if load:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if load_terngrad:
            tg.load_state_dict(state["terngrad"])
    _train(model, opt, steps)
    if save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "terngrad": tg.state_dict()}, path)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), tg.pipeline.step


def body_checkpoint(phase: str, workdir: str):
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for front in ("stock", "hvd_terngrad"):
        if phase == "first":
            out[(front, "straight")] = _ckpt_run(front, range(2 * K), workdir, save=False, load=False)
            out[(front, "first")] = _ckpt_run(front, range(K), workdir, save=True, load=False)
        else:
            out[(front, "resumed")] = _ckpt_run(front, range(K, 2 * K), workdir, save=False, load=True)
            out[(front, "without")] = _ckpt_run(front, range(K, 2 * K), workdir, save=False, load=True,
                                                load_terngrad=False)
    return out


def test_a_resumed_job_trains_on_bit_for_bit_with_error_feedback(tmp_path):
    first = run_ranks("tests.test_training_loops:body_checkpoint", np=2, timeout=120, args=("first", str(tmp_path)))
    resumed = run_ranks("tests.test_training_loops:body_checkpoint", np=2, timeout=120,
                        args=("resume", str(tmp_path)))
    for r in range(2):
        for front in ("stock", "hvd_terngrad"):
            straight, step = first[r][(front, "straight")]
            got, got_step = resumed[r][(front, "resumed")]
            assert got_step == step == 2 * K, front
            assert torch.equal(got, straight), (front, r, float((got - straight).abs().max()))
            # resumed without TernGrad's state (step and residuals), the run differs: the state matters
            assert not torch.equal(resumed[r][(front, "without")][0], straight), front


# ---------------------------------------------------------------------------------------------
# Mixed precision: AMP's GradScaler, as Horovod documents it, with an overflow on one rank
def body_amp_overflow(fronts, dtype_name):
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for front in fronts:
        model = _TwoHeads()
        named = list(model.named_parameters())
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        tg = hvd_terngrad.TernGrad(named if front == "stock" else None, min_numel=1, on_nonfinite="propagate")
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg) if front == "stock" else \
            hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scales, params = [], []
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            x, y = torch.randn(8, 100, generator=g), torch.randn(8, 10, generator=g)
            with torch.autocast("cpu", dtype=getattr(torch, dtype_name)):
                a, b = model(x)
                loss = F.mse_loss((a + b).float(), y)
            if step == 2 and hvd.rank() == 1:
                loss = loss * float("inf")  # this rank's scaled gradients overflow
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        out[front] = (scales, params)
    return out


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_an_overflow_on_one_rank_makes_every_rank_skip_and_lower_the_scale(dtype_name):
    res = run_ranks("tests.test_training_loops:body_amp_overflow", np=2, timeout=120,
                    args=(["stock", "hvd_terngrad"], dtype_name))
    for front in ("stock", "hvd_terngrad"):
        (scales, params), (scales1, params1) = res[0][front], res[1][front]
        assert scales == scales1 and all(torch.equal(a, b) for a, b in zip(params, params1)), front
        assert scales[2] == scales[1] / 2, (front, scales)  # the overflow lowered the scale on both ranks
        assert torch.equal(params[2], params[1]), front  # and both skipped the step
        assert not torch.equal(params[3], params[2]) and torch.isfinite(params[4]).all(), front  # training goes on


# ---------------------------------------------------------------------------------------------
# The rest of a training loop: one launch runs every pattern with both optimizers
LOOP_STEPS = 4


def _loop(front: str, pattern: str):
    import horovod.torch as hvd

    import hvd_terngrad

    model = _TwoHeads()
    net = torch.compile(model, backend="aot_eager") if pattern == "compile" else model
    named = list(model.named_parameters())
    # a frozen parameter gets a zero gradient from Horovod (as with Compression.none), which momentum would
    # still move: the freeze pattern steps without it
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if pattern == "freeze" else 0.9)
    passes = 2 if pattern == "accumulate" else 1
    tg = hvd_terngrad.TernGrad(named if front == "stock" else None, min_numel=1)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg, backward_passes_per_step=passes) \
        if front == "stock" else hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg,
                                                                   backward_passes_per_step=passes)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if pattern == "scheduler" else None
    norms, frozen_at = [], None
    for step in range(LOOP_STEPS):
        if pattern == "freeze" and step == 1:
            model.fc1.weight.requires_grad_(False)
            frozen_at = model.fc1.weight.detach().clone()
        if pattern == "zero-grad-keep":  # Horovod's own zero_grad() takes no set_to_none; ours does
            (model if front == "stock" else opt).zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        for k in range(passes):
            g = torch.Generator().manual_seed(1000 * step + 10 * k + hvd.rank())
            a, b = net(torch.randn(8, 100, generator=g))
            F.mse_loss(a + b, torch.randn(8, 10, generator=g)).backward()
        if pattern == "clip":  # Horovod's documented pattern: clip the averaged gradient, then step
            opt.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if sched is not None:
            sched.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    frozen_ok = frozen_at is None or torch.equal(model.fc1.weight.detach(), frozen_at)
    return params, norms, frozen_ok, opt.param_groups[0]["lr"]


LOOP_PATTERNS = ["clip", "accumulate", "compile", "zero-grad-none", "zero-grad-keep", "scheduler", "freeze"]


def body_loops(patterns):
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    return {(front, p): _loop(front, p) for p in patterns for front in ("stock", "hvd_terngrad")}


def test_training_loop_patterns_with_both_optimizers():
    res = run_ranks("tests.test_training_loops:body_loops", np=2, timeout=240, args=(LOOP_PATTERNS,))
    for key, (params, norms, frozen_ok, lr) in res[0].items():
        other = res[1][key]
        assert torch.equal(params, other[0]) and norms == other[1], key  # the ranks agree
        assert torch.isfinite(params).all() and frozen_ok, key
        assert not torch.equal(params, _initial()), key
        if key[1] == "clip":  # the clipped average is what both ranks stepped with
            assert all(n <= 0.05 * (1 + 1e-5) for n in norms[1::2]) and max(norms[0::2]) > 0.05, norms
        if key[1] == "scheduler":
            assert lr == 0.1 * 0.5 ** LOOP_STEPS, lr
    for p in LOOP_PATTERNS:  # the two optimizers give the same bits in every pattern
        assert torch.equal(res[0][("stock", p)][0], res[0][("hvd_terngrad", p)][0]), p


def body_elastic_state(front: str):
    """hvd.elastic.TorchState carries TernGrad's state: commit after K steps, train on, restore (as a reset
    does), train K more: the result equals 2K steps straight."""
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    straight, _ = _ckpt_run(front, range(2 * K), "/nonexistent", save=False, load=False)
    model, opt, tg = _with_error_feedback(front)
    state = hvd.elastic.TorchState(model, opt, terngrad=tg)
    _train(model, opt, range(K))
    state.commit()
    _train(model, opt, range(K, K + 2))  # lost to the "reset"
    state.restore()
    state.sync()
    _train(model, opt, range(K, 2 * K))
    return torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), straight), tg.pipeline.step


@pytest.mark.parametrize("front", ["stock", "hvd_terngrad"])
def test_horovod_elastic_state_carries_terngrad_through_a_restore(front):
    res = run_ranks("tests.test_training_loops:body_elastic_state", np=2, timeout=120, args=(front,))
    assert res == [(True, 2 * K)] * 2, res


def body_added_group():
    """A parameter group added after step 1 (a head unfrozen in fine-tuning, say): its gradients are averaged,
    coded, from the next backward on (hvd_terngrad's optimizer)."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd.init()
    torch.set_num_threads(1)
    model, extra = _TwoHeads(), nn.Linear(10, 10)
    tg = hvd_terngrad.TernGrad(min_numel=1)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), compression=tg)
    for step in range(4):
        if step == 1:
            opt.add_param_group({"params": list(extra.parameters()), "lr": 0.05})
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        a, b = model(torch.randn(8, 100, generator=g))
        F.mse_loss(a + extra(b), torch.randn(8, 10, generator=g)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in [*model.parameters(), *extra.parameters()]], tg.stats.last.tensors_coded


def test_a_parameter_group_added_mid_training_is_averaged():
    res = run_ranks("tests.test_training_loops:body_added_group", np=2, timeout=120)
    (p0, coded), (p1, _) = res
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # the new group too: its gradients were averaged
    assert coded == 8  # six of the model's tensors and the group's two, all coded (min_numel=1)
