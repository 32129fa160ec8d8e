"""transport="auto", per group: code it, or send it uncoded (one average, in fp32 or in 16 bits), whichever makes
the step shorter. The cost model chooses what to try (plan), a timed trial chooses what to keep (Trial), AutoPlan
runs the steps, and the pipeline fixes each step's StepPlan from it (pipeline.StepPlan) for the front ends to ask.
Why each part is built so, with the measurements: docs/notes/auto.md.

The model, per group g, with commcost's formulas on the configured link (TernGradConfig.link()):

    uncoded_g   an fp32 ring allreduce of the group
    coded_g     the cheapest transport's seconds (transports.choose_transport) plus its scaler allreduce
    codec_g     measured seconds per coded element on this rank, times the group's elements
    exposed     max(0, sum of link seconds - window) + sum of codec seconds of the coded groups

where the window is the backward time communication hides behind. It codes the groups that save the most link
time per codec second first and keeps the prefix with the least exposed time (fewest coded on a tie): every
group uncoded where FP32's average hides, so as far as the model goes never slower than FP32. Groups whose
coded cost is not below their uncoded cost are never coded. The performance model's extrapolation
(benchmarks/perf_model.py) applies the same `plan`.

The steps:
- 0 .. PLAN_STEP-1: every group in fp32. Each rank rehearses its coding on all but the last (Pipeline.rehearse)
  and measures its codec seconds per element and its window; the last step's averages carry them in a Max
  allreduce, with the wires each rank's front end offers (AutoPlan.offer), and every rank makes the same plan.
- The trial: the kinds (every group coded as the model says; the plan with its uncoded groups in fp32, and in
  16 bits; where every group is uncoded and the front end has a faster path for it, that path's wires alone:
  AutoPlan.prefer) take turns, a step each, in TRIAL_PAIRS pairs of rounds, the second of a pair reversed, the
  coded kind first. After the first pair the kinds slower than PRUNE times the fastest go, and where the default
  is a preferred wire, those not AHEAD of it. At the verdict a kind's step is the median of its steps less those
  over PAUSE times its fastest, and the default kind (the model's side of coding; there, a preferred wire) is
  kept unless another is shorter by MARGIN and, against a preferred default, by CONFIDENCE standard errors of
  the trial's noise. Where the model codes every group, the plan tried is every group uncoded, and before it,
  where some group takes the sharded transport, every group on the allgather.
- The verdict's plan holds from then on.
The groups are known by their keys ("bucket.3", a tensor's name), the same on every rank; while a plan that
leaves groups uncoded is in force, a group it has not seen goes uncoded too. Without a shared scaler
(share_scaler=False) no scaler vector carries the verdict, and auto codes every group from the start.
"""
from __future__ import annotations

import math
import statistics
import time

from hvd_terngrad.commcost import Link, allreduce_time
from hvd_terngrad.transports import TRANSPORTS, choose_transport
from hvd_terngrad.transports.uncoded import FP32, UNCODED, WIRES

PLAN_STEP = 4  # steps sent in fp32 and measured before the plan; the last of them carries the measurement
TRIAL_PAIRS = 3  # pairs of rounds of the trial, a step of each kind (coded, each plan) a round
MAX_TRIALS = 1 + len(WIRES)  # plans tried at most (AutoPlan._plan; a front end offers no more wires than WIRES)
# after the first pair, a kind whose faster step took more than PRUNE times the fastest kind's is tried no more
# (docs/notes/auto.md, "PRUNE: the kinds far behind")
PRUNE = 1.5
# a kind's trial step leaves out its steps over PAUSE times its fastest (docs/notes/auto.md, "PAUSE: a pause is
# not a kind's speed")
PAUSE = 2.0
# a kind other than the default is kept only where its step is shorter by MARGIN and, against a preferred default,
# by CONFIDENCE standard errors of the trial's noise (docs/notes/auto.md, "MARGIN and CONFIDENCE: clearly faster")
MARGIN = 0.05
CONFIDENCE = 2.0
# where the default is a preferred wire, a kind not ahead of it by AHEAD on its faster step of the first pair is
# tried no more (docs/notes/auto.md, "AHEAD: ahead of the preferred path")
AHEAD = 1 - MARGIN


def _verdict_step(kinds: int, left: int | None = None) -> int:
    """The coded step that ends a trial of `kinds` kinds (coding and each plan, a step of each a round from
    PLAN_STEP on): after its first pair of rounds where more follow, a coded step that prunes the slow kinds
    (Trial._prune), then the remaining pairs of the `left` kinds (all of them: None), and the verdict. Where one
    kind is left, the pruning step is the verdict."""
    first = PLAN_STEP + 2 * kinds * min(TRIAL_PAIRS, 1)
    left = kinds if left is None else left
    return first if TRIAL_PAIRS <= 1 or left == 1 else first + 1 + 2 * left * (TRIAL_PAIRS - 1)


LAST_VERDICT_STEP = _verdict_step(1 + MAX_TRIALS)  # auto has decided after this step


def plan(costs: dict[str, tuple[float, float, float]], window: float) -> set[str]:
    """The keys of the groups to code. costs: key -> (uncoded link seconds, coded link seconds, codec seconds);
    window: the seconds of link time that hide behind backward (module docstring)."""
    worth = [k for k, (u, c, _) in costs.items() if c < u]
    worth.sort(key=lambda k: (-(costs[k][0] - costs[k][1]) / max(costs[k][2], 1e-12), k))
    link, codec = sum(u for u, _, _ in costs.values()), 0.0
    best, keep = max(0.0, link - window), 0
    for i, k in enumerate(worth, 1):
        u, c, cod = costs[k]
        link, codec = link - (u - c), codec + cod
        cost = max(0.0, link - window) + codec
        if cost < best:
            best, keep = cost, i
    return set(worth[:keep])


def exposed(costs: dict[str, tuple[float, float, float]], coded: set[str], window: float) -> float:
    """The seconds a plan adds to the step's compute: link time beyond the window, plus the coding."""
    link = sum(c if k in coded else u for k, (u, c, _) in costs.items())
    return max(0.0, link - window) + sum(costs[k][2] for k in coded)


def group_costs(numel: int, tensors: int, scaler_bytes: int, n_workers: int, link: Link, codec_s_per_element: float,
                int8: bool) -> tuple[float, float, float]:
    """(uncoded, coded, codec) seconds of one group of `numel` coded elements in `tensors` tensors."""
    t = choose_transport(numel, n_workers, link, int8=int8)
    coded = TRANSPORTS[t].seconds(numel, n_workers, link) + allreduce_time(scaler_bytes, n_workers, link)
    return FP32.seconds(numel, n_workers, link), coded, codec_s_per_element * numel


class Trial:
    """The timed trial of transport="auto" (module docstring), over its kinds by number: 0 every group coded as the
    model says, k the k-th plan tried (AutoPlan.trials). From PLAN_STEP on the kinds take turns, a step each, in
    rounds (`order`; the second round of a pair the other way round), and this rank times every step. Then:

        pruning_step        coded; carries each kind's faster step of the first pair, and the kinds within PRUNE
                            of the fastest (and ahead of a preferred default: AHEAD) are left (_prune); where
                            one is, it is kept
        2 * (TRIAL_PAIRS-1) rounds of the kinds left, as the first two
        verdict_step        coded; carries each kind's step, the median of its steps in the trial (_trial_step),
                            and the trial's noise; the default kind (_default) is kept unless the fastest kind
                            left is clearly faster (_clearly_faster)

    What each kind sends, and when the trial begins, are AutoPlan's: this class only times and judges.
    """

    __slots__ = ("order", "favoured", "preferred", "times", "left", "verdict", "noise")

    def __init__(self, order: list[int] | None = None, favoured: list[int] | None = None,
                 preferred: list[int] | None = None):
        self.order = order or [0]  # the kinds in a round's order (AutoPlan._try: no fp32 step after a coded one)
        self.favoured = favoured or []  # the kinds on the model's side of coding (MARGIN)
        self.preferred = preferred or []  # the kinds the front end runs on a faster path (AutoPlan.prefer)
        self.times: list[list[float]] = [[] for _ in self.order]  # this rank's step seconds of each kind
        self.left: list[int] | None = None  # the kinds tried after the first pair (_prune); None: every kind
        self.verdict: tuple[float, ...] | None = None  # each kind's step seconds, every rank alike
        self.noise: float | None = None  # the noisiest rank's trial spread (_trial_noise); None: unmeasured

    @property
    def verdict_step(self) -> int:
        """The coded step that carries the step times (past it, auto has decided)."""
        return _verdict_step(len(self.order), None if self.left is None else len(self.left))

    @property
    def pruning_step(self) -> int:
        """The coded step after the first pair of rounds, which carries each kind's faster step of it (where
        more pairs follow; else the verdict's step)."""
        return _verdict_step(len(self.order), 1)

    def kind(self, step: int) -> int | None:
        """The kind `step` is; None outside the rounds (the pruning step too). Round r runs the kinds in turn
        (after the pruning step, those left), or (r odd: the second of a pair) in reverse."""
        if not PLAN_STEP <= step < self.verdict_step or step == self.pruning_step:
            return None
        turns, i = self.order, step - PLAN_STEP
        if step > self.pruning_step:
            turns, i = self.left or turns, step - self.pruning_step - 1
        r, i = divmod(i, len(turns))
        return turns[-1 - i] if r % 2 else turns[i]

    def timed(self, step: int, took: float | None) -> None:
        """Step `step` took `took` seconds on this rank (None: unknown, the first step)."""
        kind = self.kind(step)
        if took is not None and kind is not None:
            self.times[kind].append(took)

    def carried(self, step: int) -> list[float]:
        """The values this rank carries on the pruning or the verdict step."""
        if step == self.pruning_step and TRIAL_PAIRS > 1:
            # each kind's faster step of the first pair: the same before and after _prune, in every group alike
            return [min(t[:2]) for t in self.times]
        return [_trial_step(t) for t in self.times] + [_trial_noise([self.times[k] for k in self._left()])]

    def agree(self, step: int, values: list[float]) -> None:
        """The carried values after the Max allreduce, each kind's step on the slowest rank: its faster step of
        the first pair, or its step over the trial and the noisiest rank's noise."""
        if step == self.pruning_step and TRIAL_PAIRS > 1:
            if self.left is None:
                self._prune(values)
            if step == self.verdict_step:  # one kind left: kept now
                self.verdict = tuple(values)
        else:
            *steps, self.noise = values
            self.verdict = tuple(steps)

    def kept(self) -> int:
        """The kind kept at the verdict: the default, unless the fastest kind left is clearly faster."""
        left = sorted(self._left())
        best, default = min(left, key=lambda k: self.verdict[k]), self._default(left)
        return best if self._clearly_faster(best, default) else default

    def _prune(self, firsts: list[float]) -> None:
        """The kinds left for the rest of the trial: those whose faster step of the first pair (on the slowest
        rank) was within PRUNE of the fastest kind's, and where the preferred kinds are the default's, ahead of
        the faster of them (AHEAD). Where one is left, this step is the verdict's."""
        fastest, p = min(firsts), [k for k in self.preferred if k in self.favoured]
        ahead = AHEAD * min(firsts[k] for k in p) if p else math.inf
        self.left = [k for k in self.order if firsts[k] <= PRUNE * fastest and (k in p or firsts[k] < ahead)]

    def _left(self) -> list[int]:
        """The kinds still tried (_prune): every kind before the pruning step, or where none was pruned."""
        return self.left if self.left is not None else list(range(len(self.order)))

    def _default(self, left: list[int]) -> int:
        """The kind kept unless another is clearly faster: among the kinds left on the model's side of coding
        (all of them where none is), the fastest of the front end's preferred kinds there, else the fastest."""
        ours = [k for k in left if k in self.favoured] or left
        return min([k for k in ours if k in self.preferred] or ours, key=lambda k: self.verdict[k])

    def _clearly_faster(self, a: int, b: int) -> bool:
        """Whether kind a's step is shorter than the default b's by more than the trial can mistake: MARGIN, and
        against the preferred kind CONFIDENCE standard errors (a median of n steps: about 1.2533 sigma / sqrt(n))."""
        if a == b:
            return False
        n_a, n_b = len(self.times[a]), len(self.times[b])  # the same on every rank
        error = 1.2533 * self.noise * math.sqrt(1 / n_a + 1 / n_b) if b in self.preferred else 0.0
        return self.verdict[a] < (1 - max(MARGIN, CONFIDENCE * error)) * self.verdict[b]


class AutoPlan:
    """One rank's measurement, plans and verdict for transport="auto" (module docstring). Its steps:

        0                   fp32, coding rehearsed (allocations warm up)
        1 .. PLAN_STEP-2    fp32, coding rehearsed; codec seconds per element and the window measured
        PLAN_STEP-1         fp32; a Max allreduce beside each group's average carries [seconds per element,
                            -window, the wire offered both ways]; the plans to try
        PLAN_STEP ..        the trial of coding against those plans, to its verdict (Trial)
    A plan is (the keys coded, None for every group; the one transport of the coded groups, None for the
    model's choice per group; the wire of the uncoded groups, transports.uncoded.WIRES).
    """

    __slots__ = ("steps", "groups", "codec_s", "coded_numel", "windows", "first", "last", "agreed", "prefer",
                 "trials", "trial", "step_end", "kept", "coded", "transport", "wire")

    def __init__(self):
        self.steps = 0  # steps this rank finished since the plan was made new (the same count on every rank)
        self.groups: dict[str, tuple[int, int, int]] = {}  # key -> (elements, tensors, scaler bytes), this step
        self.codec_s = 0.0  # encode + decode seconds of the measured steps
        self.coded_numel = 0  # elements coded in the measured steps
        self.windows: list[float] = []  # the measured steps' windows
        self.first: tuple[float, float] | None = None  # this step's first group: (ready, encode seconds so far)
        self.last: tuple[float, float] | None = None  # and its last
        self.agreed: tuple[float, float] | None = None  # (seconds per element, window), the same on every rank
        self.prefer: tuple[str, ...] = ()  # the wires whose plans the front end runs on a faster path: offered, agreed
        self.trials: list[tuple[set[str] | None, str | None, str]] = []  # the plans tried, in turn with coding
        self.trial = Trial()  # their timing and verdict
        self.step_end: float | None = None  # when the last step ended (time.perf_counter())
        self.kept: int | None = None  # the index of the tried plan kept; None: every group coded as the model says
        self.coded: set[str] | None = None  # the keys coded now; None: every group
        self.transport: str | None = None  # the transport of every coded group now; None: the model's choice
        self.wire = "fp32"  # what the uncoded groups travel in now

    def uncoded(self, key: str) -> bool:
        return self.coded is not None and key not in self.coded

    def summary(self) -> dict:
        """What the benchmarks record: the plans tried, the step seconds that judged them (where one kind was
        left after the first pair, or for a kind pruned there: its faster step of that pair), the kinds left
        after the first pair and those on the model's side (0: coded, k: the k-th plan tried), the wire the front
        end prefers, the trial's noise (None where not measured), what is in force."""
        trial = self.trial
        return {"tried": [{"coding": "every group" if c is None else sorted(c), "transport": t}
                          | ({} if c is None else {"uncoded": w}) for c, t, w in self.trials],
                "step_seconds_coded_tried": trial.verdict, "left_after_first_pair": trial.left,
                "model_side": trial.favoured, "preferred_wires": list(self.prefer), "step_noise": trial.noise,
                "kept": self.kept, "uncoded_now": self.coded is not None, "transport_now": self.transport,
                "uncoded_wire_now": self.wire if self.coded is not None else None}

    @property
    def decided(self) -> bool:
        return self.steps > self.trial.verdict_step

    @property
    def carrying(self) -> bool:
        """Whether this step's groups carry a measurement (in their scaler vectors on the trial's coded steps)."""
        return self.steps in (PLAN_STEP - 1, self.trial.pruning_step, self.trial.verdict_step)

    @property
    def rehearsing(self) -> bool:
        """Whether this step's groups rehearse their coding: the measured steps before the one that carries the
        measurement, whose own codec time nothing reads (it keeps the groups of the step before)."""
        return self.steps < PLAN_STEP - 1

    def offer(self, wires: tuple[str, ...]) -> None:
        """The wires whose plans the front end runs on a faster path on this rank (the first where the plan is
        untried: TRIAL_PAIRS = 0; none: ()), offered at each step's end until the plan takes the wires every rank
        offered (prefer)."""
        if self.steps < PLAN_STEP:
            self.prefer = tuple(wires)

    def arrived(self, key: str, numel: int, tensors: int, scaler_bytes: int, ready: float,
                encoded: float | None) -> None:
        """A group to code was ready at `ready` (time.perf_counter()); encoded: the step's encode seconds by
        then, where this thread both runs backward and codes (None: the coding runs on another thread)."""
        if self.steps >= PLAN_STEP:
            return
        self.groups[key] = (numel, tensors, scaler_bytes)
        self.first = self.first or (ready, encoded or 0.0)
        self.last = (ready, encoded or 0.0)

    def carried(self) -> list[float]:
        """The values this rank appends to its scaler vectors on a carrying step."""
        if self.steps >= PLAN_STEP:  # the trial's pruning or verdict step
            return self.trial.carried(self.steps)
        per_element = self.codec_s / self.coded_numel if self.coded_numel else 0.0
        offered = float(_wire_bits(self.prefer))  # both ways: the Max finds a mismatch
        return [per_element, -(sum(self.windows) / len(self.windows) if self.windows else 0.0), offered, -offered]

    def agree(self, values: list[float]) -> None:
        """The carried values after the Max allreduce (every group carries the same): the slowest codec and
        the shortest window, and the wires every rank offered (none where they differ: then no rank plans on a
        path one of them lacks); or, in the trial, each kind's step on the slowest rank (Trial.agree)."""
        if self.steps >= PLAN_STEP:
            self.trial.agree(self.steps, values)
            return
        self.agreed = (values[0], -values[1])
        highest, lowest = values[2], -values[3]
        self.prefer = self.prefer if highest == lowest and highest > 0 else ()  # all alike: this rank's offer

    def step_done(self, codec_s: float, size: int, link: Link, int8: bool, now: float | None = None) -> None:
        """The end of a step (codec_s: its rehearsals' encode + decode seconds): its measurement, the plan in
        force next, or the verdict. now: the time (tests)."""
        if self.decided:
            return
        now = time.perf_counter() if now is None else now
        s = self.steps
        self.trial.timed(s, None if self.step_end is None else now - self.step_end)  # _plan below makes a new trial
        self.step_end = now
        if 1 <= s < PLAN_STEP - 1 and self.groups:
            self.codec_s += codec_s
            self.coded_numel += sum(n for n, _, _ in self.groups.values())
            ready, enc = self.last[0] - self.first[0], self.last[1] - self.first[1]
            self.windows.append(max(0.0, ready - enc))
        if s == PLAN_STEP - 1:
            self._plan(size, link, int8)
        elif s == self.trial.verdict_step and self.trial.verdict is not None:
            best = self.trial.kept()
            self.kept = best - 1 if best else None
        self.steps += 1
        self._in_force(self.kept if self.decided else self._trying(self.steps))
        if self.steps != PLAN_STEP - 1:  # the carrying step rehearses nothing: the groups are this step's
            self.groups = {}
        self.first, self.last = None, None

    def _trying(self, step: int) -> int | None:
        """The index of the plan tried on `step`; None where every group is coded as the model says."""
        k = self.trial.kind(step)
        return k - 1 if k else None

    def _in_force(self, k: int | None) -> None:
        """Tried plan k in force (None: every group coded as the model says)."""
        self.coded, self.transport, self.wire = self.trials[k] if k is not None else (None, None, "fp32")

    def _plan(self, size: int, link: Link, int8: bool) -> None:
        """The plans to try, from the agreed measurement; none (every group coded from now on) where nothing
        was measured."""
        if self.agreed is None:
            self.steps = self.trial.verdict_step  # decided: every group coded as the model says
            return
        per_element, window = self.agreed
        costs = {k: group_costs(n, t, b, size, link, per_element, int8) for k, (n, t, b) in self.groups.items()}
        chosen = plan(costs, window)
        codes_all, trials = chosen == set(costs), []
        if codes_all:  # every group coded (module docstring)
            sharded = any(TRANSPORTS[choose_transport(n, size, link, int8=int8)].reply_collective
                          for n, _, _ in self.groups.values())
            chosen, trials = set(), [(None, "allgather", "fp32")] if sharded else []
        wires = self.prefer if self.prefer and not chosen else WIRES  # every group uncoded: the faster path's wires
        self._try(trials + [(chosen, None, wire) for wire in wires], codes_all)
        if TRIAL_PAIRS == 0:  # tests: the first plan in force, untried
            self.kept, self.steps = 0, self.trial.verdict_step

    def _try(self, trials: list[tuple[set[str] | None, str | None, str]], codes_all: bool) -> None:
        """The trial of coding against these plans. A round runs the coded kind first and the plan that sends its
        uncoded groups in fp32 last: an fp32 step then follows a 16-bit or fp32 one, never a coded one, whose
        residuals (error feedback) it would merge first, a pass over each coded tensor and, on the DDP hook's C++
        path, a call into Python a bucket (ddp.native.Native.merge). A 16-bit plan's step follows a coded one in the
        first round of a pair and pays that (2 of its 6 steps, which its median of six weighs less than a mean
        would). The model's side: the kinds that code every group where it does, else its plan's.
        The preferred kinds: the plans that send every group uncoded in a wire the front end prefers."""
        self.trials = trials
        wire = [None] + [w if c is not None else None for c, _, w in trials]  # each kind's uncoded wire
        codes_every = [True] + [c is None for c, _, _ in trials]
        preferred = [k for k, (c, _, w) in enumerate(trials, 1) if w in self.prefer and c is not None and not c]
        self.trial = Trial(sorted(range(1 + len(trials)), key=lambda k: wire[k] == "fp32"),
                           [k for k, every in enumerate(codes_every) if every == codes_all], preferred)


def _wire_bits(wires: tuple[str, ...]) -> int:
    """The wires offered as one number, a bit each (transports.uncoded.UNCODED's order): docs/wire-format.md, 9."""
    return sum(1 << list(UNCODED).index(w) for w in wires)


def _unpaused(times: list[float]) -> list[float]:
    """A kind's trial steps within PAUSE of its fastest: a pause between two steps is not its speed."""
    fastest = min(times)
    return [t for t in times if t <= PAUSE * fastest]


def _trial_step(times: list[float]) -> float:
    """A kind's step from its trial steps, one a round: the median of those within PAUSE of its fastest (the
    module docstring)."""
    return statistics.median(_unpaused(times))


def _trial_noise(kinds: list[list[float]]) -> float:
    """A rank's trial noise, from the trial steps of the kinds left: the spread (1.4826 times the median absolute
    deviation, sigma for a normal law) of their steps, each relative to its kind's step (_trial_step), pauses
    left out."""
    devs = []
    for times in kinds:
        steps = _unpaused(times)
        step = statistics.median(steps)
        devs += [abs(t / step - 1) for t in steps]
    return 1.4826 * statistics.median(devs) if devs else 0.0
