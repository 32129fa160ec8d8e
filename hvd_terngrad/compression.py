"""TernGrad as a Horovod compressor for the stock hvd.DistributedOptimizer (Horovod 0.28.1, unpatched).

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_terngrad.TernGrad(model.named_parameters()))

How it fits the stock optimizer: Horovod calls compress(grad) in the backward hook and allreduces what
it returns, then calls decompress(output, ctx) in synchronize(). compress() therefore shares the scaler
(a blocking Max allreduce of 16 bytes), ternarizes the gradient and starts its transport's first collective
itself (an allgather of the packed record, a Sum of the code values, or an alltoall of code shards); it hands
Horovod a 1-element placeholder to allreduce. decompress() finishes the transport, each wait at most
timeout_s like every wait of TernGrad's, and decodes the average. Small or excluded tensors pass through
unchanged (plain average). A sparse gradient (sparse_as_dense=False) never reaches compress(): Horovod
averages it itself and decompress(output, None) returns that average as it is, like Compression.none.

Trade-off against hvd_terngrad.DistributedOptimizer: the stock path blocks the backward pass once per
tensor for the scaler and sends one allgather per tensor; the hvd_terngrad optimizer shares the scalers
of a whole bucket in one non-blocking allreduce and sends one allgather per bucket.
"""
from __future__ import annotations

import warnings

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from hvd_terngrad import hierarchy
from hvd_terngrad.collectives import HorovodCollectives, describe_process_set, process_set_id
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.engine import Item, TernGradEngine
from hvd_terngrad.transports import TRANSPORTS, resolve_transport


class _Coded:
    """A coded tensor in flight: its transport, the collective's handle and the engine's items."""

    __slots__ = ("transport", "handle", "items")

    def __init__(self, transport, handle, items: list[Item]):
        self.transport = transport
        self.handle = handle
        self.items = items


_PASS = object()


class TernGrad(Compressor):
    """TernGrad compressor (Wen et al., NeurIPS 2017): 2-bit stochastic ternary gradients, shared scaler.

    named_parameters: the model's named parameters. Optional for the stock optimizer, but needed for
        exclusion by name and for tensor names in errors; without them tensors are named by their order.
    config / **options: a TernGradConfig, or its fields as keywords (clip=2.5, share_scaler=True,
        min_numel=1024, exclude=(), seed=0, error_feedback=False, backend="auto", ...).
    process_set: the Horovod process set the gradients are averaged over (default: all ranks).
    """

    def __init__(self, named_parameters=None, config: TernGradConfig | None = None, process_set=None, **options):
        if config is not None and options:
            raise ValueError("pass either config= or keyword options, not both")
        self.config = config if config is not None else TernGradConfig(**options)
        self._named = list(named_parameters) if named_parameters is not None else None
        self._process_set = process_set  # None: not chosen yet (the global set, or the optimizer's)
        self._engine: TernGradEngine | None = None
        self._comm: HorovodCollectives | None = None
        self._world: HorovodCollectives | None = None
        self._hierarchy: hierarchy.Hierarchy | None = None
        self._by_grad: dict[int, tuple[str, torch.nn.Parameter]] = {}
        self._calls = 0
        self._done = 0

    # ------------------------------------------------------------------------------------------
    def bind(self, named_parameters: list, process_set) -> None:
        """Tie this compressor to an optimizer's parameter names and process set (hvd_terngrad's optimizer
        calls this). Names given to TernGrad itself win; a different process set is a ValueError, since the
        two would wait on each other's collectives forever."""
        if self._named is None:
            self._named = list(named_parameters)
        mine = self._comm.process_set if self._comm is not None else self._process_set
        if mine is None:
            self._process_set = process_set
        elif process_set_id(mine) != process_set_id(process_set):
            raise ValueError(f"the TernGrad compressor works on {describe_process_set(mine)} but the optimizer on "
                             f"{describe_process_set(process_set)}: pass the same process_set= to both")

    @property
    def engine(self) -> TernGradEngine:
        if self._engine is None:
            t = HorovodCollectives(self._process_set, timeout_s=self.config.timeout_s)
            if process_set_id(t.process_set) != 0 and not t.process_set.included():
                raise ValueError(f"rank {hvd.rank()} is not in {describe_process_set(t.process_set)}, the TernGrad "
                                 f"compressor's: pass the optimizer's process_set= to TernGrad")
            self._world = t
            if self.config.hierarchical:
                if process_set_id(t.process_set) != 0:
                    raise ValueError("hierarchical=True works on the global process set: its nodes are Horovod's")
                self._hierarchy = hierarchy.discover(self.config.timeout_s)
                topo = self._hierarchy.topology
                self._engine = TernGradEngine(self.config, topo.node, topo.nodes)
                t = self._hierarchy.cross or t  # one node: nothing is coded
            else:
                self._engine = TernGradEngine(self.config, t.rank, t.size)
            hier = (self._hierarchy.local, self._hierarchy.cross) if self._hierarchy else ()
            for c in (self._world, t, *hier):  # every collective counts its traffic into the engine's stats
                if c is not None:
                    c.stats = self._engine.stats
            self._comm = t
        return self._engine

    @property
    def collectives(self) -> HorovodCollectives:
        """The collectives this compressor's engine codes over (created with the engine): the optimizer's
        process set, or with hierarchical=True the cross set of this rank's local index."""
        self.engine  # noqa: B018  (creates both)
        return self._comm

    @property
    def world(self) -> HorovodCollectives:
        """The collectives over the whole process set, for what passes through uncoded."""
        self.engine  # noqa: B018
        return self._world

    @property
    def hierarchy(self) -> hierarchy.Hierarchy | None:
        """With hierarchical=True, this rank's node and its process sets; else None."""
        self.engine  # noqa: B018
        return self._hierarchy

    @property
    def stats(self):
        """StatsRecorder: .last is the last finished step (StepStats), .history the recent ones."""
        return self.engine.stats

    def _name_of(self, tensor: torch.Tensor) -> str:
        if self._named is not None:
            hit = self._by_grad.get(id(tensor))
            if hit is None or hit[1].grad is not tensor:  # grads are replaced e.g. by zero_grad(set_to_none)
                self._by_grad = {id(p.grad): (n, p) for n, p in self._named if p.grad is not None}
                hit = self._by_grad.get(id(tensor))
            if hit is not None:
                return hit[0]
            # sparse_as_dense=True: Horovod hands over a dense copy of a sparse gradient
            dense_of = [n for n, p in self._named
                        if p.grad is not None and p.grad.is_sparse and p.grad.shape == tensor.shape]
            if len(dense_of) == 1:
                return dense_of[0]
            warnings.warn("hvd_terngrad.TernGrad got a tensor that is no parameter's .grad; naming it by order",
                          stacklevel=3)
        return f"tensor.{self._calls}"

    # ------------------------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        if self.config.hierarchical:
            raise ValueError("hierarchical=True needs hvd_terngrad.DistributedOptimizer, which codes whole buckets "
                             "between nodes; the stock hvd.DistributedOptimizer hands TernGrad one tensor at a time")
        eng = self.engine
        if self.config.on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' needs hvd_terngrad.DistributedOptimizer, which owns the "
                             "optimizer step; the stock hvd.DistributedOptimizer can only raise")
        if self.config.transport != "auto" and not TRANSPORTS[self.config.transport].stock_ok:
            raise ValueError(f"transport={self.config.transport!r} needs hvd_terngrad.DistributedOptimizer (a "
                             f"blocking collective); use transport='summed' with the stock optimizer")
        if self.config.exclude and self._named is None:
            raise ValueError("exclude= matches parameter names: with the stock hvd.DistributedOptimizer pass "
                             "named_parameters to TernGrad(model.named_parameters(), ...)")
        name = self._name_of(tensor)
        self._calls += 1
        eng.check_dtype(name, tensor)
        if not self.config.compresses(name, tensor.numel()):
            eng.stats.add_float(tensor.numel() * tensor.element_size(), eng.size)
            return tensor, _PASS
        items = [eng.prepare(name, tensor)]
        if self.config.share_scaler:
            reduced = self._comm.max_allreduce(eng.scaler_vector(items), name=f"terngrad.scaler.{name}",
                                                    what=f"the scaler Max allreduce of {name!r}")
            eng.apply_shared(items, reduced)
            eng.raise_nonfinite(items)
        t = resolve_transport(self.config.transport, tensor.numel(), eng.size, int8=False, link=self.config.link())
        ctx = _Coded(t, t.start(self._comm, t.encode(eng, items), name), items)
        return torch.zeros(1, dtype=torch.float32, device=tensor.device), ctx

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:  # a sparse gradient: Horovod averaged it without calling compress()
            return tensor
        try:
            if ctx is _PASS:
                return tensor
            eng = self.engine
            received = ctx.transport.finish(self._comm, ctx.handle, repr(ctx.items[0].name))
            (avg,) = ctx.transport.decode(eng, ctx.items, received)
            eng.raise_nonfinite(ctx.items)
            it = ctx.items[0]
            return avg.view(it.shape).to(it.dtype)
        finally:
            self._done += 1
            if self._done == self._calls:  # the stock synchronize() compresses everything before decoding
                self._calls = self._done = 0
                self.engine.next_step()
