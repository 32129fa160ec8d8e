"""The group uncoded: its average in one allreduce, in fp32 or in 16 bits, where transport="auto"'s plan says
coding does not pay (hvd_terngrad.auto; the trial keeps whichever wire ran faster). Not a transport a user
names: it codes nothing, so it is not in TRANSPORTS.

With error feedback the residual goes along (g + r is averaged) and is then zero: nothing of it is lost. A
non-finite gradient makes the average non-finite on every rank alike; only then does a second collective run,
a Max allreduce of which rank's tensor was non-finite, so that the error names the tensor and the rank as the
coded path's does.

fp32 (FP32): a group whose gradients lie back to back in one fp32 buffer (a DDP bucket) is averaged in place,
as DDP's own allreduce does; any other is copied into one tensor first (fp64 where one of its gradients is
fp64: those are averaged at their own precision, as DDP averages them). In place, a rank checks its buffer
before the average (one read); a copy can be checked after, in a bad step only.

fp16 (FP16, half the bytes): each tensor is multiplied by a power of two before it is rounded to fp16 and divided
by it after, both exact (half_scale), each way one pass of the codec a group (Codec.to_halves, Codec.from_halves,
which also finds each one's largest |value|). The scale comes from the tensor's magnitude, which every rank knows
alike: its shared scaler where it was last coded, else the largest |average| of its last 16-bit average
(Coder.magnitude). A tensor whose magnitude is not known yet, or is zero, goes beside them in an fp32 average,
which measures it. The average is a copy, so the rank's gradient stays for a second look: where an average is not
finite and no rank's gradient was, the gradient outgrew the scale's headroom, and every rank averages that tensor
again in fp32 in the same step. Nothing is lost or clipped; what fp16's 11 significant bits round is not fed back
into error feedback's residual (a relative 2^-11, against a 2-bit code's whole scaler).

bf16 (BF16, half the bytes, fp32's exponent range): a copy, rounded to bf16 with no scale, for the front ends whose
collectives sum bf16 (torch.distributed; Horovod's allreduce takes no bf16), and so only where the front end
offers it (hvd_terngrad.auto, AutoPlan.offer: the DDP hook, whose C++ path averages it as this does, to the
bit where N is a power of two). What its 8 significant bits round is not fed back either (a relative 2^-8).
A non-finite average is found and named as fp32's copy is.
"""
from __future__ import annotations

import math

import torch

from hvd_terngrad.commcost import allreduce_bytes, allreduce_time
from hvd_terngrad.finite import absmax, nonfinite
from hvd_terngrad.transports.base import Transport, destination

# The room a 16-bit average leaves: the scale puts N * HALF_HEADROOM * magnitude at 2^15 or just under (_HALF_TOP),
# so N ranks' values of up to 2 * HALF_HEADROOM times the magnitude still sum below fp16's largest (65504), while
# values down to N * HALF_HEADROOM * 2^-28 of the magnitude (2^-21 at N = 4, 2^-14 at N = 512) stay normal fp16
HALF_HEADROOM = 32
_HALF_TOP = 2.0 ** 15


def half_scale(magnitude: float | None, size: int) -> float | None:
    """The power of two a tensor of this magnitude is multiplied by before it travels in fp16 among `size` ranks
    (the same on every rank, which knows the same magnitude); None where the magnitude is unknown, zero or not
    finite (then the tensor travels in fp32)."""
    if magnitude is None or not 0.0 < magnitude < math.inf:
        return None
    e = math.floor(math.log2(_HALF_TOP / (size * HALF_HEADROOM * magnitude)))
    return math.ldexp(1.0, max(-120, min(120, e)))  # within fp32's normal range, and its inverse too


class _Sending:
    """An uncoded group in flight: its averages, then (only if one is not finite) which ranks were non-finite,
    then (fp16, only where no rank was) the fp32 average of the tensors that outgrew their scale."""

    __slots__ = ("items", "rank", "key", "codec", "scales", "averages", "whole", "halves", "parts", "absmax", "bad",
                 "mine", "flags", "redone", "done")

    def __init__(self, items, rank: int, key: str, codec, scales, mine):
        self.items, self.rank, self.key = items, rank, key
        self.codec = codec  # the coder's, which reads the fp16 averages back
        self.scales = scales  # fp16: each item's power of two (half_scale), None where it travels in fp32
        self.averages: list = []  # the allreduces in flight: (handle, the indices of the items it averages)
        self.whole: torch.Tensor | None = None  # the last average received, whole
        self.halves: tuple | None = None  # fp16 wire: (the fp16 average received, whole; the indices of its items)
        self.parts: dict[int, torch.Tensor] = {}  # item index -> its average (fp16 at its scale, or fp32)
        self.absmax: dict[int, float] = {}  # fp16 wire: item index -> its largest |average| (its next magnitude)
        self.bad: list[int] = []  # the items whose average is not finite
        self.mine = mine  # this rank's non-finite flags, where known before the average (in place)
        self.flags = None  # the non-finite Max allreduce's handle, while in flight
        self.redone: list[int] = []  # fp16 wire: the items averaged again in fp32, having outgrown their scale
        self.done = False


class Uncoded(Transport):
    needs_shared_scaler = False
    collective = "allreduce"
    auto_ok = False  # chosen by auto's plan (hvd_terngrad.auto), which weighs the codec time too

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        self.element_bytes = torch.finfo(dtype).bits // 8

    def encode(self, coder, items):
        """The group's gradients (their residuals merged in: Coder.plain), to average. fp32: one tensor, in place
        where they lie back to back in one fp32 buffer (a DDP bucket), else a copy. bf16: a copy. fp16: a copy,
        each tensor at its scale, and the tensors whose magnitude is not known (or zero) in a second copy, in fp32. A
        non-finite average asks which of them were non-finite here, which a copy can tell afterwards and in
        place must be known before."""
        if self.dtype is torch.float16:
            scales = [half_scale(coder.magnitude(it.name), coder.size) for it in items]
            known = [i for i, s in enumerate(scales) if s is not None]
            values = torch.empty(sum(items[i].numel for i in known), dtype=torch.float16, device=items[0].flat.device)
            coder.codec.to_halves([items[i].flat for i in known], [scales[i] for i in known], values)
            coder.stats.add_float(values.numel() * 2, coder.size, tensors=len(known))
            unknown = [i for i, s in enumerate(scales) if s is None]
            for i in unknown:
                coder.stats.add_float(items[i].numel * 4, coder.size)
            return [(values, known), (_fp32_copy(items, unknown), unknown)], items, coder, None, scales
        for it in items:
            coder.stats.add_float(it.numel * self.element_bytes, coder.size)
        if self.dtype is torch.bfloat16:
            return [(_bf16_copy(items), list(range(len(items))))], items, coder, None, None
        values = _span(items)
        flags = None
        if values is None:
            values = _fp32_copy(items, range(len(items)))
        elif nonfinite([values]):
            flags = _nonfinite(items, coder.rank)
        return [(values, list(range(len(items))))], items, coder, flags, None

    def start(self, comm, payload, key):
        parts, items, coder, flags, scales = payload
        h = _Sending(items, coder.rank, key, coder.codec, scales, flags)
        for (values, idx), name in zip(parts, (f"terngrad.{self.name}.{key}", f"terngrad.fp32.measured.{key}")):
            if idx:
                h.averages.append((comm.average_async_(values, name=name), idx))
        return h

    def advance(self, comm, handle, what, block):
        """Move on once the collectives in flight are done: the averages (one not finite: ask which ranks were),
        the ranks' flags (fp16: average again in fp32 what no rank's gradient made non-finite); whether it
        started another collective."""
        h = handle
        if h.done:
            return False
        if h.flags is not None:
            if not (block or comm.poll(h.flags)):
                return False
            for it, f in zip(h.items, comm.wait(h.flags, f"the non-finite ranks of {what}").cpu().tolist()):
                it.nonfinite_rank = int(f) - 1
            h.flags = None
            h.redone = [i for i in h.bad if h.items[i].nonfinite_rank < 0 and self._scaled(h, i)]
            if not h.redone:
                h.done = True
                return False
            h.averages = [(comm.average_async_(_fp32_copy(h.items, h.redone), name=f"terngrad.fp32.outgrown.{h.key}"),
                           h.redone)]
            return True
        if not (block or all(comm.poll(a) for a, _ in h.averages)):
            return False
        for a, idx in h.averages:
            received, off = comm.wait(a, f"the {self.name} average of {what}"), 0
            h.whole = received
            if received.dtype == torch.float16:
                h.halves = (received, idx)
            for i in idx:
                h.parts[i], off = received[off: off + h.items[i].numel], off + h.items[i].numel
        redoing, h.averages = bool(h.redone), []
        if redoing:  # the outgrown ones' fp32 averages: their magnitudes from them
            h.absmax.update({i: absmax(h.parts[i]) for i in h.redone})
            h.done = True
            return False
        h.bad = self._nonfinite_parts(h)
        if not h.bad:
            h.done = True
            return False
        mine = h.mine if h.mine is not None else _nonfinite(h.items, h.rank)
        h.flags = comm.max_allreduce_async(mine, name=f"terngrad.{self.name}.nonfinite.{h.key}")
        return True

    def _scaled(self, h, i: int) -> bool:
        """Whether item i's average came in fp16 at its scale (not yet redone in fp32)."""
        return h.scales is not None and h.scales[i] is not None and i not in h.redone

    def _nonfinite_parts(self, h) -> list[int]:
        """The items whose average is not finite (fp16 wire: each one's largest |average| kept, its next
        magnitude)."""
        if h.scales is None:
            # one sum over the whole average first: a finite step costs no more (fp32 has one average)
            return nonfinite([h.parts[i] for i in range(len(h.items))]) if nonfinite([h.whole]) else []
        if h.halves is not None:  # one pass of the codec for the group's fp16 average
            received, idx = h.halves
            h.absmax.update(zip(idx, h.codec.from_halves(received, [h.items[i].numel for i in idx],
                                                         [h.scales[i] for i in idx])))
        for i in range(len(h.items)):
            if i not in h.absmax:
                h.absmax[i] = absmax(h.parts[i])
        return [i for i, m in h.absmax.items() if not math.isfinite(m)]

    def finish(self, comm, handle, what):
        while not handle.done:
            self.advance(comm, handle, what, block=True)
        return handle

    def decode(self, coder, items, received, outs=None):
        """Each item's average (fp32, flat), into outs where given: divided by its scale where it came in fp16.
        fp16 wire: each one's largest |average| becomes its magnitude (not a NaN's; a zero's, which sends it in
        fp32 next time)."""
        h = received
        out = [destination(outs, i) for i in range(len(items))]
        halves = [i for i in range(len(items)) if h.parts[i].dtype == torch.float16]
        for i in halves:
            if out[i] is None:
                out[i] = torch.empty(h.parts[i].shape, dtype=torch.float32, device=h.parts[i].device)
        if halves:  # the group's fp16 average in one pass; the slices of those redone in fp32 are not written
            received, idx = h.halves
            coder.codec.from_halves(received, [items[i].numel for i in idx], [h.scales[i] for i in idx],
                                    [out[i] if h.parts[i].dtype == torch.float16 else None for i in idx])
        for i, it in enumerate(items):
            part = h.parts[i]
            if part.dtype != torch.float16:
                if out[i] is None:
                    out[i] = part if part.dtype == torch.float64 else part.float()  # bf16 read back; fp32 as is
                elif out[i].data_ptr() != part.data_ptr():
                    out[i].copy_(part)
            if i in h.absmax:
                coder.note_magnitude(it.name, h.absmax[i])
        return out

    def submitted_bytes(self, numel, tensors):
        return float(self.element_bytes * numel)

    def seconds(self, numel, n_workers, link):
        return allreduce_time(float(self.element_bytes * numel), n_workers, link)

    def wire_bytes(self, numel, tensors, n_workers):
        return allreduce_bytes(float(self.element_bytes * numel), n_workers)


FP32 = Uncoded(torch.float32)
FP16 = Uncoded(torch.float16)
BF16 = Uncoded(torch.bfloat16)
UNCODED = {t.name: t for t in (FP32, FP16, BF16)}  # what auto's plans send an uncoded group in
WIRES = (FP32.name, FP16.name)  # the wires every front end's collectives average in (Horovod's allreduce takes no bf16)


def _fp32_copy(items, indices) -> torch.Tensor:
    """The gradients of items[indices], back to back in one fp32 tensor (a copy); in fp64 where one of them is
    fp64, which is averaged at its own precision, as DDP's allreduce averages it."""
    if not indices:
        return torch.empty(0)
    wide = any(items[i].flat.dtype == torch.float64 for i in indices)
    return torch.cat([items[i].flat.reshape(-1).to(torch.float64 if wide else torch.float32) for i in indices])


def _bf16_copy(items) -> torch.Tensor:
    """The items' gradients, back to back in one bf16 tensor: each rounded as it is copied (one pass)."""
    out = torch.empty(sum(it.numel for it in items), dtype=torch.bfloat16, device=items[0].flat.device)
    off = 0
    for it in items:
        out[off: off + it.numel].copy_(it.flat.reshape(-1))
        off += it.numel
    return out


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
