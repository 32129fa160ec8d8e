"""The DDP hook under the patterns DDP's own comm-hook tests use: real gloo ranks under mpirun.

Mixed parameter dtypes under transport="auto" (one order of the hook's collectives a step), sparse gradients
(averaged as DDP's allreduce_hook averages them, to the bit), complex parameters (averaged whole), a NaN in a
tensor averaged in float or in a sparse one (named with its rank on every rank), one rank (the gradients
untouched), compiled autograd's Python reducer (refused), and what the state says of itself (its name in DDP's
logging, pickling). `python -m tests.ddp.test_ddp_hardening` runs the mixed-dtype model long (main)."""
import pickle

import pytest
import torch

from tests.ddp.test_ddp import _close_gloo, _init_gloo
from tests.golden import frontends as G
from tests.mpi_harness import free_port, run_ranks

pytestmark = pytest.mark.mpi


class _Mixed(torch.nn.Module):
    """fp32, fp64 and fp32 (or bf16) layers, as DDP's tests mix them: DDP buckets each dtype apart, and backward
    hands the hook a bucket of another dtype (c's, b's) before an fp32 one (a's)."""

    def __init__(self, bf16: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(20, 64)
        self.b = torch.nn.Linear(64, 64).double()
        self.c = torch.nn.Linear(64, 5).to(torch.bfloat16 if bf16 else torch.float32)

    def forward(self, x):
        h = torch.tanh(self.a(x.float()))
        h = torch.tanh(self.b(h.double())).float()
        return self.c(h.to(self.c.weight.dtype)).float()


def _train(ddp, rank: int, steps: int, lr: float = 0.05, nan_at=None):
    """steps SGD steps of G.loss; nan_at=(rank, step, parameter): that gradient made NaN on that rank. Returns
    (the step that raised, its first line) or None."""
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    named = dict(ddp.module.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        handle = None
        if nan_at is not None and (rank, step) == nan_at[:2]:
            handle = named[nan_at[2]].register_hook(lambda g: torch.full_like(g, float("nan")))
        try:
            G.loss(ddp, rank, step).backward()
        except RuntimeError as exc:
            return step, str(exc).splitlines()[0]
        finally:
            if handle is not None:
                handle.remove()
        opt.step()
    return None


def _digest(module) -> list:
    return G.digest(p.float() for p in module.parameters())


def body_mixed_dtypes(port, cases, steps, bf16, skew=False):
    """Each case (options, how the hook is registered): `steps` steps of the mixed-dtype model. skew: the ranks
    made to race the other way each: rank 1's worker starts each exchange 20 ms late, rank 0's backward hands
    over a's gradient 20 ms late, so that two threads issuing collectives would issue them in different orders
    on the two ranks every step, not at a random one."""
    import time

    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    from hvd_terngrad.ddp.exchanges import Exchanges

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    if skew and rank == 1:
        finish = Exchanges.finish
        Exchanges.finish = lambda self, jobs: time.sleep(0.02) or finish(self, jobs)
    out = {}
    for options, how in cases:
        model = _Mixed(bf16)
        if skew and rank == 0:
            model.a.weight.register_hook(lambda g: time.sleep(0.02) or g)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
        state = TernGradState(model.named_parameters(), timeout_s=30, **options)
        if how == "register":
            state.register(ddp)
        else:
            ddp.register_comm_hook(state, terngrad_hook)
        failed = _train(ddp, rank, steps)
        assert failed is None, (options, how, failed)
        auto = state.pipeline.auto
        out[(tuple(sorted(options.items())), how)] = (
            _digest(model), all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            state.pipeline.step,
            None if auto is None else (auto.decided, auto.wire, None if auto.coded is None else sorted(auto.coded)))
        del ddp, state
    _close_gloo()
    return out


AUTO_FAST = {"transport": "auto", "link_gbps": 1000.0}


@pytest.mark.parametrize("bf16", [False, True])
def test_mixed_dtypes_under_auto_issue_every_collective_from_one_thread(bf16):
    """fp64 and fp32 layers (and bf16) under transport="auto" on a fast link: once auto sends every bucket in
    fp32, the fp32 buckets were averaged on the training thread while the fp64 ones went to the worker, two
    threads issuing collectives on one group, and gloo aborted at a random step (here every step: the ranks
    skewed). Now every rank trains on to the same finite parameters, registered either way."""
    steps = 60
    cases = [(AUTO_FAST, "register"), (AUTO_FAST, "register_comm_hook")]
    res = run_ranks("tests.ddp.test_ddp_hardening:body_mixed_dtypes", np=2, timeout=240,
                    args=(free_port(), cases, steps, bf16, True))
    assert res[0] == res[1]
    for key, (_, finite, step, auto) in res[0].items():
        assert finite and step == steps, key
        assert auto[0] and auto[2] == [] and auto[1] in ("fp32", "bf16", "fp16"), (key, auto)  # uncoded


@pytest.mark.parametrize("np", [2, 4])
def test_mixed_dtypes_on_every_transport(np):
    from hvd_terngrad.transports import TRANSPORTS

    cases = [({"transport": t, "min_numel": 64}, "register") for t in TRANSPORTS]
    res = run_ranks("tests.ddp.test_ddp_hardening:body_mixed_dtypes", np=np, timeout=240,
                    args=(free_port(), cases, 6, True))
    assert all(r == res[0] for r in res)
    for key, (_, finite, step, _) in res[0].items():
        assert finite and step == 6, key


class _Sparse(torch.nn.Module):
    def __init__(self, dense: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16, sparse=True)
        self.bag = torch.nn.EmbeddingBag(40, 16, mode="sum", sparse=True)
        self.head = torch.nn.Linear(32, 5) if dense else None

    def forward(self, ids):
        h = torch.cat([self.emb(ids).mean(1), self.bag(ids % 40)], 1)
        return self.head(h) if self.head is not None else h[:, :5]


def _sparse_loss(model, rank: int, step: int, nan: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids, y = torch.randint(0, 50, (8, 4), generator=g), torch.randint(0, 5, (8,), generator=g)
    return torch.nn.functional.cross_entropy(model(ids), y) * (float("nan") if nan else 1.0)


def body_sparse(port, steps):
    """The sparse model (alone, and beside a dense head) trained with the hook and with DDP's allreduce_hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hvd_terngrad.config import TernGradConfig
    from hvd_terngrad.ddp import TernGradState

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = {}
    configs = {"default": {}, "recommended": {"config": TernGradConfig.recommended()}, "auto": AUTO_FAST,
               "float": {"min_numel": 1 << 30}}
    for dense in (False, True):
        for name, options in [("allreduce_hook", None), *configs.items()]:
            model = _Sparse(dense)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            if options is None:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            else:
                options = options if "config" in options else {"timeout_s": 30, **options}
                state = TernGradState(model.named_parameters(), **options)
                state.register(ddp)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
            for step in range(steps):
                opt.zero_grad()
                _sparse_loss(ddp, rank, step).backward()
                opt.step()
            out[(dense, name)] = (_digest(model), model.emb.weight.grad.is_sparse)
            del ddp
    _close_gloo()
    return out


def test_sparse_gradients_are_averaged_as_ddps_allreduce_hook_averages_them():
    """nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True): each rank kept its own gradient, silently.
    Now a sparse bucket goes uncoded, averaged as DDP's allreduce_hook averages it: the parameters are its to
    the bit, alone and beside a dense head kept in float; coded or under auto, every rank agrees."""
    res = run_ranks("tests.ddp.test_ddp_hardening:body_sparse", np=2, timeout=180, args=(free_port(), 8))
    assert res[0] == res[1]
    out = res[0]
    for dense in (False, True):
        ref = out[(dense, "allreduce_hook")]
        assert ref[1]  # the gradients were sparse
        for name in ("default", "recommended", "auto", "float"):
            if not dense or name == "float":  # nothing coded: DDP's average to the bit
                assert out[(dense, name)] == ref, (dense, name)
    # with the dense head coded, the sparse layers' updates still agree on every rank (res[0] == res[1])


class _Complex(torch.nn.Module):
    """A real layer, then two complex parameters, which DDP buckets apart, as reals (view_as_real)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(20, 64)
        self.z = torch.nn.Parameter(torch.randn(64, dtype=torch.complex64))
        self.w = torch.nn.Parameter(torch.randn(5, 64, dtype=torch.complex64) / 8)

    def forward(self, x):
        return (self.a(x.float()) * self.z @ self.w.T).abs()


def body_complex(port, steps):
    """`steps` SGD steps of the complex model: DDP's allreduce_hook, the hook with nothing coded, under auto
    (fp32), and coded (recommended()). Each run's parameters (as reals)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import hvd_terngrad.auto
    from hvd_terngrad.config import TernGradConfig
    from hvd_terngrad.ddp import TernGradState

    hvd_terngrad.auto.TRIAL_PAIRS = 0  # no coded trial steps: auto's plan, uncoded in fp32, from its first step
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    out = {}
    runs = [("allreduce_hook", None), ("float", {"min_numel": 1 << 30}), ("auto", AUTO_FAST),
            ("coded", {"config": TernGradConfig.recommended()})]
    for name, options in runs:
        model = _Complex()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if options is None:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        else:
            options = options if "config" in options else {"timeout_s": 30, **options}
            TernGradState(model.named_parameters(), **options).register(ddp)
        assert _train(ddp, rank, steps) is None, name
        out[name] = G.digest(torch.view_as_real(p) if p.is_complex() else p for p in model.parameters())
        del ddp
    _close_gloo()
    return out


def test_complex_parameters_are_averaged_whole():
    """DDP lays a complex gradient in its bucket as reals (view_as_real), where bucket.gradients() views only
    p.numel() of them, at offsets that count one per element: through those views most of a complex bucket
    went unaveraged and the ranks diverged. Now uncoded it is allreduce_hook's average to the bit, and coded
    every rank holds the same parameters."""
    from hvd_terngrad.auto import PLAN_STEP

    steps = PLAN_STEP + 3
    res = run_ranks("tests.ddp.test_ddp_hardening:body_complex", np=2, timeout=180, args=(free_port(), steps))
    assert res[0] == res[1]
    out = res[0]
    assert out["float"] == out["allreduce_hook"] and out["auto"] == out["allreduce_hook"]
    assert out["coded"] != out["allreduce_hook"]  # coded, and (res[0] == res[1]) the same on every rank


def body_nonfinite(port, case):
    """A NaN at step 1 on rank 1 in a tensor averaged in float (below min_numel, or excluded), or sparse."""
    from hvd_terngrad.ddp import TernGradState

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    if case == "sparse":
        model = _Sparse(dense=True)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = TernGradState(model.named_parameters(), timeout_s=30)
        state.register(ddp)
        opt, got = torch.optim.SGD(ddp.parameters(), lr=0.5), None
        for step in range(3):
            opt.zero_grad()
            try:
                _sparse_loss(ddp, rank, step).backward() if (rank, step) != (1, 1) else \
                    _sparse_loss(ddp, rank, step, nan=True).backward()
            except RuntimeError as exc:
                got = step, str(exc).splitlines()[0]
                break
            opt.step()
    else:
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        options = {"min_numel": 256} if case == "min_numel" else {"min_numel": 1, "exclude": ("head.*",)}
        state = TernGradState(model.named_parameters(), timeout_s=30, **options)
        state.register(ddp)
        tensor = "head.bias" if case == "min_numel" else "head.weight"
        got = _train(ddp, rank, 3, nan_at=(1, 1, tensor))
    del ddp, state
    _close_gloo()
    return got


@pytest.mark.parametrize("case", ["min_numel", "exclude", "sparse"])
def test_a_nan_in_a_float_or_sparse_tensor_raises_on_every_rank_naming_it(case):
    tensor = {"min_numel": "head.bias", "exclude": "head.weight", "sparse": None}[case]
    res = run_ranks("tests.ddp.test_ddp_hardening:body_nonfinite", np=2, timeout=120, args=(free_port(), case))
    for got in res:
        assert got is not None, "no error"
        step, message = got
        assert step == 1 and "NonFiniteGradientError" in message and "on rank 1" in message, got
        assert tensor is None or repr(tensor) in message, got
        assert "Unable to cast" not in message


def body_one_rank(port):
    """One rank: the hook, recommended() and the paper defaults, against plain DDP."""
    from hvd_terngrad.config import TernGradConfig
    from hvd_terngrad.ddp import TernGradState

    _init_gloo(port)
    out = {}
    for name, cfg in (("plain", None), ("recommended", TernGradConfig.recommended()),
                      ("paper", TernGradConfig()), ("auto", TernGradConfig(**AUTO_FAST))):
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        if cfg is not None:
            state = TernGradState(model.named_parameters(), config=cfg)
            state.register(ddp)
        assert _train(ddp, 0, 5, lr=0.1) is None
        out[name] = G.digest(model.parameters())
        del ddp
    _close_gloo()
    return out


def test_one_rank_leaves_the_gradients_as_plain_ddp_does():
    """With one rank there is no peer to average with: the hook codes nothing, as both Horovod front ends."""
    out = run_ranks("tests.ddp.test_ddp_hardening:body_one_rank", np=1, timeout=90, args=(free_port(),))[0]
    for name in ("recommended", "paper", "auto"):
        assert out[name] == out["plain"], name


def body_python_reducer(port):
    """DDP built for compiled autograd's Python reducer: register() refuses it, and so does the hook."""
    import torch._dynamo

    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    from hvd_terngrad.errors import TernGradError

    rank = _init_gloo(port)
    out = {}
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = TernGradState(model.named_parameters(), timeout_s=30)
        try:
            state.register(ddp)
            out["register"] = "registered"
        except TernGradError as exc:
            out["register"] = str(exc)
        try:
            terngrad_hook(state, (next(model.parameters()).grad, next(model.parameters())))
            out["hook"] = "ran"
        except TernGradError as exc:
            out["hook"] = str(exc)
    finally:
        torch._dynamo.config.optimize_ddp = True
    del ddp, state
    _close_gloo()
    return rank, out


def test_compiled_autograds_python_reducer_is_refused_with_a_reason():
    for _, out in run_ranks("tests.ddp.test_ddp_hardening:body_python_reducer", np=2, timeout=90, args=(free_port(),)):
        for how in ("register", "hook"):
            assert "python_reducer" in out[how] and "optimize_ddp" in out[how], out


def body_names(port):
    """The hook's name in DDP's logging data, per transport, and the state's pickling."""
    from hvd_terngrad.ddp import TernGradState

    _init_gloo(port)
    out = {}
    for transport in ("allgather", "auto"):
        model = G.Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = TernGradState(model.named_parameters(), transport=transport, timeout_s=30)
        state.register(ddp)
        out[transport] = ddp._get_ddp_logging_data().get("comm_hook")
        try:
            pickle.dumps(state)
            out["pickle"] = "pickled"
        except TypeError as exc:
            out["pickle"] = str(exc)
        del ddp, state
    _close_gloo()
    return out


def test_the_hook_names_its_cpp_path_only_where_it_runs_and_says_how_to_checkpoint():
    from hvd_terngrad.ddp.native import native_module

    out = run_ranks("tests.ddp.test_ddp_hardening:body_names", np=2, timeout=90, args=(free_port(),))[0]
    assert out["allgather"] == "terngrad_hook"
    assert out["auto"] == ("hvd_terngrad.ddp.terngrad_hook (C++ path)" if native_module() else "terngrad_hook")
    assert "state_dict()" in out["pickle"] and "load_state_dict()" in out["pickle"]


def main() -> None:
    """The long form of the mixed-dtype runs: `steps` steps of the model on 2 and 4 ranks, with and without a
    bf16 layer, the ranks skewed, for every transport and for transport="auto" (fast link: uncoded; slow: coded),
    registered either way. Writes what each rank ended with as JSON.

        PYTHONPATH=. python -m tests.ddp.test_ddp_hardening --steps 200 --out results/ddp_hardening/mixed_dtypes.json
    """
    import argparse
    import json
    import time

    from hvd_terngrad.transports import TRANSPORTS

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = [({"transport": t, "min_numel": 64}, "register") for t in TRANSPORTS]
    cases += [(AUTO_FAST, "register"), (AUTO_FAST, "register_comm_hook"),
              ({"transport": "auto", "link_gbps": 0.001}, "register")]
    rows = []
    for np in args.np:
        for bf16 in (False, True):
            t0 = time.perf_counter()
            res = run_ranks("tests.ddp.test_ddp_hardening:body_mixed_dtypes", np=np, timeout=1800,
                            args=(free_port(), cases, args.steps, bf16, True))
            wall = time.perf_counter() - t0
            for key, (digest, finite, step, auto) in res[0].items():
                same = all(r[key][0] == digest for r in res)
                rows.append({"np": np, "bf16": bf16, "options": dict(key[0]), "registered": key[1],
                             "steps": step, "finite": finite, "ranks_agree": same,
                             "auto": None if auto is None else {"decided": auto[0], "wire": auto[1], "coded": auto[2]}})
                print(f"np={np} bf16={bf16!s:5} {key[1]:18} {dict(key[0])}: {step} steps, finite={finite}, "
                      f"ranks agree={same}, auto={auto}", flush=True)
            print(f"np={np} bf16={bf16}: {wall:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": f"PYTHONPATH=. python -m tests.ddp.test_ddp_hardening --steps {args.steps}",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
