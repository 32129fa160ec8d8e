"""TernGradState: the DDP hook's state (one per DDP model): its configuration, its process group, its pipeline,
and which path averages each step (hook.route, native.Native.steer)."""
import datetime
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES
from hvd_terngrad.collectives.distributed import TorchCollectives
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.ddp.averages import OwnAverages, gradient_views
from hvd_terngrad.ddp.exchanges import Exchanges
from hvd_terngrad.ddp.hook import PYTHON_REDUCER, terngrad_hook
from hvd_terngrad.ddp.native import Native, native_module
from hvd_terngrad.errors import TernGradError
from hvd_terngrad.hierarchy import Hierarchy, discover_torch
from hvd_terngrad.pipeline import Pipeline
from hvd_terngrad.session import Session


class TernGradState:
    """The state of terngrad_hook (one per DDP model), in the manner of PowerSGDState.

    Args:
        named_parameters: the module's named parameters (names key the codes, exclude= and the errors).
        config: a TernGradConfig; or its fields as keyword **options, not both.
        process_group: the torch.distributed group DDP averages over (default: the whole world). Every rank of
            it makes its state at the same point of its program, as it makes its DDP model: the state makes a
            process group of its own over the same ranks.
        bucket_bytes: DDP buckets smaller than this wait for the next ones and go through the pipeline with
            them, as one group of at least this many bytes or up to the step's last bucket (0: each bucket on its
            own). A group costs two collectives whatever its size, which on a slow link outweighs the overlap a
            small bucket would buy (measured: docs/notes/tta-history.md); DDP's own 25 MB buckets go alone. Where
            transport="auto"'s plan sends every bucket uncoded, each bucket is one average on its own, as with
            DDP's own hooks.

    Raises:
        ValueError: bucket_bytes < 0, config= and options both given, an option out of range,
            hierarchical=True with a process_group, or on_nonfinite="skip" (DDP owns the step).
    """

    # DDP checks the hook's annotations as objects: this module has no `from __future__ import annotations`
    __slots__ = ("config", "process_group", "bucket_bytes", "names", "pipeline", "world", "hierarchy",
                 "exchanges", "own", "plain", "to_worker", "_group", "_kinds", "_native", "__weakref__")

    def __init__(self, named_parameters, config: Optional[TernGradConfig] = None, process_group=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an integer >= 0, got {bucket_bytes!r}")
        if config is not None and options:
            raise ValueError("pass either config= or keyword options, not both")
        self.config = config if config is not None else TernGradConfig(**options)
        if self.config.hierarchical and process_group is not None:
            raise ValueError("hierarchical=True with DDP finds the nodes in the default process group; pass "
                             "process_group=None")
        if self.config.on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' needs an optimizer TernGrad owns; with DDP use 'raise' or, for "
                             "AMP's GradScaler, 'propagate'")
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes  # a group goes to the pipeline once its DDP buckets hold this many bytes
        self.names = {p: n for n, p in named_parameters}  # parameter -> its name
        self.pipeline: Optional[Pipeline] = None  # made on the first bucket: the process group is up by then
        self.world: Optional[TorchCollectives] = None  # DDP's ranks, over _group
        # the hook's own process group (_own_group), made here where torch.distributed is up (else on the first
        # bucket): every rank makes its state, as it makes its DDP model, while a rank's first call of stats or
        # state_dict may be its own
        up = dist.is_available() and dist.is_initialized()
        self._group = _own_group(process_group, self.config.timeout_s) if up else None
        self.hierarchy: Optional[Hierarchy] = None  # hierarchical=True: the node and cross groups (made as _group)
        if up and self.config.hierarchical:
            self.hierarchy = discover_torch(self.config.timeout_s)
        self._kinds: dict = {}  # parameter -> (its name, whether it is coded): every bucket of every step asks
        self.exchanges = Exchanges(self)  # the buckets the pipeline exchanges, on a worker thread
        self.own = OwnAverages()  # the buckets the hook averages itself (hook.route: OWN)
        self._native: Optional[Native] = None  # the hook's C++ path, where register() put it there
        # every bucket a dense contiguous fp32 buffer on the CPU, as far as known: the parameters say so for their
        # dtype and device, register() for sparse gradients, each bucket for itself (what the C++ path averages)
        self.plain = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in self.names if p.requires_grad)
        self.to_worker = False  # this step has sent a bucket to the worker: its later buckets go there too

    def __getstate__(self):
        # it holds a process group, a worker thread and the model's parameters, none of which outlive the process
        raise TypeError("hvd_terngrad: a TernGradState does not pickle (it holds its process group, its worker "
                        "thread and the model's parameters); checkpoint state.state_dict() and, on resume, make a "
                        "new state and call load_state_dict()")

    def connect(self) -> Pipeline:
        """This rank's pipeline (once): over the process group, or with hierarchical=True over the ranks of its
        local index on every node, coding as its node."""
        if self.pipeline is None:
            if self._group is None:
                self._group = _own_group(self.process_group, self.config.timeout_s)
            if self.config.hierarchical:
                self.hierarchy = self.hierarchy or discover_torch(self.config.timeout_s)
            s = Session(self.config, TorchCollectives(self._group, timeout_s=self.config.timeout_s), self.hierarchy)
            self.world, self.pipeline = s.world, s.pipeline
        return self.pipeline

    @property
    def stats(self):
        return self.connect().stats

    def state_dict(self) -> dict:
        return self.connect().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.connect().load_state_dict(state)
        if self._native is not None:  # residuals to merge, maybe: terngrad_hook takes the next step
            self._native.control.disable()

    def register(self, module: torch.nn.parallel.DistributedDataParallel) -> None:
        """module.register_comm_hook(self, terngrad_hook), with the hook's C++ path in front where it can ever
        average a bucket (transport="auto", no hierarchy or process_group, more than one rank, every bucket dense
        fp32 on the CPU) and the library has it built for this torch (hvd_terngrad._ddp_hook, csrc/ddp_hook.cpp;
        else a warning, and the hook runs in Python). In each step for which transport="auto"'s plan is fp32 for
        every bucket, on the CPU (in its trial, or kept), the C++ path averages each bucket as OwnAverages.start
        does, to the same bits and with the same errors, and terngrad_hook is not called: on a fast link, a hook in
        Python costs the step 5-6% against DDP's own C++ allreduce (measured: docs/notes/tta-log.md, "The
        DDP hook in C++"). Every other step's buckets go to terngrad_hook (Native.steer).

        Raises TernGradError where DDP was built for compiled autograd's Python reducer
        (torch._dynamo.config.optimize_ddp = "python_reducer"), which calls no hook DDP's reducer holds and
        hands register_comm_hook's hooks one gradient at a time, not a bucket."""
        if getattr(module, "_use_python_reducer", False):
            raise TernGradError(PYTHON_REDUCER)
        self.plain = self.plain and not _sparse_gradients(module.module)
        if not self._native_can_run():
            module.register_comm_hook(self, terngrad_hook)
            return
        native = native_module()
        if native is None:
            module.register_comm_hook(self, terngrad_hook)
            return
        module._check_comm_hook(terngrad_hook)
        module.logger._set_comm_hook_name("hvd_terngrad.ddp.terngrad_hook (C++ path)")
        self._native = bridge = Native(self)  # held here; the hook holds it weakly, as it holds this state
        bridge.control = native.register(module.reducer, weakref.ref(bridge), self, terngrad_hook)

    def _native_can_run(self) -> bool:
        """Whether the C++ path could ever average a bucket of this state (register; Native.steer decides each
        step): only transport="auto"'s uncoded plans run there, over the hook's own group of several ranks."""
        size = dist.get_world_size(self.process_group)
        return (self.config.transport == "auto" and self.process_group is None and not self.config.hierarchical
                and self.plain and size > 1)

    @property
    def native(self) -> bool:
        """Whether the hook's C++ path averages the buckets now (register)."""
        return self._native is not None and self._native.control.on

    # ------------------------------------------------------------------------------------------
    def end_step(self) -> None:
        """A step's end, on whichever thread ends it: the pipeline's next step, and which path averages it."""
        self.pipeline.next_step()
        if self._native is not None:
            self._native.steer()

    def split(self, bucket: dist.GradBucket):
        """The bucket's gradients as (name, view of the buffer): the coded ones, and those that stay in float."""
        coded, floats = [], []
        for p, grad in zip(bucket.parameters(), gradient_views(bucket)):
            kind = self._kinds.get(p)
            if kind is None:
                kind = self._kinds[p] = self.kind(p)
            (coded if kind[1] else floats).append((kind[0], grad))
        return coded, floats

    def gradients(self, bucket: dist.GradBucket) -> list:
        """The bucket's gradients as (name, view of the buffer), coded or not."""
        coded, floats = self.split(bucket)
        return coded + floats

    def kind(self, p) -> tuple:
        """(p's name, whether it is coded): config.compresses matches names against patterns."""
        name = self.names.get(p)
        if name is None:
            raise ValueError("hvd_terngrad: a DDP bucket holds a parameter that is not among the "
                             "named_parameters given to TernGradState (pass the DDP module's)")
        return name, self.config.compresses(name, p.numel())

    def uncoded_wire(self) -> Optional[str]:
        """The wire where this step's plan sends every bucket uncoded (transport="auto"; no hierarchy), else None
        (hook.route reads it)."""
        return self.pipeline.plan.all_uncoded if self.hierarchy is None else None


def _sparse_gradients(module: torch.nn.Module) -> bool:
    """Whether any of the module's layers makes sparse gradients (DDP buckets them alone, as sparse tensors)."""
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in module.modules())



def _own_group(process_group, timeout_s: float):
    """A process group of the hook's own over DDP's ranks, whose gloo timeout is timeout_s. DDP issues
    collectives on its own group during backward (find_unused_parameters' and static_graph's map of the
    parameters used), from the autograd thread, while the hook's worker issues the buckets' exchange. Ranks pair
    collectives on one group by the order in which each issues them, so on DDP's group the two streams paired
    differently on different ranks: gloo aborted ("Received data size doesn't match expected size")."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if process_group is None:
        return dist.new_group(timeout=timeout)  # every rank calls it
    # only DDP's ranks call it (the ranks outside it make no state); torch names each such group apart
    return dist.new_group(dist.get_process_group_ranks(process_group), timeout=timeout,
                          use_local_synchronization=True)

