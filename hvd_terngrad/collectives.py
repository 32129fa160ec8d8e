"""How TernGrad's bytes travel: thin wrappers over Horovod collectives, and the time spent waiting.

allgather: every rank receives every rank's payload ((N-1) * n/4 bytes of codes per worker).
summed: with a shared scaler every rank's codes are integers on one scale, so their sum travels in one
allreduce (fp16 through Horovod, exact for N <= 2048; int8 through mpi4py, N <= 127), at a cost that does not
grow with N. The scaler vector of a group goes through a Max allreduce first when scalers are shared.

Every wait is bounded by timeout_s. hvd.synchronize() waits forever, so a rank whose peers never join a
collective (a process set that differs between TernGrad and the optimizer, options that differ between
ranks, a rank stuck outside the step) would spin silently; wait() polls instead and raises
CollectiveTimeoutError naming the collective, the tensor and the rank.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import nullcontext as _nullcontext

import horovod.torch as hvd
import torch

from hvd_terngrad.engine import CollectiveTimeoutError
from hvd_terngrad.stats import StatsRecorder

# Waiting polls. For its first _SPIN_S it yields the core between polls, as hvd.synchronize() does: a short
# wait ends as soon as it can (a sleep, even of microseconds, costs a small job's step several milliseconds).
# A longer wait is bytes on the wire; spinning through it takes a core that other ranks sharing it, or data
# loaders, could compute on. So it then sleeps between polls, at most 1/_NAP_FRACTION of the time waited so
# far and _NAP_MAX_S, which ends it at most that late. The clock is read every _POLLS_PER_CLOCK polls.
_POLLS_PER_CLOCK = 64
_SPIN_S = 1e-3
_NAP_FRACTION = 8
_NAP_MAX_S = 5e-4


class HorovodCollectives:
    def __init__(self, process_set=None, stats: StatsRecorder | None = None, timeout_s: float = 300.0):
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.stats = stats
        self.timeout_s = timeout_s

    @property
    def rank(self) -> int:
        ps = self.process_set
        return hvd.rank() if ps is hvd.global_process_set else ps.rank()

    @property
    def size(self) -> int:
        ps = self.process_set
        return hvd.size() if ps is hvd.global_process_set else ps.size()

    def max_allreduce_async(self, vec: torch.Tensor, name: str):
        return hvd.allreduce_async(vec, name=name, op=hvd.Max, process_set=self.process_set)

    def max_allreduce(self, vec: torch.Tensor, name: str, what: str) -> torch.Tensor:
        return self.wait(self.max_allreduce_async(vec, name), what)

    def allgather_async(self, payload: torch.Tensor, name: str):
        return hvd.allgather_async(payload, name=name, process_set=self.process_set)

    def alltoall_async(self, tensor: torch.Tensor, name: str):
        """Equal slices of `tensor`'s first dimension to every rank, in rank order; wait() gives the output."""
        return _Alltoall(hvd.alltoall_async(tensor, name=name, process_set=self.process_set))

    def sum_async_(self, tensor: torch.Tensor, name: str):
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def int8_sum_(self, values: torch.Tensor, what: str = "") -> torch.Tensor:
        """In-place int8 Sum allreduce through mpi4py on a duplicate of MPI_COMM_WORLD (blocking).

        An MPI call cannot be cancelled, so it runs on a helper thread while this one waits at most timeout_s;
        past that the job is aborted (MPI_Abort) with a message naming `what` and this rank. Two threads in MPI
        at once (MPI_THREAD_MULTIPLE, here with Horovod's) can leave one rank in a sum its peers have finished
        (docs/hardening.md); an abort with a reason beats a silent hang."""
        if values.is_cuda:
            raise ValueError("transport='summed-int8' works on CPU tensors; use transport='summed' on GPUs")
        comm = self._int8_comm()
        MPI = _mpi()
        err: list[BaseException] = []

        def run():
            try:
                comm.Allreduce(MPI.IN_PLACE, values.numpy(), op=MPI.SUM)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                err.append(exc)

        with self.stats.timed("comm") if self.stats is not None else _nullcontext():
            worker = threading.Thread(target=run, name="hvd_terngrad-int8-sum", daemon=True)
            worker.start()
            worker.join(self.timeout_s)
        if worker.is_alive():
            print(self._timeout_message(f"the int8 code-sum allreduce of {what or 'a bucket'}")
                  + " Aborting the job (an MPI call cannot be cancelled); transport='summed' avoids mpi4py.",
                  file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(3)
        if err:
            raise err[0]
        return values

    def _int8_comm(self):
        if getattr(self, "_comm", None) is None:
            if self.process_set is not hvd.global_process_set:
                raise ValueError("transport='summed-int8' works on the global process set only")
            if not hvd.mpi_enabled():
                raise ValueError("transport='summed-int8' needs Horovod running on MPI (not Gloo)")
            MPI = _mpi()
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise ValueError("transport='summed-int8' needs MPI_THREAD_MULTIPLE (Horovod's thread also uses MPI)")
            self._comm = MPI.COMM_WORLD.Dup()
        return self._comm

    def average_async_(self, tensor: torch.Tensor, name: str):
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Average, process_set=self.process_set)

    def broadcast_async_(self, tensor: torch.Tensor, root: int, name: str):
        """In place, from `root` (a rank of this process set) to every rank of it."""
        return hvd.broadcast_async_(tensor, root_rank=root, name=name, process_set=self.process_set)

    def sparse_average_async(self, grad: torch.Tensor, name: str):
        """The average of a sparse gradient, uncoded and exactly as Horovod's sparse_allreduce_async makes it
        (so the same bits as Compression.none): allgathers of its indices and values, as they are."""
        ps = self.process_set
        return (hvd.allgather_async(grad._indices().t().contiguous(), name=f"{name}.indices", process_set=ps),
                hvd.allgather_async(grad._values(), name=f"{name}.values", process_set=ps), grad)

    def sparse_average(self, handle, what: str) -> torch.Tensor:
        indices_handle, values_handle, grad = handle
        values = self.wait(values_handle, what) / self.size
        indices = self.wait(indices_handle, what)
        return torch.sparse_coo_tensor(indices.t(), values, grad.shape)

    @staticmethod
    def poll(handle) -> bool:
        return hvd.poll(handle.handle if isinstance(handle, _Alltoall) else handle)

    def wait(self, handle, what: str) -> torch.Tensor:
        """hvd.synchronize(handle), but at most timeout_s: then CollectiveTimeoutError naming `what`."""
        if isinstance(handle, _Alltoall):
            return self.wait(handle.handle, what)[0]  # (output, received splits)
        with self.stats.timed("comm") if self.stats is not None else _nullcontext():
            start = time.monotonic()
            polls = 0
            while not hvd.poll(handle):
                polls += 1
                if polls % _POLLS_PER_CLOCK:
                    os.sched_yield()
                    continue
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    raise CollectiveTimeoutError(self._timeout_message(what))
                if waited > _SPIN_S:
                    time.sleep(min(waited / _NAP_FRACTION, _NAP_MAX_S))
                    polls = _POLLS_PER_CLOCK - 1  # past the spin: read the clock at every poll
            return hvd.synchronize(handle)

    def _timeout_message(self, what: str) -> str:
        where = describe_process_set(self.process_set)
        return (f"hvd_terngrad: rank {hvd.rank()} waited {self.timeout_s:g} s for {what} over {where}, and some "
                f"rank of it never joined. Do all ranks and the optimizer use the same process set and the same "
                f"TernGrad options? (hvd.DistributedOptimizer(process_set=ps) needs TernGrad(process_set=ps) too.) "
                f"A rank that stopped calling collectives mid-step does this as well. The bound is "
                f"TernGrad(timeout_s=...).")


def process_set_id(process_set) -> int:
    """A process set's id; 0 is Horovod's global set (also when given as None)."""
    return 0 if process_set is None else process_set.process_set_id


def describe_process_set(process_set) -> str:
    if process_set_id(process_set) == 0:
        return "the global process set"
    return f"process set {process_set.process_set_id} (ranks {process_set.ranks})"


class _Alltoall:
    """An alltoall's handle: its result is (output, splits), of which callers want the output."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


def _mpi():
    from mpi4py import MPI  # imported on first use: only summed-int8 needs it

    return MPI
