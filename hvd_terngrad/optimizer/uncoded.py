"""The optimizer's uncoded averages: the tensors never coded, the buckets transport="auto" sends uncoded, and
sparse gradients (Uncoded)."""
from __future__ import annotations

import torch

from hvd_terngrad.finite import nonfinite
from hvd_terngrad.transports.uncoded import half_scale


class Uncoded:
    """One step's gradients that travel uncoded: excluded or small tensors, and the buckets transport="auto"
    sends uncoded, as float averages; sparse gradients averaged exactly as Horovod averages them (an allgather
    of indices and values).

    A group (an uncoded bucket, or the step's tensors that are never coded) goes as one copy, once its last
    tensor is ready: its gradients back to back in a buffer kept from step to step, one collective and one check
    a group, where a tensor at a time costs a collective call each, and in fp32 two reads of its gradient for the
    check (measured: docs/notes/tta-log.md, "One average a group"). The copy leaves each rank's gradients as
    they were until the average is copied back, so whose gradient was non-finite is asked in a bad step only.
    - fp32: where the gradients are all contiguous fp32 tensors on one device (send_group).
    - fp16: each tensor at its scale in a slice of the buffer (transports.uncoded), where they are on one device.
      Where a tensor's average is not finite, the same Max allreduce asks whose gradient was, and where none
      was, the gradient outgrew its scale and every rank averages it again in fp32, in place. Its largest
      |average| is its next magnitude; one whose magnitude is not known goes by itself in fp32 and is measured.

    A float average that goes by itself (send_float: a tensor that cannot share a group's buffer, or one an fp16
    group measures) is made in place, as Horovod makes it, and checked (a sum: hvd_terngrad.finite) unless
    on_nonfinite="propagate" hands it on as it is. Where a non-finite average raises ("raise"), each rank
    checks its own gradient first, so that one more collective (a Max allreduce of rank + 1 per non-finite
    average) tells every rank whose gradient it was."""

    __slots__ = ("world", "size", "coder", "on_nonfinite", "kept", "floats", "flats", "halves", "sparse", "loose")

    def __init__(self, world, coder, on_nonfinite: str, kept: dict):
        self.world, self.coder = world, coder
        self.size = world.size  # read once a step: Horovod's is a call, and every tensor's scale needs it
        self.on_nonfinite = on_nonfinite  # TernGradConfig's: what the checks are for
        # (wire, group key) -> the buffer a group's average travels in, kept from step to step (the optimizer's):
        # an allocation costs more than the copy of a small group, and each step's averages are done before the
        # next step's start
        self.kept = kept
        # param -> (whether its gradient was non-finite here, the handle of its average, whether it is measured)
        self.floats: dict = {}
        self.flats: list = []  # fp32 groups: (what it is, names, the gradients' flat views, buffer, handle)
        self.halves: list = []  # fp16 groups: (what it is, [(name, gradient, scale)], buffer, handle)
        self.sparse: dict = {}  # param -> handle of its sparse average
        self.loose: set = set()  # the tensors never coded that are ready, where they wait for one another

    def send_group(self, key: str, what: str, params: list, names: list[str], grads: list[torch.Tensor],
                   wire: str) -> None:
        """A group's average in `wire` as one copy (class docstring), `what` naming it in a timeout; in fp32, a
        tensor that cannot share the buffer (another dtype or device, not contiguous) by itself beside it."""
        if wire == "fp16":
            self._send_half(key, what, params, names, grads)
            return
        device = next((g.device for g in grads if g.dtype == torch.float32), None)
        fits = [g.dtype == torch.float32 and g.is_contiguous() and g.device == device for g in grads]
        if not all(fits):
            for p, name, g, fit in zip(params, names, grads, fits):
                if not fit:
                    self.send_float(p, name, g)
            names, grads = [n for n, fit in zip(names, fits) if fit], [g for g, fit in zip(grads, fits) if fit]
            if not grads:
                return
        views = [g.view(-1) for g in grads]
        flat = self._buffer("fp32", key, sum(v.numel() for v in views), device)
        torch.cat(views, out=flat)
        self.coder.stats.add_float(flat.numel() * 4, self.size, tensors=len(grads))
        self.flats.append((what, names, views, flat, self.world.average_async_(flat, name=f"terngrad.fp32.{key}")))

    def send_float(self, p, name: str, g: torch.Tensor, measure: bool = False) -> None:
        self.coder.stats.add_float(g.numel() * g.element_size(), self.size)
        mine = self.on_nonfinite == "raise" and bool(nonfinite([g]))
        self.floats[p] = (mine, self.world.average_async_(g, name=f"terngrad.float.{name}"), measure)

    def _send_half(self, key: str, what: str, params: list, names: list[str], grads: list[torch.Tensor]) -> None:
        """The fp16 group: the tensors whose magnitude is known at their scales in one copy (each by itself where
        they are not on one device), the others by themselves in fp32, measured."""
        members = []
        for p, name, g in zip(params, names, grads):
            scale = half_scale(self.coder.magnitude(name), self.size)
            if scale is None:
                self.send_float(p, name, g, measure=True)
            else:
                members.append((name, g, scale))
        if len({g.device for _, g, _ in members}) > 1:
            for m in members:
                self._send_halves(m[0], repr(m[0]), [m])
        elif members:
            self._send_halves(key, what, members)

    def _send_halves(self, key: str, what: str, members: list) -> None:
        buf = self._buffer("fp16", key, sum(g.numel() for _, g, _ in members), members[0][1].device)
        self.coder.codec.to_halves([g for _, g, _ in members], [scale for _, _, scale in members], buf)
        self.coder.stats.add_float(buf.numel() * 2, self.size, tensors=len(members))
        self.halves.append((what, members, buf, self.world.average_async_(buf, name=f"terngrad.fp16.{key}")))

    def _buffer(self, wire: str, key: str, n: int, device) -> torch.Tensor:
        """The kept buffer of a group's average in `wire`, remade where its size or device changed."""
        buf = self.kept.get((wire, key))
        if buf is None or buf.numel() != n or buf.device != device:
            dtype = torch.float16 if wire == "fp16" else torch.float32
            buf = self.kept[(wire, key)] = torch.empty(n, dtype=dtype, device=device)
        return buf

    def send_sparse(self, p, name: str) -> None:
        g = p.grad
        self.coder.stats.add_float(g._indices().numel() * 8 + g._values().numel() * g.element_size(),
                                   self.size)
        self.sparse[p] = self.world.sparse_average_async(g, name=f"terngrad.sparse.{name}")

    def finish(self, name_of: dict) -> list[tuple[str, int]]:
        """Wait for every average and put it in place; (name, the non-finite rank or -1 where not known) of those
        that are non-finite."""
        bad = []
        for p, h in self.sparse.items():
            avg = self.world.sparse_average(h, f"the sparse average of {name_of[p]!r}")
            p.grad.zero_().add_(avg)  # as Horovod: a sparse tensor has no set_()
            if not bool(torch.isfinite(avg._values()).all()):
                bad.append((name_of[p], -1))
        floats = [(name_of[p], mine, h, measure) for p, (mine, h, measure) in self.floats.items()]
        waited = [(what, h) for what, _, _, _, h in self.flats] + [(repr(f[0]), f[2]) for f in floats] \
            + [(what, h) for what, _, _, h in self.halves]
        done = self.world.wait_all([h for _, h in waited], lambda i: f"the float average of {waited[i][0]}")
        k, m = len(self.flats), len(self.flats) + len(floats)
        flat_bad = self._unflatten(done[:k])
        averages = done[k:m]
        halves = [member for _, members, _, _ in self.halves for member in members]  # (name, gradient, scale)
        culprit, outgrown = self._checked(floats, averages), self._unscaled(done[m:])
        raising = self.on_nonfinite == "raise"
        ask, flat_ask = (culprit, flat_bad) if raising else ([], [])
        if not (ask or flat_ask or outgrown):
            return bad + [(floats[i][0], -1) for i in culprit] + [(name, -1) for name, _ in flat_bad]
        me = float(self.world.rank + 1)
        mine = [me if floats[i][1] else 0.0 for i in ask] + [me if own else 0.0 for _, own in flat_ask] \
            + [me if nonfinite([halves[i][1]]) else 0.0 for i in outgrown]
        ranks = self.world.wait(self.world.max_allreduce_async(torch.tensor(mine), name="terngrad.float.nonfinite"),
                                "the non-finite ranks of the float averages").tolist()
        bad += [(floats[i][0], int(r) - 1) for i, r in zip(ask, ranks)]
        bad += [(name, int(r) - 1) for (name, _), r in zip(flat_ask, ranks[len(ask):])]
        bad += [(floats[i][0], -1) for i in culprit if i not in ask]
        bad += [(name, -1) for name, _ in flat_bad if not raising]
        redo = []
        halved = [part for (_, members, _, _), avg in zip(self.halves, done[m:])
                  for part in avg.split([g.numel() for _, g, _ in members])]
        for i, r in zip(outgrown, ranks[len(ask) + len(flat_ask):]):
            name, g, scale = halves[i]
            if r:  # a rank's gradient was not finite: its average is handed on as it is
                self.coder.codec.from_half(halved[i], scale, out=g)
                bad.append((name, int(r) - 1))
            else:
                redo.append((name, g))
        return bad + self._redo(redo)

    def _unflatten(self, averages: list[torch.Tensor]) -> list[tuple[str, bool]]:
        """Each group's flat average copied back into its gradients; (name, whether this rank's gradient was
        non-finite) of the tensors whose average is not finite (none looked for with "propagate"). A rank's
        gradients are its own until the copy back, so only a bad step reads them."""
        bad = []
        for (_, names, views, _, _), flat in zip(self.flats, averages):
            parts = list(flat.split([v.numel() for v in views]))
            if self.on_nonfinite != "propagate" and nonfinite([flat]):
                bad += [(names[i], bool(nonfinite([views[i]]))) for i in nonfinite(parts)]
            torch._foreach_copy_(views, parts)
        return bad

    def _checked(self, floats: list, averages: list) -> list[int]:
        """The indices of the float averages that are not finite (none looked for with "propagate", but those
        measured, whose largest |average| becomes their magnitude)."""
        culprit = []
        for i, ((name, _, _, measure), avg) in enumerate(zip(floats, averages)):
            if measure:
                if self.coder.measure(name, avg):
                    continue
            elif self.on_nonfinite == "propagate" or not nonfinite([avg]):
                continue
            culprit.append(i)
        return culprit

    def _unscaled(self, averages: list[torch.Tensor]) -> list[int]:
        """Each fp16 group's average divided into its gradients, in one pass of the codec a group, and each
        finite one's largest |average| its tensor's next magnitude; the indices (over the groups' members, in
        order) of the others (a NaN somewhere, or a gradient past its scale), whose gradients stay as they were
        until the ranks have said whose it was."""
        found = []
        for (_, members, _, _), avg in zip(self.halves, averages):
            found += zip(members, self.coder.codec.from_halves(avg, [g.numel() for _, g, _ in members],
                                                               [s for _, _, s in members], [g for _, g, _ in members],
                                                               only_finite=True))
        return [i for i, ((name, _, _), m) in enumerate(found) if not self.coder.note_magnitude(name, m)]

    def _redo(self, outgrown: list) -> list[tuple[str, int]]:
        """The (name, gradient) whose fp16 averages outgrew their scale, averaged again in fp32 in place, on every
        rank alike; the non-finite ones among them (finite values whose sum is not)."""
        if not outgrown:
            return []
        handles = [self.world.average_async_(g, name=f"terngrad.fp32.outgrown.{name}") for name, g in outgrown]
        averages = self.world.wait_all(handles, lambda i: f"the fp32 average of {outgrown[i][0]!r}, which outgrew fp16")
        return [(name, -1) for (name, _), avg in zip(outgrown, averages) if not self.coder.measure(name, avg)]
