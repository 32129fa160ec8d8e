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
A bucket of sparse gradients goes uncoded, alone, averaged as DDP's allreduce_hook averages it (Exchanges.sparse);
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
thread (OwnAverages.start; its non-finite check and its bound on a rank that never joins need no
collective in a callback). Only up to a step's first bucket of another kind (fp64, bf16, sparse): that one and
every later bucket of the step go to the worker, so the training thread never issues a collective while the
worker may still issue an earlier one (hook.route). Registered with TernGradState.register, those averages
run in C++ once auto has decided (csrc/ddp_hook.cpp, Native), where a Python hook's calls cost a step on a fast
link 5-6%; there they can travel in bf16 too (NATIVE_WIRES), as torch's bf16_compress_hook sends them. In fp16 a
tensor that outgrew its scale needs a second average (transports.uncoded), which a callback may not start: the
hook launches each bucket's fp16 average itself, in launch order, and the worker finishes the step's buckets
after the last launch (TernGradState.uncoded_wire).

Why not chain the collectives with `.then()` as DDP's own hooks do: a callback runs when its collective
completes, and buckets complete in a different order on different ranks, so the collectives a callback issues
pair up differently across ranks. On gloo that aborts the job ("Received data size doesn't match expected
size") or hangs it; torch's powerSGD_hook does exactly this on an emulated 1 Gbit/s cluster. `InLaunchOrder`
runs any DDP hook the safe way, and the benchmarks run PowerSGD through it.

The modules: state (TernGradState: configuration, process group, pipeline), hook (terngrad_hook, and route:
which path a bucket takes, in one place), exchanges (the worker's exchange through the pipeline), averages (the
fp32 averages the hook makes itself, and their non-finite protocol), native (the C++ path's Python side), serial
(the worker thread in launch order, and InLaunchOrder for any other hook).
"""
from hvd_terngrad.ddp.hook import terngrad_hook
from hvd_terngrad.ddp.native import NATIVE_WIRES
from hvd_terngrad.ddp.serial import InLaunchOrder, bf16_hook, in_launch_order
from hvd_terngrad.ddp.state import TernGradState

__all__ = ["NATIVE_WIRES", "InLaunchOrder", "TernGradState", "bf16_hook", "in_launch_order", "terngrad_hook"]
