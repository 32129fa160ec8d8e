"""Collectives over a torch.distributed process group: gloo on CPU, NCCL on GPU.

Each operation is torch.distributed's own with async_op=True; wait() polls its Work, at most timeout_s, as
HorovodCollectives does. gloo on CPU does all_to_all_single, all_gather and reduce_scatter on uint8 (torch
2.13). The allgather here expects the same number of bytes from every rank, which TernGrad's payloads are
whenever the ranks agree on a group of tensors; where they do not, the payload headers or the scaler tags say
so, and a collective that cannot match fails within timeout_s.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hvd_terngrad.collectives import bounded_wait, timed
from hvd_terngrad.errors import CollectiveTimeoutError
from hvd_terngrad.stats import StatsRecorder


class TorchCollectives:
    def __init__(self, process_group=None, stats: StatsRecorder | None = None, timeout_s: float = 300.0):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("TorchCollectives needs torch.distributed initialized (dist.init_process_group)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.stats = stats
        self.timeout_s = timeout_s

    def max_allreduce_async(self, vec, name):
        out = vec.clone()
        return _Handle(dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group, async_op=True), out)

    def allgather_async(self, payload, name):
        out = torch.empty(self.size * payload.numel(), dtype=payload.dtype, device=payload.device)
        parts = list(out.chunk(self.size)) if payload.numel() else [out[:0] for _ in range(self.size)]
        return _Handle(dist.all_gather(parts, payload.contiguous(), group=self.group, async_op=True), out)

    def alltoall_async(self, tensor, name):
        out = torch.empty_like(tensor)
        return _Handle(dist.all_to_all_single(out, tensor.contiguous(), group=self.group, async_op=True), out)

    def sum_async_(self, tensor, name):
        return _Handle(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), tensor)

    int8_sum_async_ = sum_async_

    def average_async_(self, tensor, name):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Handle(work, tensor, divide=self.size)

    def broadcast_async_(self, tensor, root, name):
        """In place, from `root` (a global rank in this group) to every rank of it."""
        return _Handle(dist.broadcast(tensor, src=root, group=self.group, async_op=True), tensor)

    @staticmethod
    def poll(handle) -> bool:
        return handle.work.is_completed()

    def wait(self, handle, what: str) -> torch.Tensor:
        with timed(self.stats):
            bounded_wait(handle.work.is_completed, self.timeout_s, lambda: self.timeout_message(what))
            try:
                handle.work.wait()
            except RuntimeError as exc:  # the group's own timeout (the DDP hook's is timeout_s), or a lost peer
                raise CollectiveTimeoutError(f"{self.timeout_message(what)} ({exc})") from None
        if handle.divide:
            handle.out.div_(handle.divide)
        return handle.out

    def timeout_message(self, what: str) -> str:
        ranks = "the default process group" if self.group is None else f"process group of ranks " \
            f"{dist.get_process_group_ranks(self.group)}"
        return (f"hvd_terngrad: rank {dist.get_rank()} waited {self.timeout_s:g} s for {what} over {ranks}, and "
                f"some rank of it never joined. Do all ranks use the same process group and the same TernGrad "
                f"options? A rank that stopped calling collectives mid-step does this as well. The bound is "
                f"timeout_s in the TernGrad options.")


class _Handle:
    __slots__ = ("work", "out", "divide")

    def __init__(self, work, out: torch.Tensor, divide: int = 0):
        self.work, self.out, self.divide = work, out, divide
