"""hvd_terngrad.DistributedOptimizer: TernGrad with buckets and overlap, the signature of hvd.DistributedOptimizer.

What it does that the stock optimizer with compression=TernGrad(...) cannot:
- Buckets: coded gradients are grouped (in backward order) into buckets of about `bucket_bytes`; a
  bucket shares its scalers in one Max allreduce and sends its codes in one allgather, so a model with many
  small tensors pays one latency per bucket, not two per tensor.
- No blocking in backward: the scaler allreduce is asynchronous; later hooks poll it and start the
  bucket's allgather as soon as it is done, overlapping coding and communication with the backward pass.
- It owns the step, so on_nonfinite="skip" can skip the update on every rank.

A sparse gradient (an nn.Embedding(sparse=True), say) passes through uncoded, averaged as Horovod averages
it (an allgather of its indices and values), and leaves its bucket to the dense tensors; with
sparse_as_dense=True it is coded as a dense tensor and handed back sparse, as Horovod does.

Results equal the stock path bit for bit for the same seed and names (the codes of a tensor depend only on
seed, step, rank, tensor name and the shared scaler). With one rank, like the stock optimizer, it does not
touch the gradients.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.finite import nonfinite, nonfinite_average
from hvd_terngrad.pipeline import Group, Stage
from hvd_terngrad.session import Session
from hvd_terngrad.transports.uncoded import half_scale


class _Bucket:
    __slots__ = ("index", "key", "params", "ready", "coded", "node_handles", "group")

    def __init__(self, index: int, params: list):
        self.index = index
        self.key = f"bucket.{index}"  # its group's name in the pipeline (and in auto's plan)
        self.params = params
        self.reset()

    def reset(self):
        self.ready = set()
        self.coded = []  # the params coded this step, in bucket order: those whose gradient is not sparse
        self.node_handles = []  # hierarchical: the float averages inside the node, while in flight
        self.group: Group | None = None  # in the pipeline (where this rank codes it)

    @property
    def busy(self) -> bool:
        return bool(self.node_handles) or (self.group is not None and self.group.stage is not Stage.DONE)


class _Uncoded:
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


class _StepProtocol:
    """The step protocol of hvd.DistributedOptimizer, as Horovod documents it: step() synchronizes unless inside
    skip_synchronize() (after an explicit synchronize(), for clipping or AMP's unscale_), skips a step the
    exchange marked, and zero_grad() between backward and step is an error. Mixed into the optimizer's class."""

    @contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        if self._skip_next_step:
            self._skip_next_step = False
            return None
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._ex.busy:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause a "
                                 "race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


class _Exchange:
    """What becomes of a gradient once backward has made it, for _TernGradOptimizer (which owns the hooks that
    say when, and the step): its bucket's codes go through the pipeline, or the whole bucket in one average
    where transport="auto" sends it uncoded; the tensors never coded go in one average, or join the last
    bucket's (_joining); sparse ones are averaged as Horovod averages them."""

    def __init__(self, session: Session, named: list, bucket_bytes: int, sparse_as_dense: bool):
        self.pipe = session.pipeline  # what codes travel through
        self.world = session.world  # what passes through uncoded travels over
        self.hier = session.hierarchy
        self.cfg = session.config
        self.named = named  # (name, parameter) of the parameters averaged, in the order every rank knows
        self.name_of = {p: n for n, p in named}
        self.bucket_bytes = bucket_bytes
        self.sparse_as_dense = sparse_as_dense
        self.kept: dict = {}  # (wire, group key) -> the buffer its average travels in (_Uncoded.kept)
        self.plan()
        self.start_step()

    def plan(self):
        """Buckets of the coded parameters, as buckets.plan_buckets plans them (the performance model too)."""
        groups, _ = plan_buckets([(n, p.numel(), p.element_size()) for n, p in self.named], self.cfg,
                                 self.bucket_bytes)
        self.buckets: list[_Bucket] = [_Bucket(k, [self.named[i][1] for i in g]) for k, g in enumerate(groups)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.loose = [p for _, p in self.named if p not in self.bucket_of]  # never coded, in named order

    def add(self, named: list):
        """More parameters (the optimizer's add_param_group), and the buckets planned again."""
        self.named += named
        self.name_of.update((p, n) for n, p in named)
        self.plan()

    def start_step(self):
        for b in self.buckets:
            b.reset()
        self.uncoded = _Uncoded(self.world, self.pipe.coder, self.cfg.on_nonfinite, self.kept)
        self.densified = {}  # sparse_as_dense: param -> the dense copy of its sparse gradient that is coded
        self.fired = set()  # the parameters whose gradient is ready this step

    @property
    def busy(self) -> bool:
        """Whether a step's exchange has begun and not ended (zero_grad and add_param_group may not come)."""
        return bool(self.fired) or any(b.busy for b in self.buckets)

    def _grad(self, p) -> torch.Tensor:
        """The dense gradient that is coded or averaged: p.grad, or the dense copy of a sparse one."""
        return self.densified.get(p, p.grad)

    def ready(self, p):
        """p's gradient is ready: it goes, or waits for the rest of its group."""
        self.fired.add(p)
        name = self.name_of[p]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        b = self.bucket_of.get(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                self.uncoded.send_sparse(p, name)
                if b is not None:
                    self._bucket_member_ready(b, p)
                else:
                    self._loose_ready(p)
                return
            self.densified[p] = p.grad.to_dense()
        g = self._grad(p)
        self.pipe.coder.check_dtype(name, g)
        if b is None:
            self._loose_ready(p)
            return
        if self._uncoded_wire(b):  # a coded tensor until the plan: its residual goes along
            self.pipe.coder.merge_residual(name, g)
        self._bucket_member_ready(b, p)

    def _loose_ready(self, p):
        """A tensor that is never coded is ready. The step's never-coded tensors go together once the last is
        ready (in named order, the same on every rank): one average, where one each cost more than the overlap
        bought (docs/notes/tta-log.md, "One average a group"); in the step's last bucket's, where it joins
        (_joining)."""
        self.uncoded.loose.add(p)
        if len(self.uncoded.loose) < len(self.loose):
            return
        last = self._joining()
        if last is not None:
            if len(last.ready) == len(last.params):  # the bucket was ready first and waits for them
                self._send_uncoded(last, self._uncoded_wire(last), self._loose_dense())
            return
        dense = self._loose_dense()
        if dense:
            self._send_group("never-coded", dense, _what("the tensors never coded", self.name_of, dense),
                             self._float_wire())

    def _loose_dense(self) -> list:
        """The never-coded tensors whose gradient is not sparse, in named order."""
        return [q for q in self.loose if q not in self.uncoded.sparse]

    def _joining(self) -> _Bucket | None:
        """The step's last bucket where the never-coded tensors join its average: transport="auto"'s plan sends
        it uncoded in the wire they travel in. It is last in backward, so what joins waits little, and a model of
        one bucket (ncf) then averages once a step, where a second collective cost 3-4% of its step (measured:
        docs/notes/tta-log.md, "One collective a step, and grouped fp16 passes")."""
        if not (self.loose and self.buckets):
            return None
        last = self.buckets[-1]
        wire = self._uncoded_wire(last)
        return last if wire is not None and wire == self._float_wire() else None

    def _float_wire(self) -> str:
        """What the tensors that are never coded travel in (Pipeline.float_wire); fp32 with hierarchical coding,
        whose uncoded groups travel through the pipeline between nodes."""
        return self.pipe.float_wire() if self.hier is None else "fp32"

    def _uncoded_wire(self, b: _Bucket) -> str | None:
        """The wire transport="auto" sends bucket b uncoded in (None: coded), the whole bucket in one average once
        its last tensor is ready (_Uncoded.send_group). Hierarchical: the bucket's float average inside the node
        comes first, so it goes through the pipeline, as one group."""
        return self.pipe.uncoded(b.key) if self.hier is None else None

    def _bucket_member_ready(self, b: _Bucket, p):
        b.ready.add(p)
        if len(b.ready) < len(b.params):
            return
        # every rank has the same sparse gradients, so every rank codes the same members; if not, the scaler
        # vector's tags (or the payload headers) tell, on every rank
        b.coded = [q for q in b.params if q not in self.uncoded.sparse]
        if b is self._joining():
            if len(self.uncoded.loose) == len(self.loose):  # else the never-coded tensors' last one sends it
                self._send_uncoded(b, self._uncoded_wire(b), self._loose_dense())
            return
        if not b.coded:
            return
        wire = self._uncoded_wire(b)
        if wire:
            self._send_uncoded(b, wire)
            return
        if self.hier is not None and self.hier.local is not None:
            b.node_handles = self.hier.average_in_node([(self.name_of[q], self._grad(q)) for q in b.coded])
            return
        self._code(b)

    def _send_uncoded(self, b: _Bucket, wire: str, joining: list = ()):
        """A whole bucket that auto sends uncoded, and the never-coded tensors that join it (_joining): one
        average of their dense gradients (_send_group)."""
        params, b.coded = b.coded + list(joining), []  # nothing of it goes through the pipeline
        if params:
            self._send_group(b.key, params, _what(f"bucket {b.index}", self.name_of, params), wire)

    def _send_group(self, key: str, params: list, what: str, wire: str):
        """One average of these gradients in `wire` (_Uncoded.send_group)."""
        self.uncoded.send_group(key, what, params, [self.name_of[q] for q in params],
                                [self._grad(q) for q in params], wire)

    def _node_averaged(self, b: _Bucket):
        """Hierarchical: the node's float average of the bucket is in its gradients; code it if it is ours."""
        self.hier.wait_in_node(b.node_handles)
        b.node_handles = []
        self._code(b)

    def _code(self, b: _Bucket):
        """Start the bucket through the pipeline (hierarchical: only where this rank codes it)."""
        if self.hier is not None and not self.hier.codes(b.index):
            return
        b.group = self.pipe.start(b.key, [(self.name_of[q], self._grad(q)) for q in b.coded],
                                  what=_what(f"bucket {b.index}", self.name_of, b.coded))

    def progress(self):
        """Move every bucket on as far as it goes without waiting (called from each hook)."""
        for b in self.buckets:
            if b.node_handles and self.hier.averaged_in_node(b.node_handles):
                self._node_averaged(b)
            if b.group is not None:
                self.pipe.progress(b.group)

    def finish(self) -> tuple[list, list[tuple[str, int]]]:
        """The step's averages in the gradients, waited for (parameters with no gradient this step go as zeros):
        the coded items that are not finite, and the (name, rank) of the float averages that are not."""
        if len(self.fired) < len(self.named):
            for _, p in self.named:
                if p not in self.fired:
                    self.ready(p)
        for b in self.buckets:
            if b.node_handles:
                self._node_averaged(b)
        groups = [b for b in self.buckets if b.group is not None]
        for b in groups:  # scalers shared and transports started, in bucket order
            if b.group.stage is Stage.SCALER:
                self.pipe.progress(b.group, block=True)
        for b in groups:  # every bucket's next collective in flight before any wait for a result
            self.pipe.progress(b.group, block=True)
        bad = []
        for b in groups:  # each bucket's codes decoded into its gradients
            self.pipe.finish_into(b.group, [self._grad(p) for p in b.coded])
            bad += self.pipe.nonfinite(b.group)
        float_bad = []
        if self.hier is not None and self.hier.local is not None:  # the node's verdict replaces the codes'
            coded = [(b.index, self.name_of[q], self._grad(q)) for b in self.buckets for q in b.coded]
            float_bad, bad = [(n, -1) for n in self.hier.finish_in_node(coded, {it.name for it in bad})], []
        float_bad += self.uncoded.finish(self.name_of)
        for p, dense in self.densified.items():
            p.grad.zero_().add_(dense.to_sparse())  # handed back sparse, as Horovod's sparse_as_dense does
        return bad, float_bad


class _TernGradOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, process_set,
                 bucket_bytes, sparse_as_dense):
        super(self.__class__, self).__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        named = _checked_names(named_parameters, self.param_groups, all_params)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")

        # its own session (in bucket order on every rank: a blocking transport may be chosen), from the options
        # of the TernGrad compressor, which then reports the optimizer's stats and state (TernGrad.attach)
        if compression is None:
            session = Session.horovod(TernGradConfig(), process_set)
        else:
            session = Session.horovod(*compression.bind(named, process_set))
            compression.attach(session)
        in_opt = {id(p) for p in all_params}
        self._ex = _Exchange(session, [(n, p) for n, p in named if id(p) in in_opt and p.requires_grad],
                             bucket_bytes, sparse_as_dense)
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for _, p in self._ex.named}
        self._skip_next_step = False
        self._synchronized = False
        self._should_synchronize = True
        self._grad_accs = []
        if self._ex.world.size > 1:
            self._register_hooks()

    def add_param_group(self, param_group):
        """torch's add_param_group; its parameters are averaged from the next backward on, named by their place
        (allreduce.noname.<group>.<index>), and the buckets are planned again. (The stock hvd optimizer
        registers its hooks only when built, and leaves such parameters unaveraged.)"""
        super(self.__class__, self).add_param_group(param_group)
        if not hasattr(self, "_ex"):  # the groups torch's constructor adds: __init__ names them
            return
        if self._ex.busy:
            raise AssertionError("add_param_group() between backward and step(): add groups between steps")
        k = len(self.param_groups) - 1
        new = [(f"allreduce.noname.{k}.{j}", p) for j, p in enumerate(self.param_groups[k]["params"])
               if p.requires_grad and p not in self._ex.name_of]
        self._ex.add(new)
        for _, p in new:
            self._delay[p] = self.backward_passes_per_step
        if self._ex.world.size > 1:
            self._register_hooks([p for _, p in new])

    def _register_hooks(self, params=None):
        for p in params if params is not None else [p for _, p in self._ex.named]:
            p_tmp = p.expand_as(p)
            grad_acc = p_tmp.grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_hook(p))
            self._grad_accs.append(grad_acc)

    def _make_hook(self, p):
        def hook(*_):
            if self._delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._ex.ready(p)
                self._ex.progress()
        return hook

    def synchronize(self):
        ex = self._ex
        if ex.world.size <= 1:
            self._synchronized = True
            return
        try:
            bad, float_bad = ex.finish()
        finally:
            ex.start_step()
            self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)
            self._synchronized = True
        deciding = ex.pipe.plan.deciding
        try:
            self._skip_next_step = _skips(ex.cfg, ex.pipe, bad, float_bad, ex.world.rank)
        finally:
            ex.pipe.next_step()
            if deciding and not ex.pipe.plan.deciding:
                # the verdict's step codes every group: a trial's buffers go (half or all of a gradient's bytes
                # each), and a kept plan makes its own again on its first step
                ex.kept.clear()


def _what(group: str, name_of: dict, params: list) -> str:
    """A group of tensors in an error, named by its first tensor: "bucket 3 ('fc.weight' and 2 more)"."""
    more = f" and {len(params) - 1} more" if len(params) > 1 else ""
    return f"{group} ({name_of[params[0]]!r}{more})"


def _skips(cfg, pipe, bad: list, float_bad: list[tuple[str, int]], rank: int) -> bool:
    """A step's verdict on non-finite averages (the same on every rank): whether to skip it (on_nonfinite=
    "skip"); with "propagate" the averages are already NaN, for AMP's GradScaler to find; else
    NonFiniteGradientError naming the tensor (and the rank, where known)."""
    if not (bad or float_bad):
        return False
    if cfg.on_nonfinite == "skip":
        pipe.stats.current.skipped = True
        return True
    if cfg.on_nonfinite == "propagate":  # the pipeline made those averages NaN
        return False
    pipe.coder.raise_nonfinite(bad)
    raise nonfinite_average(*float_bad[0], pipe.step, rank)


def _checked_names(named_parameters, param_groups, all_params) -> list:
    """(name, parameter) for every parameter, checked as Horovod checks them; made up where not given."""
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) for x in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                             "produced by model.named_parameters()")
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(param_groups)
                 for j, v in enumerate(g["params"])]
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named_ids = {id(v) for _, v in named}
    if any(id(p) not in named_ids for p in all_params):
        raise ValueError("named_parameters was specified, but one or more model parameters were not named")
    return named


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set,
                         bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Wrap `optimizer` so that gradients are averaged across ranks as TernGrad ternary codes.

    Same signature as hvd.DistributedOptimizer; compression must be an hvd_terngrad.TernGrad (default:
    TernGrad() with the paper's options). op must be Average and gradient_predivide_factor 1.0;
    num_groups and groups are replaced by bucket_bytes (the dense bytes per bucket of coded tensors).
    """
    if compression is not None and not (isinstance(getattr(compression, "config", None), TernGradConfig)
                                        and callable(getattr(compression, "attach", None))):
        raise ValueError("hvd_terngrad.DistributedOptimizer takes compression=hvd_terngrad.TernGrad(...); for "
                         f"{type(compression).__name__} use hvd.DistributedOptimizer")
    if op != hvd.Average:
        raise ValueError("hvd_terngrad.DistributedOptimizer averages gradients (op=hvd.Average) only")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor must be 1.0: TernGrad decodes the exact average")
    if num_groups or groups:
        raise ValueError("num_groups/groups are not used: hvd_terngrad buckets coded tensors itself (bucket_bytes=)")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    protocol = {k: v for k, v in _StepProtocol.__dict__.items() if k not in ("__dict__", "__weakref__")}
    methods = {**protocol, **_TernGradOptimizer.__dict__}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, process_set,
               bucket_bytes, sparse_as_dense)
