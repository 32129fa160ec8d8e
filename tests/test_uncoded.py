"""The uncoded averages transport="auto" may send in place of codes (hvd_terngrad.transports.uncoded): fp32, and
fp16 at a scale every rank agrees on, with what a gradient past that scale, a NaN, and a tensor not measured
yet do to it; on loopback ranks and on real ones."""
import math

import pytest
import torch

import hvd_terngrad.auto as auto
from hvd_terngrad.auto import PLAN_STEP, AutoPlan
from hvd_terngrad.codec import Codec
from hvd_terngrad.collectives.loopback import horovod_average
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.finite import absmax
from hvd_terngrad.transports.uncoded import HALF_HEADROOM, half_scale
from tests.golden import frontends as G
from tests.mpi_harness import free_port, run_ranks
from tests.test_auto import _steps, _train, trial


def test_the_scale_is_a_power_of_two_that_leaves_the_headroom_below_fp16s_range():
    for size in (2, 4, 7, 512):
        for magnitude in (1e-30, 3e-9, 0.02, 1.0, 5e4, 1e30):
            s = half_scale(magnitude, size)
            assert math.frexp(s)[0] == 0.5  # a power of two: scaling and unscaling are exact
            top = size * HALF_HEADROOM * magnitude * s  # what N ranks' values at the headroom would sum to, scaled
            assert 2.0 ** 14 < top <= 2.0 ** 15 < 65504.0, (size, magnitude)
    for unknown in (None, 0.0, math.inf, math.nan, -1.0):
        assert half_scale(unknown, 4) is None  # such a tensor travels in fp32
    assert half_scale(1e-300, 4) == 2.0 ** 120  # clamped: the scale and its inverse stay normal fp32


def test_a_scaled_half_keeps_tiny_and_large_gradients_that_a_plain_cast_loses():
    g = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    for magnitude in (1e-9, 1e5):  # a plain .half() flushes the first to zero and overflows the second
        x = g * magnitude
        s = half_scale(absmax(x), 4)
        back = torch.empty_like(x)
        Codec().from_half(Codec().to_half(x, s), s, out=back)
        assert back.dtype == torch.float32 and torch.allclose(back, x, rtol=2 ** -10, atol=absmax(x) * 2 ** -20)
        assert not torch.allclose(x.half().float(), x, rtol=2 ** -10, atol=absmax(x) * 2 ** -20)
    assert math.isnan(absmax(torch.tensor([1.0, math.nan]))) and absmax(torch.tensor([-3.0, 2.0])) == 3.0
    assert absmax(torch.empty(0)) == 0.0


def test_the_plan_is_tried_in_fp32_and_in_fp16_and_the_faster_wire_is_kept():
    kinds = {"fp16": (0.008, 0.006), "fp32": (0.006, 0.008), "coded": (0.012, 0.011)}
    for kept, (fp32, fp16) in kinds.items():
        p = AutoPlan()
        _steps(p, trial([0.010, fp32, fp16]))
        assert p.decided and p.summary()["tried"] == [{"coding": [], "transport": None, "uncoded": "fp32"},
                                                      {"coding": [], "transport": None, "uncoded": "fp16"}]
        assert p.trial.verdict == pytest.approx((0.010, fp32, fp16))
        assert p.summary()["uncoded_wire_now"] == (None if kept == "coded" else kept)
        assert p.uncoded("bucket.0") == (kept != "coded") and (kept == "coded" or p.wire == kept)


@pytest.fixture
def fp16_untried(monkeypatch):
    """The model's plan in force at once, untried, with its uncoded groups in fp16."""
    monkeypatch.setattr(auto, "TRIAL_PAIRS", 0)
    monkeypatch.setattr(auto, "WIRES", ("fp16",))


def _run(steps, spike=None, nan=None, new_at=None, **options):
    """tests.test_auto._train on a link where auto sends its groups uncoded, tensor t_i at 10^-i. spike / nan:
    (step, rank), where t1's element 7 is 10^6 times larger / NaN. new_at: from this step on bucket.0 has a
    third tensor, "new", that was never coded."""
    def change(step, named):
        for nm in named:
            for i, (_, t) in enumerate(nm):
                t.mul_(10.0 ** -i)
        for fault, value in ((spike, None), (nan, math.nan)):
            if fault is not None and fault[0] == step:
                t = named[fault[1]][1][1]
                t[7] = t[7] * 1e6 if value is None else value
        if new_at is None or step < new_at:
            return None
        for nm in named:
            nm.insert(2, ("new", nm[0][1] * 3.0))
        return ("bucket.0", slice(0, 3)), ("bucket.1", slice(3, None))

    return _train(1000.0, steps, change=change, **options)


def test_an_fp16_average_is_within_its_rounding_of_the_exact_average_and_every_rank_gets_the_same(fp16_untried):
    pipes, out = _run(PLAN_STEP + 3)
    for step, key, groups, averages, named in out:
        if step < PLAN_STEP:
            continue
        assert {g.transport.name for g in groups} == {"fp16"}, (step, key)
        exact = horovod_average([torch.cat([t for _, t in nm]) for nm in named])
        got = torch.cat(averages[0])
        assert all(torch.equal(torch.cat(a), got) for a in averages)  # the same bits on every rank
        off = 0
        for name, t in named[0]:  # fp16's rounding: of each value, and of the partial sums (up to N times one)
            n, m = t.numel(), absmax(exact[off: off + t.numel()])
            assert torch.allclose(got[off: off + n], exact[off: off + n], rtol=2 ** -9, atol=m * 2 ** -8), name
            off += n
    # each tensor's magnitude: its last average's largest |value|, the same on every rank
    assert len({tuple(sorted(p.coder.magnitudes.items())) for p in pipes}) == 1
    assert pipes[0].coder.magnitudes["t2"] == pytest.approx(absmax(torch.cat(out[-1][3][0])), rel=1e-6)


@pytest.fixture
def bf16_untried(monkeypatch):
    """The model's plan in force at once, untried, with its uncoded groups in bf16 (a wire only front ends whose
    collectives sum bf16 offer: AutoPlan.offer)."""
    monkeypatch.setattr(auto, "TRIAL_PAIRS", 0)
    monkeypatch.setattr(auto, "WIRES", ("bf16",))


def test_a_bf16_average_is_that_of_each_ranks_rounded_gradient_and_a_nan_still_names_its_rank(bf16_untried):
    """bf16 needs no scale (fp32's exponent range): each rank's gradient rounded, summed, read back into fp32, the
    same bits on every rank, at half fp32's bytes. A NaN is found in the average and named by a second
    collective, as in fp32's copy."""
    at = PLAN_STEP + 1
    pipes, out = _run(at + 2, nan=(at + 1, 2))
    for step, key, groups, averages, named in out:
        if step < PLAN_STEP:
            continue
        assert {g.transport.name for g in groups} == {"bf16"}, (step, key)
        if step == at + 1 and key == "bucket.0":
            for p, g, a in zip(pipes, groups, averages):
                assert [it.nonfinite_rank for it in g.items] == [-1, 2] and not bool(a[1].isfinite().all())
                with pytest.raises(NonFiniteGradientError, match=r"'t1' on rank 2 at step"):
                    p.coder.raise_nonfinite(p.nonfinite(g))
            continue
        rounded = horovod_average([torch.cat([t for _, t in nm]).bfloat16() for nm in named]).float()
        assert all(a[0].dtype == torch.float32 and torch.equal(torch.cat(a), rounded) for a in averages), (step, key)
    stats = pipes[0].stats.history  # a measured step in fp32 and a planned one in bf16: their bytes
    assert stats[at].bytes_sent * 2 == stats[PLAN_STEP - 1].bytes_sent and stats[at].tensors_float == 3


def test_a_gradient_that_outgrows_its_fp16_scale_is_averaged_again_in_fp32_in_the_same_step(fp16_untried):
    at = PLAN_STEP + 1
    pipes, out = _run(at + 2, spike=(at, 2))
    (step, key, groups, averages, named), = [o for o in out if o[:2] == (at, "bucket.0")]
    exact = horovod_average([torch.cat([t for _, t in nm]) for nm in named])
    for g, a in zip(groups, averages):
        assert [it.nonfinite_rank for it in g.items] == [-1, -1]  # no error: nobody's gradient was non-finite
        assert g.handle.redone == [1]  # t1 redone in fp32, t0 kept its fp16 average
        assert torch.equal(a[1], exact[3000:])  # bit for bit Horovod's fp32 average
    nxt = [o for o in out if o[:2] == (at + 1, "bucket.0")][0][2]
    assert not nxt[0].handle.redone and nxt[0].transport.name == "fp16"


def test_a_nan_in_an_fp16_group_names_the_tensor_and_the_rank_on_every_rank(fp16_untried):
    at = PLAN_STEP + 1
    pipes, out = _run(at + 1, nan=(at, 3))
    (_, _, groups, averages, _), = [o for o in out if o[:2] == (at, "bucket.0")]
    for p, g, a in zip(pipes, groups, averages):
        assert [it.nonfinite_rank for it in g.items] == [-1, 3] and not g.handle.redone
        assert not bool(a[1].isfinite().all())  # handed on as it is (propagate would fill it with NaN)
        with pytest.raises(NonFiniteGradientError, match=r"'t1' on rank 3 at step"):
            p.coder.raise_nonfinite(p.nonfinite(g))
    assert math.isfinite(pipes[0].coder.magnitudes["t1"])  # the NaN did not become a magnitude


def test_a_tensor_whose_magnitude_is_not_known_goes_in_fp32_beside_the_group_once_and_is_measured(fp16_untried):
    """"new" joins bucket.0 after the plan: it was never coded, so no rank knows its scale."""
    at = PLAN_STEP + 1
    pipes, out = _run(at + 2, new_at=at)
    for step, key, groups, averages, named in out:
        if key != "bucket.0" or step < at:
            continue
        parts = groups[0].handle.parts
        assert [parts[i].dtype for i in range(3)] == [torch.float16, torch.float16] + (
            [torch.float32] if step == at else [torch.float16]), step  # "new": fp32 once, then fp16
        exact = horovod_average([nm[2][1] for nm in named])
        if step == at:
            assert all(torch.equal(a[2], exact) for a in averages)  # Horovod's fp32 average, bit for bit
    assert pipes[0].coder.magnitudes["new"] == pytest.approx(absmax(out[-2][3][0][2]), rel=1e-6)


def test_with_error_feedback_the_residual_goes_along_the_first_fp16_average_and_is_let_go(monkeypatch):
    """The trial's coded step (PLAN_STEP) leaves residuals; its fp16 step after carries them and lets them go."""
    monkeypatch.setattr(auto, "TRIAL_PAIRS", 1)
    monkeypatch.setattr(auto, "WIRES", ("fp16",))
    pipes, _ = _run(PLAN_STEP + 1, error_feedback=True)
    assert all(p.coder.feedback.worker for p in pipes)  # the coded step's
    pipes, _ = _run(PLAN_STEP + 2, error_feedback=True)
    assert not any(p.coder.feedback.worker for p in pipes)  # let go once the first average carried it


# ------------------------------------------------------------------------------------------
def body_frontends_fp16(port, spike_step):
    """The three front ends with transport="auto" on a link so fast that no group is worth coding, the plan in
    force in fp16: each one's parameters after PLAN_STEP + 3 steps, the wires its groups took, and its
    magnitudes. At spike_step rank 1's gradient of one tensor is 10^6 times its size: it outgrows its scale."""
    import horovod.torch as hvd

    import hvd_terngrad
    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    from tests.ddp.test_ddp import _close_gloo, _init_gloo

    hvd_terngrad.auto.TRIAL_PAIRS = 0  # the plan untried, in fp16: this is about the wire, not timing
    hvd_terngrad.auto.WIRES = ("fp16",)
    hvd.init()
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    opts = {**G.COMMON, "transport": "auto", "link_gbps": 1000.0}
    at = [0]
    spiked = "body.4.weight"

    def spike(g):
        return g * 1e6 if (rank, at[0]) == (1, spike_step) else g

    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = TernGradState(model.named_parameters(), **opts)
    ddp.register_comm_hook(state, terngrad_hook)
    ref, stock = G.Net(), G.Net()
    tg = hvd_terngrad.TernGrad(**opts)
    tg_stock = hvd_terngrad.TernGrad(stock.named_parameters(), **opts)
    for net in (model, ref, stock):
        dict(net.named_parameters())[spiked].register_hook(spike)
    runs = [(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)),
            (ref, hvd_terngrad.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                                    named_parameters=ref.named_parameters(), compression=tg)),
            (stock, hvd.DistributedOptimizer(torch.optim.SGD(stock.parameters(), lr=0.1),
                                             named_parameters=stock.named_parameters(), compression=tg_stock))]
    growth = []  # each front end's magnitude of the spiked tensor over the step before's, at spike_step
    for step in range(PLAN_STEP + 3):
        at[0] = step
        before = [p.coder.magnitude(spiked) or 0.0 for p in (state.pipeline, tg.pipeline, tg_stock.pipeline)
                  ] if step else []
        for net, o in runs:
            o.zero_grad()
            G.loss(net, rank, step).backward()
            o.step()
        if step == spike_step:
            growth = [p.coder.magnitudes[spiked] / b for p, b in zip((state.pipeline, tg.pipeline, tg_stock.pipeline),
                                                                     before)]
    pipes = (state.pipeline, tg.pipeline, tg_stock.pipeline)
    out = ([G.digest(m.parameters()) for m in (model, ref, stock)], [p.auto.wire for p in pipes],
           [sorted(p.coder.magnitudes) for p in pipes], growth)
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("spike_step", [None, PLAN_STEP + 1], ids=["steady", "outgrown"])
def test_every_front_end_averages_in_fp16_where_auto_says_so_and_they_agree(spike_step):
    res = run_ranks("tests.test_uncoded:body_frontends_fp16", np=2, timeout=240, args=(free_port(), spike_step))
    for digests, wires, measured, growth in res:
        assert wires == ["fp16"] * 3
        assert all(m for m in measured)  # every front end measured its tensors' magnitudes
        # outgrown: the average, redone in fp32, is about half the spike (rank 1's of 2) bigger than the last one
        assert growth == [] if spike_step is None else len(growth) == 3 and all(g > 1e4 for g in growth), growth
        # two ranks: a + b in fp16 rounds alike in any order, so Horovod's and gloo's fp16 sums agree bit for bit
        assert digests[0] == digests[1] == digests[2]
    assert res[0][0] == res[1][0]


def body_optimizer_lets_go_of_fp16_tensors():
    """hvd_terngrad's optimizer with auto's plan (every tensor uncoded) tried in fp16 for one step, and then the
    coded steps found faster: the fp16 buffers it keeps after each step, and what auto kept."""
    import horovod.torch as hvd

    import hvd_terngrad

    auto.TRIAL_PAIRS, auto.WIRES = 1, ("fp16",)  # steps PLAN_STEP + 0..3: coded, fp16, fp16, coded
    agree = auto.AutoPlan.agree

    def coded_fastest(self, values):
        agree(self, values)
        if self.steps == self.trial.verdict_step:
            self.trial.verdict = (0.0,) + (1.0,) * (len(values) - 1)

    auto.AutoPlan.agree = coded_fastest
    hvd.init()
    torch.set_num_threads(1)
    model = G.Net()
    tg = hvd_terngrad.TernGrad(**G.COMMON, transport="auto", link_gbps=1000.0)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), compression=tg)
    kept = []
    for step in range(PLAN_STEP + 4 + 1 + 3):
        opt.zero_grad()
        G.loss(model, hvd.rank(), step).backward()
        opt.step()
        kept.append(sum(wire == "fp16" for wire, _ in opt._ex.kept))
    return kept, tg.pipeline.auto.kept, tg.pipeline.auto.decided


@pytest.mark.mpi
def test_the_optimizer_lets_go_of_a_trials_fp16_tensors_once_auto_keeps_coding():
    for kept, plan, decided in run_ranks("tests.test_uncoded:body_optimizer_lets_go_of_fp16_tensors", np=2,
                                         timeout=120):
        assert decided and plan is None, (plan, decided)  # coding kept
        assert kept[PLAN_STEP + 1] > 0  # the trial's step sent its tensors in fp16
        assert kept[PLAN_STEP + 4:] == [0] * 4, kept  # none kept from the verdict on


def body_optimizer_uncoded_faults(on_nonfinite, wire="fp16", tensor="body.2.weight"):
    """hvd_terngrad's optimizer with the plan in force in `wire` (the bucket's gradients and the tensors never
    coded in one flat average); at PLAN_STEP + 1 `tensor`'s gradient on rank 1 is NaN. What each
    rank's step raised (raise), or each step's (all finite, that tensor all NaN) (propagate)."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd_terngrad.auto.TRIAL_PAIRS = 0
    hvd_terngrad.auto.WIRES = (wire,)
    hvd.init()
    rank = hvd.rank()
    torch.set_num_threads(1)
    net = G.Net()
    at = [0]
    params = dict(net.named_parameters())
    params[tensor].register_hook(lambda g: g * math.nan if (rank, at[0]) == (1, PLAN_STEP + 1) else g)
    tg = hvd_terngrad.TernGrad(**G.COMMON, transport="auto", link_gbps=1000.0, on_nonfinite=on_nonfinite)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                            named_parameters=net.named_parameters(), compression=tg)
    out = []
    for step in range(PLAN_STEP + 3):
        at[0] = step
        opt.zero_grad()
        G.loss(net, rank, step).backward()
        try:
            opt.synchronize()
        except NonFiniteGradientError as exc:
            return str(exc), (tg.pipeline.auto.wire, sorted(opt._ex.kept))
        finite = all(bool(p.grad.isfinite().all()) for p in net.parameters())
        out.append((finite, bool(params[tensor].grad.isnan().all())))
        if finite:  # as AMP's GradScaler: a step with a non-finite gradient is skipped
            with opt.skip_synchronize():
                opt.step()
    return out, (tg.pipeline.auto.wire, sorted(opt._ex.kept))


@pytest.mark.mpi
@pytest.mark.parametrize("wire, tensor", [("fp16", "body.2.weight"), ("fp16", "head.weight"),
                                          ("fp32", "body.2.weight"), ("fp32", "head.weight")])  # head.*: never coded
def test_a_nan_in_an_uncoded_average_of_the_optimizer_names_its_rank_on_every_rank_or_is_handed_on(wire, tensor):
    # the tensors never coded join the model's one (and last) bucket in one buffer, kept from step to step
    flat = [(wire, "bucket.0")]
    for message, how in run_ranks("tests.test_uncoded:body_optimizer_uncoded_faults", np=2, timeout=120,
                                  args=("raise", wire, tensor)):
        assert how == (wire, flat) and f"{tensor!r} on rank 1 at step {PLAN_STEP + 1}" in message, message
    for steps, how in run_ranks("tests.test_uncoded:body_optimizer_uncoded_faults", np=2, timeout=120,
                                args=("propagate", wire, tensor)):
        assert how == (wire, flat)
        assert steps == [(True, False)] * (PLAN_STEP + 1) + [(False, True), (True, False)], steps  # NaN throughout


def _beside_horovod(model, wire: str, **options):
    """hvd_terngrad's optimizer on model() with auto's plan in force in `wire` (every group uncoded, untried), then
    one step beside Horovod's own optimizer on a twin with the same weights: (the optimizer, its model, the
    twin), each with that step's averaged gradients."""
    import horovod.torch as hvd

    import hvd_terngrad

    hvd_terngrad.auto.TRIAL_PAIRS = 0
    hvd_terngrad.auto.WIRES = (wire,)
    hvd.init()
    rank = hvd.rank()
    torch.set_num_threads(1)
    ours, twin = model(), model()
    tg = hvd_terngrad.TernGrad(**G.COMMON, transport="auto", link_gbps=1000.0)
    opt = hvd_terngrad.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                            named_parameters=ours.named_parameters(), compression=tg, **options)
    for step in range(PLAN_STEP + 3):  # coded until the plan, then uncoded (in fp16, every magnitude measured)
        opt.zero_grad()
        G.loss(ours, rank, step).backward()
        opt.step()
    assert tg.pipeline.auto.wire == wire and not tg.pipeline.auto.coded
    twin.load_state_dict(ours.state_dict())
    plain = hvd.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                     named_parameters=twin.named_parameters())
    for net, o in ((ours, opt), (twin, plain)):
        o.zero_grad()
        G.loss(net, rank, PLAN_STEP + 3).backward()
        o.synchronize()
    return opt, ours, twin


def body_optimizer_joins_the_last_bucket(wire):
    """G.Net in two buckets, beside Horovod (_beside_horovod): (the buffers it kept, each averaged gradient's
    largest difference from Horovod's FP32 average, relative to its largest value)."""
    opt, ours, twin = _beside_horovod(G.Net, wire, bucket_bytes=G.BUCKET_BYTES)
    assert len(opt._ex.buckets) == 2
    return sorted(opt._ex.kept), [float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                               for a, b in zip(ours.parameters(), twin.parameters())]


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_the_tensors_never_coded_join_the_last_uncoded_bucket_in_one_average(wire):
    """Where the plan sends the last bucket uncoded in the wire of the never-coded tensors, they go in its
    average: two buffers for two buckets, none of their own, and the same averages (fp32: the same bits as
    Horovod's; fp16: within its rounding)."""
    for kept, diffs in run_ranks("tests.test_uncoded:body_optimizer_joins_the_last_bucket", np=2, timeout=120,
                                 args=(wire,)):
        assert kept == [(wire, "bucket.0"), (wire, "bucket.1")], kept
        assert max(diffs) <= (0.0 if wire == "fp32" else 2.0 ** -10), diffs


class _WithFp64(torch.nn.Module):
    """G.Net beside an fp64 parameter big enough to be coded: one bucket of mixed dtypes."""

    def __init__(self):
        super().__init__()
        self.net = G.Net()
        self.bias64 = torch.nn.Parameter(torch.linspace(-1, 1, 320, dtype=torch.float64))

    def forward(self, x):
        return self.net(x) + self.bias64.float()[:5] * self.bias64.float().mean()


def body_optimizer_mixed_fp32_bucket():
    """_WithFp64 (a bucket of fp32 and fp64 gradients) in fp32, beside Horovod (_beside_horovod): (the buffers it
    kept, whether each averaged gradient is the same bits as Horovod's)."""
    opt, ours, twin = _beside_horovod(_WithFp64, "fp32")
    return sorted(opt._ex.kept), [torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), twin.parameters())]


@pytest.mark.mpi
def test_a_tensor_that_cannot_share_a_groups_fp32_buffer_is_averaged_by_itself_as_horovod_does():
    for flat, same in run_ranks("tests.test_uncoded:body_optimizer_mixed_fp32_bucket", np=2, timeout=120):
        # the fp32 tensors (the bucket's and the never-coded ones that join it) in one buffer, the fp64 one by itself
        assert flat == [("fp32", "bucket.0")] and all(same), (flat, same)
