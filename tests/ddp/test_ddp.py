"""TernGrad as a DDP communication hook (hvd_terngrad.ddp): the same averages as hvd_terngrad's Horovod optimizer,
on real ranks, for the transports whose average does not depend on how tensors are grouped."""
import gc
import os
import time
from pathlib import Path

import pytest
import torch

from tests.golden import frontends as G
from tests.mpi_harness import free_port, run_ranks, start_transports_late

pytestmark = pytest.mark.mpi
CASES = [(name, o) for name, o in G.CASES if o.get("transport") != "sharded-ternary"]


def _init_gloo(port: int) -> int:
    import torch.distributed as dist

    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    return rank


def _close_gloo() -> None:
    """The DDP models go before their process group (else an abort at exit, hook or not), then the group."""
    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def body_ddp(cases, port):
    """Each case: STEPS steps of DDP with the hook, and of hvd_terngrad's optimizer, in the same processes."""
    import horovod.torch as hvd

    import hvd_terngrad
    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    hvd.init()
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = {}
    for name, options in cases:
        opts = {**G.COMMON, "exclude": (), "min_numel": 1, **options}  # every tensor coded: no float averages
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = TernGradState(model.named_parameters(), **opts)
        ddp.register_comm_hook(state, terngrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        ref = G.Net()
        ref_opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                                    named_parameters=ref.named_parameters(),
                                                    compression=hvd_terngrad.TernGrad(**opts))
        for step in range(G.STEPS):
            for net, o in ((ddp, opt), (ref, ref_opt)):
                o.zero_grad()
                G.loss(net, rank, step).backward()
                o.step()
        out[name] = (G.digest(model.parameters()), G.digest(ref.parameters()), state.pipeline.step,
                     state.stats.last.tensors_coded)
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.parametrize("np", [2, 4])
def test_the_ddp_hook_gives_the_horovod_optimizers_bits(np):
    res = run_ranks("tests.ddp.test_ddp:body_ddp", np=np, timeout=240, args=(CASES, free_port()))
    for name, _ in CASES:
        ddp, ref, step, coded = res[0][name]
        assert all(r[name] == res[0][name] for r in res), name  # every rank the same
        assert step == G.STEPS and coded > 0, (name, step, coded)
        assert ddp == ref, name


def body_ddp_groups(port):
    """DDP's many small buckets through the hook: together (the default bucket_bytes), and each on its own (0).
    Per setting: the parameters after 3 steps, and the (step, key) of every group the pipeline started."""
    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = []
    for bucket_bytes in ({}, {"bucket_bytes": 0}):
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = TernGradState(model.named_parameters(), **{**G.COMMON, "min_numel": 1, "exclude": ()}, **bucket_bytes)
        pipe, groups = state.connect(), []
        pipe.start = _counting(pipe, groups)
        ddp.register_comm_hook(state, terngrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        G.run_steps(ddp, opt, rank, 3)
        out.append((G.digest(model.parameters()), groups))
        del ddp, state, pipe
    _close_gloo()
    return out


def _counting(pipe, groups: list):
    """pipe.start, recording the (step, key) of every group it starts in `groups`."""
    start = pipe.start

    def counted(key, *args, **kwargs):
        groups.append((pipe.step, key))
        return start(key, *args, **kwargs)

    return counted


def test_the_hook_sends_ddps_small_buckets_together_with_the_same_bits():
    res = run_ranks("tests.ddp.test_ddp:body_ddp_groups", np=2, timeout=120, args=(free_port(),))
    for (together, groups), (alone, alone_groups) in res:
        assert together == alone == res[0][0][0]  # the codes depend on the names, not on the groups
        assert groups == [(0, "bucket.0"), (1, "bucket.0"), (2, "bucket.0")]  # one group a step
        # bucket_bytes=0: a group per DDP bucket, several once DDP has made its buckets after the first step
        assert all(sum(1 for s, _ in alone_groups if s == step) > 1 for step in (1, 2)), alone_groups


def _link_distributions(roots, site, into) -> None:
    """Link into `into` every top-level file and folder of the distributions `roots` need (their requirements
    without extras, transitively), metadata included, from the site-packages `site`."""
    import re
    from importlib import metadata

    todo, seen = list(roots), set()
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen:
            continue
        seen.add(key)
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if (site / top).exists() and not (into / top).exists() and not top.startswith(".."):
                (into / top).symlink_to(site / top)


@pytest.mark.slow
def test_pip_install_and_a_torchrun_training_in_a_fresh_venv_without_horovod(tmp_path):
    """`pip install .` into a new venv that has torch and no Horovod (nor MPI's Python), then
    `import hvd_terngrad.ddp` (and the hook's C++ path, built against that torch) and a 2-rank torchrun training
    of the installed package, from outside the tree."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    root = Path(__file__).resolve().parents[2]
    site = Path(sysconfig.get_paths()["purelib"])
    venv, deps = tmp_path / "venv", tmp_path / "deps"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    deps.mkdir()
    # torch, the digits data's scikit-learn and what a build of this package needs, with what they need:
    # linked from this venv, so nothing downloads
    _link_distributions(("torch", "scikit-learn", "setuptools", "wheel"), site, deps)
    py = venv / "bin" / "python"
    vsite = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip())
    (vsite / "a_linked_deps.pth").write_text(f"{deps}\n")  # before distutils-precedence.pth, which needs it
    for name in ("pip", "distutils-precedence.pth"):  # pip, and setuptools' shim over the stdlib's distutils
        (vsite / name).symlink_to(site / name)
    src = tmp_path / "src"  # a copy, so that the build writes nothing into the tree
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "results", "*.so",
                                                                "__pycache__", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    inst = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", str(src)], env=env, capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-3000:]
    run_dir = tmp_path / "run"
    shutil.copytree(root / "examples", run_dir / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    check = subprocess.run([str(py), "-c", "import importlib.util as u, hvd_terngrad, hvd_terngrad.ddp, "
                            "hvd_terngrad._ddp_hook; print(u.find_spec('horovod') is None, hvd_terngrad.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    absent, where = check.stdout.split()
    assert absent == "True" and str(vsite) in where  # no Horovod at all; the installed package, not the tree
    res = subprocess.run([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "examples.train_digits_ddp", "--epochs", "2"], cwd=run_dir, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "terngrad: parameters agree across 2 workers" in res.stdout and "| terngrad | 2 |" in res.stdout


def _ddp_run(steps, rank, state_in=None, overflow_at=None, **options):
    """DDP with the hook on tests.golden's model: (parameters, the TernGrad state, GradScaler scales)."""
    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = TernGradState(model.named_parameters(), min_numel=1, seed=9, **options)
    ddp.register_comm_hook(state, terngrad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if state_in is not None:
        model.load_state_dict(state_in["model"])
        opt.load_state_dict(state_in["optimizer"])
        state.load_state_dict(state_in["terngrad"])
    scaler, scales = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), []
    for step in steps:
        opt.zero_grad()
        loss = G.loss(ddp, rank, step)
        if step == overflow_at and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "terngrad": state.state_dict()}
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), saved, scales


def body_ddp_loops(port):

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    straight, _, _ = _ddp_run(range(6), rank, error_feedback=True)
    _, saved, _ = _ddp_run(range(3), rank, error_feedback=True)
    resumed, _, _ = _ddp_run(range(3, 6), rank, state_in=saved, error_feedback=True)
    params, _, scales = _ddp_run(range(4), rank, overflow_at=2, on_nonfinite="propagate")
    _close_gloo()
    return torch.equal(straight, resumed), scales, params


def test_the_ddp_hook_resumes_bit_for_bit_and_lets_amp_see_an_overflow():
    res = run_ranks("tests.ddp.test_ddp:body_ddp_loops", np=2, timeout=120, args=(free_port(),))
    for resumed_equal, scales, params in res:
        assert resumed_equal  # model, optimizer and TernGrad state saved after 3 steps: 6 steps bit for bit
        assert scales[2] == scales[1] / 2 and scales == res[0][1]  # the overflow on rank 1: both skip, scale down
        assert torch.equal(params, res[0][2]) and torch.isfinite(params).all()


class _WithUnused(torch.nn.Module):
    """G.Net beside a layer that no forward uses, as many real models have (DDP then needs
    find_unused_parameters=True or static_graph=True)."""

    def __init__(self):
        super().__init__()
        self.net = G.Net()
        self.unused = torch.nn.Linear(16, 300)

    def forward(self, x):
        return self.net(x)


def body_ddp_options(port):
    """The hook beside DDP's own collectives: find_unused_parameters and static_graph make DDP allreduce its map
    of the parameters used during backward, on its group, while the hook's worker exchanges buckets (one group
    each); and the same on a process group given to both, twice (a second state over the same ranks). Each
    case's parameters after 6 steps."""
    import torch.distributed as dist

    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    given = dist.new_group()
    out = {}
    for name, options, group in (("find_unused", {"find_unused_parameters": True}, None),
                                 ("static_graph", {"static_graph": True}, None),
                                 ("given_group", {"find_unused_parameters": True}, given),
                                 ("given_again", {"find_unused_parameters": True}, given),  # the hook's group again
                                 ("bucket_view", {"find_unused_parameters": True, "gradient_as_bucket_view": True},
                                  None)):
        model = _WithUnused()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001, process_group=group, **options)
        state = TernGradState(model.named_parameters(), **G.COMMON, bucket_bytes=0, process_group=group)
        ddp.register_comm_hook(state, terngrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        G.run_steps(ddp, opt, rank, 6)
        out[name] = G.digest(model.parameters())
        del ddp, state
    import hvd_terngrad.auto

    hvd_terngrad.auto.TRIAL_PAIRS = 0
    for name, options in (("find_unused", {"find_unused_parameters": True}), ("static_graph", {"static_graph": True}),
                          ("bucket_view", {"find_unused_parameters": True, "gradient_as_bucket_view": True})):
        # transport="auto" keeping fp32 on so fast a link: the hook's C++ path (register) from the step after
        model = _WithUnused()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001, **options)
        state = TernGradState(model.named_parameters(), **G.COMMON, transport="auto", link_gbps=1000.0)
        state.register(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        G.run_steps(ddp, opt, rank, hvd_terngrad.auto.PLAN_STEP + 3)
        out[f"auto_{name}"] = (G.digest(model.parameters()), state.native)
        del ddp, state
    _close_gloo()
    return out


def test_the_hook_beside_ddps_own_collectives_find_unused_parameters_and_static_graph():
    """The hook's collectives go on a group of its own: on DDP's, gloo aborted ("Received data size doesn't
    match expected size") as DDP's map of used parameters paired with a bucket's exchange. auto_: the hook's C++
    path beside them."""
    res = run_ranks("tests.ddp.test_ddp:body_ddp_options", np=2, timeout=120, args=(free_port(),))
    assert res[0] == res[1]
    coded = {k: v for k, v in res[0].items() if not k.startswith("auto_")}
    cpp = [v for k, v in res[0].items() if k.startswith("auto_")]
    # the codes depend on (seed, step, rank, tensor name), not on DDP's options or group: the same bits
    assert len(set(map(tuple, coded.values()))) == 1, res[0]
    assert all(native for _, native in cpp) and len({tuple(d) for d, _ in cpp}) == 1, cpp


def body_ddp_join(port, transport):
    """Uneven inputs under DDP's join(): rank 1 runs out of batches after 4 steps of 7, and DDP runs the hook
    on zero buckets for it while rank 0 goes on. The parameters, the pipeline's step and whether the hook's
    C++ path averaged the last step, on each rank."""
    import hvd_terngrad
    from hvd_terngrad.ddp import TernGradState

    hvd_terngrad.auto.TRIAL_PAIRS = 0
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = TernGradState(model.named_parameters(), **G.COMMON, transport=transport, link_gbps=1000.0)
    state.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        G.run_steps(ddp, opt, rank, 7 if rank == 0 else 4)
    out = (G.digest(model.parameters()), state.pipeline.step, state.native)
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.parametrize("transport", ["allgather", "auto"])
def test_the_hook_under_ddps_join_with_uneven_inputs(transport):
    """auto: its plan (every bucket uncoded on so fast a link) takes over after the plan step, while rank 1
    is joined, and its C++ path from the next step (DDP runs it on new zero buckets for the joined rank).
    Both ranks end on the same parameters and count the same 7 steps."""
    res = run_ranks("tests.ddp.test_ddp:body_ddp_join", np=2, timeout=120, args=(free_port(),
                                                                           transport))
    assert res[0] == res[1] and res[0][1] == 7
    assert res[0][2] == (transport == "auto")


def body_powersgd(port):
    """torch's powerSGD_hook through InLaunchOrder over many small buckets, and DDP's FP32 allreduce, from the
    same start: 5 steps of PowerSGD after its 2 of plain allreduce, and 2 steps in all (allreduce only)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from hvd_terngrad.ddp import InLaunchOrder, in_launch_order

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = {}
    for name, steps in (("fp32", 2), ("powersgd", 2), ("fp32", 7), ("powersgd", 7)):
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = None
        if name == "powersgd":
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                                min_compression_rate=0.5, random_seed=3)
            ddp.register_comm_hook(InLaunchOrder(powerSGD_hook.powerSGD_hook, state), in_launch_order)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        G.run_steps(ddp, opt, rank, steps)
        out[name, steps] = (G.digest(model.parameters()), len(state.p_memory_dict) if state else 0)
        del ddp, state
    _close_gloo()
    return out


def test_powersgd_in_launch_order_on_many_buckets():
    """torch's powerSGD_hook, chained as it is, aborts a 2-rank gloo job with this many buckets even on localhost
    ("Received data size doesn't match expected size"). Through InLaunchOrder it runs: its warm-up steps give
    DDP's FP32 parameters bit for bit, then it compresses, and every rank holds the same parameters."""
    res = run_ranks("tests.ddp.test_ddp:body_powersgd", np=2, timeout=120, args=(free_port(),))
    assert res[0] == res[1]
    out = res[0]
    assert out["powersgd", 2] == out["fp32", 2] and out["powersgd", 2][1] == 0
    assert out["powersgd", 7][0] != out["fp32", 7][0] and out["powersgd", 7][1] > 0


def body_ddp_nonfinite(port, groups=False):
    """A NaN gradient on rank 1 at step 1, on_nonfinite='raise': what each rank's backward raises. groups: a
    DDP bucket a parameter, each its own group, and rank 1 starting each transport late."""

    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    if groups and rank == 1:
        start_transports_late(1.0)
    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001 if groups else 25)
    state = TernGradState(model.named_parameters(), min_numel=1, seed=9, timeout_s=30,
                          **({"bucket_bytes": 0} if groups else {}))
    ddp.register_comm_hook(state, terngrad_hook)
    out = None
    for step in range(3):
        loss = G.loss(ddp, rank, step)
        try:
            (loss * (float("nan") if (rank, step) == (1, 1) else 1.0)).backward()
        except RuntimeError as exc:
            out = (step, str(exc).splitlines()[0])
            break
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.parametrize("groups", [False, True])
def test_a_nan_gradient_under_ddp_raises_on_every_rank_naming_tensor_and_rank(groups):
    res = run_ranks("tests.ddp.test_ddp:body_ddp_nonfinite", np=2, timeout=120, args=(free_port(), groups))
    for step, message in res:
        assert step == 1
        assert "NonFiniteGradientError: hvd_terngrad: non-finite" in message and "on rank 1 at step 1" in message
        assert "Unable to cast" not in message


def test_in_launch_order_raises_the_wrapped_hooks_error_where_ddp_waits():
    from hvd_terngrad.ddp.serial import Serial

    serial = Serial("test")
    assert serial.submit(lambda: torch.ones(2)).wait().tolist() == [1.0, 1.0]
    chained = torch.futures.Future()
    fut = serial.submit(lambda: chained)  # another hook's future: waited for before the next bucket
    later = serial.submit(lambda: torch.zeros(1))
    chained.set_result(torch.full((1,), 7.0))
    assert fut.wait().item() == 7.0 and later.wait().item() == 0.0

    def boom():
        raise ValueError("bucket 3 broke")
    with pytest.raises(RuntimeError, match="ValueError: bucket 3 broke"):  # as DDP raises it: type and message
        serial.submit(boom).wait()


def test_the_worker_holds_an_error_every_rank_raises_until_the_steps_last_group_has_run():
    from hvd_terngrad.ddp.serial import Serial
    from hvd_terngrad.errors import CollectiveTimeoutError, NonFiniteGradientError

    def fails(error):
        def run():
            raise error
        return run

    serial = Serial("test")
    assert not serial._open
    bad, later, timed_out = torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
    serial.submit_into(fails(NonFiniteGradientError("nan in 'w'")), [bad], last=False)
    serial.submit_into(lambda: [torch.ones(1)], [later], last=False)
    assert later.wait().item() == 1.0  # the groups after it run and finish as ever
    serial.submit_into(fails(CollectiveTimeoutError("a peer never joined")), [timed_out], last=False)
    assert isinstance(timed_out.wait(), CollectiveTimeoutError)  # not held: later groups would wait out theirs
    time.sleep(0.05)
    assert not bad.done()
    serial.end_step()  # the step's last bucket took the uncoded path
    assert isinstance(bad.wait(), NonFiniteGradientError) and not serial._open
    serial.end_step()  # nothing sent since: no wake-up
    assert serial._queue.empty()


def body_ddp_one_node(port):
    """hierarchical=True where every rank is on one host: the node's float average is the whole exchange."""

    from hvd_terngrad.ddp import TernGradState, terngrad_hook

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = []
    for hier in (True, False):
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = None
        if hier:
            state = TernGradState(model.named_parameters(), min_numel=1, hierarchical=True)
            ddp.register_comm_hook(state, terngrad_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        G.run_steps(ddp, opt, rank, 3)
        out.append((G.digest(model.parameters()), None if state is None else
                    (state.pipeline.size, state.hierarchy.cross is None, state.stats.last.tensors_coded)))
        del ddp, state
    _close_gloo()
    return out


def test_ddp_hierarchical_on_one_node_is_the_float_average():
    res = run_ranks("tests.ddp.test_ddp:body_ddp_one_node", np=2, timeout=120, args=(free_port(),))
    for (hier, info), (plain, _) in res:
        assert hier == plain  # DDP's own FP32 average, bit for bit
        assert info == (1, True, 0)  # one node: nothing coded between nodes


def test_the_hook_refuses_what_ddp_cannot_do_with_a_reason():
    from hvd_terngrad.ddp import TernGradState

    model = G.Net()
    with pytest.raises(ValueError, match="default process group"):
        TernGradState(model.named_parameters(), hierarchical=True, process_group=object())
    with pytest.raises(ValueError, match="on_nonfinite='skip' needs an optimizer"):
        TernGradState(model.named_parameters(), on_nonfinite="skip")
    with pytest.raises(ValueError, match="bucket_bytes must be an integer >= 0"):
        TernGradState(model.named_parameters(), bucket_bytes=-1)


def test_without_its_cpp_path_register_warns_once_and_registers_the_python_hook(monkeypatch):
    """Where hvd_terngrad._ddp_hook is not built (pip's isolated build has no torch) or not for this torch,
    TernGradState.register says so and registers terngrad_hook itself."""
    import sys
    import warnings

    import hvd_terngrad
    import hvd_terngrad.ddp as ddp

    monkeypatch.setattr(ddp.native, "_NATIVE", None)
    monkeypatch.delattr(hvd_terngrad, "_ddp_hook", raising=False)
    monkeypatch.setitem(sys.modules, "hvd_terngrad._ddp_hook", None)  # import fails

    class Module:  # what register asks of a DDP model on this path
        module = torch.nn.Linear(2, 2)

        def register_comm_hook(self, state, hook):
            registered.append((state, hook))

    registered, state = [], ddp.TernGradState(Module.module.named_parameters(), transport="auto")
    monkeypatch.setattr(ddp.TernGradState, "_native_can_run", lambda self: True)  # several ranks
    with pytest.warns(UserWarning, match=r"the DDP hook's C\+\+ path is not available"):
        state.register(Module())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        state.register(Module())
    assert registered == [(state, ddp.terngrad_hook)] * 2 and not state.native


def body_ddp_loop_patterns(port):
    """DDP's training-loop patterns around the hook, each step: two micro-batches, the first under no_sync(),
    clip_grad_norm_, then the step, on DDP models in eager mode and under torch.compile (dynamo, aot_eager: its
    graph split at DDP's buckets). `fp32`: the hook with transport="auto" on so fast a link that it averages in
    fp32 (its C++ path from the step after the plan), beside DDP's own allreduce from the same parameters
    (copied over each step): whether every clipped gradient is its bits. `coded`: recommended(), eager and
    compiled: the parameters' digests, and the pipeline's step (one a synchronised step)."""
    import hvd_terngrad.auto as auto
    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.ddp import TernGradState

    auto.TRIAL_PAIRS = 0
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    steps = auto.PLAN_STEP + 3

    def loop(model, net, ddp, step):
        with ddp.no_sync():  # accumulated here, averaged with the next micro-batch's
            G.loss(net, rank, 2 * step).backward()
        G.loss(net, rank, 2 * step + 1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    out = {}
    for compiled in (False, True):
        wrap = (lambda m: torch.compile(m, backend="aot_eager")) if compiled else (lambda m: m)
        cap = 25 if compiled else 0.01  # dynamo's DDP graph split wants no first bucket larger than the rest
        model, ref = G.Net(), G.Net()
        hooked = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        own = torch.nn.parallel.DistributedDataParallel(ref, bucket_cap_mb=cap)
        state = TernGradState(model.named_parameters(), **G.COMMON, transport="auto", link_gbps=1000.0)
        state.register(hooked)
        nets = (wrap(hooked), wrap(own))
        same = []
        for step in range(steps):
            ref.load_state_dict(model.state_dict())
            for m, net, ddp in ((model, nets[0], hooked), (ref, nets[1], own)):
                m.zero_grad()
                loop(m, net, ddp, step)
            same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
        out[("fp32", compiled)] = (same, state.native, state.pipeline.step)
        del hooked, own, state, nets

        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        state = TernGradState(model.named_parameters(), config=TernGradConfig.recommended(seed=3, min_numel=256))
        state.register(ddp)
        net, opt = wrap(ddp), torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            loop(model, net, ddp, step)
            opt.step()
        out[("coded", compiled)] = (G.digest(model.parameters()), state.pipeline.step)
        del ddp, state, net
    _close_gloo()
    return out


def test_the_hook_under_ddps_loop_patterns_accumulation_clipping_and_torch_compile():
    """The hook runs once a synchronised step (no_sync's micro-batches only accumulate), clipping reads the
    averaged gradients, and torch.compile's DDP graph changes nothing: the hook's fp32 average is DDP's own
    allreduce to the bit, from the plan on in C++, eager or compiled (and over two ranks in the measured steps
    before, whose fp32 average the pipeline makes), and recommended() trains to the same bits compiled as eager
    (its codes depend on the tensors' names, not on DDP's buckets)."""
    from hvd_terngrad.auto import PLAN_STEP

    res = run_ranks("tests.ddp.test_ddp:body_ddp_loop_patterns", np=2, timeout=120, args=(free_port(),))
    assert res[0] == res[1]
    out = res[0]
    for compiled in (False, True):
        same, native, step = out[("fp32", compiled)]
        assert same == [True] * (PLAN_STEP + 3) and native and step == PLAN_STEP + 3, (compiled, same)
        assert out[("coded", compiled)][1] == PLAN_STEP + 3
    assert out[("coded", False)] == out[("coded", True)]
