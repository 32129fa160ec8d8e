"""TernGrad for PyTorch DistributedDataParallel: a communication hook on the same exchange pipeline.

    from hvd_terngrad.ddp import TernGradState, terngrad_hook
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = TernGradState(model.named_parameters(), config=TernGradConfig.recommended())
    ddp.register_comm_hook(state, terngrad_hook)

No Horovod: the collectives are torch.distributed's (gloo on CPU, NCCL on GPU; collectives.distributed), and
`torchrun` launches the job. Each DDP bucket goes through the pipeline as one group: its coded tensors share
their scalers in one Max allreduce and travel with the configured transport; the tensors that stay in float
(min_numel, exclude) are averaged in one allreduce. The codes depend on (seed, step, rank, tensor name) and the
shared scaler, not on the buckets, so for allgather, summed and sharded the average is bit for bit the one
hvd_terngrad's Horovod optimizer computes (sharded-ternary's owners draw per bucket, so there it differs).

How it overlaps backward (the trade-off against a hook that waits inside itself): the hook hands the bucket to
one worker thread of this state and returns its future. The worker runs the whole exchange (moments, scaler
allreduce, encode, transport, decode) while backward goes on, bucket after bucket in the order DDP launches
them, and completes the future. One thread issues every collective: torch.distributed matches collectives by
the order in which each rank issues them, so two threads issuing them could pair different collectives across
ranks. DDP waits for every future at the end of backward. As DDP expects of a hook, the future's value is the
bucket's average (DDP does not divide by the world size).
"""
import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from hvd_terngrad.collectives.distributed import TorchCollectives
from hvd_terngrad.config import TernGradConfig
from hvd_terngrad.pipeline import Group, Pipeline


class TernGradState:
    """The state of terngrad_hook (one per DDP model), in the manner of PowerSGDState.

    named_parameters: the module's named parameters (names key the codes, exclude= and the errors).
    config / **options: a TernGradConfig, or its fields as keywords.
    process_group: the torch.distributed group DDP averages over (default: the whole world).
    """

    # DDP checks the hook's annotations as objects: this module has no `from __future__ import annotations`
    __slots__ = ("config", "process_group", "names", "pipeline", "_work", "_worker")

    def __init__(self, named_parameters, config: Optional[TernGradConfig] = None, process_group=None, **options):
        if config is not None and options:
            raise ValueError("pass either config= or keyword options, not both")
        self.config = config if config is not None else TernGradConfig(**options)
        if self.config.hierarchical:
            raise ValueError("hierarchical=True is for Horovod's nodes; with DDP code between all ranks")
        if self.config.on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' needs an optimizer TernGrad owns; with DDP use 'raise' or, for "
                             "AMP's GradScaler, 'propagate'")
        self.process_group = process_group
        self.names = {p: n for n, p in named_parameters}  # parameter -> its name
        self.pipeline: Optional[Pipeline] = None  # made on the first bucket: the process group is up by then
        self._work: queue.Queue = queue.Queue()  # buckets for the worker thread, in launch order
        self._worker: Optional[threading.Thread] = None

    def connect(self) -> Pipeline:
        """This rank's pipeline over the process group (once), and the worker thread."""
        if self.pipeline is None:
            comm = TorchCollectives(self.process_group, timeout_s=self.config.timeout_s)
            self.pipeline = Pipeline(self.config, comm)
            self._worker = threading.Thread(target=self._run, name="hvd_terngrad-ddp", daemon=True)
            self._worker.start()
        return self.pipeline

    @property
    def stats(self):
        return self.connect().stats

    def state_dict(self) -> dict:
        return self.connect().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.connect().load_state_dict(state)

    # ------------------------------------------------------------------------------------------
    def _split(self, bucket: dist.GradBucket):
        """The bucket's gradients as (name, view of the buffer): the coded ones, and those that stay in float."""
        coded, floats = [], []
        for p, grad in zip(bucket.parameters(), bucket.gradients()):  # views of the bucket's buffer
            name = self.names.get(p)
            if name is None:
                raise ValueError("hvd_terngrad: a DDP bucket holds a parameter that is not among the "
                                 "named_parameters given to TernGradState (pass the DDP module's)")
            (coded if self.config.compresses(name, p.numel()) else floats).append((name, grad))
        return coded, floats

    def _run(self) -> None:
        while True:
            job = self._work.get()
            try:
                job.fut.set_result(self._finish(job))
            except BaseException as exc:  # noqa: BLE001  (DDP raises it where it waits for the bucket)
                job.fut.set_exception(exc)
            # hold nothing while waiting for the next bucket: a finished job's collectives keep their process
            # group alive, and one destroyed at interpreter exit, after the group was, aborts the process
            del job

    def _finish(self, job: "_Job") -> torch.Tensor:
        pipe, comm = self.pipeline, self.pipeline.comm
        if job.coded:
            more = f" and {len(job.coded) - 1} more" if len(job.coded) > 1 else ""
            job.group = pipe.start(f"bucket.{job.index}", job.coded, send_when_shared=False,
                                   what=f"DDP bucket {job.index} ({job.coded[0][0]!r}{more})")
        floats = None
        if job.floats:  # one float average of the bucket's uncoded tensors
            flat = torch.cat([v.reshape(-1) for _, v in job.floats])
            pipe.stats.add_float(flat.numel() * flat.element_size(), pipe.size)
            floats = comm.average_async_(flat, name=f"terngrad.float.{job.index}")
        if job.group is not None:
            pipe.send(job.group)  # the scalers shared (a wait), the codes encoded, the transport started
            pipe.progress(job.group, block=True)  # the second collective of a sharded transport
            pipe.finish_into(job.group, [v for _, v in job.coded])  # propagate: non-finite ones are NaN
            if self.config.on_nonfinite != "propagate":
                pipe.coder.raise_nonfinite(pipe.nonfinite(job.group))
        if floats is not None:
            avg, off = comm.wait(floats, f"the float average of DDP bucket {job.index}"), 0
            for _, v in job.floats:
                v.copy_(avg[off: off + v.numel()].view(v.shape))
                off += v.numel()
        self._step_done(job)
        return job.buffer

    def _step_done(self, job: "_Job") -> None:
        """After the step's last bucket, the next step: every bucket of a step is coded with its number. The
        worker finishes buckets in DDP's launch order, which ends with the one DDP marks last (DDP may plan
        its buckets again after the first step, so their number is not fixed)."""
        if job.last:
            self.pipeline.next_step()


class _Job:
    __slots__ = ("index", "last", "buffer", "coded", "floats", "group", "fut")

    def __init__(self, bucket, coded, floats):
        self.index, self.last, self.buffer = bucket.index(), bucket.is_last(), bucket.buffer()
        self.coded, self.floats = coded, floats
        self.group: Optional[Group] = None  # in the pipeline, once the worker started it
        self.fut: torch.futures.Future = torch.futures.Future()


def terngrad_hook(state: TernGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average with TernGrad (Wen et al., NeurIPS 2017), 2-bit stochastic
    ternary codes and a shared scaler per tensor. The state's worker thread exchanges the bucket while backward
    goes on, and completes the returned future."""
    state.connect()
    job = _Job(bucket, *state._split(bucket))
    state._work.put(job)
    return job.fut
