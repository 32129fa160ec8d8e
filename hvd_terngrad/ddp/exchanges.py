"""The buckets the DDP hook's pipeline exchanges, on one worker thread in DDP's launch order: coded groups,
their never-coded tensors' fp32 average, sparse buckets, and the hierarchical path's node averages."""
import time
from typing import TYPE_CHECKING, Optional

import torch

from hvd_terngrad.ddp.serial import Serial
from hvd_terngrad.errors import NonFiniteGradientError
from hvd_terngrad.finite import nonfinite, nonfinite_average
from hvd_terngrad.pipeline import Group
from hvd_terngrad.transports.uncoded import FP32

if TYPE_CHECKING:
    from hvd_terngrad.ddp.state import TernGradState


class Exchanges:
    """The buckets the pipeline exchanges (all but those the hook averages itself: OwnAverages, Native): held
    until a group holds bucket_bytes (or the step's last bucket), then exchanged on one worker thread in DDP's
    launch order (Serial), so that every rank issues the same collectives in the same order."""

    __slots__ = ("owner", "order", "held")

    def __init__(self, owner: "TernGradState"):
        self.owner = owner  # the state: its pipeline, world, hierarchy and config
        self.order = Serial("hvd_terngrad-ddp")  # the worker thread that exchanges the buckets
        self.held: list = []  # this step's buckets waiting for the next ones (Job, with its future)

    def begin(self, job: "Job") -> None:
        """The group into the pipeline: prepared, and its scalers shared and its transport started (a wait), or
        its uncoded average launched."""
        pipe, more = self.owner.pipeline, f" and {len(job.coded) - 1} more" if len(job.coded) > 1 else ""
        job.group = pipe.start(f"bucket.{job.index}", job.coded, send_when_shared=False, ready=job.ready,
                               what=f"DDP bucket {job.index} ({job.coded[0][0]!r}{more})")
        pipe.send(job.group)

    def end(self, job: "Job") -> None:
        """The group's transport finished and its averages written into its gradients (propagate: non-finite
        ones are NaN)."""
        pipe = self.owner.pipeline
        pipe.progress(job.group, block=True)  # the second collective of a sharded transport
        pipe.finish_into(job.group, [v for _, v in job.coded])

    def raise_nonfinite(self, job: "Job") -> None:
        """The group's non-finite averages raised, the same names on every rank, unless on_nonfinite="propagate"
        hands them to AMP's GradScaler (end left them NaN)."""
        pipe = self.owner.pipeline
        if self.owner.config.on_nonfinite != "propagate":
            pipe.coder.raise_nonfinite(pipe.nonfinite(job.group))

    def take(self, job: "Job", launched: bool) -> None:
        """A bucket for the pipeline: held, and the held group sent once it holds bucket_bytes or ends the step.
        launched: the plan in force sends every bucket uncoded in fp16 (TernGradState.uncoded_wire), and the
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
                    else:  # launched by the hook (uncoded_wire)
                        self.end(j)
                        self.raise_nonfinite(j)
            else:
                self.exchange(jobs[0] if len(jobs) == 1 else Job.merged(jobs))
        finally:  # every bucket of a step is coded with its number; the step ends with the bucket DDP marks
            # last, which its launch order ends with (DDP may plan its buckets again after the first step, so
            # their number is not fixed); a step that raised has ended too, as on the other front ends
            if jobs[-1].last:
                self.owner.end_step()
        return [j.buffer for j in jobs]

    def exchange(self, job: "Job") -> None:
        """One group's exchange: its averages written into its gradients (the views of DDP's buffers)."""
        pipe, h, key = self.owner.pipeline, self.owner.hierarchy, f"bucket.{job.index}"
        if h is None and job.floats and pipe.uncoded(key):  # one average, in place where it is fp32
            job.coded, job.floats = job.coded + job.floats, []
        node = h.average_in_node(job.coded) if h is not None and h.local is not None and job.coded else None
        floats = FloatAverage(self.owner, job) if job.floats else None  # the tensors never coded
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

    def sparse(self, job: "Job") -> None:
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

    def finish_in_node(self, job: "Job") -> None:
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



class FloatAverage:
    """A group's tensors that are never coded (min_numel, exclude), averaged in one allreduce over DDP's ranks on
    the worker: the uncoded transport's fp32 average (transports.uncoded), whose non-finite protocol the coded
    tensors' scalers share, so that a NaN there names tensor and rank on every rank in the same step."""

    __slots__ = ("owner", "job", "items", "handle")

    def __init__(self, owner: "TernGradState", job: "Job"):
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



class Job:
    """A DDP bucket's exchange, or (merged) that of a group of consecutive buckets."""

    __slots__ = ("index", "last", "buffer", "coded", "floats", "sparse", "group", "ready", "future")

    def __init__(self, bucket, coded, floats, sparse: Optional[str] = None):
        self.index, self.last, self.buffer = bucket.index(), bucket.is_last(), bucket.buffer()
        # a bucket of sparse gradients, which DDP gives one parameter: its name (Exchanges.sparse); else None
        self.sparse = sparse
        self.ready = time.perf_counter()  # when backward handed the bucket over (transport="auto" measures it)
        self.coded, self.floats = coded, floats
        self.group: Optional[Group] = None  # in the pipeline, once the worker started it
        self.future = torch.futures.Future()  # the bucket's average, or the exchange's error

    @classmethod
    def merged(cls, jobs: list) -> "Job":
        """One group of several buckets: named by the first (its pipeline group and auto's plan), ready with
        the last."""
        job = cls.__new__(cls)
        job.index, job.last, job.buffer, job.ready = jobs[0].index, jobs[-1].last, None, jobs[-1].ready
        job.coded = [x for j in jobs for x in j.coded]
        job.floats = [x for j in jobs for x in j.floats]
        job.group = job.future = job.sparse = None
        return job

