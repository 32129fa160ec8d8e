"""TernGrad as a Horovod compressor for the stock hvd.DistributedOptimizer (Horovod 0.28.1, unpatched).

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_terngrad.TernGrad(model.named_parameters()))

How it fits the stock optimizer: Horovod calls compress(grad) in the backward hook and allreduces what
it returns, then calls decompress(output, ctx) in synchronize(). compress() therefore shares the scaler
(a blocking Max allreduce of 16 bytes), ternarizes and packs the gradient and starts an allgather of the
packed record itself; it hands Horovod a 1-element placeholder to allreduce. decompress() waits for the
allgather and decodes the average. Small or excluded tensors pass through unchanged (plain average).

Trade-off against hvd_terngrad.DistributedOptimizer: the stock path blocks the backward pass once per
tensor for the scaler and sends one allgather per tensor; the hvd_terngrad optimizer shares the scalers
of a whole bucket in one non-blocking allreduce and sends one allgather per bucket.
"""
from __future__ import annotations

import warnings

import torch
from horovod.torch.compression import Compressor

from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.engine import Item, TernGradEngine
from hvd_terngrad.perfmodel import choose_transport
from hvd_terngrad.transport import HorovodTransport


def resolve_transport(transport: str, numel: int, size: int, int8: bool) -> str:
    """The transport a group of `numel` coded elements takes: the configured one, or the model's choice."""
    if transport != "auto":
        return transport
    return choose_transport(numel, size, int8=int8)


class _Coded:
    __slots__ = ("handle", "items")

    def __init__(self, handle, items: list[Item]):
        self.handle = handle
        self.items = items


class _Summed:
    __slots__ = ("items",)

    def __init__(self, items: list[Item]):
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
        self._process_set = process_set
        self._engine: TernGradEngine | None = None
        self._transport: HorovodTransport | None = None
        self._by_grad: dict[int, tuple[str, torch.nn.Parameter]] = {}
        self._calls = 0
        self._done = 0

    # ------------------------------------------------------------------------------------------
    @property
    def engine(self) -> TernGradEngine:
        if self._engine is None:
            t = HorovodTransport(self._process_set)
            self._engine = TernGradEngine(self.config, t.rank, t.size)
            t.stats = self._engine.stats
            self._transport = t
        return self._engine

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
            warnings.warn("hvd_terngrad.TernGrad got a tensor that is no parameter's .grad; naming it by order",
                          stacklevel=3)
        return f"tensor.{self._calls}"

    # ------------------------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        eng = self.engine
        if self.config.on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' needs hvd_terngrad.DistributedOptimizer, which owns the "
                             "optimizer step; the stock hvd.DistributedOptimizer can only raise")
        if self.config.transport == "summed-int8":
            raise ValueError("transport='summed-int8' needs hvd_terngrad.DistributedOptimizer (Horovod's "
                             "allreduce takes no int8); use transport='summed' with the stock optimizer")
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
            reduced = self._transport.max_allreduce(eng.scaler_vector(items), name=f"terngrad.scaler.{name}")
            eng.apply_shared(items, reduced)
            eng.raise_nonfinite(items)
        if resolve_transport(self.config.transport, tensor.numel(), eng.size, int8=False) == "summed":
            # The stock optimizer averages what compress() returns; decompress() turns it back into sums.
            return eng.encode_values(items, torch.float16), _Summed(items)
        payload = eng.encode(items, device=tensor.device)
        handle = self._transport.allgather_async(payload, name=f"terngrad.codes.{name}")
        return torch.zeros(1, dtype=torch.float32, device=tensor.device), _Coded(handle, items)

    def decompress(self, tensor: torch.Tensor, ctx):
        try:
            if ctx is _PASS:
                return tensor
            eng = self.engine
            if isinstance(ctx, _Summed):
                # Horovod averaged the fp16 code values: N * average, rounded, is the exact integer sum
                # (the fp16 error of the average is below 0.5 / N for N < 1024).
                (avg,) = eng.decode_sums(ctx.items, torch.round(tensor.float() * eng.size))
            else:
                (avg,) = eng.decode(ctx.items, self._transport.wait(ctx.handle))
            eng.raise_nonfinite(ctx.items)
            it = ctx.items[0]
            return avg.view(it.shape).to(it.dtype)
        finally:
            self._done += 1
            if self._done == self._calls:  # the stock synchronize() compresses everything before decoding
                self._calls = self._done = 0
                self.engine.next_step()
