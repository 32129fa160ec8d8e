"""What becomes of each gradient once backward has made it (Exchange), bucket by bucket (Bucket)."""
from __future__ import annotations

import torch

from hvd_terngrad.buckets import plan_buckets
from hvd_terngrad.optimizer.uncoded import Uncoded
from hvd_terngrad.pipeline import Group, Stage
from hvd_terngrad.session import Session


class Bucket:
    """One bucket of coded parameters (buckets.plan_buckets) and where it stands this step."""

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


class Exchange:
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
        self.kept: dict = {}  # (wire, group key) -> the buffer its average travels in (Uncoded.kept)
        self.plan()
        self.start_step()

    def plan(self):
        """Buckets of the coded parameters, as buckets.plan_buckets plans them (the performance model too)."""
        groups, _ = plan_buckets([(n, p.numel(), p.element_size()) for n, p in self.named], self.cfg,
                                 self.bucket_bytes)
        self.buckets: list[Bucket] = [Bucket(k, [self.named[i][1] for i in g]) for k, g in enumerate(groups)]
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
        self.uncoded = Uncoded(self.world, self.pipe.coder, self.cfg.on_nonfinite, self.kept)
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
            self._send_group("never-coded", dense, what_of("the tensors never coded", self.name_of, dense),
                             self._float_wire())

    def _loose_dense(self) -> list:
        """The never-coded tensors whose gradient is not sparse, in named order."""
        return [q for q in self.loose if q not in self.uncoded.sparse]

    def _joining(self) -> Bucket | None:
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

    def _uncoded_wire(self, b: Bucket) -> str | None:
        """The wire transport="auto" sends bucket b uncoded in (None: coded), the whole bucket in one average once
        its last tensor is ready (Uncoded.send_group). Hierarchical: the bucket's float average inside the node
        comes first, so it goes through the pipeline, as one group."""
        return self.pipe.uncoded(b.key) if self.hier is None else None

    def _bucket_member_ready(self, b: Bucket, p):
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

    def _send_uncoded(self, b: Bucket, wire: str, joining: list = ()):
        """A whole bucket that auto sends uncoded, and the never-coded tensors that join it (_joining): one
        average of their dense gradients (_send_group)."""
        params, b.coded = b.coded + list(joining), []  # nothing of it goes through the pipeline
        if params:
            self._send_group(b.key, params, what_of(f"bucket {b.index}", self.name_of, params), wire)

    def _send_group(self, key: str, params: list, what: str, wire: str):
        """One average of these gradients in `wire` (Uncoded.send_group)."""
        self.uncoded.send_group(key, what, params, [self.name_of[q] for q in params],
                                [self._grad(q) for q in params], wire)

    def _node_averaged(self, b: Bucket):
        """Hierarchical: the node's float average of the bucket is in its gradients; code it if it is ours."""
        self.hier.wait_in_node(b.node_handles)
        b.node_handles = []
        self._code(b)

    def _code(self, b: Bucket):
        """Start the bucket through the pipeline (hierarchical: only where this rank codes it)."""
        if self.hier is not None and not self.hier.codes(b.index):
            return
        b.group = self.pipe.start(b.key, [(self.name_of[q], self._grad(q)) for q in b.coded],
                                  what=what_of(f"bucket {b.index}", self.name_of, b.coded))

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


def what_of(group: str, name_of: dict, params: list) -> str:
    """A group of tensors in an error, named by its first tensor: "bucket 3 ('fc.weight' and 2 more)"."""
    more = f" and {len(params) - 1} more" if len(params) > 1 else ""
    return f"{group} ({name_of[params[0]]!r}{more})"
