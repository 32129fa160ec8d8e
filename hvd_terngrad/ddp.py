"""TernGrad for PyTorch DistributedDataParallel: a communication hook on the same exchange pipeline.

    from hvd_terngrad.ddp import TernGradState
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = TernGradState(model.named_parameters(), config=TernGradConfig.recommended())
    state.register(ddp)  # ddp.register_comm_hook(state, terngrad_hook), with the C++ path below in front

No Horovod: the collectives are torch.distributed's (gloo on CPU, NCCL on GPU; collectives.distributed), and
`torchrun` launches the job. The hook's collectives run on a process group of its own over DDP's ranks,
made with the state (_own_group): DDP's own collectives during backward (find_unused_parameters,
static_graph) cannot pair with them. hierarchical=True finds the nodes itself (hierarchy.discover_torch) and
codes only between them, as hvd_terngrad's Horovod optimizer does. DDP's buckets go through the pipeline in groups of at
least bucket_bytes (4 MiB, as the optimizer's buckets) or up to the step's last bucket: a smaller bucket (DDP
caps its first at 1 MB) waits for the next. A group's coded tensors share their scalers in one Max allreduce
and travel with the configured transport, two collectives whatever its size; the tensors that stay in float
(min_numel, exclude) are averaged in one allreduce. The codes depend on (seed, step, rank, tensor name) and the
shared scaler, not on the buckets, so for allgather, summed and sharded the average is bit for bit the one
hvd_terngrad's Horovod optimizer computes (sharded-ternary's owners draw per group, so there it differs).
A bucket of sparse gradients goes uncoded, alone, averaged as DDP's allreduce_hook averages it (_Exchanges.sparse);
with one rank the hook returns the buckets as they are.

How it overlaps backward (the trade-off against a hook that waits inside itself): the hook hands each group of
buckets to one worker thread of this state and returns each bucket's future. The worker runs the whole
exchange (moments, scaler allreduce, encode, transport, decode) while backward goes on, group after group in
the order DDP launches the buckets, and completes the futures. One thread issues every collective:
torch.distributed matches collectives by the order in which each rank issues them, so two threads issuing them
could pair different collectives across ranks. DDP waits for every future at the end of backward. As DDP
expects of a hook, the future's value is the bucket's average (DDP does not divide by the world size).

Where transport="auto" sends every bucket uncoded in fp32, no coded bucket's collectives need keeping in order,
and the hook averages each fp32 bucket itself, as DDP's own allreduce does: one allreduce in place, no worker
thread (TernGradState._average_now; its non-finite check and its bound on a rank that never joins need no
collective in a callback). Only up to a step's first bucket of another kind (fp64, bf16, sparse): that one and
every later bucket of the step go to the worker, so the training thread never issues a collective while the
worker may still issue an earlier one (_averages_now). Registered with TernGradState.register, those averages
run in C++ once auto has decided (csrc/ddp_hook.cpp, _Native), where a Python hook's calls cost a step on a fast
link 5-6%; there they can travel in bf16 too (NATIVE_WIRES), as torch's bf16_compress_hook sends them. In fp16 a
tensor that outgrew its scale needs a second average (transports.uncoded), which a callback may not start: the
hook launches each bucket's fp16 average itself, in launch order, and the worker finishes the step's buckets
after the last launch (TernGradState._all_uncoded).

Why not chain the collectives with `.then()` as DDP's own hooks do: a callback runs when its collective
completes, and buckets complete in a different order on different ranks, so the collectives a callback issues
pair up differently across ranks. On gloo that aborts the job ("Received data size doesn't match expected
size") or hangs it; torch's powerSGD_hook does exactly this on an emulated 1 Gbit/s cluster. `InLaunchOrder`
runs any DDP hook the safe way, and the benchmarks run PowerSGD through it.
"""
import datetime
import math
import queue
import threading
import time
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from hvd_terngrad.buckets import DEFAULT_BUCKET_BYTES
from hvd_terngrad.collectives.distributed import TorchCollectives
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.errors import CollectiveTimeoutError, NonFiniteGradientError, TernGradError
from hvd_terngrad.finite import mark, marked_rank, marker_positions, nonfinite, nonfinite_average
from hvd_terngrad.hierarchy import Hierarchy, discover_torch
from hvd_terngrad.pipeline import Group, Pipeline
from hvd_terngrad.transports.uncoded import FP32, UNCODED

# The wires of the plans the C++ path averages (_Native.steer), offered to transport="auto" as its faster path
# (AutoPlan.offer): fp32 first, the plan in force where auto's plan is untried. bf16 halves the bytes for two passes
# (the rounding, and the reading back), which the trial weighs; fp16 needs a scale per tensor and, where one
# outgrows it, a second average, which the C++ path does not make.
NATIVE_WIRES = ("fp32", "bf16")


class TernGradState:
    """The state of terngrad_hook (one per DDP model), in the manner of PowerSGDState.

    named_parameters: the module's named parameters (names key the codes, exclude= and the errors).
    config / **options: a TernGradConfig, or its fields as keywords.
    process_group: the torch.distributed group DDP averages over (default: the whole world). Every rank of it
        makes its state at the same point of its program, as it makes its DDP model: the state makes a process
        group of its own over the same ranks.
    bucket_bytes: DDP buckets smaller than this wait for the next ones and go through the pipeline with them, as
        one group of at least this many bytes or up to the step's last bucket (0: each bucket on its own). A
        group costs two collectives whatever its size, which on a slow link outweighs the overlap a small
        bucket would buy (measured: docs/notes/tta-history.md); DDP's own 25 MB buckets go alone. Where
        transport="auto"'s plan sends every bucket uncoded, each bucket is one average on its own, as with DDP's
        own hooks.
    """

    # DDP checks the hook's annotations as objects: this module has no `from __future__ import annotations`
    __slots__ = ("config", "process_group", "bucket_bytes", "names", "pipeline", "world", "hierarchy",
                 "_group", "_kinds", "_exchanges", "_own", "_native", "_plain", "_to_worker", "__weakref__")

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
        self._exchanges = _Exchanges(self)  # the buckets the pipeline exchanges, on a worker thread
        self._own = _OwnAverages()  # the buckets it averages itself (_average_now)
        self._native: Optional[_Native] = None  # the hook's C++ path, where register() put it there
        # every bucket a dense contiguous fp32 buffer on the CPU, as far as known: the parameters say so for their
        # dtype and device, register() for sparse gradients, each bucket for itself (what the C++ path averages)
        self._plain = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in self.names if p.requires_grad)
        self._to_worker = False  # this step has sent a bucket to the worker: its later buckets go there too

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
            self.world = TorchCollectives(self._group, timeout_s=self.config.timeout_s)
            if self.config.hierarchical:
                h = self.hierarchy = self.hierarchy or discover_torch(self.config.timeout_s)
                self.pipeline = Pipeline(self.config, h.cross or self.world, rank=h.topology.node,
                                         size=h.topology.nodes)
                for comm in (h.local, self.world):
                    if comm is not None:
                        comm.stats = self.pipeline.stats
            else:
                self.pipeline = Pipeline(self.config, self.world)
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
        every bucket, on the CPU (in its trial, or kept), the C++ path averages each bucket as _OwnAverages.start
        does, to the same bits and with the same errors, and terngrad_hook is not called: on a fast link, a hook in
        Python costs the step 5-6% against DDP's own C++ allreduce (measured: docs/notes/tta-log.md, "The
        DDP hook in C++"). Every other step's buckets go to terngrad_hook (_Native.steer).

        Raises TernGradError where DDP was built for compiled autograd's Python reducer
        (torch._dynamo.config.optimize_ddp = "python_reducer"), which calls no hook DDP's reducer holds and
        hands register_comm_hook's hooks one gradient at a time, not a bucket."""
        if getattr(module, "_use_python_reducer", False):
            raise TernGradError(_PYTHON_REDUCER)
        self._plain = self._plain and not _sparse_gradients(module.module)
        if not self._native_can_run():
            module.register_comm_hook(self, terngrad_hook)
            return
        native = _native_module()
        if native is None:
            module.register_comm_hook(self, terngrad_hook)
            return
        module._check_comm_hook(terngrad_hook)
        module.logger._set_comm_hook_name("hvd_terngrad.ddp.terngrad_hook (C++ path)")
        self._native = bridge = _Native(self)  # held here; the hook holds it weakly, as it holds this state
        bridge.control = native.register(module.reducer, weakref.ref(bridge), self, terngrad_hook)

    def _native_can_run(self) -> bool:
        """Whether the C++ path could ever average a bucket of this state (register; _Native.steer decides each
        step): only transport="auto"'s uncoded plans run there, over the hook's own group of several ranks."""
        size = dist.get_world_size(self.process_group)
        return (self.config.transport == "auto" and self.process_group is None and not self.config.hierarchical
                and self._plain and size > 1)

    @property
    def native(self) -> bool:
        """Whether the hook's C++ path averages the buckets now (register)."""
        return self._native is not None and self._native.control.on

    # ------------------------------------------------------------------------------------------
    def _step_ends(self) -> None:
        """A step's end, on whichever thread ends it: the pipeline's next step, and which path averages it."""
        self.pipeline.next_step()
        if self._native is not None:
            self._native.steer()

    def _split(self, bucket: dist.GradBucket):
        """The bucket's gradients as (name, view of the buffer): the coded ones, and those that stay in float."""
        coded, floats = [], []
        for p, grad in zip(bucket.parameters(), _gradient_views(bucket)):
            kind = self._kinds.get(p)
            if kind is None:
                kind = self._kinds[p] = self._kind(p)
            (coded if kind[1] else floats).append((kind[0], grad))
        return coded, floats

    def _named(self, bucket: dist.GradBucket) -> list:
        """The bucket's gradients as (name, view of the buffer), coded or not."""
        coded, floats = self._split(bucket)
        return coded + floats

    def _kind(self, p) -> tuple:
        """(p's name, whether it is coded): config.compresses matches names against patterns."""
        name = self.names.get(p)
        if name is None:
            raise ValueError("hvd_terngrad: a DDP bucket holds a parameter that is not among the "
                             "named_parameters given to TernGradState (pass the DDP module's)")
        return name, self.config.compresses(name, p.numel())

    def _all_uncoded(self) -> Optional[str]:
        """The wire where transport="auto"'s plan in force sends every bucket uncoded (no hierarchy), else None.
        Then no coded bucket's collectives need keeping in order on the worker thread, and the hook itself
        starts each bucket's average on the training thread, in DDP's launch order: in fp32 it averages the
        bucket itself (_average_now). In fp16 a tensor that outgrew its scale is averaged again, a second
        collective that a callback may not start, so the hook only launches the average and the worker finishes
        the step's buckets after the last launch, any second collective in bucket order on every rank. The
        hand-over to the worker before the launch cost about 0.2 ms on the step's critical path (measured:
        docs/notes/tta-log.md, "The hook's fp16 plan at 1 Gbit/s")."""
        auto = self.pipeline.auto
        done = auto is not None and auto.coded is not None and not auto.coded and self.hierarchy is None
        return auto.wire if done else None

    def _averages_now(self, buf: torch.Tensor, wire: Optional[str]) -> bool:
        """Whether the hook averages this bucket (buf its buffer) itself on the training thread (_average_now),
        wire being _all_uncoded()'s: a dense fp32 bucket of a step none of whose earlier buckets went to the
        worker (_to_worker). So a step's collectives on the hook's group are issued in launch order: its first
        buckets' here, then the worker's. Were the worker still exchanging an earlier bucket while the training
        thread started this one's allreduce, the ranks could issue the two in different orders, and gloo pairs
        collectives by that order (a model with fp64 and fp32 layers aborted: "Received data size doesn't match
        expected size")."""
        return (wire == "fp32" and self.process_group is None and not self._to_worker
                and buf.layout == torch.strided and buf.dtype == torch.float32)

    def _average_now(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's fp32 average, made by the hook itself (_OwnAverages.start)."""
        return self._own.start(self, bucket)


class _Exchanges:
    """The buckets the pipeline exchanges (all but those the hook averages itself: _OwnAverages, _Native): held
    until a group holds bucket_bytes (or the step's last bucket), then exchanged on one worker thread in DDP's
    launch order (_Serial), so that every rank issues the same collectives in the same order."""

    __slots__ = ("owner", "order", "held")

    def __init__(self, owner: TernGradState):
        self.owner = owner  # the state: its pipeline, world, hierarchy and config
        self.order = _Serial("hvd_terngrad-ddp")  # the worker thread that exchanges the buckets
        self.held: list = []  # this step's buckets waiting for the next ones (_Job, with its future)

    def begin(self, job: "_Job") -> None:
        """The group into the pipeline: prepared, and its scalers shared and its transport started (a wait), or
        its uncoded average launched."""
        pipe, more = self.owner.pipeline, f" and {len(job.coded) - 1} more" if len(job.coded) > 1 else ""
        job.group = pipe.start(f"bucket.{job.index}", job.coded, send_when_shared=False, ready=job.ready,
                               what=f"DDP bucket {job.index} ({job.coded[0][0]!r}{more})")
        pipe.send(job.group)

    def end(self, job: "_Job") -> None:
        """The group's transport finished and its averages written into its gradients (propagate: non-finite
        ones are NaN)."""
        pipe = self.owner.pipeline
        pipe.progress(job.group, block=True)  # the second collective of a sharded transport
        pipe.finish_into(job.group, [v for _, v in job.coded])

    def raise_nonfinite(self, job: "_Job") -> None:
        """The group's non-finite averages raised, the same names on every rank, unless on_nonfinite="propagate"
        hands them to AMP's GradScaler (end left them NaN)."""
        pipe = self.owner.pipeline
        if self.owner.config.on_nonfinite != "propagate":
            pipe.coder.raise_nonfinite(pipe.nonfinite(job.group))

    def take(self, job: "_Job", launched: bool) -> None:
        """A bucket for the pipeline: held, and the held group sent once it holds bucket_bytes or ends the step.
        launched: the plan in force sends every bucket uncoded in fp16 (TernGradState._all_uncoded), and the
        bucket's one average is launched here, in DDP's launch order. A sparse bucket goes to the worker on its
        own, or held in its place among the launched ones, whose worker runs after the last launch."""
        if job.sparse is not None and not launched:
            self.send_held()
            self.held.append(job)
            self.send_held()
            return
        if launched and job.sparse is None:
            job.coded, job.floats = job.coded + job.floats, []
            try:
                self.begin(job)
            except BaseException:
                self.held = []  # the step ends here on every rank alike (the same tensors, the same options)
                raise
        self.held.append(job)
        if job.last or (not launched and sum(j.buffer.numel() * j.buffer.element_size() for j in self.held)
                        >= self.owner.bucket_bytes):
            self.send_held()

    def send_held(self) -> None:
        """The held buckets to the worker, as one group."""
        if self.held:
            jobs, self.held = self.held, []
            self.order.submit_into(lambda: self.finish(jobs), [j.future for j in jobs], last=jobs[-1].last)

    def finish(self, jobs: list) -> list:
        """The exchange of one group of DDP buckets, on the worker thread: each bucket's average."""
        try:
            if jobs[0].group is not None or jobs[0].sparse is not None:  # one by one, in launch order
                for j in jobs:
                    if j.sparse is not None:
                        self.sparse(j)
                    else:  # launched by the hook (_all_uncoded)
                        self.end(j)
                        self.raise_nonfinite(j)
            else:
                self.exchange(jobs[0] if len(jobs) == 1 else _Job.merged(jobs))
        finally:  # every bucket of a step is coded with its number; the step ends with the bucket DDP marks
            # last, which its launch order ends with (DDP may plan its buckets again after the first step, so
            # their number is not fixed); a step that raised has ended too, as on the other front ends
            if jobs[-1].last:
                self.owner._step_ends()
        return [j.buffer for j in jobs]

    def exchange(self, job: "_Job") -> None:
        """One group's exchange: its averages written into its gradients (the views of DDP's buffers)."""
        pipe, h, key = self.owner.pipeline, self.owner.hierarchy, f"bucket.{job.index}"
        if h is None and job.floats and pipe.uncoded(key):  # one average, in place where it is fp32
            job.coded, job.floats = job.coded + job.floats, []
        node = h.average_in_node(job.coded) if h is not None and h.local is not None and job.coded else None
        floats = _FloatAverage(self.owner, job) if job.floats else None  # the tensors never coded
        if node is not None:
            h.wait_in_node(node)  # hierarchical: the node's float average, coded between nodes below
        if job.coded and (h is None or h.codes(job.index)):
            self.begin(job)
            self.end(job)
        # hierarchical with a node of several ranks, or with one node only (its float average was the whole
        # exchange): the node's verdict; otherwise the pipeline's
        if node is not None or (h is not None and h.cross is None and job.coded):
            self.finish_in_node(job)  # the coder's decoded averages to the rest of its node
        elif job.group is not None:
            self.raise_nonfinite(job)
        if floats is not None:
            floats.finish()

    def sparse(self, job: "_Job") -> None:
        """A bucket of sparse gradients averaged as DDP's allreduce_hook averages it, to the bit: divided by the
        world size, then summed (gloo gathers every rank's indices and values and sums them, into the bucket's
        tensor). A non-finite average is every rank's alike; only then does a Max allreduce ask which rank's
        gradient it was, and every rank raises the same error (or, on_nonfinite="propagate", hands on the NaN)."""
        owner = self.owner
        comm, pipe, buf = owner.world, owner.pipeline, job.buffer
        mine = bool(nonfinite([buf._values()]))
        buf.div_(comm.size)
        pipe.stats.add_float(buf._values().numel() * buf.element_size() + buf._indices().numel() * 8, comm.size)
        what = f"the sparse average of DDP bucket {job.index} ({job.sparse!r})"
        job.buffer = avg = comm.wait(comm.sum_async_(buf, name=f"terngrad.sparse.{job.index}"), what)
        if not nonfinite([avg._values()]) or owner.config.on_nonfinite == "propagate":
            return
        flag = torch.tensor([float(comm.rank + 1) if mine else 0.0])
        culprit = int(comm.wait(comm.max_allreduce_async(flag, name=f"terngrad.sparse.nonfinite.{job.index}"),
                                f"the non-finite ranks of {what}")) - 1
        raise nonfinite_average(job.sparse, culprit, pipe.step, comm.rank)

    def finish_in_node(self, job: "_Job") -> None:
        """hierarchical: the coder's averages broadcast to its node (a rank that found a non-finite average fills
        it with NaN first); the names non-finite anywhere, the same on every rank, raised unless propagated."""
        pipe = self.owner.pipeline
        mine = {it.name for it in pipe.nonfinite(job.group)} if job.group is not None else set()
        bad = self.owner.hierarchy.finish_in_node([(job.index, name, v) for name, v in job.coded], mine)
        if bad and self.owner.config.on_nonfinite != "propagate":
            raise NonFiniteGradientError(
                f"hvd_terngrad: non-finite (NaN/Inf) gradient in {bad[0]!r} at step {pipe.step} (its node's float "
                f"average or the codes between nodes, seen on rank {self.owner.world.rank}; affected: "
                f"{', '.join(map(repr, bad[:5]))}). Every rank raises this in the same step; on_nonfinite="
                f"'propagate' hands AMP's GradScaler a NaN average instead.")


class _FloatAverage:
    """A group's tensors that are never coded (min_numel, exclude), averaged in one allreduce over DDP's ranks on
    the worker: the uncoded transport's fp32 average (transports.uncoded), whose non-finite protocol the coded
    tensors' scalers share, so that a NaN there names tensor and rank on every rank in the same step."""

    __slots__ = ("owner", "job", "items", "handle")

    def __init__(self, owner: TernGradState, job: "_Job"):
        self.owner, self.job = owner, job
        coder = owner.pipeline.coder
        self.items = [coder.plain(name, v) for name, v in job.floats]
        self.handle = FP32.start(owner.world, FP32.encode(coder, self.items), f"float.{job.index}")

    def finish(self) -> None:
        """The averages written into the gradients; a non-finite one raised unless on_nonfinite="propagate"
        (then NaN, as AMP's GradScaler expects)."""
        comm, coder, floats = self.owner.world, self.owner.pipeline.coder, self.job.floats
        FP32.finish(comm, self.handle, f"the float average of DDP bucket {self.job.index}")
        direct = [v.view(-1) if v.dtype == torch.float32 and v.is_contiguous() else None for _, v in floats]
        for (_, v), avg in zip(floats, FP32.decode(coder, self.items, self.handle, outs=direct)):
            if avg.data_ptr() != v.data_ptr():
                v.copy_(avg.view(v.shape))
        if self.owner.config.on_nonfinite == "propagate":
            for (_, v), it in zip(floats, self.items):
                if it.nonfinite_rank >= 0:
                    v.fill_(float("nan"))
        else:
            coder.raise_nonfinite(self.items)


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


class _OwnAverages:
    """The buckets a TernGradState averages itself in a step (TernGradState._averages_now), and what the step's
    last bucket waits for."""

    __slots__ = ("sums", "nonfinite", "markers")

    def __init__(self):
        self.sums: list = []  # this step's averages started here (their checks' futures), until its last bucket
        self.nonfinite: list = []  # this step's non-finite averages there, (bucket index, error), for the last
        self.markers: dict = {}  # bucket index -> its _Markers

    def start(self, owner: "TernGradState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's fp32 average as DDP's own allreduce makes it: in place, started here, no worker thread,
        divided by the world size before the sum (_divide). A rank whose bucket is not finite, or holds a value
        beyond _sendable(size), first marks those tensors (finite.mark), so that a non-finite average names
        tensor and rank on every rank with no collective in a callback. As no rank sends more than that, N sums
        stay within fp32's range, and the check of the average reads only the elements a marker can be at
        (_Markers), not the whole buffer gloo has just written. The allreduce runs on the hook's own group,
        whose gloo timeout is timeout_s: a rank that never joins fails it in bounded time, as the worker's
        bounded waits do.

        A non-finite average leaves through the step's last bucket, whose future completes once every earlier
        average of the step and its check have (after; the worker's _held_back, for the same reason):
        raised from an earlier bucket, it let DDP end the step while this rank's later allreduces, or a late
        peer's, were in flight, and a training loop that then tore its process group down aborted a process
        ("Resource deadlock avoided": the group destroyed on its own gloo thread). A failed allreduce is raised
        at once."""
        pipe, me, size, buf = owner.pipeline, owner.world.rank, owner.world.size, bucket.buffer()
        # the gradients as (name, view of buf), made only where this step needs them (a view each): residuals kept
        # from the coded steps, merged once, or a bucket that is not finite
        named = owner._named(bucket) if pipe.coder.feedback.worker else None
        for name, grad in named or ():
            pipe.coder.merge_residual(name, grad)
        params = bucket.parameters()
        markers, mine, limit = self._markers(bucket, buf, params, size, pipe.coder.codec), [], _sendable(size)
        if not _divide(buf, size, markers.scale) <= limit:  # NaN included
            named = named or owner._named(bucket)
            mine = mark([grad for _, grad in named], me, limit)
        pipe.stats.add_float(buf.numel() * 4, size, tensors=len(params))
        summed = dist.all_reduce(buf, group=owner.world.group, async_op=True).get_future()
        step, last, index, held = pipe.step, bucket.is_last(), bucket.index(), self.nonfinite
        # The callbacks below hold the owner weakly: gloo's thread lets go of a callback after it ran, maybe after
        # the training has gone on and torn its process groups down, and the last reference to the owner's group
        # must not go there (a process group destroyed on its own thread aborts the process: "Resource deadlock
        # avoided"). DDP holds the state while its buckets are in flight.
        state, propagate = weakref.ref(owner), owner.config.on_nonfinite == "propagate"

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            nonlocal named
            try:
                fut.value()
            except RuntimeError as exc:
                named = named or state()._named(bucket)
                raise _failed_average(index, named, me, step, exc) from None
            if not _finite_average(markers, buf):
                named = named or state()._named(bucket)
                error = _nonfinite_averaged(named, mine, me, size, step, None if propagate else limit)
                if error is not None:
                    held.append((index, error))
            return buf

        if not last:  # the step's last bucket waits for this callback, not for the allreduce alone (after)
            done = summed.then(finish)
            self.sums.append(done)
            return done

        def finish_last(fut: torch.futures.Future) -> torch.Tensor:
            try:
                return finish(fut)
            finally:
                state()._step_ends()

        return self.after(summed, finish_last)

    def _markers(self, bucket: dist.GradBucket, buf: torch.Tensor, params: list, size: int, codec) -> "_Markers":
        """Where the bucket's average can carry a marker of any of `size` ranks, kept while its buffer and layout
        last (DDP may plan its buckets again, so they are checked, not assumed); buf, params: its buffer and
        parameters."""
        key = (size, buf.data_ptr(), tuple(map(id, params)))
        known = self.markers.get(bucket.index())
        if known is None or known.key != key:
            known = self.markers[bucket.index()] = _Markers(key, bucket, buf, size, codec)
            _forget_later_buckets(self.markers, bucket)
        return known

    def after(self, last: torch.futures.Future, finish) -> torch.futures.Future[torch.Tensor]:
        """The future of the step's last bucket (`last`, its value finish(last)), completed once every average
        start() began this step has, and raising the first bucket's non-finite average held there.

        It collects each earlier average's callback (its finish), not its allreduce: a callback that a future
        runs on completion may still be running, or waiting for the GIL, on gloo's thread when a later hook adds
        another callback to the same future, which then runs at once. Collecting the allreduces, the step's last
        bucket ended before the earlier finish had held its error, and a NaN step went on unraised."""
        sums, held, self.sums, self.nonfinite = self.sums, self.nonfinite, [], []

        def finish_step(_) -> torch.Tensor:
            value = finish(last)  # every earlier bucket's finish has run: collect_all waited for them
            if held:  # the last bucket's own, if it was averaged here, among them
                raise min(held, key=lambda h: h[0])[1]  # the first bucket's, as DDP would have met it
            return value

        return (torch.futures.collect_all(sums + [last]) if sums else last).then(finish_step)


class _Markers:
    """Where a bucket's average can carry a marker (finite.marker_positions), and how to read them."""

    __slots__ = ("key", "where", "at", "values", "scale")

    def __init__(self, key: tuple, bucket: dist.GradBucket, buf: torch.Tensor, size: int, codec):
        self.key = key  # (world size, the buffer's address, its parameters' ids): this holds the buffer (values)
        self.where = _marker_positions(bucket, buf, size)  # None: most of the buffer, read it all
        cpu = self.where is not None and buf.device.type == "cpu"
        self.at = self.where.tolist() if cpu else None  # the same, as Python ints
        # the buffer's elements as Python floats: on the CPU the check reads them with no torch op on gloo's
        # thread, where one op's dispatch alone cost about 40 µs (measured: docs/notes/tta-log.md, "The DDP
        # hook's own fp32 averages")
        self.values = memoryview(buf.numpy()) if cpu else None
        self.scale = codec.impl(buf).scale  # the codec's backend for the buffer (Backend.scale)


def _forget_later_buckets(known: dict, bucket: dist.GradBucket) -> None:
    """A new layout of the step's last bucket: DDP has fewer buckets than before, and what `known` (bucket index
    -> what was worked out for it) keeps of the later ones no longer holds their old buffers."""
    if bucket.is_last():
        for index in [i for i in known if i > bucket.index()]:
            del known[index]


def _marker_positions(bucket: dist.GradBucket, buf: torch.Tensor, size: int) -> Optional[torch.Tensor]:
    """finite.marker_positions of a bucket's buffer `buf`, for `size` ranks."""
    return marker_positions([(g.storage_offset() - buf.storage_offset(), g.numel()) for g in _gradient_views(bucket)],
                            size)


def _gradient_views(bucket: dist.GradBucket) -> list:
    """The bucket's gradients as views of its buffer that cover it, one per parameter. A complex parameter's
    gradient lies in the buffer as its real view (torch.view_as_real: 2 reals per element, the parameters one
    after another), where DDP's bucket.gradients() views p.numel() reals at offsets that count one real per
    element: through those, most of a complex bucket went unaveraged. DDP buckets each dtype apart, so a bucket
    is all complex or all real."""
    grads, params = bucket.gradients(), bucket.parameters()
    if not any(p.is_complex() for p in params):
        return grads
    buf, off, views = bucket.buffer(), 0, []
    for p in params:
        views.append(buf.narrow(0, off, 2 * p.numel()).view(*p.shape, 2))
        off += 2 * p.numel()
    if off != buf.numel():
        raise TernGradError(f"hvd_terngrad: DDP bucket {bucket.index()} of complex gradients holds {buf.numel()} "
                            f"reals where its parameters have {off}: a layout this hook does not know")
    return views


def _finite_average(markers: _Markers, buf: torch.Tensor) -> bool:
    """Whether a bucket's average is finite, read where a marker can be (or all of it): where no rank sent more
    than _sendable, nothing else can be non-finite."""
    if markers.values is not None:
        return all(map(math.isfinite, map(markers.values.__getitem__, markers.at)))
    return not nonfinite([buf if markers.where is None else buf.index_select(0, markers.where)])


class _Native:
    """The hook's C++ path (csrc/ddp_hook.cpp, TernGradState.register): when it takes the buckets (steer),
    and what it asks of Python: a bucket's layout once, a rank's markers and a non-finite average's error where a
    value is out of range, and the step's end once a step. It averages as _OwnAverages.start does, whose
    docstring says why each piece is there. It holds its state weakly, as start()'s callbacks do."""

    __slots__ = ("owner", "control", "at_end", "wire", "merging", "named", "mine", "held", "__weakref__")

    def __init__(self, owner: TernGradState):
        self.owner = weakref.ref(owner)
        self.control = None  # hvd_terngrad._ddp_hook.Control: on, or off (every bucket to terngrad_hook)
        self.at_end = False  # whether it ends each step once completed (auto's trial), as last enabled
        self.wire = "fp32"  # what the averages travel in (NATIVE_WIRES), as last enabled
        self.merging = False  # whether each bucket first takes its residuals (merge), as last enabled
        self.named: dict = {}  # bucket index -> (its gradients as TernGradState._named, its bytes)
        self.mine: dict = {}  # bucket index -> the tensors this rank marked there this step (finite.mark)
        self.held: list = []  # this step's non-finite averages, (bucket index, error), raised by the last bucket

    def steer(self) -> None:
        """At a step's end (TernGradState._step_ends): whether the C++ path averages the next step. It does where
        transport="auto"'s plan for it sends every bucket in a wire of NATIVE_WIRES, in its trial (whose steps it
        then ends once they have completed, as the other kinds' steps end, so that the trial times each kind
        alike) or decided, where every bucket is a contiguous fp32 buffer on the CPU, whose codec has tg_scale; with
        error feedback, the step after a coded one first merges each bucket's residuals (merge). Otherwise
        terngrad_hook averages the next step. Where this path can run them, auto's trial tries the plan in these
        wires alone and keeps another kind only where it is clearly faster (AutoPlan.prefer): on a fast link, the
        fp16 plan in Python costs a step what any Python hook does, and the trial's six steps cannot resolve
        that."""
        if self.control.on and not self.at_end and not self.merging:
            return  # the plan kept, no residual left to merge: nothing here changes (load_state_dict turns it off)
        owner = self.owner()
        pipe = owner.pipeline
        wire, trying = owner._all_uncoded(), pipe.auto is not None and not pipe.auto.decided
        native = wire in NATIVE_WIRES
        backend = self._backend(owner) if native or trying else None
        if trying:  # where this path runs the plan, its wires are auto's default
            pipe.auto.offer(NATIVE_WIRES if backend is not None else ())
        if backend is None or not native:
            self.control.disable()
            return
        at_end, merging = not pipe.auto.decided, bool(pipe.coder.feedback.worker)
        if not self.control.on or (self.at_end, self.wire, self.merging) != (at_end, wire, merging):
            size = owner.world.size
            self.control.enable(owner.world.group, size, backend.scale_kernel(), _sendable(size), pipe.step, at_end,
                                wire == "bf16", merging)
            self.at_end, self.wire, self.merging = at_end, wire, merging

    @staticmethod
    def _backend(owner: TernGradState):
        """The buckets' codec backend where this path can average them (the hook's own group, no hierarchy, every
        bucket a contiguous fp32 buffer on the CPU, a codec with tg_scale), else None."""
        if owner.process_group is not None or owner.hierarchy is not None or not owner._plain:
            return None
        backend = owner.pipeline.coder.codec.impl(torch.empty(0))  # the buckets' (on the CPU)
        return backend if hasattr(backend, "scale_kernel") else None

    def layout(self, bucket: dist.GradBucket) -> tuple:
        """A bucket's new layout: (the positions where its average can carry a marker, or None to read it all;
        tg_scale's threads for its buffer)."""
        owner = self.owner()
        buf = bucket.buffer()
        where = _marker_positions(bucket, buf, owner.world.size)
        self.named[bucket.index()] = (owner._named(bucket), buf.numel() * buf.element_size())
        _forget_later_buckets(self.named, bucket)
        return None if where is None else where.tolist(), owner.pipeline.coder.codec.impl(buf).threads_for(buf.numel())

    def merge(self, index: int) -> None:
        """Before the scaling, on the step after a coded one (steer): a coded step's error-feedback residuals added
        into bucket `index`'s gradients, and let go, as _OwnAverages.start adds them (Coder.merge_residual)."""
        coder = self.owner().pipeline.coder
        for name, grad in self.named[index][0]:
            coder.merge_residual(name, grad)

    def mark(self, index: int) -> None:
        """Before the send: this rank's tensors of bucket `index` beyond _sendable, or not finite, marked."""
        owner = self.owner()
        grads = [grad for _, grad in self.named[index][0]]
        self.mine[index] = mark(grads, owner.world.rank, _sendable(owner.world.size))

    def nonfinite(self, index: int, step: int) -> Optional[str]:
        """Bucket `index`'s average is not finite: "held" where its error waits for the step's last bucket."""
        owner = self.owner()
        limit = None if owner.config.on_nonfinite == "propagate" else _sendable(owner.world.size)
        error = _nonfinite_averaged(self.named[index][0], self.mine.pop(index, []), owner.world.rank,
                                    owner.world.size, step, limit)
        if error is None:
            return None
        self.held.append((index, error))
        return "held"

    def failed(self, index: int, what: str, step: int) -> str:
        """The message DDP raises where bucket `index`'s allreduce failed (this rank's markers there, if any,
        go with the step: a later step's non-finite average must not name them)."""
        self.mine.pop(index, None)
        return _message(_failed_average(index, self.named[index][0], self.owner().world.rank, step, what))

    def step_done(self, buckets: list) -> int:
        """The step's end, its last allreduce launched: its byte counts, and the pipeline's next step."""
        owner = self.owner()
        pipe, size = owner.pipeline, owner.world.size
        sent = UNCODED[self.wire].element_bytes  # a value's bytes on the wire, of the buffer's 4
        for index in buckets:
            named, nbytes = self.named[index]
            pipe.stats.add_float(nbytes * sent // 4, size, tensors=len(named))
        owner._step_ends()
        return pipe.step

    def raise_held(self) -> Optional[str]:
        """The message DDP raises for the step's first non-finite average, as _OwnAverages.after raises it."""
        held, self.held = self.held, []
        return _message(min(held, key=lambda h: h[0])[1]) if held else None


def _message(error: BaseException) -> str:
    """An error as DDP raises one from a hook's callback: its type's name and its message."""
    return f"{type(error).__name__}: {error}"


def _native_module():
    """hvd_terngrad._ddp_hook, or None (a warning, once) where it is not built or not built for this torch."""
    global _NATIVE
    if _NATIVE is None:
        try:
            from hvd_terngrad import _ddp_hook
            _NATIVE = _ddp_hook
        except ImportError as exc:
            _NATIVE = False
            warnings.warn(f"hvd_terngrad: the DDP hook's C++ path is not available ({exc}); the hook runs in Python, "
                          "which costs a step on a fast link 5-6% (rebuild against this torch: scripts/install.sh, "
                          "or pip install --no-build-isolation .)", stacklevel=3)
    return _NATIVE or None


_NATIVE = None  # hvd_terngrad._ddp_hook once loaded; False where it cannot be


def _failed_average(index: int, named: list, me: int, step: int, exc) -> CollectiveTimeoutError:
    """The error of a bucket's fp32 average whose allreduce failed (named: its gradients, as TernGradState._named)."""
    return CollectiveTimeoutError(
        f"hvd_terngrad: the fp32 average of DDP bucket {index} ({named[0][0]!r} and {len(named) - 1} more) failed "
        f"on rank {me} at step {step} (a rank that never joined fails it after timeout_s): {exc}")


def _nonfinite_averaged(named: list, mine: list, me: int, size: int, step: int, limit: Optional[float]
                        ) -> Optional[NonFiniteGradientError]:
    """A bucket's non-finite average, read in full: its non-finite tensors made NaN throughout, as the coded path
    hands them to AMP's GradScaler, and the error every rank raises for the first (None where limit is None:
    on_nonfinite="propagate"). named: its gradients, as TernGradState._named; mine: the indices of those this
    rank marked (finite.mark), one too small to carry any marker being ours."""
    bad = nonfinite([grad for _, grad in named])
    error = None
    if limit is not None:
        first = bad[0]  # whose marker it carries
        culprit = marked_rank(named[first][1], size)
        error = nonfinite_average(named[first][0], me if culprit < 0 and first in mine else culprit, step, me,
                                  limit * size)
    for i in bad:
        named[i][1].fill_(float("nan"))
    return error


_FP32_MAX = torch.finfo(torch.float32).max


def _sendable(size: int) -> float:
    """The largest |value| a rank sends in a bucket it averages itself (_OwnAverages.start): `size` of them sum
    to at most half of fp32's largest, with room for any rounding, so no finite average overflows. A larger
    one, a gradient within a factor 2 of fp32's largest, counts as an overflow, as AMP's GradScaler counts the
    Inf it would soon be."""
    return _FP32_MAX / (2 * size)


def _divide(buf: torch.Tensor, size: int, scale) -> float:
    """buf * (1/size) in place, before the allreduce, and its largest |value| after (NaN where it holds one),
    in one pass of the codec. DDP's own allreduce scales so (its reducer multiplies each gradient by 1/size as
    it copies it into the bucket), and so the average is DDP's to the bit for any world size. There backward
    has just written the bucket and it is in cache; after the sum, the division ran on gloo's thread over a
    buffer gloo had just written, on the step's critical path (measured: docs/notes/tta-log.md, "The DDP
    hook's own fp32 averages"). scale: the codec backend's (Backend.scale; buf is contiguous fp32)."""
    return scale(buf, 1.0 / size)


class _Job:
    """A DDP bucket's exchange, or (merged) that of a group of consecutive buckets."""

    __slots__ = ("index", "last", "buffer", "coded", "floats", "sparse", "group", "ready", "future")

    def __init__(self, bucket, coded, floats, sparse: Optional[str] = None):
        self.index, self.last, self.buffer = bucket.index(), bucket.is_last(), bucket.buffer()
        # a bucket of sparse gradients, which DDP gives one parameter: its name (_Exchanges.sparse); else None
        self.sparse = sparse
        self.ready = time.perf_counter()  # when backward handed the bucket over (transport="auto" measures it)
        self.coded, self.floats = coded, floats
        self.group: Optional[Group] = None  # in the pipeline, once the worker started it
        self.future = torch.futures.Future()  # the bucket's average, or the exchange's error

    @classmethod
    def merged(cls, jobs: list) -> "_Job":
        """One group of several buckets: named by the first (its pipeline group and auto's plan), ready with
        the last."""
        job = cls.__new__(cls)
        job.index, job.last, job.buffer, job.ready = jobs[0].index, jobs[-1].last, None, jobs[-1].ready
        job.coded = [x for j in jobs for x in j.coded]
        job.floats = [x for j in jobs for x in j.floats]
        job.group = job.future = job.sparse = None
        return job


def terngrad_hook(state: TernGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average with TernGrad (Wen et al., NeurIPS 2017), 2-bit stochastic
    ternary codes and a shared scaler per tensor. The state's worker thread exchanges the bucket (with the
    buckets before it that were under bucket_bytes) while backward goes on, and completes the returned future.
    A bucket of sparse gradients (nn.Embedding(sparse=True)) goes uncoded, averaged as DDP's allreduce_hook
    averages it (_Exchanges.sparse). With one rank the gradients stay as they are, as on Horovod."""
    if not isinstance(bucket, dist.GradBucket):  # compiled autograd's Python reducer: (grad, param)
        raise TernGradError(_PYTHON_REDUCER)
    state.connect()
    buf = bucket.buffer()
    if state.world.size == 1:
        done = torch.futures.Future()
        done.set_result(buf)
        return done
    wire = state._all_uncoded()  # the plan in force: every bucket uncoded in this wire, or None
    sparse = buf.layout != torch.strided
    state._plain = state._plain and not sparse and buf.dtype == torch.float32 and buf.device.type == "cpu" \
        and buf.is_contiguous()
    exchanges = state._exchanges
    try:
        if state._averages_now(buf, wire):
            if bucket.is_last():
                exchanges.order.end_step()
            return state._average_now(bucket)
        state._to_worker = True  # the step's later buckets follow this one to the worker (_averages_now)
        if sparse:
            job = _Job(bucket, [], [], sparse=state._kind(bucket.parameters()[0])[0])
        else:
            job = _Job(bucket, *state._split(bucket))
        exchanges.take(job, launched=wire == "fp16")
    finally:
        if bucket.is_last():
            state._to_worker = False
    if job.last:  # the step's earlier buckets may have been averaged by the hook itself (_to_worker)
        return state._own.after(job.future, _value_or_raise)
    return job.future.then(_value_or_raise)


_PYTHON_REDUCER = (
    "hvd_terngrad: this DDP model runs compiled autograd's Python reducer (torch._dynamo.config.optimize_ddp = "
    "'python_reducer'), which hands a communication hook one gradient at a time and ignores its result, so "
    "TernGrad's hook cannot average it. Build the DDP model with optimize_ddp left at its default (or "
    "'ddp_optimizer'); torch.compile of the model works with the hook there.")


class _Serial:
    """One worker thread that runs DDP buckets' exchanges one after another, in the order DDP launched them,
    so that every rank issues the same collectives in the same order. submit(run) returns a future of run()'s
    tensor; where run() returns a future (another hook's), the worker waits for it before the next bucket."""

    __slots__ = ("name", "_queue", "_thread", "_failed", "_open")

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.Queue = queue.Queue()  # (run, futures, last), in launch order
        self._thread: Optional[threading.Thread] = None  # started on the first bucket
        self._failed: list = []  # this step's failed (futures, values), held until its last submission has run
        self._open = False  # the step has had submissions, none of them its last (set by the submitting thread)

    def submit(self, run) -> torch.futures.Future:
        fut = torch.futures.Future()  # the worker sets the tensor, or the error
        self.submit_into(lambda: [_resolved(run())], [fut])
        # An error set with set_exception reaches DDP's C++ side as "Unable to cast <message> to Tensor"; raised
        # in a callback, it reaches the user as "...when running the callback: <Type>: <message>"
        return fut.then(_value_or_raise)

    def submit_into(self, run, futures: list, last: bool = True) -> None:
        """run() returns a value per future, which the worker sets in them (or its error in all of them); the
        caller hands DDP `future.then(_value_or_raise)`. last=False: the step has more submissions to come, and
        an error that every rank raises alike is held until they have run (_held_back)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((run, futures, last))
        self._open = not last

    def end_step(self) -> None:
        """The step's last bucket went another way (the uncoded fast path): release any error held back. A step
        that sent the worker nothing costs it no wake-up."""
        if self._open:
            self.submit_into(list, [])

    def _loop(self) -> None:
        while True:
            run, futures, last = self._queue.get()
            error = None
            try:
                values = run()
            except BaseException as exc:  # noqa: BLE001  (DDP raises it where it waits for the bucket)
                error = exc.with_traceback(None)  # its frames would hold the collectives
                values = [error] * len(futures)
            # Let go of the buckets' hook and its futures before DDP may go on: they keep their process group's
            # work alive, and the training may end and destroy the group the moment the result is set; work
            # destroyed after its group (at interpreter exit, from this thread) aborts the process
            run = None
            if _held_back(error) and not last:
                self._failed.append((futures, values))
                done = []
            else:
                done = [(futures, values)]
            if last:
                done, self._failed = self._failed + done, []
            del futures, values, error
            for futures, values in done:
                for fut, value in zip(futures, values):
                    fut.set_result(value)
            done = futures = values = fut = value = None


def _held_back(error) -> bool:
    """Whether the worker holds `error` back until the step's last submission has run: an error every rank
    raises alike, in the same group. Set at once, it lets a rank's training end and tear its process group down
    while this rank's worker, or a late peer's, still runs the step's later groups; gloo then aborts a process
    at exit. A timeout is not held: the later groups would each wait out theirs."""
    return isinstance(error, TernGradError) and not isinstance(error, CollectiveTimeoutError)


def _resolved(out):
    """A hook's result: its future waited for (another hook's, run in launch order), or the tensor itself."""
    return out.wait() if isinstance(out, torch._C.Future) else out


def _value_or_raise(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


class InLaunchOrder:
    """Another DDP hook, run bucket after bucket in DDP's launch order (see the module's docstring): each
    bucket's hook starts once the previous bucket's future has completed, on one worker thread, while backward
    goes on. The cost: one bucket's collectives at a time. Where DDP has find_unused_parameters=True or
    static_graph=True, give the wrapped hook's state a process group of its own (dist.new_group() on every
    rank): DDP's own collectives during backward could otherwise pair with the worker's (see _own_group).

        ddp.register_comm_hook(InLaunchOrder(powerSGD_hook.powerSGD_hook, PowerSGDState(None)), in_launch_order)
    """

    __slots__ = ("hook", "state", "_order")

    def __init__(self, hook, state):
        self.hook, self.state = hook, state  # the wrapped hook and its own state
        self._order = _Serial("hvd_terngrad-ddp-order")


def in_launch_order(wrapped: InLaunchOrder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: `wrapped.hook(wrapped.state, bucket)`, in launch order (InLaunchOrder)."""
    return wrapped._order.submit(lambda: wrapped.hook(wrapped.state, bucket))


def bf16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook under another name. DDP refuses that hook by its name unless NCCL is there,
    though gloo sums bfloat16 too; registered as this, it runs on CPU as well."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
