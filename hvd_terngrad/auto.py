"""transport="auto", per group: code it, or send it uncoded (one fp32 average), whichever the cost model says
makes the step shorter.

Coding a group costs codec time on every rank and saves link time. Saved link time buys nothing where the
group's float average would have hidden behind backward anyway. On a fast link (InfiniBand, the emulated
`fast` profile), coding is then pure cost, and TernGrad was slower than FP32 there (measured and modelled:
docs/transports.md, "Auto: FP32 where coding does not pay"). So auto plans, per group g (commcost's formulas on the
configured link, TernGradConfig.link()):

    uncoded_g   an fp32 ring allreduce of the group
    coded_g     the cheapest transport's seconds (transports.choose_transport) plus its scaler allreduce
    codec_g     measured seconds per coded element on this rank, times the group's elements
    exposed     max(0, sum of link seconds - window) + sum of codec seconds of the coded groups

where the window is the backward time communication hides behind. It codes the groups that save the most link
time per codec second first and keeps the prefix with the least exposed time (fewest coded on a tie): every
group uncoded where FP32's average hides, so as far as the model goes never slower than FP32. Groups whose
coded cost is not below their uncoded cost are never coded. The performance model's extrapolation
(benchmarks/perf_model.py) applies the same `plan`.

Measuring and agreeing, with no collective of its own (the steps: AutoPlan's docstring):
- For PLAN_STEP steps every group is coded (the wire choice, as before). On the steps after the first (which
  warms up allocations) each rank measures its codec seconds per element (the stats' encode and decode time
  over the elements it coded), its window (the first group ready to the last group ready, less its own coding
  in between where that ran on the same thread) and its step time.
- On the last of those steps each coded group's scaler Max allreduce carries two more values, [seconds per
  element, -window] (docs/wire-format.md, section 9): every rank reads the slowest codec and the shortest
  window, and makes the same plan.
- The model leaves costs out: above all the CPU a byte costs on its way through the network stack, and the
  front end's own copies. So the plan is tried for TRIAL_STEPS steps and timed, and then every group is
  coded again for RECHECK_STEPS timed steps (the coded steps before the trial were still warming up, which
  favoured the plan). A coded step then carries both kinds' fastest step on each rank, and every rank keeps
  the plan only if its slowest rank's tried step was faster than its slowest rank's coded step; else every
  group is coded from then on.
- Where the model codes every group anyway but some with the sharded transport, the plan tried is every
  group coded with the allgather instead: the sharded transport's second collective costs latency the model
  underrates on small groups (measured: docs/time-to-accuracy.md, "Auto on the emulated cluster").
The groups are known by their keys ("bucket.3", a tensor's name), the same on every rank; a group the plan
has not seen is coded. Without a shared scaler (share_scaler=False) nothing carries the measurement, and auto
keeps coding every group.
"""
from __future__ import annotations

import time

from hvd_terngrad.commcost import Link, allreduce_time
from hvd_terngrad.transports import TRANSPORTS, choose_transport
from hvd_terngrad.transports.uncoded import UNCODED

PLAN_STEP = 4  # steps coded and measured before the plan; the last of them carries the measurement
TRIAL_STEPS = 4  # steps the model's plan is tried (the fastest counts: the first pays one-offs)
RECHECK_STEPS = 3  # coded steps after the trial, timed: the steps before it were still warming up
VERDICT_STEP = PLAN_STEP + TRIAL_STEPS + RECHECK_STEPS  # a coded step that carries both step times
CARRIED = 2  # values appended to the scaler vector on a carrying step


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
    return UNCODED.seconds(numel, n_workers, link), coded, codec_s_per_element * numel


class AutoPlan:
    """One rank's measurement, plan and verdict for transport="auto" (module docstring). Its steps:

        0                   coded (allocations warm up)
        1 .. PLAN_STEP-2    coded; codec seconds per element, the window and the step time measured
        PLAN_STEP-1         coded; the scaler vectors carry [seconds per element, -window]; the model's plan
        the TRIAL_STEPS     the model's plan tried, its step time measured
        the RECHECK_STEPS   coded again, the step time measured
        VERDICT_STEP        coded; the scaler vectors carry [coded step, tried step]; the faster is kept
    """

    __slots__ = ("steps", "groups", "codec_s", "coded_numel", "windows", "first", "last", "agreed", "trial",
                 "tried_transport", "times", "step_end", "verdict", "coded", "transport")

    def __init__(self):
        self.steps = 0  # steps this rank finished since the plan was made new (the same count on every rank)
        self.groups: dict[str, tuple[int, int, int]] = {}  # key -> (elements, tensors, scaler bytes), this step
        self.codec_s = 0.0  # encode + decode seconds of the measured steps
        self.coded_numel = 0  # elements coded in the measured steps
        self.windows: list[float] = []  # the measured steps' windows
        self.first: tuple[float, float] | None = None  # this step's first group: (ready, encode seconds so far)
        self.last: tuple[float, float] | None = None  # and its last
        self.agreed: tuple[float, float] | None = None  # (seconds per element, window), the same on every rank
        self.trial: set[str] | None = None  # the keys coded in the plan tried for TRIAL_STEPS steps
        self.tried_transport: str | None = None  # the one transport of the coded groups in that plan (None: the
        # model's choice per group)
        self.times: dict[str, list[float]] = {"coded": [], "trial": []}  # step seconds, this rank
        self.step_end: float | None = None  # when the last step ended (time.perf_counter())
        self.verdict: tuple[float, float] | None = None  # (coded, tried) step seconds, the same on every rank
        self.coded: set[str] | None = None  # the keys coded now; None: every group (the plan is not in force)
        self.transport: str | None = None  # the transport of every coded group now; None: the model's choice

    def uncoded(self, key: str) -> bool:
        return self.coded is not None and key not in self.coded

    def summary(self) -> dict:
        """What the benchmarks record: the plan tried, the step seconds that judged it, what is in force."""
        return {"tried_coding": None if self.trial is None else sorted(self.trial),
                "tried_transport": self.tried_transport, "step_seconds_coded_tried": self.verdict,
                "uncoded_now": self.coded is not None, "transport_now": self.transport}

    @property
    def decided(self) -> bool:
        return self.steps > VERDICT_STEP

    @property
    def carrying(self) -> bool:
        """Whether this step's scaler vectors carry a measurement."""
        return self.steps in (PLAN_STEP - 1, VERDICT_STEP)

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
        """The two values this rank appends to its scaler vectors on a carrying step."""
        if self.steps == VERDICT_STEP:  # the fastest step of each kind: one-off costs and noise stay out
            return [min(self.times["coded"]), min(self.times["trial"])]
        per_element = self.codec_s / self.coded_numel if self.coded_numel else 0.0
        return [per_element, -(sum(self.windows) / len(self.windows) if self.windows else 0.0)]

    def agree(self, values: list[float]) -> None:
        """The carried values after the Max allreduce (every group carries the same): the slowest codec and
        the shortest window; or each kind's step on the slowest rank."""
        if self.steps == VERDICT_STEP:
            self.verdict = (values[0], values[1])
        else:
            self.agreed = (values[0], -values[1])

    def step_done(self, codec_s: float, size: int, link: Link, int8: bool, now: float | None = None) -> None:
        """The end of a step (codec_s: its encode + decode seconds): its measurement, the plan to try, or the
        verdict. now: the time (tests)."""
        if self.decided:
            return
        now = time.perf_counter() if now is None else now
        s, took = self.steps, None if self.step_end is None else now - self.step_end
        self.step_end = now
        if took is not None:
            trying = self.coded is not None or self.transport is not None
            self.times["trial" if trying and s < VERDICT_STEP else "coded"].append(took)
        if 1 <= s < PLAN_STEP - 1 and self.groups:
            self.codec_s += codec_s
            self.coded_numel += sum(n for n, _, _ in self.groups.values())
            ready, enc = self.last[0] - self.first[0], self.last[1] - self.first[1]
            self.windows.append(max(0.0, ready - enc))
        if s == PLAN_STEP - 1:
            self._plan(size, link, int8)
        elif s == PLAN_STEP + TRIAL_STEPS - 1:
            self.coded = self.transport = None  # coded as the model says until the verdict, and the verdict's step
        elif s == VERDICT_STEP:
            tried = self.trial is not None and self.verdict is not None and self.verdict[1] < self.verdict[0]
            if tried:
                self._keep_trial()
        self.steps += 1
        self.groups, self.first, self.last = {}, None, None

    def _plan(self, size: int, link: Link, int8: bool) -> None:
        """The model's plan from the agreed measurement, to try; none (every group coded from now on) where
        nothing was measured or the plan codes every group anyway."""
        if self.agreed is not None:
            per_element, window = self.agreed
            costs = {k: group_costs(n, t, b, size, link, per_element, int8) for k, (n, t, b) in self.groups.items()}
            chosen = plan(costs, window)
            if chosen != set(costs):
                self.trial = chosen
            elif any(TRANSPORTS[choose_transport(n, size, link, int8=int8)].reply_collective
                     for n, _, _ in self.groups.values()):
                # every group coded, some with a transport of two collectives after the scalers' (sharded): the
                # latency the second adds, all there is on a small group, is what the model knows least (it cost
                # NCF at 1 Gbit/s a fifth of its speed: docs/time-to-accuracy.md), so the allgather is tried
                self.trial, self.tried_transport = chosen, "allgather"
            if self.trial is not None:
                self._keep_trial()  # in force for the trial
                if TRIAL_STEPS == 0:  # tests: the plan, untried
                    self.steps = VERDICT_STEP
                return
        self.steps = VERDICT_STEP  # decided: every group coded as the model says

    def _keep_trial(self) -> None:
        """The tried plan in force: its uncoded groups, or its one transport."""
        self.coded = self.trial if self.tried_transport is None else None
        self.transport = self.tried_transport
