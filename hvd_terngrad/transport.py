"""How TernGrad's bytes travel: thin wrappers over Horovod collectives, and the time spent waiting.

allgather: every rank receives every rank's payload ((N-1) * n/4 bytes of codes per worker). The scaler
vector of a group goes through a Max allreduce first when scalers are shared.
"""
from __future__ import annotations

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
