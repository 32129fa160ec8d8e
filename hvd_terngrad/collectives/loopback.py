"""N ranks in one process: the collectives of a LoopbackWorld, exact as Horovod's and torch.distributed's.

    world = LoopbackWorld(4)
    comms = world.ranks()                 # one LoopbackCollectives per rank
    h = [c.allgather_async(p[r], "x") for r, c in enumerate(comms)]
    out = comms[0].wait(h[0], "the codes")

A collective is complete once every rank has started it (matched by name, and by how often each rank has used
that name). Results are those of the real collectives, bit for bit: concatenations in rank order, an exact Max,
sums of integers, and the float average in the order Open MPI's recursive doubling adds (horovod_average).
One thread drives every rank, so nothing can join while a rank waits: wait() on a collective some rank has not
started raises CollectiveTimeoutError at once, naming the ranks that never joined.
"""
from __future__ import annotations

import torch

from hvd_terngrad.errors import CollectiveTimeoutError, PayloadMismatchError
from hvd_terngrad.stats import StatsRecorder


class LoopbackWorld:
    """The shared state of N in-process ranks: the collectives in progress."""

    def __init__(self, size: int, timeout_s: float = 300.0):
        if size < 1:
            raise ValueError(f"a loopback world needs at least one rank, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._ops: dict[tuple[str, int], _Op] = {}
        self._uses: list[dict[str, int]] = [{} for _ in range(size)]  # per rank: name -> times started

    def ranks(self) -> list[LoopbackCollectives]:
        return [LoopbackCollectives(self, r) for r in range(self.size)]

    def join(self, rank: int, kind: str, name: str, tensor: torch.Tensor) -> _Op:
        k = self._uses[rank].get(name, 0)
        self._uses[rank][name] = k + 1
        op = self._ops.setdefault((name, k), _Op(kind, (name, k), self.size))
        if op.kind != kind:
            raise PayloadMismatchError(f"hvd_terngrad: collective {name!r}: rank {rank} started a {kind} where "
                                       f"another rank started a {op.kind}")
        op.inputs[rank] = tensor
        if len(op.inputs) == self.size:
            op.complete()
        return op

    def release(self, op: _Op, rank: int) -> None:
        op.waited.add(rank)
        if len(op.waited) == self.size:
            del self._ops[op.key]


class _Op:
    __slots__ = ("kind", "key", "size", "inputs", "result", "waited")

    def __init__(self, kind: str, key: tuple[str, int], size: int):
        self.kind, self.key, self.size = kind, key, size
        self.inputs: dict[int, torch.Tensor] = {}
        self.result: torch.Tensor | None = None
        self.waited: set[int] = set()

    def complete(self) -> None:
        xs = [self.inputs[r] for r in range(self.size)]
        if self.kind in ("max", "sum", "average") and len({tuple(x.shape) for x in xs}) > 1:
            raise PayloadMismatchError(f"hvd_terngrad: collective {self.key[0]!r}: the ranks' tensors differ in shape "
                                       f"({[tuple(x.shape) for x in xs]})")
        if self.kind == "max":
            self.result = torch.stack(xs).amax(dim=0)
        elif self.kind == "allgather":
            self.result = torch.cat(xs)
        elif self.kind == "sum":  # integers in fp16 or int8: exact in any order
            self.result = torch.stack(xs).sum(dim=0, dtype=xs[0].dtype)
        elif self.kind == "average":
            self.result = horovod_average(xs)
        elif self.kind == "alltoall":
            self.result = torch.stack([x.view(self.size, -1) for x in xs])  # [sender, receiver, slice]

    def output(self, rank: int) -> torch.Tensor:
        if self.kind == "alltoall":
            return self.result[:, rank].reshape(-1).clone()
        if self.kind in ("sum", "average"):  # in place, as Horovod's allreduce_async_
            return self.inputs[rank].copy_(self.result)
        return self.result.clone()


class LoopbackCollectives:
    """One rank of a LoopbackWorld, with the Collectives protocol."""

    def __init__(self, world: LoopbackWorld, rank: int, stats: StatsRecorder | None = None):
        self.world, self.rank, self.size = world, rank, world.size
        self.stats = stats
        self.timeout_s = world.timeout_s

    def max_allreduce_async(self, vec, name):
        return self.world.join(self.rank, "max", name, vec)

    def allgather_async(self, payload, name):
        return self.world.join(self.rank, "allgather", name, payload)

    def alltoall_async(self, tensor, name):
        if tensor.numel() % self.size:
            raise ValueError(f"alltoall {name!r}: {tensor.numel()} elements do not split in {self.size} slices")
        return self.world.join(self.rank, "alltoall", name, tensor)

    def sum_async_(self, tensor, name):
        return self.world.join(self.rank, "sum", name, tensor)

    int8_sum_async_ = sum_async_

    def average_async_(self, tensor, name):
        return self.world.join(self.rank, "average", name, tensor)

    @staticmethod
    def poll(handle: _Op) -> bool:
        return handle.result is not None

    def wait(self, handle: _Op, what: str) -> torch.Tensor:
        if handle.result is None:
            missing = [r for r in range(self.size) if r not in handle.inputs]
            raise CollectiveTimeoutError(
                f"hvd_terngrad: rank {self.rank} waited for {what} over a loopback of {self.size} ranks, and rank(s) "
                f"{missing} never joined it ({handle.key[0]!r}): in one process nothing can join while a rank waits")
        out = handle.output(self.rank)
        self.world.release(handle, self.rank)
        return out


def horovod_average(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Horovod's Average over MPI: a Sum allreduce, here in recursive doubling's order ((g0 + g1) + (g2 + g3))
    ..., then times 1/N in double. Open MPI takes that order for small payloads on a power-of-two number of
    ranks; other cases may differ from a real job in the last bit."""
    level = list(tensors)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return (level[0].double() * (1.0 / len(tensors))).to(tensors[0].dtype)


class MirrorCollectives:
    """One rank of `size` whose peers all send what it sends, answered at once in this process: a Max or an
    average is the rank's own vector, an allgather its payload `size` times, an alltoall its own slice for itself
    from every rank, a Sum `size` times its tensor. A transport of one collective runs on it as in a world of
    copies of this rank, to the bit, and costs what it would in encode and decode, with no link: transport="auto"
    times the codec so while its measured steps send fp32 (Pipeline.rehearse). A sharded transport's owners
    reply each for its own shard: a mirror answers for the others with this rank's reply, another shard's codes."""

    stats: StatsRecorder | None = None
    timeout_s = 0.0  # nothing is ever waited for

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def max_allreduce_async(self, vec, name):
        return vec.clone()

    def allgather_async(self, payload, name):
        return payload.repeat(self.size)

    def alltoall_async(self, tensor, name):
        return tensor.view(self.size, -1)[self.rank].repeat(self.size)

    def sum_async_(self, tensor, name):
        return tensor.mul_(self.size)

    int8_sum_async_ = sum_async_

    def average_async_(self, tensor, name):
        return tensor

    @staticmethod
    def poll(handle) -> bool:
        return True

    @staticmethod
    def wait(handle, what: str) -> torch.Tensor:
        return handle
