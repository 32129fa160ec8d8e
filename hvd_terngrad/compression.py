"""TernGrad as a Horovod compressor for the stock hvd.DistributedOptimizer (Horovod 0.28.1, unpatched).

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_terngrad.TernGrad(model.named_parameters()))

How it fits the stock optimizer: Horovod calls compress(grad) in the backward hook and allreduces what it
returns, then calls decompress(output, ctx) in synchronize(). compress() therefore starts the tensor through
the pipeline itself: the Max allreduce of its scaler (16 bytes), without waiting for it, and it hands Horovod
a 1-element placeholder to allreduce. Each later compress() moves earlier tensors on whose scaler has come
back: it ternarizes them and starts their transport (an allgather of the packed record, a Sum of the code
values, or an alltoall of code shards), overlapping backward. decompress() finishes the rest, each wait at
most timeout_s like every wait of TernGrad's, and decodes the average. compress() never blocks: ranks whose
backward reaches different parameters (Horovod allreduces the missing ones as zeros in synchronize(), after
backward) would otherwise wait on each other's scaler allreduces inside backward. Small or excluded tensors
pass through unchanged (plain average), but where transport="auto" keeps fp16 for its uncoded tensors: then
they go through the pipeline in fp16 with them (Pipeline.float_wire). A sparse gradient (sparse_as_dense=False)
never reaches compress(): Horovod averages it itself and decompress(output, None) returns that average as it is,
like Compression.none.

Trade-off against hvd_terngrad.DistributedOptimizer: the stock path shares the scaler and sends the codes
once per tensor; the hvd_terngrad optimizer does both once per bucket.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from hvd_terngrad.collectives.horovod import HorovodCollectives, describe_process_set, process_set_id
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.errors import NonFiniteGradientError, PayloadMismatchError, TernGradError
from hvd_terngrad.pipeline import Group, Pipeline, Stage
from hvd_terngrad.session import Session
from hvd_terngrad.transports import TRANSPORTS

if TYPE_CHECKING:
    from hvd_terngrad.hierarchy import Hierarchy

_PASS = object()


class TernGrad(Compressor):
    """TernGrad compressor (Wen et al., NeurIPS 2017): 2-bit stochastic ternary gradients, shared scaler.

    Args:
        named_parameters: the model's named parameters. Optional for the stock optimizer, but needed for
            exclusion by name and for tensor names in errors; without them tensors are named by their order.
        config: a TernGradConfig; or its fields as keyword **options (clip=2.5, share_scaler=True,
            min_numel=1024, exclude=(), seed=0, error_feedback=False, backend="auto", ...), not both.
        process_set: the Horovod process set the gradients are averaged over (default: all ranks).

    Raises:
        ValueError: config= and options both given, or an option out of range (TernGradConfig's checks); at
            the first compress(), hierarchical=True or transport="summed-int8" (hvd_terngrad's optimizer only),
            or a rank outside process_set.
        NonFiniteGradientError: a NaN or Inf gradient, on every rank, naming the tensor and the rank
            (on_nonfinite="raise").
        CollectiveTimeoutError: a collective whose peers never joined within timeout_s.

    connect() binds the compressor to its process set and makes its session (hvd_terngrad.session); the first
    compress() or use of a property connects it if nothing did before. Handed to hvd_terngrad's optimizer, it
    hands over its options (bind) and the optimizer attaches the session it builds, so that the compressor's
    stats and state_dict() are the optimizer's; with hierarchical=True only the optimizer connects it (it
    discovers the nodes, a collective).
    """

    def __init__(self, named_parameters=None, config: TernGradConfig | None = None, process_set=None, **options):
        if config is not None and options:
            raise ValueError("pass either config= or keyword options, not both")
        self.config = config if config is not None else TernGradConfig(**options)
        self._named = list(named_parameters) if named_parameters is not None else None
        self._process_set = process_set  # None: not chosen yet (the global set, or the optimizer's)
        self._session: Session | None = None  # connect(), or the optimizer's (attach)
        self._by_grad: dict[int, tuple[str, torch.nn.Parameter]] = {}
        self._calls = 0
        self._done = 0
        self._pending: list[Group] = []  # this step's groups not yet sent in full
        self._sent: list[Group] = []  # this step's groups whose transports _send_all started
        self._lock = threading.Lock()  # held while this thread works on the pipeline; the watchdog waits for it
        self._watchdog: _Watchdog | None = None

    # ------------------------------------------------------------------------------------------
    def bind(self, named_parameters: list, process_set) -> tuple[TernGradConfig, object]:
        """Hand this compressor's options to hvd_terngrad's optimizer, which builds its own Session from them
        (and attach()es it here). Names given to TernGrad itself win; a different process set is a ValueError,
        since the two would wait on each other's collectives forever.

        Returns:
            (config, process_set): the options and the process set (None: the global one) to average over.
        """
        if self._named is None:
            self._named = list(named_parameters)
        mine = self._session.world.process_set if self._session is not None else self._process_set
        if mine is None:
            self._process_set = process_set
        elif process_set_id(mine) != process_set_id(process_set):
            raise ValueError(f"the TernGrad compressor works on {describe_process_set(mine)} but the optimizer on "
                             f"{describe_process_set(process_set)}: pass the same process_set= to both")
        return self.config, self._process_set

    def attach(self, session: Session) -> None:
        """Make an optimizer's session this compressor's: its stats, state_dict() and Horovod elastic state are
        then the optimizer's. ValueError where this compressor already coded with a session of its own."""
        if self._session is not None and self._session is not session and (self._calls or self._session.pipeline.step):
            raise ValueError("this TernGrad compressor has already coded gradients of its own; give each optimizer "
                             "a TernGrad of its own")
        self._session = session

    def connect(self) -> Pipeline:
        """Bind to the process set and make this rank's session (once), for the stock optimizer: each tensor's
        groups finish in this rank's order of decompress() calls, so no transport whose collective blocks."""
        if self._session is None:
            self._session = Session.horovod(self.config, self._process_set, blocking_ok=False)
        return self._session.pipeline

    @property
    def pipeline(self) -> Pipeline:
        """This rank's pipeline: the process set's, or with hierarchical=True the one between the nodes."""
        return self._connected().pipeline

    @property
    def world(self) -> HorovodCollectives:
        """The collectives over the whole process set, for what passes through uncoded."""
        return self._connected().world

    @property
    def hierarchy(self) -> Hierarchy | None:
        """With hierarchical=True, this rank's node and its process sets; else None."""
        return self._connected().hierarchy

    @property
    def stats(self):
        """StatsRecorder: .last is the last finished step (StepStats), .history the recent ones."""
        return self._connected().pipeline.stats

    def state_dict(self) -> dict:
        """This rank's TernGrad state for a checkpoint (Pipeline.state_dict): save it beside the model's and
        the optimizer's, one file a rank, and load_state_dict() it before the next step."""
        return self._connected().pipeline.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._connected().pipeline.load_state_dict(state)

    def _connected(self) -> Session:
        """The session, made without a collective: a property never starts one, so with hierarchical=True the
        optimizer's (which discovers the nodes when built) is the only one."""
        if self._session is None:
            if self.config.hierarchical:
                raise RuntimeError("this TernGrad compressor is not connected yet: with hierarchical=True "
                                   "hvd_terngrad.DistributedOptimizer connects it when built (discovering the nodes "
                                   "is a collective, on every rank)")
            self.connect()
        return self._session

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
        self._check_stock_options()
        pipe = self.connect()
        name = self._name_of(tensor)
        self._calls += 1
        pipe.coder.check_dtype(name, tensor)
        if not self.config.compresses(name, tensor.numel()) and pipe.float_wire() == "fp32":
            pipe.stats.add_float(tensor.numel() * tensor.element_size(), pipe.size)
            return tensor, _PASS
        # coded, or in fp16 with auto's uncoded groups: through the pipeline, a group of its own
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)
        with self._lock:
            for earlier in self._pending:  # their scalers may be back: start their transports beside backward
                pipe.progress(earlier)
            g = pipe.start(name, [(name, tensor)], what=repr(name))
            self._pending.append(g)
            self._watchdog.started[g] = time.monotonic()
        return torch.zeros(1, dtype=torch.float32, device=tensor.device), g

    def _send_all(self, pipe: Pipeline) -> None:
        """Start every pending tensor's transport, then every second collective, before any wait for codes.
        Ranks decompress in their own order of compress() calls, which differs where their backward reached
        different parameters; a rank waiting for one tensor's codes before it has sent the others' would wait
        for a peer that waits for it."""
        pending, self._pending = self._pending, []
        self._sent = pending
        self._watchdog.started.clear()
        for g in pending:  # every scaler allreduce was started on every rank: these waits end
            if g.stage is Stage.SCALER:
                pipe.progress(g, block=True)
        for g in pending:
            pipe.progress(g, block=True)

    def _finish_sent(self, pipe: Pipeline) -> None:
        """Before raising an error that every rank raises: wait for the step's other transports. Ranks reach
        the error at different tensors (each decompresses in its own order); one that left with transports in
        flight would end its Horovod under a peer still starting them, and the peer would fail with "Horovod
        has been shut down" instead of this error."""
        for g in self._sent:
            if g.stage is not Stage.DONE:
                # a peer that never joined fails on its own; this rank reports its own error
                with contextlib.suppress(TernGradError):
                    pipe.finish(g, decode=False)

    def _check_stock_options(self) -> None:
        cfg = self.config
        if cfg.hierarchical:
            raise ValueError("hierarchical=True needs hvd_terngrad.DistributedOptimizer, which codes whole buckets "
                             "between nodes; the stock hvd.DistributedOptimizer hands TernGrad one tensor at a time")
        if cfg.on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' needs hvd_terngrad.DistributedOptimizer, which owns the "
                             "optimizer step; the stock hvd.DistributedOptimizer can only raise")
        if cfg.transport != "auto" and not TRANSPORTS[cfg.transport].stock_ok:
            raise ValueError(f"transport={cfg.transport!r} needs hvd_terngrad.DistributedOptimizer (a "
                             f"blocking collective); use transport='summed' with the stock optimizer")
        if cfg.exclude and self._named is None:
            raise ValueError("exclude= matches parameter names: with the stock hvd.DistributedOptimizer pass "
                             "named_parameters to TernGrad(model.named_parameters(), ...)")

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:  # a sparse gradient: Horovod averaged it without calling compress()
            return tensor
        try:
            if ctx is _PASS:
                return tensor
            pipe = self.pipeline
            g: Group = ctx
            with self._lock:
                if self._pending:  # the step's first decompress(): every rank has compressed every tensor
                    self._send_all(pipe)
                try:
                    (avg,) = pipe.finish(g)
                    pipe.coder.raise_nonfinite(g.items if self.config.on_nonfinite == "raise" else [])
                except (NonFiniteGradientError, PayloadMismatchError):
                    self._finish_sent(pipe)
                    raise
            it = g.items[0]
            return avg.view(it.shape).to(it.dtype)
        finally:
            self._done += 1
            if self._done == self._calls:  # the stock synchronize() compresses everything before decoding
                self._calls = self._done = 0
                self._sent = []  # the step's groups, their codes received, go now and not a step later
                self.pipeline.next_step()


class _Watchdog:
    """The bound on the waits the stock optimizer makes inside Horovod.

    compress() never blocks, so a rank whose peer never starts a tensor (a stuck rank, another process set, other
    options) waits in Horovod's own synchronize(), which has no bound and which no error can leave. This thread
    watches the scaler Max allreduces in flight: one not done timeout_s after it started means a peer never
    joined it, as a bounded wait would have found. Then it prints why, naming the tensor and this rank, and ends
    this process, which ends the job (mpirun stops the others)."""

    def __init__(self, tg: TernGrad):
        self.tg = tg
        self.started: dict[Group, float] = {}  # the step's groups whose scalers may still be in flight
        self.period = min(1.0, tg.config.timeout_s / 8)
        threading.Thread(target=self._run, name="hvd_terngrad-watchdog", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            if not self.tg._lock.acquire(timeout=self.period):
                continue  # the training thread is in TernGrad's own waits, which are bounded
            try:
                late = self._late()
            finally:
                self.tg._lock.release()
            if late is not None:
                print(self.tg.world.timeout_message(f"the scaler Max allreduce of {late.what}") + " The stock "
                      "hvd.DistributedOptimizer waits for it inside Horovod, where no error reaches the training "
                      "loop: ending this rank.", file=sys.stderr, flush=True)
                os._exit(3)

    def _late(self) -> Group | None:
        now, pipe = time.monotonic(), self.tg.pipeline
        for g, t0 in self.started.items():
            if g.stage is Stage.SCALER and now - t0 > self.tg.config.timeout_s and not pipe.scalers_arrived(g):
                return g
        return None


def _register_elastic_handler() -> None:
    """hvd.elastic.TorchState(model, optimizer, terngrad=tg) keeps TernGrad's state too: its step and its
    error-feedback residuals are saved at each commit() and restored with the model on a reset; sync() gives
    every rank rank 0's step, which keys every draw and which the payload headers check."""
    from horovod.torch.elastic import state as elastic_state

    class TernGradStateHandler(elastic_state.StateHandler):
        def __init__(self, tg: TernGrad):
            super().__init__(tg)
            self._saved = None
            self.save()

        def save(self):
            tg = self.value
            self._saved = tg.state_dict() if tg._session is not None or not tg.config.hierarchical else None

        def restore(self):
            if self._saved is not None:
                self.value.load_state_dict(self._saved)

        def sync(self):
            pipe = self.value.pipeline
            pipe.coder.step = int(hvd.broadcast_object(pipe.step, root_rank=0, name="terngrad.elastic.step"))

    registry = elastic_state.get_handler_registry()
    if not any(cls is TernGrad for cls, _ in registry):
        elastic_state.set_handler_registry([*registry, (TernGrad, TernGradStateHandler)])


_register_elastic_handler()
