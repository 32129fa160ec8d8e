"""The group uncoded: its fp32 average in one allreduce, where transport="auto"'s plan says coding does not pay
(hvd_terngrad.auto). Not a transport a user names: it codes nothing, so it is not in TRANSPORTS.

With error feedback the residual goes along (g + r is averaged) and is then zero: nothing of it is lost. A
group whose gradients lie back to back in one fp32 buffer (a DDP bucket) is averaged in place, as DDP's own
allreduce does; any other is copied into one tensor first. A non-finite gradient makes the average
non-finite on every rank alike; only then does a second collective run, a Max allreduce of which rank's
tensor was non-finite, so that the error names the tensor and the rank as the coded path's does. In place,
a rank checks its buffer before the average (one read); a copy can be checked after, in a bad step only.
"""
from __future__ import annotations

import torch

from hvd_terngrad.commcost import allreduce_bytes, allreduce_time
from hvd_terngrad.finite import nonfinite
from hvd_terngrad.transports.base import Transport, destination


class _Sending:
    """An uncoded group in flight: its average, then (only if non-finite) which ranks were non-finite."""

    __slots__ = ("items", "rank", "key", "average", "result", "mine", "flags")

    def __init__(self, items, rank: int, key: str, average):
        self.items, self.rank, self.key = items, rank, key
        self.average = average  # the allreduce's handle
        self.result: torch.Tensor | None = None  # the average, once waited for
        self.mine: torch.Tensor | None = None  # this rank's non-finite flags, where known before the average
        self.flags = None  # the non-finite Max allreduce's handle, or False where the average is finite


class Uncoded(Transport):
    name = "fp32"
    needs_shared_scaler = False
    collective = "allreduce"
    auto_ok = False  # chosen by auto's plan (hvd_terngrad.auto), which weighs the codec time too

    def encode(self, coder, items):
        """The group's gradients (their residuals merged in: Coder.plain) as one fp32 tensor to average: in
        place where they lie back to back in one fp32 buffer (a DDP bucket), else a copy. The items go along: a
        non-finite average asks which of them were non-finite here, which a copy can tell afterwards and in
        place must be known before."""
        for it in items:
            coder.stats.add_float(it.numel * 4, coder.size)
        values = _span(items)
        flags = None
        if values is None:
            values = torch.cat([it.flat.reshape(-1).float() for it in items])
        elif nonfinite([values]):
            flags = _nonfinite(items, coder.rank)
        off = 0
        for it in items:
            it.offset, off = off, off + it.numel
        return values, items, coder.rank, flags

    def start(self, comm, payload, key):
        values, items, rank, flags = payload
        sending = _Sending(items, rank, key, comm.average_async_(values, name=f"terngrad.fp32.{key}"))
        sending.mine = flags
        return sending

    def advance(self, comm, handle, what, block):
        """Once the average is here: if it is non-finite, start asking which ranks were."""
        if handle.flags is not None or not (block or comm.poll(handle.average)):
            return False
        handle.result = comm.wait(handle.average, f"the fp32 average of {what}")
        if not nonfinite([handle.result]):
            handle.flags = False
            return False
        mine = handle.mine if handle.mine is not None else _nonfinite(handle.items, handle.rank)
        handle.flags = comm.max_allreduce_async(mine, name=f"terngrad.fp32.nonfinite.{handle.key}")
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
            if dst is not None and dst.data_ptr() != part.data_ptr():
                dst.copy_(part)
            out.append(part if dst is None else dst)
        return out

    def submitted_bytes(self, numel, tensors):
        return 4.0 * numel

    def seconds(self, numel, n_workers, link):
        return allreduce_time(4.0 * numel, n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(4.0 * numel, n_workers)


UNCODED = Uncoded()


def _span(items) -> torch.Tensor | None:
    """The items' gradients as one fp32 view, where they lie back to back in one buffer, else None."""
    first = items[0].flat
    ptr = first.data_ptr()
    for it in items:
        if it.flat.dtype != torch.float32 or not it.flat.is_contiguous() or it.flat.data_ptr() != ptr:
            return None
        ptr += 4 * it.numel
    return first.as_strided((sum(it.numel for it in items),), (1,))


def _nonfinite(items, rank: int) -> torch.Tensor:
    """Per item, rank + 1 where this rank's gradient is non-finite, else 0 (fp32, for a Max allreduce)."""
    flags = torch.zeros(len(items), dtype=torch.float32)
    flags[nonfinite([it.flat for it in items])] = float(rank + 1)
    return flags
