"""terngrad_hook, and route: which path each DDP bucket takes, decided in one place from the step's plan."""
import enum
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hvd_terngrad.ddp.exchanges import Job
from hvd_terngrad.ddp.serial import value_or_raise
from hvd_terngrad.errors import TernGradError

if TYPE_CHECKING:
    from hvd_terngrad.ddp.state import TernGradState


class Path(enum.Enum):
    """Where a bucket goes. A step the C++ path averages (native.Native.steer) never reaches the hook."""

    ALONE = "one rank: the gradients stay as they are, as on Horovod"
    OWN = "its fp32 average made in place on the training thread, as DDP's allreduce makes it (OwnAverages)"
    LAUNCHED = "its fp16 average launched here in launch order, finished on the worker (Exchanges.take)"
    SPARSE = "sparse gradients: averaged alone on the worker, as DDP's allreduce_hook averages them"
    WORKER = "through the pipeline on the worker: coded, uncoded as the plan says, or hierarchical"


def route(state: "TernGradState", buf: torch.Tensor, wire: Optional[str]) -> Path:
    """The path of the bucket whose buffer is `buf`, wire being the step's all-uncoded wire (uncoded_wire).

    OWN only for a dense fp32 bucket of a step none of whose earlier buckets went to the worker (to_worker): a
    step's collectives on the hook's group are then issued in launch order, its first buckets' on the training
    thread, then the worker's. Were the worker still exchanging an earlier bucket while the training thread
    started this one's allreduce, the ranks could issue the two in different orders, and gloo pairs collectives
    by that order (a model with fp64 and fp32 layers aborted: "Received data size doesn't match expected
    size"). LAUNCHED where the plan sends every bucket in fp16: a tensor that outgrew its scale is averaged
    again, a second collective a callback may not start, so the hook launches each average and the worker
    finishes the step's buckets after the last launch (the hand-over to the worker before the launch cost about
    0.2 ms on the step's critical path: docs/notes/tta-log.md, "The hook's fp16 plan at 1 Gbit/s")."""
    if state.world.size == 1:
        return Path.ALONE
    if (wire == "fp32" and state.process_group is None and not state.to_worker
            and buf.layout == torch.strided and buf.dtype == torch.float32):
        return Path.OWN
    if buf.layout != torch.strided:
        return Path.SPARSE
    return Path.LAUNCHED if wire == "fp16" else Path.WORKER


def terngrad_hook(state: "TernGradState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average with TernGrad (Wen et al., NeurIPS 2017), 2-bit stochastic
    ternary codes and a shared scaler per tensor. The state's worker thread exchanges the bucket (with the
    buckets before it that were under bucket_bytes) while backward goes on, and completes the returned future.
    A bucket of sparse gradients (nn.Embedding(sparse=True)) goes uncoded, averaged as DDP's allreduce_hook
    averages it (Exchanges.sparse). With one rank the gradients stay as they are, as on Horovod.

    Args:
        state: the model's TernGradState (register it with state.register(ddp_model)).
        bucket: DDP's bucket.
    Returns:
        A future of the bucket's average (DDP does not divide it by the world size).
    Raises (from the future, on every rank alike): NonFiniteGradientError naming the tensor and the rank,
    CollectiveTimeoutError where a rank never joins within timeout_s, PayloadMismatchError where the ranks'
    buckets differ, TernGradError under compiled autograd's Python reducer."""
    if not isinstance(bucket, dist.GradBucket):  # compiled autograd's Python reducer: (grad, param)
        raise TernGradError(PYTHON_REDUCER)
    state.connect()
    buf = bucket.buffer()
    wire = state.uncoded_wire()  # the plan in force: every bucket uncoded in this wire, or None
    path = route(state, buf, wire)
    if path is Path.ALONE:
        done = torch.futures.Future()
        done.set_result(buf)
        return done
    state.plain = state.plain and path is not Path.SPARSE and buf.dtype == torch.float32 \
        and buf.device.type == "cpu" and buf.is_contiguous()
    exchanges = state.exchanges
    try:
        if path is Path.OWN:
            if bucket.is_last():
                exchanges.order.end_step()
            return state.own.start(state, bucket)
        state.to_worker = True  # the step's later buckets follow this one to the worker (route)
        if path is Path.SPARSE:
            job = Job(bucket, [], [], sparse=state.kind(bucket.parameters()[0])[0])
        else:
            job = Job(bucket, *state.split(bucket))
        exchanges.take(job, launched=wire == "fp16")
    finally:
        if bucket.is_last():
            state.to_worker = False
    if job.last:  # the step's earlier buckets may have been averaged by the hook itself (to_worker)
        return state.own.after(job.future, value_or_raise)
    return job.future.then(value_or_raise)


PYTHON_REDUCER = (
    "hvd_terngrad: this DDP model runs compiled autograd's Python reducer (torch._dynamo.config.optimize_ddp = "
    "'python_reducer'), which hands a communication hook one gradient at a time and ignores its result, so "
    "TernGrad's hook cannot average it. Build the DDP model with optimize_ddp left at its default (or "
    "'ddp_optimizer'); torch.compile of the model works with the hook there.")
