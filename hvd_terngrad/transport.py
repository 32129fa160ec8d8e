"""How TernGrad's bytes travel: thin wrappers over Horovod collectives, and the time spent waiting.

allgather: every rank receives every rank's payload ((N-1) * n/4 bytes of codes per worker).
summed: with a shared scaler every rank's codes are integers on one scale, so their sum travels in one
allreduce (fp16 through Horovod, exact for N <= 2048; int8 through mpi4py, N <= 127), at a cost that does not
grow with N. The scaler vector of a group goes through a Max allreduce first when scalers are shared.
"""
from __future__ import annotations

import sys
import threading
from contextlib import nullcontext as _nullcontext

import horovod.torch as hvd
import torch

from hvd_terngrad.stats import StatsRecorder


class HorovodTransport:
    def __init__(self, process_set=None, stats: StatsRecorder | None = None):
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.stats = stats

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

    def max_allreduce(self, vec: torch.Tensor, name: str) -> torch.Tensor:
        return self.wait(self.max_allreduce_async(vec, name))

    def allgather_async(self, payload: torch.Tensor, name: str):
        return hvd.allgather_async(payload, name=name, process_set=self.process_set)

    def sum_async_(self, tensor: torch.Tensor, name: str):
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    # How long an int8 sum may take before the job is aborted. Once in our 8-rank runs one rank stayed in its
    # last sum after the others had finished it and exited (MPI called from two threads at once,
    # MPI_THREAD_MULTIPLE, over Open MPI 4.1's TCP transport); a clear abort beats a silent hang.
    # Generous: a 100 MB sum over 1 Gbit/s Ethernet takes about 2 s.
    INT8_TIMEOUT_S = 300.0

    def int8_sum_(self, values: torch.Tensor, what: str = "") -> torch.Tensor:
        """In-place int8 Sum allreduce through mpi4py on a duplicate of MPI_COMM_WORLD (blocking).

        The call runs on a helper thread while this one waits at most INT8_TIMEOUT_S; past that the job is
        aborted (MPI_Abort) with a message naming `what` and this rank, so no rank hangs."""
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
            worker.join(self.INT8_TIMEOUT_S)
        if worker.is_alive():
            print(f"hvd_terngrad: the int8 code-sum allreduce of {what or 'a bucket'} on rank {self.rank} did not "
                  f"complete in {self.INT8_TIMEOUT_S:.0f} s (a peer that never joined it, or MPI under "
                  f"MPI_THREAD_MULTIPLE); aborting the job. transport='summed' avoids mpi4py.",
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

    @staticmethod
    def poll(handle) -> bool:
        return hvd.poll(handle)

    def wait(self, handle) -> torch.Tensor:
        if self.stats is None:
            return hvd.synchronize(handle)
        with self.stats.timed("comm"):
            return hvd.synchronize(handle)


def _mpi():
    from mpi4py import MPI  # imported on first use: only summed-int8 needs it

    return MPI
