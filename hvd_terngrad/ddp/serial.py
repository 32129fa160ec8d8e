"""One worker thread that runs DDP buckets' exchanges in DDP's launch order (Serial), and any DDP hook run so
(InLaunchOrder)."""
import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from hvd_terngrad.errors import CollectiveTimeoutError, TernGradError


class Serial:
    """One worker thread that runs DDP buckets' exchanges one after another, in the order DDP launched them,
    so that every rank issues the same collectives in the same order. submit(run) returns a future of run()'s
    tensor; where run() returns a future (another hook's), the worker waits for it before the next bucket."""

    __slots__ = ("name", "_queue", "_thread", "_failed", "_open")

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.Queue = queue.Queue()  # (run, futures, last), in launch order
        self._thread: Optional[threading.Thread] = None  # started on the first bucket
        self._failed: list = []  # this step's failed (futures, values), held until its last submission has run
        self._open = False  # the step has had submissions, none of them its last (set by the submitting thread)

    def submit(self, run) -> torch.futures.Future:
        fut = torch.futures.Future()  # the worker sets the tensor, or the error
        self.submit_into(lambda: [_resolved(run())], [fut])
        # An error set with set_exception reaches DDP's C++ side as "Unable to cast <message> to Tensor"; raised
        # in a callback, it reaches the user as "...when running the callback: <Type>: <message>"
        return fut.then(value_or_raise)

    def submit_into(self, run, futures: list, last: bool = True) -> None:
        """run() returns a value per future, which the worker sets in them (or its error in all of them); the
        caller hands DDP `future.then(value_or_raise)`. last=False: the step has more submissions to come, and
        an error that every rank raises alike is held until they have run (_held_back)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((run, futures, last))
        self._open = not last

    def end_step(self) -> None:
        """The step's last bucket went another way (the uncoded fast path): release any error held back. A step
        that sent the worker nothing costs it no wake-up."""
        if self._open:
            self.submit_into(list, [])

    def _loop(self) -> None:
        while True:
            run, futures, last = self._queue.get()
            error = None
            try:
                values = run()
            except BaseException as exc:  # noqa: BLE001  (DDP raises it where it waits for the bucket)
                error = exc.with_traceback(None)  # its frames would hold the collectives
                values = [error] * len(futures)
            # Let go of the buckets' hook and its futures before DDP may go on: they keep their process group's
            # work alive, and the training may end and destroy the group the moment the result is set; work
            # destroyed after its group (at interpreter exit, from this thread) aborts the process
            run = None
            if _held_back(error) and not last:
                self._failed.append((futures, values))
                done = []
            else:
                done = [(futures, values)]
            if last:
                done, self._failed = self._failed + done, []
            del futures, values, error
            for futures, values in done:
                for fut, value in zip(futures, values):
                    fut.set_result(value)
            done = futures = values = fut = value = None


def _held_back(error) -> bool:
    """Whether the worker holds `error` back until the step's last submission has run: an error every rank
    raises alike, in the same group. Set at once, it lets a rank's training end and tear its process group down
    while this rank's worker, or a late peer's, still runs the step's later groups; gloo then aborts a process
    at exit. A timeout is not held: the later groups would each wait out theirs."""
    return isinstance(error, TernGradError) and not isinstance(error, CollectiveTimeoutError)


def _resolved(out):
    """A hook's result: its future waited for (another hook's, run in launch order), or the tensor itself."""
    return out.wait() if isinstance(out, torch._C.Future) else out


def value_or_raise(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


class InLaunchOrder:
    """Another DDP hook, run bucket after bucket in DDP's launch order (see the module's docstring): each
    bucket's hook starts once the previous bucket's future has completed, on one worker thread, while backward
    goes on. The cost: one bucket's collectives at a time. Where DDP has find_unused_parameters=True or
    static_graph=True, give the wrapped hook's state a process group of its own (dist.new_group() on every
    rank): DDP's own collectives during backward could otherwise pair with the worker's (see _own_group).

        ddp.register_comm_hook(InLaunchOrder(powerSGD_hook.powerSGD_hook, PowerSGDState(None)), in_launch_order)
    """

    __slots__ = ("hook", "state", "_order")

    def __init__(self, hook, state):
        self.hook, self.state = hook, state  # the wrapped hook and its own state
        self._order = Serial("hvd_terngrad-ddp-order")


def in_launch_order(wrapped: InLaunchOrder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: `wrapped.hook(wrapped.state, bucket)`, in launch order (InLaunchOrder).

    Args:
        wrapped: the InLaunchOrder holding the hook and its state (register it as the hook's state).
        bucket: DDP's bucket.

    Returns:
        The future of the bucket's average, as the wrapped hook's.
    """
    return wrapped._order.submit(lambda: wrapped.hook(wrapped.state, bucket))


def bf16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook under another name. DDP refuses that hook by its name unless NCCL is there,
    though gloo sums bfloat16 too; registered as this, it runs on CPU as well.

    Args:
        process_group: the group to average over (None: the default group), as torch's hook takes it.
        bucket: DDP's bucket.

    Returns:
        The future of the bucket's average, rounded to bf16 and back.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
