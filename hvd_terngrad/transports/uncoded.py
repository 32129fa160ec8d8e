"""The group uncoded: its average in one allreduce, in fp32 or in 16 bits, where transport="auto"'s plan says
coding does not pay (hvd_terngrad.auto; the trial keeps whichever wire ran faster). Not a transport a user
names: it codes nothing, so it is not in TRANSPORTS.

With error feedback the residual goes along (g + r is averaged) and is then zero: nothing of it is lost. A
non-finite gradient makes the average non-finite on every rank alike; only then does a second collective run,
a Max allreduce of which rank's tensor was non-finite, so that the error names the tensor and the rank as the
coded path's does.

fp32 (FP32): a group whose gradients lie back to back in one fp32 buffer (a DDP bucket) is averaged in place,
as DDP's own allreduce does; any other is copied into one tensor first. In place, a rank checks its buffer
before the average (one read); a copy can be checked after, in a bad step only.

fp16 (FP16, half the bytes): each tensor is multiplied by a power of two before it is rounded to fp16 and
divided by it after, both exact (half_scale). The scale comes from the tensor's magnitude, which every rank
knows alike: its shared scaler where it was last coded, else the largest |average| of its last 16-bit average
(Coder.magnitude). A tensor whose magnitude is not known yet, or is zero, goes in fp32 with its group, which then
measures it (FP32_MEASURED). The average is a copy, so the rank's gradient stays for a second look: where an average is
not finite and no rank's gradient was, the gradient outgrew the scale's headroom, and every rank averages that
tensor again in fp32 in the same step. Nothing is lost or clipped; what fp16's 11 significant bits round is not
fed back into error feedback's residual (a relative 2^-11, against a 2-bit code's whole scaler).
"""
from __future__ import annotations

import math

import torch

from hvd_terngrad.commcost import allreduce_bytes, allreduce_time
from hvd_terngrad.finite import nonfinite
from hvd_terngrad.transports.base import Transport, destination

# How far past its magnitude a rank's values may grow before a 16-bit average overflows: N ranks' values of up to
# 2 * HALF_HEADROOM times the magnitude still sum below fp16's largest (65504), and values down to about 2^-22 of
# the magnitude (N = 4; 2^-14 at N = 512) stay normal
HALF_HEADROOM = 32
_HALF_TOP = 2.0 ** 15  # where N * HALF_HEADROOM * magnitude is put, at most: half of fp16's range


def half_scale(magnitude: float | None, size: int) -> float | None:
    """The power of two a tensor of this magnitude is multiplied by before it travels in fp16 among `size` ranks
    (the same on every rank, which knows the same magnitude); None where the magnitude is unknown, zero or not
    finite (then the tensor travels in fp32)."""
    if magnitude is None or not 0.0 < magnitude < math.inf:
        return None
    e = math.floor(math.log2(_HALF_TOP / (size * HALF_HEADROOM * magnitude)))
    return math.ldexp(1.0, max(-120, min(120, e)))  # within fp32's normal range, and its inverse too


def to_half(x: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * scale rounded to fp16 (one pass; the product in fp32, exact for a power of two)."""
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device) if out is None else out
    return torch.mul(x, _factor(scale, x.device), out=out)


def from_half(h: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """h / scale in fp32 (one pass, exact; into out, of any float dtype)."""
    out = torch.empty(h.shape, dtype=torch.float32, device=h.device) if out is None else out
    return torch.mul(h, _factor(1.0 / scale, h.device), out=out)


def absmax(x: torch.Tensor) -> float:
    """The largest |x| (NaN where x holds NaN), one pass: aminmax, which carries NaN."""
    if not x.numel():
        return 0.0
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi)) if not math.isnan(float(lo)) else math.nan


def _factor(value: float, device) -> torch.Tensor:
    # a 1-element fp32 tensor, not a Python number: it makes the product fp32 whatever x's dtype (a number would
    # leave fp16 * number in fp16, where the divided values would leave the normal range)
    return torch.tensor([value], dtype=torch.float32, device=device)


class _Sending:
    """An uncoded group in flight: its average, then (only if non-finite) which ranks were non-finite, then (fp16,
    only where no rank was) the fp32 average of the tensors that outgrew their scale."""

    __slots__ = ("items", "rank", "key", "scales", "average", "result", "absmax", "bad", "mine", "flags", "redo",
                 "redone", "done")

    def __init__(self, items, rank: int, key: str, scales, average, mine):
        self.items, self.rank, self.key = items, rank, key
        self.scales = scales  # fp16: each item's power of two (half_scale); None for fp32
        self.average = average  # the allreduce's handle
        self.result: torch.Tensor | None = None  # the average, once waited for
        self.absmax: list[float] = []  # fp16: each item's largest |average| (its next magnitude)
        self.bad: list[int] = []  # the items whose average is not finite
        self.mine = mine  # this rank's non-finite flags, where known before the average (in place)
        self.flags = None  # the non-finite Max allreduce's handle, while in flight
        self.redo = None  # fp16: (the fp32 average's handle, the indices of the items it averages), in flight
        self.redone: dict[int, torch.Tensor] = {}  # fp16: item index -> its fp32 average, where redone
        self.done = False


class Uncoded(Transport):
    needs_shared_scaler = False
    collective = "allreduce"
    auto_ok = False  # chosen by auto's plan (hvd_terngrad.auto), which weighs the codec time too

    def __init__(self, dtype: torch.dtype, measures: bool = False):
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.float16: "fp16"}[dtype]
        self.element_bytes = torch.finfo(dtype).bits // 8
        # whether each tensor's largest |average| is taken as its magnitude (an aminmax each, in place of one
        # sum over the group): fp16's next scale, or an fp32 group's whose tensors' magnitudes are not known yet
        self.measures = measures or dtype is torch.float16

    def encode(self, coder, items):
        """The group's gradients (their residuals merged in: Coder.plain) as one tensor to average. fp32: in place
        where they lie back to back in one fp32 buffer (a DDP bucket), else a copy. fp16: a copy, each tensor at
        its scale. The items go along: a non-finite average asks which of them were non-finite here, which a copy
        can tell afterwards and in place must be known before."""
        off = 0
        for it in items:
            coder.stats.add_float(it.numel * self.element_bytes, coder.size)
            it.offset, off = off, off + it.numel
        if self.dtype is torch.float16:
            scales = [half_scale(coder.magnitude(it.name), coder.size) for it in items]
            values = torch.empty(off, dtype=torch.float16, device=items[0].flat.device)
            for it, s in zip(items, scales):
                to_half(it.flat, s, out=values[it.offset: it.offset + it.numel])
            return values, items, coder.rank, None, scales
        values = _span(items)
        flags = None
        if values is None:
            values = torch.cat([it.flat.reshape(-1).float() for it in items])
        elif nonfinite([values]):
            flags = _nonfinite(items, coder.rank)
        return values, items, coder.rank, flags, None

    def start(self, comm, payload, key):
        values, items, rank, flags, scales = payload
        return _Sending(items, rank, key, scales, comm.average_async_(values, name=f"terngrad.{self.name}.{key}"),
                        flags)

    def advance(self, comm, handle, what, block):
        """Move on once the collective in flight is done: the average (non-finite: ask which ranks were), the
        ranks' flags (fp16: average again in fp32 what no rank's gradient made non-finite); whether it moved."""
        h = handle
        if h.done:
            return False
        if h.flags is None and h.redo is None:  # the average in flight
            if not (block or comm.poll(h.average)):
                return False
            h.result = comm.wait(h.average, f"the {self.name} average of {what}")
            h.bad = self._nonfinite_parts(h)
            if not h.bad:
                h.done = True
                return False
            mine = h.mine if h.mine is not None else _nonfinite(h.items, h.rank)
            h.flags = comm.max_allreduce_async(mine, name=f"terngrad.{self.name}.nonfinite.{h.key}")
            return True
        if h.flags is not None:
            if not (block or comm.poll(h.flags)):
                return False
            for it, f in zip(h.items, comm.wait(h.flags, f"the non-finite ranks of {what}").cpu().tolist()):
                it.nonfinite_rank = int(f) - 1
            h.flags = None
            outgrown = [i for i in h.bad if h.items[i].nonfinite_rank < 0] if h.scales is not None else []
            if not outgrown:
                h.done = True
                return True
            values = torch.cat([h.items[i].flat.reshape(-1).float() for i in outgrown])
            h.redo = (comm.average_async_(values, name=f"terngrad.fp32.outgrown.{h.key}"), outgrown)
            return True
        if not (block or comm.poll(h.redo[0])):
            return False
        redone, off = comm.wait(h.redo[0], f"the fp32 average of {what}, which outgrew fp16"), 0
        for i in h.redo[1]:
            n = h.items[i].numel
            h.redone[i], off = redone[off: off + n], off + n
        h.redo, h.done = None, True
        return True

    def _nonfinite_parts(self, h) -> list[int]:
        """The items whose average is not finite (fp16: each one's largest |average| kept, its next magnitude)."""
        if not self.measures:
            if not nonfinite([h.result]):
                return []
            return nonfinite([h.result[it.offset: it.offset + it.numel] for it in h.items])
        scales = h.scales or [1.0] * len(h.items)
        h.absmax = [absmax(h.result[it.offset: it.offset + it.numel]) / s for it, s in zip(h.items, scales)]
        return [i for i, m in enumerate(h.absmax) if not math.isfinite(m)]

    def finish(self, comm, handle, what):
        while self.advance(comm, handle, what, block=True):
            pass
        return handle

    def decode(self, coder, items, received, outs=None):
        """Each item's average (fp32, flat), into outs where given. fp16: divided by its scale, or its fp32
        average where it was redone; its largest |average| becomes its magnitude."""
        h = received
        out = []
        for i, it in enumerate(items):
            dst = destination(outs, i)
            if h.scales is None or i in h.redone:
                part = h.redone[i] if i in h.redone else h.result[it.offset: it.offset + it.numel]
                if dst is not None and dst.data_ptr() != part.data_ptr():
                    dst.copy_(part)
            else:
                part = from_half(h.result[it.offset: it.offset + it.numel], h.scales[i], out=dst)
            out.append(part if dst is None else dst)
            if self.measures:
                m = absmax(h.redone[i]) if i in h.redone else h.absmax[i]
                if math.isfinite(m):  # zero too: such a tensor is measured again in fp32
                    coder.magnitudes[it.name] = m
        return out

    def submitted_bytes(self, numel, tensors):
        return float(self.element_bytes * numel)

    def seconds(self, numel, n_workers, link):
        return allreduce_time(float(self.element_bytes * numel), n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(float(self.element_bytes * numel), n_workers)


FP32 = Uncoded(torch.float32)
FP32_MEASURED = Uncoded(torch.float32, measures=True)
FP16 = Uncoded(torch.float16)
WIRES = ("fp32", "fp16")  # what auto's plans send an uncoded group in


def uncoded_transport(wire: str, coder, items) -> Uncoded:
    """How a group travels that auto's plan sends uncoded on `wire`: in fp16 where every tensor's magnitude is
    known and not zero, else in fp32 (measuring the magnitudes where the wire is fp16)."""
    if wire == "fp32":
        return FP32
    known = all(half_scale(coder.magnitude(it.name), coder.size) is not None for it in items)
    return FP16 if known else FP32_MEASURED


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
