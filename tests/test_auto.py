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
from tests.mpi_harness import free_port, run_ranks, run_ranks_failing


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
    from tests.test_ddp import _close_gloo, _init_gloo

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


def _beside_ddps_own(port, own_hook=None, **options):
    """The hook (TernGradState.register) with transport="auto" on a link so fast that its plan sends every bucket
    uncoded (unless `options` name another link_gbps), and TernGrad's `options`, beside DDP's own C++ allreduce (or
    `own_hook`, a DDP hook of the default group): (its state, train) where train(step) trains both models a step from
    the hooked one's parameters, on the same batches, and says whether every gradient is DDP's bits
    (train.grads: the step's gradients by name, (the hook's, DDP's))."""
    from hvd_terngrad.ddp import TernGradState
    from tests.test_ddp import _init_gloo

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
    from tests.test_ddp import _close_gloo

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
    for out in run_ranks("tests.test_auto:body_hook_uncoded_is_ddps_own", np=np, timeout=120, args=(free_port(), wire)):
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
    from tests.test_ddp import _close_gloo

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
    res = run_ranks("tests.test_auto:body_trial_with_cpp", np=2, timeout=120,
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
    from tests.test_ddp import _close_gloo, _init_gloo

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
    results = run_ranks("tests.test_auto:body_ddp_uncoded_faults", np=2, timeout=120,
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
    results = run_ranks("tests.test_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                        args=(free_port(), "nan", 0.0, layout, native))
    for step, message in results:
        assert step == PLAN_STEP + 1
        assert "gradient in 'body.4.weight' on rank 1 at step" in message and "beyond ±1.7e+38" in message, message


@pytest.mark.mpi
def test_a_nan_in_the_hooks_fp16_averages_names_the_tensor_and_the_rank_on_every_rank():
    """The plan in fp16, several buckets: the hook launches each bucket's average itself and the worker finishes
    them after the step's last launch, the non-finite flags' collective among them, in bucket order."""
    results = run_ranks("tests.test_auto:body_ddp_uncoded_faults", np=2, timeout=120,
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
    for steps in run_ranks("tests.test_auto:body_ddp_uncoded_faults", np=2, timeout=120,
                           args=(free_port(), "propagate", 0.0, "buckets", native)):
        assert steps == [(False, True)] * (PLAN_STEP + 1) + [(True, False), (False, True)]


@pytest.mark.mpi
@pytest.mark.parametrize("native", [False, True], ids=["python", "cpp"])
def test_the_hooks_own_uncoded_average_fails_in_bounded_time_when_a_rank_never_joins(native):
    if native:
        _needs_cpp_hook()
    msg = run_ranks_failing("tests.test_auto:body_ddp_uncoded_faults", np=2, within=45,
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
    from tests.test_ddp import _close_gloo, _init_gloo

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
    for rank, out in enumerate(run_ranks("tests.test_auto:body_cpp_failed_step", np=2, timeout=120,
                                         args=(free_port(),))):
        assert out[:bad] == [None] * bad and out[bad + 1:] == [None, None], out
        assert "CollectiveTimeoutError" in out[bad] and f"failed on rank {rank} at step {bad}" in out[bad], out[bad]


def _needs_cpp_hook():
    """The hook's C++ path is built wherever torch is there at build time (setup.py), as it is for these tests:
    missing, it is a failure, not a skip."""
    from hvd_terngrad import _ddp_hook  # noqa: F401


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
