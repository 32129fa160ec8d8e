"""transport="auto" codes a group only where the cost model says coding pays (hvd_terngrad.auto): the rule, the
measurement every rank agrees on, the uncoded average, and the three front ends on real ranks."""
import statistics

import pytest
import torch

import hvd_terngrad.auto as auto
from hvd_terngrad.auto import PLAN_STEP, TRIAL_PAIRS, AutoPlan, exposed, plan
from hvd_terngrad.collectives.loopback import LoopbackWorld, horovod_average
from hvd_terngrad.commcost import Link
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.pipeline import Pipeline, exchange
from tests.golden import frontends as G
from tests.mpi_harness import free_port, run_ranks


def test_the_plan_codes_nothing_where_the_float_average_hides_behind_backward():
    costs = {"a": (0.010, 0.001, 0.002), "b": (0.020, 0.002, 0.004)}  # (uncoded, coded, codec) seconds
    assert plan(costs, window=0.030) == set()  # 30 ms of link time hides in 30 ms of backward
    assert plan(costs, window=0.0) == {"a", "b"}  # nothing hides: both save more link time than they code
    # 25 ms window, 30 ms of link: coding a (saves 9 ms for 2 ms of codec) leaves nothing exposed
    assert plan(costs, window=0.025) == {"a"} and exposed(costs, {"a"}, 0.025) == pytest.approx(0.002)
    assert exposed(costs, set(), 0.025) == pytest.approx(0.005)
    # coding that costs more than the link time it saves: never
    assert plan({"a": (0.010, 0.001, 0.012)}, window=0.0) == set()
    # a coded transport slower than the float allreduce (small groups: latency): never, whatever the codec
    assert plan({"a": (0.001, 0.002, 0.0)}, window=0.0) == set()


def test_the_plan_codes_first_what_saves_most_link_time_per_codec_second():
    costs = {"big": (0.040, 0.004, 0.010), "cheap": (0.010, 0.001, 0.001)}
    assert plan(costs, window=0.041) == {"cheap"}  # 50 ms of link: the 9 ms "cheap" saves suffice
    assert plan(costs, window=0.0) == {"big", "cheap"}


@pytest.fixture
def untried(monkeypatch):
    """The model's plan in force at once, untried: the tests below are about the plan, not about timing."""
    monkeypatch.setattr(auto, "TRIAL_PAIRS", 0)


def _steps(p: AutoPlan, seconds: list[float], size=4, gbps=100.0, carried: dict | None = None) -> None:
    """Steps of one bucket of 10^6 elements through `p` alone, step k taking seconds[k]; the carried values
    agreed as if every rank carried this rank's (and kept in `carried`, by step, where given)."""
    clock = 0.0
    for took in seconds:
        clock += took
        p.arrived("bucket.0", 10**6, 1, 16, ready=clock, encoded=None)
        if p.carrying:
            values = p.carried()
            if carried is not None:
                carried[p.steps] = values
            p.agree(values)
        p.step_done(2e-3, size, Link(gbps * 1e9 / 8), int8=False, now=clock)


def trial(kinds: list[float], before: float = 0.010, drift: float = 0.0, preferred: tuple[int, ...] = ()
          ) -> list[float]:
    """Step seconds of a whole trial: PLAN_STEP coded steps of `before`, then the rounds, where kind k (0:
    coded, k: the k-th plan) takes kinds[k], plus drift times the step's place in the trial; after the first
    pair of rounds a coded step, and the rounds of the kinds left (whose faster step of the first pair was
    within PRUNE of the fastest kind's, and where the `preferred` kinds are the default, AHEAD of the faster of
    them) where more than one is; then the verdict's step and 2 past it. The plans end with the fp32 plan and
    the other wire's (or with the fp32 plan alone, where it is the only plan: the front end's preferred wire),
    and a round runs the fp32 plan last."""
    fp32 = len(kinds) - 2 if len(kinds) > 2 else 1
    turns = [k for k in range(len(kinds)) if k != fp32] + [fp32]

    def rounds(order: list[int], n: int, start: int) -> tuple[list[float], list[int]]:
        ks = [k for r in range(n) for k in (order if r % 2 == 0 else reversed(order))]
        return [kinds[k] + drift * (start + j) for j, k in enumerate(ks)], ks

    first, ks = rounds(turns, 2, 0)
    faster = {k: min(t for t, kk in zip(first, ks) if kk == k) for k in turns}
    ahead = auto.AHEAD * min(faster[k] for k in preferred) if preferred else float("inf")
    left = [k for k in turns
            if faster[k] <= auto.PRUNE * min(faster.values()) and (k in preferred or faster[k] < ahead)]
    rest = [kinds[0]] + rounds(left, 2 * (TRIAL_PAIRS - 1), len(first) + 1)[0] if len(left) > 1 else []
    return [before] * PLAN_STEP + first + rest + [kinds[0]] * 3


UNCODED_TRIALS = [{"coding": [], "transport": None, "uncoded": "fp32"},
                  {"coding": [], "transport": None, "uncoded": "fp16"}]  # the model's plan of one uncoded bucket


def test_the_model_plan_is_kept_only_where_its_steps_were_faster():
    fast, slow, warming = AutoPlan(), AutoPlan(), AutoPlan()
    # coded steps take 10 ms; the tried steps, uncoded in fp32, 5 ms or 20 ms (in fp16, 21 ms)
    _steps(fast, trial([0.010, 0.005, 0.021]))
    _steps(slow, trial([0.010, 0.020, 0.021]))
    # the coded steps before the trial still warming up (30 ms): they do not count; the trial's coded steps 10 ms,
    # the tried ones 12 ms
    _steps(warming, trial([0.010, 0.012, 0.012], before=0.030))
    for p in (fast, slow, warming):  # 100 Gbit/s, a 2 ms codec: the model codes nothing, its plan tried twice
        assert p.decided and p.summary()["tried"] == UNCODED_TRIALS
    assert fast.trial.verdict == pytest.approx((0.010, 0.005, 0.021)) and fast.uncoded("bucket.0") and fast.kept == 0
    assert fast.wire == "fp32" and fast.summary()["uncoded_wire_now"] == "fp32"
    assert slow.trial.verdict == pytest.approx((0.010, 0.020, 0.021))
    assert not slow.uncoded("bucket.0") and slow.kept is None
    assert warming.trial.verdict == pytest.approx((0.010, 0.012, 0.012)) and not warming.uncoded("bucket.0")


def test_the_trial_is_not_swayed_by_a_drift_of_the_machines_speed_or_by_a_spike():
    """The kinds take turns, and a kind's step is the median of its steps: a job still
    warming up (every step 0.5 ms shorter than the one before) favours no kind, where kinds tried one after
    another would favour the last (here fp16, 0.5 ms slower than fp32 on a steady machine); one step ten times
    too long moves one pair only."""
    warming, spiked = AutoPlan(), AutoPlan()
    _steps(warming, trial([0.030, 0.025, 0.0255], drift=-0.0005))
    seconds = trial([0.010, 0.009, 0.0095])
    # the fp32 step of the second pair's second round (fp32, fp16, coded), after the first pair and the pruning step
    seconds[PLAN_STEP + 3 * 3 + 1] = 0.090
    _steps(spiked, seconds)
    for p in (warming, spiked):
        assert p.decided and p.summary()["tried"] == UNCODED_TRIALS
        assert p.uncoded("bucket.0") and p.wire == "fp32", p.trial.verdict
    fp32, fp16 = warming.trial.verdict[1:]
    assert fp16 - fp32 == pytest.approx(0.0005)  # the drift cancels within each pair


def test_a_kind_far_behind_after_the_first_pair_is_tried_no_more():
    """Coded steps 1.56x the uncoded ones over the first pair (NCF on a fast link): the pruning step leaves the
    two wires, which take turns for the other pairs without a coded step, and the faster is kept; the trial is
    4 steps shorter, 3 of them coded. Where one kind is left, it is kept on the pruning step itself."""
    pruned, alone, even = AutoPlan(), AutoPlan(), AutoPlan()
    _steps(pruned, trial([0.0075, 0.0050, 0.0048]))
    _steps(alone, trial([0.0150, 0.0050, 0.0100]))  # fp16 2x fp32: one kind left after the first pair
    _steps(even, trial([0.0100, 0.0095, 0.0098]))  # within PRUNE of each other: every kind to the end
    assert pruned.summary()["left_after_first_pair"] == [2, 1] and pruned.kept == 1 and pruned.wire == "fp16"
    assert pruned.trial.verdict == pytest.approx((0.0075, 0.0050, 0.0048))  # the coded kind's: its first pair's
    assert pruned.trial.verdict_step == pruned.trial.pruning_step + 1 + 2 * 2 * (TRIAL_PAIRS - 1)
    assert even.trial.verdict_step == even.trial.pruning_step + 1 + 2 * 3 * (TRIAL_PAIRS - 1)
    assert even.trial.verdict_step == pruned.trial.verdict_step + 4
    coded = [s for s in range(pruned.trial.verdict_step + 1) if pruned.trial.kind(s) in (0, None) and s >= PLAN_STEP]
    assert len(coded) == 4  # the first pair's 2, the pruning step, the verdict's (7 without pruning: `even`)
    assert alone.summary()["left_after_first_pair"] == [1] and alone.kept == 0 and alone.wire == "fp32"
    assert alone.trial.verdict_step == alone.trial.pruning_step == PLAN_STEP + 2 * 3 and alone.decided
    assert alone.summary()["step_noise"] is None and even.summary()["step_noise"] >= 0.0  # no kinds to compare: none
    assert even.summary()["left_after_first_pair"] == [0, 2, 1] and even.kept == 0 and even.wire == "fp32"


def test_a_pause_on_one_step_of_the_first_pair_prunes_nothing():
    """An evaluation between two steps (lenet's every 7 steps, in benchmarks.time_to_accuracy) lands on one
    kind's step: 25 times its length. Its other step of the pair is as fast as the others', so every kind
    takes its turns to the end, and the median of its steps keeps the pause out of the verdict; so it does
    where a pause every 7 steps falls on the same kind in two pairs of three."""
    p = AutoPlan()
    seconds = trial([0.010, 0.0095, 0.0098])
    seconds[PLAN_STEP + 3] = 0.250  # the fp32 plan's step of the first pair's second round (fp32, fp16, coded)
    _steps(p, seconds)
    assert p.summary()["left_after_first_pair"] == [0, 2, 1] and p.kept == 0 and p.wire == "fp32"
    assert p.trial.verdict == pytest.approx((0.010, 0.0095, 0.0098))
    every7 = AutoPlan()  # lenet in benchmarks.time_to_accuracy: an evaluation before steps 7, 14 and 21
    seconds = trial([0.010, 0.0095, 0.0098])
    for s in (7, 14, 21):
        seconds[s] += 0.250
    _steps(every7, seconds)
    assert [every7.trial.kind(s) for s in (7, 14, 21)] == [1, 1, 2]  # the fp32 plan twice
    assert every7.kept == 0 and every7.trial.verdict == pytest.approx((0.010, 0.0095, 0.0098))


def test_pauses_are_left_out_of_a_kinds_step_and_coding_against_the_model_must_be_clearly_faster():
    """Lenet's evaluations before steps 7 and 14 land on the fp32 plan's steps. Its other four take 9.0, 9.4,
    9.8 and 10.2 ms (the machine's noise), the coded steps 9.5: the median of all six, 10.0 ms, put the plan
    behind coding; without the pauses it is 9.6, and coding, 1% faster, is within MARGIN of the model's side
    (at 100 Gbit/s the model codes nothing: its plan, in either wire), which is kept. Coding 10% faster is
    kept. Between the plan's wires the trial's fastest is kept: fp16 3% faster."""
    fp32_steps = [6, 7, 13, 14, 19, 20]  # three kinds: (coded, fp16, fp32) and back, twice, and again after pruning
    noisy, coding, wire = AutoPlan(), AutoPlan(), AutoPlan()
    for p, (coded, fp16) in ((noisy, (0.0095, 0.0099)), (coding, (0.0086, 0.0099)), (wire, (0.0095, 0.0093))):
        seconds = trial([coded, 0.0096, fp16])
        for i, took in zip(fp32_steps, (0.0090, 0.2596, 0.0094, 0.2596, 0.0098, 0.0102)):
            seconds[i] = took
        _steps(p, seconds)
        assert [p.trial.kind(i) for i in fp32_steps] == [1] * 6 and p.summary()["left_after_first_pair"] == [0, 2, 1]
        assert p.summary()["model_side"] == [1, 2]
    assert noisy.trial.verdict[1] == pytest.approx(0.0096) and noisy.kept == 0 and noisy.wire == "fp32"
    assert statistics.median(noisy.trial.times[1]) == pytest.approx(0.0100)  # what the median of all six made of it
    assert coding.kept is None and coding.coded is None
    assert wire.kept == 1 and wire.wire == "fp16"


def _noisy(kinds: list[float], spread: float, preferred: tuple[int, ...] = ()) -> list[float]:
    """trial(kinds), its rounds' steps each moved by up to +-spread, in a pattern that favours no kind."""
    w = [-1, 1, -0.5, 0.5, 0, -0.25, 0.25, 0.75, -0.75]
    steps = trial(kinds, preferred=preferred)
    return [t * (1 + spread * w[i % len(w)]) if i >= PLAN_STEP else t for i, t in enumerate(steps)]


def test_a_kind_off_the_default_is_kept_only_where_clearly_faster_than_the_trials_noise():
    """The default kind is the model's side (at 100 Gbit/s it codes nothing: its plan), and there the plan in the
    wire the front end prefers, if any, which is then the only plan tried. Where each step moves by up to 12%
    (lenet on the fast profile, 4 ranks on 2 cores), coding 5.6% faster by its median is within what six steps
    a kind can mistake, and the preferred wire is kept; where the steps move by 2%, MARGIN alone applies and
    coding is kept. Without a preferred wire both wires' plans are tried, and MARGIN alone applies however noisy
    the trial: coding is kept, and between the plan's wires the faster."""
    def kept(kinds, spread, prefer=None):
        p = AutoPlan()
        p.prefer = prefer or ()
        _steps(p, _noisy(kinds, spread, preferred=(1,) if prefer else ()))
        assert p.summary()["tried"] == UNCODED_TRIALS[:1 if prefer else 2]
        assert p.summary()["left_after_first_pair"] == ([0, 1] if prefer else [0, 2, 1])
        assert p.summary()["model_side"] == ([1] if prefer else [1, 2])
        assert p.summary()["step_noise"] == p.trial.noise and p.summary()["preferred_wires"] == list(prefer or ())
        return p

    quiet, noisy = kept([0.0088, 0.0096], 0.02, ("fp32",)), kept([0.0088, 0.0096], 0.12, ("fp32",))
    assert quiet.trial.noise == pytest.approx(0.007, abs=0.002) and noisy.trial.noise == pytest.approx(0.045, abs=0.005)
    assert noisy.trial.verdict[0] < (1 - auto.MARGIN) * noisy.trial.verdict[1]  # beyond MARGIN, within the noise
    assert quiet.kept is None and noisy.kept == 0  # coded where steady; the preferred fp32 plan if not
    assert kept([0.0088, 0.0096, 0.0099], 0.12).kept is None  # against the model's side alone, MARGIN
    assert kept([0.0099, 0.0096, 0.0088], 0.12).kept == 1


@pytest.mark.parametrize("coded,left", [(0.0097, [1]), (0.0090, [0, 1])])
def test_a_kind_not_ahead_of_the_preferred_default_after_the_first_pair_is_tried_no_more(coded, left):
    """Where the model codes nothing and the front end prefers the fp32 plan's wire (the DDP hook's C++ path), coding
    3% faster on the first pair is not AHEAD of it by MARGIN: it is tried no more, and the fp32 plan is kept on the
    pruning step, after 3 coded steps of the trial instead of 8. Coding 10% faster goes on to the verdict (and,
    in a trial without noise, is kept there). Without
    a preferred wire (Horovod), coding 3% faster is not pruned: between the model's wires, the fastest is kept."""
    p = AutoPlan()
    p.prefer = ("fp32",)
    _steps(p, trial([coded, 0.0100], preferred=(1,)))
    pruned = left == [1]
    assert p.summary()["left_after_first_pair"] == left and p.decided
    assert p.kept == (0 if pruned else None)  # coding 10% faster, noiseless: beyond MARGIN, kept
    coded_steps = [s for s in range(PLAN_STEP, p.trial.verdict_step + 1) if p.trial.kind(s) in (0, None)]
    assert p.trial.verdict_step == (PLAN_STEP + 4 if pruned else 17) and len(coded_steps) == (3 if pruned else 8)
    horovod = AutoPlan()
    _steps(horovod, trial([coded, 0.0100, 0.0104]))
    assert horovod.summary()["left_after_first_pair"] == [0, 2, 1]


@pytest.mark.parametrize("coded,bf16,left,kept", [(0.0097, 0.0096, [2, 1], 1), (0.0097, 0.0102, [2, 1], 0),
                                                   (0.0085, 0.0096, [0, 2, 1], None)])
def test_between_the_front_ends_preferred_wires_the_faster_is_kept_and_coding_must_be_ahead_of_it(coded, bf16, left,
                                                                                                  kept):
    """The DDP hook's C++ path runs the plan in fp32 and in bf16 (half the bytes for two passes, which the model
    does not weigh): where the model codes nothing, both are tried, the faster is kept with no margin (the front
    end prefers neither), and coding goes on past the first pair only where AHEAD of the faster of them, and is
    kept only where clearly faster than it."""
    p = AutoPlan()
    p.prefer = ("fp32", "bf16")
    _steps(p, trial([coded, 0.0100, bf16], preferred=(1, 2)))
    assert p.summary()["tried"] == [{"coding": [], "transport": None, "uncoded": w} for w in ("fp32", "bf16")]
    assert p.summary()["left_after_first_pair"] == left and p.decided and p.kept == kept
    assert p.wire == ("fp32" if kept is None else ("fp32", "bf16")[kept])
    assert p.uncoded("bucket.0") == (kept is not None)
    assert p.trial.verdict_step == (19 if left == [2, 1] else 23)


def test_against_the_models_side_margin_alone_applies_however_noisy_the_trial():
    """Horovod's NCF at 1 Gbit/s: the model codes every group, and the fp16 plan steps faster than coding, by more
    than MARGIN, in a trial whose steps spread by about 23%. The model's side is a judgement the trial is there to
    check, so the plan is kept; two standard errors of that noise (about 33%) kept coding there on 4 seeds of 10,
    where the fp16 plan stepped 22-32% faster."""
    p = AutoPlan()
    _steps(p, _noisy([0.0077, 0.0081, 0.0060], 0.30), size=2, gbps=0.008)
    assert p.summary()["model_side"] == [0] and p.summary()["left_after_first_pair"] == [0, 2]
    assert p.trial.noise == pytest.approx(0.23, abs=0.02) and p.trial.verdict[2] < 0.95 * p.trial.verdict[0]
    assert p.kept == 1 and p.wire == "fp16" and p.uncoded("bucket.0")


@pytest.mark.parametrize("prefer,plans", [((), 2), (("fp32",), 1), (("fp32", "bf16"), 2)])
def test_the_carried_values_are_the_wire_formats(prefer, plans):
    """docs/wire-format.md, "9. Auto: uncoded groups, and the measurement the scalers carry": step 3 carries four
    values, the wires offered both ways (a bit each: fp32 1, fp16 2, bf16 4); with k kinds (coding and each plan),
    the pruning step (8 or 10) k values, each kind's faster step of the first pair; the verdict (17 or 23, none
    pruned) k + 1, each kind's step and the noise."""
    p, carried = AutoPlan(), {}
    p.prefer = prefer
    _steps(p, trial([0.009, 0.0100, 0.0101][:1 + plans], preferred=tuple(range(1, 1 + len(prefer)))), carried=carried)
    k = 1 + plans
    assert {s: len(v) for s, v in carried.items()} == {PLAN_STEP - 1: 4, 3 + 2 * k + 1: k, {2: 17, 3: 23}[k]: k + 1}
    offered = {(): 0.0, ("fp32",): 1.0, ("fp32", "bf16"): 5.0}[prefer]
    assert carried[PLAN_STEP - 1][2:] == [offered, -offered]
    verdict = carried[{2: 17, 3: 23}[k]]
    assert verdict[:k] == pytest.approx(list(p.trial.verdict)) and verdict[k] == p.trial.noise


def test_the_pruning_step_carries_the_same_values_in_every_group():
    """Groups of one step carry alike whether or not an earlier group's values came back (and pruned) already:
    a rank's groups, and the ranks, stay in agreement on the vector's length and values."""
    p = AutoPlan()
    _steps(p, trial([0.0150, 0.0050, 0.0049])[:PLAN_STEP + 6])  # through the first pair
    assert p.steps == p.trial.pruning_step and p.carrying
    before = p.carried()
    p.agree(before)  # the first group's values back: the coded kind pruned
    assert p.trial.left == [2, 1] and p.carried() == before and p.carrying


def test_where_the_model_codes_everything_fp32_is_tried_and_kept_only_if_faster():
    """2 ranks at 8 Mbit/s: the model codes the bucket (with the allgather); every group uncoded is tried, and
    kept only where more than MARGIN faster than coding, the model's side."""
    faster, slower, close = AutoPlan(), AutoPlan(), AutoPlan()
    _steps(faster, trial([0.010, 0.008, 0.009]), size=2, gbps=0.008)
    _steps(slower, trial([0.010, 0.012, 0.011]), size=2, gbps=0.008)
    _steps(close, trial([0.010, 0.0098, 0.0097]), size=2, gbps=0.008)
    for p in (faster, slower, close):
        assert p.decided and p.summary()["tried"] == UNCODED_TRIALS and p.summary()["model_side"] == [0]
    assert faster.uncoded("bucket.0") and faster.summary()["uncoded_now"]
    assert not slower.uncoded("bucket.0") and slower.coded is None and slower.transport is None
    assert close.trial.verdict == pytest.approx((0.010, 0.0098, 0.0097)) and close.coded is None


def test_where_the_model_codes_with_the_sharded_transport_the_allgather_and_fp32_are_tried():
    """4 ranks at 8 Mbit/s: the model codes the bucket with the sharded transport; the allgather is tried, then
    every group uncoded in fp32 and in fp16, in turn with the coded steps, and the fastest of the four kinds is
    kept."""
    runs = {"allgather": (0.008, 0.009, 0.009), "fp32": (0.009, 0.008, 0.0085), "fp16": (0.009, 0.009, 0.007),
            "sharded": (0.011, 0.012, 0.012)}
    plans = {}
    for kept, (allgather, fp32, fp16) in runs.items():
        p = plans[kept] = AutoPlan()
        _steps(p, trial([0.010, allgather, fp32, fp16]), gbps=0.008)
        assert p.decided and p.summary()["tried"] == [{"coding": "every group", "transport": "allgather"},
                                                      *UNCODED_TRIALS]
        assert p.trial.verdict == pytest.approx((0.010, allgather, fp32, fp16))
    assert plans["allgather"].transport == "allgather" and not plans["allgather"].uncoded("bucket.0")
    assert plans["fp32"].uncoded("bucket.0") and plans["fp32"].transport is None and plans["fp32"].wire == "fp32"
    assert plans["fp16"].uncoded("bucket.0") and plans["fp16"].wire == "fp16"
    assert plans["sharded"].coded is None and plans["sharded"].transport is None


def _train(gbps, steps, nan_at=None, change=None, **options):
    """Two groups through 4 loopback ranks for `steps` steps: each step's (step, key, groups, averages, the
    gradients sent). change(step, named), where given, alters a step's tensors of every rank in place, and
    returns the groups as (key, slice of the tensors), or None for the two."""
    n = 4
    cfg = TernGradConfig(transport="auto", link_gbps=gbps, **options)
    pipes = [Pipeline(cfg, c) for c in LoopbackWorld(n).ranks()]
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        named = [[(f"t{i}", torch.randn(3000 + i, generator=g)) for i in range(3)] for _ in range(n)]
        if nan_at == step:
            named[2][1][1][7] = float("nan")
        groups = change(step, named) if change is not None else None
        for key, part in groups or (("bucket.0", slice(0, 2)), ("bucket.1", slice(2, 3))):
            sent = [[(name, t.clone()) for name, t in nm[part]] for nm in named]  # the residuals go into these
            groups, averages = exchange(pipes, key, sent)
            out.append((step, key, groups, averages, [nm[part] for nm in named]))
        for p in pipes:
            p.next_step()
    return pipes, out


def test_on_a_fast_link_auto_measures_in_fp32_then_sends_fp32_and_every_rank_plans_alike(untried):
    """The measured steps send fp32 and rehearse the coding, whose error feedback is its own: every step's average
    is Horovod's float average bit for bit, no residual is left, and every rank agrees on the codec's seconds."""
    pipes, out = _train(1000.0, PLAN_STEP + 2, error_feedback=True)
    assert all(p.auto.coded == set() for p in pipes)  # every rank the same plan, from the agreed measurement
    agreed = {p.auto.agreed for p in pipes}
    assert len(agreed) == 1 and next(iter(agreed))[0] > 0  # the slowest codec seconds per element, on every rank
    assert all(p.rehearsal is None and not p.coder.feedback.worker for p in pipes)  # the rehearsal's copies went
    for step, key, groups, averages, named in out:
        assert {g.transport.name for g in groups} == {"fp32"}, (step, key)
        exact = horovod_average([torch.cat([t for _, t in nm]) for nm in named])
        assert all(torch.equal(torch.cat(a), exact) for a in averages), (step, key)


def test_a_measured_step_trains_in_fp32_and_rehearses_its_coding_on_the_side():
    """Two measured steps with error feedback on a slow link: what travels is the fp32 average (its bytes in the
    stats, no coded tensor); the rehearsal coded every group into residuals of its own, and the second step
    (the first after the warm-up) measured its seconds over every coded element."""
    pipes, _ = _train(0.01, 2, error_feedback=True)
    for p in pipes:
        assert p.rehearsal is not None and p.rehearsal.auto is None
        assert set(p.rehearsal.coder.feedback.worker) == {"t0", "t1", "t2"} and not p.coder.feedback.worker
        last = p.stats.last
        assert (last.tensors_coded, last.tensors_float, last.time_encode) == (0, 3, 0.0)
        assert last.bytes_sent == 4 * (3000 + 3001 + 3002) and p.rehearsal.stats.current.bytes_sent > 0
        assert p.auto.coded_numel == 3000 + 3001 + 3002 and p.auto.codec_s > 0 and len(p.auto.windows) == 1


def test_the_step_that_carries_the_measurement_rehearses_nothing_and_still_plans_every_group(untried, monkeypatch):
    """Nothing reads the codec time of the step that carries the measurement, so it does not rehearse (on lenet
    on the DDP hook, about 3 ms of codec in a step of 30); its plan knows the groups from the step before: at 10
    Mbit/s the model picks the sharded transport for them, and so the allgather is the plan in force."""
    rehearsed, real = set(), Pipeline.rehearse

    def spy(self, key, named, ready):
        rehearsed.add(self.step)
        real(self, key, named, ready)

    monkeypatch.setattr(Pipeline, "rehearse", spy)
    pipes, _ = _train(0.01, PLAN_STEP + 1)
    assert sorted(rehearsed) == list(range(PLAN_STEP - 1))
    assert all(p.auto.decided and p.auto.coded is None and p.auto.transport == "allgather" for p in pipes)


def _offered(offers: list[tuple[str, ...]]) -> list[AutoPlan]:
    """The measured steps of ranks whose front ends offer `offers` at each step's end, at 100 Gbit/s (the model
    codes nothing), the carried values agreed by their Max over the ranks."""
    plans, clock = [AutoPlan() for _ in offers], 0.0
    for _ in range(PLAN_STEP):
        clock += 0.010
        for p in plans:
            p.arrived("bucket.0", 10**6, 1, 16, ready=clock, encoded=None)
        if plans[0].carrying:
            agreed = [max(values) for values in zip(*(p.carried() for p in plans))]
            for p in plans:
                p.agree(agreed)
        for p, offer in zip(plans, offers):
            p.step_done(2e-3, 4, Link(100e9 / 8), int8=False, now=clock)
            p.offer(offer)
    return plans


def test_where_the_model_codes_nothing_the_preferred_wires_plans_alone_are_tried_if_every_rank_offered_them():
    """The DDP hook runs the plan on its C++ path in fp32 and in bf16, and offers both. Where the model codes
    nothing, those plans are the default, and the fp16 plan, in Python, is not tried: it costs a step what any
    Python hook does, which six steps a kind cannot resolve against that path (on `fast` it was kept on 2 seeds of
    70, which trained at 0.92x and 0.95x DDP FP32), and its turns cost the trial's time. The offer rides with the
    measurement and is taken only where every rank made the same one: the kinds tried set the trial's steps, and
    ranks that tried different kinds would send different collectives. An offer after the plan changes nothing."""
    native = ("fp32", "bf16")
    both, fp32 = _offered([native, native]), _offered([("fp32",), ("fp32",)])
    unlike = _offered([native, ()]) + _offered([native, ("fp32",)])
    assert all(p.prefer == native and [w for _, _, w in p.trials] == ["fp32", "bf16"] for p in both)
    assert all(p.trial.preferred == [1, 2] and p.trial.order == [0, 2, 1] for p in both)  # the fp32 plan last
    assert all(p.prefer == ("fp32",) and p.trials == [(set(), None, "fp32")] for p in fp32)
    assert all(p.prefer == () and [w for _, _, w in p.trials] == ["fp32", "fp16"] for p in unlike)
    assert len({p.trial.verdict_step for p in both + unlike}) == 1 < len({p.trial.verdict_step for p in both + fp32})
    both[0].offer(())
    assert both[0].prefer == native


def test_on_a_slow_link_auto_keeps_coding(untried):
    """10 Mbit/s: every group coded once measured (the measured steps in fp32), with the allgather, the first plan
    it tries where the model's choice is the sharded transport (untried here: in force at once), on every rank
    alike."""
    pipes, out = _train(0.01, PLAN_STEP + 2)
    assert all(p.auto.decided and p.auto.coded is None and p.auto.transport == "allgather" for p in pipes)
    names = {(step, g.transport.name) for step, _, groups, _, _ in out for g in groups}
    assert names == {(s, "fp32" if s < PLAN_STEP else "allgather") for s in range(PLAN_STEP + 2)}


def test_without_a_shared_scaler_nothing_carries_the_measurement_and_auto_keeps_coding(untried):
    pipes, out = _train(1000.0, PLAN_STEP + 2, share_scaler=False)
    assert all(p.auto.coded is None for p in pipes)
    assert all(g.transport.name == "allgather" for _, _, groups, _, _ in out for g in groups)


@pytest.mark.parametrize("at", [1, PLAN_STEP], ids=["measured", "planned"])
def test_a_nan_in_an_uncoded_group_names_the_tensor_and_the_rank_on_every_rank(untried, at):
    """In a measured step too, where the rehearsal codes the NaN tensor first, and raises nothing."""
    pipes, out = _train(1000.0, at + 1, nan_at=at)
    step, key, groups, averages, _ = out[-2]  # bucket.0 of the last step: t1 is NaN on rank 2
    assert (step, key) == (at, "bucket.0") and groups[0].transport.name == "fp32"
    for p, g in zip(pipes, groups):
        assert [it.nonfinite_rank for it in g.items] == [-1, 2]
        with pytest.raises(NonFiniteGradientError, match=r"'t1' on rank 2 at step"):
            p.coder.raise_nonfinite(p.nonfinite(g))
    # a healthy group asks nothing more: no second collective
    assert not out[-1][2][0].handle.bad and out[-2][2][0].handle.bad == [1]


# ------------------------------------------------------------------------------------------
def body_frontends_auto(port):
    """DDP's hook, hvd_terngrad's optimizer and the stock compressor with transport="auto" on a link so fast
    that no group is worth coding: PLAN_STEP coded steps, then float averages."""
    import horovod.torch as hvd

    import hvd_terngrad
    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    from hvd_terngrad.ddp.averages import OwnAverages
    from tests.ddp.test_ddp import _close_gloo, _init_gloo

    hvd_terngrad.auto.TRIAL_PAIRS = 0  # the plan untried: this is about the front ends, not timing
    hvd.init()
    rank = _init_gloo(port)
    torch.set_num_threads(1)
    opts = {**G.COMMON, "transport": "auto", "link_gbps": 1000.0, "error_feedback": True}
    steps = PLAN_STEP + 2
    model = G.Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = TernGradState(model.named_parameters(), **opts)
    ddp.register_comm_hook(state, terngrad_hook)
    averaged_now, average_now = [], OwnAverages.start
    OwnAverages.start = lambda self, owner, bucket: averaged_now.append(bucket.index()) or average_now(self, owner,
                                                                                                       bucket)
    ref = G.Net()
    tg = hvd_terngrad.TernGrad(**opts)
    stock = G.Net()
    tg_stock = hvd_terngrad.TernGrad(stock.named_parameters(), **opts)
    runs = [(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)),
            (ref, hvd_terngrad.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                                    named_parameters=ref.named_parameters(), compression=tg)),
            (stock, hvd.DistributedOptimizer(torch.optim.SGD(stock.parameters(), lr=0.1),
                                             named_parameters=stock.named_parameters(), compression=tg_stock))]
    for step in range(steps):
        for net, o in runs:
            o.zero_grad()
            G.loss(net, rank, step).backward()
            o.step()
    assert averaged_now  # the hook averaged its buckets itself, without the worker thread
    plans = [p.auto.coded for p in (state.pipeline, tg.pipeline, tg_stock.pipeline)]
    floats = [p.stats.last.tensors_float for p in (state.pipeline, tg.pipeline, tg_stock.pipeline)]
    assert floats == [len(list(model.parameters()))] * 3  # every tensor counted (the optimizer's in one buffer)
    out = ([G.digest(m.parameters()) for m in (model, ref, stock)], plans, floats)
    del ddp, state
    _close_gloo()
    return out


@pytest.mark.mpi
def test_every_front_end_sends_float_averages_where_auto_says_coding_does_not_pay():
    res = run_ranks("tests.test_auto:body_frontends_auto", np=2, timeout=240, args=(free_port(),))
    for digests, plans, floats in res:
        assert plans == [set(), set(), set()]
        assert all(f > 0 for f in floats)
        assert digests[0] == digests[1] == digests[2]  # DDP, the optimizer and the stock path: the same bits
    assert res[0][0] == res[1][0]


def test_a_group_in_one_buffer_is_averaged_in_place_and_a_nan_there_still_names_its_rank(untried):
    n, steps = 4, PLAN_STEP + 2
    cfg = TernGradConfig(transport="auto", link_gbps=1000.0, min_numel=1)
    pipes = [Pipeline(cfg, c) for c in LoopbackWorld(n).ranks()]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        buffers = [torch.randn(5000, generator=g) for _ in range(n)]  # as a DDP bucket: views of one buffer
        if step == steps - 1:
            buffers[3][4000] = float("inf")
        exact = horovod_average(buffers)
        named = [[("a", b[:3000]), ("b", b[3000:])] for b in buffers]
        groups, averages = exchange(pipes, "bucket.0", named)
        for p in pipes:
            p.next_step()
    assert groups[0].transport.name == "fp32"
    assert all(a.data_ptr() == b[:3000].data_ptr() for (a, _), b in zip(averages, buffers))  # in place
    assert all(torch.equal(b[:3000], exact[:3000]) for b in buffers)
    assert all([it.nonfinite_rank for it in g.items] == [-1, 3] for g in groups)
