"""The collectives TernGrad's pipeline and transports need, as one small protocol and its implementations.

    HorovodCollectives   (collectives.horovod)   a Horovod process set
    TorchCollectives     (collectives.distributed) a torch.distributed process group: gloo on CPU, NCCL on GPU
    LoopbackCollectives  (collectives.loopback)  N ranks in one process, exact: the simulator and the tests
    MirrorCollectives    (collectives.loopback)  one rank whose peers all send what it sends: a codec rehearsal

Every operation starts without blocking and returns a handle; `poll` asks whether it is done and `wait` waits
for it, at most `timeout_s`, then raises CollectiveTimeoutError naming what was waited for, the rank and the
group. A rank whose peers never join a collective (options or process sets that differ between ranks, a rank
stuck outside the step) thus fails in bounded time instead of hanging. Each implementation counts the time
it waits into `stats` (a StatsRecorder, or None), as the "comm" phase.

Only the pipeline's needs are here. What a front end does beside it (a float average of the tensors that are
not coded, a broadcast inside a node, sparse gradients) stays with the front end and its framework.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from hvd_terngrad.errors import CollectiveTimeoutError
from hvd_terngrad.stats import StatsRecorder

__all__ = ["Collectives", "bounded_wait", "HorovodCollectives", "TorchCollectives", "LoopbackCollectives",
           "LoopbackWorld", "MirrorCollectives"]


@runtime_checkable
class Collectives(Protocol):
    """What one rank of a group of `size` ranks can ask of the others. Names tie the ranks' calls together
    (the same name, the same collective); results come back in rank order."""

    rank: int
    size: int
    stats: StatsRecorder | None
    timeout_s: float

    def max_allreduce_async(self, vec: torch.Tensor, name: str) -> Any:
        """The elementwise Max of every rank's fp32 or fp16 vector (a new tensor)."""

    def allgather_async(self, payload: torch.Tensor, name: str) -> Any:
        """Every rank's uint8 payload, concatenated in rank order."""

    def alltoall_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Equal slices of a uint8 tensor to every rank in rank order; the slices it receives, in rank order."""

    def sum_async_(self, tensor: torch.Tensor, name: str) -> Any:
        """In place: the Sum of every rank's fp16 tensor (integers: exact in any order)."""

    def int8_sum_async_(self, tensor: torch.Tensor, name: str) -> Any:
        """In place: the Sum of every rank's int8 tensor. (Horovod's allreduce takes no int8: there it is one
        blocking MPI call, made by wait(); waits must then come in the same order on every rank.)"""

    def average_async_(self, tensor: torch.Tensor, name: str) -> Any:
        """In place: the average of every rank's float tensor (what is not coded travels so)."""

    def poll(self, handle: Any) -> bool:
        """Whether the collective of `handle` is done (wait() then returns at once)."""

    def wait(self, handle: Any, what: str) -> torch.Tensor:
        """The collective's result, at most timeout_s: then CollectiveTimeoutError naming `what`."""


# Waiting polls. For its first _SPIN_S it yields the core between polls, as hvd.synchronize() does throughout
# (Horovod 0.28.1's wait loops on a yield, with no sleep): a step's waits (latency, a few milliseconds, or the
# ranks that share a core finishing their backward, 8-12 ms on lenet with four nodes on two cores) end as soon
# as they can; a nap in them ends them late, by up to the nap. A longer wait is a late peer, or one that never
# comes; spinning through it takes a core that other ranks sharing it, or data loaders, could compute on. So it
# then sleeps between polls, at most 1/_NAP_FRACTION of the time waited so far and _NAP_MAX_S, which ends it at
# most that late. Spinning 5 ms, auto's fp32 plan on lenet stepped behind Horovod FP32; 20 ms brought it level
# (measured: docs/notes/tta-log.md, "Waits that spin 20 ms"). The clock is read every _POLLS_PER_CLOCK polls.
_POLLS_PER_CLOCK = 64
_SPIN_S = 20e-3
_NAP_FRACTION = 8
_NAP_MAX_S = 5e-4


def bounded_wait(done: Callable[[], bool], timeout_s: float, message: Callable[[], str]) -> None:
    """Poll `done` until it is true; past timeout_s raise CollectiveTimeoutError(message())."""
    start = time.monotonic()
    polls = 0
    while not done():
        polls += 1
        if polls % _POLLS_PER_CLOCK:
            os.sched_yield()
            continue
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise CollectiveTimeoutError(message())
        if waited > _SPIN_S:
            time.sleep(min(waited / _NAP_FRACTION, _NAP_MAX_S))
            polls = _POLLS_PER_CLOCK - 1  # past the spin: read the clock at every poll


def timed(stats: StatsRecorder | None, phase: str = "comm"):
    """stats.timed(phase), or nothing without stats."""
    return stats.timed(phase) if stats is not None else nullcontext()


def __getattr__(name):  # the framework-bound implementations import their framework on first use
    if name == "HorovodCollectives":
        from hvd_terngrad.collectives.horovod import HorovodCollectives

        return HorovodCollectives
    if name == "TorchCollectives":
        from hvd_terngrad.collectives.distributed import TorchCollectives

        return TorchCollectives
    if name in ("LoopbackCollectives", "LoopbackWorld", "MirrorCollectives"):
        from hvd_terngrad.collectives import loopback

        return getattr(loopback, name)
    raise AttributeError(f"module 'hvd_terngrad.collectives' has no attribute {name!r}")
