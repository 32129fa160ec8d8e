"""Collectives over a Horovod process set (Horovod 0.28.1).

hvd.synchronize() waits forever, so every wait here polls instead, at most timeout_s (collectives.bounded_wait).
Horovod's allreduce takes no int8: the int8 Sum goes through mpi4py on a duplicate of MPI_COMM_WORLD, one
blocking call made by wait().
"""
from __future__ import annotations

import sys
import threading
from typing import Callable

import horovod.torch as hvd
import torch

from hvd_terngrad.collectives import bounded_wait, timed
from hvd_terngrad.stats import StatsRecorder


class HorovodCollectives:
    def __init__(self, process_set=None, stats: StatsRecorder | None = None, timeout_s: float = 300.0):
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.stats = stats
        self.timeout_s = timeout_s
        self._comm = None  # mpi4py's duplicate of MPI_COMM_WORLD, for the int8 sums

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

    def allgather_async(self, payload: torch.Tensor, name: str):
        return hvd.allgather_async(payload, name=name, process_set=self.process_set)

    def alltoall_async(self, tensor: torch.Tensor, name: str):
        return _Alltoall(hvd.alltoall_async(tensor, name=name, process_set=self.process_set))

    def sum_async_(self, tensor: torch.Tensor, name: str):
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def int8_sum_async_(self, tensor: torch.Tensor, name: str):
        if tensor.is_cuda:
            raise ValueError("transport='summed-int8' works on CPU tensors under Horovod; use transport='summed' "
                             "on GPUs")
        self._int8_comm()  # refuse an unfit setup when the sum is started, not when it is waited for
        return _Int8Sum(tensor)

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
        if isinstance(handle, _Int8Sum):
            return False  # it has not started: wait() makes the call
        return hvd.poll(handle.handle if isinstance(handle, _Alltoall) else handle)

    def wait(self, handle, what: str) -> torch.Tensor:
        """hvd.synchronize(handle), but at most timeout_s: then CollectiveTimeoutError naming `what`."""
        if isinstance(handle, _Alltoall):
            return self.wait(handle.handle, what)[0]  # (output, received splits)
        if isinstance(handle, _Int8Sum):
            return self._int8_sum_(handle.values, what)
        return self.wait_all([handle], lambda _: what)[0]

    def wait_all(self, handles: list, what: Callable[[int], str]) -> list[torch.Tensor]:
        """The results of many in-place collectives (plain handles) in one bounded wait, as the front end waits
        for a step's float averages. One wait for each costs a timer and a wait loop apiece on the training
        thread, which shares its core with other ranks (measured: docs/notes/tta-log.md, "Auto on the
        emulated cluster"). On a timeout it names, as what(i), the latest started that is not done."""
        left = len(handles)  # handles[:left] may not be done

        def done() -> bool:
            nonlocal left
            while left and hvd.poll(handles[left - 1]):  # the last started is most often the last done
                left -= 1
            return not left

        with timed(self.stats):
            bounded_wait(done, self.timeout_s, lambda: self.timeout_message(what(left - 1)))
            return [hvd.synchronize(h) for h in handles]

    def _int8_sum_(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """In-place int8 Sum allreduce through mpi4py (blocking).

        An MPI call cannot be cancelled, so it runs on a helper thread while this one waits at most timeout_s;
        past that the job is aborted (MPI_Abort) with a message naming `what` and this rank. Two threads in MPI
        at once (MPI_THREAD_MULTIPLE, here with Horovod's) can leave one rank in a sum its peers have finished
        (docs/hardening.md); an abort with a reason beats a silent hang."""
        comm = self._int8_comm()
        MPI = _mpi()
        err: list[BaseException] = []

        def run():
            try:
                comm.Allreduce(MPI.IN_PLACE, values.numpy(), op=MPI.SUM)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                err.append(exc)

        with timed(self.stats):
            worker = threading.Thread(target=run, name="hvd_terngrad-int8-sum", daemon=True)
            worker.start()
            worker.join(self.timeout_s)
        if worker.is_alive():
            print(self.timeout_message(what) + " Aborting the job (an MPI call cannot be cancelled); "
                  "transport='summed' avoids mpi4py.", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(3)
        if err:
            raise err[0]
        return values

    def int8_refusal(self) -> str | None:
        """Why the int8 Sum cannot run here, or None where it can: transport="summed-int8" raises it as a
        ValueError, and transport="auto" considers the int8 sums only where there is none (session.Session)."""
        if self.process_set is not hvd.global_process_set:
            return "transport='summed-int8' works on the global process set only"
        if not hvd.mpi_enabled():
            return "transport='summed-int8' needs Horovod running on MPI (not Gloo)"
        try:
            MPI = _mpi()
        except ImportError:
            return "transport='summed-int8' needs mpi4py"
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return "transport='summed-int8' needs MPI_THREAD_MULTIPLE (Horovod's thread also uses MPI)"
        return None

    def _int8_comm(self):
        if self._comm is None:
            refusal = self.int8_refusal()
            if refusal is not None:
                raise ValueError(refusal)
            self._comm = _mpi().COMM_WORLD.Dup()
        return self._comm

    def timeout_message(self, what: str) -> str:
        """Why a wait for `what` ran out, with the likely causes."""
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


class _Int8Sum:
    """An int8 Sum not yet made: wait() makes the blocking MPI call."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor):
        self.values = values


def _mpi():
    from mpi4py import MPI  # imported on first use: only summed-int8 needs it

    return MPI
