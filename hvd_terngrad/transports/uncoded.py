"""The group uncoded: its fp32 average in one allreduce, where transport="auto"'s plan says coding does not pay
(hvd_terngrad.auto). Not a transport a user names: it codes nothing, so it is not in TRANSPORTS.

With error feedback the residual goes along (g + r is averaged) and is then zero: nothing of it is lost. A
non-finite gradient makes the average non-finite on every rank alike; only then does a second collective
run, a Max allreduce of which rank's tensor was non-finite, so that the error names the tensor and the rank as
the coded path's does, at no cost in a healthy step.
"""
from __future__ import annotations

import torch

from hvd_terngrad.commcost import allreduce_bytes, allreduce_time
from hvd_terngrad.transports.base import Transport, destination


class _Sending:
    """An uncoded group in flight: its average, then (only if non-finite) which ranks were non-finite."""

    __slots__ = ("items", "rank", "key", "average", "result", "flags")

    def __init__(self, items, rank: int, key: str, average):
        self.items, self.rank, self.key = items, rank, key
        self.average = average  # the allreduce's handle
        self.result: torch.Tensor | None = None  # the average, once waited for
        self.flags = None  # the non-finite Max allreduce's handle, or False where the average is finite


class Uncoded(Transport):
    name = "fp32"
    needs_shared_scaler = False
    collective = "allreduce"
    auto_ok = False  # chosen by auto's plan (hvd_terngrad.auto), which weighs the codec time too

    def encode(self, coder, items):
        """The group's gradients (plus residuals) back to back in fp32; the residuals are then zero. The
        items go along: a non-finite average asks which of them were non-finite here."""
        dev = items[0].flat.device if items else torch.device("cpu")
        payload = torch.empty(sum(it.numel for it in items), dtype=torch.float32, device=dev)
        off = 0
        for it in items:
            it.offset = off
            part = payload[off: off + it.numel]
            part.copy_(it.flat)
            if it.residual is not None:
                part += it.residual
                it.residual.zero_()
            coder.stats.add_float(it.numel * 4, coder.size)
            off += it.numel
        return payload, items, coder.rank

    def start(self, comm, payload, key):
        values, items, rank = payload
        return _Sending(items, rank, key, comm.average_async_(values, name=f"terngrad.fp32.{key}"))

    def advance(self, comm, handle, what, block):
        """Once the average is here: if it is non-finite, start asking which ranks were."""
        if handle.flags is not None or not (block or comm.poll(handle.average)):
            return False
        handle.result = comm.wait(handle.average, f"the fp32 average of {what}")
        if bool(torch.isfinite(handle.result).all()):
            handle.flags = False
            return False
        mine = [float(handle.rank + 1) if not bool(torch.isfinite(it.flat).all()) else 0.0 for it in handle.items]
        handle.flags = comm.max_allreduce_async(torch.tensor(mine, dtype=torch.float32),
                                                name=f"terngrad.fp32.nonfinite.{handle.key}")
        return True

    def finish(self, comm, handle, what):
        self.advance(comm, handle, what, block=True)
        if handle.flags is not False:
            flags = comm.wait(handle.flags, f"the non-finite ranks of {what}").cpu().tolist()
            for it, f in zip(handle.items, flags):
                it.nonfinite_rank = int(f) - 1
        return handle.result

    def decode(self, coder, items, received, outs=None):
        out = []
        for i, it in enumerate(items):
            part = received[it.offset: it.offset + it.numel]
            dst = destination(outs, i)
            out.append(part if dst is None else dst.copy_(part))
        return out

    def submitted_bytes(self, numel, tensors):
        return 4.0 * numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(4.0 * numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(4.0 * numel, n_workers)


UNCODED = Uncoded()
