"""The DDP hook under transport="auto": its own uncoded averages (DDP's bits, fp32 and bf16, in Python and on the
C++ path), the trial on the path each kind would run on, and every fault of those averages on real ranks."""
import pytest
import torch

import hvd_terngrad.auto as auto
from hvd_terngrad.auto import PLAN_STEP, TRIAL_PAIRS
from tests.golden import frontends as G
from tests.mpi_harness import free_port, run_ranks, run_ranks_failing


def _beside_ddps_own(port, own_hook=None, **options):
    """The hook (TernGradState.register) with transport="auto" on a link so fast that its plan sends every bucket
    uncoded (unless `options` name another link_gbps), and TernGrad's `options`, beside DDP's own C++ allreduce (or
    `own_hook`, a DDP hook of the default group): (its state, train) where train(step) trains both models a step from
    the hooked one's parameters, on the same batches, and says whether every gradient is DDP's bits
    (train.grads: the step's gradients by name, (the hook's, DDP's))."""
    from hvd_terngrad.ddp import TernGradState
    from tests.ddp.test_ddp import _init_gloo

    rank = _init_gloo(port)
    torch.set_num_threads(1)
    model, ref = G.Net(), G.Net()
    hooked = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    own = torch.nn.parallel.DistributedDataParallel(ref, bucket_cap_mb=0.01)
    if own_hook is not None:
        own.register_comm_hook(None, own_hook)
    state = TernGradState(model.named_parameters(), **{**G.COMMON, "link_gbps": 1000.0, **options}, transport="auto")
    state.register(hooked)

    grads = {}  # set outside train: train naming itself kept its DDP model and the hook's state past gc.collect()

    def train(step: int) -> bool:
        ref.load_state_dict(model.state_dict())
        for net in (hooked, own):
            net.zero_grad()
            G.loss(net, rank, step).backward()
        same = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        grads.update((name, (p.grad.clone(), q.grad.clone()))
                     for (name, p), q in zip(model.named_parameters(), ref.parameters()))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        return same

    train.grads = grads
    return state, train


def body_hook_uncoded_is_ddps_own(port, wire):
    """The plan decided at once (no trial), in `wire`: per step, whether the hook averaged it uncoded, whether every
    gradient is DDP's bits (in bf16: those of torch's bf16_compress_hook), whether the hook's C++ path averaged it,
    and the bytes it sent; then whether the state outlived its DDP model."""
    import hvd_terngrad.ddp as ddp
    import hvd_terngrad.ddp.native as native
    from tests.ddp.test_ddp import _close_gloo

    auto.TRIAL_PAIRS = 0
    native.NATIVE_WIRES = (wire, *(w for w in native.NATIVE_WIRES if w != wire))  # the first: the plan put in force
    state, train = _beside_ddps_own(port, own_hook=ddp.bf16_hook if wire == "bf16" else None)
    out = []
    for step in range(PLAN_STEP + 4):
        if step == PLAN_STEP + 2:  # a resume: the hook in Python for a step (residuals to merge, maybe), then C++
            state.load_state_dict(state.state_dict())
        native = state.native
        same = train(step)
        last = state.pipeline.stats.last
        out.append((last.tensors_coded == 0 and last.tensors_float > 0, same, native, last.bytes_sent))
    import gc
    import weakref

    gone = weakref.ref(state), weakref.ref(state._native)
    del state, train
    gc.collect()
    if any(ref() is not None for ref in gone):  # the C++ path holds its Python side weakly: no cycle through C++
        raise AssertionError("the hook's state, or its C++ path's Python side, outlived its DDP model")
    _close_gloo()
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("wire,np", [("fp32", 3), ("bf16", 2)])
def test_the_hooks_own_uncoded_average_is_ddps_own_to_the_bit(wire, np):
    """fp32 over three ranks, where x * (1/3) and x / 3 differ: the hook scales each bucket before the sum as DDP's
    reducer does, in C++ from the plan's first step (its byte counts too: uncoded), and in Python again for the
    step after a resume (load_state_dict). bf16 over two: torch's bf16_compress_hook's bits (which rounds, then
    divides; the same where N is a power of two), from the C++ path and from the pipeline's bf16 average in Python,
    at half the bytes."""
    _needs_cpp_hook()
    for out in run_ranks("tests.ddp.test_ddp_auto:body_hook_uncoded_is_ddps_own", np=np, timeout=120,
                         args=(free_port(), wire)):
        assert [uncoded for uncoded, _, _, _ in out] == [True] * (PLAN_STEP + 4)  # fp32 while measuring too
        # the measured steps' average (the pipeline's in fp32, divided after the sum) rounds otherwise
        assert [same for _, same, _, _ in out] == [False] * PLAN_STEP + [True] * 4
        assert [native for _, _, native, _ in out] == [False] * PLAN_STEP + [True, True, False, True]
        fp32 = out[0][3]  # a measured step's bytes
        assert [sent for _, _, _, sent in out[PLAN_STEP:]] == [fp32 if wire == "fp32" else fp32 // 2] * 4


def body_trial_with_cpp(port, error_feedback, prune, link_gbps):
    """The plan's trial (TRIAL_PAIRS pairs of rounds: coded, bf16, fp32, then fp32, bf16, coded), with auto.PRUNE
    `prune`: per step, the kind auto had in force, whether the C++ path averaged it, whether every gradient is DDP's
    bits, and where it merged a coded step's residuals, how far its gradients were from DDP's plus the ranks' average
    residual, and how large that residual was (each relative to the largest |value| of the sum); then the plans
    tried, each kind's count of timed steps on this rank, the plan kept and the verdict's step."""
    from tests.ddp.test_ddp import _close_gloo

    auto.PRUNE, auto.AHEAD = prune, float("inf")  # AHEAD: no kind pruned for not being ahead of the C++ path
    state, train = _beside_ddps_own(port, error_feedback=error_feedback, link_gbps=link_gbps)
    out = []
    for step in range(auto.LAST_VERDICT_STEP + 3):
        native, plan = state.native, state.connect().auto
        left = {name: r.clone() for name, r in state.pipeline.coder.feedback.worker.items()} if step else {}
        same, merged = train(step), None
        if left:  # this step merged them: its average is DDP's plus the ranks' average residual
            far = big = 0.0
            for name, r in sorted(left.items()):
                torch.distributed.all_reduce(r)
                hooked, own = train.grads[name]
                expected = own + r.view_as(own) / torch.distributed.get_world_size()
                top = float(expected.abs().max())
                far, big = max(far, float((hooked - expected).abs().max()) / top), max(big, float(r.abs().max()) / top)
            merged = (far, big)
        out.append((plan.trial.kind(step) if plan.trials else None, native, same, merged))
    plan = state.pipeline.auto
    summary = (plan.trials, [len(t) for t in plan.trial.times], plan.kept, plan.trial.verdict_step, plan.prefer)
    del state, train
    _close_gloo()
    return out, summary


@pytest.mark.mpi
@pytest.mark.parametrize("error_feedback,prune,link_gbps",
                         [(False, float("inf"), 1e-3), (True, float("inf"), 1e-3), (True, 1.0, 1e-3),
                          (False, float("inf"), 1000.0)],
                         ids=["plain", "ef", "ef-one-left", "fast-link"])
def test_auto_trials_its_plans_on_the_cpp_path_they_would_run_on_once_kept(error_feedback, prune, link_gbps):
    """The trial times each kind as it would run once kept: the fp32 and bf16 plans' steps on the C++ path (each
    ended once it has completed, as the Python kinds' steps are), the coded steps in Python. Timed in Python,
    the fp32 plan carried the Python hook's 5-8% against the C++ path it would run on, and lost to fp16 or to
    coding by 0.4-2.8% on lenet on the fast profile (docs/notes/tta-history.md). With error feedback, a step after a
    coded one first merges its residuals, there too (a call into Python a bucket): no fp32 step of the trial
    follows a coded one, the bf16 plan's first step of a pair does (2 of its 6), and once decided, the first step
    after the coded verdict step merges them: each such step's average is DDP's plus the ranks' average residual.
    Every kind to the end (nothing pruned), or (PRUNE 1) only the fastest left after the first pair, kept on the
    pruning step. On a link slow enough that the model codes the buckets, and where it codes nothing, the plan
    tried is every bucket uncoded in the wires of the C++ path."""
    _needs_cpp_hook()
    res = run_ranks("tests.ddp.test_ddp_auto:body_trial_with_cpp", np=2, timeout=120,
                    args=(free_port(), error_feedback, prune, link_gbps))
    assert res[0] == res[1]  # the same kinds, paths, bits and verdict on both ranks
    out, (trials, counts, kept, verdict, prefer) = res[0]
    assert prefer == ("fp32", "bf16")  # the wires this path runs
    pairs = TRIAL_PAIRS if prune == float("inf") else 1
    assert [w for _, _, w in trials] == ["fp32", "bf16"] and counts == [2 * pairs] * 3, (trials, counts)
    assert verdict == PLAN_STEP + 2 * 3 * pairs + (pairs > 1), verdict  # the pruning step among them
    fp32, bf16 = 1, 2  # their kinds: trials[0], trials[1]
    for step, (kind, native, same, merged) in enumerate(out):
        after_coded = error_feedback and step > PLAN_STEP and out[step - 1][0] in (0, None)
        if after_coded and (kind in (fp32, bf16) or step == verdict + 1 and kept is not None):  # merged, not coded
            far, big = merged
            assert far < 2 ** -6 < big, (step, kind, native, merged)  # within bf16's rounding of DDP's + theirs
        if PLAN_STEP <= step < verdict:  # the trial: the plans in C++ (fp32: DDP's bits); coding in Python
            assert native == (kind in (fp32, bf16)) and same == (kind == fp32), (step, kind)
            assert not (after_coded and kind == fp32), step
        elif step == verdict + 1 and error_feedback:  # the verdict step's residuals merged, on the kept plan's path
            assert native == (kept is not None) and not same, (step, kept)
        elif step > verdict:  # decided: the C++ path where a plan was kept
            assert native == (kept is not None) and same == (kept == fp32 - 1), (step, kept, native, same)
        elif step < PLAN_STEP:  # measured: fp32 through the pipeline, in Python (over two ranks DDP's bits)
            assert not native and same, step
        else:  # the verdict's coded step
            assert not native and not same, step


class _WithBf16Scale(torch.nn.Module):
    """G.Net with a bfloat16 scale of its output: DDP puts it in a bucket of its own, the step's last, which the
    hook's worker averages, while the fp32 bucket before it takes the hook's own average."""

    def __init__(self):
        super().__init__()
        self.net = G.Net()
        self.scale = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))

    def forward(self, x):
        return self.net(x) * self.scale.float()


def body_ddp_uncoded_faults(port, fault, late_s=0.0, layout="buckets", native=False):
    """DDP's hook with transport="auto" on a link so fast that every bucket goes uncoded, which the hook then
    averages itself; two steps after the plan, rank 1 has a NaN gradient ("nan", where it starts the step's
    later buckets late_s late) or stops before its backward ("stuck"). layout: several fp32 buckets, one, or
    "bf16_last" (one fp32 bucket with a NaN in one tensor, then a finite bfloat16 one, which the worker
    averages), or "bf16_last_slow": that, with the fp32 average's callback slow (0.3 s) and the bfloat16
    bucket's hook late (0.1 s), so that the later hook meets a completed allreduce whose callback is still
    running. What each rank's backward raised, and at which step; the training then tears its process group
    down at once, as a user's loop would. native: registered with TernGradState.register, whose C++ path then
    averages the buckets from the step after the plan's first (checked); a layout ending in "_bf16" puts the plan
    in force in bf16 there."""
    import time

    import hvd_terngrad.ddp
    import hvd_terngrad.ddp.native
    from hvd_terngrad.ddp import TernGradState
    from hvd_terngrad.ddp.averages import OwnAverages
    from tests.ddp.test_ddp import _close_gloo, _init_gloo

    hvd_terngrad.auto.TRIAL_PAIRS = 0
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    bf16 = layout.startswith("bf16_last")
    if layout == "fp16_buckets":  # the plan in fp16: the hook launches each bucket, the worker finishes them
        auto.WIRES = ("fp16",)
    if layout == "bf16_last_slow":
        _slow_average_callbacks(0.3, 0.1)
    if layout.endswith("_bf16"):
        hvd_terngrad.ddp.native.NATIVE_WIRES = ("bf16", "fp32")
    model = G.Net() if not bf16 else _WithBf16Scale()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01 if "buckets" in layout else 25)
    state = TernGradState(model.named_parameters(), **G.COMMON, transport="auto", link_gbps=1000.0, timeout_s=5,
                          on_nonfinite="propagate" if fault == "propagate" else "raise")
    at = [0]  # the step the loop is at
    if bf16 and rank == 1:  # a NaN in one fp32 tensor only: the bf16 bucket stays finite
        model.net.body[4].weight.register_hook(lambda g: g * float("nan") if at[0] == PLAN_STEP + 1 else g)
    if layout.startswith("huge") and rank == 1:  # one finite value in one tensor, within a factor 2 of fp32's largest
        model.body[4].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([7]), 3e38)
                                           if at[0] == PLAN_STEP + 1 else g)
    if native:
        state.register(ddp)
    else:
        ddp.register_comm_hook(state, hvd_terngrad.ddp.terngrad_hook)  # as _slow_average_callbacks left it
    if late_s and rank == 1 and native:  # the last bucket's gradient comes late_s late on rank 1
        model.body[0].weight.register_hook(lambda g: time.sleep(late_s) or g if at[0] == PLAN_STEP + 1 else g)
    elif late_s and rank == 1:  # the NaN step's later buckets start late on rank 1
        average_now = OwnAverages.start

        def late(self, owner, bucket):
            if owner.pipeline.step == PLAN_STEP + 1 and bucket.index() > 0:
                time.sleep(late_s)
            return average_now(self, owner, bucket)

        OwnAverages.start = late
    out = None if fault != "propagate" else []
    for step in range(PLAN_STEP + 3):
        at[0] = step
        if step > PLAN_STEP and state.native != native:
            raise AssertionError(f"the C++ path is {'off' if native else 'on'} at step {step}")
        if step >= PLAN_STEP and layout.endswith("_bf16") and state.pipeline.auto.wire != "bf16":
            raise AssertionError(f"the plan in force at step {step} is not in bf16")
        loss = G.loss(ddp, rank, step)
        if (rank, step) == (1, PLAN_STEP + 1) and fault == "stuck":
            time.sleep(60)
        try:
            nan = (rank, step) == (1, PLAN_STEP + 1) and not bf16 and not layout.startswith("huge")
            (loss * (float("nan") if nan else 1.0)).backward()
            if fault == "propagate":  # per step: whether every gradient is all NaN, or all finite
                grads = [p.grad for p in model.parameters()]
                out.append((all(bool(g.isnan().all()) for g in grads), all(bool(g.isfinite().all()) for g in grads)))
                ddp.zero_grad()
        except RuntimeError as exc:
            if fault == "stuck":
                raise
            out = (step, str(exc))
            break
    if fault != "stuck":
        del ddp, state
        _close_gloo()
    return out


def _slow_average_callbacks(callback_s: float, bf16_hook_s: float) -> None:
    """The hook's own fp32 averages finish callback_s late on gloo's thread (their finiteness check there), and
    a bfloat16 bucket's hook starts bf16_hook_s late."""
    import threading
    import time

    import hvd_terngrad.ddp as ddp
    import hvd_terngrad.ddp.averages as averages

    check, hook = averages._finite_average, ddp.terngrad_hook

    def slow_check(markers, buf):
        if threading.current_thread() is not threading.main_thread():  # gloo's callback thread
            time.sleep(callback_s)
        return check(markers, buf)

    def late_hook(state, bucket):
        if bucket.buffer().dtype == torch.bfloat16:
            time.sleep(bf16_hook_s)
        return hook(state, bucket)

    averages._finite_average, ddp.terngrad_hook = slow_check, late_hook


@pytest.mark.mpi
@pytest.mark.parametrize("late_s,layout,native", [
    (0.0, "buckets", False), (2.0, "buckets", False), (0.0, "one_bucket", False), (0.0, "bf16_last", False),
    (0.0, "bf16_last_slow", False), (2.0, "buckets", True), (2.0, "buckets_bf16", True)],
    ids=["together", "late_rank", "one_bucket", "bf16_last", "bf16_last_slow_callback", "late_rank_cpp",
         "late_rank_cpp_bf16"])
def test_the_hooks_own_uncoded_average_names_a_nan_gradients_tensor_and_rank_on_every_rank(late_s, layout, native):
    """The error leaves with the step's last bucket, whichever way that went. late_rank: raised from the first,
    it let rank 0 tear its group down under rank 1's later allreduces, and rank 1 aborted ("Resource deadlock
    avoided", 6 runs of 10). bf16_last_slow_callback: the last bucket waited for the earlier allreduce, not for
    its callback, and the NaN step went on unraised (every run; once in a loaded test run without the delays).
    late_rank_cpp: the hook's C++ path (TernGradState.register) averages the NaN step (its one-bucket case:
    test_a_finite_gradient_near_fp32s_largest_is_an_overflow_named_on_every_rank[cpp], the same path); _bf16: in
    bf16, whose rounding keeps a rank's marker."""
    if native:
        _needs_cpp_hook()
    results = run_ranks("tests.ddp.test_ddp_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                        args=(free_port(), "nan", late_s, layout, native))
    assert None not in results, f"a rank trained through the NaN step without raising: {results}"
    for step, message in results:
        assert step == PLAN_STEP + 1
        assert "NonFiniteGradientError" in message and f"on rank 1 at step {step}, averaged uncoded" in message, \
            message
    assert results[0][1].split("(reported")[0] == results[1][1].split("(reported")[0]  # the same tensor


@pytest.mark.mpi
@pytest.mark.parametrize("native,layout", [(False, "huge"), (True, "huge"), (True, "huge_bf16")],
                         ids=["python", "cpp", "cpp_bf16"])
def test_a_finite_gradient_near_fp32s_largest_is_an_overflow_named_on_every_rank(native, layout):
    """The hook's own fp32 average reads only where a marker can be, which holds because no rank sends a value
    whose sum could overflow: one beyond half of fp32's largest is marked as an overflow, and raised on every
    rank with its tensor and rank, though the rest of the average would have been finite. cpp: the hook's C++
    path (TernGradState.register); cpp_bf16: its bf16 average, whose range is fp32's."""
    if native:
        _needs_cpp_hook()
    results = run_ranks("tests.ddp.test_ddp_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                        args=(free_port(), "nan", 0.0, layout, native))
    for step, message in results:
        assert step == PLAN_STEP + 1
        assert "gradient in 'body.4.weight' on rank 1 at step" in message and "beyond ±1.7e+38" in message, message


@pytest.mark.mpi
def test_a_nan_in_the_hooks_fp16_averages_names_the_tensor_and_the_rank_on_every_rank():
    """The plan in fp16, several buckets: the hook launches each bucket's average itself and the worker finishes
    them after the step's last launch, the non-finite flags' collective among them, in bucket order."""
    results = run_ranks("tests.ddp.test_ddp_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                        args=(free_port(), "nan", 0.0, "fp16_buckets"))
    assert None not in results, f"a rank trained through the NaN step without raising: {results}"
    for step, message in results:
        assert step == PLAN_STEP + 1
        assert "NonFiniteGradientError" in message and f"on rank 1 at step {step}" in message, message
    assert results[0][1].split("(reported")[0] == results[1][1].split("(reported")[0]  # the same tensor


@pytest.mark.mpi
@pytest.mark.parametrize("native", [False, True], ids=["python", "cpp"])
def test_the_hooks_own_uncoded_average_hands_amp_nan_averages_with_propagate(native):
    if native:
        _needs_cpp_hook()
    for steps in run_ranks("tests.ddp.test_ddp_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                           args=(free_port(), "propagate", 0.0, "buckets", native)):
        assert steps == [(False, True)] * (PLAN_STEP + 1) + [(True, False), (False, True)]


@pytest.mark.mpi
@pytest.mark.parametrize("native", [False, True], ids=["python", "cpp"])
def test_the_hooks_own_uncoded_average_fails_in_bounded_time_when_a_rank_never_joins(native):
    if native:
        _needs_cpp_hook()
    msg = run_ranks_failing("tests.ddp.test_ddp_auto:body_ddp_uncoded_faults", np=2, within=45,
                            args=(free_port(), "stuck", 0.0, "buckets", native))
    assert "CollectiveTimeoutError" in msg and "failed on rank 0 at step" in msg, msg[-3000:]


class _FailingGroup(torch.distributed.ProcessGroup):
    """A one-rank process group whose allreduce number `fail_at` fails, as gloo's does when a peer has gone."""

    def __init__(self):
        super().__init__(0, 1)
        self.calls, self.fail_at = 0, None

    def allreduce(self, tensors, opts=None):
        self.calls += 1
        done = torch.futures.Future()
        done.set_result(tensors)
        if self.calls == self.fail_at:
            done = done.then(_peer_gone)
        return torch._C._distributed_c10d._create_work_from_future(done)


def _peer_gone(_):
    raise RuntimeError("a peer went away")


def body_cpp_failed_step(port):
    """Two ranks, the hook's C++ path on: at step `bad` it averages over a one-rank group of its own on each
    rank, bucket 0's average is not finite and the step's last allreduce fails. What each step's backward
    raised (None where it trained)."""
    import hvd_terngrad.ddp as ddp_mod
    from hvd_terngrad.ddp.averages import sendable
    from tests.ddp.test_ddp import _close_gloo, _init_gloo

    auto.TRIAL_PAIRS = 0
    _init_gloo(port)
    torch.set_num_threads(1)
    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = ddp_mod.TernGradState(model.named_parameters(), **G.COMMON, transport="auto", link_gbps=1000.0)
    state.register(ddp)
    bad, at, group, out = PLAN_STEP + 2, [0], _FailingGroup(), []
    model.body[4].weight.register_hook(lambda g: g * float("nan") if at[0] == bad else g)  # in bucket 0
    for step in range(bad + 3):
        at[0] = step
        if step == bad:  # the C++ path's allreduces go to the failing group from here on
            assert state.native
            scale = state.pipeline.coder.codec.impl(model.body[4].weight.detach()).scale_kernel()
            state._native.control.enable(group, 1, scale, sendable(1), state.pipeline.step, False, False,
                                         False)
            group.fail_at = len(state._native.named)  # the step's last bucket
        try:
            ddp.zero_grad()
            G.loss(ddp, 0, step).backward()
            out.append(None)
        except RuntimeError as exc:
            out.append(str(exc).split("\n")[0])
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.mpi
def test_a_failed_step_on_the_cpp_path_leaves_no_error_for_the_next():
    """A step whose last allreduce fails raises that failure; the non-finite average held the same step goes
    with it. It stayed held, and the next step, finite, raised it."""
    _needs_cpp_hook()
    bad = PLAN_STEP + 2
    for rank, out in enumerate(run_ranks("tests.ddp.test_ddp_auto:body_cpp_failed_step", np=2, timeout=120,
                                         args=(free_port(),))):
        assert out[:bad] == [None] * bad and out[bad + 1:] == [None, None], out
        assert "CollectiveTimeoutError" in out[bad] and f"failed on rank {rank} at step {bad}" in out[bad], out[bad]


def _needs_cpp_hook():
    """The hook's C++ path is built wherever torch is there at build time (setup.py), as it is for these tests:
    missing, it is a failure, not a skip."""
    from hvd_terngrad import _ddp_hook  # noqa: F401
